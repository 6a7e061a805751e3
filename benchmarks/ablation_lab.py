"""Ablation lab: does the paper's ReSPO need a normalisation, a token trust mask, or other constants?

What it does
------------
Runs the starvation lab's engine (``benchmarks/starvation_sim.py``: its task, training loop and diagnostics; nothing is
re-simulated here) for ReSPO *variants only*, against clipped token PPO (TRL ``dapo``, the ``ppo`` registry loss) as
the reference row, in both lab regimes (``moderate``: Adam lr 0.1, ``stress``: lr 1.0), under both kinds of reuse:
epochs ``R = 4`` and staleness ``N`` in {8, 32} (the paper's reuse), 8 seeds. ``R = 8`` (a second epoch check) and
``R = 1`` (the on-policy identity, which the test suite checks at smoke size) are left out of the full run for CPU
time; ``--settings R=1 R=4 R=8 N=8 N=32`` adds them. One factor at a time around the paper's kernel, the package
default (``(alpha, beta, lam) = (2, 0.5, 2)`` for ``A >= 0``, ``(1, 0.5, 2)`` for ``A < 0``, the raw ``W``,
no mask):

* normalisation of ``log W`` by mean (GSPO's), sqrt (the retired 0.1 kernel's) or ess (rho_min 0.5): the spec kept
  these options only if evidence earned them a place; it did not, and the library dropped them (``respo_norm``).
  They are the starvation lab's lab-only losses ``respo_mean``, ``respo_sqrt``, ``respo_ess``, the same math;
* token trust mask: ``directional`` (the package's ``respo_trust_mask``, on by default when ``num_iterations > 1``) and
  ``symmetric`` (a lab-only loss registered here: zero a token's gradient whenever its ratio leaves
  ``[1 - eps, 1 + eps]``, whatever the advantage's sign: documented to starve low-weight positives);
* positive branch: ``lam`` 1 or 3 (slope 0 or -1 at ``W = 1``; ``lam = 1`` cuts high-weight positives less:
  ``phi+(4.5)`` = 0.48 instead of 0.087), ``beta`` 0.25; contrasts ``alpha = 1`` (the negative branch's shape:
  ``phi+(0) = 0``, a starving positive branch) and ``beta = 0`` (``phi+ = 1``, no correction);
* negative branch: ``lam`` 1 or 3, ``beta`` 0.25; contrast ``beta = 0`` (``phi- = 1``: plain policy gradient on stale
  wrong rollouts).

Metrics per variant, regime and setting (mean ± sample std over seeds, plus per-seed values): final expected reward;
reward at a quarter of the budget; early (first-quarter) ``grad_throughput/pos`` and ``/neg``, ``starved_frac/pos``
and the paper's positive-branch diagnostic (mass ratio of positives with ``log W < -1``); ``max_drop`` (largest
drawdown of the seed-mean reward curve); the seed-paired difference to clipped PPO and to the paper default (mean, std,
standard error, in reward points). At ``R = 1`` every variant is the on-policy run (``phi(1) = 1``): the JSON records
the largest ``R = 1`` deviation from clipped PPO's curve as a check.

Decision rule (fixed before the runs; ``CRITERIA`` below is the text written into the JSON and the docs)
-------------------------------------------------------------------------------------------------------
Primary cells: 2 regimes x {R = 4, N = 8}; check cells: 2 regimes x {R = 8, N = 32}, those that were run (the full
run: N = 32).

1. Primary score: the worst primary cell's seed-paired ``Delta = final reward(variant) - final reward(clipped PPO)``.
2. Adoption bar (constants): a variant replaces a paper constant only if it beats the paper default (seed-paired mean
   > 0) in all four primary cells, by more than 2 SE in at least one, and is not worse than the default by more than
   2 SE in any check cell.
3. Stability guard: every seed finite; the seed-mean reward curve's max drop at most max(0.02, clipped PPO's) in every
   reuse cell.
4. Confirmation: up to three variants passing 2-3 are re-run with the default and clipped PPO on 8 fresh seeds
   (8-15) at the primary settings; one is adopted only if it again beats the default in all four primary cells.
5. Normalisation: an option (``mean``, ``sqrt``, ``ess``) earns its place if it beats ``none`` by more than 2 SE in
   at least one primary or check cell and passes 3; an option that earns nothing is recommended for removal. It can
   become the default only through 2 and 4.
6. Directional trust mask, per kind of reuse. Epochs: it earns the default for ``R > 1`` (``respo_trust_mask="auto"``)
   if its mean seed-paired gap to no mask over the epoch cells that were run (R = 4 and 8, both regimes) is > 0 and
   no epoch cell is worse by more than 2 SE. Staleness: the paper-pure default (no mask) stays unless the mask
   passes 2 restricted to the staleness cells (N = 8 primary, N = 32 check).
7. The symmetric mask and the contrasts (``phi+ = 1``, ``phi- = 1``, ``alpha_pos = 1``) are never defaults; they are
   reported as findings.

How to run
----------
    OMP_NUM_THREADS=1 python -m benchmarks.ablation_lab          # full grid + confirmation, ~9 CPU-min
    python -m benchmarks.ablation_lab --quick --out /tmp/abl     # smoke size, seconds
    python -m benchmarks.ablation_lab --markdown-from docs/benchmarks/ablation_lab/ablation_lab.json
    python -m benchmarks.ablation_lab --factors mask --seeds 0 1 2 --no-confirm --out /tmp/abl

Writes ``--out``/``ablation_lab.json`` (default ``docs/benchmarks/ablation_lab``) and ``ablation_lab.png`` (final reward by
variant, both regimes, the primary and check settings, error bars = std over seeds, clipped PPO as a band).

Reuse on another setting: :func:`run_ablation` takes a ``runner(variants) -> {regime: {label: {"R=r"|"N=n":
metrics}}}`` with the lab's metric schema; the default :func:`lab_runner` runs the starvation lab at any
``LabConfig``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import Callable

import torch

from benchmarks import starvation_sim as sim
from benchmarks.common import command, machine_info
from respo_trl.kernels import POLICY_LOSSES, LossParams, register_policy_loss, respo_weights

ROOT = pathlib.Path(__file__).resolve().parents[1]


def respo_symmetric_mask_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """Lab-only: ReSPO's coefficient with a *symmetric* token mask, zero wherever ``r_it`` leaves
    ``[1 - epsilon_low, 1 + epsilon_high]`` whatever the sign of ``A`` (the variant the directional mask replaced)."""
    coef = respo_weights(log_ratio, advantages, mask, dataclasses.replace(params, respo_trust_mask=False),
                         sampler_ratio=sampler_ratio).coefficients
    r = torch.exp(log_ratio.detach())
    keep = ((r >= 1 - params.epsilon_low) & (r <= 1 + params.epsilon_high)).to(coef.dtype)
    a = advantages.reshape(-1, 1) if advantages.dim() == 1 else advantages
    return -coef * keep * a * log_ratio


if "respo_symmetric" not in POLICY_LOSSES:
    register_policy_loss("respo_symmetric")(respo_symmetric_mask_loss)

CRITERIA = [
    "Primary cells: 2 regimes x {R = 4, N = 8}; check cells: 2 regimes x {R = 8, N = 32}, those that were run.",
    "1. Primary score: the worst primary cell's seed-paired Delta = final reward(variant) - final reward(clipped "
    "PPO), in points.",
    "2. Adoption bar (constants): a variant replaces a paper constant only if it beats the paper default "
    "(seed-paired mean > 0) in all four primary cells, by more than 2 SE in at least one, and is not worse than the "
    "default by more than 2 SE in any check cell.",
    "3. Stability guard: every seed finite; max drop of the seed-mean reward curve at most max(0.02, clipped "
    "PPO's) in every reuse cell.",
    "4. Confirmation: up to three variants passing 2-3 are re-run with the default and clipped PPO on 8 fresh seeds "
    "at the primary settings; one is adopted only if it again beats the default in all four primary cells.",
    "5. Normalisation: an option (mean, sqrt, ess) earns its place if it beats none by more than 2 SE in at least one "
    "primary or check cell and passes 3; an option that earns nothing is recommended for removal. It becomes the "
    "default only through 2 and 4.",
    "6. Directional trust mask, per kind of reuse. Epochs: it earns the default for R > 1 if its mean seed-paired gap "
    "to no mask over the epoch cells that were run (R = 4, 8, both regimes) is > 0 and no epoch cell is worse by more "
    "than 2 SE. "
    "Staleness: the paper-pure default (no mask) stays unless the mask passes 2 restricted to the staleness cells "
    "(N = 8 primary, N = 32 check).",
    "7. The symmetric mask and the contrasts (phi+ = 1, phi- = 1, alpha_pos = 1) are never defaults; they are "
    "reported as findings.",
]

DEFAULT = {"respo_trust_mask": False,
           "respo_alpha_pos": 2.0, "respo_beta_pos": 0.5, "respo_lambda_pos": 2.0,
           "respo_alpha_neg": 1.0, "respo_beta_neg": 0.5, "respo_lambda_neg": 2.0}  # the paper's kernel
REFERENCE = "ppo_clip"
DEFAULT_LABEL = "respo"
PRIMARY = ("R=4", "N=8")
CHECK = ("R=8", "N=32")
EPOCH_CELLS = ("R=4", "R=8")
STALE_PRIMARY, STALE_CHECK = ("N=8",), ("N=32",)
MAX_CONFIRM = 3
FACTOR_ORDER = ("reference", "default", "norm", "mask", "pos", "neg")


def _num(x: float) -> str:
    return f"{x:g}"


def variant_label(overrides: dict, registry: str = "respo") -> str:
    """A short label for the ReSPO setting that differs from the default by ``overrides``."""
    p = {**DEFAULT, **overrides}
    parts = [NORM_LABELS[registry]] if registry in NORM_LABELS else []
    if registry == "respo_symmetric":
        parts.append("mask=symmetric")
    elif p["respo_trust_mask"]:
        parts.append("mask=directional")
    for sign in ("pos", "neg"):
        branch = tuple(p[f"respo_{k}_{sign}"] for k in ("alpha", "beta", "lambda"))
        if branch != tuple(DEFAULT[f"respo_{k}_{sign}"] for k in ("alpha", "beta", "lambda")):
            parts.append(f"{sign}=({','.join(_num(x) for x in branch)})")
    return " ".join(parts) or DEFAULT_LABEL


# the starvation lab's normalised-ReSPO losses (ess at rho_min = sim.ESS_RHO_MIN = 0.5) and their labels
NORM_LABELS = {"respo_mean": "norm=mean", "respo_sqrt": "norm=sqrt", "respo_ess": f"norm=ess({_num(sim.ESS_RHO_MIN)})"}
MASK_LEVELS = [("respo", {"respo_trust_mask": True}), ("respo_symmetric", {})]
POS_LEVELS = [{"respo_lambda_pos": 1.0}, {"respo_lambda_pos": 3.0}, {"respo_beta_pos": 0.25},
              {"respo_alpha_pos": 1.0}, {"respo_beta_pos": 0.0}]
NEG_LEVELS = [{"respo_lambda_neg": 1.0}, {"respo_lambda_neg": 3.0}, {"respo_beta_neg": 0.25}, {"respo_beta_neg": 0.0}]
CONTRASTS = {"pos=(1,0.5,2)": "contrast: alpha_pos = 1, the negative branch's shape (phi+(0) = 0: starves)",
             "pos=(2,0,2)": "contrast: phi+ = 1 (no correction on positives)",
             "neg=(1,0,2)": "contrast: phi- = 1 (plain policy gradient on stale wrong rollouts)",
             "mask=symmetric": "symmetric token mask (documented to starve low-weight positives)"}
NOTES = {"norm=mean": "GSPO's geometric mean", "norm=sqrt": "the retired 0.1 kernel's normalisation",
         "norm=ess(0.5)": "one ESS-based scale per batch", "mask=directional": "respo_trust_mask (auto: on for R > 1)",
         "pos=(2,0.5,1)": "slope 0 at W = 1; phi+(0) = 0.82, phi+(4.5) = 0.48",
         "pos=(2,0.5,3)": "slope -1 at W = 1; phi+(0) = 2.24, phi+(4.5) = 0.014",
         "pos=(2,0.25,2)": "phi+(0) = 1.24, phi+(4.5) = 0.33",
         "neg=(1,0.5,1)": "slope 0 at W = 1, peak 1 at W = 1",
         "neg=(1,0.5,3)": "peak 2.46 at W = 1/9", "neg=(1,0.25,2)": "peak 1.36 at W = 1/16", **CONTRASTS}


def factor_levels(factor: str) -> list[tuple[str, dict]]:
    if factor == "norm":
        return [(registry, {}) for registry in NORM_LABELS]
    if factor == "mask":
        return [(r, dict(x)) for r, x in MASK_LEVELS]
    if factor == "pos":
        return [("respo", dict(x)) for x in POS_LEVELS]
    if factor == "neg":
        return [("respo", dict(x)) for x in NEG_LEVELS]
    raise ValueError(f"unknown factor {factor!r}")


def make_variants(factors=("norm", "mask", "pos", "neg"), levels: dict | None = None) -> dict:
    """``{label: {"registry", "overrides", "factor", "contrast", "note"}}``: the reference, the default and the
    one-factor-at-a-time levels (``levels`` may replace a factor's list of ``(registry, overrides)``)."""
    variants = {REFERENCE: {"registry": "ppo", "overrides": {}, "factor": "reference", "contrast": None,
                            "note": "clipped token PPO, epsilon 0.2 (TRL dapo)"},
                DEFAULT_LABEL: {"registry": "respo", "overrides": {"respo_trust_mask": False}, "factor": "default",
                                "contrast": False, "note": "the paper: (2, 0.5, 2) / (1, 0.5, 2), raw W, no mask"}}
    for factor in factors:
        for registry, overrides in (levels or {}).get(factor, factor_levels(factor)):
            changed = {k: v for k, v in overrides.items() if DEFAULT.get(k) != v}
            label = variant_label(changed, registry)
            if label in variants:
                continue
            variants[label] = {"registry": registry, "overrides": {"respo_trust_mask": False, **changed},
                               "factor": factor, "contrast": label in CONTRASTS, "note": NOTES.get(label, "")}
    return variants


# ---------------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------------


def lab_runner(cfg, settings: list[str], log=print) -> Callable[[dict], dict]:
    """A runner on the starvation lab at ``cfg``: ``variants -> {regime: {label: {"R=r"|"N=n": metrics}}}``."""
    task = sim.Task(cfg, cfg.seeds)
    reuse = [sim.Reuse.parse(k) for k in settings]

    def run(variants: dict) -> dict:
        kernels = {label: (v["registry"], v["overrides"]) for label, v in variants.items()}
        start = time.perf_counter()
        out = {}
        for regime, lr in cfg.regimes:
            log(f"-- regime {regime!r}: Adam lr {lr}")
            out[regime] = sim.run_regime(task, dataclasses.replace(cfg, lr=lr), kernels, LossParams(), log, start,
                                         settings=reuse, same_batch=False)
        return out

    run.regimes = dict(cfg.regimes)
    run.settings = list(settings)
    run.seeds = tuple(cfg.seeds)
    return run


def _stats(values: list[float]) -> dict:
    vals = [v for v in values if v == v]
    n = len(vals)
    mean = sum(vals) / n if n else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "se": std / math.sqrt(n) if n else math.nan, "n": n}


