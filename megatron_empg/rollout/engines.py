"""The rollout-engine implementations by name (``rollout.engine`` in a config), and what each can do.

``vllm`` (``rollout.vllm_engine.VllmEngine``) and ``hf`` (``rollout.hf_engine.HfEngine``, plain
transformers in the trainer's process: for machines without vLLM, such as the GPU smoke test's).
Torch-free and import-free: an engine's module is imported only when it is built, and the layout
check (``trainer.bind.layout``, which runs where torch may be missing) reads this registry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineKind:
    """An implementation of ``rollout.engine.RolloutEngine``: ``target`` (``module:Class``, imported
    when built; the class takes ``(model_dir, rollout_config, *, load_format)``), whether it can run
    in its own process (``rollout.in_process: false``), whether it can share a training rank's
    process in a world of several ranks (vLLM's in-process engine cannot: it would join the
    training world), whether it loads weights between decode steps (``generate``'s
    ``between_steps``: ``rollout.partial``) and on which devices (``"cpu"``, ``"cuda"``) it can
    return each sample's routed experts (``Completion.routed_experts``, started with
    ``routed_experts=True``: ``algorithm.router_replay``)."""

    target: str
    own_process: bool
    in_process_beside_training: bool
    updates_mid_generation: bool
    routes_on: tuple[str, ...] = ()

    def load(self) -> type:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


ENGINES: dict[str, EngineKind] = {
    "vllm": EngineKind(
        "megatron_empg.rollout.vllm_engine:VllmEngine",
        own_process=True,
        in_process_beside_training=False,
        updates_mid_generation=True,
        routes_on=("cuda",),
    ),  # enable_return_routed_experts: its GPU model runner only
    "hf": EngineKind(
        "megatron_empg.rollout.hf_engine:HfEngine",
        own_process=False,
        in_process_beside_training=True,
        updates_mid_generation=True,
        routes_on=("cpu", "cuda"),
    ),  # from the router logits
}
