"""``rollout.partial``: an engine rank loads at most one pushed update inside a draw, so that every
version that drew tokens is probed by the gate (the probe after the draw sees only what the engine
then holds). Two pushes landing in one draw: the first is loaded mid-draw, the second stays staged
for the load after the draw, which probes it in turn. The engine rank is built without its engine:
a recording transport stands in for it, the real host stage holds the pushes."""

from __future__ import annotations

import torch

from megatron_empg.trainer.batching.batch import version_step
from megatron_empg.trainer.engines.engine_rank import EngineRank
from megatron_empg.weight_sync.staging import WeightStage


class Loads:
    """A transport recording the versions loaded into the engine."""

    def __init__(self) -> None:
        self.versions: list[str] = []

    def begin(self) -> None:
        pass

    def send(self, bucket) -> None:
        pass

    def finish(self, version: str) -> None:
        self.versions.append(version)


class Listener:
    def __init__(self) -> None:
        self.stage = WeightStage(version_step)

    def raise_failure(self) -> None:
        pass

    def push(self, version: str) -> None:
        self.stage.begin()
        self.stage.send([("w", torch.zeros(1))])
        self.stage.finish(version)


class Stage:
    weights_version = 0

    def wake_weights(self) -> None:
        pass

    def wake_kv_cache(self) -> None:
        pass


def engine_rank() -> EngineRank:
    rank = object.__new__(EngineRank)  # the loading logic only: no engine, no process group
    rank.listener, rank.transport, rank.stage, rank.loaded_in_flight = Listener(), Loads(), Stage(), False
    return rank


def push_during_draw(rank: EngineRank, versions: list[str]) -> None:
    """A draw's decode steps with ``versions`` pushed between them."""
    for version in versions:
        rank.listener.push(version)
        rank._load_between_decode_steps()
        rank._load_between_decode_steps()  # the next decode step: nothing new


def test_two_pushes_in_one_draw_load_one_inside_it_and_the_other_after():
    rank = engine_rank()
    push_during_draw(rank, ["step-3", "step-4"])
    assert rank.transport.versions == ["step-3"] and rank.loaded_in_flight  # probed after the draw
    assert rank.stage.weights_version == 3
    rank.loaded_in_flight = False  # the draw ended and its probe went (EngineRank._serve_ahead)
    assert rank._load_staged()  # the load after the draw, probed by _load_newest
    assert rank.transport.versions == ["step-3", "step-4"]


def test_one_push_per_draw_is_loaded_inside_each():
    """Negative control: the rule delays only a second push of the same draw."""
    rank = engine_rank()
    for version in ("step-3", "step-4"):
        push_during_draw(rank, [version])
        rank.loaded_in_flight = False
    assert rank.transport.versions == ["step-3", "step-4"]
