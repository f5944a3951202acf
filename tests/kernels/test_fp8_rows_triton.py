"""``kernels.fp8_rows_triton`` (row-wise FP8 quantization in one kernel) against ``core.fp8.quantize_rows``.

The FP8 bytes and the float32 inverse scales must EQUAL the torch path's, on fp32, bf16 and fp16
rows of every awkward kind: magnitudes from 1e-6 to 1e3 (e4m3 subnormals after scaling), a zero row,
signed zeros and values that round to zero, exact e4m3 values and every midpoint between two
(ties to even) with its neighbours one float32 ulp away, a row whose maximum is 448, one wide row
(several blocks) and rows of a strided view. Then the dispatch (``kernels.fp8_rows``) and a compile
for an H100, which the interpreter skips: the division and the cast lower to ``div.rn`` and a
saturating ``cvt.rn`` to e4m3.

Without CUDA the kernel runs under Triton's interpreter (``tests.kernels.interpreter``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_empg.core import fp8
from tests.kernels.interpreter import DEVICE, import_kernels, marks
from tests.kernels.interpreter import env as _env

triton, _, _ = import_kernels()
with _env("TRITON_INTERPRET", "1") if DEVICE == "cpu" else contextlib.nullcontext():
    from megatron_empg.kernels import fp8_rows_triton
pytestmark = marks(triton, fp8_rows_triton._quantize_rows_kernel)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value, ascending (from the dtype's 256 bit patterns)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[values.isfinite()].unique()


def _rows(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 640, generator=g) * torch.logspace(-6, 3, 24)[:, None]
    x[3] = 0
    x[4, :5] = torch.tensor([-0.0, 0.0, -1e-9, 1e-9, 1.0])  # signed zeros, values that round to 0
    values = _e4m3_values()
    mids = (values[1:] + values[:-1]) / 2
    up, down = mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))
    exact = torch.cat([values, mids, up, down])  # |x| <= 448: scale 448 / 448 = 1
    x[5, : exact.numel()] = (
        exact[:640] if exact.numel() >= 640 else torch.nn.functional.pad(exact, (0, 640 - exact.numel()))
    )
    x[5, 0] = 448.0
    x[6, :200] = -exact[200:400]
    x[6, 200] = -448.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_the_torch_path(dtype):
    x = _rows(dtype).to(DEVICE)
    q, scale_inv = fp8_rows_triton.quantize_rows(x)
    ref_q, ref_scale_inv = fp8.quantize_rows(x)
    assert torch.equal(scale_inv, ref_scale_inv)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert (q.float() != 0).any() and (q.view(torch.uint8) == 0x80).any()  # -0 kept


def test_wide_rows_and_strided_views():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 5000, generator=g).to(DEVICE)  # three blocks of 2048
    strided = torch.randn(8, 200, generator=g).to(DEVICE)[:, :150]
    for x in (wide, strided):
        q, scale_inv = fp8_rows_triton.quantize_rows(x)
        ref_q, ref_scale_inv = fp8.quantize_rows(x)
        assert torch.equal(scale_inv, ref_scale_inv) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_a_wrong_rounding_is_caught():
    """Negative control: truncating instead of rounding to nearest even differs from the kernel."""
    x = _rows(torch.float32).to(DEVICE)
    q, scale_inv = fp8_rows_triton.quantize_rows(x)
    scaled = x * (1 / scale_inv)[:, None]
    truncated = (
        torch.sign(scaled)
        * _e4m3_values()
        .to(DEVICE)[torch.searchsorted(_e4m3_values().to(DEVICE), scaled.abs().contiguous(), right=True) - 1]
        .abs()
    )
    assert not torch.equal(truncated, q.float())


def test_dispatch(monkeypatch):
    from megatron_empg import kernels

    monkeypatch.setenv("EMPG_VOCAB_KERNEL", "torch")
    assert kernels.fp8_rows() is None
    monkeypatch.setenv("EMPG_VOCAB_KERNEL", "auto")
    assert kernels.fp8_rows() is fp8_rows_triton.quantize_rows


_COMPILE_SM90 = textwrap.dedent(
    r"""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from megatron_empg.kernels import fp8_rows_triton as K

    fn = K._quantize_rows_kernel
    consts = {"FMAX": 448.0, "BLOCK": 2048}
    ints = {"cols": "i32", "stride_x": "i64", "stride_q": "i64"}
    ptrs = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_inv_ptr": "*fp32"}
    sig = {a: "constexpr" if a in consts else ints.get(a, ptrs.get(a)) for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = kernel.asm["ptx"]
    print(json.dumps({"div_rn": "div.rn.f32" in ptx, "cvt_e4m3": "e4m3x2.f32" in ptx}))
    """
)


def test_kernel_compiles_for_sm90():
    """Compiled to an H100 cubin with triton's own ptxas (no GPU needed): IEEE division, e4m3 cast."""
    pytest.importorskip("triton.backends.nvidia")
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SM90],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"div_rn": True, "cvt_e4m3": True}