def max_drop(curve: list[float]) -> float:
    """Largest drawdown of a curve: ``max_t (max_{s <= t} y_s - y_t)`` (0 for a never-decreasing curve)."""
    peak, drop = -math.inf, 0.0
    for y in curve:
        peak = max(peak, y)
        drop = max(drop, peak - y)
    return drop


def compact(run: dict, ref: dict | None, default: dict | None) -> dict:
    """The ablation's metrics of one (variant, regime, setting) cell from the lab's result ``run``."""
    reward = torch.tensor(run["curves"]["reward"], dtype=torch.float64)  # [seed][batch]
    mean_curve = reward.mean(0).tolist()
    out = {key: {k: run[key][k] for k in ("mean", "std", "per_seed")}
           for key in ("final_reward", "reward_at_quarter", "grad_throughput_pos", "grad_throughput_neg",
                       "starved_frac_pos", "final_reward_hard", "final_beta", "log_weight_pos")}
    low = run["low_weight_pos"]
    out["low_weight_pos"] = {"share": low["share"]["mean"], "mass_share": low["mass_share"]["mean"],
                             "mass_ratio": low["mass_ratio"]}
    out["max_drop"] = max_drop(mean_curve)
    out["finite"] = all(run["finite"])
    out["mean_reward_curve"] = mean_curve
    final = run["final_reward"]["per_seed"]
    for name, other in (("vs_ppo_points", ref), ("vs_default_points", default)):
        if other is not None:
            diffs = [100 * (a - b) for a, b in zip(final, other["final_reward"]["per_seed"])]
            out[name] = {**_stats(diffs), "per_seed": diffs}
    return out


