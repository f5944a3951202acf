"""``trainer.engines.collect.Scorer``: the reward function's scores, then DAPO's overlong punishment
(``algorithm.overlong_buffer``) added to each sample's reward, and their metric sums."""

from __future__ import annotations

import pytest

from megatron_empg.config import RunConfig, load_config
from megatron_empg.rollout.rewards import RewardResult
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.engines.collect import Scorer
from tests.trainer.demo_runs import DEMO_RECIPE


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens):
        return [" ".join(map(str, row)) for row in ids]


def _scorer(*overrides: str) -> Scorer:
    """The scorer of the demo recipe with ``overrides``, a reward that is correct (+1, else -1) iff
    the response has an even length, and a tokenizer that prints ids."""
    config = load_config(RunConfig, DEMO_RECIPE, list(overrides))  # rollout.sampling.max_tokens 12
    reward = lambda texts, examples: RewardResult(  # noqa: E731
        [1.0 if len(t.split()) % 2 == 0 else -1.0 for t in texts],
        [len(t.split()) % 2 == 0 for t in texts],
        {"no_answer": 1.0},
    )
    return Scorer(config, _Tokenizer(), reward)


def _samples(lengths):
    return [Sample([1, 2], [7] * n, [0.0] * n, "length" if n == 12 else "stop", group=0) for n in lengths]


def test_overlong_penalty_adds_to_the_reward():
    samples = _samples([4, 8, 9, 10, 12])
    metrics = _scorer("algorithm.overlong_buffer=4", "algorithm.overlong_penalty=0.5")(samples)
    # past 12 - 4 = 8 tokens, -0.5 x (L - 8) / 4
    penalties = [0.0, 0.0, -0.125, -0.25, -0.5]
    base = [1.0, 1.0, -1.0, 1.0, 1.0]
    assert [s.reward for s in samples] == pytest.approx([b + p for b, p in zip(base, penalties)])
    assert [s.correct for s in samples] == [True, True, False, True, True]  # correctness is the reward's
    assert metrics == pytest.approx(
        {
            "reward/no_answer": 1.0,
            "reward/overlong_penalty": sum(penalties),
            "reward/errors": 0.0,
            "reward/timeouts": 0.0,
        }
    )


def test_no_buffer_no_penalty():
    samples = _samples([4, 12])
    metrics = _scorer()(samples)
    assert [s.reward for s in samples] == [1.0, 1.0] and metrics == {
        "reward/no_answer": 1.0,
        "reward/errors": 0.0,
        "reward/timeouts": 0.0,
    }


def _breaking_scorer() -> Scorer:
    """The demo's scorer with ``_scorer``'s reward, which raises on a response of 3 tokens."""

    def reward(texts, examples):
        if any(len(t.split()) == 3 for t in texts):
            raise RuntimeError("cannot parse this one")
        return RewardResult(
            [1.0 if len(t.split()) % 2 == 0 else -1.0 for t in texts],
            [len(t.split()) % 2 == 0 for t in texts],
            {"no_answer": 1.0},
        )

    return Scorer(load_config(RunConfig, DEMO_RECIPE, []), _Tokenizer(), reward)


def test_a_reward_raising_on_one_sample_scores_it_0_counts_it_and_logs_once_a_step(caplog):
    scorer = _breaking_scorer()
    samples = _samples([4, 3, 5])
    with caplog.at_level("WARNING", logger="megatron_empg.trainer.engines.collect"):
        metrics = scorer(samples)
        assert [s.reward for s in samples] == [1.0, 0.0, -1.0] and [s.correct for s in samples] == [True, False, False]
        # the two good samples were scored one at a time: their metrics add up
        assert metrics == {"reward/no_answer": 2.0, "reward/errors": 1.0, "reward/timeouts": 0.0}
        assert scorer(_samples([3, 3])) == {"reward/errors": 2.0, "reward/timeouts": 0.0}  # counted, not logged
        assert len(caplog.records) == 1
        assert "reward: sample 1 of 3 raised" in caplog.text and "RuntimeError: cannot parse this one" in caplog.text
        scorer.new_step()
        scorer(_samples([3]))
        assert len(caplog.records) == 2
