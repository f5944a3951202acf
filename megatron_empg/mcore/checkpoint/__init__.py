"""Distributed checkpoints of an RL run: policy, optimizer, LR schedule, EMA anchor master, RNG
states and the loop's own counters, through Megatron's ``dist_checkpointing`` (torch_dist).
User-facing: docs/checkpoints.md.

Every rank of the default process group calls ``save_checkpoint``, ``find_verified_checkpoint``
and ``load_checkpoint`` together::

    remove_leftovers(root)                           # rank 0 at start-up: crashed saves' temp dirs
    parts = CheckpointParts(ddp_chunks, optimizer=opt, scheduler=sched, anchor=anchor)
    path = save_checkpoint(root, TrainState(step, data=cursor.state_dict()), parts, groups,
                           options=SaveOptions(keep_last=3), model=ModelMetadata(config=model_cfg))
    found = find_verified_checkpoint(root)           # newest intact: sizes and CRC32s, ranks share the reads
    # (find_latest_checkpoint(root): the same pick from sizes only; pure filesystem, no collectives)
    if found is not None:
        state = load_checkpoint(found.path, parts, groups)    # the TrainState: state.step, state.data

The loop's state (``TrainState``: step, optimizer steps, anchor updates, bad-step history, data
cursor, the engines' rollouts drawn ahead, the config) is one typed object with a version; older
checkpoints load with defaults (``train_state``'s docstring lists the versions).

On disk (``root`` is any directory on a filesystem all ranks share)::

    root/
      latest                      one line, the name of the newest committed checkpoint
      step_00000004/              a committed checkpoint (name: the step, 8+ digits)
        empg_checkpoint.json      ours, written last: {"complete": true, format, step, layout, ...,
                                    "files": {path: {"size", "crc32"}} of every other file}
        metadata.json             dist_checkpointing's (backend, version)
        .metadata, __<r>_<i>.distcp, ...   the torch_dist shards (and the common state: the TrainState)
        model_config.yaml         the ModelConfig (with ModelMetadata(config=...))
        hf/                       the HF config and tokenizer files (with ModelMetadata(hf_assets=...))
      step_00000006.tmp-1f2e3d4c/ a save in progress, or one that crashed: never loaded
      step_00000002.trash-.../    a checkpoint being deleted (retention or a re-save): never loaded

Atomicity. A save writes everything into ``step_N.tmp-<nonce>``; then rank 0 writes
``empg_checkpoint.json`` (temp file, fsync, rename), renames the directory to ``step_N``
(``os.replace``: atomic on one filesystem) and only then rewrites ``latest`` the same way. A crash
at any point leaves either the previous checkpoints untouched plus a ``*.tmp-*`` directory that
nothing loads, or a committed ``step_N`` that ``find_latest_checkpoint`` finds even if ``latest``
was not yet updated. Deletion renames a directory out of the ``step_N`` namespace before removing
its files, so a half-deleted checkpoint is never mistaken for a complete one.

Saves in the background (``mcore.checkpoint.async_save``): ``start_save(..., staging=HostStaging())``
copies the state into reused host buffers and returns a ``PendingSave`` whose files a thread writes
while training goes on; ``finish_save(pending)`` (every rank, once ``pending.written_everywhere()``)
commits it as above. ``save_checkpoint`` is ``finish_save(start_save(...))`` without staging.

Writing (``mcore.checkpoint.stream``). ``dist_checkpointing.save`` plans and finalises the save;
the shard files are written by a streaming writer (8 MiB writes, each file's CRC32 computed while
it is written, no copies of the state before writing), fully parallel over DP (each replicated
tensor written by one DP rank, spread by size).

Integrity (``mcore.checkpoint.files``, ``mcore.checkpoint.verify``). After ``dist_checkpointing.save``
rank 0 lists the files, the ranks' CRC32s of their shard files are gathered, every rank computes
the CRC32s of its share of the other files (``assign_files``: ``.metadata``, ``metadata.json``)
and rank 0 records them with the sizes in ``empg_checkpoint.json``. Every completeness check compares the
sizes, so a truncated or missing file makes a resume fall back to an older checkpoint (WARNING
naming the file); ``find_verified_checkpoint`` also compares the CRC32s (every rank reads its
share, split over the current world) and skips a damaged checkpoint the same way. Checkpoints
saved without a manifest load unchecked (INFO note).

Full disks. Before writing, rank 0 warns when the filesystem has less free space than the newest
checkpoint takes. A failed write raises ``SaveError`` (a ``CheckpointError``) on every rank
together, saying what failed, the free space, and the last checkpoint's name and size (it stays; a
resume loads it); the failed save's temp directory is removed. ``remove_leftovers`` removes those of crashed runs.

Resharding. Tensors are saved under global keys (Megatron's ``sharded_state_dict``: layers by
their global index, TP shards by their offset), so a checkpoint loads at another TP/PP/DP layout
(tested: TP2, PP2 and DP2 with the distributed optimizer, each loaded at TP1/PP1/DP1; VPP is not
tested). The distributed optimizer is saved as ``fully_reshardable`` by default (per-parameter
tensors in model space, reshardable in TP, PP and DP; see ``OPTIMIZER_FORMATS``). RNG states are
per rank and are restored only at the layout they were saved at.

Mixture of experts: experts are saved under their global index, so a checkpoint loads at another
expert-parallel size (tested: EP 2 -> EP 1, model, the plain and the fully_reshardable
distributed optimizer's state, the anchor). ``mcore.optimizer.wrap_with_ddp`` gives the experts
their own optimizer at every EP size, so that the optimizer's structure does not change with EP.
``dp_reshardable`` (flat per-DP-rank buffers, which follow the expert grid) is refused at another
TP/PP/VPP/EP/ETP.

Anchor. ``anchor`` is any object with ``models`` (its model chunks, whose parameters have the
policy's names and local shapes), ``full_master_state() -> {"<chunk>.<param name>": fp32 tensor}``
(a collective over DP; every rank returns its TP/PP part) and ``load_full_master_state(state)``.
The fp32 master is saved as ShardedTensors with the sharding metadata of the anchor's own
``sharded_state_dict(prefix="anchor_master.")``, so it reshards exactly like the model. The
prefix carries no chunk index: the keys are global already, and a chunk index would tie the
checkpoint to one VPP layout.

Model-only checkpoints. ``mcore.convert.write_model_checkpoint`` (tools/convert_hf_to_megatron.py)
writes the same format with the model part only (``parts``: no optimizer, scheduler, anchor or
RNG; step 0); ``load_checkpoint`` loads it at any layout. ``model_config.yaml`` and ``hf/`` let
tools/convert_megatron_to_hf.py work from a checkpoint alone.
"""