def _compact_raw(raw: dict) -> dict:
    """``{regime: {label: {key: lab metrics}}}`` -> the same with :func:`compact` cells (gaps to PPO and default)."""
    out = {}
    for regime, by_label in raw.items():
        ref, default = by_label[REFERENCE], by_label.get(DEFAULT_LABEL, {})
        out[regime] = {label: {key: compact(run, ref.get(key), default.get(key)) for key, run in by_s.items()}
                       for label, by_s in by_label.items()}
    return out


def run_ablation(runner: Callable[[dict], dict], variants: dict, confirm_runner: Callable[[dict], dict] | None = None,
                 log=print) -> dict:
    """Phase 1 (``variants``), scoring and the decision; with ``confirm_runner`` (the primary settings on fresh seeds),
    the candidates that pass the bar are re-run with the default and the reference, and only a confirmed one is
    adopted. Returns the JSON-ready result."""
    start = time.perf_counter()
    raw = runner(variants)
    lrs = getattr(runner, "regimes", {})
    result = {"variants": dict(variants), "criteria": CRITERIA,
              "regimes": {g: {"lr": lrs.get(g), "results": cells} for g, cells in _compact_raw(raw).items()}}
    result["on_policy_check"] = on_policy_check(raw)
    result["decision"] = decide(result)
    if confirm_runner is not None:
        candidates = result["decision"]["passing"][:MAX_CONFIRM]
        log(f"-- confirmation on fresh seeds of {candidates or 'nothing (no variant passes)'}")
        if candidates:
            keep = [REFERENCE, DEFAULT_LABEL, *candidates]
            raw3 = confirm_runner({k: variants[k] for k in keep})
            result["confirmation"] = {
                "seeds": list(getattr(confirm_runner, "seeds", [])),
                "settings": list(getattr(confirm_runner, "settings", [])),
                "regimes": {g: {"lr": lrs.get(g), "results": cells} for g, cells in _compact_raw(raw3).items()},
            }
            result["decision"] = decide(result)
    result["runtime_s"] = time.perf_counter() - start
    return result


