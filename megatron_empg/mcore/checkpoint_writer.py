"""The child process Megatron's checkpoint writer needs, started when the caller chooses.

``dist_checkpointing``'s torch_dist writer (``FileSystemWriterAsync``, used for synchronous saves
too) hands its write results back through a ``multiprocessing.Manager`` queue, whose server is a
child process started at the first save (``filesystem_async.get_write_results_queue``). A child
started there inherits whatever the process has at that moment; the trainer starts it at its own
start-up instead, with its stop signals ignored (``trainer.signals.ignored_in_children``), so that a
pre-emption signal sent to the whole process group does not kill it before the save that the
signal asks for.
"""

from __future__ import annotations

import multiprocessing

from megatron_empg.mcore import cpu_shims


def start_checkpoint_writer() -> multiprocessing.process.BaseProcess | None:
    """Start the writer's results queue (and its Manager process) now, if not started yet; the
    Manager's process, or None if it was started before (by an earlier save or call)."""
    cpu_shims.install_pre_import()
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before = set(multiprocessing.active_children())
    filesystem_async.get_write_results_queue()
    started = [p for p in multiprocessing.active_children() if p not in before]
    return started[0] if started else None
