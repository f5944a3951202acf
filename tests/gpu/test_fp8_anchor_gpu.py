"""The torch FP8 anchor's pieces on CUDA against the emulated ones (``core.fp8``): one decoder-sized
linear of the 1.5B (hidden 1536, the fused QKV's 2,048 rows and the MLP's 17,920 / 8,960) on an 8k
packed micro-batch in bf16.

    - the Triton row quantization (``kernels.fp8_rows``) equals the torch path bit for bit;
    - ``torch._scaled_mm`` (FP8 tensor cores, float32 accumulation) against the emulated product of
      the same FP8 operands: within 2^-7 of the output's scale normwise, the bf16 output's rounding
      (2^-8) plus the two paths' different summation orders; an operand quantized with another
      scale (the negative control) is off by more than 10x that;
    - the re-quantization of an anchor refresh makes no host sync
      (``torch.cuda.set_sync_debug_mode("error")``) and neither does the FP8 linear.

With ``EMPG_GPU_RESULTS_DIR`` set, the errors and both paths' times go to ``fp8_anchor_gpu_test.json``
there. Skipped without CUDA (``benchmarks/gpu_smoke.sh`` runs it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from megatron_empg.core import fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOKENS, HIDDEN = 8192, 1536
SHAPES = {"qkv": (2048, HIDDEN), "fc1": (17920, HIDDEN), "fc2": (HIDDEN, 8960)}
NORMWISE = 2.0**-7
RESULTS: dict = {}


def _fp8_capable() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


def _time(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_rows_equal_torch_and_scaled_mm_equals_emulated(name):
    from megatron_empg.kernels import fp8_rows

    if not _fp8_capable():
        pytest.skip("torch._scaled_mm needs sm89+")
    n, k = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    kernel = fp8_rows()
    assert kernel is not None
    xq, sx = kernel(x)
    ref_q, ref_s = fp8.quantize_rows(x)
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(sx, ref_s)
    wq, sw = fp8.quantize_rows(w)
    with torch.cuda.device(0):
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaled = fp8.fp8_linear(x, wq, sw, None, fp8.scaled_mm_torch, kernel)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    emulated = fp8.scaled_mm_emulated(xq, sx, wq, sw, torch.float32)
    err = ((scaled.float() - emulated).norm() / emulated.norm()).item()
    wrong = fp8.scaled_mm_emulated(xq, sx * 1.25, wq, sw, torch.float32)  # negative control
    control = ((scaled.float() - wrong).norm() / emulated.norm()).item()
    bf16 = x @ w.t()
    RESULTS[name] = {
        "shape": [TOKENS, n, k],
        "scaled_vs_emulated_normwise": err,
        "negative_control_normwise": control,
        "fp8_vs_bf16_normwise": ((scaled.float() - bf16.float()).norm() / bf16.float().norm()).item(),
        "fp8_linear_s": _time(lambda: fp8.fp8_linear(x, wq, sw, None, fp8.scaled_mm_torch, kernel)),
        "bf16_matmul_s": _time(lambda: x @ w.t()),
        "triton_quantize_s": _time(lambda: kernel(x)),
        "torch_quantize_s": _time(lambda: fp8.quantize_rows(x)),
    }
    assert err <= NORMWISE, RESULTS[name]
    assert control > 10 * NORMWISE, RESULTS[name]


def test_requantization_makes_no_host_sync():
    from megatron_empg.mcore.anchor.storage import _row_pieces

    master = torch.randn(2048 * HIDDEN, device="cuda")
    store = torch.empty_like(master, dtype=torch.float8_e4m3fn)
    amax = torch.zeros(2048, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:  # a rank's range cutting rows at both ends, as the distributed optimizer's shards do
        start, end = 700, 2048 * HIDDEN - 900
        part = master[start:end]
        for lo, hi, row, n in _row_pieces(start, end, HIDDEN):
            rows = amax[row:][:n]
            torch.maximum(rows, part[lo:hi].view(n, -1).abs().amax(dim=1), out=rows)
        scale = fp8.scales_from_amax(amax)
        for lo, hi, row, n in _row_pieces(start, end, HIDDEN):
            store[start + lo : start + hi].view(n, -1).copy_(fp8.quantize(part[lo:hi].view(n, -1), scale[row:][:n]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    full_q, _ = fp8.quantize_rows(master.view(2048, HIDDEN))
    cut = full_q.view(-1)[start:end].view(torch.uint8)
    # the cut rows' maxima are their parts' (the all-reduce combines the ranks'); the whole rows equal
    inner = slice(HIDDEN - start % HIDDEN, (end // HIDDEN) * HIDDEN - start)
    assert torch.equal(store[start:end].view(torch.uint8)[inner], cut[inner])


def teardown_module(module):
    out = os.environ.get("EMPG_GPU_RESULTS_DIR")
    if out and RESULTS:
        Path(out, "fp8_anchor_gpu_test.json").write_text(json.dumps(RESULTS, indent=1) + "\n")
