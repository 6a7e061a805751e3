"""Why VESPO leads at N = 32 in the paper's regime: the pre-registered mechanism runs
(docs/benchmarks/regime_mechanism.md 5.5).

The regime comparison (``regime.py``, docs/benchmarks/regime.md 5.3) found VESPO ahead of ReSPO by 9.2 points on seeds
1-4. This benchmark tests four explanations on the same testbed, each new run paired with the stored 5.3 run of the
same seed (same warm start, same prompt order; the pairing is checked, not assumed):

* H1, the negative branch: ReSPO with VESPO's negative branch (``respo_negvespo``), VESPO with ``phi+ = 1``
  (``vespo_pos1``);
* H2, equal movement: ReSPO at the learning rate whose movement over a reuse cycle matches VESPO's, found on seed 1
  first (``respo_search``: lr 3e-5 and 2e-5), then seeds 1-4 (``respo_eqmove``);
* H3, whole groups: ``dapo``, VESPO and ReSPO with mini-batches of whole GRPO groups (``*_groups``);
* H4, on-policy at equal policy age: the ``N = 1`` reference on seeds 3-4 (1-2 are stored), scored at the policy
  ages of the N = 32 arms' late batches too.

The rule of each hypothesis is in docs/benchmarks/regime_mechanism.md 5.5 (written before the runs) and applied by
:func:`readings`.

    python -m benchmarks.regime_mechanism run                 # every run, in 5.5's order; resumable (~12 h on 2 cores)
    python -m benchmarks.regime_mechanism run --arms onpolicy --seeds 3   # a slice
    python -m benchmarks.regime_mechanism summary             # mechanism.json, tables and the plot, from what finished
    python -m benchmarks.regime_mechanism summary --markdown  # the docs tables
    python -m benchmarks.regime_mechanism check --arm dapo --seed 3   # this code reproduces a stored run's first updates
    python -m benchmarks.regime_mechanism run --smoke --stored /tmp/regime --out /tmp/mech   # seconds (the tests)

Runs are the regime's (``benchmarks/regime_runs.py``: the recipe through ``ReSPOTrainer``, one torch thread per
worker, warm starts shared with ``regime.py`` under ``--work``); finished runs are kept in ``OUT/arms`` and never
rerun.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

from benchmarks import regime_runs
from benchmarks.common import (
    LOSS_ARGS,
    REGIME_KEYS,
    command,
    compact_history,
    history_rows,
    kl_by_staleness,
    machine_info,
    load_run,
    load_runs,
    paired,
    per_update_kl,
    record_precision,
    run_pool,
    t_quantile,
    warm_start,
)
from benchmarks.regime_runs import base_spec, run_all, run_one, run_stats

SETTING, LR, N = "long-nuisance", 1e-4, regime_runs.N_PAPER
SEEDS = (1, 2, 3, 4)  # seed 0 learns under no arm (docs/benchmarks/regime.md 5.3)
GROUPS = ["--respo_whole_groups", "true"]
# name: (hypothesis, recipe loss arguments, N, seeds). Order = the order of the runs (5.5).
ARMS = {
    "onpolicy": ("H4", LOSS_ARGS["dapo"], 1, (3, 4)),
    "respo_negvespo": ("H1", ["--loss_type", "respo", "--respo_neg_branch", "vespo"], N, SEEDS),
    "vespo_pos1": ("H1", ["--loss_type", "respo", "--respo_beta_pos", "0", "--respo_neg_branch", "vespo"], N, SEEDS),
    "respo_groups": ("H3", [*LOSS_ARGS["respo"], *GROUPS], N, SEEDS),
    "vespo_groups": ("H3", [*LOSS_ARGS["vespo"], *GROUPS], N, SEEDS),
    "dapo_groups": ("H3", [*LOSS_ARGS["dapo"], *GROUPS], N, SEEDS),
    "respo_eqmove": ("H2", LOSS_ARGS["respo"], N, SEEDS),  # at the learning rate the search finds
}
SEARCH_LRS, SEARCH_SEED = (3e-5, 2e-5), 1  # H2: ReSPO on seed 1 first
POSTHOC_7E5 = Path("docs/benchmarks/regime/posthoc/respo-lr7e-05")  # ReSPO at 7e-5 (5.4): a point of the search curve
MARGIN = 3.0  # points: "within 3 points of VESPO" / the original rule's +3
AGES = (128, 160, 192, 224)  # policy ages of the N = 32 arms' late rollout batches (cycles 5-8 of 8)
AGE_WINDOW = (8, 7)  # H4: on-policy batches sampled by policies aged a - 8 .. a + 7
SMOKE = {"setting": "short", "seeds": (1,), "ages": (2,), "search_lrs": (3e-3,), "search_seed": 1}


# ---------------------------------------------------------------------------------------------------------------------
# What runs
# ---------------------------------------------------------------------------------------------------------------------


def run_name(arm: str, n: int, seed: int, lr: float | None = None) -> str:
    return f"{arm}{'' if lr is None else f'-lr{lr:g}'}-N{n}-seed{seed}"


def search_points(runs: dict, stored: dict, smoke: bool) -> list[tuple[float, float]]:
    """(lr, cycle KL) of ReSPO on the search seed: the stored lr 1e-4 run, the 5.4 run at 7e-5 where it exists, and
    the search runs that finished, sorted by lr."""
    seed = SMOKE["search_seed"] if smoke else SEARCH_SEED
    found = [r for r in [*stored.values(), *runs.values()] if r["arm"] in ("respo", "respo_search")
             and r["seed"] == seed and r["N"] == N_of(smoke)]  # fmt: skip
    posthoc = Path(POSTHOC_7E5, "arms", run_name("respo", N_of(smoke), seed) + ".json")
    if not smoke and posthoc.exists():
        found.append(load_run(posthoc))
    points = {r["lr"]: per_update_kl(r)["cycle"] for r in found}
    return sorted((lr, kl) for lr, kl in points.items() if kl)


def equal_movement_lr(points: list[tuple[float, float]], target: float) -> float | None:
    """H2's learning rate: log-log interpolation of cycle KL against lr at ``target`` (VESPO's cycle KL on the search
    seed), two significant digits; the nearest tried lr if ``target`` lies outside the points (5.5)."""
    if len(points) < 2 or not target:
        return None
    for (lr0, kl0), (lr1, kl1) in itertools.pairwise(points):
        if min(kl0, kl1) <= target <= max(kl0, kl1) and kl0 != kl1:
            t = (math.log(target) - math.log(kl0)) / (math.log(kl1) - math.log(kl0))
            return float(f"{math.exp(math.log(lr0) + t * (math.log(lr1) - math.log(lr0))):.2g}")
    return min(points, key=lambda p: abs(math.log(p[1]) - math.log(target)))[0]


def N_of(smoke: bool) -> int:
    return regime_runs.SMOKE["N"] if smoke else N


def specs(args, runs: dict, stored: dict) -> list[dict]:
    """The runs of 5.5 in its order; H2's seeds only once the search has fixed their learning rate."""
    setting = SMOKE["setting"] if args.smoke else SETTING
    seeds_all = SMOKE["seeds"] if args.smoke else SEEDS
    n_paper = N_of(args.smoke)

    def spec(arm, loss_args, n, seed, lr, name):
        s = base_spec(args, setting, seed)
        s.update(N=n, name=name, stage="mechanism", arm=arm, lr=lr, loss_args=loss_args, evaluate=True,
                 runs_dir=str(Path(args.out, "arms")))  # fmt: skip
        return s

    def wanted(arm, seeds):
        chosen = seeds if args.seeds is None else [s for s in seeds if s in args.seeds]
        return [s for s in chosen if s in seeds_all or args.smoke] if arm in args.arms else []

    out = []
    for seed in wanted("onpolicy", SMOKE["seeds"] if args.smoke else ARMS["onpolicy"][3]):
        out.append(spec("onpolicy", ARMS["onpolicy"][1], 1, seed, LR, run_name("onpolicy", 1, seed)))
    search_seed = SMOKE["search_seed"] if args.smoke else SEARCH_SEED
    for lr in (SMOKE["search_lrs"] if args.smoke else SEARCH_LRS) if "respo_eqmove" in args.arms else ():
        out.append(spec("respo_search", LOSS_ARGS["respo"], n_paper, search_seed, lr,
                        run_name("respo", n_paper, search_seed, lr)))  # fmt: skip
    for group in (("respo_negvespo", "vespo_pos1"), ("respo_groups", "vespo_groups", "dapo_groups")):
        for seed in seeds_all:
            out += [spec(arm, ARMS[arm][1], n_paper, seed, LR, run_name(arm, n_paper, seed))
                    for arm in group if seed in wanted(arm, seeds_all)]  # fmt: skip
    lr = eqmove_lr(runs, stored, args.smoke)
    if lr is not None:
        searched = SMOKE["search_lrs"] if args.smoke else SEARCH_LRS
        for seed in wanted("respo_eqmove", seeds_all):
            if not (seed == search_seed and any(math.isclose(lr, x) for x in searched)):  # that run exists: reused
                out.append(spec("respo_eqmove", LOSS_ARGS["respo"], n_paper, seed, lr,
                                run_name("respo_eqmove", n_paper, seed, lr)))  # fmt: skip
    return out


