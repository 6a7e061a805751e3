"""Starvation lab: sign-dependent gradient starvation under both kinds of rollout reuse, on a simulated policy.

No LLM, CPU only: ~4 CPU-minutes for the full run (one torch thread), seconds at smoke size.

What it shows
-------------
The policy losses of :data:`respo_trl.kernels.POLICY_LOSSES` (clipped token PPO = TRL ``dapo``, GSPO, VESPO, ReSPO with
the paper's constants, ReSPO with the directional token trust mask, and two importance-sampling references registered
here: token IS and exact sequence IS) train the same simulated policy under the two kinds of rollout reuse of the
spec (section 4), at an equal budget of generated tokens. Also registered here, for the ablation lab and ``--kernels``
only: ReSPO on a normalised weight ``exp(l / T)`` (``respo_mean``, ``respo_sqrt``, ``respo_ess``), the options the
library removed on that ablation's evidence.

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
    OMP_NUM_THREADS=1 python benchmarks/starvation_lab.py --out docs/benchmarks/starvation_lab   # full
    python benchmarks/starvation_lab.py --quick --out /tmp/lab                      # seconds (smoke size)
    python benchmarks/starvation_lab.py --kernels ppo_clip respo respo_mean --params epsilon_high=0.28
    python benchmarks/starvation_lab.py --lr 0.3 --reuse 4 --staleness 8 --out /tmp/lr03  # custom regime
    python benchmarks/starvation_lab.py --markdown-from docs/benchmarks/starvation_lab/starvation_lab.json

``--out DIR`` writes ``DIR/starvation_lab.json`` (config; per regime, kernel and setting ``R=r`` / ``N=n``: final
reward, early diagnostics as mean, std and per-seed values; reward curves; a summary per regime that says where ReSPO
wins and where it loses) and the figures ``reward_curves.png``, ``throughput.png``, ``phi_by_sign.png`` and
``positive_branch.png``. ``--params`` overrides :class:`respo_trl.kernels.LossParams` fields for every kernel;
ablations reuse the lab through :func:`run_regime` with their own ``kernels`` dict (label -> (registry name,
overrides)).
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

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/<script>.py` from a checkout: benchmarks/ is a package

from benchmarks.machine import machine_info  # noqa: E402
from respo_trl.diagnostics import positive_low_weight_stats, sequence_stats, summarize  # noqa: E402
from respo_trl.kernels import (  # noqa: E402
    LOG_W_CLAMP,
    POLICY_LOSSES,
    LossParams,
    directional_trust_mask,
    get_policy_loss,
    gradient_coefficients,
    register_policy_loss,
    respo_kernel,
    sequence_log_weight,
)


# Two reference losses only the lab compares (not TRL loss types, so not in the library's registry by default).
# Registered once per process even if this file is imported under two module names (tests load it by path).
def token_is_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """Plain token-level importance sampling, ``-r_it A_i``: PPO with the clip removed."""
    return -torch.exp(log_ratio) * advantages.reshape(-1, 1)


def sequence_is_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """Exact sequence importance sampling: coefficient ``W_i = exp(l_i)`` (unbiased, unbounded variance)."""
    l = (torch.where(mask.bool(), log_ratio.detach(), 0.0)).sum(-1, keepdim=True)
    return -torch.exp(l.clamp(max=LOG_W_CLAMP)) * advantages.reshape(-1, 1) * log_ratio


# ReSPO on a normalised sequence weight: the ablation's respo_mean / respo_sqrt / respo_ess
# (docs/benchmarks/ablations.md, section 4). The library dropped these options on that evidence (the paper uses the raw
# W); they live here so the ablation stays reproducible: the same math as the removed ``respo_norm`` (l clamped to
# +-20, divided, clamped again).
ESS_RHO_MIN = 0.5  # the ESS floor the ablation used for "ess"
BATCH_LEVEL_LOSSES = ("respo_ess",)  # one statistic over the whole batch: the lab computes these per seed


def log_weight_divisor(l, lengths, norm: str):
    """``T_i`` (shape (B,)): ``mean``: ``L_i`` (GSPO's geometric mean); ``sqrt``: ``sqrt(L_i)`` (the retired 0.1
    kernel's); ``ess``: one ``T = max(1, std(l) / sqrt(-log rho_min))`` for the batch, so that the normalised Kish ESS
    of ``exp(l / T)`` is at least ``rho_min`` if ``l`` is normal."""
    if norm == "mean":
        return lengths.clamp(min=1.0)
    if norm == "sqrt":
        return lengths.clamp(min=1.0).sqrt()
    valid = l[(lengths > 0) & torch.isfinite(l)]
    if valid.numel() < 2:
        return torch.ones_like(l)
    return (valid.std() / math.sqrt(-math.log(ESS_RHO_MIN))).clamp(min=1.0).expand_as(l)


def normalised_respo_loss(norm: str):
    def loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
        if sampler_ratio is not None:
            raise ValueError(f"respo_{norm} is a lab-only loss without a sampler correction")
        with torch.no_grad():
            kept = mask.bool()
            l = sequence_log_weight(log_ratio, kept)
            log_w = (l / log_weight_divisor(l, kept.sum(-1).float(), norm)).clamp(-LOG_W_CLAMP, LOG_W_CLAMP)
            a = advantages.reshape(-1, 1) if advantages.dim() == 1 else advantages
            phi = respo_kernel(log_w.unsqueeze(-1).expand(-1, a.shape[-1]), a.float(), **params.respo_constants())
            coef = phi * kept.float()
            if params.respo_trust_mask:
                coef = coef * directional_trust_mask(log_ratio, advantages, kept, params.epsilon_low,
                                                     params.epsilon_high)
        return -coef * a * log_ratio

    loss.__doc__ = f"Lab-only: ReSPO's kernel on ``exp(l_i / T_i)``, the ``{norm}`` divisor (not the paper's method)."
    return loss


LAB_LOSSES = {"is": token_is_loss, "is_seq": sequence_is_loss,
              **{f"respo_{norm}": normalised_respo_loss(norm) for norm in ("mean", "sqrt", "ess")}}
for _name, _fn in LAB_LOSSES.items():
    if _name not in POLICY_LOSSES:
        register_policy_loss(_name)(_fn)

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
SAME_BATCH_HOST = "respo"  # the run whose batches the same-batch counterfactual is computed on

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


@dataclass(frozen=True)
class Reuse:
    """One reuse setting: ``epochs`` (each sample used ``n`` times) or ``staleness`` (``n`` mini-batches per rollout,
    each sample used once)."""

    kind: str
    n: int

    @property
    def key(self) -> str:
        return ("R=" if self.kind == "epochs" else "N=") + str(self.n)

    @classmethod
    def parse(cls, key: str) -> "Reuse":
        prefix, _, n = key.partition("=")
        kinds = {"R": "epochs", "N": "staleness"}
        if prefix not in kinds or not n.isdigit() or int(n) < 1:
            raise ValueError(f"reuse setting {key!r}: expected 'R=<epochs>' or 'N=<mini-batches per rollout>'")
        return cls(kinds[prefix], int(n))


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
    batches: int = 24  # the sampling budget in batches of `prompts` prompts' generations, the same for every setting
    lr: float = 0.1  # set per regime
    # (name, Adam lr): "moderate" moves each logit by <= 0.1 per step; "stress" by <= 1
    regimes: tuple[tuple[str, float], ...] = (("moderate", 0.1), ("stress", 1.0))
    max_grad_norm: float = 1.0
    reuse: tuple[int, ...] = (1, 2, 4, 8)  # epochs R
    staleness: tuple[int, ...] = (1, 4, 8, 16, 32)  # the paper's N
    minibatch_prompts: int = 8  # M: prompts per update in the staleness runs
    seeds: tuple[int, ...] = (0, 1, 2)
    early_frac: float = 0.25  # "early" = the updates of the first quarter of the budget
    diag_every: int = 8  # after the early window, diagnostics on the updates of every diag_every-th budget batch

    def settings(self) -> list[Reuse]:
        return [Reuse("epochs", r) for r in self.reuse] + [Reuse("staleness", n) for n in self.staleness]


QUICK = dict(prompts=8, group=8, max_len=64, min_len=16, batches=6, seeds=(0, 1), reuse=(1, 4), staleness=(1, 4),
             minibatch_prompts=4, diag_every=2, regimes=(("moderate", 0.1),))


def kernel_params(label: str, kernels: dict, base: LossParams) -> LossParams:
    return dataclasses.replace(base, **kernels[label][1])


# ---------------------------------------------------------------------------------------------------------------------
# The update schedule of a reuse setting
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Update:
    """One optimizer update: prompt draws ``[lo, hi)`` of its rollout, ``staleness`` = updates since that rollout was
    sampled, ``budget_batch`` = index of the budget batch (``P`` prompts' generations) it belongs to."""

    lo: int
    hi: int
    staleness: int
    budget_batch: int


def schedule(cfg: LabConfig, setting: Reuse) -> list[tuple[int, list[Update]]]:
    """``[(prompt draws of the rollout, [updates on it]), ...]`` for ``setting``, at the budget ``cfg.batches x P``.

    Epochs ``R``: ``cfg.batches`` rollouts of ``P`` draws, ``R`` full-batch passes each (pass ``r`` is ``r`` stale).
    Staleness ``N``: rollouts of ``N x M`` draws, update ``k`` on draws ``[kM, (k+1)M)`` is ``k`` stale; the last
    rollout is cut where the budget ends.
    """
    P, M = cfg.prompts, cfg.minibatch_prompts
    if setting.kind == "epochs":
        return [(P, [Update(0, P, r, b) for r in range(setting.n)]) for b in range(cfg.batches)]
    if P % M:
        raise ValueError(f"minibatch_prompts={M} must divide prompts={P}")
    total = cfg.batches * P // M  # updates, the same for every N
    plan, done = [], 0
    while done < total:
        n = min(setting.n, total - done)
        plan.append((n * M, [Update(k * M, (k + 1) * M, k, (done + k) * M // P) for k in range(n)]))
        done += n
    return plan


# ---------------------------------------------------------------------------------------------------------------------
# The simulated task and policy; seeds are stacked along a leading dimension S and trained in one pass
# ---------------------------------------------------------------------------------------------------------------------


class Task:
    """The simulated prompts for ``S`` seeds (one task per seed), stacked along a leading dimension.

    Positions are stored packed: prompt ``p``'s token position ``t < L_p`` is row ``idx[s, p, t]`` of the ``(S, N, V)``
    logit tables (padding points at a spare last row). ``z0`` (S, N, V) prior logits; ``mask`` (S, P, T) completion
    masks; ``key_idx`` / ``key_pos`` / ``key_tok`` (S, P, K) the rows and positions of the key positions and their
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
            key_pos = torch.zeros(P, K, dtype=torch.long)
            key_tok = torch.zeros(P, K, dtype=torch.long)
            valid = torch.zeros(P, K, dtype=torch.bool)
            need = torch.zeros(P, dtype=torch.long)
            for p in range(P):
                k_p = max(cfg.min_keys, int(L[p]) // cfg.key_every)
                positions = torch.randperm(int(L[p]), generator=gen)[:k_p]
                ranked = z[offsets[p] + positions].argsort(-1, descending=True)  # (k_p, V) tokens by prior prob.
                key_pos[p, :k_p] = positions
                key_tok[p, :k_p] = ranked[:, 1] if is_hard[p] else ranked[:, 0]  # hard: runner-up; routine: mode
                valid[p, :k_p] = True
                need[p] = max(1, math.ceil((cfg.need_hard if is_hard[p] else cfg.need_routine) * k_p))
            per_seed.append((L, z, offsets, is_hard, key_pos, key_tok, valid, need))
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
        self.key_pos, self.key_tok, self.key_valid, self.need = stacked
        self.key_idx = torch.gather(self.idx, 2, self.key_pos)  # (S, P, K) rows of the key positions
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

    def _rows(self, prompts: torch.Tensor) -> torch.Tensor:
        """(S, B, T) table rows of the positions of the prompt draws ``prompts`` (S, B)."""
        return torch.gather(self.idx, 1, prompts.unsqueeze(-1).expand(-1, -1, self.idx.shape[-1]))

    def sample(self, logp: torch.Tensor, prompts: torch.Tensor, group: int, gen: torch.Generator):
        """``group`` completions of each prompt draw in ``prompts`` (S, B): tokens (S, B, G, T), rewards (S, B, G)."""
        S, B = prompts.shape
        V, T = logp.shape[-1], self.idx.shape[-1]
        rows = self._rows(prompts)
        probs = torch.gather(logp, 1, rows.view(S, B * T, 1).expand(-1, -1, V)).exp()
        tokens = torch.multinomial(probs.view(-1, V), group, replacement=True, generator=gen)
        tokens = tokens.view(S, B, T, group).permute(0, 1, 3, 2).contiguous()  # (S, B, G, T)
        pick = lambda x: torch.gather(x, 1, prompts.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # noqa: E731
        key_pos, key_tok, valid = pick(self.key_pos), pick(self.key_tok), pick(self.key_valid)
        hits = torch.gather(tokens, 3, key_pos.unsqueeze(2).expand(-1, -1, group, -1))  # (S, B, G, K)
        hits = ((hits == key_tok.unsqueeze(2)) & valid.unsqueeze(2)).sum(-1)
        need = torch.gather(self.need, 1, prompts)
        return tokens, (hits >= need.unsqueeze(-1)).float()

    def token_logps(self, logp: torch.Tensor, tokens: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        """(S, B*G, T) log-probabilities of ``tokens`` (S, B, G, T) of the draws ``prompts`` under ``logp``."""
        S, B, G, T = tokens.shape
        flat = self._rows(prompts).unsqueeze(2) * logp.shape[-1] + tokens  # rows of logp.view(S, N * V)
        return torch.gather(logp.reshape(S, -1), 1, flat.view(S, -1)).view(S, B * G, T)

    def completion_mask(self, prompts: torch.Tensor, group: int) -> torch.Tensor:
        """(S, B*G, T) completion masks of the draws ``prompts`` (S, B)."""
        S, B = prompts.shape
        mask = torch.gather(self.mask, 1, prompts.unsqueeze(-1).expand(-1, -1, self.mask.shape[-1]))
        return mask.unsqueeze(2).expand(S, B, group, -1).reshape(S, B * group, -1)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """TRL's GRPO advantages: ``(r - mean) / (std + 1e-4)`` within each prompt draw's group (S, B, G)."""
    return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-4)


def prompt_stream(S: int, P: int, gen: torch.Generator):
    """Endless (S, n) prompt draws: consecutive random permutations of the ``P`` prompts per seed (a data loader)."""
    buffer = torch.empty(S, 0, dtype=torch.long)

    def take(n: int) -> torch.Tensor:
        nonlocal buffer
        while buffer.shape[1] < n:
            perms = torch.stack([torch.randperm(P, generator=gen) for _ in range(S)])
            buffer = torch.cat([buffer, perms], dim=1)
        out, buffer = buffer[:, :n], buffer[:, n:]
        return out

    return take


# ---------------------------------------------------------------------------------------------------------------------
# One training run: one kernel at one reuse setting, every seed at once
# ---------------------------------------------------------------------------------------------------------------------

DIAG_KEYS = ("pos", "neg", "clip_pos", "starved_pos", "starved_neg", "log_weight_pos", "log_weight_neg",
             "low_share", "low_mass_share", "low_ratio", "pos_length")


def train(task: Task, cfg: LabConfig, name: str, params: LossParams, setting: Reuse,
          same_batch: dict | None = None) -> dict:
    """Train registry loss ``name`` with ``params`` at ``setting``; returns per-seed curves and early diagnostics.

    ``same_batch`` (label -> (registry name, LossParams)) adds, on the early updates, the positive-branch diagnostic of
    each of those kernels' coefficients on this run's batches (``early_same_batch``).
    """
    loss_fn = get_policy_loss(name)
    S, P = task.lengths.shape
    G = cfg.group
    log_beta = torch.zeros(S, requires_grad=True)
    table = torch.zeros(S, task.N, cfg.vocab, requires_grad=True)
    opt = torch.optim.Adam([log_beta, table], lr=cfg.lr)
    offset = 0 if setting.kind == "epochs" else 100_000
    gen = torch.Generator().manual_seed(1234 + 17 * setting.n + offset)  # every kernel sees the same first rollout
    draws = prompt_stream(S, P, torch.Generator().manual_seed(4321 + setting.n + offset))
    early_batches = max(1, round(cfg.early_frac * cfg.batches))
    slices = seed_slices(name, S)

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
    diag = {k: [[] for _ in range(S)] for k in DIAG_KEYS}  # per seed, one entry per diagnosed update
    early = {k: [[] for _ in range(S)] for k in DIAG_KEYS}
    early_cf = {label: {k: [[] for _ in range(S)] for k in ("share", "mass_share", "mass_ratio")}
                for label in (same_batch or {})}
    diag_batch, diag_staleness, staleness = [], [], []
    plan = schedule(cfg, setting)
    last_of_batch = {}
    for _, updates in plan:
        for u in updates:
            last_of_batch[u.budget_batch] = u
    for n_draws, updates in plan:
        with torch.no_grad():
            prompts = torch.arange(P).expand(S, P) if setting.kind == "epochs" else draws(n_draws)
            logp_old = task.log_probs(log_beta, table)
            tokens, rewards = task.sample(logp_old, prompts, G, gen)
            old = task.token_logps(logp_old, tokens, prompts)
            adv_all = group_advantages(rewards).reshape(S, -1)
            mask_all = task.completion_mask(prompts, G)
        for u in updates:
            rows = slice(u.lo * G, u.hi * G)
            mask, adv = mask_all[:, rows], adv_all[:, rows]
            B = mask.shape[1]
            n_tokens = mask.sum((1, 2))  # (S,) dapo normaliser: the mini-batch's token count
            logp = task.token_logps(task.log_probs(log_beta, table), tokens[:, u.lo:u.hi], prompts[:, u.lo:u.hi])
            log_ratio = torch.where(mask > 0, logp - old[:, rows], torch.zeros_like(logp))
            total = 0.0
            for sl in slices:
                per_token = loss_fn(log_ratio[sl].flatten(0, 1), adv[sl].flatten(), mask[sl].flatten(0, 1), params)
                total = total + (per_token.view(-1, B, mask.shape[-1]) * mask[sl] / n_tokens[sl].view(-1, 1, 1)).sum()
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
            staleness.append(u.staleness)
            is_early = u.budget_batch < early_batches
            if is_early or u.budget_batch % cfg.diag_every == 0:
                step = step_metrics(log_ratio.detach(), adv, mask, params, name, slices)
                diag_batch.append(u.budget_batch)
                diag_staleness.append(u.staleness)
                for s, row in enumerate(step):
                    for k in DIAG_KEYS:
                        diag[k][s].append(row[k])
                        if is_early:
                            early[k][s].append(row[k])
                if is_early and same_batch:
                    for label, cf in same_batch_stats(log_ratio.detach(), adv, mask, same_batch).items():
                        for k, per_seed in cf.items():
                            for s, v in enumerate(per_seed):
                                early_cf[label][k][s].append(v)
            if last_of_batch[u.budget_batch] is u:
                for key, value in zip(curves, evaluate()):
                    curves[key].append(value)
    return {
        **{k: torch.tensor(v).T.tolist() for k, v in curves.items()},  # [seed][budget batch]
        "early": {k: [_nanmean(v) for v in per_seed] for k, per_seed in early.items()},  # [seed]
        "early_same_batch": {label: {k: [_nanmean(v) for v in per_seed] for k, per_seed in d.items()}
                             for label, d in early_cf.items()},
        "diag": diag,
        "diag_batch": diag_batch,
        "diag_staleness": diag_staleness,
        "staleness": staleness,
        "updates": len(staleness),
        "finite": [bool(torch.isfinite(table[s]).all() and torch.isfinite(log_beta[s])) for s in range(S)],
    }


def seed_slices(name: str, S: int) -> list[slice]:
    """The seeds are stacked in one batch; a loss of :data:`BATCH_LEVEL_LOSSES` is called on each seed's own."""
    return [slice(s, s + 1) for s in range(S)] if name in BATCH_LEVEL_LOSSES else [slice(0, S)]


def step_metrics(log_ratio, adv, mask, params, name, slices=None) -> list[dict]:
    """The trainer's starvation metrics for one update (one dict per seed), from :mod:`respo_trl.diagnostics`.

    ``log_ratio``/``mask`` (S, B, T), ``adv`` (S, B). Every value is what ``summarize`` logs for that seed's batch,
    except ``log_weight_pos``/``_neg`` (the mean raw ``log W`` of positive / negative responses).
    """
    S, B, T = log_ratio.shape
    slices = slices or [slice(0, S)]
    tables = [
        sequence_stats(log_ratio[sl].flatten(0, 1), adv[sl].flatten(), mask[sl].flatten(0, 1), params, name)
        for sl in slices
    ]
    table = torch.cat(tables).view(S, B, -1)
    rows = []
    for s in range(S):
        m = summarize(table[s])
        log_w = table[s, :, 5]  # column "log_weight": raw log W
        rows.append({
            "pos": m["starvation/grad_throughput/pos"],
            "neg": m["starvation/grad_throughput/neg"],
            "clip_pos": m["starvation/clip_grad_throughput/pos"],
            "starved_pos": m["starvation/starved_frac/pos"],
            "starved_neg": m["starvation/starved_frac/neg"],
            "log_weight_pos": _nanmean(log_w[adv[s] > 0].tolist()),
            "log_weight_neg": _nanmean(log_w[adv[s] < 0].tolist()),
            "low_share": m["starvation/low_weight_pos/share"],
            "low_mass_share": m["starvation/low_weight_pos/mass_share"],
            "low_ratio": m["starvation/low_weight_pos/mass_ratio"],
            "pos_length": m["starvation/pos_length_mean"],
        })
    return rows


def same_batch_stats(log_ratio, adv, mask, kernels: dict) -> dict:
    """``{label: {"share"|"mass_share"|"mass_ratio": [per seed]}}``: the positive-branch diagnostic of each kernel's
    coefficients (label -> (registry name, LossParams)) on one batch, as :func:`summarize` computes it."""
    S, B, T = log_ratio.shape
    flat_lr, flat_mask = log_ratio.flatten(0, 1), mask.flatten(0, 1)
    lengths = flat_mask.sum(-1)
    log_w = (flat_lr * flat_mask).sum(-1).clamp(-LOG_W_CLAMP, LOG_W_CLAMP).view(S, B)
    out = {}
    for label, (name, params) in kernels.items():
        c = torch.cat([gradient_coefficients(name, log_ratio[sl].flatten(0, 1), adv[sl].flatten(),
                                             mask[sl].flatten(0, 1), params) for sl in seed_slices(name, S)])
        cbar = (c.sum(-1) / lengths.clamp(min=1.0)).view(S, B)
        per_seed = [positive_low_weight_stats(log_w[s], cbar[s], adv[s], lengths.view(S, B)[s] > 0) for s in range(S)]
        out[label] = {k: [p[k] for p in per_seed] for k in ("share", "mass_share", "mass_ratio")}
    return out


def _per_batch(per_seed: list[list[float]], batches: list[int]) -> list[list[float]]:
    """Average the per-update values of each diagnosed budget batch (updates of one batch are consecutive)."""
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


def _low_weight(share: list[float], mass_share: list[float], ratio_steps: list[float]) -> dict:
    """Positive-branch diagnostic of one cell: step means of the logged share / mass share (per seed), their ratio,
    and the step mean of the logged ratio."""
    s, m = _stats(share), _stats(mass_share)
    ratio = m["mean"] / s["mean"] if s["mean"] and s["mean"] == s["mean"] and s["mean"] > 0 else math.nan
    return {"share": s, "mass_share": m, "mass_ratio": ratio, "mass_ratio_stepmean": _stats(ratio_steps)}


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
            "tokens_per_batch": _tokens_per_batch(task, cfg),
        },
        "regimes": regimes,
        "phi": {"w": PHI_GRID.tolist(), "curves": coefficient_curves(kernels, base, PHI_GRID)},
        "runtime_s": time.perf_counter() - start,
        "machine": machine_info(),
    }


def _tokens_per_batch(task: Task, cfg: LabConfig) -> float:
    return (task.lengths.sum(-1).float() * cfg.group).mean().item()


def run_regime(task: Task, cfg: LabConfig, kernels: dict, base: LossParams, log=print, start: float = 0.0,
               settings: list[Reuse] | None = None, same_batch: bool = True) -> dict:
    """``{label: {"R=r" | "N=n": metrics}}`` for every kernel and reuse setting at ``cfg.lr``; ``same_batch`` adds the
    same-batch positive-branch counterfactual of every kernel to the ``respo`` runs."""
    tokens_per_batch = _tokens_per_batch(task, cfg)
    start = start or time.perf_counter()
    settings = settings or cfg.settings()
    counterfactual = {label: (name, kernel_params(label, kernels, base)) for label, (name, _) in kernels.items()}
    results: dict = {}
    for label, (name, _) in kernels.items():
        params = kernel_params(label, kernels, base)
        results[label] = {}
        for setting in settings:
            t0 = time.perf_counter()
            host = same_batch and label == SAME_BATCH_HOST and setting.n > 1
            run = train(task, cfg, name, params, setting, counterfactual if host else None)
            early = run["early"]
            results[label][setting.key] = r = {
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
                "low_weight_pos": _low_weight(early["low_share"], early["low_mass_share"], early["low_ratio"]),
                "pos_length": _stats(early["pos_length"]),
                "updates": run["updates"],
                "max_staleness": max(run["staleness"]),
                "finite": run["finite"],
                "curves": {
                    "generated_tokens": [round(tokens_per_batch * b) for b in range(cfg.batches + 1)],
                    "reward": run["reward"],
                    "reward_hard": run["reward_hard"],
                    "beta": run["beta"],
                    "diag_batch": sorted(set(run["diag_batch"])),  # budget batches whose updates were diagnosed
                    "grad_throughput_pos": _per_batch(run["diag"]["pos"], run["diag_batch"]),  # [seed][batch]
                    "grad_throughput_neg": _per_batch(run["diag"]["neg"], run["diag_batch"]),
                },
            }
            if run["early_same_batch"]:
                r["low_weight_same_batch"] = {
                    lab_: _low_weight(d["share"], d["mass_share"], d["mass_ratio"])
                    for lab_, d in run["early_same_batch"].items()
                }
            low = r["low_weight_pos"]
            log(
                f"[{time.perf_counter() - start:6.1f}s] {label:10s} {setting.key:5s} final reward "
                f"{r['final_reward']['mean']:.3f} +- {r['final_reward']['std']:.3f}  early throughput "
                f"pos {r['grad_throughput_pos']['mean']:.3g} neg {r['grad_throughput_neg']['mean']:.3g}  "
                f"starved_pos {r['starved_frac_pos']['mean']:.2f}  low-W pos {low['share']['mean']:.2f} -> "
                f"{low['mass_share']['mean']:.2f} of mass ({low['mass_ratio']:.2f}x)  "
                f"({time.perf_counter() - t0:.1f}s)"
            )
    return results


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
        json.dump(_round(result), f, allow_nan=True)  # one line, read it with a tool
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
    result["command"] = "python benchmarks/starvation_lab.py " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:])
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
