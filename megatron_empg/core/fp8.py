"""FP8 (e4m3) with one scale per row: the quantization and the scaled matmul of the FP8 anchor.

A row ``x[r, :]`` of a weight or an activation is stored as ``q[r, :] = e4m3(x[r, :] * s[r])`` with
``s[r] = 448 / amax(|x[r, :]|)`` (1 for a zero row), computed in float32, clamped to +-448 (e4m3fn
has no infinity: a value past 448 would become NaN) and rounded to nearest even by the cast. What is
kept beside ``q`` is the inverse ``scale_inv[r] = 1 / s[r]`` (float32), so that
``x ~ q.float() * scale_inv[:, None]``: the operand form of ``torch._scaled_mm``'s row-wise scales.

Two matmuls compute ``y = x @ w.T`` from the quantized operands (``SCALED_MATMULS``):
    emulated  dequantize both in float32 and multiply there (any device, any shape);
    torch     ``torch._scaled_mm`` (Hopper / Ada tensor cores in FP8 with float32 accumulation;
              PyTorch's CPU kernel, which computes the emulated product exactly).
Both take the same quantized operands, so they differ only by the float32 accumulation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALED_MM_ALIGN = 16  # torch._scaled_mm on CUDA: every dimension a multiple of 16


def scales_from_amax(amax: Tensor) -> Tensor:
    """float32 ``[R]`` row maxima of ``|x|`` -> the quantization scales ``448 / amax`` (1 where 0),
    one IEEE division each (``scalar / tensor`` would be ``reciprocal(tensor) * scalar``: two roundings)."""
    amax = amax.float()
    return torch.where(amax > 0, torch.full_like(amax, FP8_MAX) / amax, torch.ones_like(amax))


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` ``[R, C]`` (any float dtype) and float32 scales ``[R]`` -> float8_e4m3fn ``[R, C]``."""
    return (x.float() * scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[R, C]`` -> (float8_e4m3fn ``[R, C]``, float32 ``scale_inv`` ``[R]``). No host sync."""
    scale = scales_from_amax(x.abs().amax(dim=1))
    return quantize(x, scale), scale.reciprocal()


def dequantize(q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """float8 ``[R, C]`` and float32 ``[R]`` -> ``q * scale_inv`` in ``dtype`` (computed in float32)."""
    return (q.float() * scale_inv[:, None]).to(dtype)


def scaled_mm_emulated(xq: Tensor, x_scale_inv: Tensor, wq: Tensor, w_scale_inv: Tensor, out_dtype) -> Tensor:
    """``xq`` ``[M, K]``, ``wq`` ``[N, K]`` float8 with float32 row scales ``[M]``, ``[N]`` ->
    ``dequant(xq) @ dequant(wq).T`` ``[M, N]`` in ``out_dtype`` (float32 products and sums)."""
    return (dequantize(xq, x_scale_inv) @ dequantize(wq, w_scale_inv).t()).to(out_dtype)


def scaled_mm_torch(xq: Tensor, x_scale_inv: Tensor, wq: Tensor, w_scale_inv: Tensor, out_dtype) -> Tensor:
    """``scaled_mm_emulated``'s product through ``torch._scaled_mm`` (row-wise scales). On CUDA the
    rows of ``xq`` are padded to a multiple of 16 (``wq``'s dimensions must already be, see
    ``scaled_mm_fits``)."""
    rows = xq.shape[0]
    pad = -rows % SCALED_MM_ALIGN if xq.is_cuda else 0
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
        x_scale_inv = torch.cat([x_scale_inv, x_scale_inv.new_ones(pad)])
    out = torch._scaled_mm(xq, wq.t(), scale_a=x_scale_inv[:, None], scale_b=w_scale_inv[None, :], out_dtype=out_dtype)
    return out[:rows] if pad else out


def scaled_mm_fits(weight_shape: torch.Size, device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes a weight of this ``[N, K]`` shape on ``device``."""
    return device.type != "cuda" or all(d % SCALED_MM_ALIGN == 0 for d in weight_shape)


def scaled_grouped_mm_emulated(
    xq: Tensor, x_scale_inv: Tensor, wq: Tensor, w_scale_inv: Tensor, offsets: Tensor, out_dtype
) -> Tensor:
    """Experts one after the other in the rows of ``xq`` ``[M, K]`` (float8, row scales ``[M]``),
    expert g owning rows ``offsets[g - 1] .. offsets[g]`` (int32 cumulative ends ``[G]``), its
    weight ``wq[g]`` ``[N, K]`` (scales ``w_scale_inv[g]`` ``[N]``): ``y[rows of g] = x @ w[g].T`` in
    float32 from the dequantized operands, ``[M, N]`` in ``out_dtype``; rows past the last group 0.
    Reads the offsets on the host (the emulation's loop)."""
    x = dequantize(xq, x_scale_inv)
    out = x.new_zeros(x.shape[0], wq.shape[1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ dequantize(wq[g], w_scale_inv[g]).t()
        start = end
    return out.to(out_dtype)


def scaled_grouped_mm_torch(
    xq: Tensor, x_scale_inv: Tensor, wq: Tensor, w_scale_inv: Tensor, offsets: Tensor, out_dtype
) -> Tensor:
    """``scaled_grouped_mm_emulated``'s product through ``torch._scaled_grouped_mm`` (CUDA sm90,
    row-wise scales, offsets read on the device)."""
    return torch._scaled_grouped_mm(
        xq, wq.transpose(-2, -1), x_scale_inv, w_scale_inv, offs=offsets, out_dtype=out_dtype
    )


def scaled_grouped_mm_available(weight: Tensor) -> bool:
    """Whether ``torch._scaled_grouped_mm`` takes a ``[G, N, K]`` weight on its device: CUDA
    (PyTorch has no CPU kernel), the op present, ``N`` and ``K`` multiples of 16."""
    return (
        weight.is_cuda
        and hasattr(torch, "_scaled_grouped_mm")
        and all(d % SCALED_MM_ALIGN == 0 for d in weight.shape[1:])
    )


ScaledMatmul = Callable[[Tensor, Tensor, Tensor, Tensor, torch.dtype], Tensor]
SCALED_MATMULS: dict[str, ScaledMatmul] = {"emulated": scaled_mm_emulated, "torch": scaled_mm_torch}


def fp8_linear(
    x: Tensor, wq: Tensor, w_scale_inv: Tensor, bias: Tensor | None, matmul: ScaledMatmul, quantize_fn=quantize_rows
) -> Tensor:
    """``x @ w.T + bias`` with ``x`` ``[..., K]`` (bf16 / fp16 / fp32) quantized per row (token) by
    ``quantize_fn`` and ``w`` given quantized (``wq`` float8 ``[N, K]``, ``w_scale_inv`` float32
    ``[N]``). Returns ``[..., N]`` in ``x``'s dtype."""
    lead = x.shape[:-1]
    xq, x_scale_inv = quantize_fn(x.reshape(-1, x.shape[-1]))
    out = matmul(xq, x_scale_inv, wq, w_scale_inv, x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*lead, wq.shape[0])
