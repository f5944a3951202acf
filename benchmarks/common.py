"""What several benchmarks share: the commit a result was measured at, and a plain write of a
file (the yardstick of the checkpoint benchmarks)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLAIN_CHUNK = 8 << 20  # mcore.checkpoint.stream.WRITE_CHUNK (a constant: a before run has no such module)


def commit() -> str:
    """The checkout's short commit, ``+dirty`` when tracked files differ from it."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") or "unknown"
    except OSError:
        return "unknown"


def plain_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file at ``path`` in ``PLAIN_CHUNK`` writes from one
    buffer of random bytes, fsync included; the file is removed afterwards (untimed)."""
    view = memoryview(os.urandom(PLAIN_CHUNK))
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            left -= f.write(view[: min(PLAIN_CHUNK, left)])
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed
