"""The async recipe's flow (``recipes/qwen3_async_respo.py``): TRL's async trainer with ReSPO, top to bottom.

Parse (``TrlParser``: :class:`AsyncRecipeArguments` and ``AsyncReSPOConfig``, a YAML ``--config`` plus overrides);
build or load the model (none given: the built-in tiny Qwen3, warm-started here as the main recipe warm-starts it);
build the datasets; measure held-out accuracy; train with :class:`respo_trl.AsyncReSPOTrainer` against a vLLM server
or, with ``--in_process_lags``, with rollouts sampled in this process from a controlled number of versions back; measure
again and write ``report.json``. Bad input ends in one line (exit status 2), as the main recipe's does.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from .arguments import RecipeError


@dataclass
class AsyncRecipeArguments:
    """What the async recipe adds to ``AsyncReSPOConfig``."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model to train (Hub id or local path). Unset: the built-in tiny Qwen3, "
                                        "warm-started here on the built-in arithmetic task (nothing downloaded)."})
    dataset_name: str = field(
        default="builtin:arithmetic",
        metadata={"help": "'builtin:arithmetic' or a Hub/local dataset with 'prompt' and 'solution' columns."})
    dataset_split: str = field(default="train", metadata={"help": "Split of a Hub/local dataset to train on."})
    in_process_lags: str | None = field(
        default=None,
        metadata={"help": "Sample rollouts in this process (no server) from the policy k versions back, k drawn from "
                          "'k:p,k:p,...' (e.g. '0:0.5,2:0.3,6:0.2'). Default with the built-in model: '0:0.6,2:0.25,6:0.15'."})
    warmstart_steps: int = field(default=150, metadata={"help": "Built-in model: supervised warm-start steps."})
    heldout_size: int = field(default=200, metadata={"help": "Built-in task: held-out problems measured before and after."})


DEFAULT_LAGS = "0:0.6,2:0.25,6:0.15"
# The embedded default's training settings (overridable on the command line): a minute or two on a CPU.
TINY_DEFAULTS = dict(output_dir="outputs/qwen3-tiny-async-respo", max_steps=30, per_device_train_batch_size=32,
                     num_generations=8, max_completion_length=48, learning_rate=3e-5, use_cpu=True, bf16=False,
                     report_to="none", logging_steps=1, save_strategy="no", token_budget=0, max_staleness=4)  # fmt: skip


