"""What every reward shares (``megatron_empg.rollout.rewards``): the batch check, gold answers, and
DAPO's overlong penalty. The rewards themselves are tested with their tasks (``tests/tasks``).
"""

from __future__ import annotations

import pytest

from megatron_empg.rollout.data import PromptExample
from megatron_empg.rollout.rewards import check_batch, gold_answers, overlong_penalty


def test_a_batch_is_one_str_response_per_example():
    examples = [PromptExample(prompt_ids=[2], answer="1", meta={})] * 2
    check_batch(["a", "b"], examples)
    with pytest.raises(ValueError, match=r"reward: 1 responses for 2 examples; expected one each"):
        check_batch(["a"], examples)
    with pytest.raises(TypeError, match=r"responses\[1\] must be a str, got int"):
        check_batch(["a", 2], examples)


def test_gold_answers_are_a_list():
    assert gold_answers("7") == ["7"] and gold_answers(["7", "seven"]) == ["7", "seven"]


@pytest.mark.parametrize(("length", "expected"), [(100, 0.0), (3584, 0.0), (3840, -0.5), (4096, -1.0), (4224, -1.25)])
def test_overlong_penalty_is_dapos(length, expected):
    # DAPO's recipe: 4096 response tokens, a buffer of 512, factor 1: linear from 3584 to 4096
    assert overlong_penalty(length, max_length=4096, buffer=512, factor=1.0) == pytest.approx(expected)
    assert overlong_penalty(length, max_length=4096, buffer=512, factor=0.5) == pytest.approx(expected / 2)