from __future__ import annotations

import importlib
from typing import Any

# The public API, by module. Resolved on first use (PEP 562): ``size``, ``files``, ``parts`` and
# ``train_state`` need neither torch nor megatron (the memory plan reads ``size`` when a config is checked), and importing one
# module of the package runs this file first.
_EXPORTS = {
    "files": (
        "DIST_CKPT_FILES",
        "FORMAT",
        "FORMAT_VERSION",
        "HF_ASSETS_DIR",
        "INFO_FILE",
        "LATEST_FILE",
        "TMP_MARK",
        "CheckpointError",
        "FoundCheckpoint",
        "SaveError",
        "checkpoint_bytes",
        "checkpoint_problem",
        "copy_hf_assets",
        "find_latest_checkpoint",
        "fsync_dir",
        "list_files",
        "read_checkpoint_info",
        "read_model_config",
        "remove_leftovers",
        "write_atomic",
    ),
    "load": ("load_checkpoint",),
    "parts": ("DEFAULT_OPTIMIZER_FORMAT", "OPTIMIZER_FORMATS", "CheckpointParts", "ModelMetadata", "SaveOptions"),
    "save": ("checkpoint_info", "finish_checkpoint_dir", "finish_save", "save_checkpoint", "start_save"),
    "async_save": ("HostStaging", "PendingSave"),
    "train_state": ("TRAIN_STATE_VERSION", "TrainState"),
    "verify": ("find_verified_checkpoint", "verify_checkpoint"),
    "writer": ("start_checkpoint_writer",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
