"""LoRA adapters on the policy's linear layers (``model.lora``): what they are, named as HF names
them. The adapters' layers are ``mcore.lora``; docs/lora.md says how a run uses them."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from megatron_empg.config.schema import Config, ConfigError

# HF's projection names (PEFT's ``target_modules``) -> (Megatron's linear in a transformer layer,
# the part of its output rows): the one list of LoRA targets. QKV and fc1 are fused in Megatron;
# each HF projection gets an adapter of its own on its rows, so the adapters are PEFT's exactly.
LORA_TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "q"),
    "k_proj": ("self_attention.linear_qkv", "k"),
    "v_proj": ("self_attention.linear_qkv", "v"),
    "o_proj": ("self_attention.linear_proj", "all"),
    "gate_proj": ("mlp.linear_fc1", "gate"),
    "up_proj": ("mlp.linear_fc1", "up"),
    "down_proj": ("mlp.linear_fc2", "all"),
}
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = tuple(LORA_TARGETS)


@dataclasses.dataclass(frozen=True)
class LoraConfig(Config):
    """Low-rank adapters on the policy's linear layers (Hu et al. 2021; PEFT's ``LoraConfig``):
    ``W x + (alpha / rank) B A dropout(x)``, ``A [rank, in]``, ``B [out, rank]``. The base weights
    are frozen (no gradient, no optimizer state); the optimizer, the EMA anchor and checkpoints hold
    the adapters only. A model YAML sets it, or a run with ``model_overrides: [lora.rank=64,
    lora.alpha=128]``."""

    rank: int = 16
    """The adapters' rank r (PEFT's ``r``)."""
    alpha: float = 32.0
    """The scale's numerator: the update is ``(alpha / rank) B A x`` (PEFT's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the update pass, in [0, 1) (PEFT's ``lora_dropout``); the
    old and anchor passes run without it."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """A's initialization, B being zeros (so the adapted model starts as the base): ``kaiming``
    is PEFT's default (``torch.nn.Linear``'s kaiming-uniform, a = sqrt 5), ``gaussian`` normal with
    std 1 / rank (PEFT's ``init_lora_weights="gaussian"``). Drawn per adapter from the run's seed
    and the adapter's name, so every parallel layout starts from the same adapters."""
    dtype: Literal["bfloat16", "float32"] | None = None
    """The adapters' parameters; null: ``train.params_dtype`` (bf16 adapters get the optimizer's
    float32 master, as every bf16 parameter does)."""
    targets: list[str] = dataclasses.field(default_factory=lambda: list(ATTENTION_TARGETS))
    """HF projection names to adapt: q_proj, k_proj, v_proj, o_proj (attention), gate_proj,
    up_proj, down_proj (a dense MLP; not the experts of a mixture of experts), or ``all-linear``
    for every one the model has."""

    def validate(self) -> None:
        if isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError("rank", f"must be an integer >= 1, got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError("alpha", f"must be a positive finite number, got {self.alpha!r}")
        if not (math.isfinite(self.dropout) and 0 <= self.dropout < 1):
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ConfigError("targets", "must name at least one projection")
        unknown = [t for t in self.targets if t not in LORA_TARGETS and t != "all-linear"]
        if unknown:
            raise ConfigError("targets", f"unknown {unknown}; expected names of {list(LORA_TARGETS)} or 'all-linear'")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError("targets", f"names a projection twice: {self.targets}")

    @property
    def scale(self) -> float:
        """``alpha / rank``, the update's factor."""
        return self.alpha / self.rank

    def resolved_targets(self, *, moe: bool) -> tuple[str, ...]:
        """The HF projections adapted, in ``LORA_TARGETS``' order (``all-linear``: every one the
        model has; a mixture of experts has no dense MLP)."""
        if "all-linear" in self.targets:
            return ATTENTION_TARGETS if moe else ALL_LINEAR
        return tuple(t for t in LORA_TARGETS if t in self.targets)
