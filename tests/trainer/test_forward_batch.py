"""``trainer.batching.forward_batch``: the update's packed rows back to back for the forward-only passes
(``train.max_tokens_per_forward_microbatch``).

Layout: splitting a forward row gives back every per-token field of every update row; the merged
row's ``cu_seqlens`` are each row's boundaries (its padding segment included) shifted by the rows
before, its ``seq_ids`` and ``position_ids`` follow from them; the budget bounds every forward row
and the greedy fill leaves no two neighbours that would fit together; under pipeline parallelism
every row has one width (a trailing padding segment), the narrowest that needs no more rows, and
under VPP their number is a multiple of PP.

Numerics (Megatron on gloo, float32, ``tiny-qwen2``): ``forward_stats`` on the forward rows, split
back, equals ``forward_stats`` on the update rows: log-probs at the targets and at extra ids, the
logsumexp and the top-k log-probs to 1e-5, the top-k ids exactly, at TP1 and at PP2 x VPP2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_empg.config import ParallelConfig, load_model_config
from megatron_empg.core.microbatch import MicroBatch, StatsResult
from megatron_empg.trainer.batching.batch import MicroBatchPlan, Sample, micro_batches
from megatron_empg.trainer.batching.forward_batch import ForwardPlan, forward_rows
from tests.dist import run_distributed

MODEL = "tiny-qwen2"
K = 4
# fp32 log-probs of the same tokens through GEMMs of other shapes: observed differences ~1e-7
ATOL = 1e-5
PER_TOKEN = [
    f.name for f in dataclasses.fields(MicroBatch) if f.name not in ("cu_seqlens", "max_seqlen", "cp_size", "cp_rank")
]


def _samples(count: int, seed: int, vocab: int = 250) -> list[Sample]:
    """``count`` samples of prompts of 3..8 tokens and responses of 2..30 (skewed)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(2, vocab, (3 + (5 * i) % 6,), generator=g).tolist()
        response = torch.randint(2, vocab, (30 if i % 5 == 1 else 2 + (7 * i) % 13,), generator=g).tolist()
        out.append(Sample(prompt, response, (-torch.rand(len(response), generator=g)).tolist(), "stop", group=i))
    return out


# (samples, update token budget) per Megatron call (a mini-batch): rows of 32 to 96 tokens holding
# 2 to 7 sequences, most ending in a padding segment
CALLS = [(6, 40), (8, 96), (5, 56), (3, 64)]


def _update_rows(calls=CALLS, seed: int = 0, *, fixed_shape: bool = False, count_multiple: int = 1) -> list[MicroBatch]:
    """The packed update micro-batches of one step's ``calls``, with every per-token field of a step
    after its passes set (random values). Under ``fixed_shape`` one width per call, not per step."""
    micro = []
    for j, (count, budget) in enumerate(calls):
        plan = MicroBatchPlan(max_tokens=budget, fixed_shape=fixed_shape, count_multiple=count_multiple, pad_id=1)
        micro += micro_batches(_samples(count, seed + j), torch.linspace(-1, 1, count).tolist(), plan)
    g = torch.Generator().manual_seed(seed + 100)
    for mb in micro:
        s = mb.shape[1]
        mb.old_logprobs, mb.anchor_logprobs = -torch.rand(1, s, generator=g), -torch.rand(1, s, generator=g)
        mb.behavior_weights = torch.rand(1, s, generator=g)
        mb.topk_ids = torch.randint(0, 250, (1, s, K), generator=g)
        mb.topk_anchor_logprobs = -torch.rand(1, s, K, generator=g)
        mb.routed_experts = torch.randint(0, 8, (1, s, 2, 2), generator=g).to(torch.int16)  # router replay
        mb.teacher_logprobs = -torch.rand(1, s, generator=g)  # distillation
        mb.teacher_topk_ids = torch.randint(0, 250, (1, s, K), generator=g)
        mb.teacher_topk_logprobs = -torch.rand(1, s, K, generator=g)
        mb.student_top1 = torch.randint(0, 250, (1, s), generator=g)
    return micro


