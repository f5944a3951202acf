"""Distributed checkpoints of an RL run: policy, optimizer, LR schedule, EMA anchor master, RNG
states and the loop's own counters, through Megatron's ``dist_checkpointing`` (torch_dist).

Every rank of the default process group calls ``save_checkpoint``, ``find_verified_checkpoint``
and ``load_checkpoint`` together::

    remove_leftovers(root)                           # rank 0 at start-up: crashed saves' temp dirs
    path = save_checkpoint(root, step, models=ddp_chunks, optimizer=opt, scheduler=sched,
                           anchor=anchor, extra_state={"data_cursor": c}, groups=groups)
    found = find_verified_checkpoint(root)           # newest intact: sizes and CRC32s, ranks share the reads
    # (find_latest_checkpoint(root): the same pick from sizes only; pure filesystem, no collectives)
    if found is not None:
        extra = load_checkpoint(found.path, models=..., optimizer=..., scheduler=...,
                                anchor=..., groups=groups)    # extra["step"], extra["data_cursor"]

On disk (``root`` is any directory on a filesystem all ranks share)::

    root/
      latest                      one line, the name of the newest committed checkpoint
      step_00000004/              a committed checkpoint (name: the step, 8+ digits)
        empg_checkpoint.json      ours, written last: {"complete": true, format, step, layout, ...,
                                    "files": {path: {"size", "crc32"}} of every other file}
        metadata.json             dist_checkpointing's (backend, version)
        .metadata, __<r>_<i>.distcp, ...   the torch_dist shards (and the common state)
        model_config.yaml         the ModelConfig (with save_checkpoint(model_config=...))
        hf/                       the HF config and tokenizer files (with hf_assets=...)
      step_00000006.tmp-1f2e3d4c/ a save in progress, or one that crashed: never loaded
      step_00000002.trash-.../    a checkpoint being deleted (retention or a re-save): never loaded

Atomicity. A save writes everything into ``step_N.tmp-<nonce>``; then rank 0 writes
``empg_checkpoint.json`` (temp file, fsync, rename), renames the directory to ``step_N``
(``os.replace``: atomic on one filesystem) and only then rewrites ``latest`` the same way. A crash
at any point leaves either the previous checkpoints untouched plus a ``*.tmp-*`` directory that
nothing loads, or a committed ``step_N`` that ``find_latest_checkpoint`` finds even if ``latest``
was not yet updated. Deletion renames a directory out of the ``step_N`` namespace before removing
its files, so a half-deleted checkpoint is never mistaken for a complete one.

Integrity (``mcore.checkpoint_files``). After ``dist_checkpointing.save`` rank 0 lists the files,
every rank computes the CRC32s of its share (``assign_files``: by size, over the ranks) and rank 0
records them with the sizes in ``empg_checkpoint.json``. Every completeness check compares the
sizes, so a truncated or missing file makes a resume fall back to an older checkpoint (WARNING
naming the file); ``find_verified_checkpoint`` also compares the CRC32s (every rank reads its
share, split over the current world) and skips a damaged checkpoint the same way. Checkpoints
saved without a manifest load unchecked (INFO note).

Full disks. Before writing, rank 0 warns when the filesystem has less free space than the newest
checkpoint takes. A failed write raises ``CheckpointError`` on every rank together, saying what
failed, the free space, and the last checkpoint's name and size (it stays; a resume loads it); the
failed save's temp directory is removed. ``remove_leftovers`` removes those of crashed runs.

Resharding. Tensors are saved under global keys (Megatron's ``sharded_state_dict``: layers by
their global index, TP shards by their offset), so a checkpoint loads at another TP/PP/DP layout
(tested: TP2, PP2 and DP2 with the distributed optimizer, each loaded at TP1/PP1/DP1; VPP is not
tested). The distributed optimizer is saved as ``fully_reshardable`` by default (per-parameter
tensors in model space, reshardable in TP, PP and DP; see ``OPTIMIZER_FORMATS``). RNG states are
per rank and are restored only at the layout they were saved at.

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

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import pickle
import random
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_empg.config import ModelConfig, load_model_config, to_yaml
from megatron_empg.mcore import checkpoint_files, cpu_shims
from megatron_empg.mcore.checkpoint_files import (  # noqa: F401 (re-exported: the checkpoint API is one module)
    DIST_CKPT_FILES,
    FORMAT,
    FORMAT_VERSION,
    INFO_FILE,
    LATEST_FILE,
    TMP_MARK,
    TRASH_MARK,
    CheckpointError,
    FoundCheckpoint,
    checkpoint_bytes,
    checkpoint_problem,
    find_checkpoint,
    find_latest_checkpoint,
    format_bytes,
    free_bytes,
    is_latest,
    list_files,
    newest_complete,
    read_checkpoint_info,
    remove_leftovers,
    step_dir_name,
    step_dirs,
    summarize,
)
from megatron_empg.mcore.parallel_state import ParallelGroups
from megatron_empg.parallel.collectives import collective_device

if TYPE_CHECKING:
    import torch.nn

logger = logging.getLogger(__name__)

MODEL_CONFIG_FILE = "model_config.yaml"  # the ModelConfig (config.to_yaml)
HF_ASSETS_DIR = "hf"  # copies of the HF config and tokenizer files
# Files of a HF model directory that are weights (the checkpoint holds those itself): never copied.
HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".index.json")
ANCHOR_PREFIX = "anchor_master."
# Distributed-optimizer checkpoint formats of megatron-core (``DistributedOptimizer.sharded_state_dict``)
# that this module writes. "fully_reshardable": per-parameter tensors in model space, loadable at any
# TP/PP/DP; the save all-gathers each model-parallel shard's optimizer state over DP.
# "dp_reshardable": each rank writes its own flat buffer, no exchange; loadable at another DP size
# only. ("fully_sharded_model_space", the no-exchange reshardable format, fails in 0.19.2:
# "ShardedTensor.flattened_range is not supported".) The non-distributed optimizer ignores this.
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
DEFAULT_OPTIMIZER_FORMAT = "fully_reshardable"


# --------------------------------------------------------------------------------------------
# Files: model config, HF assets, atomic writes.


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` stored in the checkpoint at ``path``; ``CheckpointError`` if it has none."""
    config_path = Path(path) / MODEL_CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(
            f"{path} has no {MODEL_CONFIG_FILE}: it was saved without model_config "
            "(save_checkpoint(..., model_config=...)); give the model config another way"
        )
    return load_model_config(config_path)


