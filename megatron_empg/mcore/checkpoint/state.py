"""What a checkpoint holds, as Megatron ``dist_checkpointing`` sharded state: the model chunks, the
optimizer (with workarounds for megatron-core 0.19.2 on torch Adam), the EMA anchor's float32 master
(sharded like the model), the per-rank RNG states, and the layout they were saved at. Used by
``mcore.checkpoint``'s save and load; imports megatron.core only inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_empg.mcore.checkpoint.files import CheckpointError
from megatron_empg.mcore.lora.model import is_adapter
from megatron_empg.mcore.parallel_state import ParallelGroups
from megatron_empg.parallel.collectives import collective_device

if TYPE_CHECKING:
    import torch.nn

ANCHOR_PREFIX = "anchor_master."


def unwrap(models: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """Model chunks without their DDP / Float16Module wrappers (checkpoint keys without ``module.``)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(models))


def layout_of(groups: ParallelGroups) -> dict[str, int | None]:
    """The grid a checkpoint was saved on (``cp`` only when context-parallel, ``ep`` and ``etp``
    only on an expert grid other than EP 1 x ETP = TP: the layouts saved before there was CP or
    EP compare equal to CP 1, EP 1)."""
    layout = {
        "tp": groups.tp_size,
        "pp": groups.pp_size,
        "vpp": groups.vpp_size,
        "dp": groups.dp_size,
        "world_size": groups.world_size,
    }
    if groups.cp_size > 1:
        layout["cp"] = groups.cp_size
    if groups.ep_size > 1 or groups.etp_size != groups.tp_size:
        layout["ep"], layout["etp"] = groups.ep_size, groups.etp_size
    return layout


def optimizer_has_state(optimizer) -> bool:
    """Whether any rank's optimizer holds state (has stepped). Collective."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    local = any(len(getattr(getattr(o, "optimizer", None), "state", None) or {}) > 0 for o in inner)
    flag = torch.tensor([int(local)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def init_fresh_torch_adam_state(optimizer) -> None:
    """Give a never-stepped distributed optimizer on torch Adam the state of step 0.

    megatron-core 0.19.2's ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` calls
    ``state_dict()``, which without TE/apex (torch Adam: the CPU path) asserts that the inner
    optimizer's per-parameter ``step`` values form one value; a fresh optimizer has none. Zero
    moments and ``step`` 0 are what torch Adam would hold before its first update; the load then
    overwrites them. With TE/apex FusedAdam (``step`` in the param groups) nothing is done.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if not isinstance(inner, distrib_optimizer.DistributedOptimizer) or len(inner.optimizer.state) > 0:
            continue
        if inner.init_state_fn is None:
            raise CheckpointError(f"cannot initialize the state of {type(inner.optimizer).__name__} for loading")
        inner.init_state_fn(inner.optimizer, inner.config)
        for state in inner.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))


