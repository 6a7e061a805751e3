"""Sequence losses on TRL's packed rows: the loss terms of a row, laid out as (sequences x tokens), pure torch.

TRL's ``AsyncGRPOTrainer`` packs a rank's samples into one row (a prefix trie: a token several samples share is
forwarded once) and hands its loss a flat list of *terms*, one per trained token of each sample: the position that
predicts it, the sampler's log-probability ``log mu``, the sample's advantage and ``segment_id``, the sample's index in
the row. A sequence kernel needs the terms of each sample together, so :func:`unpack_terms` scatters them into a
(S, T) layout (S samples, T their longest trained length) with a mask, keeping the gradient of the log-probabilities,
and the registered losses of :mod:`respo_trl.kernels` apply unchanged. Nothing here imports TRL.

Symbols as in ``docs/method.md``: ``log W_i = sum_t (log pi_theta(y_it) - log mu(y_it))`` over sample ``i``'s terms,
so in the async trainer ``W`` holds both the policy's movement since the sampled version and the gap between the
sampler's log-probabilities and the trainer's (docs/async.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels import LOG_W_CLAMP, LossParams, ReSPOWeights, respo_weights, vespo_phi

Tensor = torch.Tensor


class PackedSequences(NamedTuple):
    """A row's loss terms as (S, T) sequences; ``row_of`` maps each flat term to its (sample, position) cell."""

    log_probs: Tensor  # (S, T) log pi_theta, differentiable; 0 outside the mask
    old_log_probs: Tensor  # (S, T) the sampler's log mu; 0 outside the mask
    advantages: Tensor  # (S,) one advantage per sample (TRL repeats it on every term)
    mask: Tensor  # (S, T) float: 1 on a trained token
    row_of: tuple[Tensor, Tensor]  # (sample, position) of each flat term


def unpack_terms(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, segment_id: Tensor,
                 num_sequences: int | None = None) -> PackedSequences:  # fmt: skip
    """Scatter flat loss terms (M,) into (S, T) by ``segment_id``; a term's position is its rank among its sample's
    terms, in order. ``num_sequences`` (default ``max(segment_id) + 1``) keeps samples with no trained token as
    empty rows. The scatter is differentiable in ``log_probs``."""
    segment_id = segment_id.long()
    if num_sequences is None:
        num_sequences = int(segment_id.max().item()) + 1 if segment_id.numel() else 0
    counts = torch.bincount(segment_id, minlength=num_sequences)
    order = torch.argsort(segment_id, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(segment_id)
    position[order] = torch.arange(segment_id.numel(), device=segment_id.device) - starts[segment_id[order]]
    width = int(counts.max().item()) if counts.numel() else 0
    cells = (segment_id, position)

    def scatter(values: Tensor) -> Tensor:
        out = values.new_zeros(num_sequences, width)
        return out.index_put(cells, values)

    per_sample = advantages.new_zeros(num_sequences).index_put((segment_id,), advantages.detach())
    mask = scatter(torch.ones_like(old_log_probs, dtype=torch.float32))
    return PackedSequences(scatter(log_probs), scatter(old_log_probs.detach()), per_sample, mask, cells)


class PackedLoss(NamedTuple):
    """One micro-batch's policy loss on packed rows and what it applied."""

    loss: Tensor  # scalar, differentiable: sum over terms / normalizer (TRL's async tokens_per_rank)
    weights: ReSPOWeights | None  # ReSPO's weights per sample, (S, 1) layout: log W, phi (None for VESPO)


def packed_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, segment_id: Tensor,
                       loss_name: str, params: LossParams, *, normalizer: Tensor | float,
                       num_sequences: int | None = None) -> PackedLoss:  # fmt: skip
    """``sum_m ell_m / normalizer`` over a row's flat loss terms for ``loss_name`` (``"respo"`` or ``"vespo"``), with
    TRL's async aggregation: ``ell_m = -c_m A_m log r_m``, ``log r_m = log pi_theta - log mu`` (gradient
    ``-c A grad log pi``), ``c_m`` the coefficient of the term's sample.

    A sample's coefficient depends on its terms only through their sum ``l_i = sum_t log r_it`` (ReSPO:
    ``phi_{sign A_i}(clamp(l_i, -20, 20))``; VESPO: the same after clamping each term to +-20, as TRL does), so it
    is computed from the samples' sums laid out as (S, 1) by the functions every engine uses
    (:func:`respo_trl.kernels.respo_weights`, :func:`respo_trl.kernels.vespo_phi`) and gathered back onto the terms;
    the loss stays flat. No token mask: in the async trainer each sample is used once. ``normalizer`` is TRL's async
    ``tokens_per_rank`` (the global trained-token count over the world size)."""
    if loss_name not in ("respo", "vespo"):
        raise ValueError(f"packed_policy_loss computes the sequence losses 'respo' and 'vespo', got {loss_name!r}")
    if params.respo_trust_mask:
        raise ValueError("the packed loss has no token trust mask (each sample is used once): set it off")
    segment_id = segment_id.long()
    if num_sequences is None:
        num_sequences = int(segment_id.max().item()) + 1 if segment_id.numel() else 0
    log_ratio = log_probs - old_log_probs.detach()
    with torch.no_grad():
        terms = log_ratio.detach().float()
        if loss_name == "vespo":
            terms = terms.clamp(-LOG_W_CLAMP, LOG_W_CLAMP)
        sums = terms.new_zeros(num_sequences).index_add_(0, segment_id, terms).unsqueeze(-1)  # (S, 1): l_i
        trained = (torch.bincount(segment_id, minlength=num_sequences) > 0).unsqueeze(-1)
        per_sample = advantages.new_zeros(num_sequences).index_put((segment_id,), advantages.detach())
        weights = None
        if loss_name == "respo":
            weights = respo_weights(sums, per_sample, trained, params)
            coefficients = weights.coefficients[:, 0][segment_id]
        else:
            coefficients = vespo_phi(sums, per_sample, trained, params)[:, 0][segment_id]
    per_term = -coefficients.to(log_ratio.dtype) * advantages.detach() * log_ratio
    return PackedLoss(per_term.sum() / normalizer, weights)
