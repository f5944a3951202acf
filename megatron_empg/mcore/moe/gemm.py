"""The grouped experts' arithmetic in plain torch: a grouped linear over experts that lie one after
the other in the rows of a token matrix, the device-side group offsets, and the weighted SwiGLU.

Layout. A projection's weights for G local experts are one tensor ``weight [G, N, K]``: expert g's
``[N, K]`` is Megatron's (and ``torch.nn.Linear``'s, and HF's per-expert) ``[out, in]`` matrix.
The tokens ``x [M, K]`` are sorted by expert (Megatron's token dispatcher hands them so), expert g
owning rows ``offsets[g - 1] .. offsets[g]`` (``offsets``: int32 cumulative group *ends*, as
``torch.nn.functional.grouped_mm`` takes them; empty groups are allowed). ``grouped_linear`` gives
``y [M, N]`` with ``y[rows of g] = x[rows of g] @ weight[g].T``.

Two ways to compute it, the same layout and math:

    grouped_mm  ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on a torch without the
                public name) on ``weight.transpose(-2, -1)``: one kernel per projection, backward
                registered by torch (dX a grouped GEMM against the transposed weights, dW the
                2D x 2D grouped case). On CUDA in bf16 on sm90/sm100 it is CUTLASS's grouped GEMM
                and reads ``offsets`` on the device: no host sync. Elsewhere torch falls back to
                a loop that copies ``offsets`` to the host. Needs 16-byte strides (``K`` a
                multiple of 8 in bf16, 4 in fp32) and 16-byte aligned data.
    per_group   ``_PerGroupLinear``: one ``matmul`` per expert, forward and backward exactly as
                Megatron's linear computes them (``x @ w.t()``, ``dX = dY @ w``, ``dW = dY.t() @ x``),
                so in fp32 on CPU it is bit-equal to ``SequentialMLP``. It reads the group sizes
                on the host (free on CPU; one sync per call on CUDA).

``gemm_path`` picks ``grouped_mm`` on CUDA in bf16 where the shapes allow it, else ``per_group``.
Rows past ``offsets[-1]`` are zeros on the ``per_group`` path; ``grouped_mm`` leaves them
undefined (Megatron's dispatcher never sends such rows).

The weighted SwiGLU ``(silu(gate) * up * probs).to(dtype)`` (Megatron's order: probs, float32,
multiply the activation, then the product is cast back) runs either as the plain ops (the
unfused path, Megatron's ``MLP`` without ``bias_activation_fusion``) or as ``WeightedSwiGLU``:
one autograd function keeping only fc1's output and the probs for backward, its forward and
backward each compiled once by ``torch.compile`` with the token dimension unbacked (no
recompiles for any token count, 0 and 1 included).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

GEMM_PATHS = ("grouped_mm", "per_group")
# torch's grouped GEMM: the public name where this torch has it (>= 2.9), else the ATen op.
grouped_mm: Callable[..., Tensor] = getattr(F, "grouped_mm", None) or torch._grouped_mm
_ALIGN = 16  # bytes: grouped_mm's stride and pointer alignment


def group_offsets(tokens_per_expert: Tensor, device: torch.device) -> Tensor:
    """int32 cumulative group ends on ``device`` from the tokens of each expert (a device cumsum;
    a host tensor is copied to the device, nothing is read back)."""
    counts = tokens_per_expert.to(device=device, non_blocking=True)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def grouped_mm_unsupported(x: Tensor, weight: Tensor) -> str | None:
    """Why ``grouped_mm`` cannot take ``x [M, K]`` and ``weight [G, N, K]`` here, or None. Host-side
    checks only (dtypes, strides, data pointers)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        return f"dtype {x.dtype} / {weight.dtype} (grouped_mm takes bf16, fp16 or fp32, both the same)"
    size = x.element_size()
    if x.dim() != 2 or weight.dim() != 3 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return "x must be [M, K] and weight [G, N, K], both contiguous in their last dimension"
    if (x.stride(0) * size) % _ALIGN or (weight.stride(1) * size) % _ALIGN or (weight.stride(0) * size) % _ALIGN:
        return f"strides not multiples of {_ALIGN} bytes (K={x.shape[-1]} in {x.dtype})"
    if x.data_ptr() % _ALIGN or weight.data_ptr() % _ALIGN:
        return f"data not {_ALIGN}-byte aligned"
    return None


def gemm_path(x: Tensor, weight: Tensor) -> str:
    """``grouped_mm`` where it runs without a host sync (CUDA, bf16, aligned), else ``per_group``."""
    if x.is_cuda and x.dtype == torch.bfloat16 and grouped_mm_unsupported(x, weight) is None:
        return "grouped_mm"
    return "per_group"


def grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor, *, path: str | None = None) -> Tensor:
    """``y [M, N]``, ``y[rows of g] = x[rows of g] @ weight[g].T`` (module docstring); ``path`` one
    of ``GEMM_PATHS`` (None: ``gemm_path``)."""
    path = path or gemm_path(x, weight)
    if path == "grouped_mm":
        return grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    if path == "per_group":
        return _PerGroupLinear.apply(x, weight, offsets)
    raise ValueError(f"path {path!r}: expected one of {GEMM_PATHS}")


