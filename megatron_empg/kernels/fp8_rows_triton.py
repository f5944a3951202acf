"""Row-wise FP8 quantization in one kernel (``core.fp8.quantize_rows``'s arithmetic): one program
per row reads it twice, for its maximum and to write the e4m3 values, and stores the row's float32
``scale_inv``. The torch path takes five kernels and a float32 copy of the input; this one reads
the input in its own dtype. The scale is ``448 / amax`` divided with IEEE rounding (``div_rn``, as
torch divides), and each value is rounded to e4m3 in float32 arithmetic (``_round_e4m3``) before the
cast, which then is exact: the results equal the torch path's bit for bit, also under Triton's
interpreter, whose own float8 cast does not round to nearest even."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


@triton.jit
def _round_e4m3(v):
    """float32 ``v`` (|v| <= 448) rounded to nearest even at e4m3's precision: adding and removing
    ``1.5 * 2^(ulp + 23)`` rounds at ``2^ulp`` (float32 adds round to nearest even); ``ulp`` is 3
    bits under ``v``'s exponent, and 2^-9 in e4m3's subnormal range. The sign of a zero is kept."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp = tl.maximum(exponent, -6) - 3
    magic = (((ulp + 150) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (v + magic) - magic
    return tl.where(r == 0, v * 0.0, r)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_inv_ptr, cols, stride_x, stride_q, FMAX: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    m = tl.max(amax, axis=0)
    fmax = tl.full([], FMAX, tl.float32)
    one = tl.full([], 1.0, tl.float32)
    scale = tl.where(m > 0, tl.div_rn(fmax, tl.where(m > 0, m, one)), one)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v * scale, -FMAX), FMAX)
        tl.store(q_row + offs, _round_e4m3(q).to(tl.float8e4nv), mask=offs < cols)
    tl.store(scale_inv_ptr + row, tl.div_rn(one, scale))


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[R, C]`` (bf16 / fp16 / fp32) -> (float8_e4m3fn ``[R, C]``, float32 ``[R]``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale_inv = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(max(cols, 1)), 2048)
        _quantize_rows_kernel[(rows,)](x, q, scale_inv, cols, x.stride(0), q.stride(0), FMAX=FP8_MAX, BLOCK=block)
    return q, scale_inv