def eqmove_lr(runs: dict, stored: dict, smoke: bool) -> float | None:
    """H2's learning rate once every search run has finished (None before)."""
    search_lrs = SMOKE["search_lrs"] if smoke else SEARCH_LRS
    done = {r["lr"] for r in runs.values() if r["arm"] == "respo_search"}
    if not all(any(math.isclose(lr, d) for d in done) for lr in search_lrs):
        return None
    seed = SMOKE["search_seed"] if smoke else SEARCH_SEED
    vespo = next((r for r in stored.values() if r["arm"] == "vespo" and r["seed"] == seed), None)
    target = per_update_kl(vespo)["cycle"] if vespo else None
    return equal_movement_lr(search_points(runs, stored, smoke), target)


# ---------------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------------


def pairing_problem(run: dict, stored: dict) -> str | None:
    """Why ``run`` cannot be paired with the stored runs of its seed (None: it can). The same warm start gives the
    same greedy held-out accuracy before RL; at N = 32 the same first rollout batch gives the same training reward
    at step 1."""
    same_seed = [r for r in stored.values() if r["seed"] == run["seed"]]
    if not same_seed:
        return f"no stored run of seed {run['seed']}"
    before = {(r.get("heldout") or {}).get("greedy_before") for r in same_seed} - {None}
    if before and (run.get("heldout") or {}).get("greedy_before") not in before:
        return f"greedy held-out before RL {(run.get('heldout') or {}).get('greedy_before')} != stored {sorted(before)}"
    # at a record's precision: a record written before records were compact holds the reward unrounded
    first = {record_precision(r["history"][0].get("reward")) for r in same_seed if r["N"] == run["N"]} - {None}
    if first and record_precision(run["history"][0].get("reward")) not in first:
        return f"step-1 training reward {run['history'][0].get('reward')} != stored {sorted(first)}"
    return None


