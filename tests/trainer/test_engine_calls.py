"""What the trainer asks of its rollout engine, in order, through ``empg train`` with a recording
engine (``tests/trainer/recording_engine.py``: transformers, no vLLM): the engine sleeps from the end
of each rollout to the weight sync, which wakes its weights, loads every tensor, then wakes its KV
cache before the consistency gate; nothing is generated or scored while it sleeps (the engine would
refuse). The first update of a warmup trains at a non-zero learning rate. One run trains with full
activation recompute (``train.recompute``)."""

from __future__ import annotations

import json
import subprocess

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import REPO, train_command
from tests.trainer.hf_runs import hf_engine_config, random_demo_model

pytestmark = [pytest.mark.megatron, pytest.mark.process]


def _calls(path) -> list[str]:
    """The recorded calls, runs of ``update_weights`` folded into one ``update_weights*``."""
    names = []
    for line in path.read_text().splitlines():
        method, arguments = json.loads(line)
        names.append(
            f"{method}({arguments['level']})"
            if method == "sleep"
            else f"{method}({','.join(arguments['tags'])})"
            if method == "wake_up"
            else method
        )
    folded = [name for i, name in enumerate(names) if not (name == "update_weights" and names[i - 1] == name)]
    return [f"{name}*" if name == "update_weights" else name for name in folded]


@pytest.mark.parametrize("sleep", [True, False])
def test_the_engine_sleeps_between_rollout_and_sync(tmp_path, sleep):
    config = hf_engine_config(tmp_path, "run", random_demo_model(tmp_path / "model"), steps=2)
    config["rollout"].update(engine="recording", sleep_while_training=sleep, sleep_level=2)
    config["train"]["recompute"] = "none" if sleep else "full"  # the same calls: recompute is the trainer's
    command, env = train_command(config, tmp_path, "run")
    command[1:3] = ["-m", "tests.trainer.recording_engine"]
    log = tmp_path / "calls.jsonl"
    out = subprocess.run(
        command, cwd=REPO, env={**env, "EMPG_ENGINE_LOG": str(log)}, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert ("activation recompute: recompute_granularity=full" in out.stderr) == (not sleep)
    sync = ["begin_weight_update", "update_weights*", "finish_weight_update"]
    gate = ["score", "generate"]  # the probe scored, then its continuation sampled
    if sleep:
        step = ["generate", "sleep(2)", "wake_up(weights)", *sync, "wake_up(kv_cache)", *gate]
    else:
        step = ["generate", *sync, *gate]
    assert _calls(log) == [*sync, *gate, *step, *step, "shutdown"]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # lr 1e-4 with a warmup of 10 updates, 2 updates per step: 1e-5 then 2e-5 in step 1 (the last is logged)
    assert [r["actor/lr"] for r in records] == pytest.approx([2e-5, 4e-5])
    assert all(r["sync/gate_max_logprob_diff"] <= 1e-3 for r in records)
