"""What a recipe run leaves in its ``output_dir``, written here and nowhere else: ``report.json`` (every measured
number, with the arguments), ``heldout_curve.json`` (the held-out points as they are measured, so a resumed run keeps
its curve), the plots, the model card and the summary table (:class:`RunReport`); plus the one-line messages for a
launch that does not match its preset. The file names are :mod:`respo_trl.run_files`', where their readers (the model
card, ``eval_math``) find them too."""

from __future__ import annotations

import json
import math
import os
import re
import time
from contextlib import contextmanager
from dataclasses import asdict

from ..batching import batch_plan
from ..checkpoints import latest_complete_checkpoint
from ..run_files import ANSWERS_FILE, CURVE_FILE, CURVES_FILE, REPORT_FILE


def log_launch(script_args, training_args, world: int, logger) -> None:
    """The paper's batch arithmetic in its own terms, or a warning when a preset runs on another process count."""
    if script_args.prompts_per_update is not None:  # the paper's presets
        batch = batch_plan(training_args, world)
        logger.info(
            f"the paper's batch arithmetic on {world} process(es): {batch['prompts_per_update']} prompts x "
            f"{training_args.num_generations} per update (per_device_train_batch_size "
            f"{training_args.per_device_train_batch_size} x gradient_accumulation_steps "
            f"{training_args.gradient_accumulation_steps}), N = {batch['updates_per_rollout']} updates per rollout batch "
            f"of {batch['prompts_per_generation']} prompts (steps_per_generation {training_args.steps_per_generation}), "
            f"{batch['total_updates']} updates",
            main_process_only=True,
        )
    elif script_args.expected_num_processes and script_args.expected_num_processes != world:
        logger.warning(
            f"this preset was sized for {script_args.expected_num_processes} processes "
            f"({script_args.accelerate_config or 'see docs/recipes.md'}) but runs on {world}: the global batch "
            "scales with the process count.",
            main_process_only=True,
        )


def new_report(script_args, training_args, model_name: str, model_info: dict, trainer, world: int, resume) -> dict:
    """The skeleton of ``report.json``: what ran, on what, where; the measured sections are filled in as they come."""
    return {
        "preset": script_args.preset,
        "output_dir": training_args.output_dir,
        "model": {"name": model_name, "parameters": sum(p.numel() for p in trainer.model.parameters()), **model_info},
        "task": script_args.dataset_name,
        "prompt_format": {"system_prompt": script_args.system_prompt, "prompt_template": script_args.prompt_template,
                          "strip_dapo_instruction": script_args.strip_dapo_instruction},  # fmt: skip
        "sampling": {"max_completion_length": training_args.max_completion_length,
                     "temperature": training_args.temperature},  # fmt: skip
        "seed": training_args.seed,
        "num_processes": world,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "resumed_from": None if not resume else str(resume),
        "heldout": {
            "dataset": script_args.eval_dataset_name or f"{script_args.dataset_name} (test split)",
            "n": 0, "mode": script_args.eval_mode, "before": None, "after": None,
        },  # fmt: skip
        "curve": [],
    }


def reuse_summary(buffer, training_args, global_step: int) -> dict | None:
    """Under epochs (``num_iterations > 1``): the rollout batches the buffer sampled, its refreshes (batches sampled
    before their cycle ended: ``respo_adaptive_reuse``'s stops and ``respo_min_ess``'s refreshes) and the passes
    served per batch (micro-batches served / ``steps_per_generation`` / batches: ``num_iterations`` when nothing
    stopped a batch early); None without reuse."""
    if training_args.num_iterations == 1:
        return None
    batches = buffer.generation_index
    passes = global_step * training_args.gradient_accumulation_steps / training_args.steps_per_generation
    return {
        "adaptive_reuse": training_args.respo_adaptive_reuse,
        "adaptive_threshold": training_args.respo_adaptive_threshold,
        "batches": batches,
        "refreshes": buffer.refreshes,
        "passes_per_batch": passes / batches if batches else None,
    }