def age_aligned(run: dict, ages=AGES) -> float | None:
    """On-policy training reward over the batches sampled by policies within AGE_WINDOW of ``ages`` (the policy at
    step s has taken s - 1 updates)."""
    lo, hi = AGE_WINDOW
    rewards = [h["reward"] for h in run["history"] if "reward" in h
               and any(a - lo <= h["step"] - 1 <= a + hi for a in ages)]  # fmt: skip
    return statistics.fmean(rewards) if rewards else None


def run_row(run: dict) -> dict:
    stats = run_stats(run)
    kl, by_k = stats["per_update_kl"], kl_by_staleness(run)
    return {
        "name": run["name"], "arm": run["arm"], "seed": run["seed"], "lr": run["lr"], "N": run["N"],
        "late_mean": stats["late_mean"], "cycle_kl": kl["cycle"], "per_update_kl": kl["per_token"],
        "kl_by_staleness": by_k, "pos_neg_ratio": stats["pos_neg_ratio"],
        # descriptive (not a rule's input): the movement averaged over the whole cycle, k = 1 .. N - 1, beside the
        # late-cycle figure the rules read; they part where one kernel's KL plateaus early and another's keeps rising
        "cycle_kl_mean": statistics.fmean(by_k.values()) if by_k else None,
        "low_weight_share": stats["positive_branch"]["share"], "grad_norm": stats["grad_norm"],
        "greedy_after": (stats["heldout"] or {}).get("greedy_after"),
        "sampled_after": (stats["heldout"] or {}).get("sampled_after"), "wall_s": run["wall_s"],
    }  # fmt: skip


def scores_of(rows: list[dict], key: str = "late_mean") -> dict[int, float]:
    return {r["seed"]: r[key] for r in rows if r.get(key) is not None}


