"""Starvation lab: sign-dependent gradient starvation under both kinds of rollout reuse, on a simulated policy.

No LLM, CPU only: ~4 CPU-minutes for the full run (one torch thread), seconds at smoke size.

What it shows
-------------
The policy losses of :data:`respo_trl.kernels.POLICY_LOSSES` (clipped token PPO = TRL ``dapo``, GSPO, VESPO, ReSPO with
the paper's constants, ReSPO with the directional token trust mask, and two importance-sampling references registered
by the lab's engine, ``benchmarks/starvation_sim.py``: token IS and exact sequence IS) train the same simulated policy
under the two kinds of rollout reuse of the spec (section 4), at an equal budget of generated tokens. Also registered
there, for the ablation lab and ``--kernels`` only: ReSPO on a normalised weight ``exp(l / T)`` (``respo_mean``,
``respo_sqrt``, ``respo_ess``), the options the library removed on that ablation's evidence.

* **epochs** ``R`` in {1, 2, 4, 8} (TRL ``num_iterations``): each rollout batch of all ``P`` prompts feeds ``R``
  full-batch optimizer steps; every sample is used ``R`` times; pass ``r`` is ``r`` updates stale. More optimizer
  steps per generated token.
* **staleness** ``N`` in {1, 4, 8, 16, 32} (the paper's reuse): one rollout batch of ``N x M`` prompt draws is split
  into ``N`` mini-batches of ``M`` prompts, ``N`` consecutive updates, each sample used once; mini-batch ``k`` is
  ``k`` updates stale (``k = 0..N-1``). As in the paper, the mini-batch size and the number of updates are the same for
  every ``N`` (``budget x P / M`` updates), so at equal generated tokens ``N`` changes *only* the staleness (its
  practical benefit, fewer and larger generation rounds, costs nothing here and is not priced).

For every kernel and reuse setting (several seeds) it records, from :mod:`respo_trl.diagnostics` exactly as the
trainer logs them (``sequence_stats`` -> ``summarize``):

* the expected reward (exact, not sampled) against generated tokens: the reward curves, and the final reward;
* early ``starvation/grad_throughput/{pos,neg}`` (share of on-policy gradient mass the loss lets through, by
  advantage sign; 1 on-policy for every kernel), ``clip_grad_throughput/pos`` (clipped PPO on the same batch) and
  ``starved_frac/{pos,neg}`` (share of rollouts whose mean coefficient is below 0.1);
* the paper's positive-branch diagnostic ``starvation/low_weight_pos/{share,mass_share,mass_ratio}``: among positive
  responses, the share with ``log W < -1`` and the share of the positive coefficient mass they receive. The JSON keeps
  the step means of the logged share and mass share and their ratio (``mass_ratio``: the paper's 38.5% / 22.8% =
  1.69x is a ratio of the two shares) and the step mean of the logged per-step ratio (``mass_ratio_stepmean``);
* ``low_weight_same_batch``: in the ``respo`` runs, the same diagnostic for *every* kernel's coefficients on ReSPO's
  own batches (a same-batch counterfactual: the kernels' own runs see different weight distributions);
* each kernel's coefficient ``phi(W)`` by sign, read off the registry by autograd
  (:func:`respo_trl.kernels.gradient_coefficients` on a one-token sequence), so the figure is the code.

The losses are never re-implemented here: every step calls ``get_policy_loss(name)`` and aggregates the per-token loss
like TRL's ``dapo`` (token sum over the mini-batch's token count).

The simulated setting (explicit, so you can judge how far it transfers)
-----------------------------------------------------------------------
* ``P = 32`` prompts, ``G = 12`` completions per prompt (GRPO groups). Prompt ``p`` has a completion length ``L_p``
  drawn log-uniformly in [32, 256] tokens: long enough that a sequence's product weight ``W = exp(l)`` collapses or
  explodes from small per-token drift.
* Tokens are drawn position by position (independently given the prompt) from
  ``pi(. | p, t) = softmax(beta * Z0[p, t] + U[p, t])`` over ``V = 8`` tokens. ``Z0`` is a fixed random "pretrained"
  prior (std 2); ``U`` are trainable per-position logits; ``beta = exp(b)`` is one trainable scalar shared by every
  prompt and position: the policy's global sharpness, the channel through which learning on one prompt moves every
  other prompt, as an LLM's entropy does.
* Reward (verifiable, 0/1): prompt ``p`` has ``K_p = max(4, L_p // 16)`` key positions with an answer token each; a
  completion is correct iff at least 60% of its key tokens are the answers. Half the prompts are *routine* (the
  answer is the prior's most likely token; ~10-90% initial accuracy), half are *hard* (the answer is the runner-up;
  ~0.01-10%): correct completions of hard prompts are rare, "novel" ones. Whether positives end up in the low- or the
  high-weight tail is measured, not assumed (``log_weight_pos`` / ``log_weight_neg`` in the JSON).
* Advantages are TRL's group-normalised ones, ``(r - mean_G) / (std_G + 1e-4)``.
* Adam with gradient-norm clipping at 1 as in TRL. Budget: 24 batches of ``P`` prompts' generations for every
  setting. Epochs: 24 rollouts of the ``P`` prompts, ``24 R`` updates of ``P`` prompts. Staleness: mini-batches of
  ``M = 8`` prompts drawn from a shuffled prompt stream (every block of ``P`` draws is a permutation of the prompts, as
  a data loader's epochs), 96 updates for every ``N`` (``N = 32``: 3 rollouts of 256 draws). "Early" metrics average
  every update of the first quarter of the budget (epochs: rollouts 0-5; staleness: updates 0-23).
* Two regimes. ``moderate`` (Adam lr 0.1: each logit moves at most ~0.1 per step) and ``stress`` (lr 1.0): the
  off-policy drift of aggressive reuse.

What the lab cannot tell you: it has no context/attention, no shared representation beyond ``beta``, no language. It
shows the mechanism and how each kernel reacts to it; the LLM evidence is the tiny-LM benchmark
(``docs/benchmarks/starvation_lab.md``).

How to run
----------
    OMP_NUM_THREADS=1 python -m benchmarks.starvation_lab --out docs/benchmarks/starvation_lab   # full
    python -m benchmarks.starvation_lab --quick --out /tmp/lab                      # seconds (smoke size)
    python -m benchmarks.starvation_lab --kernels ppo_clip respo respo_mean --params epsilon_high=0.28
    python -m benchmarks.starvation_lab --lr 0.3 --reuse 4 --staleness 8 --out /tmp/lr03  # custom regime
    python -m benchmarks.starvation_lab --markdown-from docs/benchmarks/starvation_lab/starvation_lab.json

``--out DIR`` writes ``DIR/starvation_lab.json`` (config; per regime, kernel and setting ``R=r`` / ``N=n``: final
reward, early diagnostics as mean, std and per-seed values; reward curves; a summary per regime that says where ReSPO
wins and where it loses) and the figures ``reward_curves.png``, ``throughput.png``, ``phi_by_sign.png`` and
``positive_branch.png``. ``--params`` overrides :class:`respo_trl.kernels.LossParams` fields for every kernel;
ablations reuse the lab through ``starvation_sim.run_regime`` with their own ``kernels`` dict (label -> (registry name,
overrides)).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

from benchmarks.common import command, machine_info
from benchmarks.starvation_sim import (
    SAME_BATCH_HOST,
    LabConfig,
    Reuse,
    Task,
    generated_tokens_per_batch,
    kernel_params,
    run_regime,
)
from respo_trl.kernels import LossParams, gradient_coefficients

# ---------------------------------------------------------------------------------------------------------------------
# The kernels compared: label -> (registry name, LossParams overrides). Each method at its recommended parameters
# (TRL docs / the papers); ReSPO at the paper's constants (the package defaults).
# ---------------------------------------------------------------------------------------------------------------------

KERNELS: dict[str, tuple[str, dict]] = {
    "ppo_clip": ("ppo", {}),  # TRL dapo/grpo: token clip, epsilon 0.2
    "gspo": ("gspo", {"epsilon_low": 3e-4, "epsilon_high": 4e-4}),  # GSPO paper / TRL docs
    "vespo": ("vespo", {}),  # TRL 1.16 defaults (k, lambda) = (2, 3) for A >= 0, (3, 2) for A < 0
    "is_token": ("is", {}),  # PPO with the clip removed
    "is_seq": ("is_seq", {}),  # exact sequence importance sampling
    "respo": ("respo", {"respo_trust_mask": False}),  # the paper: (2, 0.5, 2) / (1, 0.5, 2), raw W, no mask
    "respo_mask": ("respo", {"respo_trust_mask": True}),  # + the directional token trust mask (default for R > 1)
}
# Not in the default run (pass --kernels to add them): they behaved like token IS in the 0.1 lab.
OPTIONAL_KERNELS: dict[str, tuple[str, dict]] = {
    "cispo": ("cispo", {"epsilon_high": 5.0}),  # ScaleRL / TRL docs value of epsilon_max for cispo
    "sapo": ("sapo", {}),  # TRL defaults, temperatures 1.0 / 1.05
    # ReSPO on a length- or ESS-normalised weight (the ablation's norm=mean / sqrt / ess(0.5); not the paper's method)
    **{f"respo_{norm}": (f"respo_{norm}", {"respo_trust_mask": False}) for norm in ("mean", "sqrt", "ess")},
}
ALL_KERNELS = {**KERNELS, **OPTIONAL_KERNELS}

STYLES = {  # overlapping curves stay visible: the clipped baseline wide underneath, IS variants dashed/dotted
    "ppo_clip": dict(lw=4.0, alpha=0.55),
    "is_token": dict(lw=1.6, ls="--"),
    "is_seq": dict(lw=1.4, ls=":"),
    "cispo": dict(lw=1.4, ls="-."),
    "respo": dict(lw=2.6),
    "respo_mask": dict(lw=2.0, ls="--"),
}

COLORS = {
    "ppo_clip": "tab:red",
    "gspo": "tab:orange",
    "cispo": "tab:brown",
    "sapo": "tab:pink",
    "vespo": "tab:purple",
    "is_token": "tab:gray",
    "is_seq": "black",
    "respo": "tab:blue",
    "respo_mask": "tab:cyan",
}

QUICK = dict(prompts=8, group=8, max_len=64, min_len=16, batches=6, seeds=(0, 1), reuse=(1, 4), staleness=(1, 4),
             minibatch_prompts=4, diag_every=2, regimes=(("moderate", 0.1),))


# ---------------------------------------------------------------------------------------------------------------------
# The coefficient curves phi(W) by sign, read off the registry
# ---------------------------------------------------------------------------------------------------------------------


# W from 1e-4 to 20 on a log grid that contains W = 1 exactly
PHI_GRID = torch.cat(
    [torch.logspace(-4, 0, 97, dtype=torch.float64), torch.logspace(0, math.log10(20.0), 33, dtype=torch.float64)[1:]]
)


def coefficient_curves(kernels: dict, base: LossParams, w: torch.Tensor) -> dict:
    """``{label: {"pos": c(W), "neg": c(W)}}``: each loss's coefficient on a one-token sequence with weight ``W``.

    With one token the token ratio, the sequence product and every normalisation coincide (``l = rho = log W``), so
    token and sequence kernels are drawn on one axis (for longer sequences the token kernels see ``W^(1/L)``).
    """
    log_w = torch.log(w.double()).float().unsqueeze(-1)
    mask = torch.ones_like(log_w)
    curves = {}
    for label, (name, _) in kernels.items():
        params = kernel_params(label, kernels, base)
        curves[label] = {
            sign: gradient_coefficients(name, log_w, torch.full((len(w),), a), mask, params)[:, 0].tolist()
            for sign, a in (("pos", 1.0), ("neg", -1.0))
        }
    return curves


# ---------------------------------------------------------------------------------------------------------------------
# The lab: every kernel at every reuse setting, summary, JSON and figures
# ---------------------------------------------------------------------------------------------------------------------


def run_lab(cfg: LabConfig, kernels: dict | None = None, base: LossParams = LossParams(), log=print) -> dict:
    """Run every kernel at every reuse setting in every regime of ``cfg``; returns the JSON-ready result."""
    kernels = dict(KERNELS if kernels is None else kernels)
    task = Task(cfg, cfg.seeds)
    start = time.perf_counter()
    regimes = {}
    for regime, lr in cfg.regimes:
        log(f"-- regime {regime!r}: Adam lr {lr}")
        results = run_regime(task, dataclasses.replace(cfg, lr=lr), kernels, base, log, start)
        regimes[regime] = {"lr": lr, "results": results, "summary": summarize_lab(results, cfg)}
    return {
        "config": {**dataclasses.asdict(cfg), "settings": [s.key for s in cfg.settings()],
                   "loss_params": dataclasses.asdict(base)},
        "kernels": {label: {"registry": name, "overrides": o} for label, (name, o) in kernels.items()},
        "task": {
            "lengths": task.lengths.tolist(),
            "hard": task.hard.tolist(),
            "tokens_per_batch": generated_tokens_per_batch(task, cfg),
        },
        "regimes": regimes,
        "phi": {"w": PHI_GRID.tolist(), "curves": coefficient_curves(kernels, base, PHI_GRID)},
        "runtime_s": time.perf_counter() - start,
        "machine": machine_info(),
    }


RESPO_LABELS = ("respo", "respo_mask")


def summarize_lab(results: dict, cfg: LabConfig) -> dict:
    """ReSPO (both variants) against clipped PPO and the best other kernel, per setting, in numbers and words."""
    summary: dict = {"per_setting": {}, "statements": [], "wins": [], "losses": []}
    ours = [k for k in RESPO_LABELS if k in results]
    if not ours:
        return summary
    settings = list(next(iter(results.values())))
    stable = [k for k in results if k not in ("is_token", "is_seq")]  # the practical kernels
    for key in settings:
        finals = {label: res[key]["final_reward"]["mean"] for label, res in results.items()}
        quarter = {label: res[key]["reward_at_quarter"]["mean"] for label, res in results.items()}
        best = max(finals, key=finals.get)
        entry = {"final_reward": finals, "best_kernel": best, "reward_at_quarter": quarter,
                 "best_kernel_at_quarter": max(quarter, key=quarter.get)}
        for label in ours:
            cell = results[label][key]
            rank = 1 + sum(v > finals[label] + 1e-3 for v in finals.values())
            rank_stable = 1 + sum(finals[k] > finals[label] + 1e-3 for k in stable)
            e = {"rank": rank, "rank_among_practical": rank_stable, "of_practical": len(stable),
                 "mean_log_weight_pos": cell["log_weight_pos"]["mean"],
                 "low_weight_mass_ratio": cell["low_weight_pos"]["mass_ratio"]}
            if "ppo_clip" in results:
                ppo = results["ppo_clip"][key]
                e["minus_ppo_clip_points"] = 100 * (finals[label] - finals["ppo_clip"])
                e["minus_ppo_clip_points_at_quarter"] = 100 * (quarter[label] - quarter["ppo_clip"])
                e["pos_throughput_ratio_over_ppo_clip"] = (
                    cell["grad_throughput_pos"]["mean"] / ppo["grad_throughput_pos"]["mean"])
            others = {k: v for k, v in finals.items() if k not in ours}
            if others:
                top = max(others, key=others.get)
                e["minus_best_other_points"] = 100 * (finals[label] - others[top])
                e["best_other"] = top
            entry[label] = e
        summary["per_setting"][key] = entry
        parts = []
        for label in ours:
            e = entry[label]
            verdict = "best" if e["rank"] == 1 else f"rank {e['rank']}/{len(finals)}"
            text = f"{label} {finals[label]:.3f} ({verdict}"
            if "minus_ppo_clip_points" in e:
                text += f", {e['minus_ppo_clip_points']:+.1f} pts vs ppo_clip"
            if "best_other" in e:
                text += f", {e['minus_best_other_points']:+.1f} vs best other kernel {e['best_other']}"
            parts.append(text + ")")
            if Reuse.parse(key).n > 1:
                if e["rank"] == 1:
                    summary["wins"].append(f"{label} {key}")
                elif e["rank_among_practical"] == e["of_practical"]:
                    summary["losses"].append(f"{label} {key}")
        summary["statements"].append(f"{key}: " + "; ".join(parts) + f"; best: {best} {finals[best]:.3f}")
    return summary


def _budget_to_reach(reward_curves: list[list[float]], target: float) -> float | None:
    """Fraction of the generation budget at which the seed-mean reward curve first reaches ``target`` (None: never)."""
    mean = torch.tensor(reward_curves).mean(0)
    hit = (mean >= target - 1e-9).nonzero()
    return None if len(hit) == 0 else hit[0].item() / (len(mean) - 1)


# ---------------------------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------------------------


def _settings_by_kind(result: dict) -> dict[str, list[Reuse]]:
    out: dict[str, list[Reuse]] = {"epochs": [], "staleness": []}
    for key in result["config"]["settings"]:
        s = Reuse.parse(key)
        out[s.kind].append(s)
    return {k: v for k, v in out.items() if v}


def plot(result: dict, out_dir: str) -> list[str]:
    """Write reward_curves.png, throughput.png, phi_by_sign.png and positive_branch.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    regimes = result["regimes"]
    n_seeds = len(result["config"]["seeds"])
    kinds = _settings_by_kind(result)
    ncols = max(len(v) for v in kinds.values())
    rows = [(regime, kind) for regime in regimes for kind in kinds]
    fig, axes = plt.subplots(len(rows), ncols, figsize=(3.8 * ncols, 3.0 * len(rows)), sharey=True, squeeze=False)
    for row, (regime, kind) in zip(axes, rows):
        res = regimes[regime]
        for ax, setting in zip(row, kinds[kind]):
            for label, by_s in res["results"].items():
                c = by_s[setting.key]["curves"]
                x = torch.tensor(c["generated_tokens"], dtype=torch.float) / 1e6
                y = torch.tensor(c["reward"])
                mean, std = y.mean(0), (y.std(0) if len(y) > 1 else torch.zeros(y.shape[1]))
                ax.plot(x, mean, color=COLORS.get(label), label=label,
                        lw=2.4 if label == "respo" else 1.2, ls="--" if label == "respo_mask" else "-")
                ax.fill_between(x, mean - std, mean + std, color=COLORS.get(label), alpha=0.08)
            what = "epochs" if kind == "epochs" else "staleness"
            ax.set_title(f"{regime} (lr {res['lr']}), {what} {setting.key}", fontsize=9)
            ax.grid(alpha=0.3)
        for ax in row[len(kinds[kind]):]:
            ax.axis("off")
        row[0].set_ylabel("expected reward")
    for ax in axes[-1]:
        ax.set_xlabel("generated tokens (M)")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Starvation lab: reward against generated tokens (staleness: updates are proportional), mean +- std "
                 f"over {n_seeds} seeds")
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "reward_curves.png"))

    keys = ("grad_throughput_pos", "grad_throughput_neg", "starved_frac_pos")
    titles = ("early grad_throughput/pos (A > 0)", "early grad_throughput/neg (A < 0)", "early starved_frac/pos")
    fig, axes = plt.subplots(len(regimes), 3, figsize=(14, 3.6 * len(regimes)), squeeze=False)
    for row, (regime, res) in zip(axes, regimes.items()):
        for label, by_s in res["results"].items():
            for ax, key in zip(row, keys):
                for kind, settings in kinds.items():
                    xs = [s.n for s in settings]
                    mean = [by_s[s.key][key]["mean"] for s in settings]
                    ax.plot(xs, mean, marker="o" if kind == "epochs" else "s", color=COLORS.get(label),
                            ls="-" if kind == "epochs" else "--", lw=2.2 if label.startswith("respo") else 1.1,
                            label=f"{label} ({'R' if kind == 'epochs' else 'N'})", ms=4)
        for ax, title in zip(row, titles):
            ax.set_xscale("log", base=2)
            ax.set_title(f"{regime}: {title}", fontsize=10)
            ax.grid(alpha=0.3)
        for ax in row[:2]:
            ax.set_yscale("log")
            ax.axhline(1.0, color="k", lw=0.6, ls=":")
    for ax in axes[-1]:
        ax.set_xlabel("reuse: epochs R (solid, circles) or staleness N (dashed, squares)")
    axes[0][2].legend(fontsize=6, ncol=2)
    fig.suptitle("Gradient throughput by advantage sign over the first quarter of the budget (1 = on-policy)")
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "throughput.png"))

    paths.append(plot_phi(result["phi"], os.path.join(out_dir, "phi_by_sign.png")))
    paths.append(plot_positive_branch(result, os.path.join(out_dir, "positive_branch.png")))
    return paths


