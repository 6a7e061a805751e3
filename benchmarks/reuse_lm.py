"""Rollout reuse on the tiny LM: held-out accuracy per generated token for clipped and reshaped losses, R = 1, 2, 4.

The question users ask: if I sample once and take R optimizer steps on the batch, do I get the accuracy of sampling
every step for a fraction of the sampling compute, or does the loss collapse? Each arm is one run of the recipe
(``recipes/qwen3_respo.py``, embedded tiny default: warm-started tiny Qwen3 on the built-in arithmetic task) through
``ReSPOTrainer``, with the same number of generation batches (the same budget of sampled completions) and
``max_steps = generations x R``. Arms: TRL ``dapo`` (the default clipped loss), ``gspo`` (TRL ``grpo`` with a
sequence-level ratio), ``vespo`` and ``respo``, on the dense model and, for a subset, the MoE model. Each
(model, seed) is warm-started once and every arm of that seed starts from that checkpoint, so arms differ only in the
loss and R.

    python benchmarks/reuse_lm.py --out docs/benchmarks/reuse_lm     # full size: ~35 min on 2 CPU cores
    python benchmarks/reuse_lm.py --smoke --out /tmp/reuse_lm        # seconds; what the test suite runs
    python benchmarks/reuse_lm.py --seeds 0 --losses dapo respo --reuse 1 4 --models dense   # a slice
    python benchmarks/reuse_lm.py --out docs/benchmarks/reuse_lm_lr1e-4 --models dense --losses dapo respo \\
        --reuse 1 4 -- --learning_rate 1e-4                           # any recipe override after --

Writes ``OUT/arms/<arm>.json`` as each arm finishes (an interrupted run resumes where it stopped; ``--fresh`` starts
over), then ``reuse_lm.json`` (per arm: mean and spread over seeds of final held-out accuracy, early gradient
throughput by sign, worst accuracy drop; the summary's claims as measured), ``reuse_lm.png`` (accuracy against
generated tokens per R; gradient throughput by sign) and, with MoE arms, ``reuse_lm_moe.png``. Runs ``--workers``
arms at once, one torch thread each; warm-start checkpoints and per-arm logs go to ``--work``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen3_respo.py"
sys.path.insert(0, str(ROOT))  # run from a checkout without `pip install -e .`
LOSSES = ("dapo", "gspo", "vespo", "respo")
CLIPPED = "dapo"  # the baseline of the summary claims: TRL's default clipped loss
# The arms' loss settings: gspo is TRL's grpo loss with a sequence-level ratio, as TRL documents it.
LOSS_ARGS = {
    "dapo": ["--loss_type", "dapo"],
    "gspo": ["--loss_type", "grpo", "--importance_sampling_level", "sequence"],
    "vespo": ["--loss_type", "vespo"],
    "respo": ["--loss_type", "respo"],
}
# Per-step metrics kept in each arm's JSON, for the per-pass analysis (--passes-from).
HISTORY_KEYS = (
    "grad_norm", "entropy", "reward", "offpolicy/ess", "offpolicy/ess_normalized", "offpolicy/log_weight/min",
    "offpolicy/log_weight/max", "clip_ratio/region_mean", "starvation/grad_throughput/pos",
    "starvation/grad_throughput/neg", "starvation/clip_grad_throughput/pos", "starvation/clip_grad_throughput/neg",
)  # fmt: skip
SMOKE_ARGS = [
    "--warmstart_steps", "4", "--train_size", "64", "--heldout_size", "8", "--heldout_curve_size", "4",
    "--tiny_hidden_size", "32", "--tiny_num_layers", "1", "--tiny_intermediate_size", "64",
    "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "12",
]  # fmt: skip


def load_recipe():
    spec = importlib.util.spec_from_file_location("qwen3_respo_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def _init_worker():
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def arm_name(model: str, loss: str, reuse: int, seed: int) -> str:
    return f"{model}-{loss}-R{reuse}-seed{seed}"


# ---------------------------------------------------------------------------------------------------------------------
# Work done in the worker processes
# ---------------------------------------------------------------------------------------------------------------------


def warm_start(model_kind: str, seed: int, extra: list[str], path: str) -> str:
    """Build the tiny model, imitate the task's teacher as the recipe does, save it where the arms load it from."""
    from transformers import set_seed

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    recipe = load_recipe()
    script_args, _, _ = recipe.parse_args(["--tiny_model", model_kind, "--seed", str(seed), *extra])
    set_seed(seed)
    model, tokenizer = recipe.build_tiny(script_args, seed=seed)
    train, _ = recipe.build_datasets(script_args)
    recipe.warm_start(model, tokenizer, train, script_args, seed=seed)
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)  # a crash never leaves a half-written warm start behind
    return path


