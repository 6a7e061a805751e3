"""ReSPO as verl's ``loss_mode="respo"``: a plugin for stock verl (0.9.1), no fork, no patched workers.

What it does
    Registers :func:`compute_policy_loss_respo` in verl's policy-loss registry
    (``verl.trainer.ppo.core_algos.register_policy_loss``). The math is not here: the sequence log-weight and the
    two-branch kernel come from :mod:`respo_trl.kernels`, the same functions the TRL trainer calls (one kernel, two
    front ends). This module only adapts verl's tensors and config to them.

How it reaches every Ray worker
    ``pyproject.toml`` declares this module under the ``verl.plugins`` entry-point group. verl 0.9.1's
    ``verl/__init__.py`` loads every entry point of that group on ``import verl`` (unless
    ``VERL_USE_EXTERNAL_PLUGINS=none``), and every verl process, driver or Ray worker, imports ``verl``; so installing
    ``respo_trl`` into the environment is enough. verl swallows plugin import errors (it logs them at DEBUG), so this
    module logs its own failures at WARNING before raising. ``VERL_USE_EXTERNAL_MODULES=respo_trl.integrations.verl``
    is an equivalent explicit route.

Config (``actor_rollout_ref.actor.policy_loss``)
    verl builds ``PolicyLossConfig`` by Hydra ``_target_`` instantiation, and that dataclass rejects unknown keys. To
    set ReSPO's constants, point ``_target_`` at :class:`ReSPOPolicyLossConfig` (a subclass with six ``respo_*``
    fields, validated in ``__post_init__``)::

        actor_rollout_ref.actor.policy_loss.loss_mode=respo \\
        actor_rollout_ref.actor.policy_loss._target_=respo_trl.integrations.verl.ReSPOPolicyLossConfig \\
        +actor_rollout_ref.actor.policy_loss.respo_alpha_pos=2.0

    The keys are ``ReSPOConfig``'s field names (``respo_lambda_pos``, ``respo_lambda_neg``: one spelling in TRL and
    verl); a renamed key (``respo_lam_pos``) is refused with its new name (:data:`respo_trl._compat.RENAMED_VERL_KEYS`).
    verl instantiates the actor config on the driver in ``validate_config`` before any worker starts, so an
    out-of-domain value fails there with the field's full name, and a misspelt ``respo_*`` key fails with Hydra's
    "unexpected keyword argument". Without the ``_target_`` override the paper's constants are used.

Sampler weights (``rollout_is_weights``)
    verl 0.9.1 passes them as a ``(B, L)`` tensor in two layouts (``algorithm.rollout_correction.rollout_is``):
    ``token`` (one ratio ``pi_old / pi_rollout`` per token, truncated) or ``sequence`` (one truncated product
    ``prod_t pi_old / pi_rollout`` per response, *broadcast to every token*). ReSPO folds them into ``log W`` in log
    space and does not multiply the loss by them again: a token-level weight adds ``sum_t m_it log r_it``, a
    sequence-level weight adds ``log r_i`` once (summing the broadcast copies would count it ``L_i`` times, which is
    what a per-token sum does). The layout is ``respo_rollout_is`` (``token``, ``sequence``, or ``auto``: a row whose
    kept tokens all carry the same weight is read as a broadcast sequence weight). A weight of exactly 0 (IcePop
    rejection) removes that token (a whole response, for sequence level) from the loss, as verl's own losses do by
    multiplying by it; it is not read as ``log W = -inf``, which ReSPO's positive branch would *amplify*.

Bypass mode (``algorithm.rollout_correction.bypass_mode=True``, the default of verl's async trainers)
    verl skips the old-log-prob forward, uses the rollout's log-probs as ``pi_old`` and, in
    ``rollout_corr_helper.apply_bypass_mode``, overwrites the actor's ``loss_mode`` with its own ``bypass_mode`` loss
    (PPO-clip or REINFORCE). With this plugin loaded, ``loss_mode="respo"`` is kept there (:func:`_keep_respo_in_bypass`
    wraps that one function; every other loss mode goes through verl's unchanged), so ReSPO's ``W`` is
    ``pi_theta / pi_rollout``: the ratio against the policy that sampled. Nothing else is multiplied in (verl's own
    PPO-clip bypass does the same: the IS weight *is* that ratio). verl's rejection sampling (``rollout_rs``) drops
    tokens or responses as its bypass loss does, when the actor's ``policy_loss.rollout_correction`` says bypass: the
    driver attaches it, and on Ray workers the launcher's ``+...policy_loss.rollout_correction=${algorithm.
    rollout_correction}`` does (a worker's config is fixed when it starts).

verl's V1 trainer (``trainer.use_v1=true``, ``main_ppo``'s default in 0.9.1)
    Never calls ``apply_bypass_mode``: in bypass mode it copies the rollout's log-probs into ``old_log_probs`` and
    leaves ``loss_mode`` alone, so ``W = pi_theta / pi_rollout`` as above; in decoupled mode (its default) it
    recomputes them with the trainer's weights at the step's start (``separate_async``: restored from a CPU snapshot
    for every mini-batch), so ``W`` is measured against those weights, plus the sampler weight when
    ``rollout_is`` is set. Rejection in bypass mode again relies on the launcher's ``rollout_correction`` override
    (V1 never attaches it). ``tests/verl_integration/test_v1_trainers.py``; docs/verl.md.

Metrics
    verl's actor loss averages a policy loss's metrics over micro-batches and data-parallel ranks with equal weights,
    so a ratio computed inside a micro-batch (a mean over its positives, say) is biased whenever micro-batches differ
    in composition, and undefined when one has no positives. The primary metrics are therefore *per-response
    averages* (linear, so verl's averaging gives the batch value for equal-size micro-batches), and the by-sign and
    diagnostic ratios are ratios of them:

    * ``respo/frac/{pos,neg}``: share of responses with ``A > 0`` / ``A < 0``;
    * ``respo/phi_mass/{pos,neg}``: average of ``phi_i 1[sign]``; ``phi`` by sign is ``phi_mass/pos / frac/pos``;
    * ``respo/low_weight_pos/frac`` and ``respo/low_weight_pos/phi_mass``: the same for positives with
      ``log W < -1``. The paper's positive-branch diagnostic is: share ``= low_weight_pos/frac / frac/pos``, mass
      share ``= low_weight_pos/phi_mass / phi_mass/pos``, ratio = mass share / share;
    * ``respo/phi_mean``, ``respo/log_w_mean``, and verl's ``actor/ppo_kl``;
    * ``respo/low_weight_pos/{share,mass_share,mass_ratio}``: the diagnostic computed within each micro-batch by
      :func:`respo_trl.diagnostics.positive_low_weight_stats` (the TRL trainer logs the same function's output as
      ``starvation/low_weight_pos/*``); 0 where a micro-batch has no positives, so it is exact only when a
      micro-batch holds the whole batch.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

_logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "respo_trl.integrations.verl needs verl 0.9.1 and its pinned stack, in an environment of its own (they clash "
    "with TRL 1.16's). From a checkout: `pip install torch==2.13.0 && pip install -r requirements/verl.txt && "
    "pip install --no-deps -e .`; from PyPI: `pip install verl==0.9.1` and then `pip install --no-deps respo-trl` "
    "(docs/verl.md)."
)

try:
    from omegaconf import open_dict
    from verl.trainer.ppo import rollout_corr_helper
    from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
    from verl.utils.torch_functional import masked_mean
    from verl.workers.config import PolicyLossConfig
except ImportError as exc:  # verl missing, or a verl whose layout differs from 0.9.1's
    _logger.warning("respo_trl could not register loss_mode='respo' with verl: %s", exc)
    raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc

from respo_trl._compat import RENAMED_VERL_KEYS, refuse_renamed  # noqa: E402

# One kernel, two front ends: the math lives in respo_trl.kernels / respo_trl.diagnostics (pure torch, no TRL).
from respo_trl.diagnostics import LOW_WEIGHT_LOG_W, positive_low_weight_stats  # noqa: E402
from respo_trl.kernels import (  # noqa: E402
    CONSTANT_KEYS,
    RESPO_DEFAULTS,
    LossParams,
    fold_sampler_ratio,
    respo_weights,
    validate_respo_constants,
    with_respo_constants,
)

__all__ = ["ReSPOPolicyLossConfig", "compute_policy_loss_respo", "respo_constants", "CONFIG_PREFIX"]

CONFIG_PREFIX = "actor_rollout_ref.actor.policy_loss"
ROLLOUT_IS_LEVELS = ("auto", "token", "sequence")
_KEYS = CONSTANT_KEYS  # verl config key (ReSPOConfig's field name) -> kernel keyword
def _check(values: dict[str, Any], rollout_is: Any) -> None:
    """Raise ``ValueError`` naming the verl field (full dotted key) of the first bad constant."""
    for key, kernel_name in _KEYS.items():
        try:
            validate_respo_constants(**{kernel_name: float(values[key])})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{CONFIG_PREFIX}.{key}={values[key]!r}: {exc}") from None
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"{CONFIG_PREFIX}.respo_rollout_is={rollout_is!r}: must be one of {ROLLOUT_IS_LEVELS}")


@dataclass
@with_respo_constants  # respo_alpha_pos ... respo_lambda_neg, declared once (respo_trl.kernels.RESPO_CONSTANTS)
class ReSPOPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ReSPO's per-branch constants (defaults: the paper's).

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=respo_trl.integrations.verl.ReSPOPolicyLossConfig``.
    ``respo_{alpha,beta,lam}_{pos,neg}`` are the kernel's ``alpha`` (order of the power mean, > 0), ``beta`` (weight
    of ``W`` in it, in [0, 1]) and ``lam`` (variance tilt, >= 0) for advantages >= 0 / < 0. ``respo_rollout_is`` is
    the layout of verl's ``rollout_is_weights`` (``auto``, ``token`` or ``sequence``; the recipes interpolate
    ``${algorithm.rollout_correction.rollout_is}``, and null means ``auto``).
    """

    respo_rollout_is: Optional[str] = "auto"

    def __new__(cls, *args, **kwargs):
        # Hydra passes the config's keys as keyword arguments: a renamed key is refused with its new name before the
        # dataclass's __init__ would refuse it as an "unexpected keyword argument".
        refuse_renamed(kwargs, RENAMED_VERL_KEYS, f"{CONFIG_PREFIX}.{{}}")
        return super().__new__(cls)

    def __post_init__(self):
        _check({key: getattr(self, key) for key in _KEYS}, self.respo_rollout_is)


