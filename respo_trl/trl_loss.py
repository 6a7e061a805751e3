"""ReSPO's loss in TRL's shape, as a function of tensors, and the two TRL pieces around it that it must reproduce.

TRL 1.16's ``GRPOTrainer._compute_loss`` has no loss hook, so for ``loss_type="respo"`` the trainer
(:mod:`respo_trl.trainer`) computes the loss itself with :func:`respo_grpo_loss`: what TRL's ``vespo`` branch computes,
with ReSPO's coefficient in place of VESPO's. The per-token loss is ``-c_it * A_i * log pi_theta(y_it)`` with a
detached ``c`` (:func:`respo_trl.kernels.respo_weights`, the sampler correction folded into ``W`` and never multiplied
again), times TRL's entropy and off-policy masks, plus TRL's KL term, summed over the loss tokens and divided by TRL's
``dapo`` normaliser. The trainer adds TRL's entropy bonus (:func:`trl_entropy_bonus`) and
MoE auxiliary loss around it, and logs TRL's metrics. ``tests/test_gradients.py`` holds it to TRL: a ReSPO loss whose
branches are both VESPO's trains exactly as ``trl.GRPOTrainer(loss_type="vespo")`` in every combination of those
terms, so a TRL release that changes its loss shows up there. Every other ``loss_type`` runs TRL's
``_compute_loss`` untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .kernels import LossParams, ReSPOWeights, respo_weights


def drop_nonfinite(inputs: dict) -> tuple[dict, torch.Tensor]:
    """``(inputs, dropped)``: every sequence whose advantage, stored log-probs or sampler ratio is NaN/inf on a loss
    token is masked out of the loss (through TRL's loss-only ``tool_mask``, keeping its tool-call zeros), and the
    non-finite values of the kept rows (padding) are filled, so the loss is never NaN; ``dropped`` is (B,) bool."""
    mask = inputs["completion_mask"].bool()
    advantages = inputs["advantages"]
    bad = ~torch.isfinite(advantages.reshape(advantages.shape[0], -1)).all(-1)
    fills = {"old_per_token_logps": 0.0, "ref_per_token_logps": 0.0, "importance_sampling_ratio": 1.0}
    for key in fills:
        value = inputs.get(key)
        if value is not None:
            bad = bad | (~torch.isfinite(value) & mask).any(-1)
    if not bad.any():
        return inputs, bad
    inputs = dict(inputs)
    keep = ~bad
    inputs["advantages"] = torch.where(keep.reshape(-1, *[1] * (advantages.dim() - 1)), advantages, 0.0)
    for key, fill in fills.items():
        if inputs.get(key) is not None:
            value = inputs[key]
            inputs[key] = torch.where(keep.unsqueeze(-1) & torch.isfinite(value), value, fill)
    loss_mask = inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
    inputs["tool_mask"] = loss_mask * keep.unsqueeze(-1).to(loss_mask.dtype)  # TRL's loss-only mask
    return inputs, bad


@dataclass
class LossForward:
    """What one ``_compute_loss`` call computed, for the diagnostics and the first-pass weight: the rows it counts as
    0 (``dropped``, with any non-finite value: TRL's loss still multiplies a dropped row's terms by 0, and a forward
    that underflowed would make that NaN), the (log-probs, entropies) of its forward, detached and cleaned once
    (:meth:`clean`), TRL's masks (``token_weight``) and, under ReSPO's loss, its weights."""

    dropped: torch.Tensor
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    token_weight: torch.Tensor | None = None
    weights: ReSPOWeights | None = None

    def clean(self, logps: torch.Tensor) -> torch.Tensor:
        if self.dropped.shape[0] != logps.shape[0]:
            return logps
        return torch.where(~torch.isfinite(logps) | self.dropped.unsqueeze(-1).to(logps.device), 0.0, logps)


class ReSPOLoss(NamedTuple):
    """The loss of one micro-batch and what it applied, for the diagnostics and the first-pass weight."""

    loss: torch.Tensor  # scalar, differentiable: the policy term (and TRL's KL term), aggregated
    weights: ReSPOWeights  # the coefficients, log W and phi of this forward (detached)
    per_token_kl: torch.Tensor | None  # TRL's k3 KL to the reference model, where beta != 0


def respo_grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: LossParams,
    *,
    normalizer: torch.Tensor | float,
    sampler_ratio: torch.Tensor | None = None,
    kept_log_w: torch.Tensor | None = None,
    token_weight: torch.Tensor | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    kl_correction: str | None = None,
) -> ReSPOLoss:
    """TRL 1.16's ``_compute_loss`` on its ``vespo`` branch with ReSPO's coefficient (spec section 2).

    ``logps`` (B, T): the loss forward's per-token log-probabilities (finite: the trainer cleans them once);
    ``old_logps``: the sampling policy's (None on-policy, where TRL takes ``logps`` detached); ``advantages`` (B,)
    or (B, T); ``mask``: the loss tokens (TRL's completion mask times its tool mask); ``normalizer``: TRL's ``dapo``
    denominator for this micro-batch; ``sampler_ratio``: TRL's vLLM importance-sampling ratio, folded into ``W``;
    ``kept_log_w`` (B,): the first-pass ``log W`` ``respo_epoch_weight="first_pass"`` keeps (NaN: use the current);
    ``token_weight``: TRL's entropy and off-policy masks, multiplied into the policy term; ``beta``, ``ref_logps``
    and ``kl_correction`` (None, ``"token"`` or ``"sequence"``: TRL's ``use_bias_correction_kl`` at its
    ``importance_sampling_level``): TRL's KL term.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    weights = respo_weights(log_ratio, advantages, mask, params, sampler_ratio=sampler_ratio, log_w=kept_log_w)
    per_token_loss = -weights.coefficients * advantages * logps
    if token_weight is not None:
        per_token_loss = per_token_loss * token_weight
    per_token_kl = None
    if beta != 0.0:
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if kl_correction == "sequence":  # TRL's sequence-level importance weight: the masked mean log-ratio
            level = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
            per_token_kl = per_token_kl * torch.exp(level)
        elif kl_correction == "token":
            per_token_kl = per_token_kl * torch.exp(log_ratio)
        per_token_loss = per_token_loss + beta * per_token_kl
    return ReSPOLoss((per_token_loss * mask).sum() / normalizer, weights, per_token_kl)


def trl_entropy_bonus(entropies, mask, entropy_mask, *, coef: float, window, last_world_entropy: float, args,
                      adaptive: bool, train: bool, accumulation: float, sync_gradients: bool, reduce):  # fmt: skip
    """TRL 1.16's entropy bonus, the term its ``_compute_loss`` adds to the loss, and its adaptive coefficient.

    The term is ``-coef`` times the mean entropy over the loss tokens (and TRL's entropy mask), scaled for gradient
    accumulation like the policy loss; under ``use_adaptive_entropy`` the coefficient applied is the one from the end
    of the previous optimizer step, and 0 while the last step's entropy over all processes was above
    ``entropy_target``. TRL keeps the adaptive state on the trainer (``entropy_coef``, ``_entropy_window_stats``,
    ``_last_world_entropy``): it comes in as ``coef``, ``window``, ``last_world_entropy`` and goes out updated, the
    window's entropy summed (``reduce``) and the coefficient moved by ``entropy_coef_delta`` within
    [``entropy_coef_min``, ``entropy_coef_max``] once per optimizer step (``sync_gradients``).
    Returns ``(term, coef, window, last_world_entropy)``."""
    effective_mask = mask if entropy_mask is None else mask * entropy_mask
    mean_entropy = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
    applied = coef if not adaptive or last_world_entropy <= args.entropy_target else 0.0
    if adaptive and train:
        stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
        window = stats if window is None else window + stats
        if sync_gradients:
            totals = reduce(window)
            last_world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
            if last_world_entropy <= args.entropy_target:
                coef = min(coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                coef = max(coef - args.entropy_coef_delta, args.entropy_coef_min)
            window = None
    return -applied * mean_entropy, coef, window, last_world_entropy