"""``kernels.topk_triton`` (the fused top-k of a vocab shard) against the torch references.

The kernel's (values, ids) must EQUAL ``core.logprob.topk_value_then_id`` on the fp32-upcast real
columns (values descending, ties to the lower id), and its values ``torch.topk``'s, on bf16 and
fp32 rows of every awkward kind: distinct values, a few values (ties everywhere, signed zeros), a
row of one value, ties straddling the k-th place, -inf ties at the k-th place (fewer finite values
than k), NaNs of either sign (no more than k), signed zeros at the k-th place, ascending values
(every block contributes: the insertion loop's worst case), descending values, a row of 1.0 but
its last columns at the next fp32 value (a late block beats the k-th by one ulp); padding columns
whose values (1e4, +inf, NaN) would win if read, rows 2 (V_local + 3) apart (a view of a wider
buffer of 1e4), one block per row and many (``BLOCK_COLUMNS`` = 16), k = 1, 5, 32, 64. Then
``_local_pass`` / ``vocab_parallel_token_stats`` at k > 0 with ``EMPG_VOCAB_KERNEL=triton`` against
``=torch``: top-k ids identical, the packed top-k columns equal, log-probs to 1e-6 (the lse comes
from ``local_stats``, which sums in another order), on shards with vocab_start > 0, padding, fewer
real columns than k, padding only; two shards reduced as a TP = 2 all-gather would, against
``core.logprob.topk_logprobs`` on the whole vocabulary; the fallback above ``MAX_K``; and a compile
for an H100, which the interpreter skips.

Without CUDA the kernel runs under Triton's interpreter (``tests.kernels.interpreter``), set when
this module imports triton and the kernel modules, and around each test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.kernels.interpreter import DEVICE, import_kernels, marks  # noqa: E402
from tests.kernels.interpreter import env as _env  # noqa: E402

triton, topk_triton, vocab_logprob_triton = import_kernels()
pytestmark = marks(triton, topk_triton._topk_kernel)

from megatron_empg.core.logprob import topk_logprobs, topk_value_then_id  # noqa: E402
from megatron_empg.kernels import KERNEL_ENV, vocab_topk_kernel  # noqa: E402
from megatron_empg.parallel.vocab_parallel import (  # noqa: E402
    VocabShard,
    _local_pass,
    _owned_local_ids,
    _reduce_pass,
    vocab_parallel_token_stats,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_TOL = {"rtol": 1e-6, "atol": 1e-6}
EXACT = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if DEVICE == "cpu":  # the interpreter checks it at each launch
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _many_blocks(monkeypatch):
    monkeypatch.setattr(topk_triton, "BLOCK_COLUMNS", 16)


def _rows(n_valid: int, k: int, seed: int) -> torch.Tensor:
    """[10, n_valid] fp32 rows, one per kind of the module docstring."""
    g = torch.Generator().manual_seed(seed)

    def randn():
        return 3.0 * torch.randn(n_valid, generator=g)

    def columns(n):
        return torch.randperm(n_valid, generator=g)[:n]

    inf = float("inf")
    distinct = randn()
    few = randn().round() / 2  # rounds small negatives to -0.0
    flat = torch.full((n_valid,), 1.5)
    straddle = randn()
    order = straddle.argsort(descending=True)
    straddle[order[max(0, k - 3) : k + 3]] = straddle[order[k - 1]].item()
    mostly_inf = torch.full((n_valid,), -inf)
    mostly_inf[columns(min(3, k - 1))] = randn()[: min(3, k - 1)]
    nans = randn()
    nans[columns(min(3, k))] = torch.tensor([float("nan"), -float("nan"), float("nan")])[: min(3, k)]  # either sign
    zeros = -randn().abs() - 1.0
    zero_cols = columns(min(k + 3, n_valid))
    zeros[zero_cols] = torch.where(torch.arange(zero_cols.numel()) % 2 == 0, 0.0, -0.0)
    ascending = torch.linspace(-5.0, 5.0, n_valid)
    ulp = torch.ones(n_valid)
    ulp[-3:] = 1.0 + 2.0**-23  # in fp32 the next value, in the last block (bf16: 1.0)
    return torch.stack([distinct, few, flat, straddle, mostly_inf, nans, zeros, ascending, -ascending, ulp])


def _shard(rows: torch.Tensor, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[R, width] view of a 1e4 buffer, rows 2 (width + 3) apart: ``rows`` then padding garbage."""
    g = torch.Generator().manual_seed(seed)
    num, n_valid = rows.shape
    buffer = torch.full((2 * num, width + 3), 1e4)
    logits = buffer[::2, 2 : 2 + width]
    logits[:, :n_valid] = rows
    garbage = torch.tensor([1e4, float("inf"), float("nan")])
    logits[:, n_valid:] = garbage[torch.randint(0, 3, (num, width - n_valid), generator=g)]
    buffer = buffer.to(dtype=dtype, device=DEVICE)
    return buffer[::2, 2 : 2 + width]