def plot_positive_branch(result: dict, path: str, cap: float = 3.0, min_share: float = 0.05) -> str:
    """The paper's diagnostic: low-weight positives' share of the positive coefficient mass / their head-count share,
    per kernel and reuse setting (own runs), and every kernel on ReSPO's batches (same-batch counterfactual). Bars are
    cut at ``cap`` (the value is written on top); faded bars: fewer than ``min_share`` of the positives have
    ``log W < -1``, too few for the ratio to mean much."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = result["regimes"]
    keys = [k for k in result["config"]["settings"] if Reuse.parse(k).n > 1]
    fig, axes = plt.subplots(len(regimes), 2, figsize=(16, 4.0 * len(regimes)), squeeze=False)
    for row, (regime, res) in zip(axes, regimes.items()):
        labels = list(res["results"])
        width = 0.8 / len(labels)
        host = res["results"].get(SAME_BATCH_HOST, {})
        for col, source in enumerate(("own", "same")):
            ax = row[col]
            for i, label in enumerate(labels):
                for j, key in enumerate(keys):
                    if source == "own":
                        low = res["results"][label][key]["low_weight_pos"]
                    else:
                        low = host.get(key, {}).get("low_weight_same_batch", {}).get(label)
                    if low is None or low["mass_ratio"] != low["mass_ratio"]:
                        continue
                    x = j + (i - (len(labels) - 1) / 2) * width
                    v = low["mass_ratio"]
                    faded = low["share"]["mean"] < min_share
                    ax.bar(x, min(v, cap), width, color=COLORS.get(label), alpha=0.3 if faded else 1.0,
                           label=label if j == len(keys) - 1 else None)
                    if v > cap:
                        ax.text(x, cap, f"{v:.0f}", ha="center", va="bottom", fontsize=6, rotation=90)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(1.69, color="tab:blue", lw=0.8, ls=":", label="paper: ReSPO 1.69x")
            ax.axhline(0.93, color="tab:purple", lw=0.8, ls=":", label="paper: VESPO 0.93x")
            ax.set_ylim(0, cap * 1.12)
            share = {k: host[k]["low_weight_pos"]["share"]["mean"] for k in keys if k in host}
            ax.set_xticks(range(len(keys)), [f"{k}\n({share[k]:.0%})" if k in share and source == "same" else k
                                             for k in keys])
            what = ("each kernel's own run" if source == "own" else
                    "every kernel's coefficients on ReSPO's batches (in brackets: share of positives with log W < -1)")
            ax.set_title(f"{regime}: {what}", fontsize=9)
            ax.set_ylabel("mass share / head-count share")
            ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7, ncol=3, loc="upper left")
    fig.suptitle("Positive-branch diagnostic (early): coefficient mass of positives with log W < -1 relative to their "
                 f"share of positives (> 1: more than their share); faded: < {min_share:.0%} of positives below",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, os.path.dirname(path) or ".", os.path.basename(path))


def plot_phi(phi: dict, path: str, labels: list[str] | None = None, title: str | None = None) -> str:
    """Coefficient by sign against ``W`` (log scale), one panel per sign, linear and log coefficient axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = phi["w"]
    labels = labels or list(phi["curves"])
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for col, (sign, name) in enumerate((("pos", "A > 0 (correct rollouts)"), ("neg", "A < 0 (wrong rollouts)"))):
        for row, scale in enumerate(("linear", "log")):
            ax = axes[row][col]
            for label in labels:
                y = [max(v, 1e-12) if scale == "log" else v for v in phi["curves"][label][sign]]
                ax.plot(w, y, color=COLORS.get(label), label=label, **STYLES.get(label, dict(lw=1.3)))
            ax.set_xscale("log")
            ax.axvline(1.0, color="k", lw=0.6, ls=":")
            if scale == "log":
                ax.set_yscale("log")
                ax.set_ylim(1e-8, 50)
                ax.set_xlabel("importance weight W = pi_theta / pi_old (one-token sequence)")
            else:
                ax.set_ylim(-0.05, 2.5)
                ax.set_title(name)
            ax.grid(alpha=0.3)
        axes[0][col].set_ylabel("coefficient on A * grad log pi")
    axes[0][1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title or "Effective coefficient phi(W) by advantage sign (read off the registry by autograd)")
    fig.tight_layout()
    return _save(fig, os.path.dirname(path) or ".", os.path.basename(path))


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(result: dict) -> str:
    """The docs tables: final reward, early diagnostics and the positive-branch diagnostic per regime, kernel and
    reuse setting (mean +- std over seeds)."""
    keys = result["config"]["settings"]
    out = []
    fmt = lambda st, p=3: f"{st['mean']:.{p}f} ± {st['std']:.{p}f}"  # noqa: E731

    def g(st):
        return f"{st['mean']:.3g}" if st["mean"] < 100 else f"{st['mean']:.1e}"

    def pct(x):
        return "-" if x != x else f"{100 * x:.0f}%"

    for regime, res in result["regimes"].items():
        rs = res["results"]
        for kind in ("R", "N"):
            ks = [k for k in keys if k.startswith(kind)]
            if not ks:
                continue
            name = "epochs" if kind == "R" else "staleness"
            out.append(f"**{regime}** (Adam lr {res['lr']}), {name}: final expected reward (mean ± std) / reward at a "
                       "quarter of the budget\n")
            out.append("| kernel | " + " | ".join(ks) + " |")
            out.append("|---|" + "---:|" * len(ks))
            for label, by_s in rs.items():
                cells = []
                for k in ks:
                    c = by_s[k]
                    best = max(rs[lab_][k]["final_reward"]["mean"] for lab_ in rs)
                    text = f"{fmt(c['final_reward'])} / {c['reward_at_quarter']['mean']:.3f}"
                    cells.append(f"**{text}**" if c["final_reward"]["mean"] >= best - 5e-4 else text)
                out.append(f"| {label} | " + " | ".join(cells) + " |")
            out.append("")
        off = [k for k in keys if Reuse.parse(k).n > 1]
        out.append(f"**{regime}**: early grad_throughput pos / neg, starved_frac pos (mean over seeds)\n")
        out.append("| kernel | " + " | ".join(off) + " |")
        out.append("|---|" + "---:|" * len(off))
        for label, by_s in rs.items():
            cells = [f"{g(by_s[k]['grad_throughput_pos'])} / {g(by_s[k]['grad_throughput_neg'])} / "
                     f"{by_s[k]['starved_frac_pos']['mean']:.2f}" for k in off]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
        out.append(f"**{regime}**: positive-branch diagnostic, early (own runs): share of positives with log W < -1 → "
                   "their share of the positive coefficient mass (ratio); last row: mean log W of ReSPO's positives\n")
        out.append("| kernel | " + " | ".join(off) + " |")
        out.append("|---|" + "---:|" * len(off))
        for label, by_s in rs.items():
            cells = []
            for k in off:
                lw = by_s[k]["low_weight_pos"]
                cells.append(f"{pct(lw['share']['mean'])} → {pct(lw['mass_share']['mean'])} ({lw['mass_ratio']:.2f}x)")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        if SAME_BATCH_HOST in rs:
            out.append("| log W of ReSPO's positives | " + " | ".join(
                f"{rs[SAME_BATCH_HOST][k]['log_weight_pos']['mean']:+.2f}" for k in off) + " |")
            out.append("")
            out.append(f"**{regime}**: same-batch counterfactual on ReSPO's batches: low-weight positives' mass ratio "
                       "under each kernel's coefficients\n")
            out.append("| kernel | " + " | ".join(off) + " |")
            out.append("|---|" + "---:|" * len(off))
            for label in rs:
                cells = []
                for k in off:
                    cf = rs[SAME_BATCH_HOST][k].get("low_weight_same_batch", {}).get(label)
                    cells.append("-" if cf is None else f"{cf['mass_ratio']:.2f}x")
                out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
        summ = res["summary"]
        if summ.get("statements"):
            out.append(f"**{regime}** summary: ReSPO best at {summ['wins'] or 'no reuse setting'}; last among the "
                       f"practical kernels at {summ['losses'] or 'no reuse setting'}.\n")
    return "\n".join(out)


