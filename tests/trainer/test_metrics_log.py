"""MetricsLogger: the JSONL file, the progress bars, and Weights & Biases (a recording stand-in
for the calls, and the real package in offline mode for the files it writes)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from megatron_empg.config import RunConfig, from_dict
from megatron_empg.trainer.metrics_log import MetricsLogger, read_metrics


def _config(tmp_path, **logging) -> RunConfig:
    return from_dict(RunConfig, {"model": "tiny-qwen2", "tokenizer": "unused",
                                 "logging": {"dir": str(tmp_path / "run"), **logging}})  # fmt: skip


@pytest.mark.parametrize("progress", ["rich", "tqdm", "none"])
def test_jsonl_has_every_step_with_non_finite_values_as_null(tmp_path, progress):
    logger = MetricsLogger(_config(tmp_path, progress=progress), total_steps=3)
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": 0.25 * step, "actor/kl": float("nan") if step == 2 else 0.5})
    logger.close()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 0.25, "actor/kl": 0.5},
        {"step": 2, "reward/mean": 0.5, "actor/kl": None},
        {"step": 3, "reward/mean": 0.75, "actor/kl": 0.5},
    ]


def test_a_resumed_run_replaces_the_records_of_the_steps_it_redoes(tmp_path):
    config = _config(tmp_path, progress="none")
    first = MetricsLogger(config, total_steps=5)
    for step in (1, 2, 3, 4):  # checkpointed at 2, crashed after 4
        first.log(step, {"reward/mean": float(step)})
    first.close()
    resumed = MetricsLogger(config, total_steps=5)
    for step in (3, 4, 5):
        resumed.log(step, {"reward/mean": 10.0 * step})
    resumed.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    fresh = MetricsLogger(config, total_steps=1)  # a fresh run in the same directory starts over
    fresh.log(1, {"reward/mean": 0.5})
    fresh.close()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.5}]


def test_interval_and_disabled_ranks_write_nothing_else(tmp_path):
    logger = MetricsLogger(_config(tmp_path, progress="none", interval=2), total_steps=4)
    for step in range(1, 5):
        logger.log(step, {"reward/mean": float(step)})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [2, 4]
    other = MetricsLogger(_config(tmp_path / "other", progress="rich"), total_steps=4, enabled=False)
    other.log(2, {"reward/mean": 1.0})
    other.close()
    assert not (tmp_path / "other").exists()


def _unset_wandb_env(monkeypatch) -> None:
    """No key and no mode, restored afterwards (the logger sets WANDB_MODE itself)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.setenv(name, "")  # records the original value for the teardown
        monkeypatch.delenv(name)


def test_wandb_gets_the_config_and_finite_metrics_offline_without_a_key(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs, __import__("os").environ.get("WANDB_MODE")))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    _unset_wandb_env(monkeypatch)
    logger = MetricsLogger(_config(tmp_path, progress="none", wandb=True, wandb_run_name="r1"), total_steps=2)
    logger.log(1, {"reward/mean": 0.5, "actor/kl": float("inf")})
    logger.close()
    (_, kwargs, mode), log, finish = calls
    assert mode == "offline" and kwargs["name"] == "r1" and kwargs["project"] == "megatron-empg"
    assert kwargs["dir"] == str(tmp_path / "run") and kwargs["config"]["model"] == "tiny-qwen2"
    assert log == ("log", 1, {"reward/mean": 0.5}) and finish == ("finish",)


def test_real_wandb_writes_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    _unset_wandb_env(monkeypatch)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(_config(tmp_path, progress="none", wandb=True), total_steps=2)
    logger.log(1, {"reward/mean": 0.5})
    logger.log(2, {"reward/mean": 0.75})
    logger.close()
    [run_dir] = (tmp_path / "run" / "wandb").glob("offline-run-*")
    [records] = run_dir.glob("*.wandb")
    assert records.stat().st_size > 0
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["reward/mean"] == 0.75
