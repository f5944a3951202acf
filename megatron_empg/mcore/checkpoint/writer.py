"""The child process Megatron's checkpoint writer needs, started when the caller chooses.

``dist_checkpointing``'s torch_dist writer (``FileSystemWriterAsync``, used for synchronous saves
too) hands its write results back through a ``multiprocessing.Manager`` queue, whose server is a
child process started at the first save (``filesystem_async.get_write_results_queue``). A child
started there inherits whatever the process has at that moment; the trainer starts it at its own
start-up instead, with its stop signals ignored (``trainer.run.signals.ignored_in_children``), so that a
pre-emption signal sent to the whole process group does not kill it before the save that the
signal asks for.

A Manager's server does not notice that its parent died: a rank killed on its own (SIGKILL, the OOM
killer, a Slurm step whose processes are tracked by parent) left it running for good. The server
started here asks the kernel to kill it when its parent dies (``parallel.process_lifetime``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.managers

from megatron_empg.mcore import cpu_shims
from megatron_empg.parallel.process_lifetime import die_with_parent


def start_checkpoint_writer() -> multiprocessing.process.BaseProcess | None:
    """Start the writer's results queue (and its Manager process, which dies with this process) now,
    if not started yet; the Manager's process, or None if it was started before (by an earlier save
    or call)."""
    cpu_shims.install_pre_import()
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return None
    before = set(multiprocessing.active_children())
    # What get_write_results_queue does (a spawn-context Manager's Queue), with the initializer.
    manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent)
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
    (started,) = [p for p in multiprocessing.active_children() if p not in before]
    return started
