"""A LoRA policy's weights as the engine and HF see them: each adapted linear's merged weight
``W + (alpha / r) layout(p -> B_p A_p)`` in the base weight's local TP shard and dtype (what the
``merged`` weight sync pushes and a merged export writes), and the adapters by global name.

For a column-parallel linear ``B_p A_p`` is ``[rows of p on this rank, in]``, placed in the fused
rows as the forward places its output (``layers.layout``, applied to the transposed deltas); for a
row-parallel one ``B A_local`` is ``[out, in / TP]``, the base's own shard. The product is formed in
float32 and added to the base weight in float32, then cast to the weight's dtype once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_empg.config.lora import LORA_TARGETS


@torch.no_grad()
def merged_weight(linear) -> Tensor:
    """``linear.weight + scale * delta`` (module docstring) as a new tensor in the weight's dtype."""
    from megatron_empg.mcore.lora.layers import COLUMN_ROLES, layout

    weight = linear.weight
    if linear.lora_role in COLUMN_ROLES:
        parts = {
            LORA_TARGETS[name][1]: (pair.lora_B.float() @ pair.lora_A.float()).t() for name, pair in linear.lora.items()
        }
        delta = layout(linear.lora_role, parts, linear.lora_rows, linear.config, linear.tp_group.size()).t()
    else:
        ((_, pair),) = linear.lora.items()
        delta = pair.lora_B.float() @ pair.lora_A.float()
    return (weight.float() + linear.lora_scale * delta).to(weight.dtype)


def merged_weights(module: torch.nn.Module) -> dict[str, Tensor]:
    """Local parameter name (``<linear>.weight``) -> merged weight, for each adapted linear of
    ``module`` (a model chunk; empty without adapters)."""
    from megatron_empg.mcore.lora.model import adapters

    return {f"{name}.weight": merged_weight(linear) for name, linear in adapters(module)}
