"""Train Qwen3 with ReSPO (reshaped sequence policy optimisation) on verifiable math rewards, with rollout reuse.

What it does, top to bottom: parse a preset (``--preset NAME`` or a YAML ``--config``) plus command-line overrides
with TRL's ``TrlParser`` into script arguments, a ``ReSPOConfig`` and a ``trl.ModelConfig``, and check everything that
can be checked before compute is spent; build the model (dense or MoE), tokenizer, datasets and rewards
(``trl.rewards.accuracy_reward``, graded by math-verify, plus a ``\\boxed{}`` format reward); warm-start a model built
here; measure held-out accuracy; train with ``ReSPOTrainer``; measure again; save, write ``report.json``, plots and the
model card into ``output_dir``, and push to the Hub with ``--push_to_hub``. Every TRL/transformers argument keeps its
usual meaning. The machinery (presets, batch arithmetic, data, evaluation, report) is in ``respo_trl.recipe``.

With no arguments it runs the embedded default, ``--preset tiny-cpu``: on a CPU, with nothing downloaded, a tiny Qwen3
and a character tokenizer are built locally, warm-started by a short supervised fine-tune on a built-in multi-step
arithmetic task (``respo_trl.demo.tasks``), then trained with ReSPO under 4x rollout reuse: about 5 minutes on 2 idle
CPU cores, greedy held-out accuracy 15-23% -> 89-97% over seeds 0-2 (final checkpoint; the numbers depend on the CPU
type, docs/recipes.md has them).

Launch lines (presets in recipes/configs/, launch configs in recipes/accelerate/, details in docs/recipes.md):

    # CPU, nothing downloaded (the embedded default); the same with overrides
    accelerate launch recipes/qwen3_respo.py
    python recipes/qwen3_respo.py --seed 1 --output_dir outputs/tiny-seed1

    # 1 GPU: Qwen3-0.6B, vLLM colocated
    accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 1 recipes/qwen3_respo.py \\
        --preset qwen3-0.6b-epochs4

    # 8 GPUs on one node: Qwen3-4B with DeepSpeed ZeRO-2; Qwen3-8B with ZeRO-3 or FSDP2
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/qwen3_respo.py --preset qwen3-4b-epochs4
    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/qwen3_respo.py --preset qwen3-8b-epochs4

    # multi-node, 2 x 8 GPUs: run on every node with its rank (output_dir on a filesystem all nodes share)
    accelerate launch --config_file recipes/accelerate/multinode_zero3.yaml \\
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR --main_process_port 29500 \\
        recipes/qwen3_respo.py --preset qwen3-30b-a3b-epochs4

    # resume an interrupted run (the rollout-reuse buffer is restored from the checkpoint)
    accelerate launch ... recipes/qwen3_respo.py --preset qwen3-4b-epochs4 --resume_from_checkpoint true

    # the ReSPO paper's runs (Base models, staleness N = 8/16/32, 1,024 updates) on 8 GPUs; a baseline is one flag
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/qwen3_respo.py \\
        --preset paper-qwen3-1.7b-base --updates_per_rollout 32                 # ReSPO, N = 32
    accelerate launch --config_file recipes/accelerate/zero2.yaml recipes/qwen3_respo.py \\
        --preset paper-qwen3-1.7b-base --updates_per_rollout 32 --algorithm gspo   # or grpo, vespo
    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/qwen3_respo.py \\
        --preset paper-qwen3-30b-a3b-base --updates_per_rollout 16

Bad input (an unknown flag, a preset value out of range, a missing model path or dataset column, nothing to resume)
ends with one line naming what to change and exit status 2, before any model loads; ``RESPO_TRACEBACK=1`` shows the
traceback. Ctrl-C says how to resume.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = RECIPES_DIR / "configs"
if __package__ in (None, "") and str(RECIPES_DIR.parent) not in sys.path:
    sys.path.insert(0, str(RECIPES_DIR.parent))  # run from a checkout without `pip install -e .`
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from respo_trl import recipe as support  # noqa: E402
from respo_trl.recipe import (  # noqa: E402, F401  (also re-exported: tests and benchmarks call them here)
    RecipeArguments,
    RecipeError,
    batch_plan,
    build_datasets,
    build_reward,
    build_tiny,
    check_batch_arithmetic,
    drop_long_prompts,
    pick_cpu_threads,
    validate_args,
    warm_start,
)

CURVE_FILE = "heldout_curve.json"  # every held-out point as it is measured: a resumed run keeps the curve


def available_presets() -> list[str]:
    return support.available_presets(CONFIGS_DIR)


def parse_args(argv: list[str] | None = None, num_processes: int | None = None):
    """(script_args, training_args, model_args): the preset (default: tiny-cpu) and overrides, checked."""
    return support.parse_args(argv, CONFIGS_DIR, num_processes=num_processes)


def main(script_args: RecipeArguments, training_args, model_args) -> dict:
    start = time.time()
    import torch
    from accelerate import PartialState
    from accelerate.logging import get_logger
    from tqdm.auto import tqdm
    from transformers import ProgressCallback, set_seed
    from trl import get_peft_config

    from respo_trl import ReSPOTrainer
    from respo_trl.rewards import ACCURACY_REWARDS, probe_rewards, reward_name
    from respo_trl.grading import accuracy_scores as grade

    logger = get_logger(__name__)
    state = PartialState()
    world = state.num_processes
    pick_cpu_threads(training_args, script_args.tiny_model is not None, logger)
    support.log_launch(script_args, training_args, world, logger)
    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True  # the latest complete checkpoint in output_dir
    set_seed(training_args.seed)

    # -- 1. rewards, model, data: cheap to build, checked before any weights load -------------------------------------
    reward_funcs = [build_reward(name, script_args, training_args) for name in script_args.reward_funcs]
    accuracy_fn = next((f for n, f in zip(script_args.reward_funcs, reward_funcs) if n in ACCURACY_REWARDS), None)
    if script_args.tiny_model:
        model, tokenizer = build_tiny(script_args, seed=training_args.seed)
        model_info = support.configure_moe(model.config, training_args, logger)
        model_name = model.config._name_or_path
    else:  # Hub or local weights: only the config is read here; the trainer loads the weights
        model_info = support.configure_moe(support.inspect_model(model_args, training_args), training_args, logger)
        init_kwargs = {"revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code,
                       "attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype}  # fmt: skip
        training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}
        model, tokenizer, model_name = model_args.model_name_or_path, None, model_args.model_name_or_path
    with state.main_process_first():
        train_dataset, heldout = build_datasets(script_args)
        dropped = 0
        if script_args.max_prompt_length:
            length_tokenizer = tokenizer or support.load_tokenizer(model_args, training_args)
            train_dataset, dropped = drop_long_prompts(
                train_dataset, length_tokenizer, script_args.max_prompt_length, training_args.chat_template_kwargs
            )
            if len(train_dataset) == 0:
                raise RecipeError(f"every training prompt is longer than --max_prompt_length {script_args.max_prompt_length}")
            logger.info(f"dropped {dropped} training prompts longer than {script_args.max_prompt_length} tokens",
                        main_process_only=True)  # fmt: skip
    if script_args.eval_mode != "none" and heldout is None:
        raise RecipeError("no held-out set: set --eval_dataset_name (e.g. HuggingFaceH4/MATH-500) or --eval_mode none")
    probe = train_dataset.select(range(min(8, len(train_dataset)))).to_dict()
    probe_rewards(reward_funcs, probe, "solution", accuracy_funcs=[accuracy_fn] if accuracy_fn else [])
    if heldout is not None and accuracy_fn is not None:
        probe_rewards([accuracy_fn], heldout.select(range(min(8, len(heldout)))).to_dict(), "solution",
                      accuracy_funcs=[accuracy_fn])  # fmt: skip

    # -- 2. warm start: a short supervised fine-tune on reference completions (skipped when resuming) ----------------
    warm_losses, warm_start_s, demo_accuracy = [], 0.0, None
    if script_args.warmstart_steps and not resume:
        if "completion" not in train_dataset.column_names:
            raise RecipeError("--warmstart_steps needs a 'completion' column of reference answers in the dataset")
        if isinstance(model, str):
            raise RecipeError("--warmstart_steps is for a model built here (--tiny_model); start from an SFT checkpoint")
        t0 = time.time()
        bar = tqdm(total=script_args.warmstart_steps, desc="warm start (SFT)", disable=not state.is_main_process)

        def on_step(step, loss):
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        model.to(training_args.device)
        warm_losses = warm_start(model, tokenizer, train_dataset, script_args, seed=training_args.seed, on_step=on_step)
        bar.close()
        warm_start_s = time.time() - t0
        if accuracy_fn is not None:  # how good the demonstrations the warm start imitated are
            sample = train_dataset.select(range(min(500, len(train_dataset))))
            demo_accuracy = sum(grade(sample["completion"], sample["solution"], accuracy_fn)) / len(sample)
    if "completion" in train_dataset.column_names:
        train_dataset = train_dataset.remove_columns("completion")  # RL sees prompts and answers only

    # -- 3. the trainer, and held-out accuracy as a function of the trainer's current weights ---------------------------
    sampled = script_args.eval_mode == "sampled"
    trainer = ReSPOTrainer(
        model=model, reward_funcs=reward_funcs, args=training_args, train_dataset=train_dataset,
        eval_dataset=heldout if sampled or training_args.eval_strategy != "no" else None, processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )  # fmt: skip
    eval_tokens = script_args.eval_max_new_tokens or training_args.max_completion_length
    curve_set = heldout
    if heldout is not None and script_args.heldout_curve_size:
        curve_set = heldout.select(range(min(script_args.heldout_curve_size, len(heldout))))

    def heldout_accuracy(dataset):
        if sampled:
            return support.sampled_accuracy(trainer, dataset, reward_name(accuracy_fn))
        return support.greedy_accuracy(trainer, dataset, eval_tokens, script_args.eval_batch_size, accuracy_fn)

    best_dir = os.path.join(training_args.output_dir, support.BEST_HELDOUT_DIR)
    best = {"step": None, "accuracy": -1.0}

    def curve_point(step, dataset=curve_set):
        result = heldout_accuracy(dataset)
        if script_args.keep_best_heldout and step > 0 and result["accuracy"] > best["accuracy"]:
            trainer.save_model(best_dir)  # every process takes part, as in any save
            best.update(step=step, accuracy=result["accuracy"], n=result["n"])
        point = {"step": step, "generated_tokens": trainer.rollouts.generated_tokens, "accuracy": result["accuracy"],
                 "n": result["n"]}  # fmt: skip
        return point

    report = support.new_report(script_args, training_args, model_name, model_info, trainer, world, resume)
    report["data"] = {"train_rows": len(train_dataset), "max_prompt_length": script_args.max_prompt_length,
                      "dropped_long_prompts": dropped}  # fmt: skip
    report["heldout"]["n"] = 0 if heldout is None else len(heldout)
    report["example_prompt"] = (heldout if heldout is not None else train_dataset)[0]["prompt"]  # the card's "Use it"
    report["warm_start"] = {"steps": len(warm_losses), "final_loss": warm_losses[-1] if warm_losses else None,
                            "demonstration_accuracy": demo_accuracy}  # fmt: skip
    curve_file = os.path.join(training_args.output_dir, CURVE_FILE)
    if resume:  # the points the interrupted run measured, up to the checkpoint it resumes from
        saved = support.resumed_curve(curve_file, trainer, resume)
        report["curve"] = saved.get("curve", [])
        report["heldout"].update(before=saved.get("before"), before_detail=saved.get("before_detail"))
    if script_args.compact_progress and not training_args.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
    every = script_args.heldout_eval_steps if script_args.eval_mode == "greedy" else 0
    for callback in support.make_callbacks(report, curve_point, every, curve_file if state.is_main_process else None):
        trainer.add_callback(callback)

    # -- 4. held-out accuracy before RL (a resumed run kept the first run's), RL, held-out accuracy after ------------
    t0 = time.time()
    if script_args.eval_mode != "none" and not resume:
        before = heldout_accuracy(heldout)
        report["heldout"]["before"], report["heldout"]["before_detail"] = before["accuracy"], before
        support.add_curve_point(report, {"step": 0, "generated_tokens": 0, "accuracy": before["accuracy"],
                                         "n": before["n"]}, curve_file if state.is_main_process else None)  # fmt: skip
        trainer.accelerator.print(f"held-out accuracy before RL: {100 * before['accuracy']:.1f}% (n={before['n']})")
    eval_s = time.time() - t0
    t0 = time.time()
    try:
        train_result = trainer.train(resume_from_checkpoint=resume)
    except KeyboardInterrupt:
        raise support.Interrupted(trainer) from None
    train_s = time.time() - t0
    t0 = time.time()
    if script_args.eval_mode != "none":
        if sampled:
            logged = support.eval_curve_from_logs(trainer.state.log_history, reward_name(accuracy_fn))
            report["curve"].extend(point for point in logged if point["step"] > 0)
        last = report["curve"][-1] if report["curve"] else None
        if sampled and last is not None and last["step"] == trainer.state.global_step and last["step"] > 0:
            after = {"accuracy": last["accuracy"], "n": len(heldout), "from": "last eval_strategy evaluation"}
        else:
            after = heldout_accuracy(heldout)
            support.add_curve_point(report, {"step": trainer.state.global_step, "accuracy": after["accuracy"],
                                             "generated_tokens": trainer.rollouts.generated_tokens, "n": after["n"]},
                                    curve_file if state.is_main_process else None)  # fmt: skip
        report["heldout"]["after"], report["heldout"]["after_detail"] = after["accuracy"], after
    eval_s += time.time() - t0

    # -- 5. save (the best in-training checkpoint measured on the whole held-out set too), report, push --------------
    trainer.save_model(training_args.output_dir)
    if best["step"] is not None and script_args.eval_mode != "none":
        final = report["curve"][-1]
        if final.get("n") == best.get("n") and final["accuracy"] >= best["accuracy"]:
            best.update(step=final["step"], accuracy=final["accuracy"])  # the final checkpoint is the best one
        t0 = time.time()
        report["heldout"]["best"] = support.best_checkpoint_accuracy(
            trainer, best, best_dir, training_args.output_dir, heldout_accuracy, heldout
        )
        eval_s += time.time() - t0
    trainer.save_state()  # trainer_state.json: the full log history the plots are drawn from
    report["training"] = support.training_summary(trainer, train_result, training_args, world, sampled)
    report["time_s"] = {"warm_start": warm_start_s, "train": train_s, "heldout_eval": eval_s,
                        "total": time.time() - start}  # fmt: skip
    if trainer.accelerator.is_main_process:
        support.write_report(report, trainer, script_args, training_args, model_args, model_name)
        support.print_summary(report)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"pushed to https://huggingface.co/{trainer.hub_model_id}")
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return report


def cli(argv: list[str] | None = None) -> dict | None:
    """The command line: parse and check, then train (or print the batch plan with ``--dry_run P``)."""
    with support.one_line_errors(parsing=True):
        parsed = parse_args(argv)
    if parsed[0].dry_run:
        print(batch_plan(*parsed))
        return None
    with support.one_line_errors(output_dir=parsed[1].output_dir):
        return main(*parsed)


if __name__ == "__main__":
    cli()
