"""The signals that stop a run after its current step: SIGTERM and SIGUSR1 (Slurm's pre-emption
warning; torchrun passes both on to every rank).

    with stop_signals(lambda signum, frame: ...):   # a training rank, an engine rank
        ...
"""

from __future__ import annotations

import contextlib
import signal
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def stop_signals(handler: Callable) -> Iterator[None]:
    """``handler(signum, frame)`` for ``STOP_SIGNALS`` while inside, then the previous handlers."""
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