def _fewest_then_narrowest(widths: list[int], budget: int, multiple: int) -> tuple[int, int]:
    """Brute force over every split of ``widths`` into consecutive groups: the fewest groups (a
    multiple of ``multiple``) whose sums stay within ``budget``, and the smallest largest sum at
    that count."""
    best: dict[int, int] = {}
    n = len(widths)
    for cuts in range(2 ** (n - 1)):
        bounds = [0, *(i + 1 for i in range(n - 1) if cuts >> i & 1), n]
        largest = max(sum(widths[a:b]) for a, b in zip(bounds, bounds[1:]))
        count = len(bounds) - 1
        if largest <= budget and count % multiple == 0:
            best[count] = min(best.get(count, largest), largest)
    fewest = min(best)
    return fewest, best[fewest]


def _assert_split_gives_back_every_field(micro: list[MicroBatch], rows) -> None:
    for name in PER_TOKEN:
        parts = rows.split([getattr(b, name) for b in rows.batches])
        for mb, part in zip(micro, parts, strict=True):
            expected = getattr(mb, name)
            if name == "seq_ids":  # renumbered in the forward row: the row's first sequence is 0 in its own
                part = part - part[0, 0]
            assert part.dtype == expected.dtype and torch.equal(part, expected), name


def _assert_consistent_layout(batch: MicroBatch) -> None:
    """A packed row as ``core.microbatch`` defines it: ``seq_ids`` number the ``cu_seqlens``
    segments, positions restart at each, the last bound is the row's length."""
    cu = batch.cu_seqlens.long()
    lengths = cu.diff()
    assert cu[0] == 0 and cu[-1] == batch.shape[1] and (lengths > 0).all()
    assert torch.equal(batch.seq_ids[0], torch.repeat_interleave(torch.arange(len(lengths)), lengths))
    assert torch.equal(batch.position_ids[0], torch.arange(batch.shape[1]) - cu[batch.seq_ids[0]])
    assert batch.max_seqlen == int(lengths.max()) and batch.cu_seqlens.dtype == torch.int32


def test_merge_then_split_is_the_identity_on_every_field():
    micro = _update_rows()
    widths = [mb.shape[1] for mb in micro]
    assert len(set(widths)) > 2 and len({len(mb.cu_seqlens) for mb in micro}) > 2  # rows differ
    assert any(mb.cu_seqlens[-2] < mb.shape[1] for mb in micro)  # some rows end in a padding segment
    rows = forward_rows(micro, ForwardPlan(max_tokens=160))
    assert 1 < len(rows.batches) < len(micro)
    _assert_split_gives_back_every_field(micro, rows)
    for batch in rows.batches:
        _assert_consistent_layout(batch)


def test_forward_row_holds_each_rows_segments_shifted_by_the_rows_before():
    micro = _update_rows()
    rows = forward_rows(micro, ForwardPlan(max_tokens=160))
    for j, batch in enumerate(rows.batches):
        members = [i for i, span in enumerate(rows.spans) if span.row == j]
        expected, offset = [0], 0
        for i in members:
            assert rows.spans[i].start == offset and rows.spans[i].width == micro[i].shape[1]
            expected += (micro[i].cu_seqlens[1:] + offset).tolist()  # sequences, then the row's padding
            offset += micro[i].shape[1]
        assert batch.cu_seqlens.tolist() == expected and batch.shape == (1, offset)  # no padding without PP
        assert batch.max_seqlen == max(micro[i].max_seqlen for i in members)
    assert [s.row for s in rows.spans] == sorted(s.row for s in rows.spans)  # consecutive, in order


@pytest.mark.parametrize("budget", [96, 100, 160, 400, 10_000])
def test_budget_bounds_every_row_and_the_fill_is_greedy(budget):
    micro = _update_rows(seed=3)
    rows = forward_rows(micro, ForwardPlan(max_tokens=budget))
    widths = [b.shape[1] for b in rows.batches]
    assert all(w <= budget for w in widths)
    assert len(widths) == _fewest_then_narrowest([mb.shape[1] for mb in micro], budget, 1)[0]
    assert sum(widths) == sum(mb.shape[1] for mb in micro)
    for j in range(len(widths) - 1):  # the next row's first update row did not fit this one
        first = next(i for i, span in enumerate(rows.spans) if span.row == j + 1)
        assert widths[j] + micro[first].shape[1] > budget
    if budget == 10_000:
        assert len(rows.batches) == 1


