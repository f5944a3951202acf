"""The files of a checkpoint root, read and removed through the filesystem only (no collectives,
no torch): directory names, completeness, the file manifest recorded at commit (sizes and CRC32s),
the checkpoint a resume should load, disk space, the leftovers of crashed saves, atomic writes,
and the files beside the shards (``model_config.yaml``, the HF assets).
``mcore.checkpoint`` re-exports the public names; ``mcore.checkpoint.verify`` holds the collective
parts (the CRC32s split over the ranks at save and at resume); ``mcore.checkpoint``'s docstring draws
the directory.

Manifest. ``empg_checkpoint.json`` lists every other file of its checkpoint directory::

    "files": {"__0_0.distcp": {"size": 1048576, "crc32": 3735928559}, "hf/config.json": {...}, ...}

(relative POSIX paths; ``crc32``: ``zlib.crc32`` of the whole file, absent when the save was
made without checksums). Sizes are checked by every completeness check (``checkpoint_problem``:
one ``stat`` per file), so a truncated or missing file makes ``find_latest_checkpoint`` fall back
to an older checkpoint. At save the shards' CRC32s are computed while they are written
(``mcore.checkpoint.stream``); verifying them needs a read of every byte (about 3 GB/s per process
from the page cache), which the ranks share (``assign_files``). A checkpoint without ``files``
(saved before manifests were recorded) passes with its files unchecked.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import zlib
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from megatron_empg.config import ModelConfig

logger = logging.getLogger(__name__)

FORMAT = "megatron_empg.checkpoint"
FORMAT_VERSION = 1
INFO_FILE = "empg_checkpoint.json"  # ours; dist_checkpointing writes its own metadata.json
DIST_CKPT_FILES = ("metadata.json", ".metadata")  # written by dist_checkpointing.save (torch_dist)
LATEST_FILE = "latest"
TMP_MARK = ".tmp-"
TRASH_MARK = ".trash-"
MODEL_CONFIG_FILE = "model_config.yaml"  # the ModelConfig (config.to_yaml)
HF_ASSETS_DIR = "hf"  # copies of the HF config and tokenizer files
# Files of a HF model directory that are weights (the checkpoint holds those itself): never copied.
HF_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".index.json",
)
CHUNK_BYTES = 4 << 20  # read size for CRC32s: 1-8 MiB measure alike (~3 GB/s); 4 MiB suits parallel filesystems

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# What save_checkpoint and write_atomic leave behind when they die: step_N.tmp-<nonce>,
# step_N.trash-<nonce> (directories) and latest.tmp-<nonce> (a file).
_LEFTOVER = re.compile(r"^(step_\d{8,}|" + re.escape(LATEST_FILE) + r")\.(tmp|trash)-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model it is loaded into,
    or a save failed."""


class SaveError(CheckpointError):
    """A save that failed to write (a full disk): the checkpoints before it are intact, and a
    later save may succeed once there is room (the trainer exits restartable on it)."""


class FoundCheckpoint(NamedTuple):
    """What ``find_latest_checkpoint`` picked: the directory, its step, and why this one."""

    path: Path
    step: int
    reason: str


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --------------------------------------------------------------------------------------------
# Manifest: sizes and CRC32s.


def file_crc32(path: str | os.PathLike) -> tuple[int, int]:
    """(size in bytes, ``zlib.crc32``) of the file at ``path``, read in ``CHUNK_BYTES`` pieces."""
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    size = crc = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def list_files(directory: str | os.PathLike, *, exclude: Collection[str] = ()) -> dict[str, int]:
    """``{relative POSIX path: size in bytes}`` of the regular files under ``directory`` (recursive;
    symlinks not followed), without the top-level names in ``exclude``; sorted by path."""
    directory = Path(directory)
    found = {}
    for parent, dirs, files in os.walk(directory):
        dirs.sort()
        for name in files:
            path = Path(parent) / name
            relative = path.relative_to(directory).as_posix()
            if relative in exclude or not path.is_file() or path.is_symlink():
                continue
            found[relative] = path.stat().st_size
    return dict(sorted(found.items()))


