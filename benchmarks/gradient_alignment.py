"""Whose stale gradient points where the on-policy gradient does: the engine of the mechanism stage of
``benchmarks.smollm2_staleness`` (no ``main``).

On one stale batch (completions sampled by an older policy ``pi_old``, scored at the current ``pi_theta``) every
loss compared here is, in gradient form (docs/method.md), ``sum_i sum_t c_it A_i grad log pi_theta(y_it)`` over the
batch's tokens, divided by their count: the losses differ only in the coefficient ``c``. The coefficients are the
package's own (:func:`respo_trl.kernels.gradient_coefficients` on the registered losses), so what is measured is the
gradient each loss really takes:

* ``dapo``: TRL's clipped token ratio (``c_it = r_it`` inside the clip, 0 where it stops the token);
* ``vespo``: VESPO's gamma kernel of the sequence weight ``W``;
* ``respo``: ReSPO's two-branch kernel of ``W`` (each sample used once: no trust mask, as in training);
* ``is``: the unclipped sequence-level importance weight ``c_i = W_i`` (``log W`` clamped to +-20 as everywhere):
  plain importance weighting, the baseline the other coefficients reshape; not an unbiased estimator here, since the
  group's mean and std come from the same samples, the token-count denominator is itself random and ``log W`` is
  clamped.

The on-policy gradient is estimated on a separate, large batch sampled from ``pi_theta`` itself: sequence-level
REINFORCE with the group-mean baseline, ``sum_i (R_i - mean_group R) sum_t grad log pi_theta(y_it)`` (an unbiased
estimate of ``(1 - 1/G) grad E[R]``: a scale, which no cosine sees).
"""

from __future__ import annotations

import math
import random
import statistics

import torch

from respo_trl.kernels import LossParams, gradient_coefficients, sequence_log_weight

LOSSES = ("dapo", "vespo", "respo", "is")
_REGISTERED = {"dapo": "ppo", "vespo": "vespo", "respo": "respo"}  # the package's loss behind each name


