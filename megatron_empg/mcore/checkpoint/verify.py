"""The collective parts of a checkpoint (every rank of the default process group takes part in a
save and a load): run on rank 0 and share, run everywhere and gather, with an error on one rank
raised on every rank; and the verification of a checkpoint's files, whose reads the ranks share.
``mcore.checkpoint`` re-exports ``verify_checkpoint`` and ``find_verified_checkpoint``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_empg.mcore.checkpoint import files as checkpoint_files
from megatron_empg.mcore.checkpoint.files import (
    INFO_FILE,
    CheckpointError,
    FoundCheckpoint,
    checkpoint_problem,
    find_checkpoint,
    is_latest,
    list_files,
    summarize,
)

logger = logging.getLogger(__name__)


def rank0_then_share(fn: Callable[[], Any], what: str) -> Any:
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


def on_every_rank(fn: Callable[[], Any], what: str) -> list[Any]:
    """Run ``fn`` on every rank; the results of all ranks (by rank) on every rank. If it raised on
    any rank, ``CheckpointError`` on every rank naming the failed ranks and their errors."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: what a failed write raises

    try:
        mine = ("ok", fn())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 (re-raised below, on every rank)
        mine = ("error", one_line(f"{type(e).__name__}: {e}"))
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


def one_line(text: str) -> str:
    """``text`` on one line: torch's ``CheckpointException`` carries each rank's traceback, whose
    frames are dropped (the log has them); the other lines, each once, joined by " | "."""
    kept = []
    for line in text.splitlines():
        if line.strip() and not line.startswith((" ", "\t", "Traceback ")) and line.strip() not in kept:
            kept.append(line.strip())
    return " | ".join(kept)


def check_same_on_all_ranks(obj: Any, what: str) -> None:
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


def measure_on_all_ranks(directory: Path, checksums: bool, written: dict[str, dict] | None = None) -> dict[str, dict]:
    """The manifest entries (``{"size", "crc32"}``) of every file in ``directory`` but
    ``empg_checkpoint.json``: rank 0 lists the files; the entries each rank measured while writing
    its files (``written``: ``StreamingSaveStrategy.files``) are gathered, and the other files are
    read, every rank its share (``assign_files``). Without ``checksums``: sizes from the listing,
    nothing read. Every rank gets them all. Collective."""
    sizes = rank0_then_share(lambda: list_files(directory, exclude=(INFO_FILE,)), f"listing {directory}")
    if not checksums:
        return {name: {"size": size} for name, size in sizes.items()}
    measured: dict[str, dict] = {}
    for part in on_every_rank(lambda: dict(written or {}), f"gathering the checksums of {directory}"):
        measured.update(part)  # entries of vanished files stay: the commit's size check names them
    rest = {name: size for name, size in sizes.items() if name not in measured}
    share = checkpoint_files.assign_files(rest, dist.get_world_size())[dist.get_rank()]
    parts = on_every_rank(
        lambda: checkpoint_files.measure_files(directory, share), f"checksumming the files of {directory}"
    )
    for part in parts:
        measured.update(part)
    return measured


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

    problem, files = rank0_then_share(manifest, f"reading the manifest of {path}")
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
    parts = on_every_rank(lambda: checkpoint_files.checksum_problems(path, files, share), f"verifying {path}")
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
        found = rank0_then_share(lambda: find_checkpoint(root, damaged), f"looking for a checkpoint in {root}")
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
