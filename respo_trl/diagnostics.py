"""Starvation, off-policy and positive-branch diagnostics (spec section 5), as pure torch.

A trainer calls :func:`sequence_stats` on each micro-batch, gathers the per-sequence table from every process (one
collective) and logs :func:`summarize` of the gathered table. Because the summary is computed from the global table,
every process logs identical numbers, and sums are exact (not means of per-process means).

The coefficients are those the loss really applies: ``c_it`` comes from differentiating the registered loss
(:func:`respo_trl.kernels.gradient_coefficients`, sampler correction and ReSPO's token trust mask included), times
``token_weight``, the masks the trainer applies on top (TRL's entropy mask and off-policy sequence mask).
Definitions (symbols of ``docs/method.md``):

* ``grad_throughput/{pos,neg} = sum_i |A_i| sum_t m_it c_it / sum_i |A_i| L_i`` over sequences with ``A > 0`` / ``< 0``:
  the share of on-policy gradient mass the loss lets through (1 on-policy, without masks).
* ``clip_grad_throughput``: the same for TRL's token-clipped loss (``dapo``, epsilon from the config) on the same batch
  and with the same masks: the counterfactual ReSPO is compared with.
* ``starved_frac/{pos,neg}``: fraction of sequences whose mean coefficient ``cbar_i = sum_t m_it c_it / L_i`` is below 0.1.
* The paper's positive-branch diagnostic (:func:`positive_low_weight_stats`): among positive responses, the share with
  ``log W < -1``, the share of the positive coefficient mass ``sum cbar_i`` they receive, and the ratio of the two
  (1 = received in proportion; the paper reports 1.69 for ReSPO, 0.93 for VESPO). ``cbar_i = phi_i`` for a
  sequence kernel without masks.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .kernels import (
    LossParams,
    directional_trust_mask,
    fold_sampler_ratio,
    gradient_coefficients,
    kish_ess,
    respo_kernel,
    sequence_log_weight,
)

Tensor = torch.Tensor

STARVED_BELOW = 0.1  # a sequence is "starved" when its mean coefficient is below this
LOW_WEIGHT_LOG_W = -1.0  # the paper's positive-branch diagnostic looks at positives with log W < -1

# Columns of the per-sequence table returned by `sequence_stats`.
COLUMNS = ("valid", "advantage", "length", "mass", "clip_mass", "log_weight", "phi", "zero_tokens", "trust_masked")
_COL = {name: i for i, name in enumerate(COLUMNS)}


def sequence_stats(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: LossParams,
    loss_name: str,
    *,
    sampler_ratio: Tensor | None = None,
    token_weight: Tensor | None = None,
) -> Tensor:
    """One row per sequence with the :data:`COLUMNS` needed by :func:`summarize` (float32, shape (B, 9)).

    ``log_ratio`` = ``log pi_theta - log pi_old`` (B, T); ``sampler_ratio`` is TRL's vLLM ``importance_sampling_ratio``
    ((B, T) or (B, 1)) or ``None``; ``token_weight`` (broadcastable to (B, T)) the trainer's extra masks;
    ``loss_name`` a key of :data:`respo_trl.kernels.POLICY_LOSSES`. Advantages of shape (B, T) are summarised per
    sequence by their masked mean.
    """
    with torch.no_grad():
        mask_f = mask.float()
        log_ratio = log_ratio.detach().float()
        adv = advantages.detach().float()
        lengths = mask_f.sum(-1)
        if adv.dim() > 1 and adv.shape[-1] > 1:
            adv_seq = (adv * mask_f).sum(-1) / lengths.clamp(min=1.0)
        else:
            adv_seq = adv.reshape(-1)
        weight = mask_f if token_weight is None else mask_f * token_weight.float()

        def coefficients(name: str, loss_params: LossParams) -> Tensor:
            c = gradient_coefficients(name, log_ratio, adv, mask, loss_params, sampler_ratio=sampler_ratio)
            return c * weight

        c = coefficients(loss_name, params)
        clip_c = coefficients("ppo", dataclasses.replace(params, importance_sampling_level="token"))
        log_c, kept = fold_sampler_ratio(sampler_ratio, mask)
        log_w = sequence_log_weight(log_ratio, kept, log_c)  # raw log W, the diagnostic's x-axis for every loss
        phi = respo_kernel(log_w, adv_seq, **params.respo_constants())  # ReSPO's phi, whatever loss is trained
        trust_masked = torch.zeros_like(lengths)
        if loss_name == "respo" and params.respo_trust_mask:
            kept_trust = directional_trust_mask(log_ratio, adv, kept, params.epsilon_low, params.epsilon_high)
            trust_masked = (kept.float() - kept_trust).clamp(min=0).sum(-1)
        columns = {
            "valid": (lengths > 0).float(),
            "advantage": adv_seq,
            "length": lengths,
            "mass": c.sum(-1),
            "clip_mass": clip_c.sum(-1),
            "log_weight": log_w,
            "phi": phi,
            "zero_tokens": ((c == 0) & mask.bool()).float().sum(-1),
            "trust_masked": trust_masked,
        }
        return torch.stack([columns[name] for name in COLUMNS], dim=-1)


def positive_low_weight_stats(
    log_w: Tensor, coefficient: Tensor, advantages: Tensor, valid: Tensor | None = None, threshold: float = LOW_WEIGHT_LOG_W
) -> dict[str, float]:
    """The paper's positive-branch diagnostic on per-response tensors (all shape (B,)).

    Among responses with ``A > 0`` (and ``valid``): ``share`` of those with ``log W < threshold``, ``mass_share`` of the
    summed ``coefficient`` they receive, and ``mass_ratio = mass_share / share`` (> 1: low-weight positives get more
    than their head count). NaN where undefined (no positives, no low-weight positive, or zero mass).
    """
    selected = advantages.reshape(-1) > 0
    if valid is not None:
        selected = selected & valid.reshape(-1).bool()
    log_w, coefficient = log_w.reshape(-1)[selected].float(), coefficient.reshape(-1)[selected].float()
    if log_w.numel() == 0:
        return {"share": math.nan, "mass_share": math.nan, "mass_ratio": math.nan}
    low = log_w < threshold
    share = low.float().mean().item()
    total = coefficient.sum().item()
    mass_share = coefficient[low].sum().item() / total if total > 0 else math.nan
    ratio = mass_share / share if share > 0 and not math.isnan(mass_share) else math.nan
    return {"share": share, "mass_share": mass_share, "mass_ratio": ratio}


def summarize(table: Tensor) -> dict[str, float]:
    """Metrics of spec section 5 from a (gathered) :func:`sequence_stats` table. NaN where a group is empty."""
    table = table.float()
    col = {name: table[:, i] for name, i in _COL.items()}
    valid = col["valid"] > 0
    adv, length = col["advantage"], col["length"]
    mean_coef = col["mass"] / length.clamp(min=1.0)
    clip_mean_coef = col["clip_mass"] / length.clamp(min=1.0)
    metrics: dict[str, float] = {}

    for sign, selected in (("pos", valid & (adv > 0)), ("neg", valid & (adv < 0))):
        weight = adv[selected].abs()
        on_policy_mass = (weight * length[selected]).sum()
        for key, column in (("grad_throughput", "mass"), ("clip_grad_throughput", "clip_mass")):
            metrics[f"starvation/{key}/{sign}"] = _ratio((weight * col[column][selected]).sum(), on_policy_mass)
        metrics[f"starvation/starved_frac/{sign}"] = _mean((mean_coef[selected] < STARVED_BELOW).float())
        metrics[f"starvation/clip_starved_frac/{sign}"] = _mean((clip_mean_coef[selected] < STARVED_BELOW).float())
        metrics[f"respo/phi_mean/{sign}"] = _mean(col["phi"][selected])

    low = positive_low_weight_stats(col["log_weight"], mean_coef, adv, valid)
    for key, value in low.items():
        metrics[f"starvation/low_weight_pos/{key}"] = value
    metrics["starvation/pos_length_mean"] = _mean(length[valid & (adv > 0)])
    tokens = length[valid].sum()
    metrics["starvation/zero_coef_token_frac"] = _ratio(col["zero_tokens"][valid].sum(), tokens)
    metrics["respo/trust_masked_frac"] = _ratio(col["trust_masked"][valid].sum(), tokens)

    log_w = col["log_weight"][valid]
    finite = log_w[torch.isfinite(log_w)]
    metrics["offpolicy/log_weight/mean"] = _mean(finite)
    metrics["offpolicy/log_weight/std"] = finite.std().item() if finite.numel() > 1 else math.nan
    metrics["offpolicy/log_weight/min"] = finite.min().item() if finite.numel() else math.nan
    metrics["offpolicy/log_weight/max"] = finite.max().item() if finite.numel() else math.nan
    metrics["offpolicy/ess"] = kish_ess(finite).item() if finite.numel() else math.nan
    return metrics


def _mean(x: Tensor) -> float:
    return x.mean().item() if x.numel() else math.nan


def _ratio(num: Tensor, den: Tensor) -> float:
    return (num / den).item() if den > 0 else math.nan