def token_logps(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``log pi(y_it | ...)`` per completion token at ``temperature`` as TRL computes what its loss sees (logits /
    temperature, log-softmax, the sampled token), prompts left-padded and completions right-padded: ``(logps, mask)``,
    both (B, T). Differentiable when grad is enabled."""
    width = max(len(p) for p in prompt_ids)
    length = max(len(c) for c in completion_ids)
    ids = torch.full((len(prompt_ids), width + length), pad_id)
    attention = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[i, width - len(p) : width + len(c)] = torch.tensor(p + c)
        attention[i, width - len(p) : width + len(c)] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, width - 1 : -1]
    logps = torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[:, width:, None]).squeeze(-1)
    mask = attention[:, width:].float()
    return logps * mask, mask


def group_advantages(rewards: list[float], group_size: int, scale: bool = True) -> torch.Tensor:
    """GRPO's advantages as TRL computes them (``scale_rewards="group"``): the reward minus its group's mean, over the
    group's unbiased standard deviation plus 1e-4; ``scale=False``: the centred reward alone (the REINFORCE baseline)."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group_size)
    centred = r - r.mean(-1, keepdim=True)
    if scale:
        centred = centred / (r.std(-1, keepdim=True) + 1e-4)
    return centred.reshape(-1)


def coefficients(loss: str, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The detached coefficient ``c_it`` (B, T) of ``loss`` on a batch whose token log-ratios against the sampling
    policy are ``log_ratio`` (TRL's defaults: clip 0.2 / 0.2, VESPO's and ReSPO's constants)."""
    if loss == "is":
        return torch.exp(sequence_log_weight(log_ratio, mask)).unsqueeze(-1) * mask
    return gradient_coefficients(_REGISTERED[loss], log_ratio.detach(), advantages, mask, LossParams())


def flat_gradient(model, objective: torch.Tensor, retain: bool) -> torch.Tensor:
    """``d objective / d theta`` over every trainable parameter, as one float32 vector."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(objective, params, retain_graph=retain, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)])


def loss_gradients(model, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   losses=LOSSES) -> dict[str, torch.Tensor]:  # fmt: skip
    """The ascent direction of each loss on one stale batch: ``sum c_it A_i grad log pi_it / sum m_it`` (minus the
    gradient of the per-token loss ``-c A log pi`` under TRL's ``dapo`` aggregation), one backward pass per loss
    through the same forward."""
    log_ratio = (logps - old_logps).detach() * mask
    tokens = mask.sum().clamp(min=1.0)
    out = {}
    for i, loss in enumerate(losses):
        c = coefficients(loss, log_ratio, advantages, mask)
        surrogate = (c * advantages.unsqueeze(-1) * logps * mask).sum() / tokens
        out[loss] = flat_gradient(model, surrogate, retain=i < len(losses) - 1)
    return out


def reinforce_gradient(model, logps: torch.Tensor, rewards: list[float], group_size: int,
                       mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Sequence-level REINFORCE with the group-mean baseline on a fresh batch, per completion (sum over tokens)."""
    advantages = group_advantages(rewards, group_size, scale=False)
    return flat_gradient(model, (advantages.unsqueeze(-1) * logps * mask).sum() / len(rewards), retain=False)


def alignment(direction: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """``cos``: the cosine of ``direction`` with ``reference``; ``gain``: the first-order change of the objective
    whose gradient ``reference`` estimates along the unit step ``direction / |direction|``."""
    norm = direction.norm()
    if norm == 0:
        return {"cos": math.nan, "gain": math.nan}
    along = torch.dot(direction, reference).item() / norm.item()
    return {"cos": along / max(reference.norm().item(), 1e-30), "gain": along}


def hierarchical_bootstrap(groups: dict, reps: int = 10_000, seed: int = 0) -> dict:
    """Mean of values grouped by a shared reference (a checkpoint: its batches share the on-policy estimate) and
    its 95% percentile interval from a two-stage bootstrap: groups resampled with replacement, then values within
    each drawn group. ``groups``: key -> list of values (empty groups dropped)."""
    groups = {k: v for k, v in groups.items() if v}
    values = [x for v in groups.values() for x in v]
    if not values:
        return {"mean": None, "ci": None, "n": 0, "groups": 0}
    rng = random.Random(seed)
    keys = sorted(groups)
    means = []
    for _ in range(reps):
        drawn = [x for k in (rng.choice(keys) for _ in keys) for x in rng.choices(groups[k], k=len(groups[k]))]
        means.append(statistics.fmean(drawn))
    return {"mean": statistics.fmean(values), "ci": percentile_interval(means), "n": len(values), "groups": len(keys)}


def percentile_interval(draws: list[float]) -> list[float]:
    """The 95% percentile interval of bootstrap draws."""
    draws = sorted(draws)
    return [draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]]


def hierarchical_difference(first: dict, second: dict, reps: int = 10_000, seed: int = 0) -> dict:
    """Mean of ``first`` minus mean of ``second`` for two unpaired sets of batches that share their groups'
    references (fresh and stale batches of the same checkpoints), with a 95% interval from a two-stage bootstrap:
    the checkpoints held by both resampled together, then each set's batches within each drawn checkpoint."""
    keys = sorted(k for k in first if first[k] and second.get(k))
    if not keys:
        return {"mean": None, "ci": None, "groups": 0}
    rng = random.Random(seed)
    diffs = []
    for _ in range(reps):
        drawn = [rng.choice(keys) for _ in keys]
        a = [x for k in drawn for x in rng.choices(first[k], k=len(first[k]))]
        b = [x for k in drawn for x in rng.choices(second[k], k=len(second[k]))]
        diffs.append(statistics.fmean(a) - statistics.fmean(b))
    mean = statistics.fmean([x for k in keys for x in first[k]]) - statistics.fmean([x for k in keys for x in second[k]])
    return {"mean": mean, "ci": percentile_interval(diffs), "groups": len(keys)}
