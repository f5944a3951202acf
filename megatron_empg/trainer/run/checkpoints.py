"""The run's checkpoint saves (``checkpoint.async_save``): blocking, or with the files written in the
background while the next steps train (``mcore.checkpoint.async_save``), one save in flight at
most, committed at the end of the first step after every rank's writing is done. The last step's
save and a pre-emption's (SIGTERM, SIGUSR1) block, after the save in flight is committed: nothing is
left unwritten when the run returns. Metrics of the step records: ``checkpoint/blocking_s`` (what
the last save started cost the step), ``checkpoint/persist_s`` (the background writing of the
save just committed, this rank's), ``checkpoint/writing`` (1 while a step ran beside a write: a
step's slowdown is its time against the steps at 0)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_empg.mcore.checkpoint import HostStaging, PendingSave


def async_saves(setting: bool | None) -> bool:
    """``checkpoint.async_save``: null means in the background on a GPU machine."""
    return torch.cuda.is_available() if setting is None else setting


class Checkpoints:
    """``start(staging)`` plans a save of the current state (``save.start_save``; staging None:
    written at once)."""

    def __init__(self, start: Callable[[HostStaging | None], PendingSave], *, background: bool) -> None:
        from megatron_empg.mcore.checkpoint import HostStaging

        self._start = start
        self._staging = HostStaging() if background else None
        self._pending: PendingSave | None = None
        self._metrics: dict[str, float] = {}

    def save(self, *, blocking: bool) -> Path | None:
        """Checkpoint now: the save in flight committed first; then this one, committed before
        returning (``blocking``, or saves not in the background) or later. Every rank."""
        self.finish()
        pending = self._start(None if blocking else self._staging)
        self._metrics["checkpoint/blocking_s"] = pending.blocking_s
        if pending.in_background:
            self._pending = pending
            return None
        return _finish(pending)

    def poll(self) -> Path | None:
        """Commit the save in flight if every rank has written it (every rank; one all-reduce)."""
        if self._pending is None or not self._pending.written_everywhere():
            return None
        return self.finish()

    def finish(self) -> Path | None:
        """Commit the save in flight, waiting for its writing (every rank); None if there is none."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        path = _finish(pending)
        self._metrics["checkpoint/persist_s"] = pending.persist_s
        return path

    def metrics(self) -> dict[str, float]:
        """This step's checkpoint metrics (then cleared): those of the saves started and committed
        since the last call, and whether a write is in flight."""
        out, self._metrics = self._metrics, {}
        if self._staging is not None:
            out["checkpoint/writing"] = float(self._pending is not None)
        return out


def _finish(pending: PendingSave) -> Path:
    from megatron_empg.mcore.checkpoint import finish_save

    return finish_save(pending)