def copy_hf_assets(src: str | os.PathLike, dst: str | os.PathLike, *, exclude: Collection[str] = ()) -> list[str]:
    """Copy the files of the HF model directory ``src`` that are not weights (config.json,
    generation_config.json, tokenizer files, chat template, ...) into ``dst`` (created). Top-level
    regular files only; hidden files, ``HF_WEIGHT_SUFFIXES`` and the names in ``exclude`` are
    skipped. Returns the names copied."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise CheckpointError(f"HF assets directory {src} is not a directory")
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for entry in sorted(src.iterdir()):
        if (not entry.is_file() or entry.name.startswith(".") or entry.name.endswith(HF_WEIGHT_SUFFIXES)
                or entry.name in exclude):  # fmt: skip
            continue
        shutil.copyfile(entry, dst / entry.name)
        copied.append(entry.name)
    return copied


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file, fsync and ``os.replace`` (then fsync the dir)."""
    tmp = path.with_name(f"{path.name}{TMP_MARK}{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# --------------------------------------------------------------------------------------------
# Collectives (on the default group: every rank takes part in a save and a load).


def _rank0_then_share(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0 and give its result to every rank; if it raised, raise on every rank
    (so no rank waits forever in a later collective). A ``CheckpointError`` keeps its message."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except CheckpointError as e:
            box[0] = ("error", str(e))
        except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
            box[0] = ("error", f"{what} failed on rank 0: {type(e).__name__}: {e}")
            logger.exception("%s failed on rank 0", what)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status != "ok":
        raise CheckpointError(value)
    return value


def _on_every_rank(fn: Callable[[], Any], what: str) -> list[Any]:
    """Run ``fn`` on every rank; the results of all ranks (by rank) on every rank. If it raised on
    any rank, ``CheckpointError`` on every rank naming the failed ranks and their errors."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: what a failed write raises

    try:
        mine = ("ok", fn())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 (re-raised below, on every rank)
        mine = ("error", f"{type(e).__name__}: {e}")
        logger.exception("%s failed on rank %d", what, dist.get_rank())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    by_error: dict[str, list[int]] = {}
    for rank, (status, value) in enumerate(gathered):
        if status != "ok":
            by_error.setdefault(value, []).append(rank)  # one error seen by several ranks is said once
    if by_error:
        detail = "; ".join(f"rank(s) {ranks}: {error}" for error, ranks in by_error.items())
        raise CheckpointError(f"{what} failed on {detail}")
    return [value for _, value in gathered]


def _check_same_on_all_ranks(obj: Any, what: str) -> None:
    digest = hashlib.sha256(pickle.dumps(obj)).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        ranks = [r for r, d in enumerate(digests) if d != digests[0]]
        raise CheckpointError(
            f"{what} differs between ranks (rank(s) {ranks} differ from rank 0); it is saved once, "
            "so it must be identical on every rank (gather per-rank values into one object first)"
        )


# --------------------------------------------------------------------------------------------
# Integrity: the files' CRC32s, shared by the ranks.


def _measure_on_all_ranks(directory: Path, checksums: bool) -> dict[str, dict]:
    """The manifest entries (``{"size", "crc32"}``) of every file in ``directory`` but
    ``empg_checkpoint.json``: rank 0 lists the files, every rank reads its share
    (``assign_files``), rank 0 gets them all (every rank does). Without ``checksums``: sizes from
    the listing, nothing read. Collective."""
    sizes = _rank0_then_share(lambda: list_files(directory, exclude=(INFO_FILE,)), f"listing {directory}")
    if not checksums:
        return {name: {"size": size} for name, size in sizes.items()}
    share = checkpoint_files.assign_files(sizes, dist.get_world_size())[dist.get_rank()]
    parts = _on_every_rank(
        lambda: checkpoint_files.measure_files(directory, share), f"checksumming the files of {directory}"
    )
    return {name: entry for part in parts for name, entry in part.items()}


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> list[str]:
    """What is damaged in the checkpoint at ``path``; [] when nothing is. Every file of its manifest
    is checked for its size and, with ``checksums``, its CRC32, each rank reading its share
    (``assign_files`` over this run's world, which need not be the saving one). The same list on
    every rank; collective. A checkpoint that is not complete (``checkpoint_problem``: marker,
    metadata, sizes) gives that problem; one saved without a manifest passes (INFO note, rank 0).
    """
    return _verify(Path(path), checksums)[0]


def _verify(path: Path, checksums: bool) -> tuple[list[str], str]:
    """``verify_checkpoint``, and what was checked (for the log)."""

    def manifest() -> tuple[str | None, dict | None]:
        problem = checkpoint_problem(path)
        return (problem, None) if problem is not None else (None, checkpoint_files.read_manifest(path))

    problem, files = _rank0_then_share(manifest, f"reading the manifest of {path}")
    if problem is not None:
        return [problem], ""
    if files is None:
        if dist.get_rank() == 0:
            logger.info("%s has no file manifest (saved before manifests were recorded): files not verified", path)
        return [], "no manifest: files not verified"
    if not checksums or not any("crc32" in entry for entry in files.values()):
        return [], "file sizes verified"  # by checkpoint_problem
    sizes = {name: entry["size"] for name, entry in files.items()}
    share = checkpoint_files.assign_files(sizes, dist.get_world_size())[dist.get_rank()]
    parts = _on_every_rank(lambda: checkpoint_files.checksum_problems(path, files, share), f"verifying {path}")
    return sorted(problem for part in parts for problem in part), "file sizes and checksums verified"


def find_verified_checkpoint(root_dir: str | os.PathLike, *, checksums: bool = True) -> FoundCheckpoint | None:
    """The checkpoint a resume should load, verified; None for a fresh start. Every rank calls it
    (collective) and gets the same answer.

    Candidates come as from ``find_latest_checkpoint`` (``latest``'s, else the newest complete one;
    a file missing or of another size disqualifies), newest first; each is checked with
    ``verify_checkpoint`` and a damaged one is skipped with a WARNING naming its files (expected
    and actual size or CRC32). ``CheckpointError`` on every rank when ``latest`` exists and no
    intact checkpoint does. Cost with ``checksums``: one read of the checked checkpoints' files,
    shared by the ranks (about 3 GB/s per rank from the page cache; usually the storage limits);
    without: one ``stat`` per file.
    """
    root = Path(root_dir)
    rank0 = dist.get_rank() == 0
    damaged: dict[str, str] = {}
    while True:
        found = _rank0_then_share(lambda: find_checkpoint(root, damaged), f"looking for a checkpoint in {root}")
        if found is None:
            return None
        problems, checked = _verify(found.path, checksums)
        if not problems:
            break
        damaged[found.path.name] = f"{found.path} is damaged: {summarize(problems)}"
        if rank0:
            logger.warning("checkpoint %s is damaged, looking for an older one: %s", found.path, "; ".join(problems))
    if rank0:
        log = logger.info if is_latest(found) else logger.warning
        log("resuming from %s (step %d, %s): %s", found.path, found.step, checked, found.reason)
    return found


# --------------------------------------------------------------------------------------------
# The state dict.


def _import_megatron() -> None:
    cpu_shims.install_pre_import()
    import megatron.core  # noqa: F401


def _unwrap(models: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """Model chunks without their DDP / Float16Module wrappers (checkpoint keys without ``module.``)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(models))


def _layout(groups: ParallelGroups) -> dict[str, int | None]:
    return {
        "tp": groups.tp_size,
        "pp": groups.pp_size,
        "vpp": groups.vpp_size,
        "dp": groups.dp_size,
        "world_size": groups.world_size,
    }


def _optimizer_has_state(optimizer) -> bool:
    """Whether any rank's optimizer holds state (has stepped). Collective."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    local = any(len(getattr(getattr(o, "optimizer", None), "state", None) or {}) > 0 for o in inner)
    flag = torch.tensor([int(local)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def _init_fresh_torch_adam_state(optimizer) -> None:
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


def _load_optimizer_state(optimizer, state: dict) -> None:
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
                inner._set_main_param_and_optimizer_states = (
                    lambda model_param, tensors, original=original: original(model_param, {"step": None, **tensors})
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


def _optimizer_metadata(kind: str | None) -> dict:
    """The ``metadata`` for ``optimizer.sharded_state_dict`` (also saved as content metadata)."""
    if kind in (None, "per_parameter"):
        return {}
    return {"distrib_optim_sharding_type": kind, "chained_optim_avoid_prefix": True}


def _model_parallel(layout: Mapping[str, Any]) -> tuple:
    return layout["tp"], layout["pp"], layout["vpp"]


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


def _anchor_sharded_state(anchor, master: Mapping[str, torch.Tensor] | None) -> dict:
    """``{"anchor_master<i>": {key: ShardedTensor of the fp32 master}}``. With ``master`` None
    (loading) the tensors are fresh fp32 buffers of the parameters' local shapes."""
    master = dict(master) if master is not None else None
    out = {}
    for i, chunk in enumerate(_unwrap(anchor.models)):
        params = dict(chunk.named_parameters())
        part = {}
        for key, sharded in chunk.sharded_state_dict(prefix=ANCHOR_PREFIX).items():
            name = key[len(ANCHOR_PREFIX) :]
            if name not in params:  # _extra_state and buffers: not part of the master
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


def _rng_sharded_object(groups: ParallelGroups, state: Any):
    """Per-rank RNG states as one ShardedObject over the (PP, TP, DP) grid (as Megatron-LM's
    ``rng_state``, with DP added: every rank's own state is kept)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state",
        state,
        (groups.pp_size, groups.tp_size, groups.dp_size),
        (groups.pp_rank, groups.tp_rank, groups.dp_rank),
        replica_id=0,
    )


def _get_rng_state() -> dict:
    import numpy as np
    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _model_sharded_state(chunks: Sequence[torch.nn.Module]) -> dict:
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


# --------------------------------------------------------------------------------------------
# Save.


def _before_commit(tmp_dir: Path) -> None:
    """Called on every rank after the shards are written and before the checkpoint is committed.
    A no-op; tests replace it to simulate a crash at that point."""


def checkpoint_info(
    *, step: int, model_name: str | None, layout: Mapping[str, int | None], model_chunks: int, parts: Mapping[str, Any],
    **extra: Any,
) -> dict:
    """The ``empg_checkpoint.json`` of a checkpoint (``extra``: more top-level entries)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "model_name": model_name,
        "layout": dict(layout),
        "model_chunks": model_chunks,
        "parts": dict(parts),
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "megatron_core": _megatron_version(),
        **extra,
        "complete": True,
    }


def finish_checkpoint_dir(
    directory: Path, info: Mapping[str, Any], *, model_config: ModelConfig | None = None,
    hf_assets: str | os.PathLike | None = None, files: Mapping[str, Mapping[str, int]] | None = None,
    checksums: bool = True,
) -> None:  # fmt: skip
    """Complete a checkpoint whose shards ``directory`` holds: write ``model_config.yaml``, copy
    the HF assets into ``hf/``, fsync, and write the completion marker last (atomically), with the
    manifest of every other file (see ``mcore.checkpoint_files``). ``files``: manifest entries
    measured already (by the ranks, ``_measure_on_all_ranks``); the other files are measured here,
    with CRC32s if ``checksums``. One process calls it; the directory is renamed into place
    afterwards."""
    if model_config is not None:
        _write_atomic(directory / MODEL_CONFIG_FILE, to_yaml(model_config))
    if hf_assets is not None:
        assets = directory / HF_ASSETS_DIR
        for name in copy_hf_assets(hf_assets, assets):
            _fsync_file(assets / name)
        _fsync_dir(assets)
    for name in DIST_CKPT_FILES:  # dist_checkpointing fsyncs its shards and .metadata, not metadata.json
        if (directory / name).is_file():
            _fsync_file(directory / name)
    present = list_files(directory, exclude=(INFO_FILE,))
    known = dict(files or {})
    changed = sorted(name for name, entry in known.items() if present.get(name) != entry["size"])
    if changed:  # something still writes, or deleted files, after the ranks measured them
        raise CheckpointError(f"{directory}: {changed[:5]} changed or vanished after they were measured")
    known.update(checkpoint_files.measure_files(directory, [n for n in present if n not in known], checksums=checksums))
    manifest = {name: known[name] for name in present}
    _write_atomic(directory / INFO_FILE, json.dumps({**info, "files": manifest}, indent=1, sort_keys=True) + "\n")


def _commit(
    root: Path, tmp: Path, final: Path, info: dict, keep_last: int | None, nonce: str,
    model_config: ModelConfig | None, hf_assets: str | os.PathLike | None, files: Mapping[str, Mapping[str, int]],
    checksums: bool,
) -> list[str]:  # fmt: skip
    """Rank 0: model config and HF assets, completion marker with the manifest, rename, ``latest``,
    retention. Returns the names removed."""
    finish_checkpoint_dir(tmp, info, model_config=model_config, hf_assets=hf_assets, files=files, checksums=checksums)
    trash = None
    if final.exists():  # a re-save of this step: move the old one out of the step_N namespace first
        trash = final.with_name(f"{final.name}{TRASH_MARK}{nonce}")
        logger.warning("replacing the existing checkpoint %s", final)
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST_FILE, final.name + "\n")
    removed = []
    if trash is not None:
        shutil.rmtree(trash)
    if keep_last is not None:
        removed = _apply_retention(root, final, keep_last, nonce)
    return removed


