"""The tasks by name: the only list of them, and the lookups the trainer makes in it.

    source = build_prompt_source(config.data, tokenizer)   # the prompts of data.source
    reward_fn = REWARDS[config.data.reward]                # (the bind step checks the name)

``TASKS`` holds each task module's ``TASK``; ``REWARDS`` (every task's rewards by ``data.reward``
name) and ``PROMPT_SOURCES`` (prompt builders by ``data.source`` name) are filled from it by
``register``, which refuses a name that two tasks claim. The config layer imports no task, so
``config.DATA_SOURCES`` repeats the source names for its load-time check (a test keeps them equal).
"""

from __future__ import annotations

from typing import Any

from megatron_empg.config import DataConfig
from megatron_empg.rollout.data import PromptSource
from megatron_empg.rollout.rewards import RewardFn
from megatron_empg.tasks import arithmetic, math, search_qa
from megatron_empg.tasks.task import SourceBuilder, Task

TASKS: dict[str, Task] = {}
REWARDS: dict[str, RewardFn] = {}
PROMPT_SOURCES: dict[str, SourceBuilder] = {}


def register(task: Task) -> None:
    """Add ``task`` to ``TASKS``, its rewards to ``REWARDS`` and its source to ``PROMPT_SOURCES``.

    A ``ValueError`` if its name or a reward's is taken, or its source is built by another builder
    (the tasks of one source share its builder, as the file datasets' tasks do)."""
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is registered already")
    for name in task.rewards:
        if name in REWARDS:
            raise ValueError(f"task {task.name!r}: reward {name!r} is another task's")
    if PROMPT_SOURCES.get(task.source, task.build_source) is not task.build_source:
        raise ValueError(f"task {task.name!r}: source {task.source!r} has another builder")
    TASKS[task.name] = task
    REWARDS.update(task.rewards)
    PROMPT_SOURCES[task.source] = task.build_source


for _module in (arithmetic, math, search_qa):
    register(_module.TASK)


def build_prompt_source(config: DataConfig, tokenizer: Any) -> PromptSource:
    """The prompts ``config`` describes, from the builder of its ``source``: a
    ``rollout.data.PromptDataset`` of its files, or a task's own stream (``tasks.arithmetic``)."""
    return PROMPT_SOURCES[config.source](config, tokenizer)
