"""Which storage the EMA anchor's compute weights take on this machine (``mcore.anchor.storage``):
resolved once by ``bind`` (``Components.anchor_storage``), read by the planner, the builder and
``empg check``."""

from __future__ import annotations

import torch

from megatron_empg.config import RunConfig


def anchor_storage(config: RunConfig) -> tuple[str, str]:
    """The EMA anchor's storage kind on this machine (``mcore.anchor.storage``: plain, te, torch,
    emulated) and why. ``algorithm.anchor.fp8: auto`` is TE where TE and a GPU are there and the
    distributed optimizer is off, else torch where the GPU multiplies in FP8, else emulated."""
    anchor = config.algorithm.anchor
    if anchor.compute_dtype != "float8_e4m3fn":
        return "plain", f"compute_dtype {anchor.compute_dtype}"
    if anchor.fp8 != "auto":
        return anchor.fp8, "algorithm.anchor.fp8"
    if te_fp8_possible() and not config.optimizer.use_distributed_optimizer:
        return "te", "auto: Transformer Engine and a GPU"
    te = "the distributed optimizer" if te_fp8_possible() else "no Transformer Engine"
    if fp8_matmul_possible():
        major, minor = torch.cuda.get_device_capability()
        return "torch", f"auto: {te}; this GPU (sm{major}{minor}) multiplies in FP8"
    where = "no GPU" if not torch.cuda.is_available() else "a GPU without FP8 matmul"
    return "emulated", f"auto: {te}; {where} (the FP8 arithmetic, computed in float32)"


def fp8_matmul_possible() -> bool:
    """A GPU whose tensor cores multiply FP8 (sm89 and newer) and PyTorch's ``_scaled_mm``."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and hasattr(torch, "_scaled_mm")


def te_fp8_possible() -> bool:
    """A GPU and Transformer Engine (Megatron's import of it)."""
    if not torch.cuda.is_available():
        return False
    from megatron_empg.mcore.model import te_available

    return te_available()