def training_summary(trainer, train_result, training_args, world: int, sampled: bool) -> dict:
    """The ``training`` section of ``report.json``, from the trainer's log history."""
    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    throughput = {}
    for key in ("grad_throughput/pos", "grad_throughput/neg", "clip_grad_throughput/pos", "clip_grad_throughput/neg"):
        values = [h.get(f"starvation/{key}") for h in history]
        values = [v for v in values if v is not None and math.isfinite(v)]
        throughput[key] = sum(values) / len(values) if values else None
    step_size = {}  # mean grad_norm of each reuse pass relative to its batch's fresh pass (docs/method.md, section 6)
    for h in history:
        if "reuse/grad_norm_vs_fresh" in h and math.isfinite(h["reuse/grad_norm_vs_fresh"]):
            step_size.setdefault(f"pass_{int(h['reuse/pass'])}", []).append(h["reuse/grad_norm_vs_fresh"])
    return {
        "global_step": trainer.state.global_step,
        "generated_tokens": trainer.rollouts.generated_tokens,
        "num_iterations": training_args.num_iterations,
        "loss_type": training_args.loss_type,
        "learning_rate": training_args.learning_rate,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "mean_grad_throughput": throughput,
        "mean_grad_norm_vs_fresh": {k: sum(v) / len(v) for k, v in sorted(step_size.items())},
        "reuse": reuse_summary(trainer.rollouts, training_args, trainer.state.global_step),
        "train_runtime_s": train_result.metrics.get("train_runtime"),
        "batch": batch_plan(training_args, world, sampled_eval=sampled),
    }


def write_report(report: dict, trainer, script_args, training_args, model_args, model_name: str) -> None:
    """Plots, ``report.json`` and the model card (which reads the held-out numbers from it), on the main process."""
    from .plots import plot_run, reward_description

    out = training_args.output_dir
    report["args"] = {"script": asdict(script_args), "model": asdict(model_args)}
    report["plots"] = plot_run(
        trainer.state.log_history,
        report["curve"],
        out,
        title=f"{model_name}, {training_args.loss_type} R={training_args.num_iterations}, seed {training_args.seed}",
        accuracy_label=f"held-out accuracy, {script_args.eval_mode}",
        loss_name=training_args.loss_type,
        reward_label=reward_description(script_args.reward_funcs, training_args.reward_weights),
    )
    curves = os.path.join(out, CURVES_FILE)  # the model card's (respo_trl.hub.card writes it)
    if os.path.isfile(curves):
        report["plots"].append(curves)
    with open(os.path.join(out, REPORT_FILE), "w") as f:
        json.dump(report, f, indent=1, default=str)
    trainer.create_model_card(dataset_name=script_args.dataset_name)  # now with report.json's held-out numbers


