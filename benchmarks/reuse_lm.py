"""Rollout reuse on the tiny LM: held-out accuracy for clipped and reshaped losses, under both kinds of reuse.

The question users ask: if I sample once and take several optimizer steps on the batch, do I get the accuracy of
sampling every step for a fraction of the sampling compute, or does the loss collapse? Two kinds of reuse:

* epochs ``R`` (TRL's ``num_iterations``): every sample is used ``R`` times; arms get the same number of generation
  batches (the same budget of sampled completions), so ``max_steps = generations x R``;
* the paper's staleness ``N`` (``respo_updates_per_rollout``): one rollout batch of ``N`` mini-batches feeds ``N``
  consecutive updates, each sample used once; arms get the same number of policy updates (the paper: 1,024 for every
  ``N``) and so the same sampled completions, in ``N`` times fewer and ``N`` times larger generation rounds.

Each arm is one run of the recipe (``recipes/qwen3_respo.py``, embedded tiny default: warm-started tiny Qwen3 on the
built-in arithmetic task) through ``ReSPOTrainer``. Arms: TRL ``dapo`` (the default clipped loss), ``gspo`` (TRL
``grpo`` with a sequence-level ratio), ``vespo`` and ``respo`` (the paper's kernel; the directional token trust mask
is on under epochs, by default), on the dense model and the MoE model. Each (model, seed) is warm-started once and
every arm of that seed starts from that checkpoint, so arms differ only in the loss and the reuse setting.

    python -m benchmarks.reuse_lm --out docs/benchmarks/reuse_lm     # epochs R = 1, 2, 4, dense and MoE
    python -m benchmarks.reuse_lm --out docs/benchmarks/reuse_lm/staleness --reuse --staleness 1 4 8 16
    python -m benchmarks.reuse_lm --smoke --out /tmp/reuse_lm        # seconds; what the test suite runs
    python -m benchmarks.reuse_lm --seeds 0 --losses dapo respo --reuse 1 4 --models dense   # a slice
    python -m benchmarks.reuse_lm --out docs/benchmarks/reuse_lm/epochs_lr1e-4 --models dense --losses dapo respo \\
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
import gzip
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    ANSWERS_SUFFIX,
    LOSS_ARGS,
    REUSE_LM_KEYS,
    code_commit,
    command,
    compact_history,
    largest_fall,
    load_run,
    load_runs,
    machine_info,
    pos_length_growth,
    run_pool,
    save_run,
    spread,
    tokens_to_reach,
    warm_start,
)

LOSSES = ("dapo", "gspo", "vespo", "respo")
CLIPPED = "dapo"  # the baseline of the summary claims: TRL's default clipped loss
ALL_LOSSES = tuple(LOSS_ARGS)
# On-policy (R = 1, N = 1) every coefficient of these losses is exactly 1 and they aggregate alike (token sum over the
# global token count), so their runs are identical (tests/test_trainer.py checks ReSPO's against dapo's): one of them
# runs and stands for all. GSPO (TRL grpo: a per-sequence mean) trains differently even on-policy.
SAME_ON_POLICY = ("dapo", "vespo", "respo", "respo_nomask", "respo_mask", "respo_pos1", "respo_neg1", "respo_flat",
                  "respo_first", "respo_current")
# Early means kept per arm (first quarter of the optimizer steps): name in the JSON -> logged metric.
EARLY_KEYS = {
    "grad_throughput_pos": "starvation/grad_throughput/pos",
    "grad_throughput_neg": "starvation/grad_throughput/neg",
    "starved_frac_pos": "starvation/starved_frac/pos",
    "starved_frac_neg": "starvation/starved_frac/neg",
    "low_weight_pos_share": "starvation/low_weight_pos/share",
    "low_weight_pos_mass_share": "starvation/low_weight_pos/mass_share",
    "pos_length_mean": "starvation/pos_length_mean",
    "trust_masked_frac": "respo/trust_masked_frac",
}
SMOKE_ARGS = [
    "--warmstart_steps", "4", "--train_size", "64", "--heldout_size", "8", "--heldout_curve_size", "4",
    "--tiny_hidden_size", "32", "--tiny_num_layers", "1", "--tiny_intermediate_size", "64",
    "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "12",
]  # fmt: skip


def setting_name(reuse: int, staleness: int, kind: str = "R") -> str:
    """``R4`` (epochs arms), ``N8`` (staleness arms; ``N1`` is their on-policy point, at their number of updates)."""
    if kind == "R":
        return f"R{reuse}"
    return f"N{staleness}" + (f"R{reuse}" if reuse > 1 else "")


def arm_name(model: str, loss: str, setting: str, seed: int) -> str:
    return f"{model}-{loss}-{setting}-seed{seed}"


# ---------------------------------------------------------------------------------------------------------------------
# Work done in the worker processes
# ---------------------------------------------------------------------------------------------------------------------


def run_arm(spec: dict) -> dict:
    """One recipe run from the warm-started checkpoint; returns what the summary needs (no weights kept)."""
    from respo_trl import recipe

    reuse, staleness = spec["reuse"], spec["staleness"]
    output_dir = os.path.join(spec["scratch"], spec["name"])
    argv = [
        *spec["extra"], *LOSS_ARGS[spec["loss"]], "--seed", str(spec["seed"]),
        # the tiny preset accumulates no gradients, so N updates per rollout batch = N steps per generation
        "--num_iterations", str(reuse), "--respo_updates_per_rollout", str(staleness), "--max_steps", str(spec["steps"]),
        "--heldout_eval_steps", str(spec["eval_steps"]), "--warmstart_steps", "0",
        "--save_strategy", "no", "--output_dir", output_dir,
    ]  # fmt: skip
    script_args, training_args, model_args = recipe.parse_args(argv)
    assert training_args.gradient_accumulation_steps == 1, "staleness arms assume no gradient accumulation"
    script_args.tiny_model, model_args.model_name_or_path = None, spec["warm_path"]
    start, commit, started_at = time.time(), code_commit(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    log_path = os.path.join(spec["logs_dir"], spec["name"] + ".log")
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        report = recipe.main(script_args, training_args, model_args)  # one log per arm keeps the console readable
    wall = time.time() - start
    history = json.loads(Path(output_dir, "trainer_state.json").read_text())["log_history"]
    answers = {}  # the greedy held-out answers of every curve point (the last measurement of a step wins)
    answers_path = Path(output_dir, recipe.ANSWERS_FILE)
    if answers_path.exists():
        for line in answers_path.read_text().splitlines():
            point = json.loads(line)
            answers[point["step"]] = [[a["completion"], a["correct"], a["tokens"]] for a in point["answers"]]
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
        **{k: spec[k] for k in ("name", "model", "loss", "reuse", "staleness", "setting", "seed", "steps")},
        "before": report["heldout"]["before"],
        "after": report["heldout"]["after"],
        "heldout_n": report["heldout"]["n"],
        "curve": [{k: p[k] for k in ("step", "generated_tokens", "accuracy", "n", "mean_answer_tokens") if k in p}
                  for p in curve],
        "best": max(p["accuracy"] for p in curve),
        "max_drop": drop,
        "generated_tokens": report["training"]["generated_tokens"],
        "global_step": report["training"]["global_step"],
        "early": {name: mean_of(early, key) for name, key in EARLY_KEYS.items()},
        "whole_run": {
            "grad_throughput_pos": mean_of(steps, "starvation/grad_throughput/pos"),
            "grad_throughput_neg": mean_of(steps, "starvation/grad_throughput/neg"),
            "ess": mean_of(steps, "offpolicy/ess"),
        },
        "history": compact_history([h for h in history if "loss" in h], REUSE_LM_KEYS),
        "refreshes": int(max((h.get("reuse/refreshes", 0) for h in history), default=0)),  # ESS-floor resamples
        "ess_before_pass": mean_of(history, "reuse/ess_before_pass"),
        "reward_last": report["training"]["reward_last"],
        "wall_s": wall,
        "commit": commit,
        "started_at": started_at,
    }
    if answers:  # step -> [[completion, right, tokens], ...] on the curve's problems (the held-out set's first ones)
        size = min(len(rows) for rows in answers.values())
        with gzip.open(Path(spec["runs_dir"], spec["name"] + ANSWERS_SUFFIX), "wt") as f:
            json.dump({str(step): rows[:size] for step, rows in sorted(answers.items())}, f)
    return save_run(Path(spec["runs_dir"], spec["name"] + ".json"), result)


# ---------------------------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------------------------


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


def mean_curve_by_step(runs: list[dict]) -> list[tuple[float, float]]:
    """Seed-mean (policy updates, accuracy) at each curve index."""
    length = min(len(r["curve"]) for r in runs)
    return [
        (statistics.fmean(r["curve"][i]["step"] for r in runs), statistics.fmean(r["curve"][i]["accuracy"] for r in runs))
        for i in range(length)
    ]


def summarize(results: list[dict]) -> dict:
    arms: dict[str, dict] = {}
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        r.setdefault("staleness", 1)
        r.setdefault("setting", setting_name(r["reuse"], r["staleness"], "N" if r["staleness"] > 1 else "R"))
        groups.setdefault((r["model"], r["loss"], r["setting"]), []).append(r)
    for (model, loss, setting), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], _order(kv[0][2]), kv[0][1])):
        arms[f"{model}-{loss}-{setting}"] = {
            "model": model,
            "loss": loss,
            "setting": setting,
            "reuse": runs[0]["reuse"],
            "staleness": runs[0]["staleness"],
            "seeds": sorted(r["seed"] for r in runs),
            "before": spread([r["before"] for r in runs]),
            "after": spread([r["after"] for r in runs]),
            "best": spread([r.get("best", r["after"]) for r in runs]),
            "after_per_seed": {r["seed"]: r["after"] for r in runs},
            "gain_points": spread([100 * (r["after"] - r["before"]) for r in runs]),
            "max_drop_points": spread([100 * r["max_drop"] for r in runs]),
            "ended_below_start": sum(r["after"] < r["before"] for r in runs),
            "generated_tokens": spread([r["generated_tokens"] for r in runs]),
            "global_step": spread([r["global_step"] for r in runs]),
            **{f"early_{name}": spread([r["early"].get(name) for r in runs]) for name in EARLY_KEYS},
            "pos_length_growth": spread([pos_length_growth(r) for r in runs]),
            "wall_s": spread([r["wall_s"] for r in runs]),
            "mean_curve": mean_curve(runs),
            "mean_curve_by_step": mean_curve_by_step(runs),
        }
    return {"arms": arms, "claims": claims(groups)}


def _order(setting: str) -> tuple:
    """Sort settings as R1, R2, R4, N1, N4, N8, N16, N2R2."""
    n = int(setting[1:].split("R")[0]) if setting.startswith("N") else 1
    r = int(setting.split("R")[1]) if "R" in setting else 1
    return (setting.startswith("N"), n, r)


def _paired(a: list[dict], b: list[dict]) -> tuple[dict, dict, list[int]]:
    a, b = ({r["seed"]: r for r in runs} for runs in (a, b))
    return a, b, sorted(set(a) & set(b))


def claims(groups: dict[tuple, list[dict]]) -> dict:
    """The issue's goals and the summary's claims, as measured (paired by seed where two arms are compared)."""
    out = {}
    for model in sorted({key[0] for key in groups}):
        for setting in sorted({key[2] for key in groups if key[0] == model}, key=_order):
            respo = groups.get((model, "respo", setting), [])
            if not respo:
                continue
            entry = {}
            for loss in ALL_LOSSES:
                other = groups.get((model, loss, setting), [])
                if loss == "respo" or not other:
                    continue
                a, b, seeds = _paired(respo, other)
                entry[f"respo_minus_{loss}_points"] = {
                    **spread([100 * (a[s]["after"] - b[s]["after"]) for s in seeds]),
                    "seeds": seeds,
                }
            entry["respo_ended_below_start"] = sum(r["after"] < r["before"] for r in respo)
            for loss in ("respo", "vespo", CLIPPED):
                runs = groups.get((model, loss, setting), [])
                ratios = [
                    r["early"]["low_weight_pos_mass_share"] / r["early"]["low_weight_pos_share"]
                    for r in runs
                    if r["early"].get("low_weight_pos_share") and r["early"].get("low_weight_pos_mass_share") is not None
                ]
                if ratios:
                    entry[f"{loss}_low_weight_pos_mass_ratio"] = {**spread(ratios), "paper": {"respo": 1.69, "vespo": 0.93}.get(loss)}
            clip = groups.get((model, CLIPPED, setting), [])
            if clip:
                a, b, seeds = _paired(respo, clip)
                ratios = [a[s]["early"]["grad_throughput_pos"] / b[s]["early"]["grad_throughput_pos"] for s in seeds
                          if a[s]["early"]["grad_throughput_pos"] and b[s]["early"]["grad_throughput_pos"]]  # fmt: skip
                entry["early_pos_throughput_ratio_vs_clipped"] = {**spread(ratios), "summary_claim": 2.4}
            out[f"{model}-{setting}"] = entry
    # what reuse saves: tokens each loss needs under R = 4 to reach the clipped on-policy run's final accuracy
    clip1 = groups.get(("dense", CLIPPED, "R1"), [])
    if clip1:
        target = statistics.fmean(r["after"] for r in clip1)
        budget = statistics.fmean(r["generated_tokens"] for r in clip1)
        fractions = {}
        for (model, loss, setting), runs in sorted(groups.items()):
            if model == "dense" and setting.startswith("R") and setting != "R1":
                reached = tokens_to_reach(mean_curve(runs), target)
                fractions.setdefault(setting, {})[loss] = None if reached is None else reached / budget
        out["fraction_of_clipped_R1_tokens_to_its_final_accuracy"] = {
            "clipped_R1_final_accuracy": target, "clipped_R1_generated_tokens": budget, **fractions
        }  # fmt: skip
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
            {k: statistics.fmean(h[k] for h in chunk if k in h) for k in REUSE_LM_KEYS if any(k in h for h in chunk)}
        )
    return table


COLORS = dict(
    zip(ALL_LOSSES, ("tab:red", "tab:orange", "tab:purple", "tab:blue", "tab:cyan", "tab:brown", "tab:olive", "tab:green",
                     "tab:pink", "tab:gray", "tab:olive", "black"))
)


def plot(summary: dict, model: str, kind: str, path: Path) -> None:
    """One panel per reuse setting of ``kind`` (``R`` epochs or ``N`` staleness): held-out accuracy against generated
    tokens (top) and against policy updates (middle); bottom: early gradient throughput by sign and the paper's
    positive-branch diagnostic (mass ratio of low-weight positives)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {k: v for k, v in summary["arms"].items() if v["model"] == model and v["setting"][0] == kind}
    settings = sorted({v["setting"] for v in arms.values()}, key=_order)
    losses = [loss for loss in ALL_LOSSES if any(v["loss"] == loss for v in arms.values())]
    ncols = max(3, len(settings))
    fig, axes = plt.subplots(3, ncols, figsize=(4.4 * ncols, 10.5), squeeze=False)

    def curve(ax, points, **kwargs):
        xs, ys = zip(*points)
        ax.plot(xs, [100 * y for y in ys], marker="o", ms=3, **kwargs)

    for col, setting in enumerate(settings):
        for row, (key, xlabel, scale) in enumerate(
            (("mean_curve", "generated tokens (k)", 1e3), ("mean_curve_by_step", "policy updates", 1))
        ):
            ax = axes[row][col]
            for loss in losses:
                arm = arms.get(f"{model}-{loss}-{setting}")
                if arm:
                    curve(ax, [(x / scale, y) for x, y in arm[key]], color=COLORS[loss], label=loss)
            ax.set(title=setting.replace("R", "R = ").replace("N", "N = "), xlabel=xlabel,
                   ylabel="held-out accuracy (%), seed mean")  # fmt: skip
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    for row in (0, 1):
        for ax in axes[row][len(settings) :]:
            ax.axis("off")
    width = 0.8 / max(1, len(losses))
    panels = (
        ("early_grad_throughput_pos", "early gradient throughput, A > 0", (0, 1.4)),
        ("early_grad_throughput_neg", "early gradient throughput, A < 0", (0, 1.4)),
        ("low_weight_mass_ratio", "low-weight positives (log W < -1):\nshare of coefficient mass / share of positives", None),
    )
    for ax, (key, title, ylim) in zip(axes[2], panels):
        for i, loss in enumerate(losses):
            means, errs = [], []
            for setting in settings:
                arm = arms.get(f"{model}-{loss}-{setting}", {})
                if key == "low_weight_mass_ratio":
                    share, mass = arm.get("early_low_weight_pos_share", {}), arm.get("early_low_weight_pos_mass_share", {})
                    ok = share.get("mean") and mass.get("mean") is not None
                    means.append(mass["mean"] / share["mean"] if ok else 0.0)
                    errs.append(0.0)
                else:
                    stats = arm.get(key) or {}
                    means.append(stats.get("mean") or 0.0)
                    errs.append(stats.get("std") or 0.0)
            ax.bar([j + i * width for j in range(len(settings))], means, width, yerr=errs, color=COLORS[loss], label=loss)
        ax.set_xticks([j + width * (len(losses) - 1) / 2 for j in range(len(settings))], settings)
        ax.set(title=title)
        if ylim:
            ax.set_ylim(*ylim)
        else:
            ax.axhline(1.0, color="gray", lw=0.8)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="lower left")
    for ax in axes[2][3:]:
        ax.axis("off")
    what = "equal sampled-completion budget per arm" if kind == "R" else "equal policy updates per arm"
    fig.suptitle(f"tiny Qwen3 ({model}), arithmetic task, {what}: {summary_note(summary)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_note(summary: dict) -> str:
    config = summary.get("config", {})
    extra = " ".join(config.get("recipe_args") or []) or "recipe defaults"
    return f"{len(config.get('seeds', []))} seeds, {extra}"


def _pm(stats, scale=1.0, digits=1):
    if not stats or stats.get("mean") is None:
        return "n/a"
    return f"{scale * stats['mean']:.{digits}f} ± {scale * stats['std']:.{digits}f}"


def _pct(stats) -> str:
    if not stats or stats.get("mean") is None:
        return "n/a"
    return f"{100 * stats['mean']:+.1f}% ± {100 * stats['std']:.1f}"


def print_table(summary: dict) -> None:
    print(f"\n{'arm':<22} {'seeds':>5} {'before %':>12} {'after %':>12} {'best %':>12} {'worst drop':>11} "
          f"{'tokens k':>9} {'early tp+':>13} {'early tp-':>13} {'wall s':>7}")  # fmt: skip
    for name, arm in summary["arms"].items():
        print(
            f"{name:<22} {len(arm['seeds']):>5} {_pm(arm['before'], 100):>12} {_pm(arm['after'], 100):>12} "
            f"{_pm(arm['best'], 100):>12} {_pm(arm['max_drop_points']):>11} "
            f"{arm['generated_tokens']['mean'] / 1e3:>9.0f} {_pm(arm['early_grad_throughput_pos'], 1, 3):>13} "
            f"{_pm(arm['early_grad_throughput_neg'], 1, 3):>13} {arm['wall_s']['mean']:>7.0f}"
        )
    print("\nclaims and goals:")
    for key, value in summary["claims"].items():
        print(f"  {key}: {json.dumps(value)}")


def markdown(summary: dict) -> str:
    """The docs tables (docs/benchmarks/reuse_lm.md, section 2) from a ``reuse_lm.json``."""
    lines = [
        "| model | loss | reuse | updates | generated tokens (k) | held-out before (%) | after (%) | best (%) "
        "| worst drop (points) | per seed after (%) | early throughput + | early throughput − "
        "| low-W positives: share / mass | trust-masked tokens | positive length, late vs early | wall (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for arm in summary["arms"].values():
        per_seed = " / ".join(f"{100 * v:.1f}" for _, v in sorted(arm.get("after_per_seed", {}).items()))
        share, mass = arm.get("early_low_weight_pos_share"), arm.get("early_low_weight_pos_mass_share")
        lines.append(
            f"| {arm['model']} | {arm['loss']} | {arm['setting']} | {arm['global_step']['mean']:.0f} "
            f"| {arm['generated_tokens']['mean'] / 1e3:.0f} | {_pm(arm['before'], 100)} | {_pm(arm['after'], 100)} "
            f"| {_pm(arm['best'], 100)} | {_pm(arm['max_drop_points'])} | {per_seed} "
            f"| {_pm(arm['early_grad_throughput_pos'], 1, 3)} | {_pm(arm['early_grad_throughput_neg'], 1, 3)} "
            f"| {_pm(share, 100)} / {_pm(mass, 100)} | {_pm(arm.get('early_trust_masked_frac'), 100)} "
            f"| {_pct(arm.get('pos_length_growth'))} | {arm['wall_s']['mean']:.0f} |"
        )
    # held-out accuracy along the run: one row per arm, one column per evaluation point
    arms = list(summary["arms"].values())
    length = max(len(arm["mean_curve"]) for arm in arms)
    lines += ["", "| arm | " + " | ".join(f"point {i}" for i in range(length)) + " |"]
    lines.append("|---|" + "---:|" * length)
    for arm in arms:
        cells = [f"{100 * a:.1f} @ {t / 1e3:.0f}k" for t, a in arm["mean_curve"]]
        cells += [""] * (length - len(cells))
        lines.append(f"| {arm['model']} {arm['loss']} {arm['setting']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Epochs at a high learning rate: the rule of docs/benchmarks/reuse_lm.md, section 2.7 (written before its runs)
# ---------------------------------------------------------------------------------------------------------------------

SAFE_MARGIN = 3.0  # points: the paired interval's lower end of (loss - dapo) must be at least -3
FALL = 15.0  # points below a run's own running peak on the held-out curve
PASS_KEYS = {
    "grad_norm": "grad_norm", "grad_norm_vs_fresh": "reuse/grad_norm_vs_fresh", "masked": "respo/trust_masked_frac",
    "zero_coef": "starvation/zero_coef_token_frac", "coef_pos": "starvation/grad_throughput/pos",
    "coef_neg": "starvation/grad_throughput/neg", "phi_pos": "respo/phi_mean/pos", "phi_neg": "respo/phi_mean/neg",
    "kl": "offpolicy/kl", "log_w_mean": "offpolicy/log_weight/mean",
}  # fmt: skip


def run_setting(run: dict) -> str:
    """A run's setting with its learning rate (``R4 lr1e-4``, ``R4 lr3.5e-5``): the records name ``R``, and the peak
    of the logged schedule is the learning rate it ran at (folders of one ``R`` at several learning rates read
    together). Records that logged no learning rate keep ``R`` alone."""
    lr = max((h["learning_rate"] for h in run["history"] if h.get("learning_rate") is not None), default=None)
    if lr is None:
        return run["setting"]
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{run['setting']} lr{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def by_pass(run: dict, first: int = 1, last: int | None = None) -> list[dict]:
    """Mean of :data:`PASS_KEYS` by pass over each batch (1 = fresh), over updates ``first..last``."""
    rows = [h for h in run["history"] if first <= h["step"] <= (last or h["step"])]
    out = []
    for p in range(1, run["reuse"] + 1):
        chunk = [h for h in rows if round(h.get("reuse/pass", (h["step"] - 1) % run["reuse"] + 1)) == p]
        means = {}
        for name, key in PASS_KEYS.items():
            values = [h[key] for h in chunk if h.get(key) is not None and math.isfinite(h[key])]
            means[name] = statistics.fmean(values) if values else None
        out.append(means)
    return out


def safety(results: list[dict], reference: str = CLIPPED) -> dict:
    """The rule, per setting and arm against ``reference`` (dapo), paired by seed: the mean paired difference of
    final held-out accuracy with its 95% t interval (safe needs its lower end >= -SAFE_MARGIN), and the seeds where
    the arm falls more than FALL points below its peak while dapo on the same seed does not (safe needs none)."""
    from benchmarks.common import paired

    settings: dict[str, dict[str, dict[int, dict]]] = {}
    for r in results:
        settings.setdefault(run_setting(r), {}).setdefault(r["loss"], {})[r["seed"]] = r
    out = {}
    for setting, losses in settings.items():
        ref = losses.get(reference, {})
        entry = {"arms": {}}
        for loss, runs in sorted(losses.items()):
            per_seed = {}
            for seed, r in sorted(runs.items()):
                peak, fall, at = largest_fall(r["curve"])
                per_seed[seed] = {"before": r["before"], "final": r["after"], "peak": peak, "fall": fall, "fall_at": at}
                if fall > FALL and seed in ref:  # around the fall: this arm and dapo, same seed, same updates
                    peak_step = max((p for p in r["curve"] if p["step"] < at), key=lambda p: p["accuracy"])["step"]
                    window = {"before_peak": (max(1, peak_step - 47), peak_step), "peak_to_fall": (peak_step + 1, at)}
                    per_seed[seed]["around_fall"] = {
                        name: {"updates": span, "arm": _mean_passes([by_pass(r, *span)]),
                               "reference": _mean_passes([by_pass(ref[seed], *span)])}
                        for name, span in window.items()
                    }  # fmt: skip
            arm = {"per_seed": per_seed, "final_mean": statistics.fmean(100 * r["after"] for r in runs.values()),
                   "by_pass": _mean_passes([by_pass(r) for r in runs.values()])}  # fmt: skip
            if loss != reference and ref:
                diff = paired({s: r["after"] for s, r in runs.items()}, {s: r["after"] for s, r in ref.items()})
                falls = [s for s in diff["seeds"] if per_seed[s]["fall"] > FALL
                         and largest_fall(ref[s]["curve"])[1] <= FALL]  # fmt: skip
                level = diff["ci"] is not None and diff["ci"][0] >= -SAFE_MARGIN
                arm.update(minus_reference=diff, falls_where_reference_does_not=falls, level_holds=level,
                           safe=level and not falls)  # fmt: skip
            entry["arms"][loss] = arm
        out[setting] = entry
    return out


CANDIDATE, INCUMBENT = "respo_first", "respo_current"  # section 2.7.1's arms: respo_epoch_weight first_pass / current
ADOPT_GAIN, ADOPT_LOSS = 3.0, -3.0  # points: the gain at R = 4, lr 1e-4 (interval above 0), the loss allowed at 3e-5


def confirmation(settings: dict) -> dict | None:
    """Section 2.7.1's rule (written before its runs), on :func:`safety`'s reading: per setting, ``respo_first -
    respo_current`` paired by seed; the default becomes ``"auto"`` iff at ``R = 4``, lr 1e-4 the mean is at least
    +ADOPT_GAIN with the interval above 0, and at ``R = 4``, lr 3e-5 the mean is above ADOPT_LOSS. ``None`` when no
    setting holds both arms."""
    from benchmarks.common import paired

    def finals(arm: dict) -> dict[int, float]:
        return {seed: v["final"] for seed, v in arm["per_seed"].items()}

    diffs = {setting: paired(finals(entry["arms"][CANDIDATE]), finals(entry["arms"][INCUMBENT]))
             for setting, entry in settings.items() if {CANDIDATE, INCUMBENT} <= set(entry["arms"])}  # fmt: skip
    if not diffs:
        return None

    high, recipe_lr = diffs.get("R4 lr1e-4"), diffs.get("R4 lr3e-5")
    gain = high is not None and high["ci"] is not None and high["mean"] >= ADOPT_GAIN and high["ci"][0] > 0
    kept = recipe_lr is not None and recipe_lr["mean"] is not None and recipe_lr["mean"] > ADOPT_LOSS
    return {"first_minus_current": diffs, "gain_at_R4_lr1e-4": gain, "no_loss_at_R4_lr3e-5": kept,
            "adopt_auto": gain and kept, "complete": high is not None and recipe_lr is not None}  # fmt: skip


def _mean_passes(tables: list[list[dict]]) -> list[dict]:
    """Seed mean of :func:`by_pass` tables (one per run)."""
    out = []
    for p in range(min(len(t) for t in tables)):
        row = {}
        for name in PASS_KEYS:
            values = [t[p][name] for t in tables if t[p][name] is not None]
            row[name] = statistics.fmean(values) if values else None
        out.append(row)
    return out


def answer_forms(problems: list[str], answers: list[list]) -> dict:
    """How greedy held-out answers fail, on the built-in task's chains (``a+b=c,c+d=e \\boxed{e}``): shares of
    all answers that are right; wrong with a wrong step sum (``a+b`` written as not ``c``); wrong with a wrong operand
    (a step adds a term that is not the problem's next one, or starts from another value than the last sum); wrong
    with a boxed answer that is not the last sum; unparsable (no box, or no chain); and the mean length in tokens."""
    import re

    counts = dict.fromkeys(("right", "wrong_sum", "wrong_operand", "wrong_box", "unparsable", "other_wrong"), 0)
    for problem, (text, right, _tokens) in zip(problems, answers):
        if right:
            counts["right"] += 1
            continue
        box = re.search(r"\\boxed\{(-?\d+)\}", text)
        steps = re.findall(r"(-?\d+)([+-])(\d+)=(-?\d+)", text)
        if not box or not steps:
            counts["unparsable"] += 1
            continue
        terms = [int(t) for t in re.findall(r"\d+", problem)]
        sums = any((int(a) + int(b) if op == "+" else int(a) - int(b)) != int(c) for a, op, b, c in steps)
        operand = [int(b) for _, _, b, _ in steps] != terms[1:] or int(steps[0][0]) != terms[0] or any(
            int(steps[i][0]) != int(steps[i - 1][3]) for i in range(1, len(steps)))  # fmt: skip
        if sums:
            counts["wrong_sum"] += 1
        elif operand:
            counts["wrong_operand"] += 1
        elif int(box.group(1)) != int(steps[-1][3]):
            counts["wrong_box"] += 1
        else:
            counts["other_wrong"] += 1
    n = max(len(answers), 1)
    return {**{k: v / n for k, v in counts.items()}, "n": len(answers),
            "mean_tokens": statistics.fmean(a[2] for a in answers) if answers else None}  # fmt: skip


def heldout_problems(extra: list[str], n: int) -> list[str]:
    """The first ``n`` held-out problems of the recipe's embedded default with ``extra`` overrides (the curve's)."""
    from respo_trl import recipe

    script_args, _, _ = recipe.parse_args(["--tiny_model", "dense", *extra, "--output_dir", "unused"])
    _, heldout = recipe.build_datasets(script_args)
    return [p[-1]["content"] for p in heldout["prompt"][:n]]


def write_safety(folders: list[str], out: Path, argv) -> dict:
    """``safety.json`` (the rule per setting and arm, passes, answer forms at the peak and at the end), the docs
    tables and ``safety.png`` (held-out curves per seed, dapo against each arm; coefficients by pass)."""
    import gzip

    results = [run for d in folders for run in load_runs(Path(d, "arms")).values()]
    settings = safety(results)
    problems = heldout_problems([], 200)
    for d in folders:  # answer forms of each arm at its peak point and at its last curve point (200 problems)
        for f in sorted(Path(d, "arms").glob("*" + ANSWERS_SUFFIX)):
            answers = json.loads(gzip.open(f, "rt").read())
            run = load_run(str(f).replace(ANSWERS_SUFFIX, ".json"))
            steps = [int(k) for k in answers]
            peak_step = max((p for p in run["curve"] if p["step"] in steps), key=lambda p: p["accuracy"])["step"]
            forms = {"peak": {"step": peak_step, **answer_forms(problems, answers[str(peak_step)])},
                     "last": {"step": max(steps), **answer_forms(problems, answers[str(max(steps))])}}  # fmt: skip
            settings[run_setting(run)]["arms"][run["loss"]]["per_seed"][run["seed"]]["answers"] = forms
    reading = {"settings": settings, "confirmation": confirmation(settings)}
    reading["config"] = {"folders": folders, "margin_points": SAFE_MARGIN, "fall_points": FALL, "reference": CLIPPED,
                         "machine": machine_info(), "command": command("reuse_lm", argv)}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    # one line without spaces: ~9,000 numbers that tools read (its tables are safety.md), 40% smaller than indented
    (out / "safety.json").write_text(json.dumps(reading, default=str, separators=(",", ":")))
    plot_safety(reading, out / "safety.png")
    print(safety_markdown(reading))
    return reading


def plot_safety(reading: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = reading["settings"]
    fig, axes = plt.subplots(2, len(settings), figsize=(5.5 * len(settings), 8), squeeze=False)
    for col, setting in enumerate(settings):
        arms = settings[setting]["arms"]
        ax = axes[0][col]
        for loss, arm in arms.items():
            finals = [100 * v["final"] for v in arm["per_seed"].values()]
            ax.scatter([loss] * len(finals), finals, color=COLORS.get(loss, "k"), alpha=0.7)
            ax.hlines(statistics.fmean(finals), -0.3 + list(arms).index(loss), 0.3 + list(arms).index(loss),
                      color=COLORS.get(loss, "k"))  # fmt: skip
        ax.set(title=f"{setting}: final held-out accuracy per seed", ylabel="%")
        ax.tick_params(axis="x", rotation=30)
        ax = axes[1][col]
        for loss, arm in arms.items():
            passes = arm["by_pass"]
            ax.plot(range(1, len(passes) + 1), [p["coef_pos"] for p in passes], "o-", color=COLORS.get(loss, "k"),
                    label=f"{loss} +")  # fmt: skip
            ax.plot(range(1, len(passes) + 1), [p["coef_neg"] for p in passes], "s--", color=COLORS.get(loss, "k"),
                    label=f"{loss} -")  # fmt: skip
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(title="mean coefficient by pass (+: correct answers, -: wrong)", xlabel="pass over the batch (1 = fresh)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def safety_markdown(reading: dict) -> str:
    lines = ["| setting | arm | final (%), mean | per seed: peak -> final (largest fall) | minus dapo (points, 95% interval) "
             "| falls > 15 where dapo does not | safe |", "|---|---|---:|---|---|---|---|"]  # fmt: skip
    for setting, entry in reading["settings"].items():
        for loss, arm in entry["arms"].items():
            seeds = "; ".join(f"{s}: {v['peak']:.0f} -> {100 * v['final']:.1f} ({v['fall']:.0f})" for s, v in arm["per_seed"].items())
            diff = arm.get("minus_reference")
            d = "" if not diff or diff["ci"] is None else f"{diff['mean']:+.1f} [{diff['ci'][0]:+.1f}, {diff['ci'][1]:+.1f}]"
            safe = "" if "safe" not in arm else ("yes" if arm["safe"] else "no")
            lines.append(f"| {setting} | {loss} | {arm['final_mean']:.1f} | {seeds} | {d} | "
                         f"{', '.join(map(str, arm.get('falls_where_reference_does_not', []))) or '-'} | {safe} |")  # fmt: skip
    confirm = reading.get("confirmation")
    if confirm:
        lines += ["", f"| setting | {CANDIDATE} - {INCUMBENT} (points, 95% interval) | per seed |", "|---|---|---|"]
        for setting, diff in confirm["first_minus_current"].items():
            if diff["mean"] is None:
                lines.append(f"| {setting} | no seed with both arms | |")
                continue
            ci = "" if diff["ci"] is None else f" [{diff['ci'][0]:+.1f}, {diff['ci'][1]:+.1f}]"
            seeds = "; ".join(f"{s}: {d:+.1f}" for s, d in diff["per_seed"].items())
            lines.append(f"| {setting} | {diff['mean']:+.1f}{ci} | {seeds} |")
        verdict = ("respo_epoch_weight='auto' becomes the default" if confirm["adopt_auto"]
                   else "the default stays respo_epoch_weight='current'")  # fmt: skip
        lines.append(f"\nSection 2.7.1's rule: gain at R4 lr1e-4 {confirm['gain_at_R4_lr1e-4']}, no loss at R4 lr3e-5 "
                     f"{confirm['no_loss_at_R4_lr3e-5']} -> {verdict}"
                     + ("" if confirm["complete"] else " (incomplete: a setting is missing)"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="docs/benchmarks/reuse_lm", help="Output folder (JSON, plots, per-arm runs).")
    p.add_argument("--work", default="outputs/reuse_lm", help="Warm-start checkpoints, per-arm logs, scratch space.")
    p.add_argument("--models", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    p.add_argument("--losses", nargs="+", default=list(LOSSES), choices=ALL_LOSSES)
    p.add_argument("--moe_losses", nargs="+", default=None, choices=ALL_LOSSES, help="Arms on MoE (default: --losses).")
    p.add_argument("--reuse", nargs="*", type=int, default=[1, 2, 4], help="Epoch settings R (none: no epoch arms).")
    p.add_argument("--staleness", nargs="*", type=int, default=[], help="Staleness settings N (the paper's reuse).")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--generations", type=int, default=60, help="Epoch arms: generation batches (the sampling budget).")
    p.add_argument("--updates", type=int, default=240, help="Staleness arms: policy updates (N x fewer generations).")
    p.add_argument("--eval_every", type=int, default=12, help="Epoch arms: held-out point every K generation batches.")
    p.add_argument("--eval_updates", type=int, default=48, help="Staleness arms: held-out point every K updates.")
    p.add_argument("--workers", type=int, default=2, help="Arms run at once (one torch thread each).")
    p.add_argument("--smoke", action="store_true", help="Tiny sizes for the test suite (seconds, numbers meaningless).")
    p.add_argument("--fresh", action="store_true", help="Ignore finished arms in OUT/arms and start over.")
    p.add_argument("--markdown-from", metavar="JSON", help="Print the docs tables of an existing result and exit.")
    p.add_argument("--summarize-from", metavar="DIR", nargs="+", help="Rebuild OUT's JSON/plots from finished arms.")
    p.add_argument("--passes-from", metavar="ARM_JSON", nargs="+", help="Print per-pass metrics of arms and exit.")
    p.add_argument("--safety-from", metavar="DIR", nargs="+", help="Section 2.7's rule, passes and answer forms of the "
                   "epochs arms in these folders, written to --out (safety.json, safety.png).")
    p.add_argument("--passes-steps", type=int, default=60, help="--passes-from: first N optimizer steps.")
    p.add_argument("recipe_args", nargs="*", help="Extra recipe overrides after '--', e.g. -- --learning_rate 2e-5")
    args = p.parse_args(argv)
    if any(v < 1 for v in args.reuse + args.staleness) or min(args.generations, args.updates, args.eval_every,
                                                               args.eval_updates) < 1:  # fmt: skip
        p.error("--reuse, --staleness, --generations, --updates, --eval_every and --eval_updates must be >= 1")
    bad = [n for n in args.staleness if args.updates % n]
    if bad:
        p.error(f"--updates {args.updates} must be a multiple of every --staleness value (not of {bad})")
    if not args.reuse and not args.staleness:
        p.error("nothing to run: give --reuse and/or --staleness values")
    args.moe_losses = args.moe_losses or args.losses
    return args


def arm_specs(args, extra: list[str], runs_dir: Path, warm_dir: Path, scratch: Path, logs: Path) -> list[dict]:
    settings = [(r, 1, "R") for r in args.reuse] + [(1, n, "N") for n in args.staleness]
    specs = []
    for model in args.models:
        losses = args.losses if model == "dense" else args.moe_losses
        for seed in args.seeds:
            for reuse, staleness, kind in settings:
                setting = setting_name(reuse, staleness, kind)
                if kind == "R":  # epochs: the same generation batches for every R
                    steps, eval_steps = args.generations * reuse, args.eval_every * reuse
                else:  # staleness: the same policy updates for every N
                    steps, eval_steps = args.updates, args.eval_updates
                run_losses = losses
                if (reuse, staleness) == (1, 1):  # on-policy: one run stands for every loss of SAME_ON_POLICY
                    shared = [loss for loss in losses if loss in SAME_ON_POLICY][:1]
                    run_losses = [loss for loss in losses if loss not in SAME_ON_POLICY] + shared
                for loss in run_losses:
                    specs.append({
                        "name": arm_name(model, loss, setting, seed), "model": model, "loss": loss, "reuse": reuse,
                        "staleness": staleness, "setting": setting, "seed": seed, "steps": steps,
                        "eval_steps": eval_steps, "extra": extra, "warm_path": str(warm_dir / f"{model}-seed{seed}"),
                        "runs_dir": str(runs_dir), "scratch": str(scratch), "logs_dir": str(logs),
                    })  # fmt: skip
    return specs


def write_summary(results: list[dict], args, argv, out: Path) -> dict:
    summary = summarize(results)
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("fresh",)}
    summary["machine"] = {**machine_info(), "workers": args.workers, "threads_per_worker": 1}
    summary["command"] = command("reuse_lm", sys.argv[1:] if argv is None else argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reuse_lm.json").write_text(json.dumps(summary, indent=1))
    plots = []
    models = sorted({arm["model"] for arm in summary["arms"].values()})
    for model in models:
        for kind in sorted({arm["setting"][0] for arm in summary["arms"].values() if arm["model"] == model}):
            suffix = ("" if model == "dense" else f"_{model}") + ("" if kind == "R" else "_staleness")
            path = out / f"reuse_lm{suffix}.png"
            plot(summary, model, kind, path)
            plots.append(str(path))
    print_table(summary)
    print(f"\nwrote {out / 'reuse_lm.json'} and {', '.join(plots)}")
    return summary


def main(argv=None) -> dict:
    args = parse(argv)
    if args.safety_from:
        return write_safety(args.safety_from, Path(args.out), sys.argv[1:] if argv is None else argv)
    if args.passes_from:
        keys = ("grad_norm", "clip_ratio/region_mean", "respo/trust_masked_frac", "offpolicy/log_weight/min", "entropy")
        print(f"{'arm':<28} {'pass':>4} " + " ".join(f"{k.split('/')[-1]:>14}" for k in keys))
        for path in args.passes_from:
            arm = load_run(path)
            for i, row in enumerate(per_pass(arm, args.passes_steps), 1):
                cells = " ".join(f"{row[k]:>14.4f}" if k in row else f"{'-':>14}" for k in keys)
                print(f"{arm['name']:<28} {i:>4} {cells}")
        return {}
    if args.markdown_from:
        summary = json.loads(Path(args.markdown_from).read_text())
        print(markdown(summary))
        return summary
    out = Path(args.out)
    if args.summarize_from:  # e.g. one figure from the arms of several runs (different learning rates need --out each)
        results = [run for d in args.summarize_from for run in load_runs(Path(d, "arms")).values()]
        return write_summary(results, args, argv, out)
    work = Path(args.work)
    runs_dir, warm_dir, scratch, logs = out / "arms", work / "warm", work / "scratch", work / "logs"
    if args.fresh:
        shutil.rmtree(runs_dir, ignore_errors=True)
    for d in (runs_dir, warm_dir, scratch, logs):
        d.mkdir(parents=True, exist_ok=True)
    extra = (SMOKE_ARGS if args.smoke else []) + list(args.recipe_args)
    # The recipe's defaults are the tiny preset; parse once here so bad overrides fail before any worker starts.
    from respo_trl import recipe

    recipe.parse_args(["--tiny_model", "dense", *extra, *LOSS_ARGS[args.losses[0]]])  # as an arm parses them

    specs = arm_specs(args, extra, runs_dir, warm_dir, scratch, logs)
    results = {name: run for name, run in load_runs(runs_dir).items() if name in {s["name"] for s in specs}}
    todo = [s for s in specs if s["name"] not in results]
    print(f"{len(specs)} arms, {len(results)} already done, {len(todo)} to run on {args.workers} workers")
    warm = {(s["model"], s["seed"]): s["warm_path"] for s in todo}  # one warm start per (model, seed), shared by arms
    for s in todo:
        s["needs"] = (s["model"], s["seed"])

    def finished(i, n, r, seconds):
        print(f"  [{i}/{n}] {r['name']}: held-out {100 * r['before']:.1f}% -> {100 * r['after']:.1f}%, "
              f"{r['generated_tokens'] / 1e3:.0f}k tokens, {r['wall_s']:.0f} s  ({seconds:.0f} s)", flush=True)

    run_pool(specs, run_arm, workers=args.workers, done=results,
             prepare={key: (warm_start, (key[0], key[1], extra, path)) for key, path in warm.items()},
             on_prepared=lambda key, path: print(f"  warm start ready: {path}", flush=True), on_result=finished)
    shutil.rmtree(scratch, ignore_errors=True)
    return write_summary([results[s["name"]] for s in specs], args, argv, out)


if __name__ == "__main__":
    main()