def _check_topk(values, ids, logits, k, n_valid):
    real = logits[:, :n_valid].float()
    ref_values, ref_ids = topk_value_then_id(real, k)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64 and values.shape == ids.shape == (len(real), k)
    assert torch.equal(ids, ref_ids), f"ids differ from topk_value_then_id:\n{ids}\n{ref_ids}"
    torch.testing.assert_close(values, ref_values, **EXACT)
    assert torch.equal(values.signbit(), ref_values.signbit()), "the logits themselves: signed zeros"
    torch.testing.assert_close(values, torch.topk(real, k).values, **EXACT)


@pytest.mark.parametrize("k", [1, 5, 32, 64])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("many_blocks", [False, True], ids=["one-block", "many-blocks"])
def test_topk_equals_torch_reference(monkeypatch, many_blocks, dtype, k):
    if many_blocks:
        _many_blocks(monkeypatch)
    width, n_valid = 150, 141
    logits = _shard(_rows(n_valid, k, seed=k), width, dtype, seed=k)
    real = logits[:, :n_valid].float()
    ranked = real.nan_to_num(nan=float("inf")).sort(-1, descending=True).values
    assert int((ranked[:, k - 1] == ranked[:, k]).sum()) >= 4, "rows with a tie across the k-th place"
    values, ids = topk_triton.topk(logits, k, n_valid)
    _check_topk(values, ids, logits, k, n_valid)


def test_topk_edges(monkeypatch):
    """k = n_valid (every real column), a contiguous shard without padding, no rows."""
    _many_blocks(monkeypatch)
    logits = _shard(_rows(17, 17, seed=1), 20, torch.bfloat16, seed=1)
    _check_topk(*topk_triton.topk(logits, 17, 17), logits, 17, 17)
    logits = logits[:, :17].contiguous()
    _check_topk(*topk_triton.topk(logits, 7, 17), logits, 7, 17)
    values, ids = topk_triton.topk(logits[:0], 3, 17)
    assert values.shape == ids.shape == (0, 3)


def test_topk_rejects_what_it_does_not_serve():
    logits = torch.zeros(4, 32, device=DEVICE)
    for k, n_valid in ((0, 32), (31, 30), (topk_triton.MAX_K + 1, 32)):
        with pytest.raises(ValueError, match="k="):
            topk_triton.topk(logits, k, n_valid)
    with pytest.raises(ValueError, match="n_valid="):
        topk_triton.topk(logits, 1, 33)
    with pytest.raises(ValueError, match="unit column stride"):
        topk_triton.topk(torch.zeros(32, 4, device=DEVICE).t(), 1, 32)
    with pytest.raises(ValueError, match="unit column stride"):
        topk_triton.topk(logits.half(), 1, 32)


def test_dispatch_rule(monkeypatch):
    x = torch.zeros(4, 8, device=DEVICE)
    monkeypatch.setenv(KERNEL_ENV, "torch")
    assert vocab_topk_kernel(x, 4) is None
    monkeypatch.setenv(KERNEL_ENV, "auto")
    assert vocab_topk_kernel(x, 4) is (topk_triton.topk if DEVICE == "cuda" else None)
    monkeypatch.setenv(KERNEL_ENV, "triton")
    assert vocab_topk_kernel(x, 4) is topk_triton.topk
    assert vocab_topk_kernel(x.bfloat16(), topk_triton.MAX_K) is topk_triton.topk
    assert vocab_topk_kernel(x, topk_triton.MAX_K + 1) is None
    assert vocab_topk_kernel(x, 0) is None
    assert vocab_topk_kernel(x.double(), 4) is None
    assert vocab_topk_kernel(torch.zeros(8, 4, device=DEVICE).t(), 4) is None


# ---------------------------------------------------------------- _local_pass, token stats

T, M = 9, 3
# (V_local, n_valid, vocab_start, k): a shard past the start with padding (k = 5, and k = 32 above
# its 30 real columns), a shard without padding, a shard of padding only.
SHARDS = [(37, 30, 40, 5), (37, 30, 40, 32), (64, 64, 0, 7), (20, 0, 200, 4)]
SHARD_IDS = [f"w{w}-valid{n}-k{k}" for w, n, _, k in SHARDS]


def _counted(monkeypatch, calls):
    for module, name in ((vocab_logprob_triton, "local_stats"), (topk_triton, "topk")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(*a, **kw))


