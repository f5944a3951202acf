"""A LoRA policy in the Megatron build: the layer spec with adapted linears, the frozen base, the
adapters' first values, and their names.

``use_lora(spec, lora, moe=...)`` swaps the local spec's linears for ``mcore.lora.layers``' (QKV and
proj, and fc1 and fc2 on a dense MLP) where ``lora``'s targets adapt them. ``finish`` leaves only
the adapters trainable: Megatron's DDP and optimizer take parameters that require a
gradient, so the base gets no gradient buffer, no optimizer state and no float32 master.

The adapters' first values: ``mcore.lora.init``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator

import torch

from megatron_empg.config.lora import LoraConfig
from megatron_empg.mcore import cpu_shims

ADAPTER = re.compile(r"\.lora\.([a-z_]+)\.lora_(A|B)$")
"""A parameter name of an adapter: ``<linear>.lora.<HF projection>.lora_<A|B>``."""


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` is an adapter's (else the base's)."""
    return ADAPTER.search(name) is not None


def use_lora(spec, lora: LoraConfig, *, moe: bool) -> None:
    """Give ``spec`` (Megatron's local GPT layer spec) the adapted linears of ``lora``'s targets."""
    cpu_shims.import_megatron()
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_empg.mcore.lora.layers import ROLES, LoraColumnParallelLinear, LoraRowParallelLinear

    targets = lora.resolved_targets(moe=moe)
    column, row = LoraColumnParallelLinear, LoraRowParallelLinear

    def adapted(role: str, cls) -> ModuleSpec:
        return ModuleSpec(module=cls, params={"role": role, "lora": lora, "targets": targets})

    def wanted(role: str) -> bool:
        return any(t in targets for t in ROLES[role])

    attention = spec.submodules.self_attention.submodules
    for field, role, cls in (("linear_qkv", "qkv", column), ("linear_proj", "proj", row)):
        if wanted(role):
            setattr(attention, field, adapted(role, cls))
    if moe:
        return
    mlp = spec.submodules.mlp  # functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))
    submodules = mlp.keywords["submodules"]
    for field, role, cls in (("linear_fc1", "fc1", column), ("linear_fc2", "fc2", row)):
        if wanted(role):
            submodules = dataclasses.replace(submodules, **{field: adapted(role, cls)})
    spec.submodules.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def finish(chunk: torch.nn.Module, lora: LoraConfig) -> None:
    """After the build's cast to the parameters' dtype: the adapters in ``lora.dtype`` (None: as
    they are), and every other parameter frozen (no gradient)."""
    for name, param in chunk.named_parameters():
        adapter = is_adapter(name)
        if adapter and lora.dtype is not None:
            param.data = param.data.to(DTYPES[lora.dtype])
        param.requires_grad_(adapter)


def adapters(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(local name of the linear, the linear)`` for each linear of ``chunk`` that has adapters."""
    for name, module in chunk.named_modules():
        if isinstance(getattr(module, "lora", None), torch.nn.ModuleDict) and len(module.lora):
            yield name, module
