"""Reuse that adapts (issue 44): does one drift threshold save generation where epochs are safe (lr 3e-5) and never
fall where they are not (lr 1e-4), for TRL's ``dapo`` and for ReSPO, at an equal budget of generated tokens?

Every run is the recipe's embedded default (the warm-started tiny dense Qwen3 on the built-in arithmetic task) at one
learning rate, one loss and one reuse setting, from that seed's warm start, stopped at the first batch boundary past
:data:`BUDGET` generated tokens (``--max_generated_tokens``), with a held-out point every tenth of the budget
(``--heldout_eval_tokens``) and the final one on all 500 held-out problems. Settings: fixed epochs ``R`` = 1, 2, 4,
and ``R = 4`` cut short by ``respo_adaptive_reuse`` (a KL or ESS threshold, the trainer's own option). The page,
with the design and the rules committed before any run: docs/benchmarks/adaptive_reuse.md.

    python -m benchmarks.adaptive_reuse pilot                   # the drift fixed epochs reached (section 2.7's records)
    python -m benchmarks.adaptive_reuse tune --workers 2        # 4 tuning seeds x every candidate, then the chooser
    python -m benchmarks.adaptive_reuse evaluate --workers 2    # 8 fresh seeds: R = 1, 2, 4 and the chosen setting
    python -m benchmarks.adaptive_reuse summary                 # the rule's reading, tables and plots, from the records
    python -m benchmarks.adaptive_reuse smollm2 --workers 2     # SmolLM2-135M, fixed R = 4 against the chosen setting
    python -m benchmarks.adaptive_reuse tune --smoke --out /tmp/ar --work /tmp/ar-work   # seconds: the tests' size

Resumable: a finished run's record (``OUT/<stage>/<name>.json``, naming its commit) is never rerun; one torch thread
per worker; warm starts, logs and scratch space go to ``--work``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    LOSS_ARGS,
    code_commit,
    command,
    compact_history,
    largest_fall,
    load_runs,
    machine_info,
    paired,
    run_pool,
    save_run,
    tokens_to_reach,
    warm_start,
)

OUT = Path("docs/benchmarks/adaptive_reuse")
LRS = (3e-5, 1e-4)
SAFE_LR, HARSH_LR = LRS  # where fixed epochs were measured safe / where they fell (reuse_lm.md 2.7.2)
LOSSES = ("dapo", "respo")
# Generated completion tokens per run: section 2's 60 rollout batches of 8 x 8 at R = 1 (113-115k, reuse_lm.md 2.4).
BUDGET = 115_000
CURVE_POINTS = 10  # a held-out point (200 problems) every BUDGET / CURVE_POINTS generated tokens
TUNING_SEEDS = (401, 402, 403, 404)
EVAL_SEEDS = (411, 412, 413, 414, 415, 416, 417, 418)
# The candidates the chooser picks from (docs/benchmarks/adaptive_reuse.md, section 1, says where they come from).
CANDIDATES = (("kl", 5e-4), ("kl", 1e-3), ("ess", 0.97), ("ess", 0.99))
FIXED = (1, 2, 4)
ADAPTIVE_R = 4
# The rule (section 2 of the page): safe when the lower end of the paired 95% interval of final accuracy minus R = 1's
# is at least -SAFE_MARGIN points (and so is the mean) and no seed falls more than FALL points below its peak where
# R = 1 on that seed does not; saving when the median over seeds of (tokens to reach R = 1's mean final minus
# TARGET_BELOW points) / (R = 1's generated tokens on that seed) is at most SAVING.
SAFE_MARGIN, FALL, TARGET_BELOW, SAVING = 3.0, 15.0, 2.0, 0.6
TIE = 0.05  # the chooser: savings within this are a tie
# Per-step metrics a record keeps (the signal's trace, the schedule, the cost).
TRACE_KEYS = (
    "reward", "grad_norm", "reuse/pass", "reuse/kl_before_pass", "reuse/ess_before_pass", "reuse/refreshes",
    "reuse/generated_tokens", "reuse/staleness_mean", "offpolicy/kl", "step_time", "learning_rate",
    "starvation/grad_throughput/pos", "starvation/grad_throughput/neg", "completions/mean_length",
)  # fmt: skip
SMOKE = {"budget": 600, "tuning_seeds": (1,), "eval_seeds": (1, 2), "candidates": (("kl", 1e-3),),
         "args": ["--warmstart_steps", "4", "--train_size", "64", "--heldout_size", "8", "--heldout_curve_size", "4",
                  "--tiny_hidden_size", "32", "--tiny_num_layers", "1", "--tiny_intermediate_size", "64",
                  "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "12"]}  # fmt: skip


def setting_name(reuse: int, signal: str | None = None, threshold: float | None = None) -> str:
    return f"R{reuse}" if signal is None else f"R{reuse}-{signal}{threshold:g}"


def run_name(setting: str, loss: str, lr: float, seed: int) -> str:
    return f"{setting}-{loss}-lr{lr:g}-s{seed}"


# ---------------------------------------------------------------------------------------------------------------------
# One run (in a worker process)
# ---------------------------------------------------------------------------------------------------------------------


def run_one(spec: dict) -> dict:
    """One recipe run from the seed's warm start to the token budget; writes and returns its record."""
    from respo_trl import recipe

    output_dir = os.path.join(spec["scratch"], spec["name"])
    shutil.rmtree(output_dir, ignore_errors=True)  # a run cut by a session's end starts again (minutes)
    adaptive = ["--respo_adaptive_reuse", spec["signal"], "--respo_adaptive_threshold", str(spec["threshold"])]
    argv = [
        *spec["extra"], *LOSS_ARGS[spec["loss"]], "--seed", str(spec["seed"]), "--learning_rate", str(spec["lr"]),
        "--num_iterations", str(spec["reuse"]), *(adaptive if spec["signal"] else []),
        "--max_steps", "100000", "--max_generated_tokens", str(spec["budget"]),
        "--heldout_eval_steps", "0", "--heldout_eval_tokens", str(spec["budget"] // CURVE_POINTS),
        "--keep_best_heldout", "false", "--warmstart_steps", "0", "--save_strategy", "no", "--output_dir", output_dir,
    ]  # fmt: skip
    script_args, training_args, model_args = recipe.parse_args(argv)
    script_args.tiny_model, model_args.model_name_or_path = None, spec["warm_path"]
    start, commit, started_at = time.time(), code_commit(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(spec["log"], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        report = recipe.main(script_args, training_args, model_args)
    history = [h for h in json.loads(Path(output_dir, "trainer_state.json").read_text())["log_history"] if "loss" in h]
    shutil.rmtree(output_dir, ignore_errors=True)
    curve = [{k: p[k] for k in ("step", "generated_tokens", "accuracy", "n") if k in p} for p in report["curve"]]
    peak, fall, fall_at = largest_fall(curve)
    passes = [h["reuse/pass"] for h in history if "reuse/pass" in h]
    record = {
        **{k: spec[k] for k in ("name", "stage", "setting", "loss", "lr", "seed", "reuse", "signal", "threshold", "budget")},
        "before": report["heldout"]["before"], "after": report["heldout"]["after"], "heldout_n": report["heldout"]["n"],
        "curve": curve, "peak": peak, "largest_fall": fall, "fall_at_step": fall_at,
        "generated_tokens": report["training"]["generated_tokens"], "updates": report["training"]["global_step"],
        "batches": 1 + sum(p == 1 for p in passes[1:]),  # a pass-1 step is a fresh batch's first
        "refreshes": int(max((h.get("reuse/refreshes", 0) for h in history), default=0)),
        "history": compact_history(history, TRACE_KEYS),
        "train_s": report["time_s"]["train"], "wall_s": time.time() - start, "commit": commit, "started_at": started_at,
    }  # fmt: skip
    return save_run(Path(spec["runs_dir"], spec["name"] + ".json"), record)


# ---------------------------------------------------------------------------------------------------------------------
# The runs of each stage
# ---------------------------------------------------------------------------------------------------------------------


def specs_for(args, stage: str, settings: list[tuple[int, str | None, float | None]], seeds) -> list[dict]:
    """Seed-major (a partial stage pairs), then learning rate, setting, loss. ``R = 1`` runs once per (seed, lr): on
    policy every loss here is the plain gradient (tests/test_trainer.py checks ReSPO's equals dapo's), so its record
    stands for both losses."""
    specs = []
    for seed in seeds:
        for lr in LRS:
            for reuse, signal, threshold in settings:
                setting = setting_name(reuse, signal, threshold)
                for loss in (("dapo",) if reuse == 1 else LOSSES):
                    name = run_name(setting, loss, lr, seed)
                    specs.append({
                        "name": name, "stage": stage, "setting": setting, "loss": loss, "lr": lr, "seed": seed,
                        "reuse": reuse, "signal": signal, "threshold": threshold, "budget": args.budget,
                        "extra": args.extra, "warm_path": str(Path(args.work, "warm", f"dense-seed{seed}")),
                        "runs_dir": str(Path(args.out, stage)), "scratch": str(Path(args.work, "scratch")),
                        "log": str(Path(args.work, "logs", name + ".log")), "needs": seed,
                    })  # fmt: skip
    return specs


def run_stage(args, stage: str, specs: list[dict]) -> dict[str, dict]:
    for folder in (Path(args.out, stage), Path(args.work, "warm"), Path(args.work, "scratch"), Path(args.work, "logs")):
        folder.mkdir(parents=True, exist_ok=True)
    done = {k: v for k, v in load_runs(Path(args.out, stage)).items() if k in {s["name"] for s in specs}}
    todo = [s for s in specs if s["name"] not in done]
    print(f"{stage}: {len(specs)} runs, {len(done)} done, {len(todo)} to run on {args.workers} workers", flush=True)
    warm = {s["seed"]: s["warm_path"] for s in todo}

    def finished(i, n, r, seconds):
        print(f"  [{i}/{n}] {r['name']}: held-out {100 * r['before']:.1f}% -> {100 * r['after']:.1f}% (peak "
              f"{r['peak']:.1f}, fall {r['largest_fall']:.1f}), {r['updates']} updates on {r['batches']} batches, "
              f"{r['generated_tokens'] / 1e3:.0f}k tokens, {r['wall_s']:.0f} s  ({seconds / 60:.0f} min)", flush=True)

    return run_pool(specs, run_one, workers=args.workers, done=done,
                    prepare={seed: (warm_start, ("dense", seed, args.extra, path)) for seed, path in warm.items()},
                    on_prepared=lambda seed, path: print(f"  warm start ready: {path}", flush=True),
                    on_result=finished)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------------------------------------------------


def by_seed(runs: dict[str, dict], setting: str, loss: str, lr: float) -> dict[int, dict]:
    loss = "dapo" if setting == "R1" else loss  # the on-policy record stands for every loss
    return {r["seed"]: r for r in runs.values() if r["setting"] == setting and r["loss"] == loss and r["lr"] == lr}


def reached(run: dict, target: float) -> float:
    """Generated tokens at which the run's held-out curve first reaches ``target`` (interpolated); inf if never."""
    points = [(p["generated_tokens"], 100 * p["accuracy"]) for p in run["curve"]]
    tokens = tokens_to_reach(points, target)
    return math.inf if tokens is None else tokens


def cell(runs: dict[str, dict], setting: str, loss: str, lr: float) -> dict | None:
    """One setting against ``R = 1`` for one loss at one learning rate, paired by seed: the level (final accuracy
    difference, points, 95% t interval), the falls R = 1 did not have, and at the safe rate the saving."""
    arm, ref = by_seed(runs, setting, loss, lr), by_seed(runs, "R1", loss, lr)
    seeds = sorted(set(arm) & set(ref))
    if not seeds:
        return None
    level = paired({s: arm[s]["after"] for s in seeds}, {s: ref[s]["after"] for s in seeds})
    falls = [s for s in seeds if arm[s]["largest_fall"] > FALL and ref[s]["largest_fall"] <= FALL]
    target = statistics.fmean(100 * ref[s]["after"] for s in seeds) - TARGET_BELOW
    fractions = [reached(arm[s], target) / ref[s]["generated_tokens"] for s in seeds]
    ref_fractions = [reached(ref[s], target) / ref[s]["generated_tokens"] for s in seeds]
    return {
        "seeds": seeds, "final": statistics.fmean(100 * arm[s]["after"] for s in seeds),
        "r1_final": statistics.fmean(100 * ref[s]["after"] for s in seeds), "level": level, "falls": falls,
        "safe": level["ci"] is not None and level["mean"] >= -SAFE_MARGIN and level["ci"][0] >= -SAFE_MARGIN
        and not falls,
        "target": target, "token_fraction": statistics.median(fractions), "per_seed_fraction": fractions,
        "r1_token_fraction": statistics.median(ref_fractions),
        "updates": statistics.fmean(arm[s]["updates"] for s in seeds),
        "batches": statistics.fmean(arm[s]["batches"] for s in seeds),
        "passes_per_batch": statistics.fmean(arm[s]["updates"] / arm[s]["batches"] for s in seeds),
        "generated_tokens": statistics.fmean(arm[s]["generated_tokens"] for s in seeds),
    }  # fmt: skip


def reading(runs: dict[str, dict], setting: str) -> dict:
    """The rule for one setting: safe at both rates and saving at the safe rate, for both losses."""
    cells = {f"{loss} lr{lr:g}": cell(runs, setting, loss, lr) for loss in LOSSES for lr in LRS}
    if any(c is None for c in cells.values()):
        return {"cells": cells, "safe": None, "saves": None, "pays": None}
    safe = all(c["safe"] for c in cells.values())
    saves = all(cells[f"{loss} lr{SAFE_LR:g}"]["token_fraction"] <= SAVING for loss in LOSSES)
    return {"cells": cells, "safe_at_harsh_lr": all(cells[f"{loss} lr{HARSH_LR:g}"]["safe"] for loss in LOSSES),
            "safe": safe, "saves": saves, "pays": safe and saves}  # fmt: skip


def choose(runs: dict[str, dict], candidates) -> dict:
    """The chooser (page, section 1), on the tuning seeds, with the mean difference standing in for the interval:
    a candidate qualifies with no unmatched fall in any cell, a mean final at least -SAFE_MARGIN from R = 1's in every
    cell and a saving of at most SAVING for both losses; of those, the most saving (the larger of its two losses'
    fractions, ties within TIE go to the KL signal, then to the larger threshold). If none qualifies: the candidate
    without unmatched falls (any, if every candidate has one) whose worst cell's mean difference is largest."""
    rows = []
    for signal, threshold in candidates:
        setting = setting_name(ADAPTIVE_R, signal, threshold)
        cells = {f"{loss} lr{lr:g}": cell(runs, setting, loss, lr) for loss in LOSSES for lr in LRS}
        if any(c is None for c in cells.values()):
            continue
        worst = min(c["level"]["mean"] for c in cells.values())
        saving = max(cells[f"{loss} lr{SAFE_LR:g}"]["token_fraction"] for loss in LOSSES)
        falls = sum(len(c["falls"]) for c in cells.values())
        rows.append({"signal": signal, "threshold": threshold, "setting": setting, "worst_mean_difference": worst,
                     "saving": saving, "unmatched_falls": falls,
                     "qualifies": falls == 0 and worst >= -SAFE_MARGIN and saving <= SAVING, "cells": cells})  # fmt: skip
    if not rows:
        return {"candidates": rows, "chosen": None, "qualified": False}
    qualified = [r for r in rows if r["qualifies"]]
    if qualified:
        best = min(r["saving"] for r in qualified)
        tied = [r for r in qualified if r["saving"] <= best + TIE]
        chosen = max(tied, key=lambda r: (r["signal"] == "kl", r["threshold"] if r["signal"] == "kl" else -r["threshold"]))
    else:
        pool = [r for r in rows if r["unmatched_falls"] == 0] or rows
        chosen = max(pool, key=lambda r: r["worst_mean_difference"])
    return {"candidates": rows, "chosen": {"signal": chosen["signal"], "threshold": chosen["threshold"],
                                           "setting": chosen["setting"]}, "qualified": bool(qualified)}  # fmt: skip


def step_cost(runs: dict[str, dict]) -> dict:
    """The check's cost as a ratio of step time, from runs of one stage (side by side on the same machine): the mean
    ``step_time`` of the adaptive arm's reuse steps, which include the check's forward, over the fixed ``R = 4`` arm's
    reuse steps on the same seed, loss and learning rate (generation steps left out of both); median over pairs."""
    ratios = []
    for r in runs.values():
        if not r["signal"]:
            continue
        fixed = next((f for f in runs.values() if f["setting"] == f"R{r['reuse']}" and f["loss"] == r["loss"]
                      and f["lr"] == r["lr"] and f["seed"] == r["seed"]), None)  # fmt: skip
        if fixed is None:
            continue

        def reuse_steps(run):
            rows = run["history"]
            return [h["step_time"] for h in rows if h.get("step_time") and h.get("reuse/pass", 1) > 1]

        a, b = reuse_steps(r), reuse_steps(fixed)
        if a and b:
            ratios.append(statistics.fmean(a) / statistics.fmean(b))
    return {"median_ratio": statistics.median(ratios) if ratios else None, "pairs": len(ratios)}


# ---------------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------------

# Where the candidates' thresholds come from: the drift each pass of fixed epochs reached in section 2.7's runs.
PILOT_FOLDERS = {SAFE_LR: "docs/benchmarks/reuse_lm/epochs_seeds/r4_lr3e-5/arms",
                 HARSH_LR: "docs/benchmarks/reuse_lm/epochs_seeds/r4_lr1e-4/arms"}  # fmt: skip


def pilot(args) -> dict:
    """Per pass of fixed ``R = 4`` (the check before pass p measures what the loss forward of pass p logs: the policy
    after p - 1 updates on the batch against the sampling one), the median and the 10th/90th percentiles over every
    logged step of ``dapo`` and ``respo`` on seeds 101-108: ``offpolicy/kl`` and ``offpolicy/ess``."""
    result = {}
    for lr, folder in PILOT_FOLDERS.items():
        runs = [r for r in load_runs(folder).values() if r["loss"] in LOSSES and r["reuse"] == 4]
        for key in ("offpolicy/kl", "offpolicy/ess"):
            for p in (2, 3, 4):
                values = sorted(h[key] for r in runs for h in r["history"]
                                if round(h.get("reuse/pass", 0)) == p and h.get(key) is not None)  # fmt: skip
                if values:
                    q = lambda f: values[min(len(values) - 1, int(f * len(values)))]  # noqa: E731
                    result[f"lr{lr:g} {key} pass {p}"] = {"p10": q(0.1), "median": q(0.5), "p90": q(0.9), "n": len(values)}
    Path(args.out, "pilot.json").write_text(json.dumps({"per_pass": result, "command": command("adaptive_reuse", args.argv)}, indent=1))
    print("| lr | signal | pass | p10 | median | p90 | steps |\n|---|---|---:|---:|---:|---:|---:|")
    for name, q in result.items():
        lr, key, _, p = name.split(" ")
        print(f"| {lr[2:]} | {key.split('/')[1]} | {p} | {q['p10']:.3g} | {q['median']:.3g} | {q['p90']:.3g} | {q['n']} |")
    return result



def tune(args) -> dict:
    settings = [(1, None, None), *((ADAPTIVE_R, sig, th) for sig, th in args.candidates)]
    runs = run_stage(args, "tuning", specs_for(args, "tuning", settings, args.tuning_seeds))
    result = {**choose(runs, args.candidates), "seeds": list(args.tuning_seeds),
              "command": command("adaptive_reuse", args.argv), "machine": machine_info()}  # fmt: skip
    Path(args.out, "tuning.json").write_text(json.dumps(result, indent=1))
    print(tuning_markdown(result))
    return result


def chosen_setting(args) -> tuple[str, float]:
    path = Path(args.out, "tuning.json")
    if not path.exists():
        raise SystemExit(f"no setting chosen yet ({path} is missing): run the tune stage first")
    chosen = json.loads(path.read_text())["chosen"]
    if chosen is None:
        raise SystemExit(f"{path} chose no setting (no candidate finished its tuning runs): rerun the tune stage")
    return chosen["signal"], chosen["threshold"]


def evaluate(args) -> dict:
    signal, threshold = chosen_setting(args)
    settings = [*((r, None, None) for r in FIXED), (ADAPTIVE_R, signal, threshold)]
    run_stage(args, "evaluation", specs_for(args, "evaluation", settings, args.eval_seeds))
    return summary(args)


# On SmolLM2-135M: a demonstration, one seed per arm, not evidence (docs/benchmarks/adaptive_reuse.md, section 5).
SMOLLM2 = {"task": "add2_30", "lr": 2e-5, "seed": 1, "updates": 48, "loss": "respo"}


def run_smollm2(spec: dict) -> dict:
    """SmolLM2-135M on the comparison's task and training shape (smollm2_staleness.md 6) with ``num_iterations = 4``,
    fixed or adaptive; records the per-step trace of the signal and the schedule (no held-out scoring)."""
    from benchmarks.smollm2_task import RL, task_args
    from respo_trl import recipe

    output_dir = os.path.join(spec["scratch"], spec["name"])
    shutil.rmtree(output_dir, ignore_errors=True)
    adaptive = ["--respo_adaptive_reuse", spec["signal"], "--respo_adaptive_threshold", str(spec["threshold"])]
    argv = [*task_args(spec["task"]), *RL, "--model_name_or_path", spec["model"], "--loss_type", spec["loss"],
            "--seed", str(spec["seed"]), "--learning_rate", str(spec["lr"]), "--num_iterations", "4",
            *(adaptive if spec["signal"] else []), "--max_steps", str(spec["updates"]), "--save_strategy", "no",
            "--output_dir", output_dir]  # fmt: skip
    start, commit, started_at = time.time(), code_commit(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(spec["log"], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        report = recipe.main(*recipe.parse_args(argv))
    history = [h for h in json.loads(Path(output_dir, "trainer_state.json").read_text())["log_history"] if "loss" in h]
    shutil.rmtree(output_dir, ignore_errors=True)
    passes = [h["reuse/pass"] for h in history if "reuse/pass" in h]
    record = {**{k: spec[k] for k in ("name", "task", "lr", "seed", "updates", "loss", "signal", "threshold")},
              "generated_tokens": report["training"]["generated_tokens"], "updates": report["training"]["global_step"],
              "batches": 1 + sum(p == 1 for p in passes[1:]),
              "refreshes": int(max((h.get("reuse/refreshes", 0) for h in history), default=0)),
              "history": compact_history(history, TRACE_KEYS), "train_s": report["time_s"]["train"],
              "wall_s": time.time() - start, "commit": commit, "started_at": started_at}  # fmt: skip
    return save_run(Path(spec["runs_dir"], spec["name"] + ".json"), record)


def smollm2(args) -> dict:
    from benchmarks.smollm2_task import MODEL

    signal, threshold = chosen_setting(args)
    out, work = Path(args.out, "smollm2"), Path(args.work, "smollm2")
    for folder in (out, work / "logs", work / "scratch"):
        folder.mkdir(parents=True, exist_ok=True)
    specs = [{**SMOLLM2, "name": name, "signal": sig, "threshold": th, "model": args.smollm2_model,
              "runs_dir": str(out), "scratch": str(work / "scratch"), "log": str(work / "logs" / f"{name}.log")}
             for name, sig, th in (("R4", None, None), (setting_name(ADAPTIVE_R, signal, threshold), signal, threshold))]  # fmt: skip
    if args.smoke:
        for spec in specs:
            spec.update(updates=4, model=args.smollm2_model)
    done = {k: v for k, v in load_runs(out).items() if k in {s["name"] for s in specs}}
    runs = run_pool(specs, run_smollm2, workers=args.workers, done=done)
    plot_smollm2(runs, threshold, signal, out / "smollm2.png")
    rows = {name: {"batches": r["batches"], "updates": r["updates"], "refreshes": r["refreshes"],
                   "generated_tokens": r["generated_tokens"], "train_s": r["train_s"]} for name, r in runs.items()}  # fmt: skip
    Path(out, "smollm2.json").write_text(json.dumps({"runs": rows, "model": MODEL, **SMOLLM2,
                                                     "command": command("adaptive_reuse", args.argv)}, indent=1))  # fmt: skip
    print(json.dumps(rows, indent=1))
    return rows


def plot_smollm2(runs: dict[str, dict], threshold: float, signal: str, path: Path) -> None:
    """The signal measured before each reuse pass against the threshold, and the pass each update served."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = f"reuse/{signal}_before_pass"
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for (name, run), color in zip(sorted(runs.items()), ("tab:gray", "tab:red")):
        rows = run["history"]
        points = [(h["step"], h[key]) for h in rows if h.get(key) is not None]
        label = name
        if not points and signal == "kl":  # fixed epochs run no check: the same KL, logged by each reuse pass's loss
            points = [(h["step"], h["offpolicy/kl"]) for h in rows if h.get("reuse/pass", 1) > 1 and h.get("offpolicy/kl")]
            label = f"{name}: offpolicy/kl of its reuse passes (no check runs)"
        axes[0].plot([p[0] for p in points], [p[1] for p in points], "o-", ms=3, color=color, label=label)
        axes[1].step([h["step"] for h in rows], [h.get("reuse/pass", 1) for h in rows], where="mid", color=color,
                     label=f"{name}: {run['batches']} batches for {run['updates']} updates")  # fmt: skip
    axes[0].axhline(threshold, color="black", ls="--", lw=1, label=f"threshold {threshold:g}")
    axes[0].set(xlabel="policy update", ylabel=key, title="SmolLM2-135M, one seed: the drift before each reuse pass",
                yscale="log" if signal == "kl" else "linear")  # fmt: skip
    axes[1].set(xlabel="policy update", ylabel="pass over its batch (1 = fresh)", title="passes served")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(args) -> dict:
    signal, threshold = chosen_setting(args)
    runs = load_runs(Path(args.out, "evaluation"))
    adaptive = setting_name(ADAPTIVE_R, signal, threshold)
    settings = [*(f"R{r}" for r in FIXED if r > 1), adaptive]
    result = {
        "chosen": {"signal": signal, "threshold": threshold, "setting": adaptive},
        "readings": {s: reading(runs, s) for s in settings}, "cost": step_cost(runs),
        "r1": {f"lr{lr:g}": {"final": [100 * r["after"] for r in by_seed(runs, "R1", "dapo", lr).values()]} for lr in LRS},
        "seeds": sorted({r["seed"] for r in runs.values()}), "runs": len(runs),
        "commits": sorted({r["commit"] for r in runs.values()}), "command": command("adaptive_reuse", args.argv),
        "rule": {"safe_margin_points": SAFE_MARGIN, "fall_points": FALL, "target_below_points": TARGET_BELOW,
                 "saving_fraction": SAVING, "budget_tokens": args.budget},
    }  # fmt: skip
    Path(args.out, "evaluation.json").write_text(json.dumps(result, indent=1, default=str))
    if runs:
        plot(runs, result, Path(args.out, "adaptive_reuse.png"))
    print(evaluation_markdown(result))
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Tables and the plot
# ---------------------------------------------------------------------------------------------------------------------


def _interval(level: dict) -> str:
    if level["ci"] is None:
        return "n/a"
    return f"{level['mean']:+.1f} [{level['ci'][0]:+.1f}, {level['ci'][1]:+.1f}]"


def tuning_markdown(result: dict) -> str:
    lines = ["| candidate | worst cell: mean final - R = 1 (points) | saving at lr 3e-5 (max over losses) | "
             "unmatched falls | qualifies |", "|---|---:|---:|---:|---|"]  # fmt: skip
    for r in result["candidates"]:
        lines.append(f"| {r['signal']} {r['threshold']:g} | {r['worst_mean_difference']:+.1f} | {r['saving']:.2f} | "
                     f"{r['unmatched_falls']} | {'yes' if r['qualifies'] else 'no'} |")  # fmt: skip
    chosen = result["chosen"]
    lines.append("")
    lines.append(f"chosen: {chosen['signal']} {chosen['threshold']:g}" if chosen else "chosen: none")
    return "\n".join(lines)


def evaluation_markdown(result: dict) -> str:
    lines = ["| setting | loss | lr | final % (R = 1) | final - R = 1, points [95% CI] | falls R = 1 lacks | "
             "tokens to R = 1's final - 2, / R = 1's tokens (R = 1 itself) | updates / batches | safe |",
             "|---|---|---|---:|---|---|---|---|---|"]  # fmt: skip
    for setting, read in result["readings"].items():
        for name, c in read["cells"].items():
            if c is None:
                continue
            loss, lr = name.split(" ")
            lines.append(f"| {setting} | {loss} | {lr[2:]} | {c['final']:.1f} ({c['r1_final']:.1f}) | "
                         f"{_interval(c['level'])} | {c['falls'] or 'none'} | {c['token_fraction']:.2f} "
                         f"({c['r1_token_fraction']:.2f}) | {c['updates']:.0f} / {c['batches']:.0f} | "
                         f"{'yes' if c['safe'] else 'no'} |")  # fmt: skip
    lines.append("")
    for setting, read in result["readings"].items():
        lines.append(f"- {setting}: safe at both rates: {read['safe']}; saves at lr 3e-5: {read['saves']}; "
                     f"pays: {read['pays']}")
    cost = result["cost"]
    if cost["median_ratio"] is not None:
        lines.append(f"- the check's cost: reuse steps take {cost['median_ratio']:.2f}x a fixed-R reuse step "
                     f"(median over {cost['pairs']} pairs)")
    return "\n".join(lines)


COLORS = {"R1": "black", "R2": "tab:blue", "R4": "tab:orange"}


def plot(runs: dict[str, dict], result: dict, path: Path) -> None:
    """Per learning rate and loss: seed-mean held-out accuracy against generated tokens for every setting; and the
    adaptive arm's passes per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    adaptive = result["chosen"]["setting"]
    fig, axes = plt.subplots(len(LRS), len(LOSSES) + 1, figsize=(15, 4.2 * len(LRS)), squeeze=False)
    for row, lr in enumerate(LRS):
        for col, loss in enumerate(LOSSES):
            ax = axes[row][col]
            for setting in ("R1", "R2", "R4", adaptive):
                seeds = by_seed(runs, setting, loss, lr)
                if not seeds:
                    continue
                length = min(len(r["curve"]) for r in seeds.values())
                xs = [statistics.fmean(r["curve"][i]["generated_tokens"] for r in seeds.values()) / 1e3 for i in range(length)]
                ys = [statistics.fmean(100 * r["curve"][i]["accuracy"] for r in seeds.values()) for i in range(length)]
                ax.plot(xs, ys, marker="o", ms=3, color=COLORS.get(setting, "tab:red"),
                        label=f"{setting} ({len(seeds)} seeds)", lw=2.5 if setting == adaptive else 1.2)  # fmt: skip
            ax.set(title=f"{loss}, lr {lr:g}", xlabel="generated tokens (k)", ylabel="held-out accuracy (%), seed mean")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        ax = axes[row][-1]
        for loss, color in zip(LOSSES, ("tab:blue", "tab:red")):
            per_batch = [r["updates"] / r["batches"] for r in by_seed(runs, adaptive, loss, lr).values()]
            ax.scatter([loss] * len(per_batch), per_batch, color=color)
        ax.set(title=f"{adaptive}: passes per batch, lr {lr:g}", ylim=(0.8, ADAPTIVE_R + 0.2), ylabel="updates / batches")
        ax.grid(alpha=0.3)
    fig.suptitle(f"adaptive reuse on the tiny model, {result['rule']['budget_tokens'] / 1e3:.0f}k generated tokens per run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["pilot", "tune", "evaluate", "summary", "smollm2"])
    p.add_argument("--out", default=str(OUT), help="Records, JSON, tables and plot (committed).")
    p.add_argument("--work", default="outputs/adaptive_reuse", help="Warm starts, logs, scratch space.")
    p.add_argument("--workers", type=int, default=2, help="Runs at once (one torch thread each).")
    p.add_argument("--smoke", action="store_true", help="Tiny sizes for the test suite (seconds, numbers meaningless).")
    p.add_argument("--smollm2_model", default="outputs/smollm2-135m-instruct-q4", help="smollm2 stage: the checkpoint")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    smoke = args.smoke
    args.budget = SMOKE["budget"] if smoke else BUDGET
    args.tuning_seeds = SMOKE["tuning_seeds"] if smoke else TUNING_SEEDS
    args.eval_seeds = SMOKE["eval_seeds"] if smoke else EVAL_SEEDS
    args.candidates = SMOKE["candidates"] if smoke else CANDIDATES
    args.extra = SMOKE["args"] if smoke else []
    return args


def main(argv=None):
    args = parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return {"pilot": pilot, "tune": tune, "evaluate": evaluate, "summary": summary, "smollm2": smollm2}[args.stage](args)


if __name__ == "__main__":
    main()
