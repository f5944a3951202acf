"""What every reward shares (``megatron_empg.rollout.rewards``): the batch check, gold answers,
DAPO's overlong penalty, and a reward call that survives a bad sample (``score_guarded``). The
rewards themselves are tested with their tasks (``tests/tasks``).
"""

from __future__ import annotations

import pytest

from megatron_empg.rollout.data import PromptExample
from megatron_empg.rollout.rewards import RewardResult, check_batch, gold_answers, overlong_penalty, score_guarded


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


def _length_reward(texts, examples):
    """len(text) / 10, correct iff even; raises on the text "boom"; ``calls``: 1 per call."""
    if "boom" in texts:
        raise ZeroDivisionError("the checker broke on this sample")
    return RewardResult([len(t) / 10 for t in texts], [len(t) % 2 == 0 for t in texts], {"calls": 1.0})


def test_a_sample_whose_reward_raises_scores_0_and_the_others_are_unchanged():
    examples = [PromptExample(prompt_ids=[2], answer="1", meta={})] * 3
    alone = [_length_reward([t], examples[:1]) for t in ("ab", "abc")]
    result, error = score_guarded(_length_reward, ["ab", "boom", "abc"], examples)
    assert result.scores == [alone[0].scores[0], 0.0, alone[1].scores[0]] == [0.2, 0.0, 0.3]
    assert result.correct == [True, False, False]
    # each good sample was scored alone once: its metrics add up; the bad one counts as an error
    assert result.metrics == {"calls": 2.0, "errors": 1.0}
    assert error.startswith("reward: sample 1 of 3 raised:") and "ZeroDivisionError: the checker broke" in error


def test_a_good_batch_is_scored_once_and_counts_no_error():
    examples = [PromptExample(prompt_ids=[2], answer="1", meta={})] * 2
    result, error = score_guarded(_length_reward, ["ab", "abc"], examples)
    assert (result.scores, result.correct, result.metrics, error) == (
        [0.2, 0.3],
        [True, False],
        {"calls": 1.0, "errors": 0.0},
        None,
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_a_score_that_is_not_a_finite_number_is_an_error(bad):
    examples = [PromptExample(prompt_ids=[2], answer="1", meta={})] * 2
    reward = lambda texts, _: RewardResult([1.0, bad], [True, True])  # noqa: E731
    result, error = score_guarded(reward, ["a", "b"], examples)
    assert (result.scores, result.correct, result.metrics) == ([1.0, 0.0], [True, False], {"errors": 1.0})
    assert error == f"reward: sample 1 of 2 scored {bad!r}, not a finite number"


def test_a_sample_past_the_timeout_scores_0_and_the_others_are_scored():
    """A reward that hangs on one sample (in-process: not a WorkerReward): the batch call overruns,
    each sample is scored alone, the hanging one scores 0 and counts in ``timeouts``."""
    import threading

    from megatron_empg.rollout.rewards import RewardResult, score_guarded

    release = threading.Event()

    def reward(responses, examples):
        if "hang" in responses:
            release.wait(60)  # stands for a check that never ends
        return RewardResult([float(len(r)) for r in responses], [True] * len(responses), {"calls": 1.0})

    try:
        result, first = score_guarded(reward, ["ab", "hang", "abcd"], [None] * 3, timeout_s=0.3)
    finally:
        release.set()
    assert result.scores == [2.0, 0.0, 4.0] and result.correct == [True, False, True]
    assert result.metrics == {"calls": 2.0, "errors": 0.0, "timeouts": 1.0}
    assert first == "reward: sample 1 of 3 ran past 0.3 s (data.reward_timeout_s): scored 0"
    fine, first = score_guarded(reward, ["ab"], [None], timeout_s=5)
    assert fine.metrics == {"calls": 1.0, "errors": 0.0, "timeouts": 0.0} and first is None
