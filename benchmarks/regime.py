"""The paper's regime on a CPU: long, high-entropy responses, sparse correct answers, staleness N = 32.

The paper's claim lives where stale *correct* responses drift to low sequence weight ``W`` (22.8% of positives below
``log W = -1`` at N = 32): there clipped GRPO, GSPO and VESPO starve them and ReSPO does not. The tiny LM of
``reuse_lm.py`` never got there (0-8%). This benchmark builds a task that can (``respo_trl.builtin.task`` with long
``+`` chains, a teacher that forgets carries and reward-irrelevant *nuisance* choices on every step), checks that it
does before comparing anything, then runs the comparison. Three stages, each resumable (a finished run is never
rerun; ``--fresh`` starts a stage over):

1. ``gate``: the regime map. For each task setting (short/no nuisance as the demo, long, long with nuisance, longer
   with nuisance) one warm start is profiled before RL (per-token entropy at temperature 1, nats per response, length,
   accuracy) and TRL ``dapo`` runs the first half of the comparison's updates at N = 32. The gate statistic is the
   share of positive responses with ``log W < -1`` over those updates, pooled (and by staleness position). A setting
   passes inside [15%, 30%] (the paper: 22.8%); the first passing setting of ``GATE_ORDER`` is the comparison's.
2. ``compare``: in the gated setting, every arm at the paper's reuse (``respo_updates_per_rollout = 32``, each sample
   once), equal updates, shared warm starts per seed, the same prompt order: TRL ``dapo`` (0.2 / 0.2, and 0.2 / 0.28),
   VESPO, GSPO (3e-4 / 4e-4), ReSPO, ReSPO with ``phi+ = 1`` and an on-policy ``N = 1`` reference. Refused when the
   gate did not pass, unless ``--override-gate``.
3. ``summary``: ``regime.json`` (gate, per-arm per-seed numbers, paired differences against ReSPO, the decision
   rule's verdict), tables and plots, from whatever has finished.

    python -m benchmarks.regime gate                       # ~1.5 h on 2 cores
    python -m benchmarks.regime compare                    # ~12 h on 2 cores, resumable across sessions
    python -m benchmarks.regime compare --arms dapo respo --seeds 0 1   # a slice
    python -m benchmarks.regime summary                    # JSON, tables and plots from the finished runs
    python -m benchmarks.regime compare --out docs/benchmarks/regime/posthoc/x --gate-dir docs/benchmarks/regime/gate \
        --lr 7e-5 --arms respo --seeds 1 3                 # post-hoc, away from the gate's choice: no verdict
    python -m benchmarks.regime summary --markdown         # the docs tables (docs/benchmarks.md, section 5)
    python -m benchmarks.regime gate --smoke --out /tmp/regime   # seconds; what the test suite runs

Every run is the recipe (``recipes/qwen3_respo.py``) through ``ReSPOTrainer``, one torch thread per worker; the
decision rule is written in docs/benchmarks.md (section 5) before the runs and applied by :func:`verdict`.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

from benchmarks.common import (
    LOSS_ARGS,
    command,
    machine_info,
    paired,
    per_update_kl,
    pooled_positive_branch,
    spread,
    t_quantile,
)
from benchmarks.regime_runs import (
    COLORS,
    N_PAPER,
    SETTINGS,
    SMOKE,
    base_spec,
    first_half,
    load_runs,
    low_weight_by_staleness,
    run_all,
    run_stats,
    settings_for,
)

# ---------------------------------------------------------------------------------------------------------------------
# What runs (the settings, the RL setting every run shares and the runs themselves: regime_runs.py)
# ---------------------------------------------------------------------------------------------------------------------

# The regime map: (setting, learning rate). The comparison takes the first of GATE_ORDER that passes.
GATE_RUNS = [("short", 1e-4), ("long", 1e-4), ("long-nuisance", 1e-4), ("longer-nuisance", 1e-4), ("long-nuisance", 3e-5),
             ("long-notes", 1e-4)]  # fmt: skip
GATE_ORDER = [("long-notes", 1e-4), ("long-nuisance", 1e-4), ("long", 1e-4), ("longer-nuisance", 1e-4),
              ("long-nuisance", 3e-5), ("short", 1e-4)]  # fmt: skip
GATE_BAND = (0.15, 0.30)  # share of positives with log W < -1 over the first half (the paper: 22.8%)
ARMS = {
    # name: (recipe loss arguments, N, seeds)
    "dapo": (LOSS_ARGS["dapo"], N_PAPER, 5),  # TRL's default clip, 0.2 / 0.2
    "vespo": (LOSS_ARGS["vespo"], N_PAPER, 5),  # TRL's defaults (k, lambda) = (2, 3) / (3, 2)
    "respo": (LOSS_ARGS["respo"], N_PAPER, 5),  # the paper's kernel, paper-pure (no trust mask: each sample once)
    "respo_pos1": (LOSS_ARGS["respo_pos1"], N_PAPER, 5),  # phi+ = 1 (beta_pos = 0), the lab's ablation
    "gspo": (LOSS_ARGS["gspo"], N_PAPER, 3),  # TRL's documented 3e-4 / 4e-4 (tuned for N ~ 4)
    "onpolicy": (LOSS_ARGS["dapo"], 1, 3),  # N = 1 at equal updates (and equal completions)
    "dapo_clip_higher": (["--loss_type", "dapo", "--epsilon_high", "0.28"], N_PAPER, 3),  # DAPO's clip-higher
}
BASELINES = ("dapo", "dapo_clip_higher", "vespo", "gspo")  # the rule's "best baseline" is the best of these
RULE = {"min_gain_points": 3.0, "fail_below_points": 1.0, "confidence": 0.95, "seeds": 5}


# ---------------------------------------------------------------------------------------------------------------------
# The decision rule (docs/benchmarks.md, section 5, written before the runs)
# ---------------------------------------------------------------------------------------------------------------------


def seeds_to_resolve(mean: float, sd: float) -> dict:
    """Seeds after which, at the observed mean and sd, the interval would settle the rule either way (None: never)."""

    def first_n(ok):
        return next((n for n in range(2, 201) if ok(t_quantile(n - 1) * sd / math.sqrt(n))), None)

    holds = first_n(lambda half: mean - half > 0) if mean >= RULE["min_gain_points"] else None
    fails = first_n(lambda half: mean + half < RULE["fail_below_points"]) if mean < RULE["fail_below_points"] else None
    return {"to_hold": holds, "to_fail": fails}


def verdict(gate_passed: bool, scores: dict[str, dict[int, float]]) -> dict:
    """Apply the rule: ``holds`` if ReSPO minus the best baseline is >= +3 points on the late-mean score with a 95%
    paired interval above 0 (over at least 5 seeds) and ReSPO beats ``phi+ = 1`` on the same seeds; ``fails`` if the
    gate passed and the interval's upper end is below +1; ``inconclusive`` otherwise, with the seeds that would
    resolve it. ``scores``: arm -> {seed: late-mean score in [0, 1]}."""
    # the best baseline is judged on ReSPO's seeds only: a seed that ReSPO has not run yet must not tip the choice
    respo_seeds = set(scores.get("respo", {}))
    means = {b: statistics.fmean(v for s, v in scores[b].items() if s in respo_seeds)
             for b in BASELINES if respo_seeds & set(scores.get(b, {}))}  # fmt: skip
    out = {"gate_passed": gate_passed, "rule": RULE, "best_baseline": None, "verdict": "inconclusive"}
    if not means:
        out["reason"] = "ReSPO or every baseline is missing"
        return out
    best = max(means, key=means.get)
    vs_best, vs_pos1 = paired(scores["respo"], scores[best]), paired(scores["respo"], scores.get("respo_pos1", {}))
    out.update(best_baseline=best, vs_best=vs_best, vs_pos1=vs_pos1)
    enough = len(vs_best["seeds"]) >= RULE["seeds"]
    ci = vs_best["ci"]
    beats_pos1 = vs_pos1["mean"] is not None and vs_pos1["mean"] > 0
    if not gate_passed:
        out["reason"] = "the gate did not pass: the comparison is outside the paper's regime"
    elif enough and ci and vs_best["mean"] >= RULE["min_gain_points"] and ci[0] > 0 and beats_pos1:
        out["verdict"], out["reason"] = "holds", f"ReSPO - {best} >= +3 points, interval above 0, ReSPO beats phi+ = 1"
    elif enough and ci and ci[1] < RULE["fail_below_points"]:
        out["verdict"], out["reason"] = "fails", f"the interval of ReSPO - {best} ends below +1 point"
    else:
        out["reason"] = "neither" if enough else f"{len(vs_best['seeds'])} paired seeds (the rule needs {RULE['seeds']})"
    if vs_best["sd"] is not None and out["verdict"] == "inconclusive":
        out["seeds_to_resolve"] = seeds_to_resolve(vs_best["mean"], vs_best["sd"])
    return out


def posthoc_reason(gate: dict, setting: str | None, lr: float | None) -> str | None:
    """Why the decision rule does not apply to a comparison run away from the gate's choice (another learning rate or
    setting: a post-hoc experiment), or None. The rule was written for the gated configuration only; applying it
    elsewhere would turn an exploratory run into a verdict."""
    chosen = gate.get("chosen")
    if not chosen or setting is None or lr is None:
        return None  # no choice to depart from: the rule itself reports an unpassed gate
    if setting == chosen["setting"] and math.isclose(lr, chosen["lr"], rel_tol=1e-9):
        return None
    return (f"post-hoc: {setting} at lr {lr:g} is not the gate's choice ({chosen['setting']} at lr {chosen['lr']:g}); "
            "the decision rule is not applied")


# ---------------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------------


def gate_name(setting: str, lr: float) -> str:
    return f"{setting}-lr{lr:g}"


def gate_specs(args) -> list[dict]:
    runs = [(s, lr) for s, lr in GATE_RUNS if s in settings_for(args)]
    if args.points:
        unknown = set(args.points) - {gate_name(s, lr) for s, lr in runs}
        if unknown:
            raise SystemExit(f"--points {sorted(unknown)}: not points of the map ({[gate_name(s, lr) for s, lr in runs]})")
        runs = [(s, lr) for s, lr in runs if gate_name(s, lr) in args.points]
    specs = []
    for setting, lr in runs:
        spec = base_spec(args, setting, seed=0)
        name = gate_name(setting, lr)
        spec.update(name=name, stage="gate", arm="dapo", lr=lr, loss_args=LOSS_ARGS["dapo"], evaluate=False,
                    updates=spec["updates"] // 2, runs_dir=str(Path(args.out, "gate")))  # fmt: skip
        specs.append(spec)
    return specs


def gate_summary(args, runs: dict[str, dict], known_profiles: dict[str, dict] | None = None) -> dict:
    """The regime map: per (setting, lr) the profile before RL and the low-weight share under dapo, and the choice.
    ``known_profiles`` (by map point) stand in for warm-start profiles that are not on this machine (a summary
    regenerated elsewhere keeps the profiles its ``regime.json`` already holds)."""
    rows = []
    for setting, lr in GATE_RUNS:
        run = runs.get(gate_name(setting, lr))
        if run is None:
            continue
        profile_path = Path(base_spec(args, setting, 0)["warm_path"], "regime_profile.json")
        profile = (json.loads(profile_path.read_text()) if profile_path.exists()
                   else (known_profiles or {}).get(gate_name(setting, lr)))  # fmt: skip
        stats = low_weight_by_staleness(run, run["history"])  # the gate run is the first half
        pooled = pooled_positive_branch(run["history"])
        share = pooled["share"]
        rows.append({
            "name": gate_name(setting, lr), "setting": setting, "lr": lr, **{k: SETTINGS.get(setting, {}).get(k) for k in
            ("terms", "nuisance", "teacher_error")}, "profile": profile, "updates": run["updates"], "N": run["N"],
            "low_weight_share": share, "positives": pooled["n"], "low_weight_by_staleness": stats,
            "per_update_kl": per_update_kl(run), "log_w_mean_k16": run_stats(run)["log_w_mean_k16"],
            "passes": share == share and GATE_BAND[0] <= share <= GATE_BAND[1],
        })  # fmt: skip
    by_name = {r["name"]: r for r in rows}
    chosen = next((by_name[gate_name(s, lr)] for s, lr in GATE_ORDER if gate_name(s, lr) in by_name
                   and by_name[gate_name(s, lr)]["passes"]), None)  # fmt: skip
    needed_kl = None
    points = sorted((r["per_update_kl"]["per_token"], r["low_weight_share"]) for r in rows
                    if r["per_update_kl"]["per_token"] and r["low_weight_share"] == r["low_weight_share"]
                    and r["setting"] != "short")  # fmt: skip
    if chosen is None and len(points) >= 2:  # the per-update KL at which the long settings would reach the band
        needed_kl = _interpolate_x(points, sum(GATE_BAND) / 2)
    return {"band": list(GATE_BAND), "paper_share": 0.228, "map": rows, "passed": chosen is not None,
            "chosen": None if chosen is None else {"setting": chosen["setting"], "lr": chosen["lr"]},
            "per_update_kl_needed": needed_kl}  # fmt: skip


def _interpolate_x(points: list[tuple[float, float]], y: float) -> float | None:
    """x at which the piecewise-linear curve through ``points`` (sorted by x) reaches ``y`` (None if it never does)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if min(y0, y1) <= y <= max(y0, y1) and y1 != y0:
            return x0 + (x1 - x0) * (y - y0) / (y1 - y0)
    return None


