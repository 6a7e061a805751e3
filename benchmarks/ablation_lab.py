"""Ablation lab: which normalisation and which (alpha, lambda) per branch ReSPO should default to.

What it does
------------
Runs the starvation lab (``benchmarks/starvation_lab.py``: its task, its training loop, its diagnostics; nothing is
re-simulated here) for ReSPO *variants only*, against clipped token PPO (TRL ``dapo``, the ``ppo`` registry loss) as
the reference row, in both lab regimes (``moderate``: Adam lr 0.1, ``stress``: lr 1.0), at reuse ``R`` in {1, 4, 8},
8 seeds. The design is one factor at a time around the spec's starting default (``sqrt``, ``(0.5, 0.5)`` / ``(2, 2)``):

* normalisation ``respo_norm`` in {none, mean, sqrt, ess} (ess with ``respo_rho_min`` in {0.3, 0.5, 0.8});
* positive branch ``(alpha_pos, lambda_pos)`` in {(0.25, 0.25), (0.5, 0.5), (0.5, 1), (1, 1)}, plus contrasts
  outside the spec's regime: ``(0, 0)`` (no correction, ``phi = 1``) and VESPO's ``(2, 3)``;
* negative branch ``(alpha_neg, lambda_neg)`` in {(1, 1.5), (1, 2), (2, 2), (3, 3), (2, 3), (3, 2)}, plus contrasts
  ``(0.5, 0.5)`` and ``(0, 0)`` (plain policy gradient on wrong rollouts);
* phase 2: combined candidates built *automatically* (the top two in-regime levels of each branch by criterion 5,
  crossed at the best normalisation), so the "looks best" combinations are reproducible, not hand-picked;
* phase 3: the candidates that pass the bar, re-run with the default and clipped PPO on 8 fresh seeds.

Metrics per variant, regime and R (mean ± sample std over seeds, plus per-seed values): final expected reward; reward
at a quarter of the budget; early (first-quarter) ``grad_throughput/pos`` and ``/neg`` and ``starved_frac/pos``;
``max_drop`` (largest drawdown of the seed-mean reward curve: monotonicity); and the seed-paired difference to
clipped PPO and to the ReSPO default (mean, std, standard error, in reward points). At R = 1 every variant is the
on-policy run (``phi(1) = 1``): the JSON records the largest R = 1 deviation from clipped PPO's curves as a check.

Decision rule (1-5 fixed before the runs; ``CRITERIA`` below is the text written into the JSON and the docs)
-------------------------------------------------------------------------------------------------------------
1. Primary score: the worst case over the two regimes of ``Delta = final reward(variant) - final reward(clipped PPO)``
   at R = 4, seed-paired, in points.
2. Adoption bar: a variant replaces the spec default only if, at R = 4, it beats the default in *both* regimes
   (seed-paired mean difference > 0) and by more than 2 standard errors in at least one of them; and at R = 8 it is
   not worse than the default by more than 2 standard errors in either regime.
3. Stability guard: every seed finite, and the seed-mean curve's max drop at R = 4 and R = 8 at most
   ``max(0.02, clipped PPO's)``.
4. Only settings inside the spec's regime (``alpha_pos`` in [0, 0.5]; ``alpha_neg`` in [1, 3], ``lambda_neg`` in
   [1.5, 3]) can become defaults; the other rows are contrasts, reported as findings.
5. Among the variants that pass 2-4, the best primary score wins; within 1 point, the better worst-case early reward
   (quarter budget), then the higher early ``grad_throughput/pos`` at R = 4. If none passes, the spec default stays.

Two guards were added after the first full run (both can only move the result *toward* the spec default):

6. Confirmation: up to three passing candidates are re-run with the default and clipped PPO on 8 fresh seeds
   (8-15, R = 4 and 8); the best-ranked one that again beats the default at R = 4 in both regimes is adopted (one
   slot, ~20 variants: selection luck is real).
7. Parsimony: a changed factor of the winner is reverted to the default when the setting without it also passed
   2-6 and the seed-paired gap between the two at R = 4, over all 16 seeds, is within 2 SE in both regimes.

How to run
----------
    PYTHONPATH=. python benchmarks/ablation_lab.py                         # full grid + phases 2-3, ~7 min
    PYTHONPATH=. python benchmarks/ablation_lab.py --quick --out /tmp/abl  # smoke size, ~4 s
    PYTHONPATH=. python benchmarks/ablation_lab.py --markdown-from docs/benchmarks/ablation_lab.json
    PYTHONPATH=. python benchmarks/ablation_lab.py --factors neg --reuse 1 4 --seeds 0 1 2   # one factor, cheaper

Writes ``--out``/``ablation_lab.json`` (default ``docs/benchmarks``) and ``ablation_lab.png`` (final reward by
variant, both regimes, R = 4 and 8, error bars = std over seeds, clipped PPO as a band). Runtime: 19 variants
(phase 1) + up to 4 combinations (phase 2) x 2 regimes x R in {1, 4, 8} x 8 seeds (batched in one pass), then phase 3
(5 settings x R in {4, 8} x 8 fresh seeds): ~6.5 min with one torch thread on the shared 2-core dev box.

Reuse on another setting: :func:`run_ablation` takes a ``runner(variants) -> {regime: {label: {"R=r": metrics}}}``
with the lab's metric schema (``final_reward``, ``reward_at_quarter``, ``grad_throughput_pos``/``neg``,
``starved_frac_pos`` as ``{"mean", "std", "per_seed"}``, ``finite``, ``curves.reward`` as ``[seed][batch]``); the
default :func:`lab_runner` runs the starvation lab at any ``LabConfig``. A tiny-LM runner with the same schema can
reuse the variants, the scoring and the decision rule unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import sys
import time
from typing import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from respo_trl.kernels import LossParams  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402


def _load_lab():
    """``benchmarks/starvation_lab.py`` as a module (recipes is not a package)."""
    if "starvation_lab" in sys.modules:
        return sys.modules["starvation_lab"]
    spec = importlib.util.spec_from_file_location("starvation_lab", ROOT / "recipes" / "starvation_lab.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["starvation_lab"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


lab = _load_lab()

CRITERIA = [
    "1. Primary score: worst case over the two regimes of Delta = final reward(variant) - final reward(clipped PPO) "
    "at R = 4, seed-paired, in points.",
    "2. Adoption bar: a variant replaces the spec default only if at R = 4 it beats the default in both regimes "
    "(seed-paired mean difference > 0) and by more than 2 standard errors in at least one; and at R = 8 it is not "
    "worse than the default by more than 2 standard errors in either regime.",
    "3. Stability guard: every seed finite; max drop of the seed-mean reward curve at R = 4 and 8 at most "
    "max(0.02, clipped PPO's).",
    "4. Only settings inside the spec's regime (alpha_pos in [0, 0.5]; alpha_neg in [1, 3], lambda_neg in [1.5, 3]) "
    "can become defaults; the others are contrasts.",
    "5. Among variants passing 2-4 the best primary score wins; within 1 point, the better worst-case early reward "
    "(quarter budget), then higher early grad_throughput/pos at R = 4. If none passes, the spec default stays.",
    "6. Confirmation (added after the first full run, against selection luck among ~20 variants): the passing "
    "candidates are re-run with the default and clipped PPO on 8 fresh seeds (R = 4 and 8); the best-ranked one that "
    "again beats the default at R = 4 in both regimes (seed-paired mean > 0) is adopted.",
    "7. Parsimony (added after the first full run, toward the spec default): a changed factor of the winner is "
    "reverted to the default when the setting without it also passed 2-6 and the gap between the two at R = 4, "
    "seed-paired over all their seeds, is within 2 SE in both regimes.",
]

DEFAULT = {"respo_norm": "sqrt", "respo_rho_min": 0.5, "respo_alpha_pos": 0.5, "respo_lambda_pos": 0.5,
           "respo_alpha_neg": 2.0, "respo_lambda_neg": 2.0}  # the spec's starting defaults (the package's today)
REFERENCE = "ppo_clip"
DEFAULT_LABEL = "respo"
PRIMARY_R = 4
CHECK_R = 8
MAX_CONFIRM = 3  # phase 3 re-runs at most this many passing candidates
FACTOR_ORDER = ("reference", "default", "norm", "pos", "neg", "combined")


def _num(x: float) -> str:
    return f"{x:g}"


def variant_label(overrides: dict) -> str:
    """A short label for the ReSPO setting that differs from the default by ``overrides``."""
    p = {**DEFAULT, **overrides}
    parts = []
    if p["respo_norm"] != DEFAULT["respo_norm"] or p["respo_rho_min"] != DEFAULT["respo_rho_min"]:
        parts.append(f"norm={p['respo_norm']}" + (f"({_num(p['respo_rho_min'])})" if p["respo_norm"] == "ess" else ""))
    if (p["respo_alpha_pos"], p["respo_lambda_pos"]) != (DEFAULT["respo_alpha_pos"], DEFAULT["respo_lambda_pos"]):
        parts.append(f"pos=({_num(p['respo_alpha_pos'])},{_num(p['respo_lambda_pos'])})")
    if (p["respo_alpha_neg"], p["respo_lambda_neg"]) != (DEFAULT["respo_alpha_neg"], DEFAULT["respo_lambda_neg"]):
        parts.append(f"neg=({_num(p['respo_alpha_neg'])},{_num(p['respo_lambda_neg'])})")
    return " ".join(parts) or DEFAULT_LABEL


def in_spec_regime(overrides: dict) -> bool:
    p = {**DEFAULT, **overrides}
    return (0.0 <= p["respo_alpha_pos"] <= 0.5 and 1.0 <= p["respo_alpha_neg"] <= 3.0
            and 1.5 <= p["respo_lambda_neg"] <= 3.0)


NORM_LEVELS = [{"respo_norm": "none"}, {"respo_norm": "mean"}, {"respo_norm": "sqrt"},
               {"respo_norm": "ess", "respo_rho_min": 0.3}, {"respo_norm": "ess", "respo_rho_min": 0.5},
               {"respo_norm": "ess", "respo_rho_min": 0.8}]
POS_LEVELS = [(0.25, 0.25), (0.5, 0.5), (0.5, 1.0), (1.0, 1.0), (0.0, 0.0), (2.0, 3.0)]
NEG_LEVELS = [(1.0, 1.5), (1.0, 2.0), (2.0, 2.0), (3.0, 3.0), (2.0, 3.0), (3.0, 2.0), (0.5, 0.5), (0.0, 0.0)]
NOTES = {"pos=(0,0)": "contrast: phi = 1 (no correction)", "pos=(2,3)": "contrast: VESPO's positive branch",
         "neg=(3,2)": "VESPO's negative branch", "neg=(0.5,0.5)": "contrast: soft, outside the regime",
         "neg=(0,0)": "contrast: phi = 1 (plain PG on negatives)", "norm=none": "true product ratio (VESPO)",
         "norm=mean": "geometric mean (GSPO)", "pos=(1,1)": "alpha_pos > 0.5: outside the spec's regime"}


def factor_levels(factor: str) -> list[dict]:
    if factor == "norm":
        return [dict(x) for x in NORM_LEVELS]
    if factor == "pos":
        return [{"respo_alpha_pos": a, "respo_lambda_pos": lam} for a, lam in POS_LEVELS]
    if factor == "neg":
        return [{"respo_alpha_neg": a, "respo_lambda_neg": lam} for a, lam in NEG_LEVELS]
    raise ValueError(f"unknown factor {factor!r}")


def make_variants(factors=("norm", "pos", "neg"), levels: dict | None = None) -> dict:
    """``{label: {"registry", "overrides", "factor", "in_regime", "note"}}``: the reference, the default and the
    one-factor-at-a-time levels (``levels`` may replace a factor's list of overrides, e.g. for a reduced grid)."""
    variants = {REFERENCE: {"registry": "ppo", "overrides": {}, "factor": "reference", "in_regime": None,
                            "note": "clipped token PPO, epsilon 0.2 (TRL dapo)"},
                DEFAULT_LABEL: {"registry": "respo", "overrides": {}, "factor": "default", "in_regime": True,
                                "note": "spec starting default: sqrt, (0.5, 0.5) / (2, 2)"}}
    for factor in factors:
        for overrides in (levels or {}).get(factor, factor_levels(factor)):
            changed = {k: v for k, v in overrides.items() if DEFAULT.get(k) != v}
            label = variant_label(changed)
            if label in variants:
                continue
            variants[label] = {"registry": "respo", "overrides": changed, "factor": factor,
                               "in_regime": in_spec_regime(changed), "note": NOTES.get(label, "")}
    return variants


# ---------------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------------


def lab_runner(cfg, log=print) -> Callable[[dict], dict]:
    """A runner on the starvation lab at ``cfg`` (any ``LabConfig``): ``variants -> {regime: {label: {"R=r": ...}}}``."""
    task = lab.Task(cfg, cfg.seeds)

    def run(variants: dict) -> dict:
        kernels = {label: (v["registry"], v["overrides"]) for label, v in variants.items()}
        start = time.perf_counter()
        out = {}
        for regime, lr in cfg.regimes:
            log(f"-- regime {regime!r}: Adam lr {lr}")
            out[regime] = lab.run_regime(task, dataclasses.replace(cfg, lr=lr), kernels, LossParams(), log, start)
        return out

    run.regimes = dict(cfg.regimes)
    run.reuse = tuple(cfg.reuse)
    run.seeds = tuple(cfg.seeds)
    return run


def _stats(values: list[float]) -> dict:
    vals = [v for v in values if v == v]
    n = len(vals)
    mean = sum(vals) / n if n else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "se": std / math.sqrt(n) if n else math.nan}