def _stats_logits(width: int, n_valid: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, width]: random rows, rows rounded to a few values (ties), padding garbage."""
    g = torch.Generator().manual_seed(seed)
    real = 3.0 * torch.randn(T, n_valid, generator=g)
    real[::2] = real[::2].round()
    if n_valid > 2:
        real[::3, n_valid - 2] = float("-inf")
    return _shard(real, width, dtype, seed)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("width", "n_valid", "vocab_start", "k"), SHARDS, ids=SHARD_IDS)
def test_token_stats_triton_equals_torch(monkeypatch, width, n_valid, vocab_start, k, dtype):
    vocab_size = vocab_start + n_valid if n_valid else vocab_start - 50
    shard = VocabShard(vocab_start, vocab_size, None)
    logits = _stats_logits(width, n_valid, dtype, seed=width + k)
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(0, vocab_size, (T, M), generator=g).to(DEVICE)
    local_ids, owned = _owned_local_ids(ids, shard, n_valid)
    calls = []
    _counted(monkeypatch, calls)
    packed, stats = {}, {}
    for mode in ("torch", "triton"):
        with _env(KERNEL_ENV, mode):
            packed[mode] = _local_pass(logits, local_ids, owned, shard, k=k, with_entropy=True, chunk_size=4)
            stats[mode] = vocab_parallel_token_stats(
                logits, ids, k, vocab_start=vocab_start, vocab_size=vocab_size, tp_group=None, chunk_size=4
            )
    assert calls == (["local_stats", "topk"] if n_valid else ["local_stats"]) * 2
    ours, expected = packed["triton"], packed["torch"]
    assert ours.shape == expected.shape == (T, 2 + M + 2 * min(k, width))
    torch.testing.assert_close(ours[:, :2], expected[:, :2], **FP32_TOL, equal_nan=True)
    assert torch.equal(ours[:, 2:], expected[:, 2:]), "the logits at the ids, the top-k values and ids"
    ours, expected = stats["triton"], stats["torch"]
    assert torch.equal(ours.topk_ids, expected.topk_ids)
    for name in ("logprobs", "lse", "entropy", "topk_logprobs"):
        torch.testing.assert_close(getattr(ours, name), getattr(expected, name), **FP32_TOL, equal_nan=True, msg=name)


def test_topk_above_max_k_takes_the_torch_path(monkeypatch):
    monkeypatch.setattr(topk_triton, "MAX_K", 4)
    calls = []
    _counted(monkeypatch, calls)
    logits = _stats_logits(37, 30, torch.float32, seed=0)
    kw = dict(vocab_start=0, vocab_size=30, tp_group=None)
    results = {}
    for mode in ("torch", "triton"):
        with _env(KERNEL_ENV, mode):
            results[mode] = [vocab_parallel_token_stats(logits, None, k, **kw) for k in (4, 5)]
    assert calls == ["local_stats", "topk"]  # k = 4 only
    for ours, expected in zip(results["triton"], results["torch"]):
        assert torch.equal(ours.topk_ids, expected.topk_ids)
        torch.testing.assert_close(ours.topk_logprobs, expected.topk_logprobs, **FP32_TOL)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_two_shards_reduce_to_the_full_vocabulary_topk(monkeypatch, dtype):
    """Each shard's packed statistics stacked as the TP = 2 all-gather would: the global top-k, ties
    across the shard boundary included (rounded logits), equals ``topk_logprobs`` on the whole
    vocabulary; the second shard (vocab_start 40) ends in padding."""
    _many_blocks(monkeypatch)
    width, vocab_size, k = 40, 77, 32
    g = torch.Generator().manual_seed(5)
    full = (2.0 * torch.randn(T, 2 * width, generator=g)).round()
    full[:, vocab_size:] = 1e4
    full = full.to(dtype=dtype, device=DEVICE)
    expected_values, expected_ids = topk_logprobs(full[:, :vocab_size], k)
    for mode in ("torch", "triton"):
        with _env(KERNEL_ENV, mode):
            packed = []
            for start in (0, width):
                shard = VocabShard(start, vocab_size, None)
                none = torch.empty(T, 0, dtype=torch.int64, device=DEVICE)
                packed.append(
                    _local_pass(
                        full[:, start : start + width], none, none.bool(), shard, k=k, with_entropy=False, chunk_size=4
                    )
                )
            stats = _reduce_pass(torch.stack(packed), num_ids=0, k=k, with_entropy=False)
        assert torch.equal(stats.topk_ids, expected_ids), mode
        torch.testing.assert_close(stats.topk_logprobs, expected_values, **FP32_TOL, msg=mode)


# ---------------------------------------------------------------- compiled for an H100, on any machine

_COMPILE_SM90 = textwrap.dedent(
    r"""
    import json, re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from megatron_empg.kernels import topk_triton as K

    fn = K._topk_kernel
    block, warps = K.launch_config(151936)
    out = {}
    for dtype in ("bf16", "fp32"):
        consts = {"BLOCK": block, "K_PAD": 32}
        ints = {"logits_row_stride": "i64", "width": "i32", "n_valid": "i32", "k": "i32"}
        ptrs = {"logits_ptr": "*" + dtype, "values_ptr": "*fp32", "ids_ptr": "*i64"}
        sig = {a: "constexpr" if a in consts else ints.get(a, ptrs.get(a)) for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if a.endswith("_ptr") or a in ("logits_row_stride", "width")}
        kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps})
        out[dtype] = len(re.findall(r"ld\.global[.\w]*\.v4\.b32", kernel.asm["ptx"]))
    print(json.dumps(out))
    """
)


def test_topk_kernel_compiles_for_sm90_with_vector_loads():
    """The default launch at 151,936 columns, k = 32, compiled to an H100 cubin with triton's own
    ptxas (no GPU needed): the loop, the insertion ``while`` and the sort lower, logits read in 16 B."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SM90],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    vector_loads = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(n >= 1 for n in vector_loads.values()), vector_loads