def on_policy_check(raw: dict) -> dict:
    """Largest |reward curve - clipped PPO's| and |throughput - 1| over the R = 1 runs (all on-policy)."""
    out = {}
    for regime, by_label in raw.items():
        if "R=1" not in by_label[REFERENCE]:
            continue
        ref = torch.tensor(by_label[REFERENCE]["R=1"]["curves"]["reward"])
        dev = max(float((torch.tensor(r["R=1"]["curves"]["reward"]) - ref).abs().max()) for r in by_label.values())
        tp = max(abs(r["R=1"][f"grad_throughput_{sign}"]["mean"] - 1)
                 for r in by_label.values() for sign in ("pos", "neg"))
        out[regime] = {"max_abs_reward_deviation": dev, "max_abs_throughput_deviation": tp}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Scoring and the decision
# ---------------------------------------------------------------------------------------------------------------------


def _cell(result, regime, label, key):
    return result["regimes"][regime]["results"].get(label, {}).get(key)


def _cells(result: dict, label: str, keys) -> dict:
    """``{(regime, key): cell}`` for the ``keys`` the result has."""
    out = {}
    for g in result["regimes"]:
        for k in keys:
            c = _cell(result, g, label, k)
            if c is not None:
                out[(g, k)] = c
    return out


def score(result: dict, label: str) -> dict:
    """Primary score and tie-breakers of ``label``: worst primary cell."""
    cells = _cells(result, label, PRIMARY)
    if not cells:
        return {}
    return {
        "worst_vs_ppo_points": min(c["vs_ppo_points"]["mean"] for c in cells.values()),
        "worst_early_reward": min(c["reward_at_quarter"]["mean"] for c in cells.values()),
        "mean_vs_default_points": sum(c["vs_default_points"]["mean"] for c in cells.values()) / len(cells),
    }