def assign_files(sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Split files over ``world_size`` ranks by size: biggest first, each to the rank with the
    fewest bytes so far (ties: the lower rank). The same on every rank for the same ``sizes``.
    Returns each rank's names, sorted."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += size
    return [sorted(share) for share in shares]


def measure_files(directory: str | os.PathLike, names: Iterable[str], *, checksums: bool = True) -> dict[str, dict]:
    """``{name: {"size": bytes, "crc32": int}}`` of the files ``names`` under ``directory`` (without
    ``checksums``: sizes only, from ``stat``)."""
    directory = Path(directory)
    out = {}
    for name in names:
        if checksums:
            size, crc = file_crc32(directory / name)
            out[name] = {"size": size, "crc32": crc}
        else:
            out[name] = {"size": (directory / name).stat().st_size}
    return out


def read_manifest(directory: str | os.PathLike, info: Mapping[str, Any] | None = None) -> dict[str, dict] | None:
    """The ``files`` of the ``empg_checkpoint.json`` of ``directory`` (or of ``info``, its content),
    None for a checkpoint saved without one; ValueError if unreadable or malformed."""
    directory = Path(directory)
    if info is None:
        try:
            info = json.loads((directory / INFO_FILE).read_text())
        except OSError as e:
            raise ValueError(f"{directory / INFO_FILE} is unreadable ({e})") from e
    files = info.get("files")
    if files is None:
        return None
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("crc32", 0), int)
        for e in files.values()
    ):
        raise ValueError(f"{directory / INFO_FILE}: 'files' is not a {{path: {{size, crc32}}}} mapping")
    return files


def size_problems(directory: str | os.PathLike, files: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The files of the manifest ``files`` that are missing or have another size under ``directory``."""
    directory = Path(directory)
    problems = []
    for name, entry in files.items():
        try:
            size = (directory / name).stat().st_size
        except OSError as e:
            missing = "missing" if isinstance(e, FileNotFoundError) else f"unreadable ({e})"
            problems.append(f"{directory / name} is {missing}, expected {entry['size']} bytes")
            continue
        if size != entry["size"]:
            problems.append(f"{directory / name} has {size} bytes, expected {entry['size']} (truncated or damaged)")
    return problems


def checksum_problems(
    directory: str | os.PathLike, files: Mapping[str, Mapping[str, int]], names: Iterable[str]
) -> list[str]:
    """The files ``names`` of the manifest ``files`` whose size or CRC32 under ``directory`` differ
    from it, or that cannot be read (entries without a CRC32: size only)."""
    directory = Path(directory)
    problems = []
    for name in names:
        entry, path = files[name], directory / name
        try:
            if "crc32" not in entry:
                size, crc = path.stat().st_size, None
            else:
                size, crc = file_crc32(path)
        except OSError as e:
            problems.append(f"{path} is unreadable ({type(e).__name__}: {e})")
            continue
        if size != entry["size"]:
            problems.append(f"{path} has {size} bytes, expected {entry['size']} (truncated or damaged)")
        elif crc is not None and crc != entry["crc32"]:
            problems.append(
                f"{path} has crc32 {crc:08x}, expected {entry['crc32']:08x} (same size, {size} bytes: damaged content)"
            )
    return problems


def summarize(problems: list[str], limit: int = 3) -> str:
    """The first ``limit`` of ``problems``, and how many more."""
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


# --------------------------------------------------------------------------------------------
# Completeness and discovery.


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint of this format, or None if it is one. Checks the
    completion marker, dist_checkpointing's metadata and the size of every file of the manifest
    (one ``stat`` each; the CRC32s are ``mcore.checkpoint.verify_checkpoint``'s)."""
    path = Path(path)
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is not a directory"
    info_path = path / INFO_FILE
    if not info_path.is_file():
        return f"{path} has no {INFO_FILE} (the completion marker written last by save_checkpoint): incomplete"
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError) as e:
        return f"{info_path} is unreadable ({e})"
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        return f"{info_path} is not a {FORMAT} file"
    if info.get("complete") is not True:
        return f"{info_path} does not say complete: true"
    if info.get("format_version") != FORMAT_VERSION:
        return f"{info_path} has format_version {info.get('format_version')!r}; this code reads {FORMAT_VERSION}"
    missing = [name for name in DIST_CKPT_FILES if not (path / name).is_file()]
    if missing:
        return f"{path} lacks dist_checkpointing's {', '.join(missing)}"
    try:
        files = read_manifest(path, info)
    except ValueError as e:
        return str(e)
    problems = size_problems(path, files) if files is not None else []
    if problems:
        return f"{path} is damaged: {summarize(problems)}"
    return None


