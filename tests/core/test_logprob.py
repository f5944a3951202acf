"""``core/logprob.py``: chunked log-probs, top-k, entropy and the exact-KL reference.

Oracles are plain torch on the whole vocabulary (``torch.log_softmax``, ``torch.topk``,
``torch.logsumexp``); ``exact_kl`` itself is checked against a 3-token example worked by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_empg.core import logprob
from megatron_empg.core.logprob import (
    exact_kl,
    gather_logprobs,
    load_masked_,
    logsoftmax_backward_,
    logsumexp_,
    logsumexp_and_entropy,
    topk_logprobs,
)

B, S, V = 2, 5, 33  # T = B * S = 10 tokens
CHUNK_SIZES = [1, 3, 10, 1024]  # 1, one not dividing T, T, larger than T


def _logits(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(B, S, V, generator=g)).to(dtype)


def _ids(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S, 3), generator=g)
    ids[..., 2] = ids[..., 0]  # a repeated id per token: the backward must accumulate, not overwrite
    return ids


def _reference_logprobs_and_grad(logits: torch.Tensor, ids: torch.Tensor, upstream: torch.Tensor):
    """log_softmax(float32(logits)).gather(ids) and its gradient w.r.t. logits (float32)."""
    leaf = logits.detach().to(torch.float32).requires_grad_(True)
    logprobs = torch.log_softmax(leaf, dim=-1).gather(-1, ids)
    (grad,) = torch.autograd.grad(logprobs, leaf, upstream)
    return logprobs.detach(), grad


def _upstream_grad(seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, 3, generator=g)  # random, non-uniform upstream gradient


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_gather_logprobs_fp32_matches_log_softmax(chunk_size):
    logits, ids, upstream = _logits(torch.float32), _ids(), _upstream_grad()
    expected_logprobs, expected_grad = _reference_logprobs_and_grad(logits, ids, upstream)
    leaf = logits.clone().requires_grad_(True)
    actual_logprobs = gather_logprobs(leaf, ids, chunk_size=chunk_size)
    (actual_grad,) = torch.autograd.grad(actual_logprobs, leaf, upstream)
    assert actual_logprobs.shape == (B, S, 3) and actual_logprobs.dtype == torch.float32
    # Same float32 arithmetic in a different order: a few ulps of |log p| <= ~20.
    torch.testing.assert_close(actual_logprobs, expected_logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_gather_logprobs_bf16_matches_log_softmax_of_upcast_logits(chunk_size):
    logits, ids, upstream = _logits(torch.bfloat16), _ids(), _upstream_grad()
    expected_logprobs, expected_grad = _reference_logprobs_and_grad(logits, ids, upstream)
    leaf = logits.clone().requires_grad_(True)
    actual_logprobs = gather_logprobs(leaf, ids, chunk_size=chunk_size)
    (actual_grad,) = torch.autograd.grad(actual_logprobs, leaf, upstream)
    assert actual_logprobs.dtype == torch.float32 and actual_grad.dtype == torch.bfloat16
    # Values: the bf16 logits are upcast and the math is float32, as in the reference.
    torch.testing.assert_close(actual_logprobs, expected_logprobs, rtol=0, atol=1e-6)
    # Gradient: float32 result rounded to bf16 (8 significant bits: relative error <= 2^-9).
    torch.testing.assert_close(actual_grad.to(torch.float32), expected_grad, rtol=2**-8, atol=1e-6)


def test_gather_logprobs_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 7, generator=g, dtype=torch.float64).requires_grad_(True)
    ids = torch.tensor([[0, 6], [2, 2], [5, 1]])  # includes a repeated id
    assert gather_logprobs(logits, ids).dtype == torch.float64  # float64 in, float64 accumulation
    assert torch.autograd.gradcheck(lambda z: gather_logprobs(z, ids, chunk_size=2), (logits,))


def test_gather_logprobs_zero_ids_per_token():
    logits = _logits(torch.float32).requires_grad_(True)
    actual = gather_logprobs(logits, torch.empty(B, S, 0, dtype=torch.int64))
    assert actual.shape == (B, S, 0)
    (actual_grad,) = torch.autograd.grad(actual.sum(), logits)
    assert torch.equal(actual_grad, torch.zeros_like(logits))


@pytest.mark.parametrize("k", [0, 1, 3, V])
def test_topk_logprobs_matches_torch_topk_of_log_softmax(k):
    logits = _logits(torch.float32)  # continuous random values: no ties
    expected = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1, sorted=True)
    actual_values, actual_ids = topk_logprobs(logits, k, chunk_size=3)
    assert actual_values.shape == (B, S, k) and actual_ids.dtype == torch.int64
    assert torch.equal(actual_ids, expected.indices)
    torch.testing.assert_close(actual_values, expected.values, rtol=0, atol=1e-6)


def _lower_id_first_topk(z: torch.Tensor, k: int) -> torch.Tensor:
    """Reference tie rule: order by value descending, then id ascending (a stable sort keeps ids
    ascending within equal values)."""
    return torch.sort(z, dim=-1, descending=True, stable=True).indices[..., :k]


@pytest.mark.parametrize("vocab", [10, 40, 1000])
def test_topk_logprobs_ties_go_to_the_lower_id(vocab):
    # Integer logits in {0, 1, 2}: ties inside the selection and across the k-th value.
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (6, vocab), generator=g).to(torch.float32)
    logits[0] = 0.0  # one row of all-equal logits
    logp = torch.log_softmax(logits, dim=-1)
    for k in (0, 1, 3, vocab // 2, vocab):
        expected_ids = _lower_id_first_topk(logits, k)
        actual_values, actual_ids = topk_logprobs(logits, k, chunk_size=4)
        assert torch.equal(actual_ids, expected_ids), f"k={k}"
        # the chunked logsumexp and log_softmax add V exponentials in another order (another one at
        # each CPU vector width): a few float32 ulps of log V ~ 7, so relative, 1e-6 ~ 8 ulps
        torch.testing.assert_close(actual_values, logp.gather(-1, expected_ids), rtol=1e-6, atol=1e-6)


def test_raw_torch_topk_does_not_break_ties_towards_the_lower_id_on_cpu():
    # Documents why ``topk_logprobs`` re-ranks: torch.topk on CPU (torch 2.13) picks an arbitrary
    # subset of equal values in an arbitrary order; e.g. torch.topk(torch.zeros(10), 3).indices is
    # [8, 6, 7]. If this starts failing, torch changed its CPU kernel; the re-ranking stays correct.
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (6, 40), generator=g).to(torch.float32)
    raw_ids = torch.topk(logits, 3, dim=-1, sorted=True).indices
    lower_id_first = _lower_id_first_topk(logits, 3)
    assert not torch.equal(raw_ids, lower_id_first)
    assert not torch.equal(torch.topk(torch.zeros(10), 3).indices, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_logsumexp_and_entropy_match_full_softmax(dtype, chunk_size):
    logits = _logits(dtype)
    z = logits.to(torch.float32)
    expected_lse = torch.logsumexp(z, dim=-1)
    expected_entropy = -(torch.softmax(z, dim=-1) * torch.log_softmax(z, dim=-1)).sum(-1)
    actual_lse, actual_entropy = logsumexp_and_entropy(logits, chunk_size=chunk_size)
    assert actual_lse.shape == (B, S) and actual_lse.dtype == torch.float32
    # float32 sums over V = 33 terms in a different order.
    torch.testing.assert_close(actual_lse, expected_lse, rtol=0, atol=1e-6)
    torch.testing.assert_close(actual_entropy, expected_entropy, rtol=0, atol=1e-5)


# --- the in-chunk passes: row blocks, padding, underflow -----------------------------------------

WIDTH, N_VALID = 40, 33  # columns N_VALID: are padding (-inf), as on the last TP shard
BLOCK_ROWS = [WIDTH, 3, 1]  # the whole chunk of 7 rows in one block; blocks of 3 (7 = 3 + 3 + 1); rows one by one


def _hard_logits(dtype: torch.dtype) -> torch.Tensor:
    """[7, WIDTH] logits: random rows, a row whose exp underflows to 0 in float32 (0 and -3 among
    -150s), a row with one dominant logit (the other probabilities ~ e^-40)."""
    g = torch.Generator().manual_seed(7)
    x = 3.0 * torch.randn(7, WIDTH, generator=g)
    x[1] = -150.0
    x[1, 5], x[1, 6] = 0.0, -3.0
    x[2, 9] = 40.0
    return x.to(dtype)


def _scratch(logits: torch.Tensor) -> torch.Tensor:
    return load_masked_(torch.empty(logits.shape), logits, N_VALID)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", BLOCK_ROWS)
def test_logsumexp_with_mean_gives_the_float64_entropy(dtype, block_rows, monkeypatch):
    monkeypatch.setattr(logprob, "CPU_BLOCK_BYTES", block_rows * WIDTH * 4)
    logits = _hard_logits(dtype)
    real = logits[:, :N_VALID].to(torch.float64)
    expected_lse = torch.logsumexp(real, dim=-1)
    expected_entropy = torch.special.entr(torch.softmax(real, dim=-1)).sum(-1)
    lse, mean = logsumexp_(_scratch(logits), with_mean=True)
    lse_only, no_mean = logsumexp_(_scratch(logits))
    assert no_mean is None and torch.equal(lse_only, lse)
    # float32 rounding of values up to |z| = 40, where one ulp is 3.8e-6
    torch.testing.assert_close(lse.double(), expected_lse, rtol=0, atol=4e-6)
    torch.testing.assert_close((lse - mean).double(), expected_entropy, rtol=0, atol=4e-6)


def test_logsumexp_of_a_row_of_padding_only_is_minus_inf_with_mean_zero():
    z = torch.full((2, 5), float("-inf"))
    z[1] = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    lse, mean = logsumexp_(z, with_mean=True)
    expected_mean = (torch.softmax(torch.arange(5.0), dim=0) * torch.arange(5.0)).sum()
    assert lse[0] == float("-inf") and mean[0] == 0.0
    torch.testing.assert_close(lse[1], torch.logsumexp(torch.arange(5.0), dim=0), rtol=0, atol=1e-6)
    torch.testing.assert_close(mean[1], expected_mean, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", BLOCK_ROWS)
@pytest.mark.parametrize("with_entropy", [True, False])
def test_logsoftmax_backward_matches_float64_autograd(dtype, block_rows, with_entropy, monkeypatch):
    monkeypatch.setattr(logprob, "CPU_BLOCK_BYTES", block_rows * WIDTH * 4)
    logits = _hard_logits(dtype)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, N_VALID, (7, 3), generator=g)
    ids[:, 2] = ids[:, 0]  # a repeated id: accumulated
    grad_ids = torch.randn(7, 3, generator=g)
    grad_entropy = torch.randn(7, generator=g) if with_entropy else torch.zeros(7)
    grad_entropy[3] = 0.0  # a masked token
    leaf = logits[:, :N_VALID].to(torch.float64).requires_grad_(True)
    log_p = torch.log_softmax(leaf, dim=-1)
    entropy = torch.special.entr(log_p.exp()).sum(-1)
    objective = (log_p.gather(-1, ids) * grad_ids.double()).sum() + (entropy * grad_entropy.double()).sum()
    (expected,) = torch.autograd.grad(objective, leaf)
    actual = logsoftmax_backward_(
        _scratch(logits),
        torch.logsumexp(leaf.detach(), dim=-1).float(),
        ids,
        grad_ids,
        grad_ids.sum(-1),
        entropy=entropy.detach().float() if with_entropy else None,
        grad_entropy=grad_entropy if with_entropy else None,
    )
    assert torch.equal(actual[:, N_VALID:], torch.zeros(7, WIDTH - N_VALID))
    # float32 rounding of terms p (g + g_H (log p + H)) with |gradient| <= 3
    torch.testing.assert_close(actual[:, :N_VALID].double(), expected, rtol=0, atol=2e-6)


def _largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation ``fn()`` makes (torch.profiler's memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def test_entropy_passes_allocate_one_block_not_a_chunk(monkeypatch):
    # The entropy needs p and log p (or z) at once: a second [c, V] float32 buffer per chunk was
    # the cost of the metrics (on CPU a fresh one per chunk, with its page faults every time).
    block_bytes = 4 * 4096 * 4  # 4 rows of 4096 float32
    monkeypatch.setattr(logprob, "CPU_BLOCK_BYTES", block_bytes)
    z = torch.randn(64, 4096)
    lse = torch.logsumexp(z, dim=-1)
    entropy = torch.special.entr(torch.softmax(z, dim=-1)).sum(-1)
    forward_scratch, backward_scratch = z.clone(), z.clone()
    ids, grad_entropy = torch.zeros(64, 1, dtype=torch.int64), torch.ones(64)
    assert _largest_allocation(lambda: logsumexp_(forward_scratch, with_mean=True)) == block_bytes
    assert (
        _largest_allocation(
            lambda: logsoftmax_backward_(
                backward_scratch, lse, ids, None, None, entropy=entropy, grad_entropy=grad_entropy
            )
        )
        == block_bytes
    )


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])  # rounding of O(1) numbers
def test_exact_kl_three_token_example_by_hand(dtype, atol):
    # pi = [1/2, 1/4, 1/4], pi_ref = [1/8, 1/8, 3/4]; logits shifted by constants (softmax-invariant).
    # reverse  KL(pi || pi_ref) = 1/2 ln(4) + 1/4 ln(2) + 1/4 ln(1/3) = 5/4 ln 2 - 1/4 ln 3 = 0.5917806
    # forward  KL(pi_ref || pi) = 1/8 ln(1/4) + 1/8 ln(1/2) + 3/4 ln 3 = 3/4 ln 3 - 3/8 ln 2 = 0.5640289
    # d KL_rev / dz_i = pi_i (ln(pi_i / pi_ref_i) - KL_rev); d KL_fwd / dz_i = pi_i - pi_ref_i = [3/8, 1/8, -1/2]
    pi = torch.tensor([0.5, 0.25, 0.25], dtype=dtype)
    pi_ref = torch.tensor([0.125, 0.125, 0.75], dtype=dtype)
    logits = (pi.log() + 0.7).requires_grad_(True)
    anchor_logits = pi_ref.log() - 1.3
    ln2, ln3 = math.log(2.0), math.log(3.0)
    expected_reverse = 1.25 * ln2 - 0.25 * ln3
    expected_forward = 0.75 * ln3 - 0.375 * ln2
    expected_reverse_grad = pi * (torch.tensor([2 * ln2, ln2, -ln3], dtype=dtype) - expected_reverse)
    expected_forward_grad = torch.tensor([0.375, 0.125, -0.5], dtype=dtype)

    actual_reverse = exact_kl(logits, anchor_logits, direction="reverse")
    (actual_reverse_grad,) = torch.autograd.grad(actual_reverse, logits)
    actual_forward = exact_kl(logits, anchor_logits, direction="forward")
    (actual_forward_grad,) = torch.autograd.grad(actual_forward, logits)

    assert actual_reverse.dtype == dtype
    torch.testing.assert_close(actual_reverse.detach(), torch.tensor(expected_reverse, dtype=dtype), rtol=0, atol=atol)
    torch.testing.assert_close(actual_forward.detach(), torch.tensor(expected_forward, dtype=dtype), rtol=0, atol=atol)
    torch.testing.assert_close(actual_reverse_grad, expected_reverse_grad, rtol=0, atol=atol)
    torch.testing.assert_close(actual_forward_grad, expected_forward_grad, rtol=0, atol=atol)


def test_exact_kl_does_not_differentiate_the_anchor():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 9, generator=g)
    anchor_logits = torch.randn(4, 9, generator=g).requires_grad_(True)
    actual = exact_kl(logits, anchor_logits, direction="forward")
    assert not actual.requires_grad


# --- bad input ---------------------------------------------------------------------------------


def test_int32_ids_raise():
    with pytest.raises(ValueError, match="^ids must be int64"):
        gather_logprobs(torch.zeros(2, 5), torch.zeros(2, 1, dtype=torch.int32))


def test_ids_leading_shape_mismatch_raises():
    with pytest.raises(ValueError, match="^ids has leading shape"):
        gather_logprobs(torch.zeros(2, 5), torch.zeros(3, 1, dtype=torch.int64))


def test_non_positive_chunk_size_raises():
    with pytest.raises(ValueError, match="^chunk_size"):
        gather_logprobs(torch.zeros(2, 5), torch.zeros(2, 1, dtype=torch.int64), chunk_size=0)


@pytest.mark.parametrize("k", [-1, 6])
def test_topk_logprobs_k_out_of_range_raises(k):
    with pytest.raises(ValueError, match=f"^k={k} must be in"):
        topk_logprobs(torch.zeros(2, 5), k)


def test_exact_kl_bad_input_raises_naming_the_argument():
    x = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="^direction='sideways'"):
        exact_kl(x, x, direction="sideways")
    with pytest.raises(ValueError, match="^anchor_logits has shape"):
        exact_kl(x, torch.zeros(2, 6), direction="reverse")
    nan_anchor = torch.zeros(2, 5)
    nan_anchor[1, 3] = float("nan")
    with pytest.raises(ValueError, match="^anchor_logits contains NaN"):
        exact_kl(x, nan_anchor, direction="reverse")