def run_arm(spec: dict) -> dict:
    """One recipe run from the warm-started checkpoint; returns what the summary needs (no weights kept)."""
    recipe = load_recipe()
    reuse, gens = spec["reuse"], spec["generations"]
    output_dir = os.path.join(spec["scratch"], spec["name"])
    argv = [
        *spec["extra"], *LOSS_ARGS[spec["loss"]], "--seed", str(spec["seed"]),
        "--respo_reuse", str(reuse), "--max_steps", str(gens * reuse),
        "--heldout_eval_steps", str(spec["eval_every"] * reuse), "--warmstart_steps", "0",
        "--save_strategy", "no", "--output_dir", output_dir,
    ]  # fmt: skip
    script_args, training_args, model_args = recipe.parse_args(argv)
    script_args.tiny_model, model_args.model_name_or_path = None, spec["warm_path"]
    start = time.time()
    log_path = os.path.join(spec["logs_dir"], spec["name"] + ".log")
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        report = recipe.main(script_args, training_args, model_args)  # one log per arm keeps the console readable
    wall = time.time() - start
    history = json.loads(Path(output_dir, "trainer_state.json").read_text())["log_history"]
    shutil.rmtree(output_dir, ignore_errors=True)
    steps = [h for h in history if "starvation/grad_throughput/pos" in h]
    early = steps[: max(1, len(steps) // 4)]  # the first quarter of the token budget, the same share at every R

    def mean_of(rows, key):
        values = [r[key] for r in rows if key in r and r[key] is not None and math.isfinite(r[key])]
        return statistics.fmean(values) if values else None

    curve = report["curve"]
    peak, drop = -1.0, 0.0
    for point in curve:  # worst fall of held-out accuracy below its running best (0 for a monotone curve)
        peak = max(peak, point["accuracy"])
        drop = max(drop, peak - point["accuracy"])
    result = {
        **{k: spec[k] for k in ("name", "model", "loss", "reuse", "seed", "generations")},
        "before": report["heldout"]["before"],
        "after": report["heldout"]["after"],
        "heldout_n": report["heldout"]["n"],
        "curve": [{k: p[k] for k in ("step", "generated_tokens", "accuracy", "n")} for p in curve],
        "max_drop": drop,
        "generated_tokens": report["training"]["generated_tokens"],
        "global_step": report["training"]["global_step"],
        "early": {
            "grad_throughput_pos": mean_of(early, "starvation/grad_throughput/pos"),
            "grad_throughput_neg": mean_of(early, "starvation/grad_throughput/neg"),
            "starved_frac_pos": mean_of(early, "starvation/starved_frac/pos"),
            "starved_frac_neg": mean_of(early, "starvation/starved_frac/neg"),
        },
        "whole_run": {
            "grad_throughput_pos": mean_of(steps, "starvation/grad_throughput/pos"),
            "grad_throughput_neg": mean_of(steps, "starvation/grad_throughput/neg"),
            "ess": mean_of(steps, "offpolicy/ess"),
        },
        "history": [{"step": h["step"], **{k: h[k] for k in HISTORY_KEYS if k in h}} for h in history if "loss" in h],
        "refreshes": int(max((h.get("reuse/refreshes", 0) for h in history), default=0)),  # ESS-floor resamples
        "ess_before_pass": mean_of(history, "reuse/ess_before_pass"),
        "reward_last": report["training"]["reward_last"],
        "wall_s": wall,
    }
    Path(spec["runs_dir"], spec["name"] + ".json").write_text(json.dumps(result))
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def mean_curve(runs: list[dict]) -> list[tuple[float, float]]:
    """Seed-mean (generated tokens, accuracy) at each curve index (arms of one setting share the eval schedule)."""
    length = min(len(r["curve"]) for r in runs)
    return [
        (
            statistics.fmean(r["curve"][i]["generated_tokens"] for r in runs),
            statistics.fmean(r["curve"][i]["accuracy"] for r in runs),
        )
        for i in range(length)
    ]


def tokens_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """First generated-token count at which the (linearly interpolated) curve reaches ``target``; None if never."""
    for (t0, a0), (t1, a1) in itertools.pairwise(curve):
        if a0 >= target:
            return t0
        if a1 >= target:
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
    return curve[-1][0] if curve and curve[-1][1] >= target else None


def summarize(results: list[dict]) -> dict:
    arms: dict[str, dict] = {}
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["model"], r["loss"], r["reuse"]), []).append(r)
    for (model, loss, reuse), runs in sorted(groups.items()):
        arms[f"{model}-{loss}-R{reuse}"] = {
            "model": model,
            "loss": loss,
            "reuse": reuse,
            "seeds": sorted(r["seed"] for r in runs),
            "before": spread([r["before"] for r in runs]),
            "after": spread([r["after"] for r in runs]),
            "gain_points": spread([100 * (r["after"] - r["before"]) for r in runs]),
            "max_drop_points": spread([100 * r["max_drop"] for r in runs]),
            "generated_tokens": spread([r["generated_tokens"] for r in runs]),
            "early_grad_throughput_pos": spread([r["early"]["grad_throughput_pos"] for r in runs]),
            "early_grad_throughput_neg": spread([r["early"]["grad_throughput_neg"] for r in runs]),
            "early_starved_frac_pos": spread([r["early"]["starved_frac_pos"] for r in runs]),
            "wall_s": spread([r["wall_s"] for r in runs]),
            "mean_curve": mean_curve(runs),
        }
    return {"arms": arms, "claims": claims(groups)}


