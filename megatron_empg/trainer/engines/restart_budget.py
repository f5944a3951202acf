"""``rollout.engine_restarts`` counted over the run's attempts, not per attempt.

Counted per process, a run whose engine dies every few steps would restart its engines
``engine_restarts`` times in each attempt, and each exit restartable would give it as many again:
the faulty engine never stops the run. The count is kept in ``<logging.dir>/engine-restarts.json``
(every rank of the stage spends together and writes the same count, atomically); each attempt
starts from it. ``--overwrite`` starts a new run in the directory: the count goes with the metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from megatron_empg.trainer.run.run_dir import RESTARTS_FILE
from megatron_empg.trainer.run.watchdog import RestartableError


class RestartBudget:
    """The engine restarts a run has left: ``limit`` over all its attempts in ``run_dir``."""

    def __init__(self, run_dir: Path, limit: int) -> None:
        self.path, self.limit = Path(run_dir) / RESTARTS_FILE, limit
        self.used = 0
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            self.used = int(json.loads(self.path.read_text())["used"])

    def spend(self, lost: Exception) -> None:
        """One restart for ``lost``, or ``RestartableError`` when the run spent them all."""
        if self.used >= self.limit:
            raise RestartableError(
                f"{lost} (rollout.engine_restarts={self.limit} spent over the run's attempts: {self.path})"
            ) from lost
        self.used += 1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"used": self.used, "limit": self.limit}))
        os.replace(tmp, self.path)