def max_drop(curve: list[float]) -> float:
    """Largest drawdown of a curve: ``max_t (max_{s <= t} y_s - y_t)`` (0 for a never-decreasing curve)."""
    peak, drop = -math.inf, 0.0
    for y in curve:
        peak = max(peak, y)
        drop = max(drop, peak - y)
    return drop


def compact(run: dict, ref: dict | None, default: dict | None) -> dict:
    """The ablation's metrics of one (variant, regime, R) cell from the lab's result ``run``."""
    reward = torch.tensor(run["curves"]["reward"], dtype=torch.float64)  # [seed][batch]
    mean_curve = reward.mean(0).tolist()
    out = {key: {k: run[key][k] for k in ("mean", "std", "per_seed")}
           for key in ("final_reward", "reward_at_quarter", "grad_throughput_pos", "grad_throughput_neg",
                       "starved_frac_pos", "final_reward_hard", "final_beta")}
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
    """``{regime: {label: {"R=r": lab metrics}}}`` -> the same with :func:`compact` cells (gaps to PPO and default)."""
    out = {}
    for regime, by_label in raw.items():
        ref, default = by_label[REFERENCE], by_label.get(DEFAULT_LABEL, {})
        out[regime] = {label: {key: compact(run, ref.get(key), default.get(key)) for key, run in by_r.items()}
                       for label, by_r in by_label.items()}
    return out