def claims(groups: dict[tuple, list[dict]]) -> dict:
    """The summary's claims, measured on the dense model (paired by seed where two arms are compared)."""
    out = {}
    respo4, clip4, clip1 = (
        groups.get(("dense", loss, r), []) for loss, r in (("respo", 4), (CLIPPED, 4), (CLIPPED, 1))
    )
    if respo4 and clip4:
        a, b = ({r["seed"]: r for r in runs} for runs in (respo4, clip4))
        seeds = sorted(set(a) & set(b))
        ratios = [a[s]["early"]["grad_throughput_pos"] / b[s]["early"]["grad_throughput_pos"] for s in seeds
                  if b[s]["early"]["grad_throughput_pos"]]  # fmt: skip
        out["early_pos_throughput_ratio_R4"] = {**spread(ratios), "claim": 2.4, "seeds": seeds}
        out["respo_minus_clipped_R4_points"] = {
            **spread([100 * (a[s]["after"] - b[s]["after"]) for s in seeds]),
            "claim": "3.6 to 5.2",
            "seeds": seeds,
        }
    if respo4 and clip1:
        target = statistics.fmean(r["after"] for r in clip1)
        budget = statistics.fmean(r["generated_tokens"] for r in clip1)
        reached = tokens_to_reach(mean_curve(respo4), target)
        out["respo_R4_tokens_to_clipped_R1_final"] = {
            "clipped_R1_final_accuracy": target,
            "clipped_R1_generated_tokens": budget,
            "respo_R4_tokens": reached,
            "fraction_of_clipped_R1_tokens": None if reached is None else reached / budget,
            "claim": "<= 0.5",
        }
        # the same for every loss run at R = 4: is the saving ReSPO's, or reuse's?
        for (model, loss, reuse), runs in sorted(groups.items()):
            if model == "dense" and reuse == 4:
                reached = tokens_to_reach(mean_curve(runs), target)
                fraction = None if reached is None else reached / budget
                out.setdefault("R4_fraction_of_clipped_R1_tokens_by_loss", {})[loss] = fraction
    return out


def per_pass(arm: dict, steps: int) -> list[dict]:
    """Mean of the kept metrics by reuse pass (1 = the fresh pass) over the first ``steps`` optimizer steps."""
    if "history" not in arm:
        raise SystemExit(f"{arm['name']}: no per-step history in this arm's JSON; delete it and rerun the arm to get one")
    reuse, rows = arm["reuse"], [h for h in arm["history"] if h["step"] <= steps]
    table = []
    for p in range(reuse):
        chunk = [h for h in rows if (h["step"] - 1) % reuse == p]
        table.append(
            {k: statistics.fmean(h[k] for h in chunk if k in h) for k in HISTORY_KEYS if any(k in h for h in chunk)}
        )
    return table


