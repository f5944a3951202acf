"""Rewards (``megatron_empg.rollout.rewards``): math answer extraction and math-verify equivalence
in worker processes (with a timeout that a pathological expression hits), SQuAD/Search-R1 exact
match and F1 against hand-computed values, and the registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_empg.rollout import rewards
from megatron_empg.rollout.data import PromptExample
from megatron_empg.rollout.rewards import (
    REWARDS,
    MathReward,
    MathVerifierPool,
    exact_match,
    extract_math_answer,
    extract_tagged_answer,
    last_boxed,
    normalize_answer,
    overlong_penalty,
    qa_em_reward,
    qa_f1_reward,
    token_f1,
)

REPOSITORY = Path(__file__).resolve().parents[2]


def examples(*answers: str | list[str]) -> list[PromptExample]:
    return [PromptExample(prompt_ids=[2], answer=answer, meta={}) for answer in answers]


def test_the_registry_has_every_reward():
    assert sorted(REWARDS) == ["arithmetic", "math", "math_dapo", "qa_em", "qa_f1"]
    assert isinstance(REWARDS["math"], MathReward) and isinstance(REWARDS["math_dapo"], MathReward)


# --------------------------------------------------------------------------------------------
# Math: extraction.


@pytest.mark.parametrize(("text", "expected"), [
    ("so \\boxed{\\frac{1}{\\sqrt{2}}}.", "\\frac{1}{\\sqrt{2}}"),
    ("first \\boxed{1}, then \\boxed{{2}+{3}}", "{2}+{3}"),  # the last one, nested braces
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not count
    ("\\fbox{4}", "4"),
    ("$\\boxed 5$ done", "5"),
    ("\\boxed{\\frac{1}{2}", None),  # not closed (a truncated response)
    ("\\boxed{ }", None),
    ("\\boxedx", None),
    ("no box", None),
])  # fmt: skip
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(("response", "expected"), [
    ("\\boxed{4} #### 5", "4"),  # a box wins
    ("so #### 1,234", "1,234"),
    ("The final answer is: $\\frac{1}{2}$.", "\\frac{1}{2}"),
    ("the answer is 7\nand then 9", "7"),  # "the answer is" before the last number
    # DAPO's format: the last "Answer:" line, whole (the last number would be 2)
    ("Answer: 3\nso...\nAnswer: $\\frac{1}{2}$", "\\frac{1}{2}"),
    ("the answer is 5, so\nAnswer: 6", "6"),
    ("I got 3, then -2.5 in the end", "-2.5"),
    ("1/2 of 10 is 5", "5"),
    ("1,000,000 stars", "1000000"),
    ("<think>\\boxed{1}</think>The answer is 2", "2"),  # only what follows </think>
    ("<think>it is 3</think>", None),
    ("nothing here", None),
])  # fmt: skip
def test_extract_math_answer(response, expected):
    assert extract_math_answer(response) == expected


# --------------------------------------------------------------------------------------------
# Math: math-verify in worker processes.


@pytest.fixture(scope="module")
def math_reward():
    reward = MathReward(num_workers=2, timeout_s=60.0)  # generous: these cases take milliseconds
    yield reward
    reward.close()


MATH_CASES = [  # gold, response, correct
    ("0.5", "Thus \\boxed{\\frac{1}{2}}.", True),
    ("\\frac{1}{2}", "The answer is 0.5.", True),
    ("1/2", "so \\boxed{\\dfrac12}", True),
    ("$\\frac{\\sqrt{2}}{2}$", "\\boxed{\\sqrt{2}/2}", True),
    ("3", "#### 3.0", True),
    ("10000", "I count 10,000 apples", True),
    ("x=2", "\\boxed{2}", True),
    ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", True),
    ("\\frac{a+b}{2}", "\\boxed{\\frac{b+a}{2}}", True),
    ("90", "\\boxed{90^\\circ}", True),
    (["7", "seven"], "\\boxed{7.0}", True),  # any gold answer
    ("2", "\\boxed{3}", False),
    ("\\frac{1}{3}", "\\boxed{0.33}", False),
    ("1", "<think>\\boxed{1}</think> final: \\boxed{2}", False),
    ("2", "<think>\\boxed{1}</think> so \\boxed{2}", True),
    ("5", "no idea", False),
]


def test_math_reward_checks_equivalence_with_math_verify(math_reward):
    result = math_reward([c[1] for c in MATH_CASES], examples(*(c[0] for c in MATH_CASES)))
    assert result.correct == [c[2] for c in MATH_CASES]
    assert result.scores == [float(c[2]) for c in MATH_CASES]
    assert result.metrics == {"no_answer": 1.0, "timeouts": 0.0, "verify_errors": 0.0}


def test_math_dapo_scores_plus_or_minus_one():
    reward = MathReward(incorrect_score=-1.0)
    try:  # an exact match and no answer at all: neither needs a math-verify worker
        result = reward(["so \\boxed{42}", "no idea", "\\boxed{3}"], examples("42", "5", "3"))
    finally:
        reward.close()
    assert result.scores == [1.0, -1.0, 1.0] and result.correct == [True, False, True]


@pytest.mark.parametrize(("length", "expected"), [(100, 0.0), (3584, 0.0), (3840, -0.5), (4096, -1.0), (4224, -1.25)])
def test_overlong_penalty_is_dapos(length, expected):
    # DAPO's recipe: 4096 response tokens, a buffer of 512, factor 1: linear from 3584 to 4096
    assert overlong_penalty(length, max_length=4096, buffer=512, factor=1.0) == pytest.approx(expected)
    assert overlong_penalty(length, max_length=4096, buffer=512, factor=0.5) == pytest.approx(expected / 2)


def test_math_reward_checks_its_batch(math_reward):
    with pytest.raises(ValueError, match=r"reward: 1 responses for 2 examples"):
        math_reward(["\\boxed{1}"], examples("1", "2"))
    with pytest.raises(TypeError, match=r"responses\[0\] must be a str, got list"):
        math_reward([["1"]], examples("1"))


def test_a_pathological_expression_times_out_and_the_pool_goes_on():
    """9^(9^(9^9)) against 1: sympy would work on it for ever; the worker is killed at the timeout."""
    reward = MathReward(num_workers=1, timeout_s=1.0)
    try:
        assert reward(["\\boxed{0.5}"], examples("1/2")).correct == [True]  # workers started
        start = time.monotonic()
        result = reward(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{0.25}"], examples("1", "\\frac14"))
        elapsed = time.monotonic() - start
        assert result.correct == [False, True] and result.metrics["timeouts"] == 1.0
        assert elapsed < 60, elapsed  # bounded by the timeout plus a worker restart, not for ever
        assert reward(["\\boxed{2}"], examples("2.0")).correct == [True]  # the replacement works
    finally:
        reward.close()


def test_missing_math_verify_is_named(monkeypatch):
    monkeypatch.setattr(rewards.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"needs the math-verify package: pip install math-verify"):
        MathVerifierPool().check([(["1"], "1")])
    # the worker says so too, as its first line, where math_verify cannot be imported
    code = ("import sys, runpy; sys.modules['math_verify'] = None; "
            "runpy.run_module('megatron_empg.rollout.rewards', run_name='__main__')")  # fmt: skip
    worker = subprocess.run(
        [sys.executable, "-c", code], input="", capture_output=True, text=True, timeout=60, cwd=REPOSITORY,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
    )  # fmt: skip
    assert "needs the math-verify package (pip install math-verify)" in worker.stdout.splitlines()[0]


def test_pool_arguments_are_checked():
    with pytest.raises(ValueError, match=r"num_workers must be an int >= 1, got 0"):
        MathVerifierPool(num_workers=0)
    with pytest.raises(ValueError, match=r"timeout_s must be > 0, got 0"):
        MathVerifierPool(timeout_s=0)


# --------------------------------------------------------------------------------------------
# QA: exact match and F1.


def test_normalize_answer_is_squads():
    assert normalize_answer("The  Quick, brown FOX!") == "quick brown fox"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert normalize_answer("U.S.A.") == "usa"


def test_exact_match_and_f1_against_hand_computed_values():
    assert exact_match("the Eiffel Tower.", ["Eiffel tower"]) and not exact_match("Eiffel", ["Eiffel tower"])
    assert exact_match("Paris", ["London", "paris"])
    # "cat sat on mat" vs "cat sat on red mat": 4 common tokens, P = 4/4, R = 4/5, F1 = 8/9
    assert token_f1("the cat sat on mat", ["a cat sat on the red mat"]) == pytest.approx(8 / 9)
    # repeated tokens: "x x y" and "x y y" share one x and one y, P = R = 2/3
    assert token_f1("x x y", ["x y y"]) == pytest.approx(2 / 3)
    assert token_f1("red mat", ["blue car", "red car"]) == pytest.approx(0.5)  # the best gold
    assert token_f1("the", ["a"]) == 1.0 and token_f1("the", ["cat"]) == 0.0  # empty after normalization
    assert token_f1("dog", ["cat"]) == 0.0


def test_tagged_answer_is_the_last_one():
    assert extract_tagged_answer("<answer>a</answer> then <answer> b \n</answer>") == "b"
    assert extract_tagged_answer("<answer>\nmulti\nline</answer>") == "multi\nline"
    assert extract_tagged_answer("the answer is b") is None and extract_tagged_answer("<answer>b") is None


def test_qa_rewards_score_the_tagged_answer():
    responses = [
        "<search>q</search><answer>The Eiffel Tower</answer>",
        "<answer>eiffel</answer>",
        "Eiffel Tower",  # no tag: 0
        "<answer>Lyon</answer> <answer>paris</answer>",
    ]
    golds = examples(["Eiffel Tower"], ["Eiffel Tower", "tower of Eiffel"], "Eiffel Tower", ["Paris", "Lutetia"])
    em = qa_em_reward(responses, golds)
    assert em.scores == [1.0, 0.0, 0.0, 1.0] and em.correct == [True, False, False, True]
    # F1 of "eiffel": vs "eiffel tower" P=1 R=1/2 -> 2/3; vs "tower of eiffel" P=1 R=1/3 -> 1/2
    f1 = qa_f1_reward(responses, golds)
    assert f1.scores == pytest.approx([1.0, 2 / 3, 0.0, 1.0]) and f1.correct == em.correct
    assert em.metrics == f1.metrics == pytest.approx({"no_answer": 1.0, "exact_match": 2.0, "f1": 2 + 2 / 3})
