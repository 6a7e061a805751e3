"""Starvation lab: sign-dependent gradient starvation under rollout reuse, on a simulated policy (no LLM, CPU, ~1 min).

What it shows
-------------
Every policy loss of :data:`respo_trl.kernels.POLICY_LOSSES` (clipped token PPO = TRL ``dapo``, GSPO, CISPO, SAPO,
VESPO, plain token and sequence importance sampling, ReSPO) trains the same simulated policy on rollouts reused for
``R`` optimizer steps each, ``R`` in {1, 2, 4, 8}, at an equal budget of generated tokens. For every kernel and ``R``
(several seeds) it records:

* the expected reward (exact, not sampled) against generated tokens: the reward curves;
* ``grad_throughput/{pos,neg}`` (spec section 4): the share of on-policy gradient mass the loss lets through, by
  advantage sign, from :mod:`respo_trl.diagnostics` exactly as the trainer logs it (1 on-policy for every kernel), and
  ``clip_grad_throughput/pos``, the clipped-PPO counterfactual on the same batch;
* ``starved_frac/pos``: the fraction of correct (A > 0) rollouts whose mean coefficient is below 0.1;
* each kernel's coefficient ``phi(w)`` by sign, read off the registry by autograd
  (:func:`respo_trl.kernels.gradient_coefficients` on a one-token sequence), so the figure is the code.

The losses are never re-implemented here: every step calls ``get_policy_loss(name)`` and aggregates the per-token loss
like TRL's ``dapo`` (token sum over the batch's token count).

The simulated setting (explicit, so you can judge how far it transfers)
-----------------------------------------------------------------------
* ``P = 32`` prompts, ``G = 12`` completions per prompt (GRPO groups). Prompt ``p`` has a completion length ``L_p``
  drawn log-uniformly in [32, 256] tokens: long enough that a sequence's product weight ``exp(l)`` collapses or
  explodes from small per-token drift, and varied enough that length normalisation matters.
* Tokens are drawn position by position (independently given the prompt) from
  ``pi(. | p, t) = softmax(beta * Z0[p, t] + U[p, t])`` over ``V = 8`` tokens. ``Z0`` is a fixed random "pretrained"
  prior (std 2); ``U`` are trainable per-position logits; ``beta = exp(b)`` is one trainable scalar shared by every
  prompt and position: the policy's global sharpness, the channel through which learning on one prompt moves every
  other prompt, as an LLM's entropy does.
* Reward (verifiable, 0/1): prompt ``p`` has ``K_p = max(4, L_p // 16)`` key positions (the decisive steps) with an
  answer token each; a completion is correct iff at least 60% of its key tokens are the answers. Half the prompts are
  *routine* (the answer is the prior's most likely token; ~10-90% initial accuracy), half are *hard* (the answer is
  the runner-up; ~0.01-10%, median ~1.5%): correct completions of hard prompts are rare, "novel" ones, and sharpening
  the policy (which helps routine prompts) pushes them into the low-weight tail. Most tokens of every completion are
  filler that only adds drift to its importance weight. Whether positives actually end up in the low- or the
  high-weight tail is measured, not assumed (``log_weight_pos``/``log_weight_neg`` in the JSON).
* Advantages are TRL's group-normalised ones, ``(r - mean_G) / (std_G + 1e-4)`` (groups without signal give 0).
* Reuse: each generation batch is used for ``R`` optimizer steps on the full batch (``R = 1`` is exactly on-policy),
  Adam with gradient-norm clipping at 1 as in TRL. Budget: 24 generation batches for every ``R``, so larger ``R``
  means more optimizer steps per generated token (the sampling compute reuse is meant to save). "Early" metrics
  average every optimizer step of the first quarter of the batches.
* Two regimes. ``moderate`` (Adam lr 0.1: each logit moves at most ~0.1 per step) and ``stress`` (lr 1.0): the
  off-policy drift of aggressive reuse, where plain token-level importance sampling (PPO without the clip) collapses
  at ``R = 8`` and exact sequence IS has weights at the ``e^20`` clamp (gradient throughput ~1e7) in both regimes:
  "just remove the clip" is visibly not an answer.

What the lab cannot tell you: it has no context/attention, no shared representation beyond ``beta``, no language. It
shows the mechanism and how each kernel reacts to it; the LLM evidence is the reuse benchmark (``docs/benchmarks.md``).

How to run
----------
    PYTHONPATH=. python benchmarks/starvation_lab.py --out docs/benchmarks/starvation_lab       # ~1 min on 2 cores
    PYTHONPATH=. python benchmarks/starvation_lab.py --quick --out /tmp/lab                      # seconds (smoke size)
    PYTHONPATH=. python benchmarks/starvation_lab.py --kernels ppo_clip respo --params respo_norm=mean --out /tmp/abl
    PYTHONPATH=. python benchmarks/starvation_lab.py --lr 0.3 --reuse 4 --out /tmp/lr03          # one custom regime

``--out DIR`` writes ``DIR/starvation_lab.json`` (config; per regime, kernel and R: final reward, early
``grad_throughput_pos``/``grad_throughput_neg``/``starved_frac_pos`` as mean, std and per-seed values; reward curves;
a summary per regime that says where ReSPO wins and where it does not) and the figures ``reward_curves.png``,
``throughput.png`` and ``phi_by_sign.png``. ``--params`` overrides :class:`respo_trl.kernels.LossParams` fields for
every kernel (e.g. the ReSPO normalisation or ``(alpha, lambda)``): ablations reuse the lab through it or through
:func:`run_lab` with their own ``kernels`` dict (label -> (registry name, overrides)).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import torch

from benchmarks.machine import machine_info
from respo_trl.diagnostics import sequence_stats, summarize
from respo_trl.kernels import LOG_W_CLAMP, LossParams, get_policy_loss, gradient_coefficients, register_policy_loss


# Two reference losses only the lab compares (not TRL loss types, so not in the library's registry by default).
@register_policy_loss("is")
def token_is_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None, gather=None):
    """Plain token-level importance sampling, ``-r_it A_i``: PPO with the clip removed."""
    return -torch.exp(log_ratio) * advantages.reshape(-1, 1)


@register_policy_loss("is_seq")
def sequence_is_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None, gather=None):
    """Exact sequence importance sampling: coefficient ``W_i = exp(l_i)`` (unbiased, unbounded variance)."""
    l = (torch.where(mask.bool(), log_ratio.detach(), 0.0)).sum(-1, keepdim=True)
    return -torch.exp(l.clamp(max=LOG_W_CLAMP)) * advantages.reshape(-1, 1) * log_ratio

# ---------------------------------------------------------------------------------------------------------------------
# The kernels compared: label -> (registry name, LossParams overrides). Each method at its recommended parameters
# (TRL docs / the papers); ReSPO at the package defaults.
# ---------------------------------------------------------------------------------------------------------------------

KERNELS: dict[str, tuple[str, dict]] = {
    "ppo_clip": ("ppo", {}),  # TRL dapo/grpo: token clip, epsilon 0.2
    "gspo": ("gspo", {"epsilon_low": 3e-4, "epsilon_high": 4e-4}),  # GSPO paper / TRL docs
    "cispo": ("cispo", {"epsilon_high": 5.0}),  # ScaleRL / TRL docs value of epsilon_max for cispo
    "sapo": ("sapo", {}),  # TRL defaults, temperatures 1.0 / 1.05
    "vespo": ("vespo", {}),  # TRL 1.16 defaults (k, lambda) = (2, 3) for A >= 0, (3, 2) for A < 0
    "is_token": ("is", {}),  # PPO with the clip removed
    "is_seq": ("is_seq", {}),  # exact sequence importance sampling
    "respo": ("respo", {}),  # package defaults: (0.5, 0.5) / (2, 2), sqrt normalisation
}

STYLES = {  # overlapping curves stay visible: the clipped baseline wide underneath, IS variants dashed/dotted
    "ppo_clip": dict(lw=4.0, alpha=0.55),
    "is_token": dict(lw=1.6, ls="--"),
    "is_seq": dict(lw=1.4, ls=":"),
    "cispo": dict(lw=1.4, ls="-."),
    "respo": dict(lw=2.6),
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
}


@dataclass
class LabConfig:
    prompts: int = 32
    group: int = 12
    vocab: int = 8
    min_len: int = 32
    max_len: int = 256
    prior_scale: float = 2.0  # std of the prior logits Z0
    key_every: int = 16  # a prompt of length L has max(min_keys, L // key_every) key positions
    min_keys: int = 4
    need_routine: float = 0.6  # fraction of key hits a correct completion needs
    need_hard: float = 0.6
    batches: int = 24  # generation batches per run (the sampling budget), the same for every R
    lr: float = 0.1  # set per regime
    # (name, Adam lr): "moderate" moves each logit by <= 0.1 per step; "stress" by <= 1, the regime where the
    # unclipped token-level importance sampling loss stops working
    regimes: tuple[tuple[str, float], ...] = (("moderate", 0.1), ("stress", 1.0))
    max_grad_norm: float = 1.0
    reuse: tuple[int, ...] = (1, 2, 4, 8)
    seeds: tuple[int, ...] = (0, 1, 2)
    early_frac: float = 0.25  # "early" = the optimizer steps of the first quarter of the generation batches
    diag_every: int = 8  # after the early window, diagnostics on the steps of every diag_every-th batch (curves)


QUICK = dict(prompts=8, group=8, max_len=64, min_len=16, batches=6, seeds=(0, 1), reuse=(1, 4), diag_every=2,
             regimes=(("moderate", 0.1),))


def kernel_params(label: str, kernels: dict, base: LossParams) -> LossParams:
    return dataclasses.replace(base, **kernels[label][1])


# ---------------------------------------------------------------------------------------------------------------------
# The simulated task and policy; seeds are stacked along a leading dimension S and trained in one pass
# ---------------------------------------------------------------------------------------------------------------------


class Task:
    """The simulated prompts for ``S`` seeds (one task per seed), stacked along a leading dimension.

    Positions are stored packed: prompt ``p``'s token position ``t < L_p`` is row ``idx[s, p, t]`` of the ``(S, N, V)``
    logit tables (padding points at a spare last row), so no work is spent on padding. ``z0`` (S, N, V) prior logits;
    ``mask`` (S, P, T) completion masks; ``key_idx``/``key_tok`` (S, P, K) the rows of the key positions and their
    answer tokens (``key_valid`` marks the ``K_p <= K`` keys a prompt has); ``need`` (S, P) the number of key hits a
    correct completion needs; ``hard`` (S, P) which prompts are hard.
    """

    def __init__(self, cfg: LabConfig, seeds: tuple[int, ...]):
        P, V, T = cfg.prompts, cfg.vocab, cfg.max_len
        K = max(cfg.min_keys, cfg.max_len // cfg.key_every)
        per_seed = []
        for seed in seeds:
            gen = torch.Generator().manual_seed(10_000 + seed)
            log_len = torch.empty(P).uniform_(math.log(cfg.min_len), math.log(cfg.max_len), generator=gen)
            L = log_len.exp().round().long().clamp(cfg.min_len, cfg.max_len)
            z = torch.randn(int(L.sum()), V, generator=gen) * cfg.prior_scale  # the "pretrained" prior, packed
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), L.cumsum(0)[:-1]])
            is_hard = torch.arange(P) % 2 == 1  # half routine, half hard
            key_idx = torch.zeros(P, K, dtype=torch.long)
            key_tok = torch.zeros(P, K, dtype=torch.long)
            valid = torch.zeros(P, K, dtype=torch.bool)
            need = torch.zeros(P, dtype=torch.long)
            for p in range(P):
                k_p = max(cfg.min_keys, int(L[p]) // cfg.key_every)
                rows = offsets[p] + torch.randperm(int(L[p]), generator=gen)[:k_p]
                ranked = z[rows].argsort(-1, descending=True)  # (k_p, V) tokens by prior probability
                key_idx[p, :k_p] = rows
                key_tok[p, :k_p] = ranked[:, 1] if is_hard[p] else ranked[:, 0]  # hard: runner-up; routine: mode
                valid[p, :k_p] = True
                need[p] = max(1, math.ceil((cfg.need_hard if is_hard[p] else cfg.need_routine) * k_p))
            per_seed.append((L, z, offsets, is_hard, key_idx, key_tok, valid, need))
        self.N = max(int(x[0].sum()) for x in per_seed) + 1  # + a spare row that padding points at
        S = len(seeds)
        self.z0 = torch.zeros(S, self.N, V)
        self.idx = torch.full((S, P, T), self.N - 1, dtype=torch.long)
        for s, (L, z, offsets, *_rest) in enumerate(per_seed):
            self.z0[s, : len(z)] = z
            for p in range(P):
                self.idx[s, p, : L[p]] = offsets[p] + torch.arange(int(L[p]))
        self.lengths = torch.stack([x[0] for x in per_seed])
        self.hard = torch.stack([x[3] for x in per_seed])
        stacked = [torch.stack([x[i] for x in per_seed]) for i in range(4, 8)]
        self.key_idx, self.key_tok, self.key_valid, self.need = stacked
        self.mask = (torch.arange(T) < self.lengths.unsqueeze(-1)).float()

    def log_probs(self, log_beta: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """(S, N, V) token log-probabilities, ``log_softmax(exp(log_beta) * z0 + table)``."""
        return torch.log_softmax(log_beta.exp().view(-1, 1, 1) * self.z0 + table, dim=-1)

    def accuracy(self, logp: torch.Tensor) -> torch.Tensor:
        """Exact expected reward (S, P): P(#key hits >= need) for independent hits (a Poisson-binomial tail)."""
        S, P, K = self.key_idx.shape
        hit = torch.gather(logp, 1, self.key_idx.view(S, -1, 1).expand(-1, -1, logp.shape[-1]))
        hit = torch.gather(hit, 2, self.key_tok.view(S, -1, 1)).view(S, P, K).exp() * self.key_valid
        dist = torch.zeros(S, P, K + 1)
        dist[..., 0] = 1.0
        for k in range(K):  # distribution of the number of hits, one key at a time
            h = hit[..., k : k + 1]
            dist = dist * (1 - h) + torch.nn.functional.pad(dist[..., :-1], (1, 0)) * h
        at_least = dist.flip(-1).cumsum(-1).flip(-1)  # at_least[..., n] = P(hits >= n)
        return torch.gather(at_least, 2, self.need.unsqueeze(-1)).squeeze(-1)

    def sample(self, logp: torch.Tensor, group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``group`` completions per prompt: tokens (S, P, G, T) and 0/1 rewards (S, P, G)."""
        S, N, V = logp.shape
        P, T = self.idx.shape[1:]
        packed = torch.multinomial(logp.exp().reshape(-1, V), group, replacement=True, generator=gen).view(S, N, group)
        tokens = torch.gather(packed, 1, self.idx.view(S, P * T, 1).expand(-1, -1, group))  # (S, P*T, G)
        tokens = tokens.view(S, P, T, group).permute(0, 1, 3, 2).contiguous()  # (S, P, G, T)
        hits = torch.gather(packed, 1, self.key_idx.view(S, -1, 1).expand(-1, -1, group)).view(S, P, -1, group)
        hits = ((hits == self.key_tok.unsqueeze(-1)) & self.key_valid.unsqueeze(-1)).sum(2)  # (S, P, G)
        return tokens, (hits >= self.need.unsqueeze(-1)).float()

    def token_logps(self, logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(S, P*G, T) log-probabilities of sampled ``tokens`` (S, P, G, T) under the policy ``logp`` (S, N, V)."""
        S, P, G, T = tokens.shape
        flat = self.idx.unsqueeze(2) * logp.shape[-1] + tokens  # (S, P, G, T) rows of logp.view(S, N * V)
        return torch.gather(logp.reshape(S, -1), 1, flat.view(S, -1)).view(S, P * G, T)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """TRL's GRPO advantages: ``(r - mean) / (std + 1e-4)`` within each prompt's group (S, P, G)."""
    return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# One training run: one kernel at one reuse R, every seed at once
# ---------------------------------------------------------------------------------------------------------------------

DIAG_KEYS = ("pos", "neg", "clip_pos", "starved_pos", "starved_neg", "log_weight_pos", "log_weight_neg")


def train(task: Task, cfg: LabConfig, name: str, params: LossParams, reuse: int) -> dict:
    """Train registry loss ``name`` with ``params`` at reuse ``R``; returns per-seed curves and early diagnostics."""
    loss_fn = get_policy_loss(name)
    S, P = task.lengths.shape
    G, T = cfg.group, cfg.max_len
    log_beta = torch.zeros(S, requires_grad=True)
    table = torch.zeros(S, task.N, cfg.vocab, requires_grad=True)
    opt = torch.optim.Adam([log_beta, table], lr=cfg.lr)
    gen = torch.Generator().manual_seed(1234 + 17 * reuse)  # every kernel sees the same first batch
    mask = task.mask.unsqueeze(2).expand(S, P, G, T).reshape(S, P * G, T)
    n_tokens = mask.sum((1, 2))  # (S,) dapo normaliser: the batch's token count
    early_batches = max(1, round(cfg.early_frac * cfg.batches))
    # ess normalisation takes its scale from the whole batch: then each seed needs its own call
    batch_stats = name == "respo" and params.respo_norm == "ess"
    slices = [slice(s, s + 1) for s in range(S)] if batch_stats else [slice(0, S)]

    def evaluate():
        with torch.no_grad():
            per_prompt = task.accuracy(task.log_probs(log_beta, table)).nan_to_num(0.0)
            hard = task.hard.float()
            return (
                per_prompt.mean(-1).tolist(),
                ((per_prompt * hard).sum(-1) / hard.sum(-1)).tolist(),
                log_beta.exp().tolist(),
            )

    curves = {"reward": [], "reward_hard": [], "beta": []}
    for key, value in zip(curves, evaluate()):
        curves[key].append(value)
    diag = {k: [[] for _ in range(S)] for k in DIAG_KEYS}  # per seed, one entry per diagnosed step
    early = {k: [[] for _ in range(S)] for k in DIAG_KEYS}
    diag_batch = []
    for b in range(cfg.batches):
        with torch.no_grad():
            logp_old = task.log_probs(log_beta, table)
            tokens, rewards = task.sample(logp_old, G, gen)
            old = task.token_logps(logp_old, tokens)
            adv = group_advantages(rewards).reshape(S, P * G)
        for _ in range(reuse):
            logp = task.token_logps(task.log_probs(log_beta, table), tokens)
            log_ratio = torch.where(mask > 0, logp - old, torch.zeros_like(logp))
            total = 0.0
            for sl in slices:
                per_token = loss_fn(log_ratio[sl].flatten(0, 1), adv[sl].flatten(), mask[sl].flatten(0, 1), params)
                total = total + (per_token.view(-1, P * G, T) * mask[sl] / n_tokens[sl].view(-1, 1, 1)).sum()
            opt.zero_grad(set_to_none=True)
            total.backward()
            with torch.no_grad():  # per-seed gradient-norm clipping (TRL's max_grad_norm), NaN-safe
                grads = [log_beta.grad.unsqueeze(-1), table.grad]
                for g in grads:
                    g.nan_to_num_(0.0, posinf=0.0, neginf=0.0)
                norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads]).sum(0).sqrt().clamp(min=1e-12)
                for g in grads:
                    g.mul_((cfg.max_grad_norm / norms).clamp(max=1.0).view(S, *[1] * (g.dim() - 1)))
            opt.step()
            if b < early_batches or b % cfg.diag_every == 0:
                rows = _diagnostics(log_ratio.detach(), adv, mask, params, name, slices)
                diag_batch.append(b)
                for s, row in enumerate(rows):
                    for k in DIAG_KEYS:
                        diag[k][s].append(row[k])
                        if b < early_batches:
                            early[k][s].append(row[k])
        for key, value in zip(curves, evaluate()):
            curves[key].append(value)
    return {
        **{k: torch.tensor(v).T.tolist() for k, v in curves.items()},  # [seed][batch]
        "early": {k: [_nanmean(v) for v in per_seed] for k, per_seed in early.items()},  # [seed]
        "diag": diag,
        "diag_batch": diag_batch,
        "finite": [bool(torch.isfinite(table[s]).all() and torch.isfinite(log_beta[s])) for s in range(S)],
    }


