"""The training ranks' side of disaggregated engines (``rollout.placement: disaggregated``), and
the messages both sides exchange over the ``parallel.link.Link``.

Training rank 0 is the link's end: it tells the engines where the run starts (``Start``), pushes
the weights (``weight_sync.transport.LinkTransport``), and after every step says whether to go on
(``Control``); it receives what the engines' lead gathered (a step's rollout, the gate's probes, a
validation pass) and shares it with the other training ranks (one object broadcast over the
training world). The engines' side is ``trainer.engine_rank``; the order of the messages is the
loop's, so each side waits only where it needs the other:

    sync:          engines:  draw s, send      -> weights s+1 -> probes -> [validation] -> control
                   trainers: receive s, train  -> weights s+1 -> gate   -> [validation] -> control
    one_step_off:  engines:  draw s+1, send    -> weights s+1 -> probes -> [validation] -> control
                   trainers: train s, receive s+1 -> weights s+1 -> gate -> [validation] -> control

(one_step_off: the engines draw step s+1 with step s's starting weights while the trainers train
step s; step 0's rollout comes first, after the starting weights.)
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import Tensor

from megatron_empg.parallel.link import LEAD, TRAINER, Link
from megatron_empg.trainer.collect import StepRollout


@dataclasses.dataclass(frozen=True)
class Start:
    """Where the run starts: ``step`` (training steps done), the data cursor's ``data_state``,
    whether the rollout of ``step`` is already on the training ranks (``pending``: restored from a
    checkpoint of a one-step-off run) and whether to validate the starting weights."""

    step: int
    data_state: dict
    pending: bool
    validate: bool


@dataclasses.dataclass(frozen=True)
class Control:
    """After every step (checkpoint written): ``stop`` the engines, or go on."""

    stop: bool


@dataclasses.dataclass(frozen=True)
class FromEngines:
    """What the engines' lead sends training rank 0: a step's ``rollout`` (all replicas), the
    gate's ``probes`` (per engine: probe sequences and the engine's log-probs) or ``validation``
    metrics, with the largest signal an engine rank received (``signal``, 0: none): the training
    ranks fold it into their stop decision."""

    rollout: StepRollout | None = None
    probes: list[tuple[list[list[int]], Tensor]] | None = None
    validation: dict[str, float] | None = None
    signal: int = 0


class RemoteEngines:
    """Every training rank holds one; ``link`` on training rank 0 only (None elsewhere)."""

    def __init__(self, link: Link | None) -> None:
        self.link = link
        self.engine_signal: int | None = None  # the largest signal the engines reported
        self.stopped = False  # the engines were told to stop

    def start(self, start: Start) -> None:
        if self.link is not None:
            self.link.broadcast_object(start, src=TRAINER)

    def control(self, stop: bool) -> None:
        """After each step: go on, or (the last step, a signal) stop the engines."""
        if self.link is not None:
            self.link.broadcast_object(Control(stop), src=TRAINER)
        self.stopped = stop

    def receive(self) -> FromEngines:
        """The lead's next message on every training rank (rank 0 receives it, then broadcasts)."""
        box = [self.link.recv_object(src=LEAD) if self.link is not None else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        message: FromEngines = box[0]
        if message.signal:
            self.engine_signal = max(self.engine_signal or 0, message.signal)
        return message

    def rollout(self) -> StepRollout:
        return self.receive().rollout

    def probes(self) -> list[tuple[list[list[int]], Tensor]]:
        return self.receive().probes

    def validation(self) -> dict[str, float]:
        return self.receive().validation

    def close(self) -> None:
        """The run is over; engines not yet told to stop (it failed) are told now. They hear it at
        their next message from training rank 0 (the step's weights, or its control)."""
        if self.link is not None:
            if not self.stopped:
                self.link.broadcast_object(Control(stop=True), src=TRAINER)
                self.stopped = True
            self.link.shutdown()
