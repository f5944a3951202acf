"""Rollout samples -> the micro-batches (``core.microbatch.MicroBatch``) of the Megatron passes.

A sample is a prompt and one sampled response. Its tokens are ``prompt + response``; position t
predicts token t + 1, so the response's log-probs sit at positions ``len(prompt) - 1 ..
len(prompt) + len(response) - 2``: that is where ``loss_mask`` is True, except at the response
tokens the policy did not generate (a multi-turn response's observations: ``response_mask``
False), which get no loss, KL or entropy term, and except in a sample that does not train
(``Sample.trains``: a truncated response under ``algorithm.mask_truncated``).

``micro_batches`` turns the samples of one mini-batch into the micro-batches of one Megatron call
(``MicroBatchPlan``):

    grouping  ``micro_batch_size`` samples per micro-batch, or (``max_tokens``, packed only) as
              few micro-batches as hold the samples within that many tokens each; packed rows
              are balanced by tokens (``balance.partition``), padded rows group similar lengths
    layout    packed: one row of the group's sequences back to back (``MicroBatch`` docstring);
              padded: one right-padded row per sample
    shape     each micro-batch is cut to its own tokens, rounded up to ``pad_multiple``; under
              pipeline parallelism (``fixed_shape``) to the call's largest, since the stages
              exchange fixed-size activations

``replica_shares`` says which samples each data-parallel replica trains on: with balancing, the samples
of each mini-batch of all replicas of one engine (every rank of them holds them all) are split
between those replicas by estimated compute, so that no replica waits for a heavier one; the
union over replicas, and with it each optimizer step's gradient, is unchanged. Samples that do not
train are left out of every pass: a sample without loss tokens adds 0 to every (sum, count).

A sample scored by a distillation teacher engine (``Sample.teacher``, ``algorithm.distill.placement:
engine``) puts its scores into the micro-batch's ``teacher_*`` at the positions that predict its
tokens 1 .. L-1 (zeros elsewhere): every sample of a micro-batch has them, or none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_empg.core.advantages import token_advantages
from megatron_empg.core.aggregation import masked_values
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.rollout.engine import ROUTED_EXPERT_DTYPE, TopkScores
from megatron_empg.rollout.trajectory import Trajectory
from megatron_empg.trainer.batching.balance import micro_batch_bins, partition


def version_name(step: int) -> str:
    """The label of the weights after ``step`` training steps (the gate's messages name it)."""
    return f"step-{step}"


def version_step(name: str) -> int:
    """The training steps of a ``version_name`` label."""
    return int(name.removeprefix("step-"))


@dataclasses.dataclass
class Sample:
    """One response to one prompt, with everything the step computes about it."""

    prompt_ids: list[int]
    response_ids: list[int]
    sampler_logprobs: list[float]  # [len(response_ids)] from the engine
    finish_reason: str
    group: int  # prompt index within the step (GRPO group)
    example: Any = None  # the rollout.data.PromptExample (its gold answer for the reward)
    response_mask: list[bool] | None = None  # [len(response_ids)], True: generated; None: all generated
    stats: dict[str, float] = dataclasses.field(default_factory=dict)  # rollout counts (turns, searches)
    reward: float = 0.0
    correct: bool = False
    trains: bool = True  # False: no loss term (algorithm.mask_truncated on a truncated response)
    version: int = 0  # the weights that drew it (its first token): training steps done when the engine got them
    token_versions: list[int] | None = None  # [len(response_ids)] per token (rollout.partial); None: all `version`
    routed_experts: torch.Tensor | None = None  # [length - 1, layers, top_k] int16, the engine's routing (Trajectory's)
    teacher: TopkScores | None = None  # [length - 1] positions: a distillation teacher engine's scores of its tokens

    @classmethod
    def from_trajectory(
        cls, example, group: int, trajectory: Trajectory, *, version: int = 0, teacher: TopkScores | None = None
    ) -> Sample:
        """The sample of ``trajectory``, a response to ``example`` (a ``PromptExample``), in ``group``,
        drawn with weights ``version`` (its tokens' own versions, ``version_name`` labels, if it has them);
        ``teacher``: a teacher engine's scores of prompt + response (``placement: engine``)."""
        tokens = None
        if trajectory.versions is not None:
            tokens = [version if label is None else version_step(label) for label in trajectory.versions]
            version = min(tokens, default=version)
        return cls(
            example.prompt_ids,
            trajectory.token_ids,
            trajectory.logprobs,
            trajectory.finish_reason,
            group=group,
            example=example,
            response_mask=trajectory.response_mask,
            stats=dict(trajectory.stats),
            version=version,
            token_versions=tokens,
            routed_experts=trajectory.routed_experts,
            teacher=teacher,
        )

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def generated_ids(self) -> list[int]:
        """The response tokens the policy generated (what the reward reads)."""
        if self.response_mask is None:
            return self.response_ids
        return [token for token, generated in zip(self.response_ids, self.response_mask) if generated]

    @property
    def loss_tokens(self) -> int:
        """Tokens that carry a loss: the generated ones, if the sample trains."""
        return len(self.generated_ids) if self.trains else 0


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    """How one call's samples become micro-batches (module docstring).

    ``max_tokens``: a token budget per micro-batch (packed layout only) instead of
    ``micro_batch_size`` samples. ``fixed_shape``: one [b, s] for every micro-batch of the call
    (pipeline parallelism). ``count_multiple``: the number of micro-batches is a multiple of it
    (the interleaved schedule runs them in groups of the pipeline size). ``segment_multiple``
    (packed only): every sequence's segment, and the row's padding segment, padded to a multiple of
    it (2 x CP under context parallelism: ``parallel.context_parallel``); the padding tokens after
    a sequence are its own, with no loss. ``routing`` (layers, top_k): every micro-batch carries
    the samples' ``routed_experts`` (``algorithm.router_replay``; a sample without them is an
    error); None: none does.
    """

    packing: bool = True
    micro_batch_size: int = 8
    max_tokens: int | None = None
    fixed_shape: bool = False
    count_multiple: int = 1
    pad_multiple: int = 8
    pad_id: int = 0
    segment_multiple: int = 1
    routing: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and not self.packing:
            raise ValueError("a token budget per micro-batch (max_tokens) needs the packed layout")
        if self.segment_multiple > 1 and not self.packing:
            raise ValueError("segments padded to a multiple (context parallelism) need the packed layout")

    @property
    def row_multiple(self) -> int:
        """What each row's length is rounded up to."""
        return math.lcm(self.pad_multiple, self.segment_multiple)


def micro_batches(samples: Sequence[Sample], advantages: Sequence[float], plan: MicroBatchPlan) -> list[MicroBatch]:
    """The micro-batches of one call (on the CPU) holding ``samples`` with their per-sample
    ``advantages``; at least one (``plan.count_multiple``), padding-only if there are no samples.
    A sample longer than ``plan.max_tokens`` is a ValueError naming ``train.max_tokens_per_microbatch``."""
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    lengths = [_round_up(s.length, plan.segment_multiple) for s in samples]
    if plan.max_tokens is not None:
        bins = micro_batch_bins(lengths, plan.max_tokens, multiple_of=plan.count_multiple)
        if plan.fixed_shape:
            bins = _fewest_slots(lengths, bins, plan)
    else:
        count = _round_up(max(1, math.ceil(len(samples) / plan.micro_batch_size)), plan.count_multiple)
        bins = partition(lengths, count, equal_count=True) if plan.packing else _similar_lengths(lengths, count)
    if plan.packing:
        widths = [_round_up(max(sum(lengths[i] for i in b), 1), plan.row_multiple) for b in bins]
        rows = [1] * len(bins)
    else:
        widths = [_round_up(max([lengths[i] for i in b], default=1), plan.pad_multiple) for b in bins]
        rows = [max(len(b), 1) for b in bins]
    if plan.fixed_shape:
        widths, rows = [max(widths)] * len(bins), [max(rows)] * len(bins)
    out = []
    for members, width, row_count in zip(bins, widths, rows):
        chosen, chosen_advantages = [samples[i] for i in members], [float(advantages[i]) for i in members]
        if plan.packing:
            out.append(_packed_row(chosen, chosen_advantages, width, plan.pad_id, plan.segment_multiple, plan.routing))
        else:
            out.append(_padded_rows(chosen, chosen_advantages, width, row_count, plan.pad_id, plan.routing))
    return out


def _fewest_slots(lengths: Sequence[int], bins: list[list[int]], plan: MicroBatchPlan) -> list[list[int]]:
    """Under one shape per call every row is as long as the fullest: a few more rows than the
    budget needs can be shorter in all (fewer slots). The partition with the fewest
    ``count x longest row`` among the budget's count and the next ``_EXTRA_ROWS`` multiples."""

    def slots(candidate: list[list[int]]) -> int:
        return len(candidate) * _round_up(max(sum(lengths[i] for i in b) for b in candidate), plan.row_multiple)

    best = bins
    for extra in range(1, _EXTRA_ROWS + 1):
        candidate = partition(lengths, len(bins) + extra * plan.count_multiple)
        if max(sum(lengths[i] for i in b) for b in candidate) <= plan.max_tokens and slots(candidate) < slots(best):
            best = candidate
    return best


_EXTRA_ROWS = 4


def _similar_lengths(lengths: Sequence[int], count: int) -> list[list[int]]:
    """``count`` groups of consecutive lengths in sorted order (sizes within 1): padded rows of a
    group pad only to its longest."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [sorted(order[j * len(order) // count : (j + 1) * len(order) // count]) for j in range(count)]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Rows:
    """[rows, width] tensors being filled, one sequence at a time."""

    def __init__(self, rows: int, width: int, pad_id: int, routing: tuple[int, int] | None = None) -> None:
        self.input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
        self.target_ids = torch.full((rows, width), pad_id, dtype=torch.long)
        self.loss_mask = torch.zeros((rows, width), dtype=torch.bool)
        self.advantages = torch.zeros((rows, width), dtype=torch.float32)
        self.sampler = torch.zeros((rows, width), dtype=torch.float32)
        self.routed = None if routing is None else filler_routing((rows, width), *routing)
        self.teacher: dict[str, torch.Tensor] = {}  # MicroBatch.teacher_* from the samples' engine scores
        self.untaught = 0  # samples without them

    def put_teacher(self, row: int, offset: int, n: int, scores: TopkScores | None) -> None:
        """A teacher engine's ``scores`` of a sequence of ``n`` tokens at ``[row, offset : offset +
        n - 1]`` (the positions that predict its tokens 1 .. n-1); zeros elsewhere."""
        if scores is None:
            self.untaught += 1
            return
        t, k = scores.ids.shape
        if t != n - 1:
            raise ValueError(f"a sample of {n} tokens has teacher scores of {t} positions, expected {n - 1}")
        if not self.teacher:
            rows, width = self.input_ids.shape
            self.teacher = {
                "teacher_logprobs": torch.zeros(rows, width, dtype=torch.float32),
                "teacher_topk_ids": torch.zeros(rows, width, k, dtype=torch.long),
                "teacher_topk_logprobs": torch.zeros(rows, width, k, dtype=torch.float32),
            }
        if self.teacher["teacher_topk_ids"].shape[-1] != k:
            raise ValueError(f"teacher scores of top-{k} beside top-{self.teacher['teacher_topk_ids'].shape[-1]}")
        span = slice(offset, offset + n - 1)
        self.teacher["teacher_logprobs"][row, span] = scores.target
        self.teacher["teacher_topk_ids"][row, span] = scores.ids
        self.teacher["teacher_topk_logprobs"][row, span] = scores.logprobs

    def put(self, row: int, offset: int, sample: Sample, advantage: float) -> None:
        """``sample``'s tokens at ``[row, offset : offset + length]``; its targets, loss mask,
        advantage and sampler log-probs at the positions that predict its response."""
        tokens = torch.tensor(sample.prompt_ids + sample.response_ids, dtype=torch.long)
        n, p, r = tokens.numel(), len(sample.prompt_ids), len(sample.response_ids)
        self.input_ids[row, offset : offset + n] = tokens
        self.target_ids[row, offset : offset + n - 1] = tokens[1:]
        self.put_teacher(row, offset, n, sample.teacher)
        if self.routed is not None:
            routed = sample.routed_experts
            if routed is None or routed.shape != (n - 1, *self.routed.shape[2:]):
                got = None if routed is None else list(routed.shape)
                raise ValueError(
                    f"algorithm.router_replay: a sample of {n} tokens has routed experts of shape {got}, "
                    f"expected {[n - 1, *self.routed.shape[2:]]} (the engine's routing of all but its "
                    "last token)"
                )
            self.routed[row, offset : offset + n - 1] = routed
        if not r:
            return
        mask = sample.response_mask
        generated = torch.ones(r, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
        if generated.shape != (r,):
            raise ValueError(f"a sample's response_mask has {generated.numel()} entries for {r} response tokens")
        generated &= sample.trains
        span = slice(offset + p - 1, offset + p - 1 + r)
        self.loss_mask[row, span] = generated
        self.advantages[row, span] = token_advantages(torch.tensor([advantage]), generated[None])[0]
        self.sampler[row, span] = masked_values(torch.tensor(sample.sampler_logprobs, dtype=torch.float32), generated)

    def micro_batch(self, **layout) -> MicroBatch:
        if self.teacher and self.untaught:
            raise ValueError(f"{self.untaught} sample(s) of a micro-batch have no teacher scores, the others do")
        return MicroBatch(
            self.input_ids,
            self.target_ids,
            self.loss_mask,
            self.advantages,
            self.sampler,
            routed_experts=self.routed,
            **self.teacher,
            **layout,
        )


def filler_routing(shape: tuple[int, ...], layers: int, top_k: int) -> torch.Tensor:
    """``[*shape, layers, top_k]`` int16 experts 0 .. top_k - 1: the routing of tokens the engine did
    not route (padding, a sequence's last token), whose outputs nothing reads."""
    return torch.arange(top_k, dtype=ROUTED_EXPERT_DTYPE).expand(*shape, layers, top_k).clone()


def _padded_rows(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    width: int,
    rows: int,
    pad_id: int,
    routing: tuple[int, int] | None = None,
):
    """One right-padded row per sample (and padding-only rows up to ``rows``)."""
    out = _Rows(rows, width, pad_id, routing)
    for row, (sample, advantage) in enumerate(zip(samples, advantages)):
        out.put(row, 0, sample, advantage)
    return out.micro_batch()


def _packed_row(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    width: int,
    pad_id: int,
    segment_multiple: int = 1,
    routing: tuple[int, int] | None = None,
):
    """One row of the samples back to back (each in a segment padded to ``segment_multiple``),
    then padding (its own segment)."""
    out = _Rows(1, width, pad_id, routing)
    lengths = [_round_up(s.length, segment_multiple) for s in samples]
    offset = 0
    for sample, advantage, length in zip(samples, advantages, lengths):
        out.put(0, offset, sample, advantage)
        offset += length
    if offset < width:
        lengths.append(width - offset)
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.arange(width) - bounds[seq_ids]
    return out.micro_batch(
        position_ids=positions[None], seq_ids=seq_ids[None], cu_seqlens=bounds.to(torch.int32), max_seqlen=max(lengths)
    )


def replica_shares(
    lengths: Sequence[Sequence[int]],
    trains: Sequence[Sequence[bool]],
    *,
    mini_batches: int,
    cost: Callable[[int], float] | None,
) -> list[list[list[tuple[int, int]]]]:
    """Which samples each of the R replicas of one engine trains on, ``[R][mini-batch]`` lists of
    ``(replica r, sample i)`` pairs into ``lengths`` / ``trains`` ([R][B]).

    Mini-batch j holds each replica's samples ``[j * B / mini_batches, (j + 1) * B / mini_batches)``
    that train. ``cost`` None (or R = 1): each replica keeps its own. Else the pool of mini-batch j
    over all R replicas is split into R parts of balanced ``cost`` (the sequence's estimated
    compute, from its length), part k to replica k: every rank computes the same.
    """
    count, per_replica = len(lengths), len(lengths[0]) if lengths else 0
    if per_replica % mini_batches:
        raise ValueError(f"{per_replica} samples per replica do not split into {mini_batches} mini-batches")
    size = per_replica // mini_batches
    shares: list[list[list[tuple[int, int]]]] = [[] for _ in range(count)]
    for j in range(mini_batches):
        members = range(j * size, (j + 1) * size)
        if cost is None or count == 1:
            for r in range(count):
                shares[r].append([(r, i) for i in members if trains[r][i]])
            continue
        pool = [(r, i) for r in range(count) for i in members if trains[r][i]]
        parts = partition([cost(lengths[r][i]) for r, i in pool], count)
        for r in range(count):
            shares[r].append([pool[k] for k in parts[r]])
    return shares