def _diagnostics(log_ratio, adv, mask, params, name, slices) -> list[dict]:
    """The trainer's starvation metrics (one dict per seed) from :mod:`respo_trl.diagnostics`."""
    S, B, T = log_ratio.shape
    tables = [
        sequence_stats(log_ratio[sl].flatten(0, 1), adv[sl].flatten(), mask[sl].flatten(0, 1), params, name)
        for sl in slices
    ]
    table = torch.cat(tables).view(S, B, -1)
    rows = []
    for s in range(S):
        m = summarize(table[s])
        log_w = table[s, :, 5]  # column "log_weight": l_i
        rows.append({
            "pos": m["starvation/grad_throughput/pos"],
            "neg": m["starvation/grad_throughput/neg"],
            "clip_pos": m["starvation/clip_grad_throughput/pos"],
            "starved_pos": m["starvation/starved_frac/pos"],
            "starved_neg": m["starvation/starved_frac/neg"],
            "log_weight_pos": _nanmean(log_w[adv[s] > 0].tolist()),
            "log_weight_neg": _nanmean(log_w[adv[s] < 0].tolist()),
        })
    return rows


def _per_batch(per_seed: list[list[float]], batches: list[int]) -> list[list[float]]:
    """Average the per-step values of each diagnosed batch (steps of one batch are consecutive)."""
    keys = sorted(set(batches))
    return [[_nanmean([v for v, b in zip(values, batches) if b == k]) for k in keys] for values in per_seed]


