"""The starvation lab's engine: the simulated task and policy, the lab-only losses (token IS, exact sequence IS and
ReSPO on a normalised weight, registered in :data:`respo_trl.kernels.POLICY_LOSSES` on import), the update schedule of
each reuse setting (epochs ``R``, staleness ``N``) and one training run per kernel and setting, every seed at once,
with the trainer's diagnostics (:func:`run_regime`).

Not a benchmark (it has no command line): ``python -m benchmarks.starvation_lab`` (the lab, whose docstring describes
the simulated setting) and ``python -m benchmarks.ablation_lab`` (ReSPO's variants) run it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from respo_trl.diagnostics import positive_low_weight_stats, sequence_stats, summarize
from respo_trl.kernels import (
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
# Registered once per process (the registry takes a name once).
def token_is_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """Plain token-level importance sampling, ``-r_it A_i``: PPO with the clip removed."""
    return -torch.exp(log_ratio) * advantages.reshape(-1, 1)


def sequence_is_loss(log_ratio, advantages, mask, params, *, sampler_ratio=None):
    """Exact sequence importance sampling: coefficient ``W_i = exp(l_i)`` (unbiased, unbounded variance)."""
    l = (torch.where(mask.bool(), log_ratio.detach(), 0.0)).sum(-1, keepdim=True)
    return -torch.exp(l.clamp(max=LOG_W_CLAMP)) * advantages.reshape(-1, 1) * log_ratio


# ReSPO on a normalised sequence weight: the ablation's respo_mean / respo_sqrt / respo_ess
# (docs/benchmarks/ablation_lab.md, section 4). The library dropped these options on that evidence (the paper uses the raw
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
# Reuse settings and the lab's configuration
# ---------------------------------------------------------------------------------------------------------------------

SAME_BATCH_HOST = "respo"  # the run whose batches the same-batch counterfactual is computed on


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
# Every kernel at every reuse setting, at one learning rate
# ---------------------------------------------------------------------------------------------------------------------


def generated_tokens_per_batch(task: Task, cfg: LabConfig) -> float:
    """Tokens generated per budget batch (``P`` prompts' groups), the mean over seeds."""
    return (task.lengths.sum(-1).float() * cfg.group).mean().item()


def run_regime(task: Task, cfg: LabConfig, kernels: dict, base: LossParams, log=print, start: float = 0.0,
               settings: list[Reuse] | None = None, same_batch: bool = True) -> dict:
    """``{label: {"R=r" | "N=n": metrics}}`` for every kernel and reuse setting at ``cfg.lr``; ``same_batch`` adds the
    same-batch positive-branch counterfactual of every kernel to the ``respo`` runs."""
    tokens_per_batch = generated_tokens_per_batch(task, cfg)
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
