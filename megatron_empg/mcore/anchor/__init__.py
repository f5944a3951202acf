"""The EMA anchor of a Megatron policy (``EmaAnchor``): its layout and collectives (``layout``), what
its compute weights are stored as (``storage``: plain, emulated / torch FP8, TE FP8) and the FP8
linear matmul (``fp8_linear``). Imports megatron.core, ``core`` and ``kernels``; nothing above mcore."""

from megatron_empg.mcore.anchor.ema_anchor import EmaAnchor

__all__ = ["EmaAnchor"]
