"""``parallel.context_parallel``: the load-balanced split of a packed row over CP ranks.

Every index ``CpChunks`` builds is checked against a brute-force construction from python lists
(each segment cut into 2 * cp chunks, rank r keeping chunks r and 2 * cp - 1 - r); the masked
attention buckets against the causal rule itself (a query sees its segment's keys up to its own
position); ``split_microbatch`` field by field and back; ``gather_from_cp`` forward and backward on
gloo ranks, at CP 4 and on two CP groups of 2 in the same world, against the one-process row.
"""

from __future__ import annotations

import pytest
import torch

from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.parallel.context_parallel import CpChunks, gather_from_cp, split_microbatch
from tests.dist import run_distributed

# Segment layouts in units of 2 * cp tokens: odd numbers of sequences, an empty segment, a trailing
# padding segment (the last), one segment alone.
UNITS = [(3,), (2, 5, 1), (4, 1, 0, 3, 2), (1, 1, 1, 6, 2, 1, 3)]


def _brute_local(lengths: list[int], cp: int, rank: int) -> list[int]:
    """Full-row positions of rank ``rank``'s tokens in local order, by slicing python lists."""
    local, start = [], 0
    for length in lengths:
        positions = list(range(start, start + length))
        if cp == 1:
            local += positions
        else:
            c = length // (2 * cp)
            chunks = [positions[i * c : (i + 1) * c] for i in range(2 * cp)]
            local += chunks[rank] + chunks[2 * cp - 1 - rank]
        start += length
    return local


def _segment_of(lengths: list[int]) -> list[tuple[int, int]]:
    """(segment start, segment end) of every full-row position."""
    out, start = [], 0
    for length in lengths:
        out += [(start, start + length)] * length
        start += length
    return out


def _layouts():
    for cp in (1, 2, 4):
        for units in UNITS:
            yield cp, [u * 2 * cp for u in units]
    yield 1, [5, 3, 0, 1, 7]  # CP 1 takes any lengths


@pytest.mark.parametrize(("cp", "lengths"), list(_layouts()))
def test_cp_chunks_index_math_equals_brute_force(cp, lengths):
    total = sum(lengths)
    segment = _segment_of(lengths)
    gathered = []
    for rank in range(cp):
        chunks = CpChunks.from_cu_seqlens(torch.tensor([0, *lengths]).cumsum(0).to(torch.int32), cp, rank)
        assert chunks == CpChunks.from_cu_seqlens([0, *torch.tensor(lengths).cumsum(0).tolist()], cp, rank)
        local = _brute_local(lengths, cp, rank)
        assert chunks.local_length == len(local) == total // cp
        assert chunks.local_index().tolist() == local
        gathered += local
        # each query chunk: contiguous in the local row and in the full row, keys from its segment start
        for q in chunks.query_chunks:
            span = local[q.local_start : q.local_start + q.length]
            assert span == list(range(q.full_start, q.key_end))
            assert all(segment[p] == (q.segment_start, segment[p][1]) for p in span)
        assert sum(q.length for q in chunks.query_chunks) == len(local)
        # the packed key ranges: chunk i's queries, and its segment's keys up to the chunk's end
        ranges = chunks.key_ranges()
        cu_q, cu_k, keys = ranges.cu_seqlens_q.tolist(), ranges.cu_seqlens_k.tolist(), ranges.key_index.tolist()
        assert ranges.cu_seqlens_q.dtype == ranges.cu_seqlens_k.dtype == torch.int32
        assert cu_q[-1] == len(local)
        for i in range(len(cu_q) - 1):
            queries = local[cu_q[i] : cu_q[i + 1]]
            seg_start = segment[queries[0]][0]
            assert keys[cu_k[i] : cu_k[i + 1]] == list(range(seg_start, queries[-1] + 1))
        assert ranges.max_seqlen_q == max(cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1))
        assert ranges.max_seqlen_k == max(cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1))
        _check_buckets(chunks, local, segment)
    assert sorted(gathered) == list(range(total))  # the ranks' shares partition the row
    assert chunks.gathered_positions().tolist() == gathered
    assert torch.equal(torch.tensor(gathered)[chunks.full_order()], torch.arange(total))


def _check_buckets(chunks: CpChunks, local: list[int], segment: list[tuple[int, int]]) -> None:
    """Every local row in exactly one bucket slot, and its mask row shows exactly the keys of its
    segment up to its own position (the causal rule, not the bucket's construction)."""
    seen = []
    for bucket in chunks.chunk_buckets():
        assert bucket.mask.shape == (bucket.batch, 1, bucket.queries, bucket.keys) and bucket.mask.dtype == torch.bool
        query_rows = bucket.query_index.view(bucket.batch, bucket.queries)
        key_positions = bucket.key_index.view(bucket.batch, bucket.keys)
        for slot, row in zip(bucket.slots.tolist(), bucket.rows.tolist(), strict=True):
            n, i = divmod(slot, bucket.queries)
            assert query_rows[n, i] == row
            position = local[row]
            visible = key_positions[n][bucket.mask[n, 0, i]].tolist()
            assert visible == list(range(segment[position][0], position + 1))
            seen.append(row)
    assert sorted(seen) == list(range(len(local)))