def stable(result: dict, label: str) -> list[str]:
    """Criterion 3: reasons ``label`` fails the stability guard (empty: passes)."""
    reasons = []
    for (g, k), c in _cells(result, label, PRIMARY + CHECK).items():
        ref = _cell(result, g, REFERENCE, k)
        if not c["finite"]:
            reasons.append(f"non-finite run ({g}, {k})")
        if c["max_drop"] > max(0.02, ref["max_drop"]) + 1e-9:
            reasons.append(f"seed-mean reward drops by {c['max_drop']:.3f} ({g}, {k})")
    return reasons


def bar(result: dict, label: str, primary=PRIMARY, check=CHECK) -> list[str]:
    """Criterion 2 against the default on the given cells: reasons it fails (empty: passes)."""
    reasons = []
    cells = _cells(result, label, primary)
    gaps = {gk: c["vs_default_points"] for gk, c in cells.items()}
    if not all(d["mean"] > 0 for d in gaps.values()):
        reasons.append("not better than the default in every primary cell (" + ", ".join(
            f"{g} {k} {d['mean']:+.1f}" for (g, k), d in gaps.items()) + " points)")
    elif not any(d["mean"] > 2 * d["se"] for d in gaps.values()):
        reasons.append("better than the default in every primary cell but within 2 SE in all")
    for (g, k), c in _cells(result, label, check).items():
        d = c["vs_default_points"]
        if d["mean"] < -2 * d["se"]:
            reasons.append(f"worse than the default at {k} ({g}: {d['mean']:+.1f} points, SE {d['se']:.1f})")
    return reasons


def confirm(result: dict, label: str) -> dict | None:
    """Criterion 4: on the fresh seeds, ``label`` beats the default in every primary cell (paired mean > 0)."""
    conf = result.get("confirmation")
    if not conf or label not in next(iter(conf["regimes"].values()))["results"]:
        return None
    gaps = {f"{g} {k}": r["results"][label][k]["vs_default_points"]
            for g, r in conf["regimes"].items() for k in PRIMARY if k in r["results"][label]}
    return {"confirmed": all(d["mean"] > 0 for d in gaps.values()),
            "vs_default_points": {c: {k: d[k] for k in ("mean", "se")} for c, d in gaps.items()}}