def run_ablation(runner: Callable[[dict], dict], variants: dict, combine: bool = True,
                 confirm_runner: Callable[[dict], dict] | None = None, log=print) -> dict:
    """Phase 1 (``variants``), phase 2 (combined candidates), scoring and the decision; with ``confirm_runner``
    (the same setting on fresh seeds), phase 3 re-runs the candidates that pass the bar, with the default and the
    reference, and the decision adopts only a confirmed one. Returns the JSON-ready result."""
    start = time.perf_counter()
    raw = runner(variants)
    variants = dict(variants)
    if combine:
        extra = combined_candidates({"variants": variants, "regimes": {
            g: {"results": cells} for g, cells in _compact_raw(raw).items()}})
        if extra:
            log(f"-- phase 2: combined candidates {list(extra)}")
            raw2 = runner(extra)
            for regime in raw:
                raw[regime].update(raw2[regime])
            variants.update(extra)
    lrs = getattr(runner, "regimes", {})
    result = {"variants": variants, "criteria": CRITERIA,
              "regimes": {g: {"lr": lrs.get(g), "results": cells} for g, cells in _compact_raw(raw).items()}}
    result["on_policy_check"] = on_policy_check(raw)
    result["decision"] = decide(result)
    if confirm_runner is not None:
        candidates = result["decision"]["passing"][:MAX_CONFIRM]
        log(f"-- phase 3: confirmation on fresh seeds of {candidates or 'nothing (no variant passes)'}")
        if candidates:
            keep = [REFERENCE, DEFAULT_LABEL, *candidates]
            raw3 = confirm_runner({k: variants[k] for k in keep})
            result["confirmation"] = {
                "seeds": list(getattr(confirm_runner, "seeds", [])),
                "reuse": list(getattr(confirm_runner, "reuse", [])),
                "regimes": {g: {"lr": lrs.get(g), "results": cells} for g, cells in _compact_raw(raw3).items()},
            }
            result["decision"] = decide(result)
    result["runtime_s"] = time.perf_counter() - start
    return result


