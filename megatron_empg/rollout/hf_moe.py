"""The transformers engine's view of a mixture of experts (``rollout.hf_engine``): where the
per-expert checkpoint tensors lie in transformers' fused expert parameters, and the experts each
layer's router chose."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_empg.rollout.engine import ROUTED_EXPERT_DTYPE

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def fused_expert_slices(owners: dict[str, torch.nn.Parameter]) -> dict[str, tuple[str, int, slice]]:
    """Checkpoint names of the experts that transformers fuses in memory -> (parameter name, expert,
    rows). Qwen3-MoE (transformers 5) keeps ``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` (expert e's
    gate rows ``[:F]``, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, F]``; checkpoints
    and the weight sync name each expert's ``mlp.experts.{e}.gate_proj.weight`` ``[F, H]``,
    ``up_proj.weight`` and ``down_proj.weight`` ``[H, F]``."""
    slices = {}
    for name, parameter in owners.items():
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj") or parameter.dim() != 3:
            continue
        for e in range(parameter.size(0)):
            if kind == "down_proj":
                slices[f"{prefix}.{e}.down_proj.weight"] = (name, e, slice(None))
            else:
                ffn = parameter.size(1) // 2
                slices[f"{prefix}.{e}.gate_proj.weight"] = (name, e, slice(0, ffn))
                slices[f"{prefix}.{e}.up_proj.weight"] = (name, e, slice(ffn, 2 * ffn))
    return slices


class RouterRecorder:
    """Forward hooks on a transformers MoE model's routers (``model.layers.{i}.mlp.gate``, which
    return ``(logits, weights, indices)``): the expert ids of the tokens of each forward."""

    def __init__(self, model: PreTrainedModel) -> None:
        gates = [layer.mlp.gate for layer in model.model.layers]
        self._chosen: list[torch.Tensor] = []
        self._handles = [gate.register_forward_hook(self._keep) for gate in gates]

    def _keep(self, module, inputs, output) -> None:
        self._chosen.append(output[2])  # [rows * width, top_k]: transformers' own top-k

    def take(self, rows: int, width: int) -> torch.Tensor:
        """[rows, width, layers, top_k] int16 (CPU) of the last forward, in the layers' order."""
        chosen, self._chosen = self._chosen, []
        return torch.stack(chosen, dim=1).view(rows, width, len(chosen), -1).to("cpu", ROUTED_EXPERT_DTYPE)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