def respo_constants(config: Any) -> tuple[dict[str, float], str]:
    """The kernel's six constants and the ``rollout_is_weights`` layout from verl's actor config.

    ``config`` is verl's ``ActorConfig`` (``config.policy_loss`` a ``PolicyLossConfig``, ours or verl's), an
    OmegaConf/dict actor config, or None (paper defaults). Unknown ``respo_*`` keys and out-of-domain values raise
    ``ValueError`` naming the field.
    """
    policy_loss = None if config is None else _get(config, "policy_loss")
    if policy_loss is None:
        return dict(RESPO_DEFAULTS), "auto"
    known = set(_KEYS) | {"respo_rollout_is"}
    is_dataclass = hasattr(policy_loss, "__dataclass_fields__")
    names = [f.name for f in fields(policy_loss)] if is_dataclass else list(policy_loss)
    refuse_renamed([str(n) for n in names], RENAMED_VERL_KEYS, f"{CONFIG_PREFIX}.{{}}")
    unknown = sorted(str(n) for n in names if str(n).startswith("respo_") and n not in known)
    if unknown:
        raise ValueError(f"unknown ReSPO setting(s) {', '.join(f'{CONFIG_PREFIX}.{n}' for n in unknown)}; "
                         f"known: {sorted(known)}")
    values = {key: _get(policy_loss, key, RESPO_DEFAULTS[name]) for key, name in _KEYS.items()}
    rollout_is = _get(policy_loss, "respo_rollout_is", "auto")
    _check(values, rollout_is)
    return {name: float(values[key]) for key, name in _KEYS.items()}, rollout_is or "auto"


