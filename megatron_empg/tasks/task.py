"""What a task module defines: ``TASK = Task(...)``, its prompts and its rewards in one value."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_empg.config import DataConfig
from megatron_empg.rollout.data import PromptSource, load_prompt_dataset
from megatron_empg.rollout.rewards import RewardFn

SourceBuilder = Callable[[DataConfig, Any], PromptSource]  # (data config, tokenizer) -> prompts


@dataclass(frozen=True)
class Task:
    """A task: where its prompts come from and how its responses are scored.

    ``name``: its key in ``tasks.registry.TASKS``. ``rewards``: its rewards by ``data.reward`` name.
    ``source``: the ``data.source`` its prompts come from, built by ``build_source(data config,
    tokenizer)``: by default ``files``, the datasets of ``rollout.data`` (which several tasks share).
    """

    name: str
    rewards: Mapping[str, RewardFn]
    source: str = "files"
    build_source: SourceBuilder = load_prompt_dataset