def on_policy_check(raw: dict) -> dict:
    """Largest |reward curve - clipped PPO's| over R = 1 runs (all variants are the on-policy gradient there)."""
    out = {}
    for regime, by_label in raw.items():
        if "R=1" not in by_label[REFERENCE]:
            continue
        ref = torch.tensor(by_label[REFERENCE]["R=1"]["curves"]["reward"])
        dev = max(float((torch.tensor(r["R=1"]["curves"]["reward"]) - ref).abs().max()) for r in by_label.values())
        tp = max(max(abs(r["R=1"]["grad_throughput_pos"]["mean"] - 1), abs(r["R=1"]["grad_throughput_neg"]["mean"] - 1))
                 for r in by_label.values())
        out[regime] = {"max_abs_reward_deviation": dev, "max_abs_throughput_deviation": tp}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Scoring and the decision
# ---------------------------------------------------------------------------------------------------------------------


def _cell(result, regime, label, reuse):
    return result["regimes"][regime]["results"][label].get(f"R={reuse}")


def score(result: dict, label: str, reuse: int = PRIMARY_R) -> dict:
    """Primary score and tie-breakers of ``label``: worst case over regimes at R = ``reuse``."""
    regimes = list(result["regimes"])
    cells = {g: _cell(result, g, label, reuse) for g in regimes}
    if any(c is None for c in cells.values()):
        return {}
    return {
        "worst_vs_ppo_points": min(c["vs_ppo_points"]["mean"] for c in cells.values()),
        "worst_early_reward": min(c["reward_at_quarter"]["mean"] for c in cells.values()),
        "mean_early_throughput_pos": sum(c["grad_throughput_pos"]["mean"] for c in cells.values()) / len(cells),
    }


def gate(result: dict, label: str) -> dict:
    """Criteria 2-4 for ``label`` against the default: ``{"passes": bool, "reasons": [...]}``."""
    reasons = []
    v = result["variants"][label]
    if not v.get("in_regime"):
        reasons.append("outside the spec's regime")
    regimes = list(result["regimes"])
    rs = {int(k[2:]) for k in result["regimes"][regimes[0]]["results"][label]}
    primary = [_cell(result, g, label, PRIMARY_R)["vs_default_points"] for g in regimes]
    if not all(d["mean"] > 0 for d in primary):
        reasons.append(f"not better than the default at R={PRIMARY_R} in both regimes ("
                       + ", ".join(f"{g} {d['mean']:+.1f}" for g, d in zip(regimes, primary)) + " points)")
    elif not any(d["mean"] > 2 * d["se"] for d in primary):
        reasons.append(f"better than the default at R={PRIMARY_R} in both regimes but within 2 SE in both")
    if CHECK_R in rs:
        for g in regimes:
            d = _cell(result, g, label, CHECK_R)["vs_default_points"]
            if d["mean"] < -2 * d["se"]:
                reasons.append(f"worse than the default at R={CHECK_R} ({g}: {d['mean']:+.1f} points, SE {d['se']:.1f})")
    for g in regimes:
        for reuse in sorted(r for r in rs if r > 1 and r in (PRIMARY_R, CHECK_R)):
            c, ref = _cell(result, g, label, reuse), _cell(result, g, REFERENCE, reuse)
            if not c["finite"]:
                reasons.append(f"non-finite run ({g}, R={reuse})")
            if c["max_drop"] > max(0.02, ref["max_drop"]) + 1e-9:
                reasons.append(f"seed-mean reward drops by {c['max_drop']:.3f} ({g}, R={reuse})")
    return {"passes": not reasons, "reasons": reasons}


