"""The attention backends (``model.attention_backend``): the one list of their names, and what a
setting means on the machine that reads it. Imports neither megatron nor Transformer Engine at
module import, so the bind step resolves the setting in milliseconds.

    te       Transformer Engine's layer spec: fused attention (THD packed rows natively), TE's
             norms and linears. Needs Transformer Engine (the NGC PyTorch container).
    sdpa     Megatron's local spec with ``mcore.attention.SdpaAttention`` as core attention:
             ``torch.nn.functional.scaled_dot_product_attention`` on padded rows (flash / cuDNN /
             memory-efficient kernels on CUDA, the CPU flash kernel on CPU) and, on packed rows,
             ``torch.nn.attention.varlen.varlen_attn`` on CUDA where this torch has it, else SDPA
             per length bucket. No [b, heads, s, s] scores are kept. Context parallelism: packed
             rows split over the CP group, K / V all-gathered (``mcore.cp_attention``). Needs
             torch >= 2.5 (SDPA's ``enable_gqa``).
    unfused  Megatron's local spec with its ``DotProductAttention`` (packed rows per length
             bucket): the [b, heads, s, s] scores, an fp32 softmax and a bf16 copy of it are
             written and kept for backward. The reference the others are tested against.

``auto`` (the default) means ``te`` where Transformer Engine imports, else ``sdpa`` where torch
has what it needs, else ``unfused``; ``resolve_attention_backend`` says which and why.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import torch

from megatron_empg.config import ConfigError

ATTENTION_BACKENDS: dict[str, str] = {
    "te": "Transformer Engine's layer spec and fused attention",
    "sdpa": "Megatron's local spec with torch's scaled_dot_product_attention / varlen_attn",
    "unfused": "Megatron's local spec with its unfused DotProductAttention ([b, heads, s, s] scores)",
}
AUTO = "auto"
FIELD = "model.attention_backend"
# SDPA's ``enable_gqa`` (grouped K/V heads without expanding them) arrived in torch 2.5.
SDPA_MIN_TORCH = (2, 5)


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """What ``model.attention_backend`` resolved to: ``name`` in ``ATTENTION_BACKENDS`` and why
    (``reason``: "configured", or what ``auto`` found)."""

    name: str
    reason: str

    @property
    def uses_te(self) -> bool:
        """Whether the model is built on Transformer Engine's layer spec."""
        return self.name == "te"

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


@functools.lru_cache(maxsize=1)
def te_import_error() -> str | None:
    """None when ``transformer_engine`` imports (what megatron-core's ``HAVE_TE`` tests), else why
    not. Imported once per process; a broken install (a missing shared library) counts as missing."""
    try:
        importlib.import_module("transformer_engine")
    except Exception as error:  # noqa: BLE001 - any failure means Megatron cannot use it either
        return f"{type(error).__name__}: {error}".splitlines()[0][:200]
    return None


def sdpa_missing() -> str | None:
    """None when this torch has what the ``sdpa`` backend needs, else what is missing."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < SDPA_MIN_TORCH:
        return f"torch {torch.__version__} is older than 2.5 (scaled_dot_product_attention's enable_gqa)"
    return None


def resolve_attention_backend(setting: str) -> AttentionChoice:
    """The backend ``setting`` (``auto`` or a name in ``ATTENTION_BACKENDS``) means here.

    Raises ``ConfigError`` naming ``model.attention_backend``: an unknown name, ``te`` without
    Transformer Engine, ``sdpa`` on a torch without what it needs."""
    if setting == AUTO:
        te_error = te_import_error()
        if te_error is None:
            return AttentionChoice("te", "auto: Transformer Engine imports")
        sdpa_error = sdpa_missing()
        if sdpa_error is None:
            return AttentionChoice("sdpa", "auto: Transformer Engine is not importable")
        return AttentionChoice("unfused", f"auto: Transformer Engine is not importable and {sdpa_error}")
    if setting not in ATTENTION_BACKENDS:
        raise ConfigError(FIELD, f"unknown name {setting!r}; expected {AUTO!r} or one of {sorted(ATTENTION_BACKENDS)}")
    if setting == "te" and (te_error := te_import_error()) is not None:
        raise ConfigError(
            FIELD,
            f"te needs Transformer Engine, which does not import here ({te_error}; torch {torch.__version__}). "
            "It comes with the NGC PyTorch container; elsewhere use sdpa (or auto)",
        )
    if setting == "sdpa" and (sdpa_error := sdpa_missing()) is not None:
        raise ConfigError(FIELD, f"sdpa needs torch >= 2.5: {sdpa_error}; use unfused (or auto)")
    return AttentionChoice(setting, "configured")
