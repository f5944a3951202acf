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

from megatron_empg.config import RunConfig, load_config
from megatron_empg.rollout.data import PromptExample
from megatron_empg.rollout.rewards import RewardLimits
from megatron_empg.tasks import math_verifier
from megatron_empg.tasks.math import MathReward, extract_math_answer, last_boxed
from megatron_empg.tasks.math_verifier import MathVerifierPool
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.engines.collect import RolloutCollector, Scorer
from tests.trainer.demo_runs import DEMO_RECIPE

REPOSITORY = Path(__file__).resolve().parents[2]


def examples(*answers: str | list[str]) -> list[PromptExample]:
    return [PromptExample(prompt_ids=[2], answer=answer, meta={}) for answer in answers]


# --------------------------------------------------------------------------------------------
# Math: extraction.


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{\\sqrt{2}}}.", "\\frac{1}{\\sqrt{2}}"),
        ("first \\boxed{1}, then \\boxed{{2}+{3}}", "{2}+{3}"),  # the last one, nested braces
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not count
        ("\\fbox{4}", "4"),
        ("$\\boxed 5$ done", "5"),
        ("\\boxed{\\frac{1}{2}", None),  # not closed (a truncated response)
        ("\\boxed{ }", None),
        ("\\boxedx", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
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
    ],
)
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
    code = (
        "import sys, runpy; sys.modules['math_verify'] = None; "
        "runpy.run_module('megatron_empg.tasks.math_verifier', run_name='__main__')"
    )
    worker = subprocess.run(
        [sys.executable, "-c", code],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPOSITORY,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
    )
    assert "needs the math-verify package (pip install math-verify)" in worker.stdout.splitlines()[0]


def test_pool_arguments_are_checked():
    with pytest.raises(ValueError, match=r"num_workers must be an int >= 1, got 0"):
        MathVerifierPool(num_workers=0)
    with pytest.raises(ValueError, match=r"timeout_s must be > 0, got 0"):
        MathVerifierPool(timeout_s=0)


# --------------------------------------------------------------------------------------------
# The run's settings (data.reward_workers, reward_timeout_s) and its per-step budget (reward_budget_s).

ADVERSARIAL = "so \\boxed{9^{9^{9^{9}}}}"  # against 1: sympy works on it for ever, in C


class _Tokenizer:
    """Decodes a sample's one token id, an index into ``texts``."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def batch_decode(self, ids, skip_special_tokens):
        return [self.texts[row[0]] for row in ids]


def _run_config(*overrides: str) -> RunConfig:
    return load_config(
        RunConfig, DEMO_RECIPE, ["data.source=files", "data.reward=math", "data.train_files=[m.jsonl]", *overrides]
    )


def _samples(first: int, golds: list[str]) -> list[Sample]:
    """Samples whose responses are texts[first], texts[first + 1], ... answering ``golds``."""
    return [Sample([1], [first + i], [0.0], "stop", group=i, example=e) for i, e in enumerate(examples(*golds))]


def test_the_runs_worker_count_and_timeout_reach_the_pool():
    reward = MathReward()  # 2 workers, 5 s: the defaults the run's settings replace
    config = _run_config("data.reward_workers=3", "data.reward_timeout_s=1.0")
    scorer = Scorer(config, _Tokenizer([ADVERSARIAL, "\\boxed{0.5}"]), reward)
    samples = _samples(0, ["1", "1/2"])
    try:
        metrics = scorer(samples)
        assert (reward.pool.num_workers, reward.pool.timeout_s, len(reward.pool._workers)) == (3, 1.0, 3)
        assert [s.reward for s in samples] == [0.0, 1.0]
        assert metrics == {
            "reward/no_answer": 0.0,
            "reward/timeouts": 1.0,
            "reward/verify_errors": 0.0,
            "reward/errors": 0.0,
        }  # no budget
    finally:
        reward.close()


def test_a_budget_leaves_the_answers_not_checked_by_then_unscored_at_0():
    """math_dapo (-1 when wrong): 2 plain answers are checked, then 16 adversarial ones fill both
    workers until the 2 s budget ends the call (16 x 5 s / 2 = 40 s without it); they score 0."""
    reward = MathReward(incorrect_score=-1.0)
    limits = RewardLimits(workers=2, timeout_s=5.0)
    try:
        assert reward(["\\boxed{1}", "\\boxed{0.5}"], examples("1", "1/2"), limits).correct == [True, True]  # started
        start = time.monotonic()
        result = reward(
            ["\\boxed{0.5}", "\\boxed{3}", *[ADVERSARIAL] * 16],
            examples("1/2", "2", *["1"] * 16),
            RewardLimits(workers=2, timeout_s=5.0, deadline=time.monotonic() + 2.0),
        )
        elapsed = time.monotonic() - start
        assert result.scores == [1.0, -1.0, *[0.0] * 16] and result.correct == [True, False, *[False] * 16]
        assert result.metrics == {"no_answer": 0.0, "timeouts": 0.0, "verify_errors": 0.0, "unscored": 16.0}
        assert elapsed < 15, elapsed  # the budget and a margin, not 40 s
        assert reward(["\\boxed{2}"], examples("2.0"), limits).correct == [True]  # the killed workers' replacements
    finally:
        reward.close()


class _Stage:
    """A single engine's two replicas: replica 0 answers 4 adversarial answers, replica 1 two plain ones."""

    placement = type("Placement", (), {"num_engines": 1})()
    weights_version = 0

    def sample(self, index, prompts, dp_size):
        return [_samples(0, ["1"] * 4), _samples(4, ["1/2", "2.0"])], {"engines/count": 1.0}


class _Batches:
    cursor = 0

    def __next__(self):
        return []

    def state_dict(self):
        return {"cursor": self.cursor}


def test_the_budget_is_the_steps_over_all_of_its_scoring_calls():
    """Replica 0's adversarial answers take the step's whole 2 s budget: replica 1's plain answers,
    scored after them in the same step, are left unscored at once."""
    reward = MathReward()
    config = _run_config("data.reward_budget_s=2", "train.prompts_per_step=2")
    scorer = Scorer(config, _Tokenizer([ADVERSARIAL] * 4 + ["\\boxed{0.5}", "\\boxed{2}"]), reward)
    try:
        scorer(_samples(4, ["1/2"]))  # the workers started
        collector = RolloutCollector(config, _Stage(), _Batches(), scorer, dp_size=2)
        times: dict[str, float] = {}
        rollout = collector.collect(times)
        assert [sums["reward/unscored"] for sums in rollout.sums] == [4.0, 2.0]
        assert [s.reward for replica in rollout.replicas for s in replica] == [0.0] * 6
        assert 2.0 <= times["rewards"] < 15, times
    finally:
        reward.close()