def _apply_retention(root: Path, newest: Path, keep_last: int, nonce: str) -> list[str]:
    """Delete all but the ``keep_last`` newest complete checkpoints (never ``newest``, the one
    ``latest`` names), and the leftovers of crashed saves and deletions."""
    removed = []
    complete = [path for _, path in step_dirs(root) if checkpoint_problem(path) is None]
    for path in complete[keep_last:]:
        if path == newest:
            continue
        trash = path.with_name(f"{path.name}{TRASH_MARK}{nonce}")
        os.replace(path, trash)  # out of the step_N namespace first: a half-deleted dir is never loaded
        shutil.rmtree(trash)
        removed.append(path.name)
    removed += remove_leftovers(root, spare=nonce)
    if removed:
        logger.info("checkpoint retention (keep_last=%d) removed %s", keep_last, removed)
    return removed


def _warn_if_low_space(root: Path) -> None:
    """A WARNING when the filesystem of ``root`` has less free space than the newest complete
    checkpoint there takes: the save about to start will likely fail."""
    previous = newest_complete(root)
    if previous is None:
        return
    need, free = checkpoint_bytes(previous), free_bytes(root)
    if free < need:
        logger.warning(
            "checkpoint directory %s: %s free on its filesystem, less than the %s of the last checkpoint %s: "
            "this save will likely fail for lack of space (%s is kept if it does). Make room: remove old "
            "checkpoints, lower checkpoint.keep_last, or move checkpoint.dir",
            root, format_bytes(free), format_bytes(need), previous.name, previous.name,
        )  # fmt: skip


