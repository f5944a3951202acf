"""Loss aggregation: hand-computed modes, micro-batch and DP invariance of value and gradient."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.core.aggregation import AGG_MODES, LossSum, add, aggregate, divide_by_count

# values l[b, s] and mask m[b, s] of the worked example (sequence 2 is fully masked):
#   seq 0: 1, 2, 3   mask 1 1 0   -> token sum 3,  n = 2, token mean 1.5
#   seq 1: 4, 5, 6   mask 1 1 1   -> token sum 15, n = 3, token mean 5
#   seq 2: 7, 8, 9   mask 0 0 0   -> not counted
#   seq 3: -1, 0, 2  mask 0 0 1   -> token sum 2,  n = 1, token mean 2
VALUES = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [-1.0, 0.0, 2.0]]
MASK = [[1, 1, 0], [1, 1, 1], [0, 0, 0], [0, 0, 1]]
EXPECTED = {
    # mode: (loss_sum, count, loss = loss_sum / count)
    "token-mean": (3 + 15 + 2, 6, 20 / 6),
    "seq-mean-token-sum": (3 + 15 + 2, 3, 20 / 3),
    "seq-mean-token-mean": (1.5 + 5 + 2, 3, 8.5 / 3),
}


def example():
    return torch.tensor(VALUES, dtype=torch.float64), torch.tensor(MASK, dtype=torch.bool)


def expected_gradient(mode: str) -> torch.Tensor:
    """d loss / d l[b, s] by hand: 1/N per token, 1/#seq per token, 1/(#seq n_b) per token."""
    mask = torch.tensor(MASK, dtype=torch.float64)
    n = mask.sum(dim=1, keepdim=True)  # [B, 1]
    if mode == "token-mean":
        return mask / mask.sum()
    if mode == "seq-mean-token-sum":
        return mask / 3
    return mask / (3 * n.clamp(min=1))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_each_mode_matches_the_hand_computation(mode):
    values, mask = example()
    values.requires_grad_(True)
    actual = aggregate(values, mask, mode)
    expected_sum, expected_count, expected_loss = EXPECTED[mode]
    assert isinstance(actual, LossSum)
    torch.testing.assert_close(actual.loss_sum, torch.tensor(expected_sum, dtype=torch.float64))
    assert actual.count.dtype == torch.int64 and actual.count.tolist() == expected_count
    loss = divide_by_count(*actual)
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=torch.float64))
    loss.backward()
    torch.testing.assert_close(values.grad, expected_gradient(mode))