def variant_reading(variant: dict[int, float], respo: dict[int, float], vespo: dict[int, float],
                    needed: int = len(SEEDS)) -> dict:  # fmt: skip
    """5.5's three-way reading of a ReSPO variant against the stored ReSPO and VESPO of the same seeds: only once
    ``needed`` seeds are paired (5.5 reads over seeds 1-4; a partial table is shown, never read)."""
    vs_vespo, vs_respo = paired(variant, vespo), paired(variant, respo)
    out = {"minus_vespo": vs_vespo, "minus_respo": vs_respo}
    if vs_respo["ci"] is None or vs_vespo["mean"] is None or len(vs_respo["seeds"]) < needed:
        out["reading"] = "incomplete"
    elif vs_respo["ci"][0] > 0:
        out["reading"] = "closes the gap" if vs_vespo["mean"] >= -MARGIN else "closes part of the gap"
    else:
        out["reading"] = "does not close the gap"
    ci = vs_vespo["ci"]
    out["beats_vespo"] = bool(out["reading"] != "incomplete" and ci and vs_vespo["mean"] >= MARGIN and ci[0] > 0)
    return out


def pooled_interval(values: list[float]) -> dict:
    """Mean and 95% t interval of differences already in points (the pooled whole-groups effect)."""
    out = {"n": len(values), "mean": statistics.fmean(values) if values else None, "ci": None, "values": values}
    if len(values) > 1:
        half = t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
        out["ci"] = [out["mean"] - half, out["mean"] + half]
    return out


def readings(arms: dict[str, list[dict]], stored: dict[str, list[dict]], ages=AGES, needed: int = len(SEEDS)) -> dict:
    """Each hypothesis read by its rule (docs/benchmarks/regime_mechanism.md 5.5), once its arms have ``needed`` paired seeds
    (None or "incomplete" before). ``arms``/``stored``: arm -> run rows."""
    respo, vespo = scores_of(stored.get("respo", [])), scores_of(stored.get("vespo", []))
    out = {"gap": paired(vespo, respo)}
    variants = {a: variant_reading(scores_of(arms[a]), respo, vespo, needed)
                for a in ("respo_negvespo", "respo_eqmove", "respo_groups") if arms.get(a)}  # fmt: skip
    out["variants"] = variants
    # H1
    if "respo_negvespo" in variants and arms.get("vespo_pos1"):
        flat = paired(scores_of(arms["vespo_pos1"]), vespo)
        supported = variants["respo_negvespo"]["reading"] == "closes the gap" and flat["mean"] is not None and (
            flat["mean"] >= -MARGIN)
        complete = variants["respo_negvespo"]["reading"] != "incomplete" and len(flat["seeds"]) >= needed
        out["H1"] = {"vespo_pos1_minus_vespo": flat, "supported": supported if complete else None,
                     "vespo_positive_branch_contributes": bool(complete and flat["ci"] and flat["ci"][1] < 0)}  # fmt: skip
    # H2
    if "respo_eqmove" in variants:
        reading = variants["respo_eqmove"]["reading"]
        moved, vespo_moved = scores_of(arms["respo_eqmove"], "cycle_kl"), scores_of(stored.get("vespo", []), "cycle_kl")
        out["H2"] = {"supported": None if reading == "incomplete" else reading == "closes the gap",
                     # 5.5: the movement actually matched, seed by seed (the lr is fitted on seed 1 only)
                     "movement_ratio_to_vespo": {s: moved[s] / vespo_moved[s] for s in sorted(moved)
                                                 if vespo_moved.get(s)}}  # fmt: skip
    # H3
    if all(arms.get(a) for a in ("respo_groups", "vespo_groups")):
        rg, vg = scores_of(arms["respo_groups"]), scores_of(arms["vespo_groups"])
        gap_groups = paired(rg, vg)
        seeds = sorted(set(rg) & set(vg) & set(respo) & set(vespo))
        change = paired({s: rg[s] - vg[s] for s in seeds}, {s: respo[s] - vespo[s] for s in seeds})
        # what whole groups do to each kernel (reported, not read), and pooled over the three (the default's rule)
        per_kernel = {arm: paired(scores_of(arms.get(f"{arm}_groups", [])), scores_of(stored.get(arm, [])))
                      for arm in ("dapo", "vespo", "respo")}  # fmt: skip
        pooled = pooled_interval([v for d in per_kernel.values() for v in d["per_seed"].values()])
        out["H3"] = {
            "respo_minus_vespo_groups": gap_groups, "gap_change": change, "groups_minus_rows": per_kernel,
            "supported": None if change["ci"] is None or len(change["seeds"]) < needed
            else bool(gap_groups["mean"] >= -MARGIN and change["ci"][0] > 0),
            "whole_groups_effect": pooled,
            "default_whole_groups_under_N": None if pooled["ci"] is None or pooled["n"] < 12 else pooled["ci"][0] > 0,
        }  # fmt: skip
    # H4: on-policy rows of both sources (stored seeds 1-2, new 3-4)
    onpolicy = [*stored.get("onpolicy", []), *arms.get("onpolicy", [])]
    if onpolicy:
        late = paired(scores_of(onpolicy), vespo)
        aligned = paired(scores_of(onpolicy, "age_aligned"), vespo)
        if aligned["ci"] is None or len(aligned["seeds"]) < needed:
            reading = None
        elif aligned["ci"][0] > 0:
            reading = "on-policy leads at equal policy age"
        elif late["ci"] and late["ci"][0] > 0:
            reading = "the lead is timing"
        else:
            reading = "neither"
        out["H4"] = {"late_minus_vespo": late, "aligned_minus_vespo": aligned, "reading": reading}
    return out