def _failed_save(root: Path, tmp: Path, final: Path, error: str) -> CheckpointError:
    """The error every rank raises when a save failed: what failed, the free space, the last
    checkpoint's name and size, and that it is kept. Rank 0 first removes this save's temp
    directory (best effort), so that the next save has the room. Collective."""

    def free_now() -> str:
        try:
            return format_bytes(free_bytes(root))
        except OSError as e:
            return f"unknown ({e})"

    def report() -> str:
        committed = not tmp.exists() and checkpoint_problem(final) is None  # failed after the rename
        free_then, cleanup = free_now(), ""
        if tmp.exists():
            try:
                shutil.rmtree(tmp)
                cleanup = f", {free_now()} after removing the partial save {tmp.name}"
            except OSError as e:
                cleanup = f"; removing the partial save {tmp} failed as well ({e}): remove it by hand"
        message = f"saving {final.name} into {root} failed: {error}. Free on its filesystem: {free_then}{cleanup}."
        if committed:
            return f"{message} {final.name} itself was committed; what failed came after ({LATEST_FILE} or retention)."
        previous = newest_complete(root)
        if previous is None:
            return f"{message} There is no earlier complete checkpoint in {root}."
        size = checkpoint_bytes(previous)
        message += (
            f" The last checkpoint, {previous.name} ({format_bytes(size)}), is kept: a resume loads it. "
            f"The next save needs about {format_bytes(size)} free"
        )
        try:
            full = free_bytes(root) < size
        except OSError:
            full = False
        if full:
            return f"{message}; make room (remove old checkpoints, lower checkpoint.keep_last) or move checkpoint.dir."
        return f"{message}."

    try:
        return CheckpointError(_rank0_then_share(report, f"reporting the failed save of {final}"))
    except CheckpointError as e:
        return CheckpointError(f"saving {final.name} into {root} failed: {error} (and reporting it failed: {e})")


