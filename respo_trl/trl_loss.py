"""One micro-batch's loss in TRL's shape: ReSPO's computed here as a function of tensors, or TRL's own, aggregated and
measured the way TRL's ``GRPOTrainer._compute_loss`` does it.

TRL 1.16's ``_compute_loss`` has no loss hook, so :mod:`respo_trl.trainer` makes one call per micro-batch,
:func:`micro_batch_loss`, with the micro-batch and :class:`TrlContext` (TRL's settings, its forward, its mask helpers,
its own ``_compute_loss`` and the collectives, read off the trainer) and gets back a frozen :class:`LossResult`:
``(loss, weights, metrics)``, as verl's ``PolicyLossFn`` returns ``(loss, metrics)`` and aggregates itself.

For ``loss_type="respo"`` the loss is what TRL's ``vespo`` branch computes, with ReSPO's coefficient in place of
VESPO's (:func:`respo_grpo_loss`): the per-token loss ``-c_it * A_i * log pi_theta(y_it)`` with a detached ``c``
(:func:`respo_trl.kernels.respo_weights`, the sampler correction folded into ``W`` and never multiplied again), times
TRL's entropy and off-policy masks (:func:`trl_token_masks`), plus TRL's KL term, summed over the loss tokens and
divided by TRL's ``dapo`` normaliser (:func:`dapo_normalizer`); then TRL's entropy bonus (:func:`trl_entropy_bonus`)
and MoE auxiliary loss, and TRL's metrics. ``tests/test_gradients.py`` holds it to TRL: a ReSPO loss whose branches are
both VESPO's trains exactly as ``trl.GRPOTrainer(loss_type="vespo")`` in every combination of those terms, so a TRL
release that changes its loss shows up there. Every other ``loss_type`` runs TRL's ``_compute_loss`` untouched.
Either way ReSPO's diagnostics (:func:`respo_trl.diagnostics.step_metrics`) come from the loss forward's cleaned
log-probabilities and, under ReSPO, the weights the loss applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .buffer import FIRST_LOG_W_KEY, STALENESS_KEY
from .diagnostics import sampler_gap_warning, step_metrics
from .kernels import FOLDS_SAMPLER_RATIO, LossParams, ReSPOWeights, respo_weights


def loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens a loss counts: TRL's completion mask times its loss-only tool mask (tool-call tokens, dropped rows)."""
    return inputs["completion_mask"] * inputs.get("tool_mask", 1)


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


class ReSPOLoss(NamedTuple):
    """The loss of one micro-batch and what it applied, for the diagnostics and the first-pass weight."""

    loss: torch.Tensor  # scalar, differentiable: the policy term (and TRL's KL term), aggregated
    weights: ReSPOWeights  # the coefficients, log W and phi of this forward (detached)
    per_token_kl: torch.Tensor | None  # TRL's k3 KL to the reference model, where beta != 0


