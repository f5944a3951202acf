"""The weight sync's seam: what a transport sends (``NamedTensors``), the engine's side of an update
(``WeightReceiver``) and one update's steps (``Transport``). Every transport module
(``transport``, ``cuda_ipc``, ``staging``) imports these, and none imports another for them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

NamedTensors = Sequence[tuple[str, Tensor]]


class WeightReceiver(Protocol):
    """The rollout engine's side of a weight update (see ``rollout.engine.RolloutEngine``)."""

    def begin_weight_update(self) -> None: ...

    def update_weights(
        self, *, named_tensors: NamedTensors | None = None, path: str | None = None, ipc: dict | None = None
    ) -> None: ...

    def finish_weight_update(self, version: str) -> None: ...


class Transport(Protocol):
    """One weight update: ``begin()``, ``send(bucket)`` per bucket (HF names, full tensors),
    ``finish(version)``, which also makes the engine drop KV computed with the old weights."""

    def begin(self) -> None: ...

    def send(self, bucket: NamedTensors) -> None: ...

    def finish(self, version: str) -> None: ...