def _best(result: dict, labels: list[str]) -> str | None:
    """Criterion 5: best primary score; within 1 point of it, the better worst-case early reward, then the higher
    early positive throughput."""
    scored = {k: score(result, k) for k in labels}
    scored = {k: s for k, s in scored.items() if s}
    if not scored:
        return None
    top = max(s["worst_vs_ppo_points"] for s in scored.values())
    close = [k for k, s in scored.items() if s["worst_vs_ppo_points"] >= top - 1.0]
    return max(close, key=lambda k: (scored[k]["worst_early_reward"], scored[k]["mean_early_throughput_pos"]))


def ranked(result: dict, labels: list[str]) -> list[str]:
    """``labels`` in the order of criterion 5 (best first)."""
    left, out = list(labels), []
    while left:
        best = _best(result, left)
        if best is None:
            break
        out.append(best)
        left.remove(best)
    return out


def confirm(result: dict, label: str) -> dict | None:
    """Phase 3 verdict: on the fresh seeds, ``label`` beats the default at R = 4 in both regimes (paired mean > 0)."""
    conf = result.get("confirmation")
    if not conf or label not in next(iter(conf["regimes"].values()))["results"]:
        return None
    diffs = {g: r["results"][label][f"R={PRIMARY_R}"]["vs_default_points"] for g, r in conf["regimes"].items()}
    vs_ppo = {g: r["results"][label][f"R={PRIMARY_R}"]["vs_ppo_points"] for g, r in conf["regimes"].items()}
    return {"confirmed": all(d["mean"] > 0 for d in diffs.values()),
            "vs_default_points": {g: {k: d[k] for k in ("mean", "se")} for g, d in diffs.items()},
            "vs_ppo_points": {g: {k: d[k] for k in ("mean", "se")} for g, d in vs_ppo.items()}}


def decide(result: dict) -> dict:
    """Apply the criteria: per-factor leaders, the variants that pass the bar (ranked), the confirmation verdicts
    where phase 3 ran, and the recommended defaults."""
    variants = result["variants"]
    respo = [k for k, v in variants.items() if v["registry"] == "respo"]
    table = {k: {**score(result, k), **gate(result, k)} for k in respo if k != DEFAULT_LABEL}
    table[DEFAULT_LABEL] = {**score(result, DEFAULT_LABEL), "passes": None, "reasons": ["the default itself"]}
    leaders = {}
    for factor in ("norm", "pos", "neg", "combined"):
        in_factor = [k for k in respo if variants[k]["factor"] in (factor, "default") and variants[k]["in_regime"]]
        if len(in_factor) > 1:
            leaders[factor] = _best(result, in_factor)
    passing = ranked(result, [k for k, row in table.items() if row.get("passes")])
    winner = None
    for label in passing:
        verdict = confirm(result, label)
        if verdict is not None:
            table[label]["confirmation"] = verdict
        if winner is None and (verdict is None or verdict["confirmed"]):
            winner = label
    ranked_winner, trimmed = winner, []
    while winner is not None:  # criterion 7: drop the factors of the winner that carry no evidence of their own
        reduced = _drop_unsupported_factor(result, winner, passing, table)
        if reduced is None:
            break
        trimmed.append(reduced)
        winner = reduced["to"]
    chosen = winner or DEFAULT_LABEL
    return {
        "table": table,
        "factor_leaders": leaders,
        "passing": passing,
        "confirmation_ran": "confirmation" in result,
        "ranked_winner": ranked_winner,
        "parsimony": trimmed,
        "winner": chosen,
        "changes_default": winner is not None,
        "recommended": {**DEFAULT, **variants[chosen]["overrides"]},
        "best_overall_by_primary_score": _best(result, respo),
    }


FACTOR_KEYS = {"norm": ("respo_norm", "respo_rho_min"), "pos": ("respo_alpha_pos", "respo_lambda_pos"),
               "neg": ("respo_alpha_neg", "respo_lambda_neg")}


def _pooled_finals(result: dict, label: str, regime: str, reuse: int) -> list[float] | None:
    """Per-seed final rewards of ``label`` over phase 1 and, where it ran ``label``, the confirmation seeds."""
    out = []
    for src in (result, result.get("confirmation")):
        if not src:
            continue
        cell = src["regimes"][regime]["results"].get(label, {}).get(f"R={reuse}")
        if cell is None:
            if src is result:
                return None
            continue
        out += cell["final_reward"]["per_seed"]
    return out


