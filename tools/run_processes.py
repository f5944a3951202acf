"""The processes a run left behind, for the fault suite and the tests.

A run is found two ways, since neither sees every process: by a ``NAME=value`` marker in its
environment (every child inherits it, but vLLM's process title overwrites ``/proc/<pid>/environ``
and its workers get an environment of their own), and by session (a run started with
``start_new_session=True`` is session ``proc.pid``; children keep it unless they call setsid).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path


def _session(stat: str) -> int:
    # /proc/<pid>/stat: "pid (comm) state ppid pgrp session ..."; comm may hold spaces and ")"
    return int(stat.rsplit(")", 1)[1].split()[3])


def _marked(pid_dir: Path, marker: bytes, sessions: Collection[int]) -> bool:
    try:
        if sessions and _session((pid_dir / "stat").read_text()) in sessions:
            return True
        return bool(marker) and marker in (pid_dir / "environ").read_bytes().split(b"\0")
    except (OSError, IndexError, ValueError):  # gone, or not ours to read
        return False


def processes_with(marker: str = "", sessions: Collection[int] = (), settle_s: float = 10.0) -> list[int]:
    """The pids of live processes whose environment holds ``marker`` or whose session is one of
    ``sessions``, after waiting up to ``settle_s`` for them to exit (multiprocessing's resource
    tracker takes a moment)."""
    deadline, sessions = time.monotonic() + settle_s, set(sessions)
    while True:
        pids = [int(d.name) for d in Path("/proc").glob("[0-9]*") if _marked(d, marker.encode(), sessions)]
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.5)
