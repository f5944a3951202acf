"""The task registry (``megatron_empg.tasks.registry``): the only list of tasks, the reward and
prompt-source names derived from it, and a new task added as one module's ``TASK``."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pytest

from megatron_empg.config import DataConfig
from megatron_empg.config import run as config_module  # DATA_SOURCES: its data.source Literal
from megatron_empg.rollout.data import PromptBatches, PromptDataset, PromptExample, load_prompt_dataset
from megatron_empg.rollout.rewards import RewardResult
from megatron_empg.tasks import arithmetic, math, search_qa
from megatron_empg.tasks.arithmetic import ArithmeticTask
from megatron_empg.tasks.math import MathReward
from megatron_empg.tasks.registry import PROMPT_SOURCES, REWARDS, TASKS, build_prompt_source, register
from megatron_empg.tasks.task import Task
from tests.rollout.test_data import GOOD, files_config, plain_tokenizer, write_jsonl


def test_the_registry_has_every_task_and_reward():
    assert TASKS == {"arithmetic": arithmetic.TASK, "math": math.TASK, "search_qa": search_qa.TASK}
    assert sorted(REWARDS) == ["arithmetic", "math", "math_dapo", "qa_em", "qa_f1"]
    assert isinstance(REWARDS["math"], MathReward) and isinstance(REWARDS["math_dapo"], MathReward)
    assert REWARDS["math_dapo"].incorrect_score == -1.0 and REWARDS["qa_f1"] is search_qa.qa_f1_reward


def test_reward_and_source_names_come_from_the_task_modules():
    assert REWARDS == {name: fn for task in TASKS.values() for name, fn in task.rewards.items()}
    assert PROMPT_SOURCES == {task.source: task.build_source for task in TASKS.values()}
    # the config layer imports no task: its load-time list of data.source names must agree
    assert sorted(config_module.DATA_SOURCES) == sorted(PROMPT_SOURCES)


def test_the_bind_step_looks_rewards_up_in_the_registry():
    from megatron_empg.trainer.bind import build

    assert build.REWARDS is REWARDS


def test_build_prompt_source_reads_files_or_makes_the_arithmetic_task(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD])
    assert isinstance(build_prompt_source(files_config(path), plain_tokenizer()), PromptDataset)
    assert isinstance(build_prompt_source(DataConfig(), plain_tokenizer()), ArithmeticTask)


# --------------------------------------------------------------------------------------------
# A new task is one module: its TASK, registered.


class CountingSource:
    """Prompt ``i`` is the token ids ``[i]``, its answer ``str(i)``."""

    def __init__(self, config: DataConfig, tokenizer: Any) -> None:
        self.seed = config.seed

    def example(self, index: int) -> PromptExample:
        return PromptExample(prompt_ids=[index], answer=str(index), meta={"index": index})

    def batch_indices(self, step: int, batch_size: int) -> list[int]:
        return list(range(step * batch_size, (step + 1) * batch_size))

    def fingerprint(self) -> dict[str, Any]:
        return {"source": "counting", "seed": self.seed}


def echo_reward(responses: list[str], examples: list[PromptExample]) -> RewardResult:
    correct = [response == example.answer for response, example in zip(responses, examples)]
    return RewardResult(scores=[float(c) for c in correct], correct=correct)


TOY = Task("counting", rewards={"echo": echo_reward}, source="counting", build_source=CountingSource)


@dataclasses.dataclass(frozen=True)
class ToyDataConfig(DataConfig):
    """``DataConfig`` with the toy's source among its ``data.source`` names (the ``Literal`` that a
    real task's source is added to)."""

    source: Literal["files", "arithmetic", "counting"] = "arithmetic"


@pytest.fixture
def restored_registry():
    """The registry as it was, after the test (a toy task must not leak into other tests)."""
    saved = [(table, dict(table)) for table in (TASKS, REWARDS, PROMPT_SOURCES)]
    yield
    for table, entries in saved:  # in place: the trainer holds these very dicts
        table.clear()
        table.update(entries)


def test_a_registered_task_is_found_by_source_and_reward(restored_registry):
    register(TOY)
    assert TASKS["counting"] is TOY and REWARDS["echo"] is echo_reward
    config = ToyDataConfig(source="counting", reward="echo", seed=3)
    source = build_prompt_source(config, tokenizer=None)
    examples = next(PromptBatches(source, batch_size=4))
    assert [e.answer for e in examples] == ["0", "1", "2", "3"]
    assert REWARDS[config.reward](["0", "2", "2", "x"], examples).correct == [True, False, True, False]


def test_the_toy_task_is_gone_after_its_test():
    assert "counting" not in TASKS and "echo" not in REWARDS and "counting" not in PROMPT_SOURCES


def test_a_name_two_tasks_claim_is_refused(restored_registry):
    with pytest.raises(ValueError, match=r"task 'math' is registered already"):
        register(math.TASK)
    with pytest.raises(ValueError, match=r"task 'math2': reward 'math' is another task's"):
        register(dataclasses.replace(math.TASK, name="math2"))
    with pytest.raises(ValueError, match=r"task 'counting2': source 'arithmetic' has another builder"):
        register(dataclasses.replace(TOY, name="counting2", rewards={}, source="arithmetic"))
    # the tasks of one source share its builder: math and search_qa both read files
    register(dataclasses.replace(TOY, name="files2", rewards={}, source="files", build_source=load_prompt_dataset))
    assert PROMPT_SOURCES["files"] is load_prompt_dataset