def compare_specs(args, setting: str, lr: float) -> list[dict]:
    """The comparison's runs, in the order that makes a partial result most useful: first the arms the decision rule
    needs at 5 seeds, seed by seed (every finished seed is paired across them), then the 3-seed arms."""
    arms = [a for a in ARMS if a in args.arms]

    def seeds_of(arm):
        return list(args.seeds) if args.seeds is not None else list(range(1 if args.smoke else ARMS[arm][2]))

    primary = [a for a in arms if ARMS[a][2] >= RULE["seeds"]]
    order = []
    for group in (primary, [a for a in arms if a not in primary]):
        for seed in sorted({s for arm in group for s in seeds_of(arm)}):
            order += [(arm, seed) for arm in group if seed in seeds_of(arm)]
    specs = []
    for arm, seed in order:
        loss_args, n, _ = ARMS[arm]
        spec = base_spec(args, setting, seed)
        if n == 1:
            spec["N"] = 1
        spec.update(name=f"{arm}-N{spec['N']}-seed{seed}", stage="compare", arm=arm, lr=lr, loss_args=loss_args,
                    evaluate=True, runs_dir=str(Path(args.out, "arms")))  # fmt: skip
        specs.append(spec)
    return specs


# ---------------------------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------------------------


def compare_summary(runs: dict[str, dict]) -> dict:
    """Per arm: per-seed numbers and their spread; the positive-branch diagnostic pooled over every seed's first half
    (own batches; for dapo also ReSPO's and VESPO's weights on dapo's batches); paired differences against ReSPO."""
    by_arm: dict[str, dict[int, dict]] = {}
    for run in runs.values():
        by_arm.setdefault(run["arm"], {})[run["seed"]] = run
    arms = {}
    for arm in [a for a in ARMS if a in by_arm]:
        seeds = by_arm[arm]
        stats = {seed: run_stats(run) for seed, run in sorted(seeds.items())}
        pooled = pooled_positive_branch([h for run in seeds.values() for h in first_half(run)])
        per_seed = {
            seed: {
                "late_mean": s["late_mean"], "greedy_after": (s["heldout"] or {}).get("greedy_after"),
                "sampled_after": (s["heldout"] or {}).get("sampled_after"),
                "low_weight_share": s["positive_branch"]["share"], "mass_ratio": s["positive_branch"]["mass_ratio"],
                "pos_length_growth": s["pos_length_growth"], "grad_norm": s["grad_norm"],
                "per_update_kl": s["per_update_kl"]["per_token"], "cycle_kl": s["per_update_kl"]["cycle"],
                "pos_neg_ratio": s["pos_neg_ratio"], "clip_ratio": s["clip_ratio"], "wall_s": s["wall_s"],
            }
            for seed, s in stats.items()
        }  # fmt: skip
        arms[arm] = {
            "loss_args": next(iter(seeds.values()))["loss_args"], "N": next(iter(seeds.values()))["N"],
            "seeds": sorted(seeds), "per_seed": per_seed,
            **{key: spread([v[key] for v in per_seed.values()]) for key in (
                "late_mean", "greedy_after", "sampled_after", "pos_length_growth", "grad_norm", "per_update_kl",
                "cycle_kl", "pos_neg_ratio", "clip_ratio", "wall_s")},
            "positive_branch": pooled,
            "generated_tokens": statistics.fmean(r["generated_tokens"] for r in seeds.values()),
            "updates": next(iter(seeds.values()))["updates"],
        }  # fmt: skip
    scores = {arm: {s: v["late_mean"] for s, v in a["per_seed"].items() if v["late_mean"] is not None}
              for arm, a in arms.items()}  # fmt: skip
    if "respo" in scores:
        for arm, a in arms.items():
            if arm != "respo":
                a["respo_minus_this"] = paired(scores["respo"], scores[arm])
                sampled = {s: v["sampled_after"] for s, v in a["per_seed"].items() if v["sampled_after"] is not None}
                respo_sampled = {s: v["sampled_after"] for s, v in arms["respo"]["per_seed"].items()
                                 if v["sampled_after"] is not None}  # fmt: skip
                a["respo_minus_this_heldout_sampled"] = paired(respo_sampled, sampled)
    return {"arms": arms, "scores": scores}