def load_optimizer_state(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, working around two megatron-core 0.19.2 bugs of the
    distributed optimizer on torch Adam (no TE/apex: the CPU path; nothing is changed with TE/apex).

    1. ``_set_main_param_and_optimizer_states`` (reached from
       ``load_parameter_state_from_fully_reshardable``) looks up every tensor of the inner
       optimizer's state, torch Adam's ``step`` included, in the loaded tensors, which never hold
       ``step`` (it comes from the param groups): ``KeyError: 'step'``. A ``None`` entry makes it
       skip ``step``, as it already skips non-tensor entries. Scoped to this call.
    2. ``DistributedOptimizer.load_state_dict`` gives every parameter the same ``step`` tensor
       object and torch's ``Optimizer.load_state_dict`` keeps it shared; torch Adam increments
       each parameter's ``step`` in place, so one update would add the parameter count to all of
       them (wrong bias correction from the first step after a resume). Each parameter gets its
       own copy afterwards.
    """
    from megatron.core.optimizer import distrib_optimizer

    patched = []
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            if isinstance(inner, distrib_optimizer.DistributedOptimizer):
                original = inner._set_main_param_and_optimizer_states
                inner._set_main_param_and_optimizer_states = lambda model_param, tensors, original=original: original(
                    model_param, {"step": None, **tensors}
                )
                patched.append(inner)
    try:
        with torch.no_grad():  # load_parameter_state_from_dp_reshardable copies into views of the params
            optimizer.load_state_dict(state)
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states  # back to the class's method
    for inner in patched:
        for param_state in inner.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()


def optimizer_metadata(kind: str | None) -> dict:
    """The ``metadata`` for ``optimizer.sharded_state_dict`` (also saved as content metadata)."""
    if kind in (None, "per_parameter"):
        return {}
    return {"distrib_optim_sharding_type": kind, "chained_optim_avoid_prefix": True}


def model_parallel(layout: Mapping[str, Any]) -> tuple:
    """(TP, PP, VPP, EP, ETP) of a ``layout_of`` dict."""
    return layout["tp"], layout["pp"], layout["vpp"], layout.get("ep", 1), layout.get("etp", layout["tp"])


def _with_data(sharded, data: torch.Tensor):
    """A copy of a ShardedTensor / ShardedTensorFactory that holds ``data`` (same local shape)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(sharded, ShardedTensor):
        if tuple(sharded.local_shape) != tuple(data.shape) and sharded.flattened_range is None:
            raise CheckpointError(f"{sharded.key}: local shape {tuple(sharded.local_shape)} != {tuple(data.shape)}")
        return dataclasses.replace(sharded, data=data, dtype=data.dtype)
    if isinstance(sharded, ShardedTensorFactory):
        return dataclasses.replace(sharded, data=data)
    raise CheckpointError(f"unexpected sharded entry {type(sharded).__name__} for {getattr(sharded, 'key', '?')}")


def anchor_sharded_state(anchor, master: Mapping[str, torch.Tensor] | None) -> dict:
    """``{"anchor_master<i>": {key: ShardedTensor of the fp32 master}}``. With ``master`` None
    (loading) the tensors are fresh fp32 buffers of the parameters' local shapes."""
    master = dict(master) if master is not None else None
    out = {}
    for i, chunk in enumerate(unwrap(anchor.models)):
        params = dict(chunk.named_parameters())
        part = {}
        for key, sharded in chunk.sharded_state_dict(prefix=ANCHOR_PREFIX).items():
            name = key[len(ANCHOR_PREFIX) :]
            if name not in params or not anchor.averages(name):  # _extra_state, buffers, a frozen base
                continue
            param = params[name]
            if master is None:
                tensor = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            else:
                tensor = master.pop(f"{i}.{name}", None)
                if tensor is None:
                    raise CheckpointError(f"anchor.full_master_state() lacks {i}.{name} (anchor chunk {i} has it)")
                if tuple(tensor.shape) != tuple(param.shape) or tensor.dtype != torch.float32:
                    raise CheckpointError(
                        f"anchor master {i}.{name}: {tensor.dtype} {tuple(tensor.shape)}, expected float32 "
                        f"{tuple(param.shape)} (the parameter's local shape)"
                    )
            part[key] = _with_data(sharded, tensor)
        out[f"anchor_master{i}"] = part
    if master:
        raise CheckpointError(f"anchor.full_master_state() has entries the anchor models lack: {sorted(master)[:8]}")
    return out


def rng_sharded_object(groups: ParallelGroups, state: Any):
    """Per-rank RNG states as one ShardedObject over the (PP, TP, DP) grid (as Megatron-LM's
    ``rng_state``, with DP added: every rank's own state is kept; and CP, when there is one)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape, offset = (groups.pp_size, groups.tp_size, groups.dp_size), (groups.pp_rank, groups.tp_rank, groups.dp_rank)
    if groups.cp_size > 1:
        shape, offset = (*shape, groups.cp_size), (*offset, groups.cp_rank)
    return ShardedObject(
        "rng_state",
        state,
        shape,
        offset,
        replica_id=0,
    )


def get_rng_state() -> dict:
    import numpy as np
    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def has_adapters(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks are a LoRA policy's (``mcore.lora``)."""
    return any(is_adapter(name) for chunk in chunks for name, _ in chunk.named_parameters())


def model_sharded_state(chunks: Sequence[torch.nn.Module], *, adapters: bool | None = None) -> dict:
    """The chunks' checkpoint entries: all of them (``adapters`` None), a LoRA policy's adapters
    only (True: what its checkpoints hold), or all but the adapters (False: its base)."""
    out = {}
    for i, chunk in enumerate(chunks):
        entries = chunk.sharded_state_dict()
        if adapters is not None:
            entries = {k: v for k, v in entries.items() if is_adapter(k) == adapters}
        out[f"model{i}"] = entries
    return out


def load_model_entries(chunk: torch.nn.Module, state: Mapping, *, strict: bool, adapters: bool | None) -> None:
    """``chunk.load_state_dict`` of the entries ``model_sharded_state(adapters=...)`` asked for: the
    others (a LoRA policy's base, or its adapters) must be all that is left out."""
    if adapters is None:
        chunk.load_state_dict(state, strict=strict)
        return
    missing, unexpected = chunk.load_state_dict(state, strict=False)
    wrong = [k for k in missing if is_adapter(k) == adapters and not k.endswith("_extra_state")] + list(unexpected)
    if wrong:
        raise CheckpointError(f"the model's {'adapter' if adapters else 'base'} entries do not match: {wrong[:8]}")


def part_of(key: str) -> str:
    """Which part of a checkpoint a sharded key belongs to (for error messages)."""
    if key.startswith("optimizer."):
        return "optimizer"
    if key.startswith(ANCHOR_PREFIX):
        return "anchor"
    if key.startswith("rng_state"):
        return "rng"
    if key.startswith("common_state"):
        return "common"
    return "model"
