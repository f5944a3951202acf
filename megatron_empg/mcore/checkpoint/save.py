"""Saving a checkpoint (``save_checkpoint``, every rank together): the sharded state through
Megatron's ``dist_checkpointing`` into a temp directory, the manifest, then the commit (completion
marker, rename, ``latest``, retention). The package's docstring (``mcore.checkpoint``) describes
the format, atomicity, integrity and full disks.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_empg.config import ModelConfig, to_yaml
from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.checkpoint import files as checkpoint_files
from megatron_empg.mcore.checkpoint.async_save import HostStaging, PendingSave, SaveTarget
from megatron_empg.mcore.checkpoint.files import (
    DIST_CKPT_FILES,
    FORMAT,
    FORMAT_VERSION,
    HF_ASSETS_DIR,
    INFO_FILE,
    LATEST_FILE,
    MODEL_CONFIG_FILE,
    TMP_MARK,
    TRASH_MARK,
    CheckpointError,
    SaveError,
    checkpoint_bytes,
    checkpoint_problem,
    copy_hf_assets,
    format_bytes,
    free_bytes,
    fsync_dir,
    fsync_file,
    list_files,
    newest_complete,
    remove_leftovers,
    step_dir_name,
    step_dirs,
    write_atomic,
)
from megatron_empg.mcore.checkpoint.parts import OPTIMIZER_FORMATS, CheckpointParts, ModelMetadata, SaveOptions
from megatron_empg.mcore.checkpoint.state import (
    anchor_sharded_state,
    get_rng_state,
    has_adapters,
    is_distributed,
    layout_of,
    model_sharded_state,
    optimizer_has_state,
    optimizer_metadata,
    rng_sharded_object,
    unwrap,
)
from megatron_empg.mcore.checkpoint.train_state import SAVED_KEY, TrainState
from megatron_empg.mcore.checkpoint.verify import (
    check_same_on_all_ranks,
    measure_on_all_ranks,
    on_every_rank,
    rank0_then_share,
)
from megatron_empg.mcore.parallel_state import ParallelGroups

if TYPE_CHECKING:
    import torch.nn

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Save.


def _before_commit(tmp_dir: Path) -> None:
    """Called on every rank after the shards are written and before the checkpoint is committed.
    A no-op; tests replace it to simulate a crash at that point."""


def checkpoint_info(
    *,
    step: int,
    model_name: str | None,
    layout: Mapping[str, int | None],
    model_chunks: int,
    parts: Mapping[str, Any],
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
        "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "megatron_core": _megatron_version(),
        **extra,
        "complete": True,
    }


def finish_checkpoint_dir(
    directory: Path,
    info: Mapping[str, Any],
    *,
    model_config: ModelConfig | None = None,
    hf_assets: str | os.PathLike | None = None,
    files: Mapping[str, Mapping[str, int]] | None = None,
    checksums: bool = True,
) -> None:
    """Complete a checkpoint whose shards ``directory`` holds: write ``model_config.yaml``, copy
    the HF assets into ``hf/``, fsync, and write the completion marker last (atomically), with the
    manifest of every other file (see ``mcore.checkpoint.files``). ``files``: manifest entries
    measured already (by the ranks, ``measure_on_all_ranks``); the other files are measured here,
    with CRC32s if ``checksums``. One process calls it; the directory is renamed into place
    afterwards."""
    if model_config is not None:
        write_atomic(directory / MODEL_CONFIG_FILE, to_yaml(model_config))
    if hf_assets is not None:
        assets = directory / HF_ASSETS_DIR
        for name in copy_hf_assets(hf_assets, assets):
            fsync_file(assets / name)
        fsync_dir(assets)
    for name in DIST_CKPT_FILES:  # dist_checkpointing fsyncs its shards and .metadata, not metadata.json
        if (directory / name).is_file():
            fsync_file(directory / name)
    present = list_files(directory, exclude=(INFO_FILE,))
    known = dict(files or {})
    changed = sorted(name for name, entry in known.items() if present.get(name) != entry["size"])
    if changed:  # something still writes, or deleted files, after the ranks measured them
        raise CheckpointError(f"{directory}: {changed[:5]} changed or vanished after they were measured")
    known.update(checkpoint_files.measure_files(directory, [n for n in present if n not in known], checksums=checksums))
    manifest = {name: known[name] for name in present}
    write_atomic(directory / INFO_FILE, json.dumps({**info, "files": manifest}, indent=1, sort_keys=True) + "\n")


def _commit(
    root: Path,
    tmp: Path,
    final: Path,
    info: dict,
    keep_last: int | None,
    nonce: str,
    model: ModelMetadata,
    files: Mapping[str, Mapping[str, int]],
    checksums: bool,
) -> list[str]:
    """Rank 0: model config and HF assets, completion marker with the manifest, rename, ``latest``,
    retention. Returns the names removed."""
    finish_checkpoint_dir(
        tmp, info, model_config=model.config, hf_assets=model.hf_assets, files=files, checksums=checksums
    )
    trash = None
    if final.exists():  # a re-save of this step: move the old one out of the step_N namespace first
        trash = final.with_name(f"{final.name}{TRASH_MARK}{nonce}")
        logger.warning("replacing the existing checkpoint %s", final)
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_dir(root)
    write_atomic(root / LATEST_FILE, final.name + "\n")
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
            root,
            format_bytes(free),
            format_bytes(need),
            previous.name,
            previous.name,
        )


def _failed_save(root: Path, tmp: Path, final: Path, error: str) -> SaveError:
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
        return SaveError(rank0_then_share(report, f"reporting the failed save of {final}"))
    except CheckpointError as e:
        return SaveError(f"saving {final.name} into {root} failed: {error} (and reporting it failed: {e})")


def save_checkpoint(
    root_dir: str | os.PathLike,
    state: TrainState,
    parts: CheckpointParts,
    groups: ParallelGroups,
    *,
    options: SaveOptions | None = None,
    model: ModelMetadata | None = None,
) -> Path:
    """Save a checkpoint of ``state.step`` under ``root_dir`` atomically; every rank calls it.
    Returns the committed directory ``root_dir/step_<step>``.

    ``state``: the loop's state, identical on every rank (checked; ``load_checkpoint`` returns it).
    ``parts``: this rank's model chunks, optimizer, scheduler and anchor. ``options``: retention,
    checksums, the distributed optimizer's format (default ``SaveOptions()``). ``model``: the model's
    name, config and HF assets recorded beside the tensors (default: none).

    Rank 0 warns first when the filesystem has less free space than the newest checkpoint takes.
    A write that fails (a full disk: ENOSPC, EFBIG, torch's "enforce fail at inline_container.cc")
    raises ``SaveError`` (a ``CheckpointError``) on every rank together, naming the directory, the
    error, the free space and the last checkpoint (which stays loadable); this save's temp directory
    is removed.
    """
    return finish_save(start_save(root_dir, state, parts, groups, options=options, model=model))


def start_save(
    root_dir: str | os.PathLike,
    state: TrainState,
    parts: CheckpointParts,
    groups: ParallelGroups,
    *,
    options: SaveOptions | None = None,
    model: ModelMetadata | None = None,
    staging: HostStaging | None = None,
) -> PendingSave:
    """``save_checkpoint``'s first half, every rank together: the plan, and the shard files written
    here (``staging`` None) or, with ``staging``, the state copied into its host buffers and the
    files written by a background thread (``mcore.checkpoint.async_save``: training goes on while
    it writes). ``finish_save`` (every rank) commits it."""
    cpu_shims.import_megatron()
    from megatron.core import dist_checkpointing

    from megatron_empg.mcore.checkpoint.stream import save_strategy

    started = time.perf_counter()
    options = options or SaveOptions()
    model = model or ModelMetadata()
    step, keep_last, optimizer_format = state.step, options.keep_last, options.optimizer_format
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be None or an int >= 1")
    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(f"optimizer_format={optimizer_format!r}: expected one of {OPTIMIZER_FORMATS}")
    if model.hf_assets is not None and not Path(model.hf_assets).is_dir():
        raise ValueError(f"hf_assets={str(model.hf_assets)!r} is not a directory")
    saved_state = state.to_saved()
    check_same_on_all_ranks(saved_state, "the train state")

    root = Path(root_dir)
    final = root / step_dir_name(step)

    def make_tmp() -> str:
        root.mkdir(parents=True, exist_ok=True)
        _warn_if_low_space(root)
        nonce = secrets.token_hex(4)
        (root / f"{final.name}{TMP_MARK}{nonce}").mkdir()
        return nonce

    nonce = rank0_then_share(make_tmp, f"creating a temp checkpoint directory in {root}")
    tmp = root / f"{final.name}{TMP_MARK}{nonce}"

    optimizer, scheduler, anchor = parts.optimizer, parts.scheduler, parts.anchor
    chunks = unwrap(parts.models)
    lora = has_adapters(chunks)  # a LoRA policy saves its adapters; its base is referenced (model.base)
    if lora and model.base is None:
        raise CheckpointError("a LoRA policy's checkpoint needs its base recorded (ModelMetadata.base)")
    sharded = model_sharded_state(chunks, adapters=True if lora else None)
    optimizer_status = optimizer_kind = None
    if optimizer is not None:
        optimizer_kind = optimizer_format if is_distributed(optimizer) else "per_parameter"
        if optimizer_has_state(optimizer):
            metadata = optimizer_metadata(optimizer_kind)
            sharded["optimizer"] = optimizer.sharded_state_dict(dict(sharded), is_loading=False, metadata=metadata)
            optimizer_status = "saved"
        else:
            optimizer_status = "fresh"
    if scheduler is not None:
        sharded["scheduler"] = scheduler.state_dict()
    if anchor is not None:  # the master's own tensors (no copy): staged or written before the next update
        sharded.update(anchor_sharded_state(anchor, anchor.full_master_state(copy=False)))
    sharded["rng_state"] = rng_sharded_object(groups, get_rng_state())
    sharded[SAVED_KEY] = saved_state

    content = {"format": FORMAT, "format_version": FORMAT_VERSION, **optimizer_metadata(optimizer_kind)}
    strategy, streaming = save_strategy(groups, options.checksums)
    held = {
        "model": True,
        "optimizer": optimizer_status,
        "optimizer_format": optimizer_kind,  # "per_parameter" (non-distributed) or OPTIMIZER_FORMATS
        "scheduler": scheduler is not None,
        "anchor": anchor is not None,
        "rng": True,
        "model_config": model.config is not None,
        "hf_assets": model.hf_assets is not None,
    }
    extra = {"lora_base": dict(model.base)} if lora else {}
    info = checkpoint_info(
        step=step, model_name=model.model_name, layout=layout_of(groups), model_chunks=len(chunks), parts=held, **extra
    )
    target = SaveTarget(root, tmp, final, nonce, step, keep_last, model, options.checksums, info, streaming)

    requests = []

    def plan() -> None:  # the collectives of the plan; the request writes nothing yet (and stays here)
        requests.append(
            dist_checkpointing.save(
                sharded, str(tmp), sharded_strategy=strategy, content_metadata=content, async_sharded_save=True
            )
        )

    try:
        on_every_rank(plan, f"planning {tmp}")
        pending = PendingSave(target, requests[0], staging, started)
    except CheckpointError as e:
        raise _failed_save(root, tmp, final, str(e)) from None
    return pending


def finish_save(pending: PendingSave) -> Path:
    """The end of every save, every rank together: this rank's writing waited for, Megatron's
    write results and metadata, then the manifest, the completion marker, the rename, ``latest``
    and retention. Returns the committed directory."""
    target = pending.target
    pending.wait()
    try:
        on_every_rank(pending.finalize, f"writing {target.tmp}")
    except CheckpointError as e:
        raise _failed_save(target.root, target.tmp, target.final, str(e)) from None
    return _commit_save(target)


def _commit_save(target: SaveTarget) -> Path:
    try:
        files = measure_on_all_ranks(target.tmp, target.checksums, written=target.streaming.files)
    except CheckpointError as e:
        raise _failed_save(target.root, target.tmp, target.final, str(e)) from None
    _before_commit(target.tmp)
    root, tmp, final = target.root, target.tmp, target.final
    try:
        removed = rank0_then_share(
            lambda: _commit(
                root, tmp, final, target.info, target.keep_last, target.nonce, target.model, files, target.checksums
            ),
            f"committing {final}",
        )
    except CheckpointError as e:
        raise _failed_save(root, tmp, final, str(e)) from None
    if dist.get_rank() == 0:
        logger.info("saved checkpoint %s (step %d)%s", final, target.step, f"; removed {removed}" if removed else "")
    return final


def _megatron_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