def clean_logps(logps: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """The loss forward's per-token log-probabilities with a dropped row's and every non-finite value set to 0: TRL's
    loss multiplies a dropped row's terms by 0, and a forward that underflowed would make that NaN."""
    if dropped.shape[0] != logps.shape[0]:
        return logps
    return torch.where(~torch.isfinite(logps) | dropped.unsqueeze(-1).to(logps.device), 0.0, logps)


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

    ``logps`` (B, T): the loss forward's per-token log-probabilities, finite (:func:`clean_logps`);
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

class EntropyState(NamedTuple):
    """TRL's adaptive entropy-bonus state, which TRL keeps on the trainer (``entropy_coef``,
    ``_entropy_window_stats``, ``_last_world_entropy``): in through :class:`TrlContext`, out through
    :class:`LossResult`."""

    coef: float
    window: torch.Tensor | None
    last_world_entropy: float


@dataclass(frozen=True)
class TrlContext:
    """TRL's side of one micro-batch's loss, read off the trainer that owns it: its settings, its forward and mask
    helpers, its own ``_compute_loss`` and the collectives. The loss changes none of it."""

    loss_type: str
    params: LossParams
    loss_name: str  # the registered loss whose coefficient ``loss_type`` applies (the diagnostics')
    forward: Callable[..., tuple]  # TRL's ``_get_per_token_logps_and_entropies`` on the training model
    trl_loss: Callable[[dict, torch.Tensor], tuple]  # TRL's ``_compute_loss``: (inputs, dropped) -> (loss, logps, entropies)
    training: bool
    accumulation: int  # TRL's current_gradient_accumulation_steps (1 in evaluation)
    steps_per_generation: int
    num_processes: int
    beta: float
    kl_correction: str | None  # TRL's ``use_bias_correction_kl`` at its ``importance_sampling_level``, else None
    high_entropy_mask: Callable | None  # TRL's ``get_high_entropy_mask`` with its quantile, None when off
    off_policy_mask: Callable | None  # TRL's ``get_off_policy_mask`` with its threshold, None when off
    entropy: EntropyState | None  # None: TRL's entropy bonus is off
    adaptive_entropy: bool
    args: Any  # the config (entropy targets and steps, read by the adaptive coefficient)
    aux_coef: float | None  # the MoE auxiliary loss's coefficient, None when TRL computes none
    sampler_correction: bool  # TRL's vLLM importance-sampling correction is on (its ratio enters every loss)
    diagnostics: bool  # respo_log_diagnostics
    multimodal_keys: tuple[str, ...]
    collectives: Any  # the trainer's accelerator: reduce, gather, gather_for_metrics


class LossResult(NamedTuple):
    """What one micro-batch's loss computed; the trainer returns ``loss`` to TRL and logs ``metrics``."""

    loss: torch.Tensor  # scalar, differentiable
    weights: ReSPOWeights | None  # ReSPO's coefficients, log W and phi (None: TRL's own loss)
    metrics: dict[str, float]  # TRL's (ReSPO's loss) and ReSPO's diagnostics, over all processes
    staleness: torch.Tensor | None  # each row's staleness over all processes (None: not a served micro-batch)
    entropy: EntropyState | None  # TRL's entropy state after ReSPO's loss (None: unchanged, or TRL's loss moved it itself)
    sampler_gap: str | None  # the sampler-gap alarm this micro-batch raises (fresh rows only), else None


def trl_token_masks(ctx: TrlContext, inputs: dict, logps: torch.Tensor, entropies: torch.Tensor | None):
    """TRL's masks besides the importance weight, with TRL's own helpers: ``(entropy mask, product of the entropy and
    off-policy masks)``, each None when off. ReSPO's loss multiplies them in; the diagnostics reuse them."""
    mask = loss_mask(inputs)
    entropy_mask = weight = None
    if ctx.high_entropy_mask is not None:
        entropy_mask = ctx.high_entropy_mask(entropies, mask)
        weight = entropy_mask.float()
    if ctx.off_policy_mask is not None:
        advantages, old = inputs["advantages"], inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        kept = ctx.off_policy_mask(
            advantages=advantages.unsqueeze(1) if advantages.dim() == 1 else advantages, per_token_logps=logps,
            sampling_per_token_logps=inputs.get("sampling_per_token_logps", old), mask=mask,
        ).float()  # fmt: skip
        weight = kept if weight is None else weight * kept
    return entropy_mask, weight


def dapo_normalizer(ctx: TrlContext, inputs: dict) -> torch.Tensor:
    """TRL's ``dapo`` denominator: ``num_items_in_batch`` spans the generation batch, rescaled to one accumulation
    window (and per process, as DDP averages the gradients)."""
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / ctx.num_processes
    if ctx.training:
        normalizer = normalizer * ctx.accumulation / ctx.steps_per_generation
    return normalizer


def _global_masked_mean(ctx: TrlContext, values: torch.Tensor, mask: torch.Tensor) -> float:
    totals = ctx.collectives.reduce(torch.stack([(values * mask).sum(), mask.sum().float()]), reduction="sum")
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def _respo_loss(ctx: TrlContext, inputs: dict, dropped: torch.Tensor, kept_log_w):
    """ReSPO's loss as TRL's ``vespo`` branch aggregates it: ``(loss, weights, logps, entropies, token weight, TRL's
    metrics, entropy state)``, the log-probs and entropies detached for the diagnostics."""
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    logps, entropies, aux_loss = ctx.forward(
        torch.cat([prompt_ids, completion_ids], dim=1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1),
        compute_entropy=True, compute_aux_loss=ctx.aux_coef is not None,
        **{key: inputs.get(key) for key in ctx.multimodal_keys},
    )  # fmt: skip
    logps = clean_logps(logps, dropped)
    mask = loss_mask(inputs)
    entropy_mask, token_weight = trl_token_masks(ctx, inputs, logps, entropies)
    result = respo_grpo_loss(
        logps, inputs.get("old_per_token_logps"), inputs["advantages"], mask, ctx.params,
        normalizer=dapo_normalizer(ctx, inputs), sampler_ratio=inputs.get("importance_sampling_ratio"),
        kept_log_w=kept_log_w, token_weight=token_weight, beta=ctx.beta, ref_logps=inputs.get("ref_per_token_logps"),
        kl_correction=ctx.kl_correction,
    )  # fmt: skip
    metrics, loss, entropy = {}, result.loss, ctx.entropy
    if entropy is not None:  # TRL's entropy bonus, its adaptive coefficient moved once per optimizer step
        collectives, sync = ctx.collectives, ctx.collectives.sync_gradients
        metrics["policy_loss"] = collectives.gather(result.loss.detach()).nanmean().item()
        term, *entropy = trl_entropy_bonus(
            entropies, mask, entropy_mask, coef=entropy.coef, window=entropy.window,
            last_world_entropy=entropy.last_world_entropy, args=ctx.args, adaptive=ctx.adaptive_entropy,
            train=ctx.training, accumulation=ctx.accumulation, sync_gradients=sync,
            reduce=lambda t: collectives.reduce(t, reduction="sum"),
        )  # fmt: skip
        entropy = EntropyState(*entropy)
        loss = loss + term
        if ctx.training and sync:
            metrics["entropy_coef"] = entropy.coef
    else:  # TRL adds its bonus term whether or not it is on (0.0 when off): the same graph, the same float
        loss = loss + 0.0
    if ctx.aux_coef is not None:  # scaled for gradient accumulation like the policy loss
        loss = loss + ctx.aux_coef * aux_loss / ctx.accumulation
        metrics["aux_loss"] = ctx.collectives.gather_for_metrics(aux_loss).mean().item()
    if ctx.beta != 0.0:
        metrics["kl"] = _global_masked_mean(ctx, result.per_token_kl, mask)
    metrics["entropy"] = _global_masked_mean(ctx, entropies, mask)
    detached = None if entropies is None else entropies.detach()
    return loss, result.weights, logps.detach(), detached, token_weight, metrics, entropy


def micro_batch_loss(inputs: dict, ctx: TrlContext) -> LossResult:
    """One micro-batch's loss, TRL's metrics and ReSPO's diagnostics (module docstring).

    Every sequence whose advantage, stored log-probs or sampler ratio is non-finite leaves the loss first
    (:func:`drop_nonfinite`); ``respo_epoch_weight="first_pass"`` reads each row's first-pass ``log W`` from the
    served micro-batch (NaN on its first pass)."""
    inputs, dropped = drop_nonfinite(inputs)
    kept_log_w = inputs.get(FIRST_LOG_W_KEY) if ctx.training else None
    if ctx.loss_type == "respo":
        loss, weights, logps, entropies, token_weight, metrics, entropy = _respo_loss(ctx, inputs, dropped, kept_log_w)
    else:  # TRL's own loss; its forward's log-probs come back cleaned and detached. TRL moved its entropy state on the
        # trainer itself: nothing to hand back (handing back ctx.entropy would undo TRL's update)
        (loss, logps, entropies), weights, token_weight, metrics, entropy = ctx.trl_loss(inputs, dropped), None, None, {}, None
    staleness = inputs.get(STALENESS_KEY)
    if ctx.diagnostics:  # from the loss's own forward and, under ReSPO, its weights
        if weights is None:  # TRL's own loss: its masks, recomputed once with TRL's helpers
            token_weight = trl_token_masks(ctx, inputs, logps, entropies)[1]
        sampler_ratio = inputs.get("importance_sampling_ratio") if ctx.sampler_correction else None
        diagnostics, staleness = step_metrics(
            logps, inputs.get("old_per_token_logps"), inputs["advantages"], loss_mask(inputs), ctx.params,
            ctx.loss_name, sampler_ratio=sampler_ratio, token_weight=token_weight, kept_log_w=kept_log_w,
            weights=weights, staleness=staleness, dropped=dropped, gather=ctx.collectives.gather,
        )  # fmt: skip
        metrics.update(diagnostics)
    elif ctx.training and staleness is not None:
        staleness = ctx.collectives.gather(staleness.float())
    return LossResult(loss, weights, metrics, staleness if ctx.training else None, entropy,
                      _sampler_gap(ctx, inputs, staleness, metrics.get("offpolicy/log_weight/std")))  # fmt: skip


def _sampler_gap(ctx: TrlContext, inputs: dict, staleness, log_weight_std) -> str | None:
    """The sampler-gap alarm (:func:`respo_trl.diagnostics.sampler_gap_warning`) where it applies: a training
    micro-batch whose rows are all fresh, under a loss that folds TRL's sampler correction into a sequence weight."""
    if not ctx.training or staleness is None or log_weight_std is None or ctx.loss_name not in FOLDS_SAMPLER_RATIO:
        return None
    fresh = staleness.numel() > 0 and staleness.max().item() == 0
    if not fresh or not ctx.sampler_correction or inputs.get("importance_sampling_ratio") is None:
        return None
    return sampler_gap_warning(log_weight_std)
