"""``empg train`` whose engine core process is killed inside step 2's rollout (vLLM in its own
process): the engine is started again, given the weights it held (the consistency gate passes on
them), and the rollout drawn again from the same prompts with the same seeds, so that every step
equals the one-process reference run's (same tokens, same statistics) with no restart of the run."""

from __future__ import annotations

import re

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import LAUNCH_TIMEOUT_S, REPO, assert_same_steps, run_train, small_demo_config

STEPS = 4
KILL_IN_STEP_2 = '''
import os
import signal
import threading

import megatron_empg.rollout.vllm_engine as vllm_engine

_generate, _calls = vllm_engine.VllmEngine.generate, []


def generate(self, prompts, sampling, **kwargs):
    """The third call (the first sync's gate probe, step 1's rollout, then step 2's) loses its core
    0.3 s in, once."""
    _calls.append(1)
    if len(_calls) == 3:
        pid = self._core_processes()[0].pid
        threading.Timer(0.3, lambda: os.kill(pid, signal.SIGKILL)).start()
    return _generate(self, prompts, sampling, **kwargs)


vllm_engine.VllmEngine.generate = generate
'''


@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_an_engine_killed_mid_rollout_is_restarted_and_the_step_redrawn(tmp_path, warm_start, small_demo_reference):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_IN_STEP_2)
    done = run_train(
        small_demo_config(tmp_path, "killed", warm_start, STEPS),
        tmp_path,
        "killed",
        "rollout.in_process=false",
        "weight_sync.transport=shm_file",
        timeout=LAUNCH_TIMEOUT_S,
        env={"PYTHONPATH": f"{hook}:{REPO}"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # the core dies 0.3 s into the call: inside generate, or (a short call) found by the health
    # request before the next one
    failed = r"engine 0 failed inside the rollout of step 2: (generate|health request): the vLLM engine core process"
    assert re.search(failed, done.stderr), [line for line in done.stderr.splitlines() if "engine 0" in line]
    assert "engine 0: starting it again (1 of rollout.engine_restarts=2)" in done.stderr
    records = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["rollout/engine_restarts"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["sync/gate_max_logprob_diff"] < 1e-4 for r in records)
    assert_same_steps(records, small_demo_reference, same_tokens=True)