def against(summary: dict, reference: dict) -> list[dict]:
    """A post-hoc comparison's arms against a reference one (the pre-registered comparison), seed by seed: the
    late-mean score of each arm here minus each arm there on their common seeds (points, as :func:`paired`), with the
    per-update KL of both, so a change of learning rate can be read at its policy movement."""

    def per_seed(arm: dict, key: str) -> dict[int, float]:  # JSON keys are strings, fresh summaries' are ints
        return {int(s): v[key] for s, v in arm["per_seed"].items() if v.get(key) is not None}

    rows = []
    for name, arm in summary["comparison"]["arms"].items():
        for ref_name, ref in reference["comparison"]["arms"].items():
            d = paired(per_seed(arm, "late_mean"), per_seed(ref, "late_mean"))
            if d["seeds"]:
                row = {"arm": name, "reference": ref_name, **d}
                for key in ("per_update_kl", "cycle_kl"):  # one step, and a cycle's last quarter (where kernels differ)
                    here, there = per_seed(arm, key), per_seed(ref, key)
                    row[key] = {s: here.get(s) for s in d["seeds"]}
                    row[f"reference_{key}"] = {s: there.get(s) for s in d["seeds"]}
                rows.append(row)
    return rows


def write_summary(args, out: Path) -> dict:
    gate_runs = load_runs(gate_dir(args))
    compare_runs = load_runs(Path(out, "arms"))
    previous = Path(out, "regime.json")
    known = {r["name"]: r["profile"] for r in json.loads(previous.read_text())["gate"]["map"]} if previous.exists() else {}
    gate = gate_summary(args, gate_runs, known)
    comparison = compare_summary(compare_runs) if compare_runs else {"arms": {}, "scores": {}}
    setting = next(iter(compare_runs.values()))["setting"] if compare_runs else None
    lr = next(iter(compare_runs.values()))["lr"] if compare_runs else None
    posthoc = posthoc_reason(gate, setting, lr)
    summary = {
        "gate": gate,
        "comparison": {"setting": setting, "lr": lr, "N": N_PAPER, "arms": comparison["arms"],
                       "updates": next(iter(compare_runs.values()))["updates"] if compare_runs else None},
        "verdict": verdict(gate["passed"], comparison["scores"]) if comparison["scores"] and not posthoc else None,
        "posthoc": posthoc,
        "machine": {**machine_info(), "workers": args.workers, "threads_per_worker": 1},
        "command": command("regime", sys.argv[1:]),
    }
    if args.against:
        reference = json.loads(Path(args.against, "regime.json").read_text())
        summary["against"] = {"dir": str(args.against), "lr": reference["comparison"]["lr"],
                              "rows": against(summary, reference)}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "regime.json").write_text(json.dumps(summary, indent=1))
    own_gate = gate_dir(args).resolve() == Path(out, "gate").resolve()  # a borrowed gate is plotted where it lives
    plots = [plot_gate(summary, out / "regime_gate.png")] if gate["map"] and own_gate else []
    if comparison["arms"]:
        plots.append(plot_comparison(summary, compare_runs, out / "regime_comparison.png"))
    print(markdown(summary))
    print(f"\nwrote {out / 'regime.json'}" + (f" and {', '.join(map(str, plots))}" if plots else ""))
    return summary


