"""The update-pass objective from a vocab shard: policy-gradient loss + beta * KL - c * entropy.

Everything per token is computed from this rank's logits shard [B, S, V_local] with one pass of
``vocab_parallel_logprobs`` (log pi at the sampled token, and at the Top-k index set when the KL
is Top-k; the entropy only when it has a coefficient or is logged), or from the output layer's
input and weight shard (``fused_output.OutputLayerInput``) with ``fused_output_logprobs``, which
never holds more than one chunk of the logits; then the ``core`` losses:

    loss = agg(policy loss) + kl_coef * agg(KL) - entropy_coef * agg(H) [+ coef * distill]

With a distillation term (``core.distill.term.DistillTerm``, bound from ``algorithm.distill``), the
student's log-probs at the teacher's top-k ids (a Top-k loss) are gathered in the same pass, and
without task rewards (``use_task_rewards`` false) the policy loss drops out (KL and entropy stay).

With ``batch.behavior_weights`` w (``core.behavior_is``: samples drawn by an engine whose policy
mu is not pi_old), every term that is an expectation over the sampled token is multiplied by w.

All three terms use the same aggregation mode, so they share one count, and the result is a
``LossSum`` (sum, count): the caller divides once by the count summed over micro-batches and
data-parallel ranks (Megatron's ``calculate_per_token_loss``). Metrics are token-mean
``LossSum``\\ s of detached per-token values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.core.aggregation import LossSum, aggregate, sequence_token_counts
from megatron_empg.core.checks import check_choice, check_same_shape
from megatron_empg.core.distill.term import DistillTerm, zero_like
from megatron_empg.core.kl_term import KLTerm, bind_kl
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.core.policy_loss import POLICY_LOSSES
from megatron_empg.core.rpg import RPG_POLICY_LOSSES
from megatron_empg.parallel.fused_output import OutputLayerInput, fused_output_logprobs
from megatron_empg.parallel.vocab_parallel import vocab_parallel_logprobs

ALL_POLICY_LOSSES = {**POLICY_LOSSES, **RPG_POLICY_LOSSES}


class RLLoss(NamedTuple):
    """``loss``: the objective as (sum, count); ``metrics``: name -> token-mean ``LossSum``."""

    loss: LossSum
    metrics: dict[str, LossSum]


def check_rl_loss_options(policy_loss: str, kl: KLTerm | None, kl_coef: float, entropy_coef: float) -> None:
    """Raise ValueError naming the option unless the combination is valid."""
    check_choice("policy_loss", policy_loss, tuple(ALL_POLICY_LOSSES))
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef!r} must be >= 0")
    if kl is None and kl_coef != 0:
        raise ValueError(f"kl_coef={kl_coef!r} needs a kl estimator (kl is None)")
    if entropy_coef < 0:
        raise ValueError(f"entropy_coef={entropy_coef!r} must be >= 0 (it is a bonus: loss -= coef * H)")


def rl_loss(
    vocab_parallel_logits: Tensor | OutputLayerInput,
    batch: MicroBatch,
    *,
    vocab_start: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None = None,
    policy_loss: str = "ppo_clip",
    policy_loss_args: dict | None = None,
    kl: KLTerm | str | None = None,
    kl_coef: float = 0.0,
    kl_args: dict | None = None,
    entropy_coef: float = 0.0,
    log_entropy: bool = True,
    agg_mode: str = "token-mean",
    chunk_size: int | None = None,
    inplace_backward: bool = False,
    distill: DistillTerm | None = None,
    validate: bool = True,
) -> RLLoss:
    """The update-pass objective of one micro-batch from this rank's vocab shard (module docstring).

    Args:
        vocab_parallel_logits: [B, S, V_local] (bf16 or fp32), this TP rank's columns; or an
            ``OutputLayerInput`` (hidden [B, S, H], weight [V_local, H]) whose logits they are.
        batch: the ``MicroBatch`` (padded or packed) with ``target_ids``, ``loss_mask``,
            ``advantages``, ``old_logprobs`` and what the KL needs (``anchor_logprobs``, and
            ``topk_ids`` / ``topk_anchor_logprobs`` for a Top-k KL), and ``behavior_weights``
            (or None: no correction); the seq-mean modes average over its sequences (``seq_ids``),
            not its rows.
        vocab_start, vocab_size, tp_group: the vocab shard (see ``vocab_parallel_logprobs``).
        cp_group: the context-parallel group when ``batch`` is one rank's share of rows split
            over it (``parallel.context_parallel``): the seq-mean modes divide by each sequence's
            loss tokens over the group, and its rank 0 counts the sequences. None: whole rows.
        policy_loss: a key of ``ALL_POLICY_LOSSES`` (``ppo_clip`` covers GRPO, DAPO, dual-clip;
            ``rpg*`` the RPG surrogates); ``policy_loss_args``: its keyword arguments.
        kl: None, the bound KL term (``core.kl_term.KLTerm``: a sampled estimator of ``core.kl``,
            the Top-k KL, an RPG penalty or the corrected GRPO KL), or its name, a key of
            ``core.kl_term.KL_KINDS``, bound here with ``kl_args`` (``core.kl_term.bind_kl``; the
            function checks its keywords at the call); ``kl_args`` only with a name.
        kl_coef: beta >= 0. entropy_coef: the entropy bonus c >= 0.
        log_entropy: compute the entropy for the metrics even when ``entropy_coef`` is 0.
        agg_mode: ``core.aggregation.AGG_MODES``.
        chunk_size: tokens per chunk; None: the default of the path (``core.logprob.DEFAULT_CHUNK_SIZE``
            for logits, ``fused_output.FUSED_CHUNK_SIZE`` for an ``OutputLayerInput``).
        inplace_backward: write the logits gradient into ``vocab_parallel_logits`` (no logits
            tensor with an ``OutputLayerInput``: ignored).
        distill: the distillation term, or None; ``batch`` then carries the teacher's log-probs.

    Returns:
        ``RLLoss``; ``loss.loss_sum`` carries the gradient.
    """
    if kl_args and not isinstance(kl, str):
        raise ValueError("kl_args go with a kl name; a bound KLTerm carries its arguments")
    kl = bind_kl(kl, kl_args, check_args=False) if isinstance(kl, str) else kl
    check_rl_loss_options(policy_loss, kl, kl_coef, entropy_coef)
    fused = isinstance(vocab_parallel_logits, OutputLayerInput)
    rows = vocab_parallel_logits.hidden if fused else vocab_parallel_logits  # [B, S, H] or [B, S, V_local]
    if rows.dim() != 3:
        raise ValueError(f"{'hidden' if fused else 'vocab_parallel_logits'} must be [B, S, *], got {tuple(rows.shape)}")
    lead = rows.shape[:2]
    num_tokens = lead.numel()
    ids = batch.target_ids.unsqueeze(-1) if kl is None else kl.gather_ids(batch, lead_shape=lead, vocab_size=vocab_size)
    head_ids = distill.gather_ids(batch) if distill is not None else None  # [B, S, K] or None
    num_head = 0 if head_ids is None else head_ids.shape[-1]
    if head_ids is not None:
        ids = torch.cat([head_ids, ids], dim=-1)  # [B, S, K + M + 1]
    ids = ids.reshape(num_tokens, -1)  # [T, (K +) M + 1], the target last
    check_same_shape(target_ids=batch.target_ids, behavior_weights=batch.behavior_weights)
    with_entropy = entropy_coef > 0 or log_entropy
    shard = dict(
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        tp_group=tp_group,
        with_entropy=with_entropy,
        validate=validate,
        **({"chunk_size": chunk_size} if chunk_size else {}),
    )
    if fused:
        gathered, entropy = fused_output_logprobs(
            rows.reshape(num_tokens, -1), vocab_parallel_logits.weight, ids, **shard
        )
    else:
        gathered, entropy = vocab_parallel_logprobs(
            rows.reshape(num_tokens, -1), ids, inplace_backward=inplace_backward, **shard
        )
    gathered = gathered.reshape(*lead, -1)
    head, gathered = (gathered[..., :num_head], gathered[..., num_head:]) if num_head else (None, gathered)
    logprobs = gathered[..., -1]  # [B, S] log pi(target)
    mask = batch.loss_mask
    old = batch.old_logprobs
    seq_ids = batch.seq_ids
    # The tokens were sampled from mu, so each term whose expectation is over the sampled token
    # (policy gradient, sampled KLs, RPG terms, the Top-k tail) is weighted by w ~ pi_old / mu to
    # be an expectation under pi_old; the Top-k head and the entropy are exact sums over the
    # vocabulary at a position: unweighted. None: no correction (the same code path as before).
    weights = batch.behavior_weights

    pg = ALL_POLICY_LOSSES[policy_loss](logprobs, old, batch.advantages, **(policy_loss_args or {}), validate=validate)
    split = _context_parallel(mask, seq_ids, cp_group) if agg_mode != "token-mean" else {}
    total = aggregate(_weighted(pg.values, weights), mask, agg_mode, seq_ids, **split)
    metrics = {"policy_loss": LossSum(total.loss_sum.detach(), total.count)}
    for name, values in pg.metrics.items():
        metrics[name] = aggregate(values, mask)
    if distill is not None:
        out = distill(head, logprobs, batch, weights=weights, agg_mode=agg_mode, split=split, validate=validate)
        total = total if distill.use_task_rewards else zero_like(total)
        total = LossSum(total.loss_sum + distill.coef * out.loss.loss_sum, total.count)
        metrics.update(out.metrics)
    if kl is not None:
        kl_values = kl(gathered, batch, weights=weights, validate=validate)  # [B, S]
        kl_sum = aggregate(kl_values, mask, agg_mode, seq_ids, **split)
        total = LossSum(total.loss_sum + kl_coef * kl_sum.loss_sum, total.count)
        metrics["kl"] = aggregate(kl_values.detach(), mask)
    if entropy is not None:
        entropy = entropy.reshape(lead)
        if entropy_coef > 0:
            bonus = aggregate(entropy, mask, agg_mode, seq_ids, **split).loss_sum
            total = LossSum(total.loss_sum - entropy_coef * bonus, total.count)
        metrics["entropy"] = aggregate(entropy.detach(), mask)
    metrics["loss"] = LossSum(total.loss_sum.detach(), total.count)
    return RLLoss(total, metrics)


def loss_units(batch: MicroBatch, *, agg_mode: str = "token-mean", cp_group: dist.ProcessGroup | None = None) -> Tensor:
    """[] int64: the count ``rl_loss`` returns for ``batch`` under ``agg_mode`` (its loss tokens,
    or its sequences with a loss token), without the logits: what the step knows before its
    update pass (``mcore.moe.routing``'s router-loss scale)."""
    mask = batch.loss_mask
    split = _context_parallel(mask, batch.seq_ids, cp_group) if agg_mode != "token-mean" else {}
    return aggregate(torch.zeros(mask.shape, device=mask.device), mask, agg_mode, batch.seq_ids, **split).count


def _context_parallel(mask: Tensor, seq_ids: Tensor | None, cp_group: dist.ProcessGroup | None) -> dict:
    """``aggregate``'s arguments for a micro-batch split over ``cp_group``: each sequence's loss
    tokens over the group (one all-reduce of [N] int64) and whether this rank counts sequences."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return {}
    tokens = sequence_token_counts(mask, seq_ids)
    dist.all_reduce(tokens, group=cp_group)
    return {"sequence_tokens": tokens, "counts_sequences": dist.get_rank(cp_group) == 0}


def _weighted(values: Tensor, weights: Tensor | None) -> Tensor:
    """``values`` * ``weights`` [same shape], or ``values`` itself when there are no weights."""
    return values if weights is None else values * weights