def plot(summary: dict, model: str, path: Path) -> None:
    """Top row: held-out accuracy against generated tokens, one panel per R. Bottom row: the same curves by R for the
    clipped baseline and ReSPO (what reuse saves), and early gradient throughput by advantage sign."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {k: v for k, v in summary["arms"].items() if v["model"] == model}
    reuses = sorted({v["reuse"] for v in arms.values()})
    losses = [loss for loss in LOSSES if any(v["loss"] == loss for v in arms.values())]
    colors = dict(zip(LOSSES, ("tab:red", "tab:orange", "tab:purple", "tab:blue")))
    styles = dict(zip(sorted(reuses), (":", "--", "-", "-.")))
    ncols = max(3, len(reuses))
    fig, axes = plt.subplots(2, ncols, figsize=(4.6 * ncols, 7.4), squeeze=False)

    def curve(ax, arm, **kwargs):
        xs, ys = zip(*arm["mean_curve"])
        ax.plot([x / 1e3 for x in xs], [100 * y for y in ys], marker="o", ms=3, **kwargs)

    for ax, reuse in zip(axes[0], reuses):
        for loss in losses:
            if f"{model}-{loss}-R{reuse}" in arms:
                curve(ax, arms[f"{model}-{loss}-R{reuse}"], color=colors[loss], label=loss)
        ax.set(title=f"R = {reuse}", xlabel="generated tokens (k)", ylabel="held-out accuracy (%), mean of seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[0][len(reuses) :]:
        ax.axis("off")
    ax = axes[1][0]
    for loss in (CLIPPED, "respo"):
        for reuse in reuses:
            if f"{model}-{loss}-R{reuse}" in arms:
                curve(
                    ax,
                    arms[f"{model}-{loss}-R{reuse}"],
                    color=colors[loss],
                    ls=styles[reuse],
                    label=f"{loss} R={reuse}",
                )
    ax.set(title="what reuse saves", xlabel="generated tokens (k)", ylabel="held-out accuracy (%), mean of seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    width = 0.8 / max(1, len(losses))
    for ax, sign in zip(axes[1][1:3], ("pos", "neg")):
        for i, loss in enumerate(losses):
            stats = [arms.get(f"{model}-{loss}-R{r}", {}).get(f"early_grad_throughput_{sign}") for r in reuses]
            means = [s["mean"] if s and s["mean"] is not None else 0.0 for s in stats]
            errs = [s["std"] if s and s["std"] is not None else 0.0 for s in stats]
            ax.bar(
                [j + i * width for j in range(len(reuses))], means, width, yerr=errs, color=colors[loss], label=loss
            )
        ax.set_xticks([j + width * (len(losses) - 1) / 2 for j in range(len(reuses))], [f"R={r}" for r in reuses])
        ax.set(title=f"early gradient throughput, A {'> 0' if sign == 'pos' else '< 0'}", ylim=(0, 1.1))
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="lower left")
    for ax in axes[1][3:]:
        ax.axis("off")
    fig.suptitle(
        f"tiny Qwen3 ({model}), arithmetic task, equal sampled-completion budget per arm: {summary_note(summary)}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_note(summary: dict) -> str:
    config = summary.get("config", {})
    extra = " ".join(config.get("recipe_args") or []) or "recipe defaults"
    return f"{len(config.get('seeds', []))} seeds, {extra}"


def print_table(summary: dict) -> None:
    def fmt(stats, scale=1.0, digits=1):
        if not stats or stats["mean"] is None:
            return "n/a"
        return f"{scale * stats['mean']:.{digits}f} ± {scale * stats['std']:.{digits}f}"

    print(f"\n{'arm':<20} {'seeds':>5} {'before %':>12} {'after %':>12} {'worst drop':>11} {'tokens k':>9} "
          f"{'early tp+':>13} {'early tp-':>13} {'wall s':>7}")  # fmt: skip
    for name, arm in summary["arms"].items():
        print(
            f"{name:<20} {len(arm['seeds']):>5} {fmt(arm['before'], 100):>12} {fmt(arm['after'], 100):>12} "
            f"{fmt(arm['max_drop_points']):>11} {arm['generated_tokens']['mean'] / 1e3:>9.0f} "
            f"{fmt(arm['early_grad_throughput_pos'], 1, 3):>13} {fmt(arm['early_grad_throughput_neg'], 1, 3):>13} "
            f"{arm['wall_s']['mean']:>7.0f}"
        )
    print("\nsummary claims (dense):")
    for key, value in summary["claims"].items():
        print(f"  {key}: {json.dumps(value)}")


def markdown(summary: dict) -> str:
    """The docs tables (docs/benchmarks.md, section 2) from a ``reuse_lm.json``."""

    def pm(stats, scale=1.0, digits=1):
        if not stats or stats.get("mean") is None:
            return "n/a"
        return f"{scale * stats['mean']:.{digits}f} ± {scale * stats['std']:.{digits}f}"

    lines = [
        "| model | loss | R | held-out before (%) | after (%) | worst drop (points) | generated tokens (k) "
        "| early throughput + | early throughput − | early starved + | wall (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in summary["arms"].values():
        lines.append(
            f"| {arm['model']} | {arm['loss']} | {arm['reuse']} | {pm(arm['before'], 100)} | {pm(arm['after'], 100)} "
            f"| {pm(arm['max_drop_points'])} | {arm['generated_tokens']['mean'] / 1e3:.0f} "
            f"| {pm(arm['early_grad_throughput_pos'], 1, 3)} | {pm(arm['early_grad_throughput_neg'], 1, 3)} "
            f"| {pm(arm['early_starved_frac_pos'], 1, 3)} | {arm['wall_s']['mean']:.0f} |"
        )
    # held-out accuracy along the run: one row per arm, one column per evaluation point (same generation batches)
    arms = list(summary["arms"].values())
    length = max(len(arm["mean_curve"]) for arm in arms)
    tokens = [
        statistics.fmean(arm["mean_curve"][i][0] for arm in arms if i < len(arm["mean_curve"])) for i in range(length)
    ]
    lines += ["", "| arm \\ generated tokens | " + " | ".join(f"{t / 1e3:.0f}k" for t in tokens) + " |"]
    lines.append("|---|" + "---:|" * length)
    for arm in arms:
        cells = [f"{100 * a:.1f}" for _, a in arm["mean_curve"]] + [""] * (length - len(arm["mean_curve"]))
        lines.append(f"| {arm['model']} {arm['loss']} R={arm['reuse']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="docs/benchmarks/reuse_lm", help="Output folder (JSON, plots, per-arm runs).")
    p.add_argument("--work", default="outputs/reuse_lm", help="Warm-start checkpoints, per-arm logs, scratch space.")
    p.add_argument("--models", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    p.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    p.add_argument("--moe_losses", nargs="+", default=[CLIPPED, "respo"], choices=LOSSES, help="Arms run on MoE.")
    p.add_argument("--moe_reuse", nargs="+", type=int, default=[1, 4], help="Reuse factors run on MoE.")
    p.add_argument("--reuse", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--generations", type=int, default=60, help="Generation batches per arm (the sampling budget).")
    p.add_argument("--eval_every", type=int, default=12, help="Held-out curve point every N generation batches.")
    p.add_argument("--workers", type=int, default=2, help="Arms run at once (one torch thread each).")
    p.add_argument(
        "--smoke", action="store_true", help="Tiny sizes for the test suite (seconds, numbers meaningless)."
    )
    p.add_argument("--fresh", action="store_true", help="Ignore finished arms in OUT/arms and start over.")
    p.add_argument("--markdown-from", metavar="JSON", help="Print the docs tables of an existing result and exit.")
    p.add_argument("--passes-from", metavar="ARM_JSON", nargs="+", help="Print per-pass metrics of arms and exit.")
    p.add_argument("--passes-steps", type=int, default=60, help="--passes-from: first N optimizer steps.")
    p.add_argument("recipe_args", nargs="*", help="Extra recipe overrides after '--', e.g. -- --learning_rate 2e-5")
    args = p.parse_args(argv)
    if any(r < 1 for r in args.reuse + args.moe_reuse) or args.generations < 1 or args.eval_every < 1:
        p.error("--reuse, --moe_reuse, --generations and --eval_every must be >= 1")
    return args


def main(argv=None) -> dict:
    from benchmarks.machine import machine_info

    args = parse(argv)
    if args.passes_from:
        keys = (
            "grad_norm",
            "clip_ratio/region_mean",
            "offpolicy/log_weight/min",
            "offpolicy/ess_normalized",
            "entropy",
        )
        print(f"{'arm':<28} {'pass':>4} " + " ".join(f"{k.split('/')[-1]:>14}" for k in keys))
        for path in args.passes_from:
            arm = json.loads(Path(path).read_text())
            for i, row in enumerate(per_pass(arm, args.passes_steps), 1):
                cells = " ".join(f"{row[k]:>14.4f}" if k in row else f"{'-':>14}" for k in keys)
                print(f"{arm['name']:<28} {i:>4} {cells}")
        return {}
    if args.markdown_from:
        summary = json.loads(Path(args.markdown_from).read_text())
        print(markdown(summary))
        return summary
    out = Path(args.out)
    work = Path(args.work)
    runs_dir, warm_dir, scratch, logs = out / "arms", work / "warm", work / "scratch", work / "logs"
    if args.fresh:
        shutil.rmtree(runs_dir, ignore_errors=True)
    for d in (runs_dir, warm_dir, scratch, logs):
        d.mkdir(parents=True, exist_ok=True)
    extra = (SMOKE_ARGS if args.smoke else []) + list(args.recipe_args)
    # The recipe's defaults are the tiny preset; parse once here so bad overrides fail before any worker starts.
    load_recipe().parse_args(["--tiny_model", "dense", *extra])

    specs = []
    for model in args.models:
        losses, reuses = (args.losses, args.reuse) if model == "dense" else (args.moe_losses, args.moe_reuse)
        for seed in args.seeds:
            for reuse in reuses:
                for loss in losses:
                    name = arm_name(model, loss, reuse, seed)
                    specs.append({
                        "name": name, "model": model, "loss": loss, "reuse": reuse, "seed": seed,
                        "generations": args.generations, "eval_every": args.eval_every, "extra": extra,
                        "warm_path": str(warm_dir / f"{model}-seed{seed}"), "runs_dir": str(runs_dir),
                        "scratch": str(scratch), "logs_dir": str(logs),
                    })  # fmt: skip
    results = {}
    for spec in specs:
        done = runs_dir / (spec["name"] + ".json")
        if done.exists():
            results[spec["name"]] = json.loads(done.read_text())
    todo = [s for s in specs if s["name"] not in results]
    print(f"{len(specs)} arms, {len(results)} already done, {len(todo)} to run on {args.workers} workers")

    start = time.time()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
        warm = {(s["model"], s["seed"]): s["warm_path"] for s in todo}
        for future in as_completed(
            [pool.submit(warm_start, m, seed, extra, path) for (m, seed), path in warm.items()]
        ):
            print(f"  warm start ready: {future.result()}  ({time.time() - start:.0f} s)", flush=True)
        futures = {pool.submit(run_arm, spec): spec["name"] for spec in todo}
        for i, future in enumerate(as_completed(futures), 1):
            r = future.result()
            results[r["name"]] = r
            print(
                f"  [{i}/{len(todo)}] {r['name']}: held-out {100 * r['before']:.1f}% -> {100 * r['after']:.1f}%, "
                f"{r['generated_tokens'] / 1e3:.0f}k tokens, {r['wall_s']:.0f} s  ({time.time() - start:.0f} s)",
                flush=True,
            )
    shutil.rmtree(scratch, ignore_errors=True)

    summary = summarize(list(results.values()))
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("fresh",)}
    summary["machine"] = {**machine_info(), "workers": args.workers, "threads_per_worker": 1}
    summary["command"] = "python benchmarks/reuse_lm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "reuse_lm.json").write_text(json.dumps(summary, indent=1))
    plots = []
    for model in args.models:
        path = out / ("reuse_lm.png" if model == "dense" else f"reuse_lm_{model}.png")
        plot(summary, model, path)
        plots.append(str(path))
    print_table(summary)
    print(f"\nwrote {out / 'reuse_lm.json'} and {', '.join(plots)}")
    return summary


if __name__ == "__main__":
    main()
