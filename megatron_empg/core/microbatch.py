"""``MicroBatch``: the tokens of one forward (and backward) call, and everything per token that
the passes compute about them. The trainer builds it (``trainer.batching.batch``); the Megatron passes
(``mcore.step``) read its ids and layout and fill in the old and anchor statistics; the update
objective (``parallel.rl_loss``) reads the rest. Position t of a row predicts ``target_ids[t]``.

Two layouts of [b, s] rows:

    padded   b rows, one sequence each, right-padded; positions 0 .. s-1; ``seq_ids``,
             ``position_ids`` and ``cu_seqlens`` are None.
    packed   one row (b = 1) of several sequences back to back, then padding: ``position_ids``
             restart at 0 for every sequence, ``seq_ids`` numbers the sequences, and ``cu_seqlens``
             holds their boundaries (Megatron's THD ``PackedSeqParams``). The padding after the
             last sequence is one more segment of its own, so that ``cu_seqlens[-1] == s`` and
             attention never crosses into or out of it.

Every per-token tensor follows the layout, so a loss that sums over a sequence reads ``seq_ids``
(``core.aggregation.aggregate``), never the row.

Context parallelism (``parallel.context_parallel.split_microbatch``): a packed row split over
``cp_size`` ranks. Every ``cu_seqlens`` segment (length a multiple of 2 * cp_size) is cut into
2 * cp_size equal chunks, and rank r keeps chunks r and 2 * cp_size - 1 - r of each, segment after
segment (the load-balanced causal split of Megatron / Transformer Engine). Its per-token tensors
are then [1, S / cp_size]: ``position_ids`` stay each token's position within its sequence and
``seq_ids`` its sequence, while ``cu_seqlens`` and ``max_seqlen`` still describe the FULL row
(every rank knows the whole layout; attention gathers the other ranks' keys).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass
class MicroBatch:
    """One call's tokens and per-token values (module docstring); B = rows, S = row length.

    Attributes:
        input_ids: [B, S] int64.
        target_ids: [B, S] int64, the token position t predicts (the pad id where nothing is).
        loss_mask: [B, S] bool, True at the response tokens that carry a loss.
        advantages: [B, S] float32, the sequence's advantage on its loss tokens, 0 elsewhere.
        sampler_logprobs: [B, S] float32, the engine's log-prob of the target on loss tokens, 0 elsewhere.
        position_ids: [B, S] int64 per-sequence positions (packed), or None (padded: 0 .. S-1).
        seq_ids: [B, S] int64 index of the sequence each position belongs to (packed), or None
            (padded: the row is the sequence).
        cu_seqlens: [N + 1] int32 boundaries of the N segments of the packed row (the sequences,
            then the padding if any), or None.
        max_seqlen: the longest segment of ``cu_seqlens`` (0 when padded).
        old_logprobs: [B, S] float32 log pi_old(target), from the old pass.
        behavior_weights: [B, S] float32 importance weights of the sampled-token terms against the
            engine's policy (``core.behavior_is``; 1.0 off the loss tokens), or None (no correction).
        anchor_logprobs: [B, S] float32 log pi_ref(target), from the anchor pass (a KL only).
        topk_ids: [B, S, K] int64 Top-k index set (a Top-k KL only).
        topk_anchor_logprobs: [B, S, K] float32 log pi_ref at ``topk_ids`` (a Top-k KL only).
        teacher_logprobs: [B, S] float32 log pi_teacher(target), from the teacher pass (distillation only).
        teacher_topk_ids: [B, S, K] int64 the teacher's top-k ids, descending (distillation only).
        teacher_topk_logprobs: [B, S, K] float32 log pi_teacher at ``teacher_topk_ids``.
        student_top1: [B, S] int64 the policy's top-1 id from the old pass (distillation's metrics), or None.
        routed_experts: [B, S, L, k] int16, the experts the engine routed each token to in each of
            the L MoE layers (``algorithm.router_replay``), replayed by every pass; padding and each
            sequence's last token (no engine routing, no loss) hold experts 0 .. k-1. None: the
            trainer's router decides.
        cp_size: context-parallel ranks the packed row is split over (1: the whole row is here).
        cp_rank: which of them holds this share. With ``cp_size`` > 1 every per-token tensor is
            this rank's [1, S_full / cp_size] (module docstring) and ``cu_seqlens`` / ``max_seqlen``
            are the full row's; ``shape`` is the local (1, S_full / cp_size).
    """

    input_ids: Tensor
    target_ids: Tensor
    loss_mask: Tensor | None = None
    advantages: Tensor | None = None
    sampler_logprobs: Tensor | None = None
    position_ids: Tensor | None = None
    seq_ids: Tensor | None = None
    cu_seqlens: Tensor | None = None
    max_seqlen: int = 0
    old_logprobs: Tensor | None = None
    behavior_weights: Tensor | None = None
    anchor_logprobs: Tensor | None = None
    topk_ids: Tensor | None = None
    topk_anchor_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    teacher_topk_ids: Tensor | None = None
    teacher_topk_logprobs: Tensor | None = None
    student_top1: Tensor | None = None
    routed_experts: Tensor | None = None
    cp_size: int = 1
    cp_rank: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def shape(self) -> tuple[int, int]:
        """(B, S): the local shape (under context parallelism, this rank's share of the row)."""
        return tuple(self.input_ids.shape)

    def to(self, device: torch.device) -> MicroBatch:
        """A copy with every tensor on ``device``."""
        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, Tensor)})


@dataclasses.dataclass(frozen=True)
class StatsResult:
    """One micro-batch's per-token statistics from a forward-only pass (``mcore.step.forward_stats``:
    the old pass on the policy, the anchor pass on the anchor), on the model's device; [b, s] is
    the micro-batch's shape, k the request's top-k, M its number of extra ids per token.

    Attributes:
        logprobs: [b, s] float32 log pi at the targets.
        lse: [b, s] float32 logsumexp of the logits over the real vocabulary.
        topk_ids: [b, s, k] int64 global ids of the top-k (descending), or None (k = 0).
        topk_logprobs: [b, s, k] float32 their log-probs, or None (k = 0).
        extra_logprobs: [b, s, M] float32 log pi at the extra ids (the anchor pass of a reverse
            Top-k KL: the policy's top-k), or None (none requested).
        entropy: [b, s] float32, or None (not requested).
    """

    logprobs: Tensor
    lse: Tensor
    topk_ids: Tensor | None = None
    topk_logprobs: Tensor | None = None
    extra_logprobs: Tensor | None = None
    entropy: Tensor | None = None

    def columns(self, start: int, stop: int) -> StatsResult:
        """Every statistic's positions ``[start, stop)`` of dimension 1 (views)."""
        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return StatsResult(**{name: t if t is None else t[:, start:stop] for name, t in tensors.items()})