def save_checkpoint(
    root_dir: str | os.PathLike,
    step: int,
    *,
    models: Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    anchor=None,
    extra_state: Mapping[str, Any] | None = None,
    groups: ParallelGroups,
    keep_last: int | None = None,
    model_name: str | None = None,
    optimizer_format: str = DEFAULT_OPTIMIZER_FORMAT,
    model_config: ModelConfig | None = None,
    hf_assets: str | os.PathLike | None = None,
    checksums: bool = True,
) -> Path:
    """Save a checkpoint of ``step`` under ``root_dir`` atomically; every rank calls it. Returns
    the committed directory ``root_dir/step_<step>``.

    Rank 0 warns first when the filesystem has less free space than the newest checkpoint takes.
    A write that fails (a full disk: ENOSPC, EFBIG, torch's "enforce fail at inline_container.cc")
    raises ``CheckpointError`` on every rank together, naming the directory, the error, the free
    space and the last checkpoint (which stays loadable); this save's temp directory is removed.

    Args:
        models: the policy's model chunks (Megatron DDP-wrapped or not).
        optimizer: the Megatron optimizer (``get_megatron_optimizer``), or None. One that has
            never stepped has no state; it is recorded as fresh and not saved.
        scheduler: the ``OptimizerParamScheduler``, or None.
        anchor: the EMA anchor (see the module docstring), or None.
        extra_state: small picklable loop state (step counters, data cursor), identical on every
            rank; ``load_checkpoint`` returns it with ``"step"`` added.
        keep_last: keep only this many newest complete checkpoints (the new one always stays);
            also removes ``*.tmp-*``/``*.trash-*`` leftovers of interrupted saves. None keeps all.
        model_name: recorded in ``empg_checkpoint.json`` and checked by ``load_checkpoint``
            (default: ``model_config.name``).
        optimizer_format: the distributed optimizer's format, one of ``OPTIMIZER_FORMATS``.
        model_config: stored as ``model_config.yaml`` (``read_model_config``), so that
            tools/convert_megatron_to_hf.py can convert the checkpoint on its own.
        hf_assets: a HF model directory whose config and tokenizer files (no weights) are copied
            into ``hf/`` (see ``copy_hf_assets``).
        checksums: record every file's CRC32 in the manifest (the ranks share the read: about
            3 GB/s per rank from the page cache), for ``find_verified_checkpoint``. Without, sizes only.
    """
    _import_megatron()
    from megatron.core import dist_checkpointing

    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be None or an int >= 1")
    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(f"optimizer_format={optimizer_format!r}: expected one of {OPTIMIZER_FORMATS}")
    if hf_assets is not None and not Path(hf_assets).is_dir():
        raise ValueError(f"hf_assets={str(hf_assets)!r} is not a directory")
    if model_name is None and model_config is not None:
        model_name = model_config.name
    extra = dict(extra_state or {})
    if extra.get("step", step) != step:
        raise ValueError(f"extra_state['step']={extra['step']!r} differs from step={step}")
    extra["step"] = step
    _check_same_on_all_ranks(extra, "extra_state")

    root = Path(root_dir)
    final = root / step_dir_name(step)

    def make_tmp() -> str:
        root.mkdir(parents=True, exist_ok=True)
        _warn_if_low_space(root)
        nonce = secrets.token_hex(4)
        (root / f"{final.name}{TMP_MARK}{nonce}").mkdir()
        return nonce

    nonce = _rank0_then_share(make_tmp, f"creating a temp checkpoint directory in {root}")
    tmp = root / f"{final.name}{TMP_MARK}{nonce}"

    chunks = _unwrap(models)
    state = _model_sharded_state(chunks)
    optimizer_status = optimizer_kind = None
    if optimizer is not None:
        optimizer_kind = optimizer_format if _is_distributed(optimizer) else "per_parameter"
        if _optimizer_has_state(optimizer):
            metadata = _optimizer_metadata(optimizer_kind)
            state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=False, metadata=metadata)
            optimizer_status = "saved"
        else:
            optimizer_status = "fresh"
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if anchor is not None:
        state.update(_anchor_sharded_state(anchor, anchor.full_master_state()))
    state["rng_state"] = _rng_sharded_object(groups, _get_rng_state())
    state["extra_state"] = extra

    layout = _layout(groups)
    content = {"format": FORMAT, "format_version": FORMAT_VERSION, **_optimizer_metadata(optimizer_kind)}
    try:
        _on_every_rank(lambda: dist_checkpointing.save(state, str(tmp), content_metadata=content), f"writing {tmp}")
        files = _measure_on_all_ranks(tmp, checksums)
    except CheckpointError as e:
        raise _failed_save(root, tmp, final, str(e)) from None
    _before_commit(tmp)

    parts = {
        "model": True,
        "optimizer": optimizer_status,
        "optimizer_format": optimizer_kind,  # "per_parameter" (non-distributed) or OPTIMIZER_FORMATS
        "scheduler": scheduler is not None,
        "anchor": anchor is not None,
        "rng": True,
        "model_config": model_config is not None,
        "hf_assets": hf_assets is not None,
    }
    info = checkpoint_info(step=step, model_name=model_name, layout=layout, model_chunks=len(chunks), parts=parts)
    try:
        removed = _rank0_then_share(
            lambda: _commit(root, tmp, final, info, keep_last, nonce, model_config, hf_assets, files, checksums),
            f"committing {final}",
        )
    except CheckpointError as e:
        raise _failed_save(root, tmp, final, str(e)) from None
    if dist.get_rank() == 0:
        logger.info("saved checkpoint %s (step %d)%s", final, step, f"; removed {removed}" if removed else "")
    return final


