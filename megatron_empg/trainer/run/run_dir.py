"""The directories a run writes (``checkpoint.dir``, ``logging.dir``): one run at a time, and no
fresh start over an earlier run's checkpoints or metrics. Training rank 0 calls it before the
process group, an engine or a model starts:

    held = hold_run_directories(config)                    # RunDirectoryError if another run holds one
    check_start(config, resume=..., overwrite=..., previous=held.previous)
    held.claim()                                           # only now: the lock files say who holds them
    ...                                                    # the run
    held.release()                                         # (or the process ends: the OS releases it)

A refused start changes nothing on disk: taking the locks writes nothing into an existing lock file
(``claim`` does, after every check), and ``release(undo=True)`` removes the directories and lock
files that taking them created. ``check_run_directories`` (also ``empg check``'s) says in one line
why a directory cannot be used, before anything is created.

The lock is an OS lock (``fcntl.flock``) on ``<dir>/.empg.lock``: released when the process dies,
however it dies, so a killed run never blocks the next one. The file also says who holds it
(host, pid, start time, both directories), which names the holder in the error of a second run
and tells a later run which checkpoints the metrics beside it belong to.

Start rules (``check_start``), for a requeue script that always passes ``--resume`` as for a person:

    --resume, a checkpoint in checkpoint.dir          resume from it
    --resume, no checkpoint, no earlier metrics       start at step 0 (WARNING: nothing to resume)
    --resume, no checkpoint, metrics of a run whose   start at step 0 (WARNING: it stopped before
        checkpoints go to this checkpoint.dir             its first checkpoint; those records are redone)
    --resume, no checkpoint, metrics of another run   error: checkpoint.dir mistyped?
    no --resume, checkpoints or metrics there         error, unless --overwrite (which deletes them)

``check_fresh_start`` repeats the checkpoint rule where a ``Trainer`` starts a run not resumed.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_empg.config import ConfigError, ModelConfig, RunConfig
from megatron_empg.trainer.run.phase_limits import PHASE_TIMES

RESTARTS_FILE = "engine-restarts.json"  # rollout.engine_restarts spent (trainer.engines.restart_budget)

log = logging.getLogger(__name__)

LOCK_FILE = ".empg.lock"


class RunDirectoryError(ValueError):
    """A run's directory is held by another run, or holds an earlier run that this start would
    overwrite."""


@dataclass
class HeldDirectories:
    """The locks this process holds; ``previous``: what the lock file of ``logging.dir`` said before
    (the last run that held it: ``checkpoint_dir``, ``host``, ``pid``, ``started``), or None."""

    files: list = field(default_factory=list)
    previous: dict | None = None
    created: list[Path] = field(default_factory=list)  # directories that did not exist before, outermost first
    created_files: list[Path] = field(default_factory=list)  # lock files that did not exist before
    holder: dict = field(default_factory=dict)  # what ``claim`` writes into the lock files

    def claim(self) -> None:
        """Write this run (``holder``) into the lock files: after every check of the start passed."""
        for f in self.files:
            f.seek(0)
            f.truncate()
            f.write(json.dumps(self.holder) + "\n")
            f.flush()

    def release(self, *, undo: bool = False) -> None:
        """Release the locks; ``undo``: also remove what taking them created (a run refused before it
        started leaves no directory or lock file behind)."""
        for f in self.files:
            if undo and Path(f.name) in self.created_files:
                Path(f.name).unlink(missing_ok=True)
            f.close()  # closing the descriptor releases the flock
        self.files.clear()
        for directory in reversed(self.created) if undo else ():
            _remove_empty_tree(directory)
        self.created.clear()


def _remove_empty_tree(root: Path) -> None:
    """``root`` and the directories under it, where empty (the deepest first)."""
    for path in [*sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)), root]:
        try:
            path.rmdir()
        except OSError:  # not empty (or gone): something else was written there
            pass


def _directories(config: RunConfig) -> dict[Path, str]:
    """Each distinct directory (resolved) -> the field that names it."""
    found: dict[Path, str] = {}
    for name, path in (("logging.dir", config.logging.dir), ("checkpoint.dir", config.checkpoint.dir)):
        found.setdefault(Path(path).resolve(), name)
    return found


def _read_holder(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def check_run_directories(config: RunConfig) -> None:
    """A ``ConfigError`` naming ``logging.dir`` or ``checkpoint.dir`` if it is not a directory, or
    cannot be created (a file on its path, no permission to write where it would be). Reads only."""
    for directory, name in _directories(config).items():
        if directory.exists():
            if not directory.is_dir():
                raise ConfigError(name, f"{directory} is a file, not a directory")
            existing = directory
        else:
            existing = next(p for p in directory.parents if p.exists())
            if not existing.is_dir():
                raise ConfigError(name, f"{directory} cannot be created: {existing} is a file, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            what = "is not writable" if existing == directory else f"cannot be created: {existing} is not writable"
            raise ConfigError(name, f"{directory} {what}")


def hold_run_directories(config: RunConfig) -> HeldDirectories:
    """Lock ``logging.dir`` and ``checkpoint.dir`` (created if missing) for this process, or raise
    ``RunDirectoryError`` naming the directory and the run that holds it (``ConfigError`` for one
    that cannot be used). Never waits; writes nothing into an existing lock file (``claim`` does)."""
    check_run_directories(config)
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "checkpoint_dir": str(Path(config.checkpoint.dir).resolve()),
        "logging_dir": str(Path(config.logging.dir).resolve()),
        "command": " ".join(sys.argv),
    }
    held = HeldDirectories(holder=me)
    logging_dir = Path(config.logging.dir).resolve()
    try:
        for directory, name in _directories(config).items():
            missing = directory
            while not missing.parent.exists():
                missing = missing.parent
            if not missing.exists():
                held.created.append(missing)
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / LOCK_FILE
            if not path.exists():
                held.created_files.append(path)
            f = open(path, "a+")  # noqa: SIM115 (kept open: the lock lives as long as the descriptor)
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                holder = _read_holder(path) or {}
                raise RunDirectoryError(
                    f"{name}={directory} is in use by another run: pid {holder.get('pid', '?')} on host "
                    f"{holder.get('host', '?')}, started {holder.get('started', '?')} (it holds {path}). Two runs "
                    f"must not share a directory: wait for that run to end, or give this run another {name}"
                ) from None
            held.files.append(f)
            if directory == logging_dir:
                held.previous = _read_holder(path)
    except OSError as error:  # created meanwhile, or a filesystem that refuses: said in one line
        held.release(undo=True)
        raise RunDirectoryError(f"cannot take the run's directories: {error}") from None
    except BaseException:
        held.release(undo=True)
        raise
    return held


def check_start(config: RunConfig, *, resume: bool, overwrite: bool, previous: dict | None) -> None:
    """Apply the start rules of the module docstring (reads files; ``overwrite`` deletes the earlier
    run's checkpoints and metrics). Raises ``RunDirectoryError`` naming the directory, or
    ``ConfigError`` for a checkpoint to resume of another model's shapes."""
    from megatron_empg.mcore.checkpoint import find_latest_checkpoint
    from megatron_empg.trainer.run.metrics_log import read_metrics

    checkpoint_dir, metrics_path = Path(config.checkpoint.dir), Path(config.logging.dir) / "metrics.jsonl"
    found = find_latest_checkpoint(checkpoint_dir)
    steps = [r.get("step") for r in read_metrics(metrics_path)] if metrics_path.is_file() else []
    earlier = f"{len(steps)} records, steps {min(steps)}-{max(steps)}" if steps else ""
    if resume:
        if found is not None:  # of this run's model: other shapes would fail deep inside Megatron's load
            check_checkpoint_model("checkpoint.dir", found.path, config.model_config())
            return
        same_run = previous is not None and previous.get("checkpoint_dir") == str(checkpoint_dir.resolve())
        if steps and not same_run:
            where = (
                f"its checkpoints in {previous['checkpoint_dir']}"
                if previous and previous.get("checkpoint_dir")
                else "its checkpoints elsewhere"
            )
            raise RunDirectoryError(
                f"--resume: checkpoint.dir={checkpoint_dir} holds no checkpoint, but logging.dir={config.logging.dir} "
                f"holds the metrics of an earlier run ({earlier}; {where}). Is checkpoint.dir mistyped? "
                "Pass --overwrite (without --resume) to start a new run over them"
            )
        log.warning(
            "--resume: no checkpoint in %s yet: starting at step 0%s",
            checkpoint_dir,
            f" (the run there stopped before its first checkpoint: {earlier} are redone)" if steps else "",
        )
        return
    if found is None and not steps:
        return
    what = " and ".join(
        part
        for part in (
            f"checkpoints (newest: {found.path.name}) in checkpoint.dir={checkpoint_dir}" if found else "",
            f"metrics ({earlier}) in logging.dir={config.logging.dir}" if steps else "",
        )
        if part
    )
    if not overwrite:
        raise RunDirectoryError(
            f"an earlier run left {what}: pass --resume to continue it, --overwrite to replace it, or give "
            "this run other directories"
        )
    log.warning("--overwrite: deleting the earlier run's %s", what)
    if found is not None:
        _delete_checkpoints(checkpoint_dir)
    if steps:
        metrics_path.unlink()
        run_dir = Path(config.logging.dir)  # the earlier run's phase times and engine restarts go too
        shutil.rmtree(run_dir / PHASE_TIMES, ignore_errors=True)
        (run_dir / RESTARTS_FILE).unlink(missing_ok=True)


def _delete_checkpoints(root: Path) -> None:
    """The ``step_N`` directories and ``latest`` of a checkpoint root (nothing else of it)."""
    from megatron_empg.mcore.checkpoint import LATEST_FILE

    (root / LATEST_FILE).unlink(missing_ok=True)  # first: a half-deleted root is then a fresh one
    for entry in sorted(root.glob("step_*")):
        if entry.is_dir():
            shutil.rmtree(entry)


def check_fresh_start(config: RunConfig) -> None:
    """A ``RunDirectoryError`` if ``checkpoint.dir`` holds a checkpoint (a run not resumed must not
    overwrite another's); reads files only."""
    from megatron_empg.mcore.checkpoint import find_latest_checkpoint

    found = find_latest_checkpoint(config.checkpoint.dir)
    if found is not None:
        raise RunDirectoryError(
            f"checkpoint.dir={config.checkpoint.dir} holds checkpoints of an earlier run (newest: "
            f"{found.path.name}): pass --resume to continue it, or give this run another checkpoint.dir"
        )


def check_checkpoint_model(field: str, directory: Path, model: ModelConfig) -> None:
    """The model config saved in the checkpoint ``directory`` must equal ``model`` in every field
    that decides the tensors (``weight_sync.hf_files.ARCHITECTURE_FIELDS``); a checkpoint saved
    without one is checked by name only, when it loads."""
    from megatron_empg.mcore.checkpoint.files import MODEL_CONFIG_FILE, read_model_config
    from megatron_empg.weight_sync.hf_files import architecture_differences

    if not (directory / MODEL_CONFIG_FILE).is_file():
        return
    try:
        saved = read_model_config(directory)
    except ConfigError as error:
        raise ConfigError(field, f"{directory / MODEL_CONFIG_FILE}: {error}") from None
    differences = architecture_differences(saved, model)
    if differences:
        raise ConfigError(
            field,
            f"{directory} holds model {saved.name!r} of other shapes than this run's model {model.name!r} "
            f"(saved != this run's): {'; '.join(differences)}",
        )
