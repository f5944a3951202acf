"""vLLM warnings that repeat for a whole run, shown once per process.

The layerwise weight reload warns "RotaryEmbedding: Failed to load weights" after every weight sync
(its cos/sin cache is no checkpoint weight; vLLM puts its own back, and the sync's consistency gate
checks the result); vLLM's CPU worker replaces ``torch.set_num_threads`` by a warning, repeated on
every call. ``show_repeating_warnings_once`` runs in the trainer's process
(``trainer.run.console.configure_logging``) and in each vLLM worker process (``vllm_weight_transfer``
registers its backend there). Standard library only.
"""

from __future__ import annotations

import logging

# The two loggers of the module docstring: the layerwise reload's, the CPU worker's.
REPEATING_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.worker.cpu_worker")


def show_repeating_warnings_once() -> None:
    """Let the ``REPEATING_LOGGERS`` pass each of their messages once in this process. A second call
    adds nothing."""
    for name in REPEATING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Once) for f in logger.filters):
            logger.addFilter(_Once())


class _Once(logging.Filter):
    """Passes each distinct message (level and text) once."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[tuple[int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self._seen:
            return False
        self._seen.add(key)
        return True