def _megatron_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------
# Load.


def _part_of(key: str) -> str:
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


def load_checkpoint(
    path: str | os.PathLike,
    *,
    models: Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    anchor=None,
    groups: ParallelGroups,
    strict: bool = True,
    model_name: str | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` (a ``step_N`` directory) into this rank's objects, at any
    TP/PP/VPP/DP layout; every rank calls it. Returns the saved ``extra_state`` with ``"step"``.

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
    _import_megatron()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    parts = info["parts"]
    rank0 = dist.get_rank() == 0
    where = f"checkpoint {path} (step {info['step']}, saved at {info['layout']})"
    if model_name is not None and info.get("model_name") not in (None, model_name):
        raise CheckpointError(f"{where} holds model {info['model_name']!r}, expected {model_name!r}")

    asked = {"optimizer": optimizer is not None, "scheduler": scheduler is not None, "anchor": anchor is not None}
    held = {"optimizer": parts["optimizer"] is not None, "scheduler": parts["scheduler"], "anchor": parts["anchor"]}
    for part in asked:
        if asked[part] and not held[part]:
            raise CheckpointError(f"{where} has no {part} state, but a {part} was given to load into")
        if held[part] and not asked[part]:
            message = f"{where} holds {part} state that is not loaded (no {part} given)"
            if strict:
                raise CheckpointError(f"{message}; pass strict=False to skip it")
            if rank0:
                logger.warning(message)

    layout = _layout(groups)
    same_layout = layout == info["layout"]
    restore_rng = same_layout and parts.get("rng", True)
    chunks = _unwrap(models)
    state = _model_sharded_state(chunks)
    load_optimizer = optimizer is not None and parts["optimizer"] == "saved"
    if load_optimizer:
        kind = parts["optimizer_format"]
        if (kind == "per_parameter") == _is_distributed(optimizer):
            raise CheckpointError(
                f"{where} holds the state of a {'non-' if kind == 'per_parameter' else ''}distributed optimizer "
                f"(format {kind}); this run's optimizer is {'' if _is_distributed(optimizer) else 'not '}distributed. "
                "Switching between them on load is not supported: set use_distributed_optimizer as at save time"
            )
        if kind == "dp_reshardable" and _model_parallel(layout) != _model_parallel(info["layout"]):
            raise CheckpointError(
                f"{where} saved the distributed optimizer as dp_reshardable, which loads only at the same "
                f"TP/PP/VPP ({_model_parallel(info['layout'])}), not at {_model_parallel(layout)}"
            )
        _init_fresh_torch_adam_state(optimizer)
        metadata = _optimizer_metadata(kind)
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=True, metadata=metadata)
    elif optimizer is not None:  # saved before the first update: the optimizer must be fresh too
        if _optimizer_has_state(optimizer):
            raise CheckpointError(
                f"{where} was saved before the optimizer's first update, but this optimizer has state; "
                "load it into a freshly built optimizer"
            )
        if rank0:
            logger.info("%s saved a fresh (never stepped) optimizer; this one is fresh as well", where)
    if anchor is not None:
        state.update(_anchor_sharded_state(anchor, None))
    if restore_rng:
        state["rng_state"] = _rng_sharded_object(groups, None)
    elif rank0 and parts.get("rng", True):
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
            by_part.setdefault(_part_of(key), []).append(key)
        detail = "; ".join(f"{part}: {keys[:5]}{' ...' if len(keys) > 5 else ''}" for part, keys in by_part.items())
        raise CheckpointError(f"{where} lacks entries this run needs at {layout} ({detail})")
    not_loaded = {k for k in missing if _part_of(k) == "model"}  # the other parts were checked above
    if not_loaded:
        message = f"{where} holds model entries this model does not have: {sorted(not_loaded)[:8]}"
        if strict:
            raise CheckpointError(message)
        if rank0:
            logger.warning(message)

    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"], strict=strict)
    if load_optimizer:
        _load_optimizer_state(optimizer, loaded["optimizer"])
    elif optimizer is not None:  # fresh: its float32 main params (bf16/fp16 models) follow the loaded weights
        with torch.no_grad():
            optimizer.reload_model_params()
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if anchor is not None:
        master = {}
        for i in range(len(anchor.models)):
            for key, tensor in loaded[f"anchor_master{i}"].items():
                master[f"{i}.{key[len(ANCHOR_PREFIX):]}"] = tensor
        anchor.load_full_master_state(master)
    if restore_rng:
        _set_rng_state(loaded["rng_state"])

    extra = dict(loaded.get("extra_state") or {})
    extra["step"] = info["step"]
    if rank0:
        optimizer_note = "loaded" if load_optimizer else ("fresh" if optimizer is not None else "not asked")
        rng_note = "restored" if restore_rng else ("not restored (layout differs)" if parts.get("rng", True) else "none saved")
        anchor_note = "loaded" if anchor is not None else "not asked"
        logger.info(
            "loaded %s at %s (optimizer: %s, anchor: %s, RNG: %s)", where, layout, optimizer_note, anchor_note, rng_note
        )
    return extra