def _loss_fields(constants: dict[str, float]) -> dict[str, float]:
    """The kernel's constants (``alpha_pos`` ...) under ``LossParams``' field names (``respo_alpha_pos`` ...)."""
    return {key: constants[name] for key, name in _KEYS.items()}


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict) or hasattr(obj, "get"):
        return obj.get(key, default)
    return getattr(obj, key, default)


def sampler_log_ratio(log_c: torch.Tensor, keep: torch.Tensor, level: str) -> torch.Tensor:
    """``log c`` of verl's ``rollout_is_weights`` laid out so :func:`respo_trl.kernels.sequence_log_weight` adds it
    the right number of times.

    ``log_c`` (B, L) comes from :func:`respo_trl.kernels.fold_sampler_ratio` (0 on dropped tokens). ``token``: returned
    as is, summed over the kept tokens. ``sequence``: verl broadcast one weight ``c_i`` to the response's tokens, so
    the row's single value is returned as (B, 1), which is added once (summing the ``L_i`` copies would count it
    ``L_i`` times). ``auto``: rows whose kept tokens all carry the same value are read as sequence-level, the others
    as token-level (for rows with 0 or 1 kept token both readings agree).
    """
    n_kept = keep.sum(-1, keepdim=True)
    per_seq = torch.where(keep, log_c, 0.0).sum(-1, keepdim=True) / n_kept.clamp_min(1)  # mean of equal copies
    if level == "sequence":
        return per_seq
    if level == "token":
        return log_c
    inf = torch.full_like(log_c, math.inf)
    row_max = torch.where(keep, log_c, -inf).amax(-1, keepdim=True)
    row_min = torch.where(keep, log_c, inf).amin(-1, keepdim=True)
    broadcast = (row_max == row_min) | (n_kept <= 1)
    # one tensor for the batch: sequence rows carry their value on the first kept token only, so the masked sum in
    # sequence_log_weight adds it exactly once
    first = keep & (keep.cumsum(-1) == 1)
    return torch.where(broadcast, torch.where(first, per_seq, 0.0), log_c)


