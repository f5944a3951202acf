"""The signals that stop a run after its current step: SIGTERM and SIGUSR1 (Slurm's pre-emption
warning; torchrun passes both on to every rank).

    with stop_signals(lambda signum, frame: ...):   # a training rank, an engine rank
        ...
    with ignored_in_children():                     # around the start of a child process
        start_the_child()

torchrun (``os.killpg``) and Slurm send these signals to whole process groups: the children a
rank starts (Megatron's checkpoint writer, the reward workers, an engine in its own process) get
them too, and one that dies of them breaks the checkpoint or the step that the signal asks the
rank to finish. Children started inside ``ignored_in_children`` inherit them blocked (a signal
mask survives fork and exec): pending for ever unless the child unblocks them, which neither
Python nor vLLM does (vLLM's engine core is stopped with SIGINT instead: ``VllmEngine.shutdown``).
The rank's own handlers are not touched, so it loses none: other threads take the signal meanwhile,
or it waits until the block ends.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def ignored_in_children(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Processes started inside keep ``signals`` blocked; this thread blocks them while inside, and a
    signal held meanwhile reaches this process's handlers on exit."""
    # multiprocessing starts its resource tracker at the first spawn (vLLM spawns its engine core,
    # Megatron its writer) and then UNBLOCKS SIGINT and SIGTERM in the calling thread
    # (resource_tracker.ensure_running): started first, it leaves the block alone.
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def stop_signals(handler: Callable) -> Iterator[None]:
    """``handler(signum, frame)`` for ``STOP_SIGNALS`` while inside, then the previous handlers."""
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def any_rank_signalled(signum: int | None, group) -> int | None:
    """The largest signal number any rank of ``group`` has received (``signum``: this rank's, or
    None), or None if none has; every rank of ``group`` calls it. One MAX all-reduce (of one int64),
    so all ranks take the same decision after a step even when a signal reached only some of them,
    or reached them on either side of their checks (a rank stopping alone would leave the others
    waiting in the next collective)."""
    import torch
    import torch.distributed as dist

    from megatron_empg.parallel.collectives import collective_device

    if dist.get_world_size(group) == 1:
        return signum
    flag = torch.tensor([signum or 0], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) or None
