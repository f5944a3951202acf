"""Loss aggregation through (sum, count) pairs, so that micro-batching never changes the result.

A loss is reported as ``LossSum(loss_sum, count)``: the sum of per-unit losses and the number of
units (tokens or sequences, depending on the mode). Sums and counts add across micro-batches and
data-parallel ranks; ``divide_by_count`` is the single place where a division happens, by the
*global* count. With every micro-batch holding whole sequences, the three modes give exactly the
same gradient for any split (the verl/OpenRLHF normalisation bugs came from dividing per
micro-batch).

Modes (verl's ``agg_loss`` names; values ``l[b, s]``, mask ``m[b, s]``, ``n_b = sum_s m[b, s]``):
    token-mean:            sum_{b,s} m l / sum_{b,s} m
    seq-mean-token-sum:    sum_b [n_b > 0] sum_s m l / #{b : n_b > 0}
    seq-mean-token-mean:   sum_b [n_b > 0] (sum_s m l / n_b) / #{b : n_b > 0}

Here b is a row, unless ``seq_ids`` says which sequence each position belongs to (packed rows of
several sequences, ``core.microbatch``): then b runs over the sequences.

Context parallelism splits every sequence of a packed row over the CP ranks: each rank sums its
tokens of sequence b, divided by the sequence's token count over all of them (``sequence_tokens``,
all-reduced by the caller: a division by a constant is linear, so the ranks' parts add up to the
sequence's mean), and one rank counts the sequences (``counts_sequences``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from megatron_empg.core.checks import check_bool, check_choice, check_same_shape

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


class LossSum(NamedTuple):
    """An unnormalised loss: ``loss_sum`` [] (float) over ``count`` [] (int64) units."""

    loss_sum: Tensor
    count: Tensor


def masked_values(values: Tensor, loss_mask: Tensor) -> Tensor:
    """``values`` with masked-out entries set to 0 (no gradient reaches them) [same shape]."""
    return torch.where(loss_mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def aggregate(
    values: Tensor,
    loss_mask: Tensor,
    mode: str = "token-mean",
    seq_ids: Tensor | None = None,
    *,
    sequence_tokens: Tensor | None = None,
    counts_sequences: bool = True,
) -> LossSum:
    """Reduce per-token values to a ``LossSum`` under one of ``AGG_MODES``.

    Args:
        values: [B, S] per-token losses (bf16 inputs are summed in float32).
        loss_mask: [B, S] bool, True where the token contributes.
        mode: one of ``AGG_MODES``.
        seq_ids: [B, S] int64 >= 0, the sequence of each position (packed rows), or None (each
            row is one sequence). Only the seq-mean modes read it.
        sequence_tokens: [N] int64, each sequence's loss tokens over every context-parallel rank
            (``sequence_token_counts`` summed over the CP group), or None (the rows hold whole
            sequences). Only the seq-mean modes read it.
        counts_sequences: whether this rank's count includes the sequences (False on all but one
            context-parallel rank).

    Returns:
        ``LossSum`` whose ``count`` is the number of tokens (token-mean) or of sequences with at
        least one unmasked token (the seq-mean modes).
    """
    check_choice("mode", mode, AGG_MODES)
    check_bool("loss_mask", loss_mask)
    check_same_shape(values=values, loss_mask=loss_mask)
    if values.dim() != 2:
        raise ValueError(f"values must be [B, S], got shape {tuple(values.shape)}")
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    masked = masked_values(values, loss_mask)  # [B, S]
    if mode == "token-mean":
        return LossSum(masked.sum(), loss_mask.sum())
    if seq_ids is None:
        per_seq, tokens_per_seq = masked.sum(dim=-1), loss_mask.sum(dim=-1)  # [B]
    else:
        per_seq, tokens_per_seq = _segment_sums(masked, loss_mask, seq_ids)  # [N]
    if sequence_tokens is not None:
        check_same_shape(per_seq=per_seq, sequence_tokens=sequence_tokens)
        tokens_per_seq = sequence_tokens
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / tokens_per_seq.clamp(min=1).to(per_seq.dtype)
    count = (tokens_per_seq > 0).sum()
    return LossSum(per_seq.sum(), count if counts_sequences else torch.zeros_like(count))


def sequence_token_counts(loss_mask: Tensor, seq_ids: Tensor | None) -> Tensor:
    """[N] int64 loss tokens per sequence of ``loss_mask`` [B, S] (per row without ``seq_ids``)."""
    if seq_ids is None:
        return loss_mask.sum(dim=-1)
    check_same_shape(loss_mask=loss_mask, seq_ids=seq_ids)
    ids = seq_ids.reshape(-1)
    count = int(ids.max()) + 1 if ids.numel() else 0
    return torch.zeros(count, dtype=torch.long, device=ids.device).index_add(0, ids, loss_mask.reshape(-1).long())


def _segment_sums(masked: Tensor, loss_mask: Tensor, seq_ids: Tensor) -> tuple[Tensor, Tensor]:
    """[N] sums of ``masked`` [B, S] and [N] int64 loss-token counts per sequence id (N = max id + 1)."""
    check_same_shape(values=masked, seq_ids=seq_ids)
    tokens = sequence_token_counts(loss_mask, seq_ids)
    per_seq = masked.new_zeros(tokens.numel()).index_add(0, seq_ids.reshape(-1), masked.reshape(-1))
    return per_seq, tokens


def add(*parts: LossSum) -> LossSum:
    """Sum several ``LossSum`` (micro-batches); counts add exactly."""
    if not parts:
        raise ValueError("add() needs at least one LossSum")
    return LossSum(sum(p.loss_sum for p in parts), sum(p.count for p in parts))


def divide_by_count(loss_sum: Tensor, count: Tensor) -> Tensor:
    """``loss_sum / count``; a zero count gives ``loss_sum * 0`` so that backward still runs [].

    This is the only division of a loss by its normaliser in the project: the trainer passes the
    count summed over micro-batches and all-reduced over data-parallel ranks.
    """
    safe = count.clamp(min=1).to(loss_sum.dtype)
    return torch.where(count > 0, loss_sum / safe, loss_sum * 0)