def decide(result: dict) -> dict:
    """Apply the criteria: per-variant table, constants (2-4), normalisation (5), trust mask (6), contrasts (7)."""
    variants = result["variants"]
    respo = [k for k, v in variants.items() if v["factor"] not in ("reference",)]
    table = {}
    for label in respo:
        row = {**score(result, label), "stability": stable(result, label)}
        if label != DEFAULT_LABEL:
            row["bar"] = bar(result, label)
        table[label] = row
    # constants (criteria 2-4): in-family, non-contrast variants of the two branches
    candidates = [k for k in respo if variants[k]["factor"] in ("pos", "neg") and not variants[k]["contrast"]]
    passing = [k for k in candidates if not table[k]["bar"] and not table[k]["stability"]]
    passing.sort(key=lambda k: -table[k]["worst_vs_ppo_points"])
    winner = None
    for label in passing:
        verdict = confirm(result, label)
        if verdict is not None:
            table[label]["confirmation"] = verdict
        if winner is None and (verdict is None or verdict["confirmed"]):
            winner = label
    # normalisation (criterion 5)
    norm = {}
    for label in (k for k in respo if variants[k]["factor"] == "norm"):
        better = [f"{g} {k}" for (g, k), c in _cells(result, label, PRIMARY + CHECK).items()
                  if c["vs_default_points"]["mean"] > 2 * c["vs_default_points"]["se"]]
        worse = [f"{g} {k}" for (g, k), c in _cells(result, label, PRIMARY + CHECK).items()
                 if c["vs_default_points"]["mean"] < -2 * c["vs_default_points"]["se"]]
        earns = bool(better) and not table[label]["stability"]
        norm[label] = {"better_than_none_beyond_2se": better, "worse_than_none_beyond_2se": worse,
                       "earns_its_place": earns, "becomes_default": False}
    # trust mask (criterion 6)
    mask = {}
    if "mask=directional" in variants:
        epoch = _cells(result, "mask=directional", EPOCH_CELLS)
        gaps = [c["vs_default_points"] for c in epoch.values()]
        mean_gap = sum(d["mean"] for d in gaps) / len(gaps) if gaps else math.nan
        worse = [f"{g} {k}" for (g, k), c in epoch.items()
                 if c["vs_default_points"]["mean"] < -2 * c["vs_default_points"]["se"]]
        stale_bar = bar(result, "mask=directional", STALE_PRIMARY, STALE_CHECK)
        mask = {"epochs": {"mean_gap_points": mean_gap, "worse_beyond_2se": worse,
                           "mask_default_for_R_gt_1": bool(gaps) and mean_gap > 0 and not worse},
                "staleness": {"bar": stale_bar, "mask_default_for_N": not stale_bar}}
    chosen = winner or DEFAULT_LABEL
    recommended = {**DEFAULT, **{k: v for k, v in variants[chosen]["overrides"].items() if k in DEFAULT}}
    return {
        "table": table,
        "constants": {"candidates": candidates, "passing": passing, "winner": chosen,
                      "changes_default": winner is not None},
        "passing": passing,
        "winner": chosen,
        "changes_default": winner is not None,
        "confirmation_ran": "confirmation" in result,
        "normalisation": norm,
        "trust_mask": mask,
        "recommended": recommended,
        "best_overall_by_primary_score": max((k for k in respo if table[k].get("worst_vs_ppo_points") is not None),
                                             key=lambda k: table[k]["worst_vs_ppo_points"], default=None),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Output: JSON, figure, markdown
# ---------------------------------------------------------------------------------------------------------------------


def _ordered(result: dict) -> list[str]:
    v = result["variants"]
    return sorted(v, key=lambda k: FACTOR_ORDER.index(v[k]["factor"]))


def _keys(result: dict) -> list[str]:
    regimes = list(result["regimes"])
    keys = list(result["regimes"][regimes[0]]["results"][REFERENCE])
    return [k for k in keys if k != "R=1"]


def plot(result: dict, path: str) -> str:
    """Final reward by variant (rows) for each regime and reuse setting, error bars = std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [k for k in _ordered(result) if k != REFERENCE]
    regimes = list(result["regimes"])
    keys = _keys(result)
    colors = {"default": "tab:blue", "norm": "tab:green", "mask": "tab:cyan", "pos": "tab:orange",
              "neg": "tab:purple"}
    n = len(regimes) * len(keys)
    fig, axes = plt.subplots(1, n, figsize=(2.9 * n + 1.8, 0.3 * len(labels) + 1.7), sharey=True, squeeze=False)
    y = list(range(len(labels)))[::-1]
    for i, (regime, key) in enumerate((g, k) for g in regimes for k in keys):
        ax = axes[0][i]
        res = result["regimes"][regime]["results"]
        ref = res[REFERENCE][key]["final_reward"]
        ax.axvspan(ref["mean"] - ref["std"], ref["mean"] + ref["std"], color="tab:red", alpha=0.12)
        ax.axvline(ref["mean"], color="tab:red", lw=1.2, label="clipped PPO (± std)")
        ax.axvline(res[DEFAULT_LABEL][key]["final_reward"]["mean"], color="tab:blue", lw=0.8, ls=":")
        for yy, label in zip(y, labels):
            st = res[label][key]["final_reward"]
            v = result["variants"][label]
            ax.errorbar(st["mean"], yy, xerr=st["std"], fmt="x" if v["contrast"] else "o", capsize=2, ms=4,
                        color=colors.get(v["factor"], "k"))
        kind = "epochs" if key.startswith("R") else "staleness"
        ax.set_title(f"{regime}, {kind} {key}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
        ax.set_xlabel("final expected reward", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_yticks(y, [lab_ + (" (contrast)" if result["variants"][lab_]["contrast"] else "")
                              for lab_ in labels], fontsize=7)
    axes[0][0].legend(fontsize=7, loc="lower left")
    n_seeds = len(result["regimes"][regimes[0]]["results"][REFERENCE][keys[0]]["final_reward"]["per_seed"])
    fig.suptitle(f"ReSPO ablation (starvation lab): final reward, mean ± std over {n_seeds} seeds; "
                 "dotted = the paper's default; x = contrast", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(result: dict) -> str:
    """The docs tables: final reward and gaps per cell, early diagnostics, the decisions."""
    regimes = list(result["regimes"])
    labels = _ordered(result)
    keys = _keys(result)
    dec = result["decision"]
    pm = lambda st, p=3: f"{st['mean']:.{p}f} ± {st['std']:.{p}f}"  # noqa: E731
    pts = lambda st: f"{st['mean']:+.1f} ± {st['se']:.1f}"  # noqa: E731
    out = []
    for key in keys:
        kind = "epochs" if key.startswith("R") else "staleness"
        out.append(f"**{kind} {key}: final reward (mean ± std over seeds); seed-paired gap to clipped PPO and to the "
                   "paper default in points (mean ± SE)**\n")
        out.append("| variant | factor | " + " | ".join(f"{g} final | Δ clip | Δ default" for g in regimes) + " |")
        out.append("|---|---|" + "---:|---:|---:|" * len(regimes))
        for label in labels:
            v = result["variants"][label]
            cells = []
            for g in regimes:
                c = _cell(result, g, label, key)
                cells += [pm(c["final_reward"]), "(ref)" if label == REFERENCE else pts(c["vs_ppo_points"]),
                          "-" if label in (REFERENCE, DEFAULT_LABEL) else pts(c["vs_default_points"])]
            name = f"**{label}**" if label in (dec["winner"], DEFAULT_LABEL) else label
            name += " (contrast)" if v["contrast"] else ""
            out.append(f"| {name} | {v['factor']} | " + " | ".join(cells) + " |")
        out.append("")
    for key in PRIMARY:
        if key not in keys:
            continue
        out.append(f"**{key}: early diagnostics (mean over seeds): reward at a quarter of the budget; grad_throughput "
                   "pos / neg; starved_frac pos; low-weight positives' share → mass share (ratio); max drop of the "
                   "seed-mean curve**\n")
        out.append("| variant | " + " | ".join(f"{g}: early | tp pos / neg | starved | low-W pos | drop"
                                                for g in regimes) + " |")
        out.append("|---|" + "---:|---:|---:|---:|---:|" * len(regimes))
        for label in labels:
            cells = []
            for g in regimes:
                c = _cell(result, g, label, key)
                lw = c["low_weight_pos"]
                low = "-" if lw["share"] != lw["share"] else (
                    f"{100 * lw['share']:.0f}% → {100 * lw['mass_share']:.0f}% ({lw['mass_ratio']:.2f}x)")
                cells += [f"{c['reward_at_quarter']['mean']:.3f}",
                          f"{c['grad_throughput_pos']['mean']:.2f} / {c['grad_throughput_neg']['mean']:.2f}",
                          f"{c['starved_frac_pos']['mean']:.2f}", low, f"{c['max_drop']:.3f}"]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("**Decision: constants (criteria 1-4)**\n")
    out.append("| variant | worst Δ clip (primary) | mean Δ default (primary) | stability (3) | bar (2) | "
               "confirmed (4) |")
    out.append("|---|---:|---:|---|---|---|")
    constants = {k: row for k, row in dec["table"].items()
                 if result["variants"][k]["factor"] in ("default", "pos", "neg")}
    rows = sorted(constants.items(), key=lambda kv: -kv[1].get("worst_vs_ppo_points", -math.inf))
    for label, row in rows:
        contrast = result["variants"][label]["contrast"]
        bar_text = "-" if label == DEFAULT_LABEL else ("passes" if not row.get("bar") else "; ".join(row["bar"]))
        if contrast:
            bar_text = f"{bar_text} (contrast: never a default, 7)"
        conf = row.get("confirmation")
        conf_text = "" if conf is None else ("yes" if conf["confirmed"] else "no") + " (" + ", ".join(
            f"{c} {d['mean']:+.1f}" for c, d in conf["vs_default_points"].items()) + ")"
        out.append(f"| {label} | {row.get('worst_vs_ppo_points', math.nan):+.1f} | "
                   f"{row.get('mean_vs_default_points', math.nan):+.1f} | "
                   f"{'ok' if not row['stability'] else '; '.join(row['stability'])} | {bar_text} | {conf_text} |")
    out.append("")
    conf = result.get("confirmation")
    if conf:
        out.append(f"**Confirmation on fresh seeds {conf['seeds']}** (final reward mean ± std; seed-paired gaps in "
                   "points, mean ± SE)\n")
        names = list(conf["regimes"])
        cks = [k for k in PRIMARY if k in conf["settings"]]
        heads = [f"{g} {k} final | Δ clip | Δ default" for g in names for k in cks]
        out.append("| variant | " + " | ".join(heads) + " |")
        out.append("|---|" + "---:|---:|---:|" * (len(names) * len(cks)))
        for label in next(iter(conf["regimes"].values()))["results"]:
            cells = []
            for g in names:
                for k in cks:
                    c = conf["regimes"][g]["results"][label][k]
                    cells += [pm(c["final_reward"]), "(ref)" if label == REFERENCE else pts(c["vs_ppo_points"]),
                              "-" if label in (REFERENCE, DEFAULT_LABEL) else pts(c["vs_default_points"])]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    if dec["normalisation"]:
        out.append("**Decision: normalisation (criterion 5)**\n")
        out.append("| option | better than none (> 2 SE) | worse than none (> 2 SE) | earns its place |")
        out.append("|---|---|---|---|")
        for label, n in dec["normalisation"].items():
            out.append(f"| {label} | {', '.join(n['better_than_none_beyond_2se']) or 'nowhere'} | "
                       f"{', '.join(n['worse_than_none_beyond_2se']) or 'nowhere'} | "
                       f"{'yes' if n['earns_its_place'] else 'no'} |")
        out.append("")
    masks = [k for k in labels if result["variants"][k]["factor"] == "mask"]
    if masks:
        out.append("**Token masks: seed-paired gap to the paper default (no mask) in points (mean ± SE), and the "
                   "low-weight positives' mass ratio (early)**\n")
        out.append("| mask | " + " | ".join(f"{g} {k}" for k in keys for g in regimes) + " |")
        out.append("|---|" + "---:|" * (len(keys) * len(regimes)))
        for label in masks:
            cells = []
            for k in keys:
                for g in regimes:
                    c = _cell(result, g, label, k)
                    cells.append(f"{pts(c['vs_default_points'])} ({c['low_weight_pos']['mass_ratio']:.2f}x)")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        ref = [f"{_cell(result, g, DEFAULT_LABEL, k)['low_weight_pos']['mass_ratio']:.2f}x" for k in keys
               for g in regimes]
        out.append("| (no mask: ratio) | " + " | ".join(ref) + " |")
        out.append("")
    if dec["trust_mask"]:
        m = dec["trust_mask"]
        epoch = [k for k in EPOCH_CELLS if k in keys]
        verdict = "on for R > 1 (auto)" if m["epochs"]["mask_default_for_R_gt_1"] else "not supported by the lab"
        out.append("**Decision: directional trust mask (criterion 6)**: epochs: mean gap to no mask "
                   f"{m['epochs']['mean_gap_points']:+.1f} points over {', '.join(epoch)} x {len(regimes)} regimes, "
                   f"worse beyond 2 SE at {', '.join(m['epochs']['worse_beyond_2se']) or 'no cell'} -> {verdict}; "
                   f"staleness: {'mask' if m['staleness']['mask_default_for_N'] else 'no mask (paper-pure) stays'}"
                   + (f" ({'; '.join(m['staleness']['bar'])})" if m["staleness"]["bar"] else "") + ".\n")
    recommended = dict(dec["recommended"])
    if dec["trust_mask"].get("epochs", {}).get("mask_default_for_R_gt_1") and not dec["trust_mask"]["staleness"][
            "mask_default_for_N"]:
        recommended["respo_trust_mask"] = "'auto' (on for R > 1, off when each sample is used once)"
    out.append(f"Winner (constants): **{dec['winner']}** ({'changes' if dec['changes_default'] else 'keeps'} the "
               "paper's constants). Recommended: " + ", ".join(f"{k}={v}" for k, v in recommended.items()))
    chk = result.get("on_policy_check", {})
    if chk:
        out.append("\nR = 1 check (every variant is the on-policy gradient): "
                   + "; ".join(f"{g}: max |reward - clipped PPO's| {c['max_abs_reward_deviation']:.1e}, max "
                               f"|throughput - 1| {c['max_abs_throughput_deviation']:.1e}" for g, c in chk.items()))
    return "\n".join(out)


def _round(value, digits: int = 4):
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _round(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v, digits) for v in value]
    return value


def write(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ablation_lab.json")
    with open(path, "w") as f:
        json.dump(_round(result), f, allow_nan=True, separators=(",", ":"))
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------

FULL_SETTINGS = ["R=4", "N=8", "N=32"]
FULL = dict(seeds=tuple(range(8)), diag_every=10**9)  # diagnostics on the early updates only
FULL_CONFIRM_SEEDS = tuple(range(8, 16))
QUICK_SETTINGS = ["R=1", "R=4", "N=8"]
QUICK_CONFIRM_SEEDS = (2, 3)
QUICK = dict(prompts=8, group=8, max_len=64, min_len=16, batches=6, seeds=(0, 1), minibatch_prompts=4,
             diag_every=10**9)
QUICK_LEVELS = {"norm": [("respo_sqrt", {})],
                "mask": [("respo", {"respo_trust_mask": True}), ("respo_symmetric", {})],
                "pos": [("respo", {"respo_lambda_pos": 1.0}), ("respo", {"respo_beta_pos": 0.0})],
                "neg": [("respo", {"respo_lambda_neg": 3.0})]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "ablation_lab"), help="directory for the JSON and PNG")
    parser.add_argument("--quick", action="store_true", help="smoke size: reduced grid and lab (seconds)")
    parser.add_argument("--factors", nargs="+", default=["norm", "mask", "pos", "neg"],
                        choices=["norm", "mask", "pos", "neg"])
    parser.add_argument("--settings", nargs="+", help="reuse settings, e.g. R=1 R=4 N=8 (default R=4 N=8 N=32)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (default 0..7)")
    parser.add_argument("--batches", type=int, help="budget in generation batches (lab default 24)")
    parser.add_argument("--confirm-seeds", nargs="+", type=int, help="fresh seeds of the confirmation (default 8..15)")
    parser.add_argument("--no-confirm", action="store_true", help="skip the confirmation on fresh seeds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on the shared box)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--markdown-from", metavar="JSON", help="print the docs tables of an existing result and exit")
    args = parser.parse_args(argv)
    if args.markdown_from:
        with open(args.markdown_from) as f:
            result = json.load(f)
        print(markdown(result))
        return result

    torch.set_num_threads(args.threads)
    cfg = sim.LabConfig(**(QUICK if args.quick else FULL))
    settings = args.settings or (QUICK_SETTINGS if args.quick else FULL_SETTINGS)
    for key in settings:
        sim.Reuse.parse(key)
    overrides = {"seeds": tuple(args.seeds)} if args.seeds else {}
    if args.batches:
        overrides["batches"] = args.batches
    cfg = dataclasses.replace(cfg, **overrides)
    variants = make_variants(args.factors, QUICK_LEVELS if args.quick else None)
    print(f"ablation lab: {len(variants)} variants x {settings} x {len(cfg.seeds)} seeds x {len(cfg.regimes)} regimes",
          flush=True)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    log = lambda line: print(line, flush=True)  # noqa: E731
    confirm_runner = None
    if not args.no_confirm:
        seeds = tuple(args.confirm_seeds or (QUICK_CONFIRM_SEEDS if args.quick else FULL_CONFIRM_SEEDS))
        if set(seeds) & set(cfg.seeds):
            raise SystemExit(f"--confirm-seeds {seeds} must be fresh (phase 1 seeds: {cfg.seeds})")
        primary = [k for k in settings if k in PRIMARY]
        confirm_runner = lab_runner(dataclasses.replace(cfg, seeds=seeds), primary, log=log)
    result = run_ablation(lab_runner(cfg, settings, log=log), variants, confirm_runner=confirm_runner, log=log)
    result = {
        "config": {**dataclasses.asdict(cfg), "settings": settings, "default": DEFAULT, "primary": list(PRIMARY),
                   "check": list(CHECK)},
        **result,
        "runtime_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - cpu0,
        "command": command("ablation_lab", argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
    }
    print(f"wrote {write(result, args.out)}")
    if not args.no_plot:
        print(f"wrote {plot(result, os.path.join(args.out, 'ablation_lab.png'))}")
    print()
    print(markdown(result))
    print(f"\ntotal {result['runtime_s']:.1f}s wall, {result['cpu_s']:.1f}s CPU")
    return result


if __name__ == "__main__":
    main()