@register_policy_loss("respo")
def compute_policy_loss_respo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """ReSPO's policy loss in verl's registry signature; all tensors ``(B, L)``.

    ``log W_i = clamp(sum_t m_it (log_prob - old_log_prob) [+ sampler correction], -20, 20)``, ``phi_i`` from the
    branch of ``sign(A_i)`` (detached), per-token loss ``-phi_i A_it log_prob_it``, aggregated by verl's ``agg_loss``
    with ``config.global_batch_info`` (global token/sequence counts and DP size), so micro-batching and data
    parallelism do not change the gradient.
    """
    constants, level = respo_constants(config)
    mask = response_mask.bool()
    # A sampler weight of exactly 0 is verl's rejection (IcePop): that token (or, sequence-level, response) is dropped.
    log_c, keep = fold_sampler_ratio(rollout_is_weights, mask)
    kept_by_rs, rs_metrics = bypass_rejection(config, log_prob, old_log_prob, mask)
    keep = keep if kept_by_rs is None else keep & kept_by_rs

    log_ratio = (log_prob - old_log_prob).detach()
    m = mask.to(advantages.dtype)
    seq_advantage = (advantages * m).sum(-1) / m.sum(-1).clamp_min(1.0)  # A_i (GRPO: constant over the response)
    # the coefficient every engine uses (kernels.respo_weights): log W_i = clamp(sum_t m_it log r_it [+ log c], +-20),
    # phi_{sign A_i}(W_i) on the kept tokens, 0 elsewhere
    weights = respo_weights(log_ratio, seq_advantage.to(torch.float32), keep, LossParams(**_loss_fields(constants)),
                            log_sampler_ratio=None if log_c is None else sampler_log_ratio(log_c, keep, level))  # fmt: skip
    log_w, phi = weights.log_w, weights.phi.squeeze(-1).to(log_prob.dtype)  # (B,), detached

    loss_mat = -weights.coefficients.to(log_prob.dtype) * advantages * log_prob
    batch_info = dict(_get(config, "global_batch_info", None) or {}) if config is not None else {}
    loss = agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)

    return loss, {**_metrics(log_w, phi, seq_advantage, keep, mask, log_ratio), **rs_metrics}


