"""ReSPO's math as pure torch functions, and the policy losses it is compared with.

Nothing here imports TRL: the functions take tensors and numbers and can be used from any RL framework or notebook.
Symbols follow ``docs/method.md``:

* ``rho_it = clamp(log pi_theta(y_it) - log mu(y_it), -20, 20)``  token log-ratio against the behaviour policy ``mu``
* ``l_i = sum_t m_it rho_it``, ``L_i = sum_t m_it``                 sequence log-weight and length
* ``s_i = clamp(l_i / T_i, -20, 20)``                              normalised sequence log-weight
* ``phi(w) = w^alpha * exp(lam * (1 - w))``, ``w = exp(s)``         the two-branch ReSPO kernel (branch = sign of A)

Every policy loss in :data:`POLICY_LOSSES` returns a per-token loss ``ell_it`` with the convention

    d (sum_t m_it ell_it) / d rho_it = -A_i * c_it,     c_it = 1 on-policy,

so ``c_it`` is the loss's *effective coefficient* on ``A_i * grad log pi_theta(y_it)`` relative to the plain policy
gradient. :func:`gradient_coefficients` recovers ``c`` from any registered loss by autograd; the starvation
diagnostics are built on it. The trainer applies TRL's aggregation (token sum over the global token count for
``dapo``/``respo``) on top of these per-token losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

Tensor = torch.Tensor
Gather = Optional[Callable[[Tensor], Tensor]]

LOG_RATIO_CLAMP = 20.0  # |rho_it| and |s_i| are clamped here (spec section 2)
NORM_MODES = ("none", "mean", "sqrt", "ess")


# --------------------------------------------------------------------------------------------------------------------
# Sequence log-weights and their normalisation
# --------------------------------------------------------------------------------------------------------------------


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor, log_is_ratio: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Return ``(l, L)``: the masked sum of clamped token log-ratios and the sequence length, both of shape (B,).

    ``log_is_ratio`` (B, T) is the log of a sampler-correction ratio (TRL's vLLM ``importance_sampling_ratio``,
    token modes): adding it makes the weight ``pi_theta / pi_sampler`` instead of ``pi_theta / pi_old``.
    Masked positions never contribute, even when they hold NaN or inf.
    """
    mask = mask.bool()
    rho = log_ratio.float()
    if log_is_ratio is not None:
        rho = rho + log_is_ratio.float()
    rho = rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.where(mask, rho, 0.0)  # also drops NaN at masked positions
    return rho.sum(-1), mask.sum(-1).to(rho.dtype)


def normalization_scale(
    l: Tensor, lengths: Tensor, norm: str = "sqrt", rho_min: float = 0.5, gather: Gather = None
) -> Tensor:
    """The divisor ``T_i`` of the sequence log-weight ``s_i = l_i / T_i`` (shape (B,)).

    * ``none``: ``T_i = 1``, the true product ratio (VESPO).
    * ``mean``: ``T_i = L_i``, the geometric mean of the token ratios (GSPO).
    * ``sqrt``: ``T_i = sqrt(L_i)``; under independent token log-ratios the spread of ``l_i`` grows like ``sqrt(L_i)``,
      so this keeps long and short sequences on one scale.
    * ``ess``: one ``T = max(1, std(l) / sqrt(-log rho_min))`` for the whole (gathered) micro-batch. If ``s`` is
      normal with standard deviation ``sigma``, the normalised Kish ESS of ``exp(s)`` is ``exp(-sigma^2)``; this ``T``
      keeps it at least ``rho_min``. ``T = 1`` with fewer than two non-empty sequences.

    ``gather`` (e.g. ``accelerator.gather``) collects ``l`` from every process for the ``ess`` statistics; every
    process then uses the same ``T``.
    """
    if norm == "none":
        return torch.ones_like(l)
    if norm == "mean":
        return lengths.clamp(min=1.0)
    if norm == "sqrt":
        return lengths.clamp(min=1.0).sqrt()
    if norm == "ess":
        if not 0.0 < rho_min <= 1.0:
            raise ValueError(f"rho_min must be in (0, 1], got {rho_min}")
        stats = torch.stack([l.float(), (lengths > 0).float()], dim=-1)
        if gather is not None:
            stats = gather(stats)
        valid_l = stats[:, 0][stats[:, 1] > 0]
        if valid_l.numel() < 2:
            return torch.ones_like(l)
        sigma = valid_l.std()
        budget = math.sqrt(-math.log(rho_min))
        if budget == 0.0:  # rho_min == 1: only exactly equal weights have ESS 1, so flatten them all
            scale = torch.where(sigma > 0, torch.full_like(sigma, math.inf), torch.ones_like(sigma))
        else:
            scale = (sigma / budget).clamp(min=1.0)
        return scale.expand_as(l).clone()
    raise ValueError(f"Unknown normalization {norm!r}; expected one of {NORM_MODES}")