class RunReport:
    """``report.json`` of one run and the files that go with it: the recipe records what it measures here, and this
    object writes it (the curve file as points come, everything else at the end, on the main process)."""

    def __init__(self, script_args, training_args, model_args, model_name: str, model_info: dict, trainer, world: int,
                 resume, is_main: bool):  # fmt: skip
        self.script_args, self.training_args, self.model_args = script_args, training_args, model_args
        self.model_name, self.trainer, self.world, self.is_main = model_name, trainer, world, is_main
        self.data = new_report(script_args, training_args, model_name, model_info, trainer, world, resume)
        self.curve_file = os.path.join(training_args.output_dir, CURVE_FILE)
        self.answers_file = os.path.join(training_args.output_dir, ANSWERS_FILE)
        self.seconds = {"warm_start": 0.0, "train": 0.0, "heldout_eval": 0.0}

    @property
    def curve(self) -> list[dict]:
        return self.data["curve"]

    def record_inputs(self, train_dataset, heldout, dropped: int, warm: dict) -> None:
        """The data the run trained and is measured on, and the warm start."""
        self.data["data"] = {"train_rows": len(train_dataset), "max_prompt_length": self.script_args.max_prompt_length,
                             "dropped_long_prompts": dropped}  # fmt: skip
        self.data["heldout"]["n"] = 0 if heldout is None else len(heldout)
        self.data["example_prompt"] = (heldout if heldout is not None else train_dataset)[0]["prompt"]  # card's Use it
        self.data["warm_start"] = {key: warm[key] for key in ("steps", "final_loss", "demonstration_accuracy", "shipped")}
        self.seconds["warm_start"] = warm["seconds"]

    def resume_curve(self, resume) -> None:
        """The held-out points (and starting accuracy) the interrupted run measured, up to the checkpoint this run
        resumes from; nothing if the file is missing (a run of respo_trl < 0.3, or one without held-out points)."""
        if not os.path.isfile(self.curve_file):
            return
        if resume is True:  # the one the trainer resumes from (it reports what it skipped)
            trainer = self.trainer
            checkpoint = latest_complete_checkpoint(trainer.args.output_dir, trainer.accelerator.num_processes, lambda _: None)
        else:
            checkpoint = str(resume)
        match = re.search(r"checkpoint-(\d+)$", os.path.normpath(checkpoint))
        step = int(match.group(1)) if match else None
        with open(self.curve_file) as f:
            saved = json.load(f)
        self.data["curve"] = [p for p in saved.get("curve", []) if step is None or p["step"] <= step]
        self.data["heldout"].update(before=saved.get("before"), before_detail=saved.get("before_detail"))

    def add_point(self, point: dict, answers: list[dict] | None = None) -> None:
        """Append a held-out point and, on the main process, rewrite the curve file whole (then renamed into place),
        so an interrupted run's curve survives for its resume; its answers, if given, go to :data:`ANSWERS_FILE`."""
        self.curve.append(point)
        if not self.is_main:
            return
        os.makedirs(os.path.dirname(self.curve_file) or ".", exist_ok=True)
        if answers is not None:
            with open(self.answers_file, "a") as f:
                f.write(json.dumps({"step": point["step"], "answers": answers}) + "\n")
        payload = {"before": self.data["heldout"].get("before"), "before_detail": self.data["heldout"].get("before_detail"),
                   "curve": self.curve}  # fmt: skip
        tmp = f"{self.curve_file}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(payload, f, default=str)
        os.replace(tmp, self.curve_file)

    def before(self, result: dict) -> None:
        answers = result.pop("answers", None)
        self.data["heldout"]["before"], self.data["heldout"]["before_detail"] = result["accuracy"], result
        point = {"step": 0, "generated_tokens": 0, "accuracy": result["accuracy"], "n": result["n"]}
        if "mean_answer_tokens" in result:
            point["mean_answer_tokens"] = result["mean_answer_tokens"]
        self.add_point(point, answers)

    def after(self, result: dict, point: dict | None, answers: list[dict] | None = None) -> None:
        if point is not None:
            self.add_point(point, answers)
        self.data["heldout"]["after"], self.data["heldout"]["after_detail"] = result["accuracy"], result

    def best(self, result: dict | None) -> None:
        if result is not None:
            self.data["heldout"]["best"] = result

    @contextmanager
    def timed(self, phase: str):
        """Add the wall time of the block to ``time_s[phase]``."""
        start = time.time()
        try:
            yield
        finally:
            self.seconds[phase] += time.time() - start

    def finish(self, train_result, sampled: bool, started: float) -> dict:
        """The training summary and times; then, on the main process, plots, ``report.json``, the model card and the
        summary table."""
        from .heldout import print_summary

        self.data["training"] = training_summary(self.trainer, train_result, self.training_args, self.world, sampled)
        self.data["time_s"] = {**self.seconds, "total": time.time() - started}
        if self.is_main:
            write_report(self.data, self.trainer, self.script_args, self.training_args, self.model_args,
                         self.model_name)  # fmt: skip
            print_summary(self.data)
        return self.data