def read_checkpoint_info(path: str | os.PathLike) -> dict:
    """The ``empg_checkpoint.json`` of a complete checkpoint; ``CheckpointError`` naming what is wrong
    otherwise."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"not a loadable checkpoint: {problem}")
    return json.loads((Path(path) / INFO_FILE).read_text())


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``step_N`` directories under ``root`` (temp and trash directories excluded), newest first."""
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, key=lambda item: item[0], reverse=True)


def newest_complete(root: str | os.PathLike) -> Path | None:
    """The newest complete ``step_N`` under ``root`` (by step, not by ``latest``), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    return next((path for _, path in step_dirs(root) if checkpoint_problem(path) is None), None)


def _read_latest(root: Path) -> tuple[Path | None, str]:
    """(the directory ``latest`` names, or None; what was wrong with it)."""
    latest = root / LATEST_FILE
    if not latest.is_file():
        return None, f"{latest} does not exist"
    try:
        name = latest.read_text().strip()
    except OSError as e:
        return None, f"{latest} is unreadable ({e})"
    if not _STEP_DIR.match(name):
        return None, f"{latest} holds {name[:80]!r}, not a step_N directory name"
    return root / name, ""


def find_latest_checkpoint(root_dir: str | os.PathLike) -> FoundCheckpoint | None:
    """The checkpoint a resume should load, or None for a fresh run; reads files only.

    ``latest`` is followed when it names a complete checkpoint; otherwise (missing, unreadable,
    pointing to a deleted, incomplete or damaged directory: a file of its manifest missing or of
    another size) the newest complete ``step_N`` is used, with a WARNING whose reason names what was
    wrong. Temp (``*.tmp-*``) and trash directories are never considered. The files' CRC32s are not
    read: ``mcore.checkpoint.find_verified_checkpoint`` (collective) does that.

    Returns None (with a warning if ``root_dir`` holds leftovers) when ``root_dir`` does not exist
    or holds no complete checkpoint and no ``latest``: a crash during the first save. Raises
    ``CheckpointError`` when ``latest`` exists but no complete checkpoint does: a checkpoint was
    committed once and is gone, and silently starting from scratch would discard the run.
    """
    found = find_checkpoint(root_dir)
    if found is not None:
        log = logger.info if is_latest(found) else logger.warning
        log("resuming from %s (step %d): %s", found.path, found.step, found.reason)
    return found


def is_latest(found: FoundCheckpoint) -> bool:
    """Whether ``found`` is the checkpoint that ``latest`` names (not a fallback)."""
    return _read_latest(found.path.parent)[0] == found.path


def find_checkpoint(root_dir: str | os.PathLike, damaged: Mapping[str, str] | None = None) -> FoundCheckpoint | None:
    """``find_latest_checkpoint`` without its log line; the ``step_N`` names in ``damaged`` (name ->
    what is damaged) count as unusable too."""
    damaged = dict(damaged or {})
    root = Path(root_dir)
    if not root.exists():
        logger.info("no checkpoint directory at %s: fresh start", root)
        return None
    if not root.is_dir():
        raise CheckpointError(f"checkpoint root {root} is not a directory")

    def problem_of(path: Path) -> str | None:
        return damaged.get(path.name) or checkpoint_problem(path)

    target, why = _read_latest(root)
    if target is not None:
        problem = problem_of(target)
        if problem is None:
            step = int(_STEP_DIR.match(target.name).group(1))
            return FoundCheckpoint(target, step, f"{root / LATEST_FILE} points to it")
        why = f"{root / LATEST_FILE} points to {target.name}, which is not usable: {problem}"
    skipped = []
    for step, path in step_dirs(root):
        if path == target:
            continue
        problem = problem_of(path)
        if problem is None:
            reason = f"{why}; using the newest complete checkpoint"
            if skipped:
                reason += f" (skipped newer: {'; '.join(skipped)})"
            return FoundCheckpoint(path, step, reason)
        skipped.append(problem)
    leftovers = sorted(p.name for p in root.iterdir() if TMP_MARK in p.name or _STEP_DIR.match(p.name))
    if (root / LATEST_FILE).exists():
        others = f"; other step directories: {'; '.join(skipped)}" if skipped else ""
        raise CheckpointError(
            f"{root} has a {LATEST_FILE} file but no complete checkpoint ({why}{others}; "
            f"step directories: {leftovers or 'none'}). Refusing to start from scratch: restore the "
            f"checkpoint or remove {root / LATEST_FILE} to start a new run."
        )
    if leftovers:
        logger.warning("no complete checkpoint in %s (only incomplete: %s): fresh start", root, leftovers)
    return None


def remove_leftovers(root_dir: str | os.PathLike, *, spare: str | None = None) -> list[str]:
    """Remove what crashed saves and deletions left in ``root_dir``: ``step_N.tmp-*`` and
    ``step_N.trash-*`` directories and ``latest.tmp-*`` files (names whose nonce is ``spare`` are
    kept: a save in progress). Nothing else is touched. One process calls it, while no save runs
    (e.g. rank 0 at start-up, holding the run's directory lock). Returns the names removed."""
    root = Path(root_dir)
    if not root.is_dir():
        return []
    removed = []
    for entry in sorted(root.iterdir()):
        if not _LEFTOVER.match(entry.name) or (spare is not None and entry.name.endswith(spare)):
            continue
        size = directory_bytes(entry) if entry.is_dir() else entry.stat().st_size
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        logger.warning("removed %s (%s), left by an interrupted save or deletion", entry, format_bytes(size))
        removed.append(entry.name)
    return removed


# --------------------------------------------------------------------------------------------
# Disk space.


def format_bytes(n: int) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB (3 significant digits)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.3g} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{value:.3g} TiB"


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) of the filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def directory_bytes(path: str | os.PathLike) -> int:
    return sum(list_files(path).values())


def checkpoint_bytes(path: str | os.PathLike) -> int:
    """The size of the checkpoint at ``path``: its manifest's total, else its files' sizes summed."""
    path = Path(path)
    try:
        files = read_manifest(path)
    except ValueError:
        files = None
    if files is None:
        return directory_bytes(path)
    return sum(entry["size"] for entry in files.values()) + (path / INFO_FILE).stat().st_size


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` stored in the checkpoint at ``path``; ``CheckpointError`` if it has none."""
    from megatron_empg.config import load_model_config

    config_path = Path(path) / MODEL_CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(
            f"{path} has no {MODEL_CONFIG_FILE}: it was saved without model_config "
            "(save_checkpoint(..., model=ModelMetadata(config=...))); give the model config another way"
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
        if (
            not entry.is_file()
            or entry.name.startswith(".")
            or entry.name.endswith(HF_WEIGHT_SUFFIXES)
            or entry.name in exclude
        ):
            continue
        shutil.copyfile(entry, dst / entry.name)
        copied.append(entry.name)
    return copied


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file, fsync and ``os.replace`` (then fsync the dir)."""
    tmp = path.with_name(f"{path.name}{TMP_MARK}{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
