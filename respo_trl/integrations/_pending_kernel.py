"""TEMPORARY stand-in for the version-2 kernel API that is landing on ``main`` (``respo_trl.kernels`` /
``respo_trl.diagnostics``). It exists only so the verl integration can be written and tested before that merge, and
is deleted once ``main`` provides the same names. Do not import it from anywhere but ``integrations/verl.py``."""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

RESPO_DEFAULTS = {"alpha_pos": 2.0, "beta_pos": 0.5, "lam_pos": 2.0, "alpha_neg": 1.0, "beta_neg": 0.5, "lam_neg": 2.0}
LOG_W_CLAMP = 20.0


def validate_respo_constants(**constants: float) -> None:
    for name, value in constants.items():
        if name not in RESPO_DEFAULTS:
            raise ValueError(f"unknown ReSPO constant {name!r}; known: {sorted(RESPO_DEFAULTS)}")
        value = float(value)
        if name.startswith("alpha") and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
        if name.startswith("beta") and not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
        if name.startswith("lam") and not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def sequence_log_weight(log_ratio: Tensor, mask: Tensor, log_sampler_ratio: Tensor | None = None) -> Tensor:
    m = mask.to(log_ratio.dtype)
    total = log_ratio * m
    if log_sampler_ratio is not None:
        total = total + log_sampler_ratio * m
    total = torch.where(m > 0, total, torch.zeros_like(total)).sum(-1)
    return total.clamp(-LOG_W_CLAMP, LOG_W_CLAMP)


def _phi(log_w: Tensor, alpha: float, beta: float, lam: float) -> Tensor:
    if alpha == 1.0:
        phi0 = torch.exp(beta * log_w)
    else:
        p = alpha - 1.0
        phi0 = ((1.0 - beta) + beta * torch.exp(p * log_w)) ** (1.0 / p)
    return phi0 * torch.exp(lam * (1.0 - phi0))


def respo_kernel(log_w, advantages, alpha_pos=2.0, beta_pos=0.5, lam_pos=2.0, alpha_neg=1.0, beta_neg=0.5,
                 lam_neg=2.0) -> Tensor:
    validate_respo_constants(alpha_pos=alpha_pos, beta_pos=beta_pos, lam_pos=lam_pos, alpha_neg=alpha_neg,
                             beta_neg=beta_neg, lam_neg=lam_neg)
    if log_w.shape != advantages.shape:
        raise ValueError(f"log_w {tuple(log_w.shape)} and advantages {tuple(advantages.shape)} must match")
    with torch.no_grad():
        lw = log_w.detach().to(torch.promote_types(log_w.dtype, torch.float32)).clamp(-LOG_W_CLAMP, LOG_W_CLAMP)
        pos = _phi(lw, alpha_pos, beta_pos, lam_pos)
        neg = _phi(lw, alpha_neg, beta_neg, lam_neg)
        phi = torch.where(advantages >= 0, pos, neg)
        return phi.nan_to_num(0.0, posinf=0.0, neginf=0.0)


def positive_low_weight_stats(log_w: Tensor, phi: Tensor, advantages: Tensor, valid: Tensor) -> dict[str, float]:
    pos = (advantages >= 0) & valid.bool()
    low = pos & (log_w < -1.0)
    n_pos = int(pos.sum())
    share = float(low.sum()) / n_pos if n_pos else math.nan
    mass = float(phi[pos].sum())
    mass_share = float(phi[low].sum()) / mass if mass > 0 else math.nan
    ratio = mass_share / share if share and share == share and mass_share == mass_share else math.nan
    return {"low_weight_share": share, "low_weight_mass_share": mass_share, "low_weight_mass_ratio": ratio}