def _nanmean(values) -> float:
    vals = [float(v) for v in values if v == v]
    return sum(vals) / len(vals) if vals else math.nan


def _stats(per_seed: list[float]) -> dict:
    vals = [v for v in per_seed if v == v]
    mean = sum(vals) / len(vals) if vals else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return {"mean": mean, "std": std, "per_seed": per_seed}


# ---------------------------------------------------------------------------------------------------------------------
# The coefficient curves phi(w) by sign, read off the registry
# ---------------------------------------------------------------------------------------------------------------------


# w from 1e-4 to 20 on a log grid that contains w = 1 exactly
PHI_GRID = torch.cat(
    [torch.logspace(-4, 0, 97, dtype=torch.float64), torch.logspace(0, math.log10(20.0), 33, dtype=torch.float64)[1:]]
)


def coefficient_curves(kernels: dict, base: LossParams, w: torch.Tensor) -> dict:
    """``{label: {"pos": c(w), "neg": c(w)}}``: each loss's coefficient on a one-token sequence with weight ``w``.

    With one token the token ratio, the sequence product and every normalisation coincide (``l = rho = log w``), so
    token and sequence kernels are drawn on one axis.
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
# The lab: every kernel at every R, summary, JSON and figures
# ---------------------------------------------------------------------------------------------------------------------


def run_lab(cfg: LabConfig, kernels: dict | None = None, base: LossParams = LossParams(), log=print) -> dict:
    """Run every kernel at every ``R`` in every regime of ``cfg``; returns the JSON-ready result (module docstring)."""
    kernels = dict(KERNELS if kernels is None else kernels)
    task = Task(cfg, cfg.seeds)
    start = time.perf_counter()
    regimes = {}
    for regime, lr in cfg.regimes:
        log(f"-- regime {regime!r}: Adam lr {lr}")
        results = run_regime(task, dataclasses.replace(cfg, lr=lr), kernels, base, log, start)
        regimes[regime] = {"lr": lr, "results": results, "summary": summarize_lab(results, cfg)}
    return {
        "config": {**dataclasses.asdict(cfg), "loss_params": dataclasses.asdict(base)},
        "kernels": {label: {"registry": name, "overrides": o} for label, (name, o) in kernels.items()},
        "task": {
            "lengths": task.lengths.tolist(),
            "hard": task.hard.tolist(),
            "tokens_per_batch": _tokens_per_batch(task, cfg),
        },
        "regimes": regimes,
        "phi": {"w": PHI_GRID.tolist(), "curves": coefficient_curves(kernels, base, PHI_GRID)},
        "runtime_s": time.perf_counter() - start,
        "machine": machine_info(),
    }


def _tokens_per_batch(task: Task, cfg: LabConfig) -> float:
    return (task.lengths.sum(-1).float() * cfg.group).mean().item()


def run_regime(task: Task, cfg: LabConfig, kernels: dict, base: LossParams, log=print, start: float = 0.0) -> dict:
    """``{label: {"R=r": metrics}}`` for every kernel and reuse at ``cfg.lr``."""
    tokens_per_batch = _tokens_per_batch(task, cfg)
    start = start or time.perf_counter()
    results: dict = {}
    for label, (name, _) in kernels.items():
        params = kernel_params(label, kernels, base)
        results[label] = {}
        for reuse in cfg.reuse:
            t0 = time.perf_counter()
            run = train(task, cfg, name, params, reuse)
            early = run["early"]
            results[label][f"R={reuse}"] = r = {
                "final_reward": _stats([curve[-1] for curve in run["reward"]]),
                "reward_at_quarter": _stats([curve[round(cfg.batches / 4)] for curve in run["reward"]]),
                "final_reward_hard": _stats([curve[-1] for curve in run["reward_hard"]]),
                "final_beta": _stats([curve[-1] for curve in run["beta"]]),
                "grad_throughput_pos": _stats(early["pos"]),
                "grad_throughput_neg": _stats(early["neg"]),
                "clip_grad_throughput_pos": _stats(early["clip_pos"]),
                "starved_frac_pos": _stats(early["starved_pos"]),
                "starved_frac_neg": _stats(early["starved_neg"]),
                "log_weight_pos": _stats(early["log_weight_pos"]),
                "log_weight_neg": _stats(early["log_weight_neg"]),
                "finite": run["finite"],
                "curves": {
                    "generated_tokens": [round(tokens_per_batch * b) for b in range(cfg.batches + 1)],
                    "reward": run["reward"],
                    "reward_hard": run["reward_hard"],
                    "beta": run["beta"],
                    "diag_batch": sorted(set(run["diag_batch"])),  # batches whose steps were diagnosed
                    "grad_throughput_pos": _per_batch(run["diag"]["pos"], run["diag_batch"]),  # [seed][batch]
                    "grad_throughput_neg": _per_batch(run["diag"]["neg"], run["diag_batch"]),
                },
            }
            log(
                f"[{time.perf_counter() - start:6.1f}s] {label:9s} R={reuse}  final reward "
                f"{r['final_reward']['mean']:.3f} +- {r['final_reward']['std']:.3f}  early throughput "
                f"pos {r['grad_throughput_pos']['mean']:.3g} neg {r['grad_throughput_neg']['mean']:.3g}  "
                f"starved_pos {r['starved_frac_pos']['mean']:.2f}  ({time.perf_counter() - t0:.1f}s)"
            )
    return results


def summarize_lab(results: dict, cfg: LabConfig) -> dict:
    """ReSPO against the clipped baseline and the best other kernel, per R, in plain numbers and words."""
    summary: dict = {"per_R": {}, "statements": []}
    if "respo" not in results:
        return summary
    target = results.get("ppo_clip", {}).get("R=1", {}).get("final_reward", {}).get("mean")
    for reuse in cfg.reuse:
        key = f"R={reuse}"
        finals = {label: res[key]["final_reward"]["mean"] for label, res in results.items()}
        best = max(finals, key=finals.get)
        respo = results["respo"][key]
        entry = {
            "final_reward": finals,
            "best_kernel": best,
            "respo_rank": 1 + sum(v > finals["respo"] + 1e-3 for v in finals.values()),
        }
        quarter = {label: res[key]["reward_at_quarter"]["mean"] for label, res in results.items()}
        entry["reward_at_quarter"] = quarter
        entry["best_kernel_at_quarter"] = max(quarter, key=quarter.get)
        if "ppo_clip" in results:
            ppo = results["ppo_clip"][key]
            entry["respo_minus_ppo_clip_points"] = 100 * (respo["final_reward"]["mean"] - ppo["final_reward"]["mean"])
            entry["respo_minus_ppo_clip_points_at_quarter"] = 100 * (quarter["respo"] - quarter["ppo_clip"])
            entry["pos_throughput_ratio_respo_over_ppo_clip"] = (
                respo["grad_throughput_pos"]["mean"] / ppo["grad_throughput_pos"]["mean"]
            )
            entry["pos_throughput_ratio_same_batch"] = (
                respo["grad_throughput_pos"]["mean"] / respo["clip_grad_throughput_pos"]["mean"]
            )
        if target is not None:
            entry["budget_to_reach_ppo_clip_R1_final"] = {
                label: _budget_to_reach(res[key]["curves"]["reward"], target) for label, res in results.items()
            }
        summary["per_R"][key] = entry
        gap = entry.get("respo_minus_ppo_clip_points")
        if finals[best] - finals["respo"] < 1e-3:
            verdict = "ties for best" if sum(finals[best] - v < 1e-3 for v in finals.values()) > 1 else "is best"
        else:
            verdict = f"is not best (best: {best} {finals[best]:.3f})"
        text = f"{key}: ReSPO final reward {finals['respo']:.3f}, {verdict}"
        if gap is not None:
            text += (
                f"; ReSPO - clipped PPO = {gap:+.1f} points at the end, "
                f"{entry['respo_minus_ppo_clip_points_at_quarter']:+.1f} at a quarter of the budget"
                f" (best there: {entry['best_kernel_at_quarter']}); early positive throughput ReSPO/clipped = "
                f"{entry['pos_throughput_ratio_respo_over_ppo_clip']:.2f}x (separate runs), "
                f"{entry['pos_throughput_ratio_same_batch']:.2f}x (same batch)"
            )
        summary["statements"].append(text)
    return summary


def _budget_to_reach(reward_curves: list[list[float]], target: float) -> float | None:
    """Fraction of the generation budget at which the seed-mean reward curve first reaches ``target`` (None: never)."""
    mean = torch.tensor(reward_curves).mean(0)
    hit = (mean >= target - 1e-9).nonzero()
    return None if len(hit) == 0 else hit[0].item() / (len(mean) - 1)



# ---------------------------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------------------------


def plot(result: dict, out_dir: str) -> list[str]:
    """Write reward_curves.png, throughput.png and phi_by_sign.png into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    cfg, regimes = result["config"], result["regimes"]
    reuses = cfg["reuse"]
    n_seeds = len(cfg["seeds"])

    fig, axes = plt.subplots(len(regimes), len(reuses), figsize=(4.2 * len(reuses), 3.4 * len(regimes)),
                             sharey=True, squeeze=False)
    for row, (regime, res) in zip(axes, regimes.items()):
        for ax, reuse in zip(row, reuses):
            for label, by_r in res["results"].items():
                c = by_r[f"R={reuse}"]["curves"]
                x = torch.tensor(c["generated_tokens"], dtype=torch.float) / 1e6
                y = torch.tensor(c["reward"])
                mean, std = y.mean(0), (y.std(0) if len(y) > 1 else torch.zeros(y.shape[1]))
                ax.plot(x, mean, color=COLORS.get(label), label=label, lw=2.4 if label == "respo" else 1.2)
                ax.fill_between(x, mean - std, mean + std, color=COLORS.get(label), alpha=0.10)
            ax.set_title(f"{regime} (lr {res['lr']}), R = {reuse}", fontsize=10)
            ax.grid(alpha=0.3)
        row[0].set_ylabel("expected reward")
    for ax in axes[-1]:
        ax.set_xlabel("generated tokens (M)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Starvation lab: reward against sampling compute, mean +- std over {n_seeds} seeds")
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "reward_curves.png"))

    keys = ("grad_throughput_pos", "grad_throughput_neg", "starved_frac_pos")
    titles = ("early grad_throughput/pos (A > 0)", "early grad_throughput/neg (A < 0)", "early starved_frac/pos")
    fig, axes = plt.subplots(len(regimes), 3, figsize=(14, 3.6 * len(regimes)), squeeze=False)
    for row, (regime, res) in zip(axes, regimes.items()):
        for label, by_r in res["results"].items():
            for ax, key in zip(row, keys):
                mean = [by_r[f"R={r}"][key]["mean"] for r in reuses]
                std = [by_r[f"R={r}"][key]["std"] for r in reuses]
                ax.errorbar(reuses, mean, yerr=std, marker="o", color=COLORS.get(label), label=label,
                            lw=2.4 if label == "respo" else 1.2, capsize=3)
        for ax, title in zip(row, titles):
            ax.set_xscale("log", base=2)
            ax.set_xticks(reuses, [str(r) for r in reuses])
            ax.set_title(f"{regime}: {title}", fontsize=10)
            ax.grid(alpha=0.3)
        for ax in row[:2]:
            ax.set_yscale("log")
            ax.axhline(1.0, color="k", lw=0.6, ls=":")
    for ax in axes[-1]:
        ax.set_xlabel("reuse R (optimizer steps per generation batch)")
    axes[0][2].legend(fontsize=7)
    fig.suptitle("Gradient throughput by advantage sign over the first quarter of training (1 = on-policy)")
    fig.tight_layout()
    paths.append(_save(fig, out_dir, "throughput.png"))

    paths.append(plot_phi(result["phi"], os.path.join(out_dir, "phi_by_sign.png")))
    return paths


