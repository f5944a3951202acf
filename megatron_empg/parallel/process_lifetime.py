"""Child processes that die with the process that started them.

A rank killed on its own (SIGKILL, the OOM killer, a launcher that tracks processes by parent) runs
no shutdown code, and a child that does not watch its parent outlives it, holding its memory (on a
GPU, the next run's engine then cannot start). Two such children: Megatron's checkpoint writer
(a ``multiprocessing.Manager`` server, ``mcore.checkpoint.writer``) and vLLM's engine core with its
workers (``rollout.vllm_plugin``). Each calls ``die_with_parent`` when it starts.

SIGKILL, not SIGTERM: the trainer starts its children with the stop signals blocked
(``trainer.run.signals``), so that a pre-emption reaching the process group does not stop a child whose
parent is alive.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

logger = logging.getLogger(__name__)


def die_with_parent() -> bool:
    """In a process started by ``multiprocessing``, on Linux: SIGKILL from the kernel when the parent
    dies (``PR_SET_PDEATHSIG``); exits at once if the parent is gone already. Returns whether it was
    set (False: no multiprocessing parent, another OS, or prctl refused, with a warning)."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        logger.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): this process may outlive its parent", ctypes.get_errno()
        )
        return False
    if os.getppid() != parent.pid:  # the parent died before the request: nothing will signal this one
        os._exit(1)
    return True