def _drop_unsupported_factor(result: dict, label: str, passing: list[str], table: dict) -> dict | None:
    """Criterion 7 (parsimony): if reverting one changed factor of ``label`` to the default gives a setting that
    also passed (and, where phase 3 ran, was confirmed) and whose seed-paired gap to ``label`` at R = 4, pooled over
    all seeds that ran both, is within 2 SE in every regime, return ``{"from", "to", "factor", "gap_points"}``."""
    overrides = result["variants"][label]["overrides"]
    for factor, keys in FACTOR_KEYS.items():
        if not any(k in overrides for k in keys):
            continue
        reduced = variant_label({k: v for k, v in overrides.items() if k not in keys})
        row = table.get(reduced)
        if reduced == DEFAULT_LABEL or reduced not in passing or (row.get("confirmation") or {}).get(
                "confirmed") is False:
            continue
        gaps = {}
        for regime in result["regimes"]:
            a = _pooled_finals(result, label, regime, PRIMARY_R)
            b = _pooled_finals(result, reduced, regime, PRIMARY_R)
            n = min(len(a or []), len(b or []))
            if n < 2:
                break
            st = _stats([100 * (x - y) for x, y in zip(a[:n], b[:n])])
            gaps[regime] = {"mean": st["mean"], "se": st["se"], "n": n}
        if len(gaps) == len(result["regimes"]) and all(g["mean"] <= 2 * g["se"] for g in gaps.values()):
            return {"from": label, "to": reduced, "factor": factor, "gap_points": gaps}
    return None


def combined_candidates(prelim: dict) -> dict:
    """Phase 2 candidates from the phase-1 result: the top two in-regime levels (the default among them, criterion 5)
    of the positive and of the negative branch, crossed at the normalisation leader, plus all three leaders
    together when the normalisation leader is not the default. Settings already run are skipped."""
    variants = prelim["variants"]

    def top(factor: str, n: int) -> list[dict]:
        labels = [k for k, v in variants.items()
                  if v["registry"] == "respo" and v["factor"] in (factor, "default") and v["in_regime"]]
        return [variants[k]["overrides"] for k in ranked(prelim, labels)[:n]] if len(labels) > 1 else [{}]

    norm = top("norm", 1)[0]
    pos, neg = top("pos", 2), top("neg", 2)
    combos = [{**norm, **p, **n} for p in pos for n in neg]
    if norm:
        combos.append({**pos[0], **neg[0]})
    extra = {}
    for ov in combos:
        label = variant_label(ov)
        if label in variants or label in extra or sum(bool(x) for x in (
                {k: v for k, v in ov.items() if k.startswith("respo_norm") or k == "respo_rho_min"},
                {k: v for k, v in ov.items() if k.endswith("_pos")},
                {k: v for k, v in ov.items() if k.endswith("_neg")})) < 2:
            continue  # already run, or a single-factor change (phase 1 ran those)
        extra[label] = {"registry": "respo", "overrides": ov, "factor": "combined", "in_regime": in_spec_regime(ov),
                        "note": "phase 2: top factor levels combined"}
    return extra


# ---------------------------------------------------------------------------------------------------------------------
# Output: JSON, figure, markdown
# ---------------------------------------------------------------------------------------------------------------------


def _ordered(result: dict) -> list[str]:
    v = result["variants"]
    return sorted(v, key=lambda k: FACTOR_ORDER.index(v[k]["factor"]))