def plot_phi(phi: dict, path: str, labels: list[str] | None = None, title: str | None = None) -> str:
    """Coefficient by sign against ``w`` (log scale), one panel per sign, linear and log coefficient axes."""
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
                ax.set_xlabel("importance weight w = pi_theta / mu")
            else:
                ax.set_ylim(-0.05, 2.5)
                ax.set_title(name)
            ax.grid(alpha=0.3)
        axes[0][col].set_ylabel("coefficient on A * grad log pi")
    axes[0][1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title or "Effective coefficient phi(w) by advantage sign (read off the registry by autograd)")
    fig.tight_layout()
    return _save(fig, os.path.dirname(path) or ".", os.path.basename(path))


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(result: dict) -> str:
    """The docs tables: final reward and early diagnostics per regime, kernel and R (mean +- std over seeds)."""
    reuses = result["config"]["reuse"]
    out = []
    fmt = lambda st, p=3: f"{st['mean']:.{p}f} ± {st['std']:.{p}f}"  # noqa: E731

    def g(st):
        return f"{st['mean']:.3g}" if st["mean"] < 100 else f"{st['mean']:.1e}"

    for regime, res in result["regimes"].items():
        rs = res["results"]
        out.append(f"**{regime}** (Adam lr {res['lr']}): final expected reward / at a quarter of the budget\n")
        out.append("| kernel | " + " | ".join(f"R={r}" for r in reuses) + " |")
        out.append("|---|" + "---:|" * len(reuses))
        for label, by_r in rs.items():
            cells = [f"{fmt(by_r[f'R={r}']['final_reward'])} / {by_r[f'R={r}']['reward_at_quarter']['mean']:.3f}"
                     for r in reuses]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        off = [r for r in reuses if r > 1]
        out.append(f"\n**{regime}**: early grad_throughput pos / neg, starved_frac pos (mean over seeds)\n")
        out.append("| kernel | " + " | ".join(f"R={r} pos / neg / starved" for r in off) + " |")
        out.append("|---|" + "---:|" * len(off))
        for label, by_r in rs.items():
            cells = [f"{g(by_r[f'R={r}']['grad_throughput_pos'])} / {g(by_r[f'R={r}']['grad_throughput_neg'])} / "
                     f"{by_r[f'R={r}']['starved_frac_pos']['mean']:.2f}" for r in off]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def write(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "starvation_lab.json")
    with open(path, "w") as f:
        json.dump(_round(result), f, allow_nan=True)  # one line: ~0.3 MB, read it with a tool
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
    """``["respo_norm=mean", "respo_alpha_pos=0.3", "delta=None"]`` -> LossParams overrides, typed by the defaults."""
    defaults = LossParams()
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if not hasattr(defaults, key):
            raise SystemExit(f"unknown LossParams field {key!r}; fields: {sorted(dataclasses.asdict(defaults))}")
        default = getattr(defaults, key)
        out[key] = value if isinstance(default, str) else (None if value == "None" else float(value))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="directory for starvation_lab.json and the figures")
    parser.add_argument("--quick", action="store_true", help="smoke size (seconds)")
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), help="subset of kernels (default: all)")
    parser.add_argument("--reuse", nargs="+", type=int, help="reuse values R (default 1 2 4 8)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (default 0 1 2)")
    parser.add_argument("--lr", type=float, help="one regime at this Adam learning rate (default: 0.1 and 1.0)")
    parser.add_argument("--batches", type=int, help="generation batches per run (default 24)")
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
    if args.reuse:
        overrides["reuse"] = tuple(args.reuse)
    if args.seeds:
        overrides["seeds"] = tuple(args.seeds)
    cfg = dataclasses.replace(cfg, **overrides)
    kernels = {k: KERNELS[k] for k in (args.kernels or KERNELS)}
    base = dataclasses.replace(LossParams(), **_parse_params(args.params))

    print(f"starvation lab: {len(kernels)} kernels x R in {list(cfg.reuse)} x {len(cfg.seeds)} seeds", flush=True)
    result = run_lab(cfg, kernels, base, log=lambda line: print(line, flush=True))
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