@pytest.mark.parametrize("multiple", [1, 2])
@pytest.mark.parametrize("budget", [96, 120, 200, 300])
def test_pipeline_rows_share_the_narrowest_width_with_a_trailing_padding_segment(budget, multiple):
    micro = _update_rows(CALLS[:3], seed=3, fixed_shape=True, count_multiple=multiple)
    widths = [mb.shape[1] for mb in micro]
    assert len(set(widths)) > 1  # one width per call, calls of different widths
    rows = forward_rows(micro, ForwardPlan(max_tokens=budget, fixed_shape=True, count_multiple=multiple))
    count, width = _fewest_then_narrowest(widths, budget, multiple)
    assert [b.shape for b in rows.batches] == [(1, width)] * count
    _assert_split_gives_back_every_field(micro, rows)
    padded = 0
    for j, batch in enumerate(rows.batches):
        _assert_consistent_layout(batch)
        used = sum(span.width for span in rows.spans if span.row == j)
        if used < width:  # the padding: one segment of its own, after the rows' own
            padded += 1
            assert batch.cu_seqlens[-2:].tolist() == [used, width]
            assert batch.position_ids[0, used:].tolist() == list(range(width - used))
            assert not batch.loss_mask[0, used:].any() and not batch.input_ids[0, used:].any()
    assert padded > 0


def test_without_a_budget_the_update_rows_are_the_forward_rows():
    micro = _update_rows()
    rows = forward_rows(micro, ForwardPlan(fixed_shape=True))
    assert all(a is b for a, b in zip(rows.batches, micro, strict=True))
    stats = [StatsResult(logprobs=mb.old_logprobs, lse=mb.old_logprobs.exp(), topk_ids=mb.topk_ids) for mb in micro]
    for out, mb in zip(rows.split_stats(stats), micro, strict=True):
        assert torch.equal(out.logprobs, mb.old_logprobs) and torch.equal(out.topk_ids, mb.topk_ids)


def test_split_stats_gives_each_update_row_its_columns_of_every_statistic():
    micro = _update_rows()
    rows = forward_rows(micro, ForwardPlan(max_tokens=160))
    assert 1 < len(rows.batches) < len(micro)
    outputs = [  # what a pass without entropy and extra ids gives per forward row
        StatsResult(
            logprobs=b.old_logprobs, lse=b.anchor_logprobs, topk_ids=b.topk_ids, topk_logprobs=b.topk_anchor_logprobs
        )
        for b in rows.batches
    ]
    for out, mb in zip(rows.split_stats(outputs), micro, strict=True):
        assert torch.equal(out.logprobs, mb.old_logprobs) and torch.equal(out.lse, mb.anchor_logprobs)
        assert torch.equal(out.topk_ids, mb.topk_ids) and torch.equal(out.topk_logprobs, mb.topk_anchor_logprobs)
        assert out.extra_logprobs is None and out.entropy is None


def test_rows_the_budget_cannot_take_are_errors():
    micro = _update_rows()
    widest = max(mb.shape[1] for mb in micro)
    with pytest.raises(ValueError, match=rf"a row of {widest} tokens exceeds train\.max_tokens_per_forward_microbatch"):
        forward_rows(micro, ForwardPlan(max_tokens=widest - 1))
    (padded,) = micro_batches(_samples(4, 0), [0.0] * 4, MicroBatchPlan(packing=False, micro_batch_size=4))
    with pytest.raises(ValueError, match="needs packed rows"):
        forward_rows([padded], ForwardPlan(max_tokens=1000))
    micro[1].topk_ids = None
    with pytest.raises(ValueError, match="topk_ids is set on some"):
        forward_rows(micro[:2], ForwardPlan(max_tokens=1000))


# ---------------------------------------------------------------- numerics (Megatron)


