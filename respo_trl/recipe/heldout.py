"""Held-out accuracy during and after a recipe run (:class:`HeldoutEvaluator`, with the best in-training checkpoint),
the compact progress bar, and the run's summary table."""

from __future__ import annotations

import os

# Where keep_best_heldout saves the best in-training weights: a `checkpoint-*` name, so that transformers' push of
# output_dir leaves it out (its ignore patterns) and the Hub gets exactly one model; not `checkpoint-<digits>`, so
# neither transformers' checkpoint rotation nor a resume ever takes it for a training checkpoint.
BEST_HELDOUT_DIR = "checkpoint-best-heldout"


def greedy_accuracy(trainer, dataset, max_new_tokens: int, batch_size: int, reward_fn, keep_answers: bool = False) -> dict:
    """Greedy held-out accuracy graded by the training accuracy reward, sharded over processes and summed; with
    ``keep_answers``, every answer too (``answers``: completion, grade, tokens), to see *how* a policy fails."""
    import torch
    from trl.models import unwrap_model_for_generation

    from respo_trl.grading import accuracy_scores

    from .generation import generate

    accelerator = trainer.accelerator
    shard = dataset.select(range(accelerator.process_index, len(dataset), accelerator.num_processes))
    with unwrap_model_for_generation(trainer.model_wrapped, accelerator) as model:
        texts, lengths = generate(
            model, trainer.processing_class, shard["prompt"], max_new_tokens=max_new_tokens, batch_size=batch_size
        )
    correct = accuracy_scores(texts, shard["solution"], reward_fn) if texts else []
    local = torch.tensor([sum(correct), len(correct), sum(lengths)], dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(local, "sum").tolist()
    result = {
        "accuracy": total[0] / max(total[1], 1),
        "n": int(total[1]),
        "mean_answer_tokens": total[2] / max(total[1], 1),
        "examples": [{"prompt": p[-1]["content"], "completion": t} for p, t in zip(shard["prompt"][:3], texts[:3])],
    }
    if keep_answers:  # every problem's answer, in the dataset's order (shards interleave by process index)
        from accelerate.utils import gather_object

        rows = [(accelerator.process_index + i * accelerator.num_processes, t, float(c), n)
                for i, (t, c, n) in enumerate(zip(texts, correct, lengths))]  # fmt: skip
        rows = sorted(gather_object(rows) if accelerator.num_processes > 1 else rows)
        result["answers"] = [{"completion": t, "correct": c, "tokens": n} for _, t, c, n in rows]
    return result


def sampled_accuracy(trainer, dataset, accuracy_name: str) -> dict:
    """Mean accuracy reward of ``num_generations_eval`` samples per problem, from ``trainer.evaluate()``."""
    metrics = trainer.evaluate(eval_dataset=dataset)
    key = f"eval_rewards/{accuracy_name}/mean"
    if key not in metrics:
        raise RuntimeError(f"trainer.evaluate() returned no {key!r}; got {sorted(metrics)}")
    return {"accuracy": metrics[key], "n": len(dataset), "samples_per_problem": trainer.num_generations_eval}


def eval_curve_from_logs(log_history: list[dict], accuracy_name: str) -> list[dict]:
    """Sampled mode: the ``eval_strategy`` evaluations as (step, generated tokens, accuracy) points."""
    key, points, tokens = f"eval_rewards/{accuracy_name}/mean", [], 0
    for log in log_history:
        tokens = log.get("reuse/generated_tokens", tokens)
        if key in log:
            points.append({"step": log["step"], "generated_tokens": int(tokens), "accuracy": log[key]})
    return points


class HeldoutEvaluator:
    """Held-out accuracy as a function of the trainer's current weights (``eval_mode``: greedy answers graded by the
    run's accuracy reward, or ``trainer.evaluate()``'s sampled mean), its in-training points on ``heldout_curve_size``
    problems every ``heldout_eval_steps`` steps, and, with ``keep_best_heldout``, the best of those points saved and
    measured again on the whole set at the end."""

    def __init__(self, trainer, script_args, training_args, heldout, accuracy_fn):
        self.trainer, self.heldout, self.accuracy_fn = trainer, heldout, accuracy_fn
        self.mode = script_args.eval_mode
        self.sampled = self.mode == "sampled"
        self.max_new_tokens = script_args.eval_max_new_tokens or training_args.max_completion_length
        self.batch_size = script_args.eval_batch_size
        self.curve_set = heldout
        if heldout is not None and script_args.heldout_curve_size:
            self.curve_set = heldout.select(range(min(script_args.heldout_curve_size, len(heldout))))
        self.every = script_args.heldout_eval_steps if self.mode == "greedy" else 0
        self.every_tokens = (script_args.heldout_eval_tokens or 0) if self.mode == "greedy" else 0
        self.keep_best = script_args.keep_best_heldout
        self.best_dir = os.path.join(training_args.output_dir, BEST_HELDOUT_DIR)
        self.best = {"step": None, "accuracy": -1.0}

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def measure(self, dataset=None, keep_answers: bool = False) -> dict:
        """Accuracy of the current weights on ``dataset`` (default: the whole held-out set); greedy mode with
        ``keep_answers`` also returns every answer (``answers``)."""
        from respo_trl.rewards import reward_name

        dataset = self.heldout if dataset is None else dataset
        if self.sampled:
            return sampled_accuracy(self.trainer, dataset, reward_name(self.accuracy_fn))
        return greedy_accuracy(self.trainer, dataset, self.max_new_tokens, self.batch_size, self.accuracy_fn,
                               keep_answers=keep_answers)  # fmt: skip

    def curve_point(self, step: int) -> tuple[dict, list[dict] | None]:
        """An in-training point on the curve's problems and its answers (greedy mode; None when sampled); the weights
        are saved when it is the best so far."""
        result = self.measure(self.curve_set, keep_answers=True)
        if self.keep_best and step > 0 and result["accuracy"] > self.best["accuracy"]:
            self.trainer.save_model(self.best_dir)  # every process takes part, as in any save
            self.best.update(step=step, accuracy=result["accuracy"], n=result["n"])
        point = {"step": step, "generated_tokens": self.trainer.rollouts.generated_tokens,
                 "accuracy": result["accuracy"], "n": result["n"]}  # fmt: skip
        if "mean_answer_tokens" in result:
            point["mean_answer_tokens"] = result["mean_answer_tokens"]
        return point, result.get("answers")

    def after_training(self, curve: list[dict]) -> tuple[dict, dict | None]:
        """(accuracy after RL, the curve point to add or None, its answers or None): sampled mode reuses an
        ``eval_strategy`` evaluation of the last step when there is one; otherwise the whole set is measured."""
        from respo_trl.rewards import reward_name

        trainer = self.trainer
        if self.sampled:
            logged = eval_curve_from_logs(trainer.state.log_history, reward_name(self.accuracy_fn))
            curve.extend(point for point in logged if point["step"] > 0)
        last = curve[-1] if curve else None
        if self.sampled and last is not None and last["step"] == trainer.state.global_step and last["step"] > 0:
            return {"accuracy": last["accuracy"], "n": len(self.heldout), "from": "last eval_strategy evaluation"}, None, None
        after = self.measure(keep_answers=True)
        answers = after.pop("answers", None)
        point = {"step": trainer.state.global_step, "accuracy": after["accuracy"],
                 "generated_tokens": trainer.rollouts.generated_tokens, "n": after["n"]}  # fmt: skip
        if "mean_answer_tokens" in after:
            point["mean_answer_tokens"] = after["mean_answer_tokens"]
        return after, point, answers

    def best_checkpoint(self, curve: list[dict], final_dir: str) -> dict | None:
        """The best in-training checkpoint measured on the whole held-out set (None without in-training points)."""
        if self.best["step"] is None:
            return None
        final_point = curve[-1]
        if final_point.get("n") == self.best.get("n") and final_point["accuracy"] >= self.best["accuracy"]:
            self.best.update(step=final_point["step"], accuracy=final_point["accuracy"])  # the final one is the best
        return best_checkpoint_accuracy(self.trainer, self.best, self.best_dir, final_dir, self.measure, self.heldout)


def best_checkpoint_accuracy(trainer, best: dict, best_dir: str, final_dir: str, measure, heldout) -> dict:
    """Whole-held-out-set accuracy of the best in-training checkpoint (chosen on the curve's subset), then the final
    weights are put back (a later push sends the final model)."""
    from safetensors.torch import load_file

    def load(folder):
        model = trainer.accelerator.unwrap_model(trainer.model)
        state = load_file(os.path.join(folder, "model.safetensors"), device=str(trainer.accelerator.device))
        model.load_state_dict(state, strict=False)

    if best["step"] == trainer.state.global_step or not os.path.isdir(best_dir):
        return {"step": trainer.state.global_step, "accuracy": None, "is_final": True, "path": final_dir}
    load(best_dir)
    result = measure(heldout)
    load(final_dir)
    return {
        "step": best["step"],
        "accuracy": result["accuracy"],
        "n": result["n"],
        "subset_accuracy": best["accuracy"],
        "subset_n": best.get("n"),
        "is_final": False,
        "path": best_dir,
    }


def token_budget(trainer, max_generated_tokens: int):
    """A callback that stops training once ``max_generated_tokens`` completion tokens were sampled, at the first step
    after which the next micro-batch would sample a new batch (``ReSPOTrainer.samples_next``: a cycle's end, or a
    drift check that stops the batch), so the budget never cuts a batch short and overshoots by less than a batch."""
    from transformers import TrainerCallback

    class TokenBudget(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if trainer.rollouts.generated_tokens >= max_generated_tokens and trainer.samples_next():
                control.should_training_stop = True

    return TokenBudget()


def make_callbacks(report, heldout: HeldoutEvaluator, save_at_steps=(), max_generated_tokens=None):
    """A compact progress bar; when ``heldout.every`` > 0 (steps) or ``heldout.every_tokens`` > 0 (sampled tokens), a
    held-out accuracy point at that interval, recorded in the run's report
    (:class:`~respo_trl.recipe.report.RunReport`) as it is measured; a checkpoint after each of ``save_at_steps``
    besides the save strategy's; with ``max_generated_tokens``, the stop at that sampling budget."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class CompactProgress(TrainerCallback):
        """One progress bar with the numbers that matter, instead of a log dict per step."""

        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="ReSPO", dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is None or not logs:
                return
            postfix = dict(self.bar.postfix and [kv.split("=", 1) for kv in self.bar.postfix.split(", ")] or [])
            if "reward" in logs:
                postfix["reward"] = f"{logs['reward']:.2f}"
            if "reuse/generated_tokens" in logs:
                postfix["tokens"] = f"{logs['reuse/generated_tokens'] / 1e3:.0f}k"
            if report.curve:
                postfix["held-out"] = f"{100 * report.curve[-1]['accuracy']:.1f}%"
            self.bar.set_postfix(postfix, refresh=False)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    class HeldoutCurve(TrainerCallback):
        """Held-out accuracy every ``every`` optimizer steps or ``every_tokens`` sampled tokens, against generated
        tokens (all processes take part); none at the run's last step, which the final measurement covers."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps or control.should_training_stop:
                return
            if heldout.every_tokens:
                last = report.curve[-1]["generated_tokens"] if report.curve else 0
                due = heldout.trainer.rollouts.generated_tokens // heldout.every_tokens > last // heldout.every_tokens
            else:
                due = bool(heldout.every) and state.global_step % heldout.every == 0
            if due:
                report.add_point(*heldout.curve_point(state.global_step))

    class SaveAt(TrainerCallback):
        """The Trainer's own save (weights, optimizer, rollout buffer: resumable) after the listed steps."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in save_at_steps:
                control.should_save = True

    budget = [token_budget(heldout.trainer, max_generated_tokens)] if max_generated_tokens else []  # before the curve
    return [CompactProgress(), *budget, HeldoutCurve(), *([SaveAt()] if save_at_steps else [])]


def reuse_rows(reuse: dict | None) -> list[tuple[str, str]]:
    """The summary table's rows for ``report["training"]["reuse"]`` (none without reuse)."""
    if not reuse:
        return []
    passes = reuse["passes_per_batch"]
    stop = f" ({reuse['adaptive_reuse']} {reuse['adaptive_threshold']:g})" if reuse.get("adaptive_reuse") else ""
    return [
        ("rollout batches sampled", str(reuse["batches"])),
        ("refreshes (sampled before a cycle ended)", f"{reuse['refreshes']}{stop}"),
        ("passes per batch", "n/a" if passes is None else f"{passes:.2f}"),
    ]


def print_summary(report: dict) -> None:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    before, after = report["heldout"]["before"], report["heldout"]["after"]
    delta = None if before is None or after is None else 100 * (after - before)
    rows = [
        ("model", report["model"]["name"] + f" ({report['model']['parameters'] / 1e6:.2f}M params)"),
        ("held-out set", f"{report['heldout']['dataset']} (n={report['heldout']['n']}, {report['heldout']['mode']})"),
        ("warm-start demonstrations right", pct(report["warm_start"]["demonstration_accuracy"])),
        ("held-out accuracy before RL", pct(before)),
        ("held-out accuracy after RL (final)", pct(after)),
        ("change", "n/a" if delta is None else f"{delta:+.1f} points"),
        ("optimizer steps", str(report["training"]["global_step"])),
        ("generated tokens", f"{report['training']['generated_tokens']:,}"),
        ("epochs R (num_iterations)", str(report["training"]["num_iterations"])),
        *reuse_rows(report["training"].get("reuse")),
        (
            "grad norm of reuse passes / fresh",
            ", ".join(f"{v:.2f}" for v in report["training"]["mean_grad_norm_vs_fresh"].values()) or "n/a (R = 1)",
        ),
        ("warm-start time", f"{report['time_s']['warm_start']:.0f} s"
                            + (" (the shipped weights, loaded)" if report["warm_start"].get("shipped") else "")),
        ("RL time", f"{report['time_s']['train']:.0f} s"),
        ("wall time (this process)", f"{report['time_s']['total']:.0f} s"),
    ]
    best = report["heldout"].get("best")
    if best and not best["is_final"]:
        rows.insert(5, (f"held-out accuracy, best checkpoint (step {best['step']})", pct(best["accuracy"])))
    elif best:
        rows.insert(5, ("best checkpoint", "the final one"))
    width = max(len(k) for k, _ in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * 52 + "+"
    print("\n" + line)
    for key, value in rows:
        print(f"| {key:<{width}} | {value:<50} |")
    print(line)
    print(f"report and plots: {report['output_dir']}")
