"""The FP8 anchor's linear layers: Megatron's local ``ColumnParallelLinear`` / ``RowParallelLinear``
of the decoder with their matmul replaced by ``core.fp8.fp8_linear`` (the input quantized per token,
the weight already FP8 with row scales). Megatron's own ``forward`` keeps everything around the
matmul (the tensor-parallel regions, the reduce of a row-parallel output, the bias it skips); the
matmul is its ``_forward_impl``, which we set per module. The grouped experts
(``mcore.moe.grouped.GroupedExperts``) take a scaled grouped matmul the same way, through their
``grouped_linear``: ``torch._scaled_grouped_mm`` where it exists (CUDA sm90), else the emulation.
Forward only: the anchor has no gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_empg import kernels
from megatron_empg.core import fp8 as fp8_math
from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region  # noqa: E402
from megatron.core.utils import get_tensor_model_parallel_group_if_none  # noqa: E402

from megatron_empg.mcore.moe.grouped import GroupedExperts  # noqa: E402


def fp8_modules(models: Sequence[torch.nn.Module], *, output_layer: bool = False) -> dict[str, torch.nn.Module]:
    """``"<chunk>.<parameter name>"`` -> the module multiplying by that weight in the decoder: the
    local linears (``weight``) and the grouped experts (``linear_fc1.weight``, ``linear_fc2.weight``);
    with ``output_layer`` an untied output layer too (by default it stays in the forward dtype: its
    log-probs are what the KL reads; a tied one reads the embedding's weight, which stays)."""
    out = {}
    for c, model in enumerate(models):
        for name, module in model.named_modules():
            if output_layer and name == "output_layer" and getattr(module, "weight", None) is not None:
                out[f"{c}.{name}.weight"] = module
            if not name.startswith("decoder."):
                continue
            if isinstance(module, ColumnParallelLinear | RowParallelLinear) and module.weight is not None:
                out[f"{c}.{name}.weight"] = module
            elif isinstance(module, GroupedExperts):
                out[f"{c}.{name}.linear_fc1.weight"] = out[f"{c}.{name}.linear_fc2.weight"] = module
    return out


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``core.fp8.quantize_rows`` (the same bits), by one Triton kernel on CUDA (``kernels.fp8_rows``)."""
    if x.is_cuda:
        kernel = kernels.fp8_rows()
        if kernel is not None:
            return kernel(x)
    return fp8_math.quantize_rows(x)


def install(module: torch.nn.Module, weight: Tensor, weight_scale_inv: Tensor, kind: str) -> None:
    """Make ``module`` multiply by ``weight`` (float8_e4m3fn ``[N, K]``, or ``[G, N, K]`` for grouped
    experts; float32 ``weight_scale_inv`` per row, kept up to date by the anchor's refresh) in FP8,
    the ``kind``'s way (``emulated`` or ``torch``)."""
    if isinstance(module, GroupedExperts):
        _install_grouped(module, weight, weight_scale_inv, kind)
    else:
        _install_linear(module, weight_scale_inv, fp8_math.SCALED_MATMULS[kind])


def _install_linear(module: torch.nn.Module, weight_scale_inv: Tensor, matmul: fp8_math.ScaledMatmul) -> None:

    def forward_impl(input: Tensor, weight: Tensor, bias: Tensor | None = None, **kwargs) -> Tensor:
        if kwargs.get("sequence_parallel"):
            group = get_tensor_model_parallel_group_if_none(kwargs.get("tp_group"))
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        return fp8_math.fp8_linear(input, weight, weight_scale_inv, bias, matmul, quantize_rows)

    module._forward_impl = forward_impl


def _install_grouped(module: GroupedExperts, weight: Tensor, weight_scale_inv: Tensor, kind: str) -> None:
    """The grouped experts' two projections through one scaled grouped matmul each."""
    scales = getattr(module, "_fp8_scales", {})
    scales[id(weight)] = weight_scale_inv.view(weight.shape[0], weight.shape[1])
    module._fp8_scales = scales
    torch_kind = kind == "torch" and fp8_math.scaled_grouped_mm_available(weight)
    matmul = fp8_math.scaled_grouped_mm_torch if torch_kind else fp8_math.scaled_grouped_mm_emulated

    def grouped_linear(x: Tensor, w: Tensor, offsets: Tensor, path: str | None = None) -> Tensor:
        xq, x_scale_inv = quantize_rows(x)
        return matmul(xq, x_scale_inv, w, module._fp8_scales[id(w)], offsets, x.dtype)

    module.grouped_linear = grouped_linear