def sequence_log_weights(
    log_ratio: Tensor,
    mask: Tensor,
    norm: str = "sqrt",
    rho_min: float = 0.5,
    log_is_ratio: Tensor | None = None,
    gather: Gather = None,
) -> Tensor:
    """Normalised sequence log-weights ``s_i = clamp(l_i / T_i, -20, 20)`` of shape (B,), detached.

    ``log_ratio`` and ``mask`` are (B, T); see :func:`normalization_scale` for ``norm`` and ``rho_min``.
    An empty sequence (all-zero mask) gets ``s = 0``.
    """
    with torch.no_grad():
        l, lengths = sequence_log_ratio(log_ratio.detach(), mask, log_is_ratio)
        scale = normalization_scale(l, lengths, norm, rho_min, gather)
        return (l / scale).nan_to_num(0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# --------------------------------------------------------------------------------------------------------------------
# The two-branch kernel
# --------------------------------------------------------------------------------------------------------------------


def log_phi(s: Tensor, alpha: Tensor | float, lam: Tensor | float) -> Tensor:
    """``log phi(w) = alpha * log w + lam * (1 - w)`` with ``log w = s`` (so ``phi(1) = 1``)."""
    return alpha * s + lam * (1.0 - torch.exp(s))


def respo_kernel(
    s: Tensor,
    advantages: Tensor,
    alpha_pos: float = 0.5,
    lam_pos: float = 0.5,
    alpha_neg: float = 2.0,
    lam_neg: float = 2.0,
) -> Tensor:
    """ReSPO's gradient scale ``phi_i`` (detached), with the branch chosen by the sign of ``A_i``.

    ``phi(w) = w^alpha * exp(lam * (1 - w))``: ``(alpha_pos, lam_pos)`` for ``A >= 0`` and ``(alpha_neg, lam_neg)``
    for ``A < 0``. ``s`` and ``advantages`` broadcast against each other ((B,) or (B, 1)). ``phi`` is computed in log
    space and is finite for every finite ``s`` (it underflows to 0 for ``s -> +-inf`` whenever the branch has a
    positive ``alpha`` or ``lam``).
    """
    with torch.no_grad():
        s = s.to(torch.promote_types(s.dtype, torch.float32))  # bf16 in, fp32 math; fp64 stays fp64
        positive = advantages >= 0
        alpha = torch.where(positive, alpha_pos, alpha_neg)
        lam = torch.where(positive, lam_pos, lam_neg)
        return torch.exp(log_phi(s, alpha, lam)).nan_to_num(0.0, posinf=0.0, neginf=0.0)


def kernel_sup(alpha: float, lam: float) -> tuple[float, float]:
    """``(sup_w phi(w), argmax_w)``: ``exp(lam - alpha) (alpha/lam)^alpha`` at ``w = alpha/lam`` (spec section 2).

    With ``lam = 0`` and ``alpha > 0`` the kernel is the unbounded power ``w^alpha`` (returns ``inf``).
    """
    if lam == 0.0:
        return (math.inf, math.inf) if alpha > 0 else (1.0, math.nan)
    if alpha == 0.0:
        return math.exp(lam), 0.0  # phi = exp(lam (1 - w)) decreases from exp(lam) at w = 0
    w_star = alpha / lam
    return math.exp(lam - alpha) * w_star**alpha, w_star


# --------------------------------------------------------------------------------------------------------------------
# Policy losses behind one registry
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossParams:
    """Hyper-parameters of every registered loss, named as in TRL's ``GRPOConfig`` / ``ReSPOConfig``."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    respo_alpha_pos: float = 0.5
    respo_lambda_pos: float = 0.5
    respo_alpha_neg: float = 2.0
    respo_lambda_neg: float = 2.0
    respo_norm: str = "sqrt"
    respo_rho_min: float = 0.5

    @classmethod
    def from_config(cls, args) -> "LossParams":
        """Read the fields from a ``GRPOConfig``-like object (``epsilon`` is TRL's name for ``epsilon_low``)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if hasattr(args, "epsilon"):
            values["epsilon_low"] = args.epsilon
        if getattr(args, "epsilon_high", None) is None:
            values["epsilon_high"] = values.get("epsilon_low", cls.epsilon_low)
        return cls(**values)


PolicyLoss = Callable[..., Tensor]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register ``fn(log_ratio, advantages, mask, params, *, log_is_ratio=None, gather=None) -> per_token_loss``."""

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"Unknown policy loss {name!r}; registered: {sorted(POLICY_LOSSES)}") from None


def _column(advantages: Tensor) -> Tensor:
    return advantages.reshape(-1, 1) if advantages.dim() == 1 else advantages


def _level_log_weights(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """Token log-ratios (B, T) or, at ``sequence`` level, their masked mean broadcast to (B, T) (GSPO)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        mask = mask.to(log_ratio.dtype)
        mean = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        return mean.expand_as(log_ratio)
    raise ValueError(f"Unknown importance_sampling_level {level!r}; expected 'token' or 'sequence'")


def _ppo_clip(log_ratio: Tensor, advantages: Tensor, params: LossParams, level: str) -> Tensor:
    # PPO surrogate, as TRL's grpo/dapo: -min(w A, clip(w, 1-eps_low, 1+eps_high) A); optional two-sided cap `delta`.
    a = _column(advantages)
    w = torch.exp(log_ratio)
    w_clipped = torch.clamp(w, 1 - params.epsilon_low, 1 + params.epsilon_high)
    if params.delta is not None:
        w = torch.clamp(w, max=params.delta)
    return -torch.min(w * a, w_clipped * a)


@register_policy_loss("ppo")
def ppo_loss(log_ratio, advantages, mask, params, *, log_is_ratio=None, gather=None):
    """Clipped PPO/GRPO at ``params.importance_sampling_level`` (TRL ``grpo``/``bnpo``/``dr_grpo``/``dapo``)."""
    weights = _level_log_weights(log_ratio, mask, params.importance_sampling_level)
    return _ppo_clip(weights, advantages, params, params.importance_sampling_level)


@register_policy_loss("gspo")
def gspo_loss(log_ratio, advantages, mask, params, *, log_is_ratio=None, gather=None):
    """GSPO: the PPO clip applied to the geometric-mean sequence ratio ``w_i``, repeated on each of its tokens.

    Summed over the ``L_i`` tokens, the mean's ``1 / L_i`` cancels, so ``c_it = w_i`` inside the clip range: the same
    relative coefficient as TRL's ``importance_sampling_level='sequence'`` with ``loss_type='grpo'``.
    """
    return _ppo_clip(_level_log_weights(log_ratio, mask, "sequence"), advantages, params, "sequence")


@register_policy_loss("cispo")
def cispo_loss(log_ratio, advantages, mask, params, *, log_is_ratio=None, gather=None):
    """CISPO (MiniMax-M1): ``-min(w, eps_high).detach() * A * log pi``; the clipped weight scales, never zeroes."""
    weights = _level_log_weights(log_ratio, mask, params.importance_sampling_level)
    clamped = torch.clamp(torch.exp(weights), max=params.epsilon_high).detach()
    return -clamped * _column(advantages) * log_ratio


@register_policy_loss("sapo")
def sapo_loss(log_ratio, advantages, mask, params, *, log_is_ratio=None, gather=None):
    """SAPO: a sigmoid gate ``4/tau * sigmoid(tau (w - 1))`` instead of the hard clip (TRL ``sapo``)."""
    a = _column(advantages)
    w = torch.exp(_level_log_weights(log_ratio, mask, params.importance_sampling_level))
    tau = torch.where(a > 0, params.sapo_temperature_pos, params.sapo_temperature_neg)
    return -torch.sigmoid(tau * (w - 1)) * 4 / tau * a


@register_policy_loss("is")
def token_is_loss(log_ratio, advantages, mask, params, *, log_is_ratio=None, gather=None):
    """Plain token-level importance sampling, ``-w_it A_i``: PPO with the clip removed."""
    return -torch.exp(log_ratio) * _column(advantages)


@register_policy_loss("is_seq")
def sequence_is_loss(log_ratio, advantages, mask, params, *, log_is_ratio=None, gather=None):
    """Exact sequence importance sampling: ``phi_i = exp(l_i)`` (unbiased, unbounded variance)."""
    l, _ = sequence_log_ratio(log_ratio.detach(), mask, log_is_ratio)
    phi = torch.exp(l.clamp(max=LOG_RATIO_CLAMP)).unsqueeze(-1)
    return -phi * _column(advantages) * log_ratio


def vespo_phi(log_ratio, advantages, mask, params: LossParams, log_is_ratio: Tensor | None = None) -> Tensor:
    """VESPO's sequence weight as in TRL 1.16: the same kernel family on the raw product ratio (``norm='none'``),
    ``(k, lambda)`` per sign, with the log-weight clamped below at ``log 1e-8`` as TRL does."""
    l, _ = sequence_log_ratio(log_ratio.detach(), mask, log_is_ratio)
    s = l.clamp(math.log(1e-8), LOG_RATIO_CLAMP)
    a = advantages.reshape(-1)
    return respo_kernel(
        s, a, params.vespo_k_pos, params.vespo_lambda_pos, params.vespo_k_neg, params.vespo_lambda_neg
    )


@register_policy_loss("vespo")
def vespo_loss(log_ratio, advantages, mask, params, *, log_is_ratio=None, gather=None):
    """VESPO: ``-phi(W_i).detach() * A_i * log pi`` with the gamma kernel on the sequence product ratio."""
    phi = vespo_phi(log_ratio, advantages, mask, params, log_is_ratio).unsqueeze(-1)
    return -phi * _column(advantages) * log_ratio


def respo_phi(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: LossParams,
    log_is_ratio: Tensor | None = None,
    gather: Gather = None,
) -> Tensor:
    """ReSPO's per-sequence scale ``phi_i`` (B,), detached: normalise (``params.respo_norm``), then the kernel."""
    s = sequence_log_weights(log_ratio, mask, params.respo_norm, params.respo_rho_min, log_is_ratio, gather)
    return respo_kernel(
        s,
        advantages.reshape(-1),
        params.respo_alpha_pos,
        params.respo_lambda_pos,
        params.respo_alpha_neg,
        params.respo_lambda_neg,
    )


@register_policy_loss("respo")
def respo_loss(log_ratio, advantages, mask, params, *, log_is_ratio=None, gather=None):
    """ReSPO: ``-phi_i * A_i * log pi_theta(y_it)``, ``phi_i`` detached (spec section 2)."""
    phi = respo_phi(log_ratio, advantages, mask, params, log_is_ratio, gather).unsqueeze(-1)
    return -phi * _column(advantages) * log_ratio


# TRL `loss_type` -> registered loss whose per-token coefficient it applies. (TRL's aggregation differs between
# grpo/bnpo/dr_grpo/dapo, but the importance-weight coefficient relative to on-policy is the same.)
TRL_LOSS_TYPES = {
    "grpo": "ppo",
    "bnpo": "ppo",
    "dr_grpo": "ppo",
    "dapo": "ppo",
    "luspo": "ppo",
    "cispo": "cispo",
    "sapo": "sapo",
    "vespo": "vespo",
    "respo": "respo",
}


def registered_loss_for(loss_type: str) -> str:
    """The registry name implementing TRL's ``loss_type`` coefficient (``ppo`` for the clipped family)."""
    if loss_type in POLICY_LOSSES:
        return loss_type
    try:
        return TRL_LOSS_TYPES[loss_type]
    except KeyError:
        raise ValueError(f"No registered policy loss for loss_type {loss_type!r}") from None


def gradient_coefficients(
    name: str,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: LossParams = LossParams(),
    *,
    log_is_ratio: Tensor | None = None,
    gather: Gather = None,
) -> Tensor:
    """Effective coefficients ``c_it`` (B, T) of a registered loss, by differentiating it w.r.t. ``rho_it``.

    ``c_it = -(d sum_t m_it ell_it / d rho_it) / sign(A_i)``, evaluated with unit advantages of the same sign (every
    registered loss is linear in ``|A|`` within a sign), so ``c`` is defined for ``A = 0`` too (positive branch).
    Masked positions get 0.
    """
    loss_fn = get_policy_loss(name)
    sign = torch.where(advantages.reshape(-1) >= 0, 1.0, -1.0).to(log_ratio.device)
    with torch.enable_grad():
        rho = log_ratio.detach().float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        rho = torch.where(mask.bool(), rho, torch.zeros_like(rho)).requires_grad_(True)
        per_token = loss_fn(rho, sign, mask, params, log_is_ratio=log_is_ratio, gather=gather)
        total = (per_token * mask.to(per_token.dtype)).sum()
        (grad,) = torch.autograd.grad(total, rho)
    return (-grad / sign.unsqueeze(-1)).nan_to_num(0.0) * mask.to(grad.dtype)


def kish_ess(log_w: Tensor) -> Tensor:
    """Normalised Kish effective sample size ``(sum w)^2 / (n sum w^2)`` in ``(0, 1]``, stable in log space."""
    log_w = log_w.float().reshape(-1)
    if log_w.numel() == 0:
        return torch.tensor(float("nan"))
    shifted = log_w - log_w.max()
    return torch.exp(2 * torch.logsumexp(shifted, 0) - torch.logsumexp(2 * shifted, 0)) / log_w.numel()
