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

from .kernels import LossParams, ReSPOWeights, get_policy_loss, respo_weights

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

    loss: Tensor  # scalar, differentiable: sum over terms / tokens_per_rank (TRL's async normaliser)
    sequences: PackedSequences
    weights: ReSPOWeights | None  # ReSPO's coefficients, log W and phi (None for other losses)


def packed_policy_loss(sequences: PackedSequences, loss_name: str, params: LossParams, *,
                       normalizer: Tensor | float) -> PackedLoss:  # fmt: skip
    """``sum_i sum_t m_it ell_it / normalizer`` for the registered loss ``loss_name`` (``"respo"``, ``"vespo"``,
    ``"ppo"``), with ``ell`` from :mod:`respo_trl.kernels`: for ReSPO ``ell_it = -phi_{sign A_i}(W_i) A_i log r_it``
    with ``log r_it = log pi_theta - log mu`` and a detached ``phi`` (the same function the synchronous trainer and the
    verl plugin call). ``normalizer`` is TRL's async ``tokens_per_rank`` (the global trained-token count over the world
    size), so the three losses share TRL's aggregation exactly."""
    log_ratio = (sequences.log_probs - sequences.old_log_probs) * sequences.mask
    weights = None
    if loss_name == "respo":
        weights = respo_weights(log_ratio, sequences.advantages, sequences.mask, params)
        per_token = -weights.coefficients * sequences.advantages.unsqueeze(-1) * log_ratio
    else:
        per_token = get_policy_loss(loss_name)(log_ratio, sequences.advantages, sequences.mask, params)
    return PackedLoss((per_token * sequences.mask).sum() / normalizer, sequences, weights)