def test_cp_chunks_reject_a_segment_that_does_not_split():
    message = r"segment 2 of the packed row has 6 tokens, not a multiple of 2 \* cp_size = 4"
    with pytest.raises(ValueError, match=message):
        CpChunks((8, 4, 6, 4), 2, 0)
    with pytest.raises(ValueError, match="CP rank 2 of 2"):
        CpChunks((8,), 2, 2)


def _packed_batch(lengths: list[int], k: int = 3, seed: int = 0) -> MicroBatch:
    """A packed row with every per-token field set to distinct random values."""
    g = torch.Generator().manual_seed(seed)
    s = sum(lengths)

    def floats(*shape):
        return torch.randn(1, s, *shape, generator=g)

    return MicroBatch(
        input_ids=torch.randint(0, 1000, (1, s), generator=g),
        target_ids=torch.randint(0, 1000, (1, s), generator=g),
        loss_mask=torch.rand(1, s, generator=g) > 0.5,
        advantages=floats(),
        sampler_logprobs=floats(),
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        seq_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
        cu_seqlens=torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
        max_seqlen=max(lengths),
        old_logprobs=floats(),
        behavior_weights=floats(),
        anchor_logprobs=floats(),
        topk_ids=torch.randint(0, 1000, (1, s, k), generator=g),
        topk_anchor_logprobs=floats(k),
    )


PER_TOKEN = [
    "input_ids",
    "target_ids",
    "loss_mask",
    "advantages",
    "sampler_logprobs",
    "position_ids",
    "seq_ids",
    "old_logprobs",
    "behavior_weights",
    "anchor_logprobs",
    "topk_ids",
    "topk_anchor_logprobs",
]


@pytest.mark.parametrize("cp", [2, 4])
def test_split_microbatch_takes_every_field_and_gathers_back(cp):
    lengths = [u * 2 * cp for u in (3, 1, 2, 1)]  # three sequences and a padding segment
    batch = _packed_batch(lengths)
    shares = [split_microbatch(batch, cp, rank) for rank in range(cp)]
    for rank, share in enumerate(shares):
        index = torch.tensor(_brute_local(lengths, cp, rank))
        assert (share.cp_size, share.cp_rank, share.shape) == (cp, rank, (1, sum(lengths) // cp))
        assert share.cu_seqlens is batch.cu_seqlens and share.max_seqlen == batch.max_seqlen
        for name in PER_TOKEN:
            part, full = getattr(share, name), getattr(batch, name)
            assert part.dtype == full.dtype and torch.equal(part, full[:, index]), name
    order = CpChunks.from_cu_seqlens(batch.cu_seqlens, cp, 0).full_order()
    for name in PER_TOKEN:  # a rank-major gather of the shares, reordered: the row again
        gathered = torch.cat([getattr(share, name) for share in shares], dim=1)
        assert torch.equal(gathered[:, order], getattr(batch, name)), name


def test_split_microbatch_checks_its_input():
    batch = _packed_batch([8, 4])
    assert split_microbatch(batch, 1, 0) is batch
    with pytest.raises(ValueError, match="segment 1 of the packed row has 4 tokens"):
        split_microbatch(batch, 4, 0)
    with pytest.raises(ValueError, match="padded"):
        split_microbatch(MicroBatch(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)), 2, 0)
    with pytest.raises(ValueError, match="already CP rank 1's share of 2"):
        split_microbatch(split_microbatch(batch, 2, 1), 2, 1)


# ------------------------------------------------------------------------ gather_from_cp (gloo)

GATHER_LENGTHS = [16, 8, 0, 24, 16]  # multiples of 2 * 4


def _gather_worker(rank: int, world_size: int, full: torch.Tensor, weights: torch.Tensor) -> dict:
    """At CP 4 (the world) and CP 2 (two groups of 2): gather this rank's rows of ``full`` and
    backpropagate a loss that weighs the gathered row with ``weights[rank]``."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    out = {}
    for cp, group, cp_rank in ((4, dist.group.WORLD, rank), (2, pairs[rank // 2], rank % 2)):
        chunks = CpChunks.from_cu_seqlens(torch.tensor([0, *GATHER_LENGTHS]).cumsum(0), cp, cp_rank)
        local = full[chunks.local_index()].clone().requires_grad_()
        gathered = gather_from_cp(local, chunks, group)
        (gathered * weights[rank]).sum().backward()
        out[cp] = (gathered.detach(), local.grad)
    return out


def test_gather_from_cp_forward_and_backward_on_gloo():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(sum(GATHER_LENGTHS), 3, 2, generator=g, dtype=torch.float64)
    weights = torch.randn(4, *full.shape, generator=g, dtype=torch.float64)
    results = run_distributed(_gather_worker, 4, full, weights, timeout=120)
    for cp in (4, 2):
        for rank, result in enumerate(results):
            gathered, grad = result[cp]
            assert torch.equal(gathered, full)
            members = range(4) if cp == 4 else range(rank // 2 * 2, rank // 2 * 2 + 2)
            # d/d(local rows) of sum over the group's ranks of <gathered, weights[r]>
            expected = sum(weights[r] for r in members)[_brute_local(GATHER_LENGTHS, cp, rank % cp)]
            torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