def random_batch(seed: int, batch_size: int = 12, seq_len: int = 9):
    """float64 values [B, S] and a ragged bool mask with some fully masked sequences."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(batch_size, seq_len, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, seq_len + 1, (batch_size,), generator=g)
    lengths[[2, 7]] = 0  # empty sequences must not count in the seq-mean modes
    starts = torch.randint(0, 3, (batch_size,), generator=g)  # prompt tokens before the response
    pos = torch.arange(seq_len)
    mask = (pos >= starts[:, None]) & (pos < (starts + lengths).clamp(max=seq_len)[:, None])
    return values, mask


def loss_and_grad(values: torch.Tensor, mask: torch.Tensor, mode: str, splits: list[list[int]]):
    """Aggregate per part (rows of ``values``), add, divide once -> (loss, d loss / d values)."""
    leaf = values.clone().requires_grad_(True)
    weights = torch.linspace(0.5, 2.0, values.numel(), dtype=values.dtype).reshape(values.shape)
    per_token = leaf * weights + leaf.square()  # a non-linear per-token loss
    total = add(*(aggregate(per_token[rows], mask[rows], mode) for rows in splits))
    loss = divide_by_count(*total)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batching_changes_neither_value_nor_gradient(mode):
    values, mask = random_batch(seed=0)
    rows = list(range(values.shape[0]))
    expected_loss, expected_grad = loss_and_grad(values, mask, mode, [rows])
    all_splits = (
        [rows[:5], rows[5:]],
        [rows[:1], rows[1:3], rows[3:8], rows[8:]],
        [[r] for r in rows],
    )
    for splits in all_splits:
        actual_loss, actual_grad = loss_and_grad(values, mask, mode, splits)
        torch.testing.assert_close(actual_loss, expected_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_data_parallel_ranks_by_slicing(mode):
    """Each rank sums its micro-batches; the trainer all-reduces sums and counts, divides once.

    Simulated without a process group: 3 ranks x 2 micro-batches, the global loss is
    sum over ranks of (per-rank loss_sum) / (sum over ranks of counts), and the gradient of
    each rank's rows equals the full batch's.
    """
    values, mask = random_batch(seed=1, batch_size=18)
    rows = list(range(18))
    expected_loss, expected_grad = loss_and_grad(values, mask, mode, [rows])
    ranks = [rows[0:6], rows[6:12], rows[12:18]]
    per_rank = [aggregate(values[r], mask[r], mode) for r in ranks]
    global_count = sum(p.count for p in per_rank)  # the all-reduce of counts
    leafs = [values[r].clone().requires_grad_(True) for r in ranks]
    weights = torch.linspace(0.5, 2.0, values.numel(), dtype=values.dtype).reshape(values.shape)
    rank_losses = []
    for leaf, r in zip(leafs, ranks):
        per_token = leaf * weights[r] + leaf.square()
        micro = [
            aggregate(per_token[:3], mask[r][:3], mode),
            aggregate(per_token[3:], mask[r][3:], mode),
        ]
        rank_sum = add(*micro).loss_sum
        # each rank divides its own sum by the *global* count; the DP gradient all-reduce sums
        rank_loss = divide_by_count(rank_sum, global_count)
        rank_loss.backward()
        rank_losses.append(rank_loss.detach())
    torch.testing.assert_close(sum(rank_losses), expected_loss, rtol=1e-12, atol=1e-12)
    actual_grad = torch.cat([leaf.grad for leaf in leafs])
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_padding_tokens_get_zero_gradient_even_when_non_finite(mode):
    values, mask = random_batch(seed=2)
    values = torch.where(mask, values, torch.tensor(float("inf"), dtype=values.dtype))
    leaf = values.clone().requires_grad_(True)
    loss = divide_by_count(*aggregate(leaf, mask, mode))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.equal(leaf.grad[~mask], torch.zeros_like(leaf.grad[~mask]))
    assert (leaf.grad[mask] != 0).all()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_masked_micro_batch_gives_zero_with_a_graph(mode):
    leaf = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    part = aggregate(leaf, mask, mode)
    assert part.loss_sum.item() == 0 and part.count.item() == 0
    loss = divide_by_count(*part)
    assert loss.item() == 0 and loss.requires_grad
    loss.backward()  # runs: every rank still takes part in the backward
    assert torch.equal(leaf.grad, torch.zeros(3, 4))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_micro_batch_adds_nothing(mode):
    values, mask = random_batch(seed=3)
    full = aggregate(values, mask, mode)
    empty = aggregate(values[:2], torch.zeros_like(mask[:2]), mode)
    total = add(full, empty)
    torch.testing.assert_close(total.loss_sum, full.loss_sum, rtol=0, atol=0)
    assert torch.equal(total.count, full.count)


def test_float32_values_keep_their_dtype():
    values = torch.randn(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    actual = aggregate(values, mask)
    assert actual.loss_sum.dtype == torch.float32
    assert divide_by_count(*actual).dtype == torch.float32


def test_bad_inputs_name_the_argument():
    values, mask = example()
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor"):
        aggregate(values, mask.float())
    message = r"loss_mask has shape \(4, 2\) but values has shape \(4, 3\)"
    with pytest.raises(ValueError, match=message):
        aggregate(values, mask[:, :2])
    with pytest.raises(ValueError, match=r"mode='token-sum' is not one of"):
        aggregate(values, mask, "token-sum")
    with pytest.raises(ValueError, match=r"values must be \[B, S\]"):
        aggregate(values.flatten(), mask.flatten())


def test_bf16_values_are_summed_in_float32():
    # 257 tokens of value 1.0: bf16 cannot hold 257 (it rounds to 256), float32 can.
    values = torch.ones(1, 257, dtype=torch.bfloat16)
    mask = torch.ones(1, 257, dtype=torch.bool)
    actual = aggregate(values, mask, "token-mean")
    assert actual.loss_sum.dtype == torch.float32
    assert actual.loss_sum.item() == 257.0
    actual_seq = aggregate(values, mask, "seq-mean-token-mean")
    assert actual_seq.loss_sum.item() == 1.0


def test_add_without_parts_raises():
    with pytest.raises(ValueError, match="at least one"):
        add()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_packed_sequences_aggregate_per_sequence_not_per_row(mode):
    """Rows of [B, S] laid back to back in one row with ``seq_ids``: the same sum, count and
    gradient as the rows (a sequence without loss tokens counts in no mode)."""
    g = torch.Generator().manual_seed(4)
    lengths = [5, 2, 7, 3]
    values = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 7, generator=g) < 0.6
    mask[1] = False
    for row, n in enumerate(lengths):
        mask[row, n:] = False
    padded = aggregate(values, mask, mode)
    flat = torch.cat([values[row, :n] for row, n in enumerate(lengths)] + [values.new_zeros(3)])[None]
    flat_mask = torch.cat([mask[row, :n] for row, n in enumerate(lengths)] + [torch.zeros(3, dtype=torch.bool)])[None]
    seq_ids = torch.repeat_interleave(torch.arange(5), torch.tensor([*lengths, 3]))[None]  # + a padding segment
    packed = aggregate(flat, flat_mask, mode, seq_ids)
    assert packed.count.item() == padded.count.item() == (int(mask.sum()) if mode == "token-mean" else 3)
    torch.testing.assert_close(packed.loss_sum, padded.loss_sum, rtol=1e-12, atol=0)
    (grad_padded,) = torch.autograd.grad(padded.loss_sum, values)
    (grad_packed,) = torch.autograd.grad(packed.loss_sum, values)
    torch.testing.assert_close(grad_packed, grad_padded, rtol=1e-12, atol=0)
    # the rows themselves as one sequence would differ in the seq-mean modes
    if mode != "token-mean":
        assert aggregate(flat, flat_mask, mode).count.item() == 1
