"""The math task (``megatron_empg.tasks.math``): answer extraction, and math-verify equivalence in
worker processes (``tasks.math_verifier``, with a timeout that a pathological expression hits).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_empg.rollout.data import PromptExample
from megatron_empg.tasks import math_verifier
from megatron_empg.tasks.math import MathReward, extract_math_answer, last_boxed
from megatron_empg.tasks.math_verifier import MathVerifierPool

REPOSITORY = Path(__file__).resolve().parents[2]


def examples(*answers: str | list[str]) -> list[PromptExample]:
    return [PromptExample(prompt_ids=[2], answer=answer, meta={}) for answer in answers]


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
    monkeypatch.setattr(math_verifier.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"needs the math-verify package: pip install math-verify"):
        MathVerifierPool().check([(["1"], "1")])
    # the worker says so too, as its first line, where math_verify cannot be imported
    code = ("import sys, runpy; sys.modules['math_verify'] = None; "
            "runpy.run_module('megatron_empg.tasks.math_verifier', run_name='__main__')")  # fmt: skip
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
