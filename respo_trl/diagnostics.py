"""Starvation, off-policy and positive-branch diagnostics (spec section 5), as pure torch.

A trainer calls :func:`sequence_stats` on each micro-batch, gathers the per-sequence table from every process (one
collective) and logs :func:`summarize` of the gathered table. Because the summary is computed from the global table,
every process logs identical numbers, and sums are exact (not means of per-process means).

The coefficients are those the loss really applies: for ReSPO, the ones its loss computed on this forward
(:func:`respo_trl.kernels.respo_weights`, handed over, not recomputed); for TRL's own losses, ``c_it`` from
differentiating the registered loss (:func:`respo_trl.kernels.gradient_coefficients`, sampler correction included);
both times ``token_weight``, the masks the trainer applies on top (TRL's entropy mask and off-policy sequence mask).
Definitions (symbols of ``docs/method.md``):

* ``grad_throughput/{pos,neg} = sum_i |A_i| sum_t m_it c_it / sum_i |A_i| L_i`` over sequences with ``A > 0`` / ``< 0``:
  the share of on-policy gradient mass the loss lets through (1 on-policy, without masks).
* ``clip_grad_throughput``: the same for TRL's token-clipped loss (``dapo``, epsilon from the config) on the same batch
  and with the same masks: the counterfactual ReSPO is compared with.
* ``starved_frac/{pos,neg}``: fraction of sequences whose mean coefficient ``cbar_i = sum_t m_it c_it / L_i`` is below 0.1.
* The paper's positive-branch diagnostic (:func:`positive_low_weight_stats`): among positive responses, the share with
  ``log W < -1``, the share of the positive coefficient mass ``sum cbar_i`` they receive, and the ratio of the two
  (1 = received in proportion; the paper reports 1.69 for ReSPO, 0.93 for VESPO). ``cbar_i = phi_i`` for a
  sequence kernel without masks. The paper's figure is pooled over many updates, so :func:`summarize` also returns
  the four sums it is made of (:data:`LOW_WEIGHT_SUMS`) and :func:`pooled_low_weight` forms the ratios from sums
  accumulated over any window (the trainer: once per logged optimizer step, across processes). The same sums are
  kept for ReSPO's and VESPO's weights on the *same* batch, whatever loss trains (the same-batch counterfactual).
* Which responses count: a response with no loss token is left out everywhere; one the sampler correction dropped
  whole (``sequence_mask``: ratio 0) still counts in the throughput (it receives no gradient) but not in the weight
  statistics (``offpolicy/*``, ``respo/phi_mean``, the positive-branch diagnostic): its ``W`` is not defined.
* ``offpolicy/kl``: per-token ``KL(pi_old || pi_theta)`` by the k3 estimator ``r - 1 - log r`` over the kept tokens
  (``r`` the token ratio, sampler correction excluded): how far the policy has moved since these rollouts were
  sampled. At staleness 1 it is the movement of one update.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .kernels import (
    LossParams,
    ReSPOWeights,
    directional_trust_mask,
    fold_sampler_ratio,
    gradient_coefficients,
    kish_ess,
    respo_weights,
    sequence_log_weight,
    two_branch_phi,
    vespo_branch,
    vespo_phi,
)

Tensor = torch.Tensor

STARVED_BELOW = 0.1  # a sequence is "starved" when its mean coefficient is below this
LOW_WEIGHT_LOG_W = -1.0  # the paper's positive-branch diagnostic looks at positives with log W < -1
# On fresh rollouts (staleness 0) with TRL's vLLM sampler correction on, ``log W`` is only the engine's rounding against
# the trainer's. Above this standard deviation that noise moves ReSPO's coefficient of a fresh response by ~20% or more
# (phi+(e^-0.5) = 1.19, phi-(e^-0.5) = 1.24, against 1 on-policy). Measured on SmolLM2-135M
# (docs/benchmarks/real_stack.md, section 7): a bf16 engine against a float32 trainer reaches 0.46 at 256 tokens and
# 1.8 at 2,048; a float32 engine stays at 0.009 over 128 tokens.
SAMPLER_GAP_STD = 0.5


def sampler_gap_warning(log_weight_std: float) -> str | None:
    """The one-line alarm for a fresh step whose ``offpolicy/log_weight/std`` says the sampler gap, not policy
    movement, is moving ``W`` (None below :data:`SAMPLER_GAP_STD` or when the std is undefined)."""
    if not math.isfinite(log_weight_std) or log_weight_std <= SAMPLER_GAP_STD:
        return None
    return (
        f"offpolicy/log_weight/std is {log_weight_std:.2f} on fresh rollouts (staleness 0, above {SAMPLER_GAP_STD}): "
        "the vLLM engine's rounding against the trainer's, not policy movement, is moving the sequence weight W of "
        "responses nobody has trained on yet (docs/benchmarks/real_stack.md). Set vllm_importance_sampling_correction: "
        "false (the paper's runs: W is then 1 on fresh rollouts) and, on a GPU, cast_lm_head_to_fp32: true."
    )

# Columns of the per-sequence table returned by `sequence_stats`.
COLUMNS = (
    "valid", "kept", "advantage", "length", "mass", "clip_mass", "log_weight", "phi", "vespo_phi", "zero_tokens",
    "trust_masked", "kl", "kept_tokens",
)  # fmt: skip
_COL = {name: i for i, name in enumerate(COLUMNS)}
LOW_WEIGHT_PREFIX = "starvation/low_weight_pos/"
# The sums the positive-branch diagnostic is made of, per coefficient: the loss's own (``""``) and, on the same batch,
# ReSPO's and VESPO's weights. Summed over a window, :func:`pooled_low_weight` turns them into share / mass share /
# ratio. ``n``: positives; ``n_low``: those with log W < -1; ``mass``/``mass_low``: their summed coefficient.
COUNTERFACTUALS = ("respo", "vespo")
LOW_WEIGHT_SUMS = ("n", "n_low", "mass", "mass_low") + tuple(
    f"{name}_{part}" for name in COUNTERFACTUALS for part in ("mass", "mass_low")
)


def sequence_stats(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: LossParams,
    loss_name: str,
    *,
    sampler_ratio: Tensor | None = None,
    token_weight: Tensor | None = None,
    kept_log_w: Tensor | None = None,
    weights: ReSPOWeights | None = None,
) -> Tensor:
    """One row per sequence with the :data:`COLUMNS` needed by :func:`summarize` (float32, shape (B, 13)).

    ``log_ratio`` = ``log pi_theta - log pi_old`` (B, T); ``sampler_ratio`` is TRL's vLLM ``importance_sampling_ratio``
    ((B, T) or (B, 1)) or ``None``; ``token_weight`` (broadcastable to (B, T)) the trainer's extra masks;
    ``loss_name`` a key of :data:`respo_trl.kernels.POLICY_LOSSES`. Advantages of shape (B, T) are summarised per
    sequence by their masked mean. ``weights``: what ReSPO's loss computed on this forward
    (:func:`respo_trl.kernels.respo_weights`), used as they are, never computed again; for TRL's own losses the
    coefficients are recovered from the registered loss by autograd. ``kept_log_w`` (B,): the first-pass weight
    ReSPO's loss keeps under ``respo_epoch_weight="first_pass"``; the coefficients (and ``phi``) are the ones that
    weight gives, while ``log_weight`` stays the current ``log W`` (how far the policy has moved).
    """
    with torch.no_grad():
        mask_f = mask.float()
        log_ratio = log_ratio.detach().float()
        adv = advantages.detach().float()
        lengths = mask_f.sum(-1)
        per_token = adv.dim() > 1 and adv.shape[-1] > 1
        adv_seq = (adv * mask_f).sum(-1) / lengths.clamp(min=1.0) if per_token else adv.reshape(-1)
        weight = mask_f if token_weight is None else mask_f * token_weight.float()
        if weights is None:
            weights = respo_weights(log_ratio, adv, mask, params, sampler_ratio=sampler_ratio, log_w=kept_log_w)
            c = gradient_coefficients(loss_name, log_ratio, adv, mask, params, sampler_ratio=sampler_ratio,
                                      log_w=kept_log_w) * weight  # fmt: skip
        else:
            c = weights.coefficients.float() * weight
        clip_c = clipped_coefficients(log_ratio, adv, mask, params, sampler_ratio) * weight
        kept, log_w = weights.kept, weights.log_w  # raw log W, the diagnostic's x-axis for every loss
        vespo = vespo_phi(log_ratio, adv_seq, mask, params, sampler_ratio).reshape(-1)  # VESPO's weight, as TRL has it
        if per_token:  # ReSPO's phi as configured at each sequence's mean advantage
            evaluated = log_w if kept_log_w is None else torch.where(torch.isfinite(kept_log_w), kept_log_w.to(log_w), log_w)
            phi = torch.where(vespo_branch(adv_seq, params), vespo, two_branch_phi(evaluated, adv_seq, params))
        else:  # ReSPO's phi as configured, whatever loss is trained: a branch set to VESPO's kernel is VESPO's weight
            phi = weights.phi.reshape(-1).float()
        kept_f = kept.float()
        rho = torch.where(kept, log_ratio, 0.0)
        kl = ((torch.expm1(rho) - rho) * kept_f).sum(-1)  # k3: r - 1 - log r >= 0, unbiased for KL(pi_old || pi)
        trust_masked = torch.zeros_like(lengths)
        if loss_name == "respo" and weights.trust_kept is not None:
            trust_masked = (kept_f - weights.trust_kept).clamp(min=0).sum(-1)
        columns = {
            "valid": (lengths > 0).float(),
            "kept": kept.any(-1).float(),
            "advantage": adv_seq,
            "length": lengths,
            "mass": c.sum(-1),
            "clip_mass": clip_c.sum(-1),
            "log_weight": log_w.float(),
            "phi": phi,
            "vespo_phi": vespo,
            "zero_tokens": ((c == 0) & mask.bool()).float().sum(-1),
            "trust_masked": trust_masked,
            "kl": kl,
            "kept_tokens": kept_f.sum(-1),
        }
        return torch.stack([columns[name] for name in COLUMNS], dim=-1)


def step_metrics(logps: Tensor, old_logps: Tensor | None, advantages: Tensor, mask: Tensor, params: LossParams,
                 loss_name: str, *, sampler_ratio=None, token_weight=None, kept_log_w=None, weights=None,
                 staleness: Tensor | None = None, dropped: Tensor | None = None, gather=lambda t: t):  # fmt: skip
    """One micro-batch's metrics (:func:`summarize` of the gathered :func:`sequence_stats` table, plus
    ``respo/nonfinite_seqs``) and its rows' staleness over all processes, in one collective (``gather``): every
    process logs the same global numbers. ``logps`` is the loss forward's, cleaned (a dropped row and a non-finite
    value count as log-ratio 0); ``staleness``/``dropped`` (B,) travel with the table (None: fresh / none)."""
    log_ratio = torch.zeros_like(logps) if old_logps is None else logps - old_logps
    table = sequence_stats(log_ratio, advantages, mask, params, loss_name, sampler_ratio=sampler_ratio,
                           token_weight=token_weight, kept_log_w=kept_log_w, weights=weights)  # fmt: skip
    extra = [torch.zeros(len(table)) if v is None else v for v in (staleness, dropped)]
    table = gather(torch.cat([table, *(v.to(table).unsqueeze(-1) for v in extra)], dim=-1))
    metrics = summarize(table[:, : len(COLUMNS)])
    metrics["respo/nonfinite_seqs"] = table[:, len(COLUMNS) + 1].sum().item()
    return metrics, table[:, len(COLUMNS)]


def clipped_coefficients(log_ratio: Tensor, advantages: Tensor, mask: Tensor, params: LossParams,
                         sampler_ratio: Tensor | None = None) -> Tensor:  # fmt: skip
    """The coefficient TRL's token-clipped loss (``dapo``, this config's epsilons and ``delta``) would apply on the
    same batch, in closed form: the token ratio ``r_it`` where the clip lets the token through in its advantage's
    direction, 0 where it stops it (:func:`respo_trl.kernels.directional_trust_mask` has the same zero set), times the
    sampler ratio as TRL multiplies it in. Equal to the derivative of the registered ``ppo`` loss (tested), without
    evaluating that loss on every step."""
    with torch.no_grad():
        rho = torch.where(mask.bool(), log_ratio.detach().float(), 0.0)
        sign = torch.where(advantages >= 0, 1.0, -1.0)  # A = 0 takes the positive side, as the loss's derivative does
        c = torch.exp(rho) * directional_trust_mask(rho, sign, mask, params.epsilon_low, params.epsilon_high,
                                                    params.delta)  # fmt: skip
        if sampler_ratio is not None:
            c = c * sampler_ratio.float()
        return c.nan_to_num(0.0) * mask.float()


def drift_rows(logps: Tensor, old_logps: Tensor, mask: Tensor, sampler_ratio: Tensor | None = None) -> Tensor:
    """Per sequence, what the reuse checks gather (B, 6): ``log W`` (sampler correction included) and whether it is
    defined; the summed k3 KL(pi_old || pi_theta) over the kept tokens with a finite log-ratio and their count
    (sampler correction excluded, as ``offpolicy/kl``); the policy's own ``log(pi_theta / pi_old)`` (sampler
    correction excluded) and whether it is defined. :func:`drift_signals` turns the gathered rows into the signals.

    The drift signals leave the engine's sampler correction out: it is there on a batch's fresh pass already, so
    under vLLM a threshold on it would stop batches the policy has not moved from. ``ess`` keeps it, because the
    ESS floor (``respo_min_ess``) is on the weights the kernel sees."""
    with torch.no_grad():
        log_c, kept = fold_sampler_ratio(sampler_ratio, mask)
        log_ratio = logps - old_logps
        log_w = sequence_log_weight(log_ratio, kept, log_c)
        valid = kept.any(-1) & torch.isfinite(log_w)
        log_w_policy = log_w if log_c is None else sequence_log_weight(log_ratio, kept)  # differs only under vLLM
        valid_policy = kept.any(-1) & torch.isfinite(log_w_policy)
        finite = kept & torch.isfinite(log_ratio)  # one bad log-prob must not turn the batch's KL into NaN
        rho = torch.where(finite, log_ratio.float(), 0.0)
        kl = torch.where(finite, torch.expm1(rho) - rho, 0.0).sum(-1)
        columns = [log_w, valid.float(), kl, finite.float().sum(-1), log_w_policy, valid_policy.float()]
        return torch.stack(columns, dim=-1)


class DriftSignals(NamedTuple):
    """How far the current policy has moved from the one that sampled a batch, over all processes: what the reuse
    schedule decides on (``respo_min_ess``, ``respo_adaptive_reuse``) and what it logs before a pass."""

    ess: float  # the normalised Kish ESS of the defined W, sampler correction included (the ESS floor's)
    kl: float  # the per-token KL(pi_old || pi_theta) over all kept tokens
    policy_ess: float  # the ESS of pi_theta / pi_old alone (adaptive reuse's "ess")

    def metrics(self) -> dict[str, float]:
        return {"reuse/ess_before_pass": self.ess, "reuse/kl_before_pass": self.kl,
                "reuse/policy_ess_before_pass": self.policy_ess}  # fmt: skip


def drift_signals(rows: Tensor) -> DriftSignals:
    """The gathered :func:`drift_rows` as :class:`DriftSignals`."""
    return DriftSignals(
        ess=kish_ess(rows[:, 0][rows[:, 1] > 0]).item(),
        kl=(rows[:, 2].sum() / rows[:, 3].sum().clamp(min=1.0)).item(),
        policy_ess=kish_ess(rows[:, 4][rows[:, 5] > 0]).item(),
    )


def positive_low_weight_stats(
    log_w: Tensor, coefficient: Tensor, advantages: Tensor, valid: Tensor | None = None, threshold: float = LOW_WEIGHT_LOG_W
) -> dict[str, float]:
    """The paper's positive-branch diagnostic on per-response tensors (all shape (B,)).

    Among responses with ``A > 0`` (and ``valid``): ``share`` of those with ``log W < threshold``, ``mass_share`` of the
    summed ``coefficient`` they receive, and ``mass_ratio = mass_share / share`` (> 1: low-weight positives get more
    than their head count). NaN where undefined (no positives, no low-weight positive, or zero mass).
    """
    pooled = pooled_low_weight(low_weight_sums(log_w, coefficient, advantages, valid, threshold))
    return {key: pooled[key] for key in ("share", "mass_share", "mass_ratio")}


def low_weight_sums(log_w: Tensor, coefficient: Tensor, advantages: Tensor, valid: Tensor | None = None,
                    threshold: float = LOW_WEIGHT_LOG_W) -> dict[str, float]:
    """``n``, ``n_low``, ``mass``, ``mass_low`` of the positive-branch diagnostic (see :func:`positive_low_weight_stats`)."""
    selected = advantages.reshape(-1) > 0
    if valid is not None:
        selected = selected & valid.reshape(-1).bool()
    log_w, coefficient = log_w.reshape(-1)[selected].float(), coefficient.reshape(-1)[selected].float()
    low = log_w < threshold
    return {
        "n": float(selected.sum().item()),
        "n_low": float(low.sum().item()),
        "mass": coefficient.sum().item(),
        "mass_low": coefficient[low].sum().item(),
    }


def pooled_low_weight(sums: dict[str, float]) -> dict[str, float]:
    """Share, mass share and ratio from :data:`LOW_WEIGHT_SUMS` summed over any window (keys without the prefix).

    Returns ``share``, ``mass_share``, ``mass_ratio`` for the loss's own coefficient and ``{respo,vespo}_mass_share``,
    ``{respo,vespo}_mass_ratio`` for the same-batch counterfactuals; NaN where undefined (no positive, no low-weight
    positive, zero mass)."""
    n, n_low = sums.get("n", 0.0), sums.get("n_low", 0.0)
    share = n_low / n if n > 0 else math.nan
    out = {"share": share}
    for prefix in ("", *(f"{name}_" for name in COUNTERFACTUALS)):
        mass, mass_low = sums.get(f"{prefix}mass", 0.0), sums.get(f"{prefix}mass_low", 0.0)
        mass_share = mass_low / mass if mass > 0 and n > 0 else math.nan
        ratio = mass_share / share if share > 0 and not math.isnan(mass_share) else math.nan
        out[f"{prefix}mass_share"], out[f"{prefix}mass_ratio"] = mass_share, ratio
    return out


def pool_low_weight_window(metrics: dict[str, list]) -> None:
    """The paper's positive-branch diagnostic over a logging window, in place in TRL's ``_metrics[mode]`` dict: TRL
    averages every metric over the window's micro-batches, which would average ratios; here the counts and masses
    (already summed over processes) are summed over the window and the share, mass share and ratios formed once."""
    keys = [LOW_WEIGHT_PREFIX + key for key in LOW_WEIGHT_SUMS]
    if not all(key in metrics for key in keys):
        return
    sums = {key: sum(metrics[LOW_WEIGHT_PREFIX + key]) for key in LOW_WEIGHT_SUMS}
    for key, value in {**sums, **pooled_low_weight(sums)}.items():
        metrics[LOW_WEIGHT_PREFIX + key] = [value]


def summarize(table: Tensor) -> dict[str, float]:
    """Metrics of spec section 5 from a (gathered) :func:`sequence_stats` table. NaN where a group is empty."""
    table = table.float()
    col = {name: table[:, i] for name, i in _COL.items()}
    valid = col["valid"] > 0
    kept = valid & (col["kept"] > 0)  # W is defined: not dropped whole by the sampler correction
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
        metrics[f"respo/phi_mean/{sign}"] = _mean(col["phi"][kept & (adv > 0 if sign == "pos" else adv < 0)])

    sums = low_weight_sums(col["log_weight"], mean_coef, adv, kept)
    for name in COUNTERFACTUALS:
        other = low_weight_sums(col["log_weight"], col[f"{name}_phi" if name == "vespo" else "phi"], adv, kept)
        sums[f"{name}_mass"], sums[f"{name}_mass_low"] = other["mass"], other["mass_low"]
    for key, value in {**sums, **pooled_low_weight(sums)}.items():
        metrics[LOW_WEIGHT_PREFIX + key] = value
    metrics["starvation/pos_length_mean"] = _mean(length[kept & (adv > 0)])
    tokens = length[valid].sum()
    metrics["starvation/zero_coef_token_frac"] = _ratio(col["zero_tokens"][valid].sum(), tokens)
    metrics["respo/trust_masked_frac"] = _ratio(col["trust_masked"][valid].sum(), tokens)
    metrics["offpolicy/kl"] = _ratio(col["kl"][kept].sum(), col["kept_tokens"][kept].sum())

    log_w = col["log_weight"][kept]
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