def plot(result: dict, path: str) -> str:
    """Final reward by variant (rows) for each regime at R = 4 and 8, error bars = std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [k for k in _ordered(result) if k != REFERENCE]
    regimes = list(result["regimes"])
    reuses = [r for r in (PRIMARY_R, CHECK_R) if f"R={r}" in result["regimes"][regimes[0]]["results"][REFERENCE]]
    colors = {"default": "tab:blue", "norm": "tab:green", "pos": "tab:orange", "neg": "tab:purple",
              "combined": "black"}
    fig, axes = plt.subplots(1, len(regimes) * len(reuses), figsize=(3.3 * len(regimes) * len(reuses) + 1.5,
                             0.28 * len(labels) + 1.6), sharey=True, squeeze=False)
    y = list(range(len(labels)))[::-1]
    for i, (regime, reuse) in enumerate((g, r) for g in regimes for r in reuses):
        ax = axes[0][i]
        res = result["regimes"][regime]["results"]
        ref = res[REFERENCE][f"R={reuse}"]["final_reward"]
        ax.axvspan(ref["mean"] - ref["std"], ref["mean"] + ref["std"], color="tab:red", alpha=0.12)
        ax.axvline(ref["mean"], color="tab:red", lw=1.2, label="clipped PPO (± std)")
        default = res[DEFAULT_LABEL][f"R={reuse}"]["final_reward"]["mean"]
        ax.axvline(default, color="tab:blue", lw=0.8, ls=":")
        for yy, label in zip(y, labels):
            st = res[label][f"R={reuse}"]["final_reward"]
            v = result["variants"][label]
            ax.errorbar(st["mean"], yy, xerr=st["std"], fmt="o" if v["in_regime"] else "x", capsize=2, ms=4,
                        color=colors.get(v["factor"], "k"))
        ax.set_title(f"{regime}, R = {reuse}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
        ax.set_xlabel("final expected reward", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_yticks(y, [lab_ + ("" if result["variants"][lab_]["in_regime"] else " *") for lab_ in labels],
                          fontsize=7)
    axes[0][0].legend(fontsize=7, loc="lower left")
    n = len(result["regimes"][regimes[0]]["results"][REFERENCE][f"R={reuses[0]}"]["final_reward"]["per_seed"])
    fig.suptitle(f"ReSPO ablation (starvation lab): final reward, mean ± std over {n} seeds; "
                 "* = outside the spec's regime; dotted = ReSPO default", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(result: dict) -> str:
    """The docs tables: final reward and gap to clipped PPO, early diagnostics, the decision."""
    regimes = list(result["regimes"])
    labels = _ordered(result)
    reuses = sorted({int(k[2:]) for k in result["regimes"][regimes[0]]["results"][REFERENCE]})
    big = [r for r in reuses if r > 1]
    dec = result["decision"]
    pm = lambda st, p=3: f"{st['mean']:.{p}f} ± {st['std']:.{p}f}"  # noqa: E731
    pts = lambda st: f"{st['mean']:+.1f} ± {st['se']:.1f}"  # noqa: E731
    out = []
    for reuse in big:
        out.append(f"**R = {reuse}: final reward (mean ± std over seeds) and seed-paired gap to clipped PPO in points "
                   "(mean ± standard error)**\n")
        out.append("| variant | factor | " + " | ".join(f"{g} final | {g} Δ clip" for g in regimes) + " | worst Δ |")
        out.append("|---|---|" + "---:|---:|" * len(regimes) + "---:|")
        for label in labels:
            v = result["variants"][label]
            cells, worst = [], math.inf
            for g in regimes:
                c = _cell(result, g, label, reuse)
                d = c.get("vs_ppo_points")
                cells += [pm(c["final_reward"]), "(ref)" if label == REFERENCE else pts(d)]
                worst = min(worst, d["mean"] if d else math.inf)
            name = f"**{label}**" if label in (dec["winner"], DEFAULT_LABEL) else label
            name += "" if v["in_regime"] in (True, None) else " *"
            w = "" if label == REFERENCE else f"{worst:+.1f}"
            out.append(f"| {name} | {v['factor']} | " + " | ".join(cells) + f" | {w} |")
        out.append("")
    out.append(f"**R = {PRIMARY_R}: early diagnostics (mean over seeds): reward at a quarter of the budget, "
               "grad_throughput pos / neg, starved_frac pos, max drop of the seed-mean curve; gap to the ReSPO default "
               "in points (mean ± SE)**\n")
    out.append("| variant | " + " | ".join(f"{g}: early reward | tp pos / neg | starved | max drop | Δ default"
                                            for g in regimes) + " |")
    out.append("|---|" + "---:|---:|---:|---:|---:|" * len(regimes))
    for label in labels:
        cells = []
        for g in regimes:
            c = _cell(result, g, label, PRIMARY_R)
            d = c.get("vs_default_points")
            cells += [f"{c['reward_at_quarter']['mean']:.3f}",
                      f"{c['grad_throughput_pos']['mean']:.2f} / {c['grad_throughput_neg']['mean']:.2f}",
                      f"{c['starved_frac_pos']['mean']:.2f}", f"{c['max_drop']:.3f}",
                      "-" if label == DEFAULT_LABEL or d is None else pts(d)]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("**Decision** (criteria above)\n")
    out.append("| variant | worst Δ clip @R=4 | worst early reward | passes 2-4 | confirmed (6) | why not |")
    out.append("|---|---:|---:|---|---|---|")
    rows = sorted(dec["table"].items(), key=lambda kv: -kv[1].get("worst_vs_ppo_points", -math.inf))
    for label, row in rows:
        ok = "-" if row["passes"] is None else ("yes" if row["passes"] else "no")
        verdict = row.get("confirmation")
        conf_cell = "" if verdict is None else ("yes" if verdict["confirmed"] else "no") + " (" + ", ".join(
            f"{g} {d['mean']:+.1f}" for g, d in verdict["vs_default_points"].items()) + ")"
        out.append(f"| {label} | {row.get('worst_vs_ppo_points', math.nan):+.1f} | "
                   f"{row.get('worst_early_reward', math.nan):.3f} | {ok} | {conf_cell} | {'; '.join(row['reasons'])} |")
    out.append("")
    conf = result.get("confirmation")
    if conf:
        out.append(f"**Confirmation on fresh seeds {conf['seeds']}** (R = {PRIMARY_R}; final reward mean ± std, "
                   "seed-paired gaps in points, mean ± SE)\n")
        names = list(conf["regimes"])
        out.append("| variant | " + " | ".join(f"{g} final | {g} Δ clip | {g} Δ default" for g in names) + " |")
        out.append("|---|" + "---:|---:|---:|" * len(names))
        for label in next(iter(conf["regimes"].values()))["results"]:
            cells = []
            for g in names:
                c = conf["regimes"][g]["results"][label][f"R={PRIMARY_R}"]
                cells += [pm(c["final_reward"]), "(ref)" if label == REFERENCE else pts(c["vs_ppo_points"]),
                          "-" if label == DEFAULT_LABEL else pts(c["vs_default_points"])]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    out.append(f"Factor leaders (in-regime, primary score): {dec['factor_leaders']}. "
               f"Best overall by primary score (any regime): {dec['best_overall_by_primary_score']}. "
               + "".join(f"Parsimony (7): {t['from']} -> {t['to']} (the {t['factor']} change adds "
                         + ", ".join(f"{g} {v['mean']:+.1f} ± {v['se']:.1f}" for g, v in t["gap_points"].items())
                         + f" points over {min(v['n'] for v in t['gap_points'].values())} seeds). "
                         for t in dec.get("parsimony", []))
               + f"Winner: **{dec['winner']}** ({'changes' if dec['changes_default'] else 'keeps'} the default): "
               + ", ".join(f"{k}={v}" for k, v in dec["recommended"].items()))
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

FULL = dict(reuse=(1, 4, 8), seeds=tuple(range(8)))
FULL_CONFIRM_SEEDS = tuple(range(8, 16))
QUICK_CONFIRM_SEEDS = (2, 3)
QUICK = dict(prompts=8, group=8, max_len=64, min_len=16, batches=6, seeds=(0, 1), reuse=(1, 4), diag_every=2)
QUICK_LEVELS = {"norm": [{"respo_norm": "mean"}, {"respo_norm": "ess", "respo_rho_min": 0.5}],
                "pos": [{"respo_alpha_pos": 0.25, "respo_lambda_pos": 0.25}],
                "neg": [{"respo_alpha_neg": 1.0, "respo_lambda_neg": 1.5}]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="directory for the JSON and PNG")
    parser.add_argument("--quick", action="store_true", help="smoke size: reduced grid and lab (seconds)")
    parser.add_argument("--factors", nargs="+", default=["norm", "pos", "neg"], choices=["norm", "pos", "neg"])
    parser.add_argument("--reuse", nargs="+", type=int, help="reuse values R (default 1 4 8)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (default 0..7)")
    parser.add_argument("--batches", type=int, help="generation batches per run (lab default 24)")
    parser.add_argument("--no-combine", action="store_true", help="skip phase 2 (combined candidates)")
    parser.add_argument("--confirm-seeds", nargs="+", type=int, help="fresh seeds of phase 3 (default 8..15)")
    parser.add_argument("--no-confirm", action="store_true", help="skip phase 3 (confirmation on fresh seeds)")
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
    cfg = lab.LabConfig(**(QUICK if args.quick else FULL))
    overrides = {k: tuple(v) for k, v in (("reuse", args.reuse), ("seeds", args.seeds)) if v}
    if args.batches:
        overrides["batches"] = args.batches
    cfg = dataclasses.replace(cfg, **overrides)
    variants = make_variants(args.factors, QUICK_LEVELS if args.quick else None)
    print(f"ablation lab: {len(variants)} variants x R in {list(cfg.reuse)} x {len(cfg.seeds)} seeds x "
          f"{len(cfg.regimes)} regimes (+ combined candidates)", flush=True)
    t0 = time.perf_counter()
    log = lambda line: print(line, flush=True)  # noqa: E731
    confirm_runner = None
    if not args.no_confirm:
        seeds = tuple(args.confirm_seeds or (QUICK_CONFIRM_SEEDS if args.quick else FULL_CONFIRM_SEEDS))
        if set(seeds) & set(cfg.seeds):
            raise SystemExit(f"--confirm-seeds {seeds} must be fresh (phase 1 seeds: {cfg.seeds})")
        reuse = tuple(r for r in cfg.reuse if r in (PRIMARY_R, CHECK_R))
        confirm_runner = lab_runner(dataclasses.replace(cfg, seeds=seeds, reuse=reuse), log=log)
    result = run_ablation(lab_runner(cfg, log=log), variants, combine=not args.no_combine,
                          confirm_runner=confirm_runner, log=log)
    result = {
        "config": {**dataclasses.asdict(cfg), "default": DEFAULT, "primary_R": PRIMARY_R, "check_R": CHECK_R},
        **result,
        "runtime_s": time.perf_counter() - t0,
        "command": "PYTHONPATH=. python benchmarks/ablation_lab.py " + " ".join(argv if argv is not None
                                                                               else sys.argv[1:]),
        "machine": machine_info(),
    }
    print(f"wrote {write(result, args.out)}")
    if not args.no_plot:
        print(f"wrote {plot(result, os.path.join(args.out, 'ablation_lab.png'))}")
    print()
    print(markdown(result))
    print(f"\ntotal {result['runtime_s']:.1f}s")
    return result


if __name__ == "__main__":
    main()
