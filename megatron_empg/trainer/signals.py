"""The signals that stop a run after its current step: SIGTERM and SIGUSR1 (Slurm's pre-emption
warning; torchrun passes both on to every rank).

    with stop_signals(lambda signum, frame: ...):   # a training rank, an engine rank
        ...
    with ignored_in_children(STOP_SIGNALS):         # around the start of a child process
        start_the_child()

torchrun (``os.killpg``) and Slurm send these signals to whole process groups: the children a
rank starts (Megatron's checkpoint writer, the reward workers, an engine in its own process) get
them too, and one that dies of them breaks the checkpoint or the step that the signal asks the
rank to finish. Children started inside ``ignored_in_children`` inherit SIG_IGN for them (an
ignored disposition survives fork and exec) and keep them blocked; the rank itself loses none: the
signals are blocked while its handlers are swapped out, and delivered to its own handlers on exit.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def ignored_in_children(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Processes started inside (fork or spawn) ignore ``signals``; this process's handlers are
    back on exit, and a signal that arrived meanwhile is delivered to them then. Main thread only."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # pending ones reach the restored handlers


@contextlib.contextmanager
def stop_signals(handler: Callable) -> Iterator[None]:
    """``handler(signum, frame)`` for ``STOP_SIGNALS`` while inside, then the previous handlers."""
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