def summarize(args) -> dict:
    stored_runs = load_runs(Path(args.stored, "arms"))
    runs = load_runs(Path(args.out, "arms"))
    ages = SMOKE["ages"] if args.smoke else AGES
    seeds = set(SMOKE["seeds"] if args.smoke else SEEDS)
    stored = {}
    for r in stored_runs.values():
        if r["seed"] in seeds and r["stage"] == "compare":
            row = run_row(r)
            if r["arm"] == "onpolicy":
                row["age_aligned"] = age_aligned(r, ages)
            stored.setdefault(r["arm"], []).append(row)
    arms, unpaired = {}, {}
    eqmove = eqmove_lr(runs, stored_runs, args.smoke)
    for r in runs.values():
        problem = pairing_problem(r, stored_runs)
        if problem:
            unpaired[r["name"]] = problem
            continue
        row = run_row(r)
        if r["arm"] == "onpolicy":
            row["age_aligned"] = age_aligned(r, ages)
        arms.setdefault(r["arm"], []).append(row)
        if r["arm"] == "respo_search" and eqmove is not None and math.isclose(r["lr"], eqmove):
            arms.setdefault("respo_eqmove", []).append(row)  # the search's own run at the chosen lr is seed 1 of H2
    for rows in [*arms.values(), *stored.values()]:
        rows.sort(key=lambda row: row["seed"])
    summary = {
        "design": "docs/benchmarks.md 5.5", "setting": SMOKE["setting"] if args.smoke else SETTING,
        "stored": str(args.stored), "arms": arms, "stored_arms": stored, "unpaired": unpaired,
        "h2_search": {"points": search_points(runs, stored_runs, args.smoke), "lr": eqmove},
        "readings": readings(arms, stored, ages, len(SMOKE["seeds"] if args.smoke else SEEDS)),
        "machine": {**machine_info(), "workers": args.workers, "threads_per_worker": 1},
        "command": command("regime_mechanism", sys.argv[1:]),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mechanism.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "mechanism.png")
    print(markdown(summary))
    print(f"\nwrote {out / 'mechanism.json'} and {out / 'mechanism.png'}")
    return summary


