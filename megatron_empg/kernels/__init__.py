"""Fused GPU kernels (Triton) below ``parallel/``: torch and triton only, triton imported on first use.

``vocab_logprob_kernels(logits)`` is the dispatch of ``parallel.vocab_parallel`` (the environment
variable ``EMPG_VOCAB_KERNEL``, see ``vocab_logprob_triton``): the kernel module when it serves
these logits, else None (the chunked torch path); ``vocab_topk_kernel(logits, k)`` the same for the
top-k (``topk_triton``). ``core`` never imports this layer.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

KERNEL_ENV = "EMPG_VOCAB_KERNEL"
KERNEL_MODES = ("auto", "triton", "torch")
KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # what the tests cover; fp16 and fp64 take the torch path


@functools.cache
def _import_or_none() -> ModuleType | None:
    try:
        from megatron_empg.kernels import vocab_logprob_triton
    except ImportError:  # no triton: the torch path serves
        return None
    return vocab_logprob_triton


def vocab_kernel_mode() -> str:
    """``EMPG_VOCAB_KERNEL`` (default ``auto``); ValueError naming the variable when invalid."""
    mode = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNEL_ENV}={mode!r} must be one of {KERNEL_MODES}")
    return mode


def vocab_logprob_kernels(logits: Tensor) -> ModuleType | None:
    """``vocab_logprob_triton`` when it serves ``logits`` [T, V_local], else None.

    It serves bf16 / fp32 logits with unit column stride, on CUDA (mode ``auto``) or on any
    device (mode ``triton``); never in mode ``torch``. In mode ``triton`` an ImportError of triton
    propagates.
    """
    mode = vocab_kernel_mode()
    if mode == "torch" or (mode == "auto" and not logits.is_cuda):
        return None
    if logits.dtype not in KERNEL_DTYPES or (logits.shape[-1] > 1 and logits.stride(-1) != 1):
        return None
    if mode == "triton":
        from megatron_empg.kernels import vocab_logprob_triton

        return vocab_logprob_triton
    return _import_or_none()


def vocab_topk_kernel(logits: Tensor, k: int) -> Callable[..., tuple[Tensor, Tensor]] | None:
    """``topk_triton.topk`` when ``vocab_logprob_kernels`` serves ``logits`` and 1 <= k <=
    ``topk_triton.MAX_K``, else None (the chunked torch path, ``core.logprob.topk_value_then_id``)."""
    if k < 1 or vocab_logprob_kernels(logits) is None:
        return None
    from megatron_empg.kernels import topk_triton  # triton imported: vocab_logprob_kernels did

    return topk_triton.topk if k <= topk_triton.MAX_K else None


def fp8_rows() -> Callable[[Tensor], tuple[Tensor, Tensor]] | None:
    """``fp8_rows_triton.quantize_rows`` (the row-wise FP8 quantization of ``core.fp8`` in one
    kernel), or None where triton is missing or ``EMPG_VOCAB_KERNEL`` is ``torch``."""
    if vocab_kernel_mode() == "torch":
        return None
    return _fp8_rows_or_none()


@functools.cache
def _fp8_rows_or_none() -> Callable[[Tensor], tuple[Tensor, Tensor]] | None:
    try:
        from megatron_empg.kernels import fp8_rows_triton
    except ImportError:
        return None
    return fp8_rows_triton.quantize_rows
