"""Weight updates that wait in host memory for the engine to take them (``rollout.max_staleness``
>= 1 with disaggregated engines).

An engine owner's listening thread receives every update as training rank 0 pushes it
(``transport.receive_weights`` into a ``WeightStage``, which is a ``Transport``), so the push
never waits for the engine's rollout in flight; the engine's own thread takes the newest update
between rollouts (``take``) and loads it through its ``weight_sync.transport`` (``load_staged``).
An older update not yet taken is dropped when a newer one is complete: the engine always loads
the newest weights it has.

Host memory: up to three full copies of the model's weights in the engine's dtype per engine
owner (3 x 3.6 GB for a 1.8B model in bf16): the update the engine is loading, the newest
complete one, and the one being received.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from torch import Tensor

from megatron_empg.weight_sync.protocol import NamedTensors, Transport


@dataclasses.dataclass(frozen=True)
class StagedUpdate:
    """One complete update: its ``version`` label and its buckets of (HF name, CPU tensor)."""

    version: str
    buckets: list[list[tuple[str, Tensor]]]


class WeightStage:
    """A ``Transport`` that keeps each update in host memory until ``take``; thread-safe between
    one receiving thread and one taking thread. ``number``: maps a version label to the
    training steps it stands for (what ``wait_for`` compares)."""

    def __init__(self, number: Callable[[str], int]) -> None:
        self._number = number
        self._changed = threading.Condition()
        self._receiving: list[list[tuple[str, Tensor]]] | None = None
        self._ready: StagedUpdate | None = None
        self._newest = -1  # the newest complete update's number, taken or not

    # ------------------------------------------------------------------ the receiving thread

    def begin(self) -> None:
        self._receiving = []

    def send(self, bucket: NamedTensors) -> None:
        # a copy: the link's receive buffer is reused by the next bucket
        self._receiving.append([(name, tensor.detach().to("cpu", copy=True)) for name, tensor in bucket])

    def finish(self, version: str) -> None:
        with self._changed:
            self._ready = StagedUpdate(version, self._receiving)
            self._newest = self._number(version)
            self._receiving = None
            self._changed.notify_all()

    # ------------------------------------------------------------------ the engine's thread

    @property
    def newest(self) -> int:
        """The number of the newest complete update (-1: none yet)."""
        with self._changed:
            return self._newest

    def take(self) -> StagedUpdate | None:
        """The newest complete update not taken yet (None: none); it leaves the stage."""
        with self._changed:
            update, self._ready = self._ready, None
            return update

    def wait(self, until: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until ``until()`` holds (checked whenever an update completes, and when
        ``notify`` is called); returns its last value."""
        with self._changed:
            return self._changed.wait_for(until, timeout)

    def notify(self) -> None:
        """Wake ``wait`` to check its condition again (another thread queued something)."""
        with self._changed:
            self._changed.notify_all()


def load_staged(update: StagedUpdate, transport: Transport) -> int:
    """``update`` into the engine through its ``transport``; returns the bytes loaded."""
    transport.begin()
    loaded = 0
    for bucket in update.buckets:
        transport.send(bucket)
        loaded += sum(t.numel() * t.element_size() for _, t in bucket)
    transport.finish(update.version)
    return loaded
