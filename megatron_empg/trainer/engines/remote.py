"""The training ranks' side of disaggregated engines (``rollout.placement: disaggregated``), and
the messages both sides exchange over the ``parallel.link.Link``.

Training rank 0 is the link's end: it tells the engines where the run starts (``Start``), pushes
the weights (``weight_sync.transport.LinkTransport``), and after every step says whether to go on
(``Control``); it receives what the engines' lead gathered (a step's rollout, the gate's probes, a
validation pass) and shares it with the other training ranks (one object broadcast over the
training world). The engines' side is ``trainer.engines.engine_rank``.

With ``rollout.max_staleness`` 0 both sides keep one order, so each waits only where it needs the
other:

    engines:  draw s, send      -> weights s+1 -> probes -> [validation] -> control
    trainers: receive s, train  -> weights s+1 -> gate   -> [validation] -> control

With k >= 1 neither side waits for the other's turn: an engine owner's thread takes every
message of training rank 0 as it comes (a weight update into host memory,
``weight_sync.staging``; a ``Validate`` request; the ``Control``), and a thread on training rank 0
takes every message of the engines' lead into a queue (``Inbox``). The engines draw step t once
they hold weights of step t - 1 - k or newer, loading the newest they have between rollouts; after
each load they send their probes (``FromEngines.versions``), which the training ranks check against
the log-probs they computed when they pushed those weights. Messages from the lead keep their
order: a load's probes come after every rollout drawn with older weights.
"""

from __future__ import annotations

import dataclasses
import queue
import threading

import torch.distributed as dist
from torch import Tensor

from megatron_empg.parallel.link import LEAD, TRAINER, Link
from megatron_empg.trainer.engines.collect import StepRollout


@dataclasses.dataclass(frozen=True)
class Start:
    """Where the run starts: ``step`` (training steps done), the data cursor's ``data_state``, how
    many rollouts from ``step`` on are already on the training ranks (``pending``: restored from a
    checkpoint of a run with ``rollout.max_staleness`` >= 1) and whether to validate the starting
    weights."""

    step: int
    data_state: dict
    pending: int
    validate: bool


@dataclasses.dataclass(frozen=True)
class Validate:
    """``rollout.max_staleness`` >= 1: validate the weights of ``step`` training steps (pushed
    before this request; the engines load them first)."""

    step: int


@dataclasses.dataclass(frozen=True)
class Control:
    """After every step (checkpoint written): ``stop`` the engines, or go on."""

    stop: bool


@dataclasses.dataclass(frozen=True)
class FromEngines:
    """What the engines' lead sends training rank 0: a step's ``rollout`` (all replicas), the
    gate's ``probes`` (per engine: probe sequences and the engine's log-probs; with
    ``rollout.max_staleness`` >= 1 per engine the training steps of the weights it probed,
    ``versions``, and the largest gap between its sampler's and its own scoring's log-probs of the
    sampled continuation, ``self_check``) or ``validation`` metrics, or ``stopped`` (the engines'
    last message), with the largest signal an engine rank received (``signal``, 0: none): the
    training ranks fold it into their stop decision."""

    rollout: StepRollout | None = None
    probes: list[tuple[list[list[int]], Tensor]] | None = None
    validation: dict[str, float] | None = None
    versions: list[int] | None = None
    self_check: list[float] | None = None
    stopped: bool = False
    signal: int = 0


class RemoteEngines:
    """Every training rank holds one; ``link`` on training rank 0 only (None elsewhere).
    ``inbox``: receive on a thread of training rank 0 (``rollout.max_staleness`` >= 1), so the
    engines' lead never waits for the trainers to take a message."""

    def __init__(self, link: Link | None, *, inbox: bool = False) -> None:
        self.link = link
        self.engine_signal: int | None = None  # the largest signal the engines reported
        self.stopped = False  # the engines were told to stop
        self.inbox = Inbox(link) if inbox and link is not None else None

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
        box = [None]
        if self.inbox is not None:
            box = [self.inbox.next()]
        elif self.link is not None:
            box = [self.link.recv_object(src=LEAD)]
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

    def request_validation(self, step: int) -> None:
        if self.link is not None:
            self.link.broadcast_object(Validate(step), src=TRAINER)

    def close(self) -> None:
        """The run is over; engines not yet told to stop (it failed) are told now. They hear it at
        their next message from training rank 0 (the step's weights, or its control); with an
        inbox, training rank 0 waits for their last message (their rollout in flight is dropped)."""
        if self.link is not None:
            if not self.stopped:
                self.link.broadcast_object(Control(stop=True), src=TRAINER)
                self.stopped = True
            if self.inbox is not None:
                self.inbox.close()
            self.link.shutdown()


class Inbox:
    """Training rank 0's thread that receives every message of the engines' lead as it comes, in
    order, until the engines' last (``FromEngines.stopped``)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.messages: queue.Queue[FromEngines | BaseException] = queue.Queue()
        self.thread = threading.Thread(target=self._receive, name="empg-engine-inbox", daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        try:
            while True:
                message: FromEngines = self.link.recv_object(src=LEAD)
                self.messages.put(message)
                if message.stopped:
                    return
        except BaseException as error:  # noqa: BLE001  (the main thread raises it)
            self.messages.put(error)

    def next(self) -> FromEngines:
        """The lead's next message (waits for it); what ended the thread, raised."""
        message = self.messages.get()
        if isinstance(message, BaseException):
            raise RuntimeError("the engines' link broke") from message
        return message

    def close(self, timeout: float = 600.0) -> None:
        """Wait (up to ``timeout`` s: the engines finish their rollout in flight) for the lead's last message."""
        self.thread.join(timeout)