def parse_lags(text: str) -> dict[int, float]:
    try:
        lags = {int(k): float(p) for k, p in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise RecipeError(f"--in_process_lags must look like '0:0.5,2:0.3,6:0.2' (lag:probability), got {text!r}") from None
    if any(k < 0 for k in lags) or any(p < 0 for p in lags.values()) or sum(lags.values()) <= 0:
        raise RecipeError(f"--in_process_lags needs lags >= 0 and probabilities >= 0 that sum to > 0, got {text!r}")
    return lags


def parse(argv: list[str] | None = None):
    from trl import TrlParser

    from respo_trl.async_config import AsyncReSPOConfig

    argv = list(argv or [])
    recipe_only = TrlParser((AsyncRecipeArguments,)).parse_args_and_config(argv, return_remaining_strings=True)[0]
    defaults = TINY_DEFAULTS if recipe_only.model_name_or_path is None else {}
    given = {a.split("=")[0].lstrip("-") for a in argv if a.startswith("--")}
    extra = [item for key, value in defaults.items() if key not in given for item in (f"--{key}", str(value))]
    script_args, training_args = TrlParser((AsyncRecipeArguments, AsyncReSPOConfig)).parse_args_and_config(argv + extra)
    if script_args.model_name_or_path is None and script_args.in_process_lags is None:
        script_args.in_process_lags = DEFAULT_LAGS
    return script_args, training_args


def builtin_model(script_args, training_args):
    """The main recipe's tiny model, task (split by canonical form) and warm start; returns (path, train, held-out)."""
    from transformers import set_seed

    from respo_trl import recipe

    recipe_args, _, _ = recipe.parse_args(["--warmstart_steps", str(script_args.warmstart_steps), "--task_split_by",
                                           "canonical", "--heldout_size", str(script_args.heldout_size),
                                           "--seed", str(training_args.seed), "--loss_type", "dapo"])  # fmt: skip
    set_seed(training_args.seed)
    model, tokenizer = recipe.build_tiny(recipe_args, seed=training_args.seed)
    train, heldout = recipe.build_datasets(recipe_args)
    print(f"warm-starting the built-in tiny Qwen3 ({script_args.warmstart_steps} steps)", flush=True)
    recipe.warm_start(model, tokenizer, train, recipe_args, seed=training_args.seed)
    path = os.path.join(training_args.output_dir, "warm-start")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, train, heldout


def hub_data(script_args):
    from datasets import load_dataset

    data = load_dataset(script_args.dataset_name, split=script_args.dataset_split)
    missing = {"prompt", "solution"} - set(data.column_names)
    if missing:
        raise RecipeError(f"{script_args.dataset_name} has no {sorted(missing)} column(s): the async recipe needs "
                          "'prompt' and 'solution' (rename them with datasets' rename_column)")  # fmt: skip
    return data, None


class HeldoutCopy:
    """Greedy held-out accuracy of a trainer's current weights, measured on a standard-attention copy of the model
    loaded once from ``model_path`` (the trainer's model runs TRL's tree attention, which only packed rows can use).
    The async recipe and ``benchmarks.async_staleness`` both measure through it."""

    def __init__(self, model_path: str, tokenizer, max_new_tokens: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens

    def accuracy(self, dataset, weights=None) -> float:
        """Share of ``dataset``'s problems answered right, greedy, by ``weights`` (a state dict; None: as loaded or
        as last set)."""
        import torch
        from trl.rewards import accuracy_reward

        from respo_trl.grading import accuracy_scores

        from .generation import generate

        if weights is not None:
            self.model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            texts, _ = generate(self.model, self.tokenizer, dataset["prompt"], max_new_tokens=self.max_new_tokens,
                                batch_size=128)  # fmt: skip
        correct = accuracy_scores(texts, dataset["solution"], accuracy_reward)
        return sum(correct) / max(len(correct), 1)


def main(script_args, training_args) -> dict:
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template
    from trl.rewards import accuracy_reward

    from respo_trl.async_rollouts import InProcessRollouts
    from respo_trl.async_trainer import AsyncReSPOTrainer

    start = time.time()
    lags = parse_lags(script_args.in_process_lags) if script_args.in_process_lags else None
    if script_args.model_name_or_path is None:
        if not script_args.dataset_name.startswith("builtin:"):
            raise RecipeError("without --model_name_or_path the recipe trains the built-in tiny model on the built-in "
                              "task: drop --dataset_name, or give a model")  # fmt: skip
        model_path, train, heldout = builtin_model(script_args, training_args)
    else:
        model_path = script_args.model_name_or_path
        train, heldout = hub_data(script_args)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not getattr(tokenizer, "response_template", None) and "<|im_start|>" in (tokenizer.chat_template or ""):
        tokenizer.response_template = qwen3_template  # TRL's worker parses responses with a template it knows
    worker = None
    if lags is not None:
        worker = InProcessRollouts(model_path, tokenizer, train, [accuracy_reward],
                                   num_generations=training_args.num_generations,
                                   max_tokens=training_args.max_completion_length,
                                   temperature=training_args.temperature, lag_probabilities=lags,
                                   seed=training_args.seed, groups_per_call=2)  # fmt: skip
    measure = heldout is not None
    probe = HeldoutCopy(model_path, tokenizer, training_args.max_completion_length) if measure else None
    before = probe.accuracy(heldout) if measure else None
    trainer = AsyncReSPOTrainer(model_path, accuracy_reward, training_args, train_dataset=train,
                                processing_class=tokenizer, rollout_worker=worker, weight_transfer=worker)  # fmt: skip
    trainer.train()
    after = probe.accuracy(heldout, trainer.model.state_dict()) if measure else None
    trainer.save_model(training_args.output_dir)
    history = [h for h in trainer.state.log_history if "loss" in h]
    report = {
        "loss_type": training_args.loss_type, "max_staleness": training_args.max_staleness,
        "updates": trainer.state.global_step, "in_process_lags": lags,
        "heldout": {"before": before, "after": after, "n": len(heldout) if measure else 0},
        "staleness_at_use_mean": [h.get("staleness/at_use_mean") for h in history],
        "dropped_stale_tokens": sum(h.get("async/dropped_stale_tokens_total", 0.0) for h in history),
        "received_tokens": sum(h.get("async/received_tokens_total", 0.0) for h in history),
        "time_s": time.time() - start,
    }  # fmt: skip
    with open(os.path.join(training_args.output_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    if measure:
        print(f"held-out accuracy ({report['heldout']['n']} problems, greedy): {100 * before:.1f}% -> {100 * after:.1f}%"
              f"; {report['updates']} updates, {report['dropped_stale_tokens']:.0f} of {report['received_tokens']:.0f} "
              f"received completion tokens dropped as stale; {report['time_s']:.0f} s; "
              f"{training_args.output_dir}/report.json", flush=True)  # fmt: skip
    return report


def cli(argv: list[str] | None = None) -> dict:
    import sys

    from .cli import one_line_errors

    with one_line_errors():
        return main(*parse(sys.argv[1:] if argv is None else argv))
