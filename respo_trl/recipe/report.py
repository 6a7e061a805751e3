"""What a recipe run leaves in its ``output_dir``: ``report.json`` (every measured number, with the arguments), the
plots, and the summary table; plus the one-line messages for a launch that does not match its preset."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict

from .args import check_batch_arithmetic, reward_description


def log_launch(script_args, training_args, world: int, logger) -> None:
    """The paper's batch arithmetic in its own terms, or a warning when a preset runs on another process count."""
    paper = script_args.prompts_per_update is not None or script_args.updates_per_rollout is not None
    if paper:
        batch = check_batch_arithmetic(training_args, world)
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
        "respo_reuse": training_args.respo_reuse,
        "loss_type": training_args.loss_type,
        "learning_rate": training_args.learning_rate,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "mean_grad_throughput": throughput,
        "mean_grad_norm_vs_fresh": {k: sum(v) / len(v) for k, v in sorted(step_size.items())},
        "train_runtime_s": train_result.metrics.get("train_runtime"),
        "batch": check_batch_arithmetic(training_args, world, sampled_eval=sampled),
    }


def write_report(report: dict, trainer, script_args, training_args, model_args, model_name: str) -> None:
    """Plots, ``report.json`` and the model card (which reads the held-out numbers from it), on the main process."""
    from .plots import plot_run

    out = training_args.output_dir
    report["args"] = {"script": asdict(script_args), "model": asdict(model_args)}
    report["plots"] = plot_run(
        trainer.state.log_history,
        report["curve"],
        out,
        title=f"{model_name}, {training_args.loss_type} R={training_args.respo_reuse}, seed {training_args.seed}",
        accuracy_label=f"held-out accuracy, {script_args.eval_mode}",
        loss_name=training_args.loss_type,
        reward_label=reward_description(script_args, training_args),
    )
    curves = os.path.join(out, "training_curves.png")  # the model card's (respo_trl.hub.card)
    if os.path.isfile(curves):
        report["plots"].append(curves)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    trainer.create_model_card(dataset_name=script_args.dataset_name)  # now with report.json's held-out numbers