def bypass_rejection(config: Any, log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor):
    """In bypass mode (``old_log_prob`` is the rollout's), the tokens verl's rejection sampling keeps, computed as
    verl's own bypass loss computes them (current policy against the rollout policy), and its metrics; ``(None, {})``
    outside bypass mode or without ``rollout_rs``. In decoupled mode verl applies the rejection to ``response_mask``
    on the driver before the loss sees it."""
    policy_loss = None if config is None else _get(config, "policy_loss")
    correction = None if policy_loss is None else _get(policy_loss, "rollout_correction")
    if correction is None or not _get(correction, "bypass_mode", False) or _get(correction, "rollout_rs") is None:
        return None, {}
    with torch.no_grad():
        _, kept, metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob.detach(), rollout_log_prob=rollout_log_prob, response_mask=mask, rollout_is=None,
            rollout_rs=_get(correction, "rollout_rs"), rollout_rs_threshold=_get(correction, "rollout_rs_threshold"),
        )
    return kept.bool(), metrics


def _keep_respo_in_bypass(verl_apply_bypass_mode):
    """Wrap verl's ``apply_bypass_mode`` so that it keeps ``loss_mode="respo"`` (see the module docstring); verl's
    trainers import it from ``rollout_corr_helper`` when they call it, so replacing the module attribute reaches them."""

    @functools.wraps(verl_apply_bypass_mode)
    def apply_bypass_mode(batch, rollout_corr_config=None, policy_loss_config=None):
        respo = policy_loss_config is not None and _get(policy_loss_config, "loss_mode") == "respo"
        verl_apply_bypass_mode(batch, rollout_corr_config=rollout_corr_config, policy_loss_config=policy_loss_config)
        if respo:  # verl set old_log_probs = rollout_log_probs and attached rollout_correction; ReSPO stays the loss
            with open_dict(policy_loss_config):
                policy_loss_config["loss_mode"] = "respo"
            if not apply_bypass_mode.announced:
                _logger.warning("loss_mode=respo under algorithm.rollout_correction.bypass_mode=True: ReSPO stays the "
                                "loss, with W = pi_theta / pi_rollout (verl's bypass_mode loss is not used)")
                apply_bypass_mode.announced = True

    apply_bypass_mode.announced = False
    apply_bypass_mode.keeps_respo = True
    return apply_bypass_mode


if not getattr(rollout_corr_helper.apply_bypass_mode, "keeps_respo", False):  # once, however often this is imported
    rollout_corr_helper.apply_bypass_mode = _keep_respo_in_bypass(rollout_corr_helper.apply_bypass_mode)


def _metrics(log_w, phi, seq_advantage, keep, mask, log_ratio) -> dict[str, float]:
    """Per-micro-batch metrics; see the module docstring for how verl aggregates them and how to read them."""
    valid = keep.any(-1)
    n = max(int(valid.sum()), 1)
    pos, neg = valid & (seq_advantage > 0), valid & (seq_advantage < 0)  # A = 0 responses carry no gradient
    low = pos & (log_w < LOW_WEIGHT_LOG_W)
    phi = phi.double()

    def per_response(x):  # average over the micro-batch's valid responses: linear, so verl's averaging keeps it exact
        return float(x.double().sum()) / n

    metrics = {
        "respo/phi_mean": per_response(phi * valid),
        "respo/log_w_mean": per_response(log_w.double() * valid),
        "respo/frac/pos": per_response(pos),
        "respo/frac/neg": per_response(neg),
        "respo/phi_mass/pos": per_response(phi * pos),
        "respo/phi_mass/neg": per_response(phi * neg),
        "respo/low_weight_pos/frac": per_response(low),
        "respo/low_weight_pos/phi_mass": per_response(phi * low),
        "actor/ppo_kl": float(masked_mean(-log_ratio, mask)) if bool(mask.any()) else 0.0,
    }
    # The paper's diagnostic as ratios within this micro-batch (the library's function, as the TRL trainer logs it);
    # 0 where undefined (no positives). The batch-level values are ratios of the linear metrics above.
    for key, value in positive_low_weight_stats(log_w, phi, seq_advantage, valid).items():
        metrics[f"respo/low_weight_pos/{key}"] = value if value == value else 0.0
    return metrics
