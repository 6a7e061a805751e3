"""Starvation and off-policy diagnostics (spec section 4), as pure torch.

The trainer calls :func:`sequence_stats` on each micro-batch, gathers the resulting per-sequence table from every
process (one collective), and logs :func:`summarize` of the gathered table. Because the summary is computed from the
global table, every process logs identical numbers, and sums are exact (not means of per-process means).

Definitions (symbols of ``docs/method.md``; ``c_it`` from :func:`respo_trl.kernels.gradient_coefficients`):

* ``grad_throughput/{pos,neg} = sum_i |A_i| sum_t m_it c_it / sum_i |A_i| L_i`` over sequences with ``A > 0`` / ``< 0``:
  the share of on-policy gradient mass the loss lets through. 1 on-policy.
* ``clip_grad_throughput`` is the same for TRL's default token-clipped loss (``dapo``, epsilon from the config) on the
  same batch: the counterfactual the ReSPO gain is measured against.
* ``starved_frac/{pos,neg}``: fraction of sequences whose mean coefficient ``sum_t m c / L`` is below 0.1.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .kernels import (
    LOG_RATIO_CLAMP,
    LossParams,
    gradient_coefficients,
    kish_ess,
    normalization_scale,
    respo_kernel,
    sequence_log_ratio,
)

Tensor = torch.Tensor

STARVED_BELOW = 0.1  # a sequence is "starved" when its mean coefficient is below this

# Columns of the per-sequence table returned by `sequence_stats`.
COLUMNS = ("valid", "advantage", "length", "mass", "clip_mass", "log_weight", "s", "norm_T", "phi")
_COL = {name: i for i, name in enumerate(COLUMNS)}

# Losses whose per-token loss TRL multiplies by the vLLM importance-sampling ratio afterwards; the sequence kernels
# (vespo, respo) fold that ratio into their weight instead.
SEQUENCE_KERNEL_LOSSES = ("vespo", "respo", "is_seq")


def sequence_stats(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: LossParams,
    loss_name: str,
    *,
    is_ratio: Tensor | None = None,
    gather=None,
) -> Tensor:
    """One row per sequence with the :data:`COLUMNS` needed by :func:`summarize` (float32, shape (B, 9)).

    ``log_ratio`` = ``log pi_theta - log pi_old`` (B, T); ``is_ratio`` is TRL's vLLM ``importance_sampling_ratio`` in a
    token mode (B, T), or ``None``. ``loss_name`` is a key of :data:`respo_trl.kernels.POLICY_LOSSES`.
    """
    with torch.no_grad():
        mask_f = mask.float()
        log_ratio = log_ratio.detach().float()
        adv = advantages.detach().float().reshape(-1)
        log_is, seq_log_is = None, 0.0
        if is_ratio is not None:  # token modes (B, T) enter the token sum; sequence modes (B, 1) the sequence weight
            log_isr = torch.log(is_ratio.float()).clamp(min=-LOG_RATIO_CLAMP)
            if is_ratio.shape[-1] == 1:
                seq_log_is = log_isr.squeeze(-1)
            else:
                log_is = log_isr

        def mass(name: str, loss_params: LossParams) -> Tensor:
            if name in SEQUENCE_KERNEL_LOSSES:
                c = gradient_coefficients(name, log_ratio, adv, mask, loss_params, log_is_ratio=log_is, gather=gather)
            else:
                c = gradient_coefficients(name, log_ratio, adv, mask, loss_params)
                if is_ratio is not None:
                    c = c * is_ratio.float()
            return (c * mask_f).sum(-1)

        clip_params = dataclasses.replace(params, importance_sampling_level="token")
        l, lengths = sequence_log_ratio(log_ratio, mask, log_is)
        l = l + seq_log_is
        scale = normalization_scale(l, lengths, params.respo_norm, params.respo_rho_min, gather)
        s = (l / scale).nan_to_num(0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        phi = respo_kernel(
            s, adv, params.respo_alpha_pos, params.respo_lambda_pos, params.respo_alpha_neg, params.respo_lambda_neg
        )
        columns = {
            "valid": (lengths > 0).float(),
            "advantage": adv,
            "length": lengths,
            "mass": mass(loss_name, params),
            "clip_mass": mass("ppo", clip_params),
            "log_weight": l,
            "s": s,
            "norm_T": scale.clamp(max=torch.finfo(torch.float32).max),
            "phi": phi,
        }
        return torch.stack([columns[name] for name in COLUMNS], dim=-1)


def summarize(table: Tensor) -> dict[str, float]:
    """Metrics of spec section 4 from a (gathered) :func:`sequence_stats` table. NaN where a group is empty."""
    table = table.float()
    col = {name: table[:, i] for name, i in _COL.items()}
    valid = col["valid"] > 0
    adv, length = col["advantage"], col["length"]
    metrics: dict[str, float] = {}

    for sign, selected in (("pos", valid & (adv > 0)), ("neg", valid & (adv < 0))):
        weight = adv[selected].abs()
        on_policy_mass = (weight * length[selected]).sum()
        for key, column in (("grad_throughput", "mass"), ("clip_grad_throughput", "clip_mass")):
            metrics[f"starvation/{key}/{sign}"] = _ratio((weight * col[column][selected]).sum(), on_policy_mass)
        mean_coef = col["mass"][selected] / length[selected]
        clip_mean_coef = col["clip_mass"][selected] / length[selected]
        metrics[f"starvation/starved_frac/{sign}"] = _mean((mean_coef < STARVED_BELOW).float())
        metrics[f"starvation/clip_starved_frac/{sign}"] = _mean((clip_mean_coef < STARVED_BELOW).float())
        metrics[f"respo/phi_mean/{sign}"] = _mean(col["phi"][selected])

    log_w = col["log_weight"][valid]
    metrics["offpolicy/log_weight/mean"] = _mean(log_w)
    metrics["offpolicy/log_weight/std"] = log_w.std().item() if log_w.numel() > 1 else math.nan
    metrics["offpolicy/log_weight/min"] = log_w.min().item() if log_w.numel() else math.nan
    metrics["offpolicy/log_weight/max"] = log_w.max().item() if log_w.numel() else math.nan
    metrics["offpolicy/ess"] = kish_ess(log_w).item() if log_w.numel() else math.nan
    metrics["offpolicy/ess_normalized"] = kish_ess(col["s"][valid]).item() if log_w.numel() else math.nan
    metrics["respo/norm_T"] = _mean(col["norm_T"][valid])
    return metrics


def _mean(x: Tensor) -> float:
    return x.mean().item() if x.numel() else math.nan


def _ratio(num: Tensor, den: Tensor) -> float:
    return (num / den).item() if den > 0 else math.nan