def write(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "starvation_lab.json")
    with open(path, "w") as f:
        json.dump(_round(result), f, allow_nan=True, separators=(",", ":"))  # one line, read it with a tool
    return path


def _round(value, digits: int = 5):
    """Floats to ``digits`` significant digits (keeps the JSON readable and small)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _round(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v, digits) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def _parse_params(items: list[str]) -> dict:
    """``["epsilon_high=0.28", "respo_alpha_pos=3", "respo_trust_mask=True"]`` -> LossParams overrides, typed by the
    defaults."""
    defaults = LossParams()
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if not hasattr(defaults, key):
            raise SystemExit(f"unknown LossParams field {key!r}; fields: {sorted(dataclasses.asdict(defaults))}")
        default = getattr(defaults, key)
        if isinstance(default, bool):
            out[key] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, str):
            out[key] = value
        else:
            out[key] = None if value == "None" else float(value)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="directory for starvation_lab.json and the figures")
    parser.add_argument("--quick", action="store_true", help="smoke size (seconds)")
    parser.add_argument("--kernels", nargs="+", choices=list(ALL_KERNELS), help="subset of kernels (default: KERNELS)")
    parser.add_argument("--reuse", nargs="*", type=int, help="epochs R (default 1 2 4 8; none: skip epochs)")
    parser.add_argument("--staleness", nargs="*", type=int, help="staleness N (default 1 4 8 16 32; none: skip)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (default 0 1 2)")
    parser.add_argument("--lr", type=float, help="one regime at this Adam learning rate (default: 0.1 and 1.0)")
    parser.add_argument("--batches", type=int, help="budget in generation batches of P prompts (default 24)")
    parser.add_argument("--params", nargs="*", default=[], help="LossParams overrides for every kernel, key=value")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for these small ops)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--markdown-from", metavar="JSON", help="print the docs tables of an existing result and exit")
    args = parser.parse_args(argv)
    if args.markdown_from:
        with open(args.markdown_from) as f:
            result = json.load(f)
        print(markdown(result))
        return result

    torch.set_num_threads(args.threads)
    cfg = LabConfig(**QUICK) if args.quick else LabConfig()
    overrides = {"batches": args.batches} if args.batches else {}
    if args.lr is not None:
        overrides["regimes"] = (("custom", args.lr),)
    if args.reuse is not None:
        overrides["reuse"] = tuple(args.reuse)
    if args.staleness is not None:
        overrides["staleness"] = tuple(args.staleness)
    if args.seeds:
        overrides["seeds"] = tuple(args.seeds)
    cfg = dataclasses.replace(cfg, **overrides)
    kernels = {k: ALL_KERNELS[k] for k in (args.kernels or KERNELS)}
    base = dataclasses.replace(LossParams(), **_parse_params(args.params))

    print(f"starvation lab: {len(kernels)} kernels x {[s.key for s in cfg.settings()]} x {len(cfg.seeds)} seeds",
          flush=True)
    result = run_lab(cfg, kernels, base, log=lambda line: print(line, flush=True))
    result["command"] = command("starvation_lab", argv if argv is not None else sys.argv[1:])
    for regime, res in result["regimes"].items():
        print(f"\nsummary, regime {regime!r} (lr {res['lr']}):")
        print("\n".join("  " + line for line in res["summary"]["statements"]))
    if args.out:
        print(f"wrote {write(result, args.out)}")
        if not args.no_plots:
            for path in plot(result, args.out):
                print(f"wrote {path}")
    print(f"total {result['runtime_s']:.1f}s")
    return result


if __name__ == "__main__":
    main()
