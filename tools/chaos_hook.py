"""The fault campaign's hook in the run's processes (``tools/chaos.py``): every rank's main process
of a campaign's run imports it (the fault suite's ``sitecustomize``, ``EMPG_FAULT_HOOK=chaos``).
It reads the flag files that the campaign writes from outside, in ``$EMPG_CHAOS_FLAGS``:

    hang_reward  the next reward call hangs, and every later one of the process that took the
                 flag (a reward service that stopped answering for this attempt; a restarted
                 process starts without it)
    nan_step     the loss of the next update of rank 0 is NaN (its gradients too; the all-reduce
                 brings them to every rank, and the step guard refuses the step on all)
    nan_steps    the steps poisoned so far, one a line (written here): a step trained again after
                 a restart is poisoned again, as a NaN that comes from the data would be, and the
                 uninterrupted reference run is given the same file
    trained      each step rank 0 logged and when, one a line (written here): the steps trained
                 twice, and the seconds a step takes

A flag is taken by renaming it (one process takes it). Not part of the package: a test hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path

FLAGS = Path(os.environ["EMPG_CHAOS_FLAGS"])
RANK = int(os.environ["RANK"])


def take(name: str) -> bool:
    """Whether this process took the flag ``name`` (written by the campaign, not yet taken)."""
    try:
        os.rename(FLAGS / name, FLAGS / f"{name}.taken-{os.getpid()}")
    except FileNotFoundError:
        return False
    return True


def _append(name: str, line: str) -> None:
    with open(FLAGS / name, "a") as out:
        out.write(f"{line}\n")
        out.flush()
        os.fsync(out.fileno())  # before the step it names can end: a kill right after loses nothing


def _steps(name: str) -> set[int]:
    with contextlib.suppress(FileNotFoundError):
        return {int(line) for line in (FLAGS / name).read_text().splitlines()}
    return set()


def _hang_rewards() -> None:
    from megatron_empg.tasks import registry

    stuck = threading.Event()

    def wrap(reward):
        def hanging(responses, examples, *args):
            if stuck.is_set() or take("hang_reward"):
                stuck.set()
                threading.Event().wait()  # for ever
            return reward(responses, examples, *args)

        return hanging

    registry.REWARDS["arithmetic"] = wrap(registry.REWARDS["arithmetic"])  # the demo recipe's reward


def _nan_steps() -> None:
    import megatron_empg.trainer.loop as loop
    from megatron_empg.core.aggregation import LossSum
    from megatron_empg.parallel.rl_loss import RLLoss

    update = loop.Trainer.update

    def nan_loss(loss_fn):
        def loss(*args, **kwargs):
            out = loss_fn(*args, **kwargs)
            nan = LossSum(out.loss.loss_sum * float("nan"), out.loss.count)
            return RLLoss(nan, {**out.metrics, "loss": nan})

        return loss

    def poisoned_update(self, minis):
        step = self.step_index + 1
        if step not in _steps("nan_steps"):
            if not take("nan_step"):
                return update(self, minis)
            _append("nan_steps", str(step))
        components = self.components
        self.components = dataclasses.replace(components, loss_fn=nan_loss(components.loss_fn))
        try:
            return update(self, minis)
        finally:
            self.components = components

    loop.Trainer.update = poisoned_update


def _count_trained() -> None:
    from megatron_empg.trainer.run.metrics_log import MetricsLogger

    log = MetricsLogger.log

    def counted(self, step, metrics):
        if self.enabled and step > 0:
            _append("trained", f"{step} {time.time():.3f}")
        return log(self, step, metrics)

    MetricsLogger.log = counted


_hang_rewards()
if RANK == 0:  # rank 0 alone poisons (a NaN on one rank refuses the step on every rank) and logs
    _nan_steps()
    _count_trained()