def _bounds(offsets: Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()  # the per-group path's one host read
    return list(zip([0, *ends[:-1]], ends, strict=True))


class _PerGroupLinear(torch.autograd.Function):
    """``grouped_linear`` one expert at a time, with Megatron linear's forward and backward GEMMs."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
        bounds = _bounds(offsets)
        ctx.save_for_backward(x, weight)
        ctx.bounds = bounds
        outs = [x[start:end].matmul(weight[g].t()) for g, (start, end) in enumerate(bounds)]
        rest = x.shape[0] - (bounds[-1][1] if bounds else 0)
        if rest > 0:
            outs.append(x.new_zeros(rest, weight.shape[1]))
        return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for g, (start, end) in enumerate(ctx.bounds):
            if grad_x is not None:
                grad_x[start:end] = grad[start:end].matmul(weight[g])
            if grad_w is not None:
                grad_w[g] = grad[start:end].t().matmul(x[start:end])
        return grad_x, grad_w, None


# --------------------------------------------------------------------------------------------
# The weighted SwiGLU.


def weighted_swiglu_unfused(fc1: Tensor, probs: Tensor) -> Tensor:
    """``silu(gate) * up``, times ``probs`` [M] (float32: the product is float32), cast back to
    ``fc1``'s dtype: Megatron's ``MLP`` forward without ``bias_activation_fusion``, op for op."""
    gate, up = torch.chunk(fc1, 2, dim=-1)
    out = F.silu(gate) * up
    return (out * probs.unsqueeze(-1)).to(fc1.dtype)


def _fused_forward(fc1: Tensor, probs: Tensor) -> Tensor:
    gate, up = torch.chunk(fc1, 2, dim=-1)
    return ((F.silu(gate) * up) * probs.unsqueeze(-1)).to(fc1.dtype)


def _fused_backward(grad: Tensor, fc1: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
    """Megatron's ``weighted_swiglu_back``: the input's gradient from ``grad * probs`` (in probs'
    precision), the probs' gradient ``sum(swiglu(fc1) * grad)`` per token."""
    gate, up = torch.chunk(fc1, 2, dim=-1)
    weighted = grad.to(probs.dtype) * probs.unsqueeze(-1)
    sig = torch.sigmoid(gate.to(probs.dtype))
    gate32, up32 = gate.to(probs.dtype), up.to(probs.dtype)
    grad_gate = weighted * sig * (1 + gate32 * (1 - sig)) * up32
    grad_up = weighted * gate32 * sig
    grad_fc1 = torch.cat((grad_gate, grad_up), dim=-1).to(fc1.dtype)
    grad_probs = ((F.silu(gate) * up).to(probs.dtype) * grad.to(probs.dtype)).sum(-1)
    return grad_fc1, grad_probs


@functools.cache
def _compiled(backend: str | None) -> tuple[Callable, Callable]:
    kwargs = {"dynamic": True, "fullgraph": True, **({"backend": backend} if backend else {})}
    return torch.compile(_fused_forward, **kwargs), torch.compile(_fused_backward, **kwargs)


def _unbacked_tokens(*tensors: Tensor) -> None:
    """The token dimension as an unbacked size: one graph for every token count (0 and 1 too)."""
    for tensor in tensors:
        torch._dynamo.decorators.mark_unbacked(tensor, 0)


class WeightedSwiGLU(torch.autograd.Function):
    """The fused weighted SwiGLU (module docstring): ``apply(fc1 [M, 2F], probs [M], backend)``;
    ``backend`` None is ``torch.compile``'s default (inductor), ``"eager"`` runs uncompiled, any
    other a ``torch.compile`` backend (tests count compiles with ``aot_eager`` on CPU)."""

    @staticmethod
    def forward(ctx, fc1: Tensor, probs: Tensor, backend: str | None) -> Tensor:
        ctx.save_for_backward(fc1, probs)
        ctx.backend = backend
        if backend == "eager":
            return _fused_forward(fc1, probs)
        _unbacked_tokens(fc1, probs)
        return _compiled(backend)[0](fc1, probs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        fc1, probs = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.backend == "eager":
            grad_fc1, grad_probs = _fused_backward(grad, fc1, probs)
        else:
            _unbacked_tokens(grad, fc1, probs)
            grad_fc1, grad_probs = _compiled(ctx.backend)[1](grad, fc1, probs)
        return grad_fc1, grad_probs, None


def weighted_swiglu(fc1: Tensor, probs: Tensor, *, fused: bool, backend: str | None = None) -> Tensor:
    """``(silu(gate) * up * probs).to(fc1.dtype)`` for ``fc1 [M, 2F]`` and ``probs [M]``:
    ``WeightedSwiGLU`` when ``fused``, else the plain ops."""
    if fused:
        return WeightedSwiGLU.apply(fc1, probs, backend)
    return weighted_swiglu_unfused(fc1, probs)