def plot_gate(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, row in enumerate(summary["gate"]["map"]):
        color = f"C{i}"
        per_k = row["low_weight_by_staleness"]["per_k"]
        ks = sorted(per_k, key=int)
        ax.plot([int(k) for k in ks], [100 * per_k[k]["share"] for k in ks], ".", ms=3, color=color, alpha=0.35)
        bins = row["low_weight_by_staleness"]["bins"]  # pooled over 8 positions: the per-position points are noisy
        centers = [sum(map(int, name.split("-"))) / 2 for name in bins]
        ax.plot(centers, [100 * b["share"] for b in bins.values()], "o-", lw=2, color=color,
                label=f"{row['name']}: {100 * row['low_weight_share']:.1f}%")  # fmt: skip
    lo, hi = summary["gate"]["band"]
    ax.axhspan(100 * lo, 100 * hi, color="gold", alpha=0.2, label="gate band (pooled share)")
    ax.axhline(22.8, color="k", lw=0.8, ls="--", label="paper, N = 32: 22.8%")
    ax.set(xlabel="staleness k (updates since sampled); lines: pooled over 8 positions, dots: each position",
           ylabel="positives with log W < -1 (%)",
           title="Regime gate: TRL dapo, N = 32, first half of the updates, seed 0")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _windows(run: dict, width: int = N_PAPER) -> list[tuple[float, float, float]]:
    """(updates, generated tokens, training score) per window of ``width`` updates (one N = 32 rollout batch)."""
    out = []
    tokens = 0.0
    rows = run["history"]
    for start in range(0, run["updates"], width):
        window = [h for h in rows if start < h["step"] <= start + width]
        rewards = [h["reward"] for h in window if "reward" in h]
        tokens = max([h.get("reuse/generated_tokens", tokens) for h in window] + [tokens])
        if rewards:
            out.append((start + width, tokens, statistics.fmean(rewards)))
    return out


def plot_comparison(summary: dict, runs: dict[str, dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = summary["comparison"]["arms"]
    # seed means are only comparable over the same seeds (the warm starts differ a lot): an arm that lacks some of
    # ReSPO's seeds, or has others, is drawn dashed and its label lists its seeds
    respo_seeds = sorted(arms.get("respo", {}).get("per_seed", {}))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for arm in arms:
        curves = [_windows(r) for r in runs.values() if r["arm"] == arm]
        seeds = sorted(arms[arm]["per_seed"])
        length = min(len(c) for c in curves)
        mean = lambda i, j: statistics.fmean(c[i][j] for c in curves)  # noqa: E731
        label = f"{arm} (N = {arms[arm]['N']}; seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"
        for ax, x in ((axes[0], 0), (axes[1], 1)):
            ax.plot([mean(i, x) / (1e6 if x else 1) for i in range(length)], [100 * mean(i, 2) for i in range(length)],
                    marker="o", ms=3, color=COLORS.get(arm), label=label,
                    ls="-" if seeds == respo_seeds else "--")  # fmt: skip
    axes[0].set(xlabel="policy updates", ylabel="training score (accuracy, %), seed mean, per 32 updates",
                title="dashed: not on ReSPO's seeds (not comparable)")  # fmt: skip
    axes[1].set(xlabel="generated tokens (M)", ylabel="training score (%)")
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    others = [a for a in arms if a != "respo" and arms[a].get("respo_minus_this", {}).get("mean") is not None]
    shown = []  # what sets the y-range: every seed's point, and the intervals over 3 or more seeds (a 2-seed t
    # interval has 1 degree of freedom, is ten times wider, and would flatten the rest; it is drawn, off the scale)
    for i, arm in enumerate(others):
        d = arms[arm]["respo_minus_this"]
        ax.scatter([i] * len(d["per_seed"]), list(d["per_seed"].values()), color=COLORS.get(arm), s=14)
        shown += list(d["per_seed"].values())
        if d["ci"]:
            ax.errorbar([i + 0.15], [d["mean"]], yerr=[[d["mean"] - d["ci"][0]], [d["ci"][1] - d["mean"]]], fmt="k_",
                        capsize=4)  # fmt: skip
            if len(d["per_seed"]) >= 3:
                shown += list(d["ci"])
    if shown:
        lo, hi = min(shown + [0.0, RULE["min_gain_points"]]), max(shown + [0.0, RULE["min_gain_points"]])
        ax.set_ylim(lo - 0.1 * (hi - lo) - 0.5, hi + 0.1 * (hi - lo) + 0.5)
    ax.axhline(0, color="gray", lw=0.8)
    ax.axhline(RULE["min_gain_points"], color="tab:red", lw=0.8, ls="--", label="+3 points (the rule)")
    ax.set_xticks(range(len(others)), others, rotation=20, fontsize=8)
    ax.set(ylabel="ReSPO minus arm, late-mean score (points)", title="paired by seed; bars: mean, 95% interval")
    ax.legend(fontsize=8)
    setting = summary["comparison"]["setting"]
    v = (summary.get("verdict") or {}).get("verdict", "n/a")
    fig.suptitle(f"The paper's regime on the tiny LM: {setting}, lr {summary['comparison']['lr']:g}, N = 32, "
                 f"{summary['comparison']['updates']} updates; verdict: {v}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _p(x, scale=100.0, digits=1, sign=False, unit=""):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{scale * x:{'+' if sign else ''}.{digits}f}{unit}"


def _pm(stats, scale=100.0, digits=1, unit=""):
    if not stats or stats.get("mean") is None:
        return "n/a"
    return f"{scale * stats['mean']:.{digits}f} ± {scale * stats['std']:.{digits}f}{unit}"


def markdown(summary: dict) -> str:
    gate = summary["gate"]
    lines = ["Regime map (TRL `dapo`, N = 32, first half of the updates, seed 0; profile: warm start before RL, "
             "training prompts at temperature 1):", "",
             "| setting | lr | terms | nuisance | teacher error | T=1 accuracy | nats/token | nats/response | length "
             "| positives | low-W share (pooled) | by staleness 0-7 / 8-15 / 16-23 / 24-31 | mean log W, k >= 16 "
             "| KL per token after 1 update / after 24-31 updates | gate |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]  # fmt: skip
    for r in gate["map"]:
        t1 = (r["profile"] or {}).get("train_t1", {})
        bins = " / ".join(_p(b["share"]) for b in r["low_weight_by_staleness"]["bins"].values())
        kl = r["per_update_kl"]
        lines.append(
            f"| {r['setting']} | {r['lr']:g} | {r['terms'][0]}-{r['terms'][1]} "
            f"| {'notes' if r['nuisance'] == 'notes' else 'yes' if r['nuisance'] else 'no'} "
            f"| {r['teacher_error']:g} | {_p(t1.get('accuracy'), unit='%')} | {_p(t1.get('entropy_per_token'), 1, 3)} "
            f"| {_p(t1.get('entropy_per_response'), 1, 1)} | {_p(t1.get('mean_length'), 1, 0)} | {r['positives']:.0f} "
            f"| {_p(r['low_weight_share'], unit='%')} | {bins} | {_p(r['log_w_mean_k16'], 1, 2)} "
            f"| {_p(kl['per_token'], 1, 5)} / {_p(kl.get('cycle'), 1, 4)} | {'**pass**' if r['passes'] else 'no'} |"
        )
    chosen = gate["chosen"]
    lines += ["", f"Gate: {'passed, ' + chosen['setting'] + ' at lr ' + format(chosen['lr'], 'g') if chosen else 'no setting passed'}"
              + ("" if chosen or gate["per_update_kl_needed"] is None else
                 f"; per-update KL needed (interpolated): {gate['per_update_kl_needed']:.5f} per token")]  # fmt: skip
    arms = summary["comparison"]["arms"]
    if arms:
        lines += ["", f"Comparison ({summary['comparison']['setting']}, lr {summary['comparison']['lr']:g}, "
                  f"{summary['comparison']['updates']} updates):", "",
                  "| arm | N | seeds | late-mean score (%) | per seed (%) | held-out greedy (%) | held-out avg@8, T=1 (%) "
                  "| low-W share / mass share / ratio (own, first half) | ReSPO / VESPO ratio on these batches "
                  "| positive length growth | grad norm | KL per token after 1 update / after 24-31 updates "
                  "| weight on positives / negatives, k >= 16 | clipped fraction | wall (s) |",
                  "|---|---:|---:|---:|---|---:|---:|---|---|---:|---:|---|---:|---:|---:|"]  # fmt: skip
        for arm, a in arms.items():
            pb = a["positive_branch"]
            per_seed = " / ".join(_p(v["late_mean"]) for _, v in sorted(a["per_seed"].items()))
            lines.append(
                f"| {arm} | {a['N']} | {len(a['seeds'])} | {_pm(a['late_mean'])} | {per_seed} | {_pm(a['greedy_after'])} "
                f"| {_pm(a['sampled_after'])} | {_p(pb['share'], unit='%')} / {_p(pb['mass_share'], unit='%')} / {_p(pb['mass_ratio'], 1, 2)} "
                f"| {_p(pb['respo_mass_ratio'], 1, 2)} / {_p(pb['vespo_mass_ratio'], 1, 2)} "
                f"| {_pm(a['pos_length_growth'], unit='%')} | {_pm(a['grad_norm'], 1, 3)} "
                f"| {_pm(a['per_update_kl'], 1, 5)} / {_pm(a.get('cycle_kl'), 1, 4)} | {_pm(a.get('pos_neg_ratio'), 1, 2)} "
                f"| {_pm(a['clip_ratio'], 100, 2, unit='%')} | {_pm(a['wall_s'], 1, 0)} |"
            )
        # seeds differ in their warm starts (and so in how far they are in the regime): per seed, every arm
        seeds = sorted({s for a in arms.values() for s in a["per_seed"]})
        lines += ["", "Per seed: late-mean score (%) / low-W share of positives, own batches, first half (%):", "",
                  "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]  # fmt: skip
        for arm, a in arms.items():
            cells = [a["per_seed"].get(s) for s in seeds]
            lines.append(f"| {arm} | " + " | ".join(
                "" if c is None else f"{_p(c['late_mean'])} / {_p(c['low_weight_share'])}" for c in cells) + " |")  # fmt: skip
        lines += ["", "| ReSPO minus | seeds | per seed (points) | mean | 95% interval | held-out avg@8: mean (interval) |",
                  "|---|---|---|---:|---|---|"]  # fmt: skip
        for arm, a in arms.items():
            d, h = a.get("respo_minus_this"), a.get("respo_minus_this_heldout_sampled")
            if not d or d["mean"] is None:
                continue
            ci = "n/a" if not d["ci"] else f"[{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}]"
            hci = "" if not h or not h["ci"] else f" ([{h['ci'][0]:+.1f}, {h['ci'][1]:+.1f}])"
            per = " / ".join(f"{v:+.1f}" for _, v in sorted(d["per_seed"].items()))
            lines.append(f"| {arm} | {len(d['seeds'])} | {per} | {d['mean']:+.1f} | {ci} "
                         f"| {'n/a' if not h or h['mean'] is None else format(h['mean'], '+.1f')}{hci} |")  # fmt: skip
    if summary.get("against"):
        ref = summary["against"]
        lines += ["", (f"Against `{ref['dir']}` (lr {ref['lr']:g}): late-mean score, the arm here minus the arm there, "
                       "by seed (points); KL per token to the rollout policy after 24-31 updates (x 1e-3), here / "
                       "there, by seed (the movement over a cycle, where kernels differ):"), "",
                  "| arm here | minus | seeds | per seed (points) | mean | 95% interval | KL after 24-31 updates, here / there |",
                  "|---|---|---|---|---:|---|---|"]  # fmt: skip
        for r in ref["rows"]:
            seeds = sorted(r["per_seed"], key=int)
            kl = " ; ".join(f"{_p(r.get('cycle_kl', {}).get(s), 1e3, 1)} / {_p(r.get('reference_cycle_kl', {}).get(s), 1e3, 1)}"
                            for s in seeds)  # fmt: skip
            per = " / ".join(f"{r['per_seed'][s]:+.1f}" for s in seeds)
            ci = "n/a" if not r["ci"] else f"[{r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}]"
            lines.append(f"| {r['arm']} | {r['reference']} | {', '.join(map(str, seeds))} | {per} | {r['mean']:+.1f} | {ci} | {kl} |")
    v = summary.get("verdict")
    if summary.get("posthoc"):
        lines += ["", f"Verdict: none ({summary['posthoc']})"]
    if v:
        lines += ["", f"Verdict: **{v['verdict']}** (best baseline: {v['best_baseline']}; {v.get('reason', '')})"
                  + (f"; seeds to resolve at the observed spread: {v['seeds_to_resolve']}" if v.get("seeds_to_resolve") else "")]  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("stage", choices=["gate", "compare", "summary"], help="What to run (see the module docstring).")
    p.add_argument("--out", default="docs/benchmarks/regime", help="Output folder: gate/, arms/, regime.json, plots.")
    p.add_argument("--work", default="outputs/regime", help="Warm starts (with their profiles), logs, scratch space.")
    p.add_argument("--gate-dir", default=None, help="compare/summary: the gate's runs (default: OUT/gate). A post-hoc "
                   "comparison in another --out reuses the committed gate; away from the gate's choice no verdict is given.")
    p.add_argument("--against", default=None, help="compare/summary: a reference comparison's folder (its regime.json; "
                   "e.g. docs/benchmarks/regime): each arm here minus each arm there, by seed, with both per-update KLs.")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="compare: the arms to run.")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="compare: seeds (default: each arm's count).")
    p.add_argument("--setting", default=None, help="compare: task setting (default: the gate's choice).")
    p.add_argument("--lr", type=float, default=None, help="compare: learning rate (default: the gate's choice).")
    p.add_argument("--override-gate", action="store_true", help="compare: run although no setting passed the gate.")
    p.add_argument("--points", nargs="+", default=None, help="gate: only these points of the map (e.g. long-lr0.0001).")
    p.add_argument("--workers", type=int, default=2, help="Runs at once (one torch thread each).")
    p.add_argument("--smoke", action="store_true", help="Tiny sizes for the test suite (seconds, numbers meaningless).")
    p.add_argument("--fresh", action="store_true", help="Forget this stage's finished runs and start over.")
    p.add_argument("--markdown", action="store_true", help="summary: print the docs tables only.")
    p.add_argument("recipe_args", nargs="*", help="Extra recipe overrides after '--' (every run of the stage).")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.setting is not None and args.setting not in SETTINGS:
        p.error(f"--setting must be one of {sorted(SETTINGS)}, got {args.setting!r}")
    if args.gate_dir is not None and not Path(args.gate_dir).is_dir():
        p.error(f"--gate-dir {args.gate_dir!r} is not a folder (the gate's runs, e.g. docs/benchmarks/regime/gate)")
    if args.against is not None and not Path(args.against, "regime.json").is_file():
        p.error(f"--against {args.against!r} has no regime.json (a comparison's folder, e.g. docs/benchmarks/regime)")
    return args


def gate_dir(args) -> Path:
    return Path(args.gate_dir) if args.gate_dir else Path(args.out, "gate")


def main(argv=None) -> dict:
    args = parse(argv)
    out = Path(args.out)
    if args.stage == "summary":
        if args.markdown:
            summary = json.loads((out / "regime.json").read_text())
            print(markdown(summary))
            return summary
        return write_summary(args, out)
    from respo_trl import recipe  # TRL: seconds to import, which the summary does without

    recipe.parse_args(["--tiny_model", "dense", *(SMOKE["args"] if args.smoke else []), *args.recipe_args])
    if args.stage == "gate":
        runs_dir = out / "gate"
        if args.fresh:
            shutil.rmtree(runs_dir, ignore_errors=True)
        run_all(args, gate_specs(args), runs_dir)
        return write_summary(args, out)
    gate_runs = load_runs(gate_dir(args))
    gate = gate_summary(args, gate_runs)
    setting, lr = args.setting, args.lr
    if gate["chosen"] is None and not args.override_gate:
        print(markdown({"gate": gate, "comparison": {"arms": {}}}))
        raise SystemExit(
            "no task setting passed the regime gate (the map is above): the comparison would say nothing about the "
            "paper's claim. Run `python -m benchmarks.regime gate` first, or pass --override-gate (with --setting and --lr) to run it anyway."
        )
    if gate["chosen"] is not None:
        setting = setting or gate["chosen"]["setting"]
        lr = lr or gate["chosen"]["lr"]
    if setting is None or lr is None:
        raise SystemExit("--override-gate needs --setting and --lr (no setting passed the gate to take them from)")
    if setting not in settings_for(args):
        raise SystemExit(f"--setting {setting!r} is not a setting of this run ({sorted(settings_for(args))})")
    runs_dir = out / "arms"
    if args.fresh:
        shutil.rmtree(runs_dir, ignore_errors=True)
    run_all(args, compare_specs(args, setting, lr), runs_dir)
    return write_summary(args, out)


if __name__ == "__main__":
    main()
