"""The experts' implementations (``model.moe_experts``): the one list of their names, and what a
setting means on the machine that reads it. Imports neither megatron nor Transformer Engine, so
the bind step resolves the setting in milliseconds. How the experts compute, not what they are:
every choice holds the same weights, saves the same checkpoint (keys, shapes, offsets) and gives
the weight sync the same per-expert tensors.

    te          Transformer Engine's grouped experts (Megatron's ``TEGroupedMLP``: GroupedLinear
                per projection). Needs Transformer Engine and its layer spec
                (``model.attention_backend`` te).
    grouped     ``mcore.moe.grouped.GroupedExperts``: one stacked weight per projection and
                PyTorch's grouped GEMM (``torch.nn.functional.grouped_mm``) on CUDA in bf16, an
                exact per-expert fallback elsewhere; device-side group offsets (no host sync on
                the grouped GEMM's path); the routing weights applied in a fused weighted SwiGLU
                where ``bias_activation_fusion`` is on (CUDA).
    sequential  Megatron's ``SequentialMLP``: one MLP per local expert, run one after the other
                after reading the token counts on the host. The reference the others are tested
                against.

``auto`` (the default) means ``te`` where Transformer Engine imports and the layers are its spec,
else ``grouped``; ``resolve_moe_experts`` says which and why.
"""

from __future__ import annotations

import dataclasses

from megatron_empg.config import ConfigError
from megatron_empg.mcore.attention_backends import AttentionChoice, te_import_error

MOE_EXPERTS: dict[str, str] = {
    "te": "Transformer Engine's grouped experts (TEGroupedMLP)",
    "grouped": "stacked expert weights through torch's grouped GEMM (GroupedExperts)",
    "sequential": "Megatron's SequentialMLP: one MLP per expert, one after the other",
}
AUTO = "auto"
FIELD = "model.moe_experts"


@dataclasses.dataclass(frozen=True)
class ExpertsChoice:
    """What ``model.moe_experts`` resolved to: ``name`` in ``MOE_EXPERTS`` and why (``reason``)."""

    name: str
    reason: str

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"

    def gemm(self, *, cuda: bool, bf16: bool) -> str:
        """How the experts' GEMMs run with bf16 weights (or not) on a CUDA machine (or not)."""
        if self.name == "te":
            return "Transformer Engine's GroupedLinear"
        if self.name == "sequential":
            return "one GEMM per expert after a host read of the token counts"
        if cuda and bf16:
            return "torch grouped_mm, offsets on the device (no host sync)"
        return "the exact per-expert fallback (grouped_mm's fast path is CUDA bf16)"


def check_moe_experts_name(setting: str) -> None:
    """A ``ConfigError`` naming ``model.moe_experts`` unless ``setting`` is ``auto`` or a name of
    ``MOE_EXPERTS``."""
    if setting != AUTO and setting not in MOE_EXPERTS:
        raise ConfigError(FIELD, f"unknown name {setting!r}; expected {AUTO!r} or one of {sorted(MOE_EXPERTS)}")


def resolve_moe_experts(setting: str, attention: AttentionChoice) -> ExpertsChoice:
    """The implementation ``setting`` (``auto`` or a name of ``MOE_EXPERTS``) means here, for
    layers built on ``attention``'s spec.

    Raises ``ConfigError`` naming ``model.moe_experts``: an unknown name; ``te`` without Transformer
    Engine or on the local spec (its grouped linears are TE modules of TE's layer spec)."""
    check_moe_experts_name(setting)
    if setting == AUTO:
        te_error = te_import_error()
        if te_error is None and attention.uses_te:
            return ExpertsChoice("te", "auto: Transformer Engine imports")
        why = "Transformer Engine is not importable" if te_error is not None else f"attention is {attention.name}"
        return ExpertsChoice("grouped", f"auto: {why}")
    if setting == "te":
        if (te_error := te_import_error()) is not None:
            raise ConfigError(
                FIELD, f"te needs Transformer Engine, which does not import here ({te_error}); use grouped (or auto)"
            )
        if not attention.uses_te:
            raise ConfigError(
                FIELD,
                f"te needs Transformer Engine's layer spec (model.attention_backend te); attention is "
                f"{attention.describe()}: use grouped (or auto)",
            )
    return ExpertsChoice(setting, "configured")