def reproduces(args) -> dict:
    """Rerun the first ``--updates`` updates of a stored run with this checkout's code and compare every number its
    record keeps of those updates (:data:`~benchmarks.common.REGIME_KEYS`, to the record's precision; a record written
    before records were compact is compacted first) with the new run's: the runs of 5.5 span sessions and code
    changes, and pairing them with 5.3's runs is only sound while the code still reproduces those runs exactly (one
    thread: bit for bit, to the record's six significant digits)."""
    import tempfile

    stored = load_runs(Path(args.stored, "arms"))[run_name(args.arm, N_of(args.smoke) if args.arm != "onpolicy"
                                                                  else 1, args.seed)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        spec = base_spec(args, stored["setting"], args.seed)
        spec.update(N=stored["N"], name=stored["name"], stage="check", arm=stored["arm"], lr=stored["lr"],
                    loss_args=stored["loss_args"], evaluate=False, updates=args.updates, runs_dir=tmp, scratch=tmp,
                    logs_dir=tmp, needs="warm")  # fmt: skip
        warm = (warm_start, ("dense", args.seed, [*spec["setting_args"], *spec["extra"]], spec["warm_path"]))
        fresh = run_pool([spec], run_one, workers=1, done={}, prepare={"warm": warm})[stored["name"]]
    kept = history_rows(compact_history(stored["history"], REGIME_KEYS))
    old = {h["step"]: h for h in kept if h["step"] <= args.updates}
    new = {h["step"]: h for h in fresh["history"]}
    differ = [f"step {step} {key}: {old[step][key]!r} -> {new[step].get(key)!r}" for step in sorted(old)
              for key in old[step] if not _same(old[step][key], new.get(step, {}).get(key))]  # fmt: skip
    compared = sum(len(h) for h in old.values())
    print(f"{stored['name']}: {compared} recorded numbers of updates 1-{args.updates} compared, {len(differ)} differ")
    for line in differ[:20]:
        print("  " + line)
    if differ:
        raise SystemExit(f"this checkout does not reproduce {stored['name']}: new runs would not pair with the stored ones")
    return {"run": stored["name"], "compared": compared, "differ": differ}


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


# ---------------------------------------------------------------------------------------------------------------------
# Tables and plot
# ---------------------------------------------------------------------------------------------------------------------


def _d(d: dict | None) -> str:
    if not d or d.get("mean") is None:
        return "n/a"
    per = " / ".join(f"{v:+.1f}" for _, v in sorted(d["per_seed"].items(), key=lambda kv: int(kv[0])))
    ci = "" if not d.get("ci") else f" [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}]"
    return f"{per}: **{d['mean']:+.1f}**{ci}"


def _arm_table(title: str, rows_by_arm: dict[str, list[dict]]) -> list[str]:
    lines = [title, "", ("| arm | lr | seeds | late-mean score, per seed (%) | KL after 24-31 updates (x 1e-3) "
                         "| KL mean over k = 1-31 (x 1e-3) | weight on positives / negatives, k >= 16 "
                         "| low-W share of positives, first half | avg@8 held-out (%) |"),
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def cells(rows, key, scale=100.0, digits=1):
        return " / ".join("n/a" if r.get(key) is None else f"{scale * r[key]:.{digits}f}" for r in rows)

    for arm, rows in rows_by_arm.items():
        lrs = sorted({r["lr"] for r in rows})
        lines.append(f"| {arm} | {', '.join(f'{lr:g}' for lr in lrs)} | {', '.join(str(r['seed']) for r in rows)} "
                     f"| {cells(rows, 'late_mean')} | {cells(rows, 'cycle_kl', 1e3)} | {cells(rows, 'cycle_kl_mean', 1e3)} "
                     f"| {cells(rows, 'pos_neg_ratio', 1, 2)} "
                     f"| {cells(rows, 'low_weight_share')} | {cells(rows, 'sampled_after')} |")  # fmt: skip
    return lines


def _verdict(supported: bool | None) -> str:
    return {True: "supported", False: "not supported"}.get(supported, "not read yet (seeds 1-4 needed)")


def markdown(summary: dict) -> str:
    lines = _arm_table("Stored runs (docs/benchmarks/regime, 5.3), seeds 1-4:", summary["stored_arms"])
    lines += [""] + _arm_table("New runs (5.5):", summary["arms"])
    search = summary["h2_search"]
    pts = ", ".join(f"lr {lr:g}: {1e3 * kl:.1f}" for lr, kl in search["points"])
    lr = "n/a (search not finished)" if search["lr"] is None else format(search["lr"], "g")
    lines += ["", (f"H2 search (ReSPO on the search seed, KL after 24-31 updates x 1e-3): {pts or 'n/a'}; "
                   f"equal-movement lr: {lr}")]
    r = summary["readings"]
    lines += ["", "Paired over the seeds both have (points of the late-mean score; per seed: **mean** [95% interval]):",
              "", "| comparison | per seed: mean [interval] | reading (5.5's rule) |", "|---|---|---|",
              f"| VESPO - ReSPO (stored) | {_d(r['gap'])} | the gap to explain |"]
    for arm, v in r["variants"].items():
        reading = v["reading"] if v["reading"] != "incomplete" else f"not read yet ({len(v['minus_respo']['seeds'])} of {len(SEEDS)} seeds)"
        lines.append(f"| {arm} - ReSPO | {_d(v['minus_respo'])} | {reading} |")
        lines.append(f"| {arm} - VESPO | {_d(v['minus_vespo'])} | {'beats VESPO: confirm on seeds 5-9' if v['beats_vespo'] else ''} |")
    if "H1" in r:
        h = r["H1"]
        lines.append(f"| vespo_pos1 - VESPO | {_d(h['vespo_pos1_minus_vespo'])} | H1: {_verdict(h['supported'])}"
                     f"{'; VESPO positive branch contributes' if h['vespo_positive_branch_contributes'] else ''} |")
    if "H2" in r:
        ratios = " / ".join(f"{v:.2f}" for v in r["H2"]["movement_ratio_to_vespo"].values()) or "n/a"
        lines.append(f"| (H2) KL after 24-31 updates, respo_eqmove / VESPO | {ratios} | "
                     f"H2: {_verdict(r['H2']['supported'])} |")
    if "H3" in r:
        h = r["H3"]
        e = h["whole_groups_effect"]
        ci = "" if not e["ci"] else f" [{e['ci'][0]:+.1f}, {e['ci'][1]:+.1f}]"
        lines += [f"| {arm}_groups - {arm} (rows, 5.3) | {_d(d)} | |" for arm, d in h["groups_minus_rows"].items()]
        lines += [f"| respo_groups - vespo_groups | {_d(h['respo_minus_vespo_groups'])} | |",
                  f"| gap change, groups - rows | {_d(h['gap_change'])} | H3: {_verdict(h['supported'])} |",
                  (f"| whole groups - rows, pooled over dapo, VESPO, ReSPO | {e['n']} differences: **"
                   f"{'n/a' if e['mean'] is None else format(e['mean'], '+.1f')}**{ci} | default under N: "
                   f"{ {True: 'on', False: 'off'}.get(h['default_whole_groups_under_N'], 'n/a') } |")]  # fmt: skip
    if "H4" in r:
        h = r["H4"]
        lines += [f"| on-policy - VESPO, late mean | {_d(h['late_minus_vespo'])} | |",
                  f"| on-policy - VESPO, at equal policy age | {_d(h['aligned_minus_vespo'])} | {h['reading'] or 'not read yet'} |"]
    if summary["unpaired"]:
        lines += ["", "Not paired (excluded): " + "; ".join(f"{k}: {v}" for k, v in summary["unpaired"].items())]
    return "\n".join(lines)


COLORS = {**regime_runs.COLORS, "respo_negvespo": "darkred", "vespo_pos1": "olive", "respo_groups": "salmon",
          "vespo_groups": "lightgreen", "dapo_groups": "lightblue", "respo_eqmove": "magenta", "respo_search": "pink"}


def plot(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    everything = {**{f"{a} (5.3)": rows for a, rows in summary["stored_arms"].items()}, **summary["arms"]}
    ax = axes[0]  # movement where kernels differ: KL to the rollout policy by staleness position, seed means
    for label, rows in everything.items():
        curves = [r["kl_by_staleness"] for r in rows if r["kl_by_staleness"]]
        if not curves:
            continue
        ks = sorted(set.intersection(*(set(map(int, c)) for c in curves)))
        mean = [statistics.fmean(c[k] if k in c else c[str(k)] for c in curves) for k in ks]
        arm = label.split(" ")[0]
        ax.plot(ks, [1e3 * m for m in mean], color=COLORS.get(arm), ls="--" if "(5.3)" in label else "-", label=label)
    ax.set(xlabel="staleness k (updates since the batch was sampled)", ylabel="KL to the rollout policy, per token (x 1e-3)",
           title="Movement within a reuse cycle (cycles 2-8, seed mean)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]  # does movement order the scores?
    for label, rows in everything.items():
        arm = label.split(" ")[0]
        pts = [(r["cycle_kl"], r["late_mean"]) for r in rows if r["cycle_kl"] and r["late_mean"] is not None]
        ax.scatter([1e3 * x for x, _ in pts], [100 * y for _, y in pts], color=COLORS.get(arm), s=18,
                   marker="x" if "(5.3)" in label else "o", label=label)  # fmt: skip
    ax.set(xscale="log", xlabel="KL after 24-31 updates (x 1e-3, log)", ylabel="late-mean training score (%)",
           title="Score against movement over a cycle (one point per run)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[2]  # the paired differences the rule reads
    r = summary["readings"]
    items = [("VESPO - ReSPO", r["gap"])]
    items += [(f"{a} - ReSPO", v["minus_respo"]) for a, v in r["variants"].items()]
    items += [(f"{a} - VESPO", v["minus_vespo"]) for a, v in r["variants"].items()]
    if "H1" in r:
        items.append(("vespo_pos1 - VESPO", r["H1"]["vespo_pos1_minus_vespo"]))
    if "H3" in r:
        items.append(("gap change (groups)", r["H3"]["gap_change"]))
        items += [(f"{arm}: groups - rows", d) for arm, d in r["H3"]["groups_minus_rows"].items()]
        effect = r["H3"]["whole_groups_effect"]  # the default's evidence: its 12 differences, one dot each
        items.append(("groups - rows, pooled", {**effect, "per_seed": dict(enumerate(effect["values"]))}))
    if "H4" in r:
        items += [("on-policy - VESPO", r["H4"]["late_minus_vespo"]), ("same, equal age", r["H4"]["aligned_minus_vespo"])]
    for i, (label, d) in enumerate(items):
        if d.get("mean") is None:
            continue
        ax.scatter([i] * len(d["per_seed"]), list(d["per_seed"].values()), s=14, color="tab:gray")
        if d.get("ci") and len(d["per_seed"]) >= 3:  # a 1-degree-of-freedom interval would only flatten the panel
            ax.errorbar([i + 0.15], [d["mean"]], yerr=[[d["mean"] - d["ci"][0]], [d["ci"][1] - d["mean"]]], fmt="k_",
                        capsize=4)  # fmt: skip
        elif len(d["per_seed"]) > 1:
            ax.scatter([i + 0.15], [d["mean"]], marker="_", s=120, color="k")
    ax.axhline(0, color="gray", lw=0.8)
    for y in (-MARGIN, MARGIN):
        ax.axhline(y, color="tab:red", lw=0.8, ls="--")
    ax.set_xticks(range(len(items)), [label for label, _ in items], rotation=35, ha="right", fontsize=7)
    ax.set(ylabel="points of the late-mean score", title="Paired by seed; bars: mean and 95% interval (3+ seeds)")
    fig.suptitle(f"Why VESPO leads at N = 32 ({summary['setting']}): docs/benchmarks.md 5.5")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("stage", choices=["run", "summary", "check"], help="What to do (see the module docstring).")
    p.add_argument("--out", default="docs/benchmarks/regime_mechanism", help="arms/, mechanism.json, mechanism.png.")
    p.add_argument("--stored", default="docs/benchmarks/regime", help="The comparison the new runs pair with (5.3).")
    p.add_argument("--work", default="outputs/regime", help="Warm starts (shared with regime.py), logs, scratch.")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="run: the arms (respo_eqmove "
                   "includes its lr search).")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="run: only these seeds.")
    p.add_argument("--workers", type=int, default=2, help="Runs at once (one torch thread each).")
    p.add_argument("--smoke", action="store_true", help="Tiny sizes for the test suite (seconds, numbers meaningless).")
    p.add_argument("--markdown", action="store_true", help="summary: print the docs tables of mechanism.json.")
    p.add_argument("--arm", default="dapo", help="check: the stored arm to reproduce.")
    p.add_argument("--seed", type=int, default=3, help="check: its seed.")
    p.add_argument("--updates", type=int, default=8, help="check: how many of its first updates.")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if not Path(args.stored, "arms").is_dir():
        p.error(f"--stored {args.stored!r} has no arms/ folder (the stored comparison, e.g. docs/benchmarks/regime)")
    args.recipe_args = []  # what regime_runs.base_spec reads
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.stage == "check":
        return reproduces(args)
    if args.stage == "summary" and args.markdown:
        path = Path(args.out, "mechanism.json")
        if not path.exists():
            return summarize(args)  # written from the arms first (it prints the tables too)
        summary = json.loads(path.read_text())
        print(markdown(summary))
        return summary
    if args.stage == "run":
        stored = load_runs(Path(args.stored, "arms"))
        runs_dir = Path(args.out, "arms")
        todo = specs(args, load_runs(runs_dir), stored)
        run_all(args, todo, runs_dir)
        # the search may have finished in this call: H2's seeds run at the lr it fixed
        more = [s for s in specs(args, load_runs(runs_dir), stored) if s["name"] not in {t["name"] for t in todo}]
        if more:
            run_all(args, more, runs_dir)
    return summarize(args)


if __name__ == "__main__":
    main()
