"""Loading a checkpoint of ``mcore.checkpoint`` (which re-exports ``load_checkpoint``; its docstring
describes the format, resharding and the parts): at any TP/PP/VPP/DP layout, every part checked
against what is asked for, the distributed optimizer through the megatron-core 0.19.2 workarounds
of ``mcore.checkpoint.state``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.checkpoint.files import CheckpointError, read_checkpoint_info
from megatron_empg.mcore.checkpoint.parts import CheckpointParts
from megatron_empg.mcore.checkpoint.state import (
    ANCHOR_PREFIX,
    anchor_sharded_state,
    has_adapters,
    init_fresh_torch_adam_state,
    is_distributed,
    layout_of,
    load_model_entries,
    load_optimizer_state,
    model_parallel,
    model_sharded_state,
    optimizer_has_state,
    optimizer_metadata,
    part_of,
    rng_sharded_object,
    set_rng_state,
    unwrap,
)
from megatron_empg.mcore.checkpoint.train_state import SAVED_KEY, TrainState
from megatron_empg.mcore.parallel_state import ParallelGroups

if TYPE_CHECKING:
    import torch.nn

logger = logging.getLogger(__name__)


def load_checkpoint(
    path: str | os.PathLike,
    parts: CheckpointParts,
    groups: ParallelGroups,
    *,
    strict: bool = True,
    model_name: str | None = None,
) -> TrainState:
    """Load the checkpoint at ``path`` (a ``step_N`` directory) into this rank's objects
    (``parts``), at any TP/PP/VPP/DP layout; every rank calls it. Returns its ``TrainState``
    (that of an older checkpoint filled with defaults; a newer version than this code reads is a
    ``CheckpointError``).

    ``path`` must be a complete checkpoint (``CheckpointError`` naming the missing marker or file
    otherwise). A part that is asked for (``optimizer``, ``scheduler``, ``anchor``) but absent from
    the checkpoint is an error. With ``strict`` a part that the checkpoint holds but is not asked
    for is an error too, and the model's keys must match exactly; ``strict=False`` skips such
    parts with a warning. RNG states are restored only at the layout they were saved at (a note is
    logged otherwise). A checkpoint saved before the optimizer's first update loads only into an
    optimizer that has not stepped either (its main params are refreshed from the loaded weights).
    Loading the model without its optimizer (``optimizer=None``, ``strict=False``) leaves any
    optimizer's main params stale: call its ``reload_model_params()``. A model-only checkpoint
    (``mcore.convert``) has no RNG states: the run keeps its own.
    """
    path = Path(path)
    info = read_checkpoint_info(path)  # before any import or collective: a bad path fails fast everywhere
    cpu_shims.import_megatron()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    optimizer, scheduler, anchor = parts.optimizer, parts.scheduler, parts.anchor
    held_parts = info["parts"]
    rank0 = dist.get_rank() == 0
    where = f"checkpoint {path} (step {info['step']}, saved at {info['layout']})"
    if model_name is not None and info.get("model_name") not in (None, model_name):
        raise CheckpointError(f"{where} holds model {info['model_name']!r}, expected {model_name!r}")

    asked = {"optimizer": optimizer is not None, "scheduler": scheduler is not None, "anchor": anchor is not None}
    held = {
        "optimizer": held_parts["optimizer"] is not None,
        "scheduler": held_parts["scheduler"],
        "anchor": held_parts["anchor"],
    }
    for part in asked:
        if asked[part] and not held[part]:
            raise CheckpointError(f"{where} has no {part} state, but a {part} was given to load into")
        if held[part] and not asked[part]:
            message = f"{where} holds {part} state that is not loaded (no {part} given)"
            if strict:
                raise CheckpointError(f"{message}; pass strict=False to skip it")
            if rank0:
                logger.warning(message)

    layout = layout_of(groups)
    same_layout = layout == info["layout"]
    restore_rng = same_layout and held_parts.get("rng", True)
    chunks = unwrap(parts.models)
    # a LoRA policy: its adapters from a checkpoint of adapters (which records their base), else its
    # base from a checkpoint of a whole model (the adapters keep their first values)
    adapters = None if not has_adapters(chunks) else info.get("lora_base") is not None
    if adapters is None and info.get("lora_base") is not None:
        raise CheckpointError(
            f"{where} holds LoRA adapters only (their base: {info['lora_base']['path']}); "
            "this model has no adapters (model.lora)"
        )
    state = model_sharded_state(chunks, adapters=adapters)
    load_optimizer = optimizer is not None and held_parts["optimizer"] == "saved"
    if load_optimizer:
        kind = held_parts["optimizer_format"]
        if (kind == "per_parameter") == is_distributed(optimizer):
            raise CheckpointError(
                f"{where} holds the state of a {'non-' if kind == 'per_parameter' else ''}distributed optimizer "
                f"(format {kind}); this run's optimizer is {'' if is_distributed(optimizer) else 'not '}distributed. "
                "Switching between them on load is not supported: set use_distributed_optimizer as at save time"
            )
        if kind == "dp_reshardable" and model_parallel(layout) != model_parallel(info["layout"]):
            raise CheckpointError(
                f"{where} saved the distributed optimizer as dp_reshardable, which loads only at the same "
                f"TP/PP/VPP/EP/ETP ({model_parallel(info['layout'])}), not at {model_parallel(layout)}"
            )
        init_fresh_torch_adam_state(optimizer)
        metadata = optimizer_metadata(kind)
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=True, metadata=metadata)
    elif optimizer is not None:  # saved before the first update: the optimizer must be fresh too
        if optimizer_has_state(optimizer):
            raise CheckpointError(
                f"{where} was saved before the optimizer's first update, but this optimizer has state; "
                "load it into a freshly built optimizer"
            )
        if rank0:
            logger.info("%s saved a fresh (never stepped) optimizer; this one is fresh as well", where)
    if anchor is not None:
        state.update(anchor_sharded_state(anchor, None))
    if restore_rng:
        state["rng_state"] = rng_sharded_object(groups, None)
    elif rank0 and held_parts.get("rng", True):
        logger.info("%s: layout differs from this run's %s; RNG states are not restored", where, layout)

    try:
        loaded, missing, unexpected = dist_checkpointing.load(state, str(path), strict=StrictHandling.RETURN_ALL)
    except CheckpointError:
        raise
    except Exception as e:  # dist_checkpointing raises CheckpointingException, torch errors, ...
        raise CheckpointError(f"{where} cannot be loaded into this model at {layout}: {type(e).__name__}: {e}") from e
    # dist_checkpointing's words: "unexpected" = asked for but not in the checkpoint,
    # "missing" = in the checkpoint but not asked for.
    if unexpected:
        by_part: dict[str, list[str]] = {}
        for key in sorted(unexpected):
            by_part.setdefault(part_of(key), []).append(key)
        detail = "; ".join(f"{part}: {keys[:5]}{' ...' if len(keys) > 5 else ''}" for part, keys in by_part.items())
        raise CheckpointError(f"{where} lacks entries this run needs at {layout} ({detail})")
    not_loaded = {k for k in missing if part_of(k) == "model"}  # the other parts were checked above
    if not_loaded:
        message = f"{where} holds model entries this model does not have: {sorted(not_loaded)[:8]}"
        if strict:
            raise CheckpointError(message)
        if rank0:
            logger.warning(message)

    # a train state this code cannot read fails before the loaded state is applied
    train_state = TrainState.from_saved(loaded.get(SAVED_KEY), step=info["step"], source=where)
    for i, chunk in enumerate(chunks):
        load_model_entries(chunk, loaded[f"model{i}"], strict=strict, adapters=adapters)
    if load_optimizer:
        load_optimizer_state(optimizer, loaded["optimizer"])
    elif optimizer is not None:  # fresh: its float32 main params (bf16/fp16 models) follow the loaded weights
        with torch.no_grad():
            optimizer.reload_model_params()
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if anchor is not None:
        master = {}
        for i in range(len(anchor.models)):
            for key, tensor in loaded[f"anchor_master{i}"].items():
                master[f"{i}.{key[len(ANCHOR_PREFIX) :]}"] = tensor
        anchor.load_full_master_state(master)
    if restore_rng:
        set_rng_state(loaded["rng_state"])

    if rank0:
        optimizer_note = "loaded" if load_optimizer else ("fresh" if optimizer is not None else "not asked")
        rng_note = (
            "restored"
            if restore_rng
            else ("not restored (layout differs)" if held_parts.get("rng", True) else "none saved")
        )
        anchor_note = "loaded" if anchor is not None else "not asked"
        logger.info(
            "loaded %s at %s (optimizer: %s, anchor: %s, RNG: %s)", where, layout, optimizer_note, anchor_note, rng_note
        )
    return train_state