def _stats_both_ways(rank: int, world_size: int, parallel: ParallelConfig, budget: int) -> dict:
    """Per update micro-batch (two calls, ``CALLS[1:3]``, of rows of different widths): the old
    pass (top-k) and an anchor-style pass (the old top-k as extra ids, and the entropy) on the
    update rows and on forward rows of ``budget`` tokens."""
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, share_stats

    model = load_model_config(MODEL)
    pp, vpp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    groups = initialize_model_parallel(parallel, seed=5)
    try:
        models = build_gpt_model(model, parallel)
        calls = [
            _update_rows([c], seed=j, fixed_shape=pp > 1, count_multiple=pp if vpp else 1)
            for j, c in enumerate(CALLS[1:3])
        ]
        micro = [mb for call in calls for mb in call]
        for mb in micro:  # the passes fill these
            mb.old_logprobs = mb.anchor_logprobs = mb.behavior_weights = mb.topk_ids = mb.topk_anchor_logprobs = None
        plan = ForwardPlan(max_tokens=budget, fixed_shape=pp > 1, count_multiple=pp if vpp else 1)

        def stats(batches, request):
            return share_stats(forward_stats(models, batches, request, groups), batches, request, groups)

        def per_call(request):  # the reference: the update rows, one call per shape under PP
            return [out for call in calls for out in stats(call, request)]

        old = StatsRequest(vocab_size=model.vocab_size, k=K, with_entropy=False)
        rows = forward_rows(micro, plan)
        update_old, forward_old = per_call(old), rows.split_stats(stats(rows.batches, old))
        one_call = stats(micro, old)  # both calls' rows in one pass (under PP: one schedule call per width)
        for mb, out in zip(micro, update_old):
            mb.topk_ids = out.topk_ids
        anchor = StatsRequest(vocab_size=model.vocab_size, k=K, extra_ids_key="topk_ids", with_entropy=True)
        rows = forward_rows(micro, plan)  # again, with the extra ids
        update_anchor, forward_anchor = per_call(anchor), rows.split_stats(stats(rows.batches, anchor))
        return {
            "update": list(zip(update_old, update_anchor)),
            "forward": list(zip(forward_old, forward_anchor)),
            "one_call": one_call,
            "widths": [mb.shape[1] for mb in micro],
            "rows": rows.batches,
            "spans": rows.spans,
        }
    finally:
        destroy_model_parallel()


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.parametrize(
    "world_size, parallel",
    [
        (1, ParallelConfig()),
        (2, ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    ],
    ids=["tp1", "pp2vpp2"],
)
def test_forward_rows_give_the_update_rows_statistics(world_size, parallel):
    for rank, result in enumerate(run_distributed(_stats_both_ways, world_size, parallel, 160, timeout=240)):
        shapes = [b.shape for b in result["rows"]]
        assert len(set(result["widths"])) > 1 and len(shapes) < len(result["widths"])  # rows merged
        if world_size > 1:  # one width, a multiple of PP rows, some padded
            assert len(set(shapes)) == 1 and len(shapes) % 2 == 0
            assert any(
                b.cu_seqlens[-2] < b.shape[1] and b.seq_ids[0, -1] > b.seq_ids[0, b.cu_seqlens[-2] - 1]
                for b in result["rows"]
            )
        for i, pair in enumerate(zip(result["update"], result["forward"], strict=True)):
            for update, forward in zip(*pair, strict=True):
                for name in (f.name for f in dataclasses.fields(update)):
                    expected, actual = getattr(update, name), getattr(forward, name)
                    assert (actual is None) == (expected is None), (rank, i, name)
                    if expected is None:
                        continue
                    assert actual.shape == expected.shape, (rank, i, name)
                    if name == "topk_ids":
                        assert torch.equal(actual, expected), (rank, i)
                    else:
                        torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL, msg=f"{rank} {i} {name}")
        anchor = result["update"][0][1]
        assert anchor.extra_logprobs is not None and anchor.entropy is not None
        for (expected, _), actual in zip(result["update"], result["one_call"], strict=True):
            assert torch.equal(actual.topk_ids, expected.topk_ids)
            torch.testing.assert_close(actual.logprobs, expected.logprobs, rtol=0, atol=ATOL)
