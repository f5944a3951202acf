"""``empg train`` with disaggregated engines (``rollout.placement: disaggregated``) on 3 gloo ranks
under torchrun: 2 training ranks and 1 engine rank.

- ``sync`` draws what colocated engines draw and trains to the same numbers on vLLM: the
  ``dp2-disaggregated`` layout of ``test_trainer_multirank.py``;
- ``one_step_off``: the samples of step s >= 2 were drawn by weights one step old (staleness 1,
  importance ratios pi_old / mu away from 1); pre-empted after step N, the checkpoint keeps the
  rollout already drawn for step N + 1 and the resumed run trains steps N + 1, N + 2 as the
  uninterrupted run did; no process outlives the pre-emption (the transformers engine);
- ``max_staleness`` 2 with training slowed (2 s a step) so the engine always runs ahead: step t
  trains samples drawn by the weights of step max(t - 2, 0), never older (checked per sample);
  pre-empted after step N, the checkpoint keeps the two rollouts drawn for steps N + 1 and N + 2,
  and the resumed run trains N + 1 .. N + 3 as the uninterrupted run did;
- with two engine ranks (2 + 2 processes), a weight push that engine 1 drops on purpose fails the
  consistency gate, naming engine 1 (step 1 ran on both engines, each sampling one replica).
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import (
    CLOSE_ABS,
    CLOSE_REL,
    REPO,
    interrupt,
    processes_with,
    run_train,
    small_demo_config,
    train_command,
)

LAUNCH_TIMEOUT_S = 420
DISAGGREGATED = ("rollout.placement=disaggregated", "rollout.engine_ranks=1")
HF = ("rollout.engine=hf", "rollout.in_process=true", "weight_sync.transport=in_process")
TRAINING = ("actor/loss", "actor/policy_loss", "actor/kl", "actor/grad_norm", "actor/entropy")


def _same_step(a: dict, b: dict) -> None:
    """Two runs' records of one step: the same samples, rewards and training statistics."""
    assert a["rollout/digest"] == b["rollout/digest"], (a["step"], "different samples")
    for key in ("reward/mean", "reward/accuracy", "response/length_mean"):
        assert a[key] == b[key], key
    for key in TRAINING:
        assert a[key] == pytest.approx(b[key], rel=CLOSE_REL, abs=CLOSE_ABS), key


def _one_step_off(tmp_path, warm_start, name: str, steps: int) -> dict:
    config = small_demo_config(tmp_path, name, warm_start, steps)
    config["checkpoint"]["interval"] = 0  # at the end or on a signal
    return config


def _preempt_after_two_steps(config: dict, tmp_path, extra: tuple[str, ...], env: dict[str, str]) -> int:
    """Run ``config`` as ``cut`` (3 processes), SIGTERM the launcher once two steps are logged;
    the step every rank checkpointed at and stopped after."""
    command, env_cut = train_command(config, tmp_path, "cut", *extra, nproc=3, env=env)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    log = tmp_path / "cut.log"
    with log.open("w") as out:
        launcher = subprocess.Popen(command, cwd=REPO, env=env_cut, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + LAUNCH_TIMEOUT_S
            while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
                assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=LAUNCH_TIMEOUT_S)
        finally:
            interrupt(launcher)
    stops = re.findall(r"signal \d+: checkpointed at step (\d+)", log.read_text())
    assert stops, log.read_text()[-4000:]
    return int(stops[0])


def _resume(
    config: dict, tmp_path, extra: tuple[str, ...], env: dict[str, str], stopped: int, *, more: int
) -> list[dict]:
    """Resume the pre-empted ``cut`` run for ``more`` steps after step ``stopped``; its metrics
    (every step logged once, no process left)."""
    config["train"]["steps"] = stopped + more
    done = run_train(config, tmp_path, "cut", *extra, "--resume", nproc=3, timeout=LAUNCH_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert processes_with(f"EMPG_TEST_RUN={tmp_path.name}") == []
    resumed = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, stopped + more + 1))
    return resumed


ONE_STEP_OFF = (*DISAGGREGATED, "rollout.max_staleness=1", "algorithm.behavior_is=tis", *HF)

DRAWN_AHEAD = '''
import os
import time

if os.environ.get("RANK") == "0":  # training rank 0: the engines' messages arrive in its inbox
    import megatron_empg.trainer.loop as loop

    _update = loop.Trainer.update

    def update(self, minis):
        """Step s trains only once the engines have drawn every step they may draw ahead of it
        (s + 1 .. s + k, not past the run): if they waited for this step's weights instead, it
        never trains (the test fails at the deadline)."""
        engines, step = self.engines, self.step_index + 1
        want = min(engines.staleness, self.config.train.steps - step)
        deadline = time.monotonic() + 300
        while len(engines.ready) + sum(getattr(m, "rollout", None) is not None
                                       for m in list(engines.remote.inbox.messages.queue)) < want:
            assert time.monotonic() < deadline, f"step {step} trained before the engines drew {want} ahead"
            time.sleep(0.05)
        return _update(self, minis)

    loop.Trainer.update = update
'''


def _hook_env(tmp_path, sitecustomize: str) -> dict[str, str]:
    """The environment of a run whose every process imports ``sitecustomize`` (a test's hook) at
    start-up, marked for ``processes_with``."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(sitecustomize)
    return {"PYTHONPATH": f"{hook}:{REPO}", "EMPG_TEST_RUN": tmp_path.name}


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
def test_one_step_off_is_stale_by_one_and_resumes_its_pipeline(tmp_path, warm_start):
    reference_steps = 8  # room for the signal to land a few steps late on a loaded machine
    env = _hook_env(tmp_path, DRAWN_AHEAD)  # step s trains once step s + 1 is drawn
    full = run_train(
        _one_step_off(tmp_path, warm_start, "full", reference_steps),
        tmp_path,
        "full",
        *ONE_STEP_OFF,
        nproc=3,
        timeout=LAUNCH_TIMEOUT_S,
        env=env,
    )
    assert full.returncode == 0, full.stderr[-4000:]
    reference = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [r["rollout/staleness_max"] for r in reference] == [0.0] + [1.0] * (reference_steps - 1)
    assert reference[0]["rollout/is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the initial weights drew step 1
    # the policy moved since: mean |log pi_old - log mu| far above step 1's numerics (3.5e-7 on 2
    # CPU cores; 2e-3 to 1e-2 after). Not the ratios' mean: above and below 1 cancel in it
    # (1 + 9e-6 at step 2 of that run).
    assert reference[0]["batch/sampler_logprob_gap"] < 1e-5
    assert all(r["batch/sampler_logprob_gap"] > 1e-4 for r in reference[1:])

    # pre-empted once two steps are logged: every rank, the engine rank too, stops after step N
    config = _one_step_off(tmp_path, warm_start, "cut", 1000)
    marker = f"EMPG_TEST_RUN={tmp_path.name}"
    stopped = _preempt_after_two_steps(config, tmp_path, ONE_STEP_OFF, env)
    assert stopped + 2 <= reference_steps, stopped
    assert processes_with(marker) == [], "a rank or engine process outlived the pre-empted run"

    resumed = _resume(config, tmp_path, ONE_STEP_OFF, env, stopped, more=2)
    for step in (stopped + 1, stopped + 2):  # the restored rollout, then one drawn after the resume
        _same_step(resumed[step - 1], reference[step - 1])
        assert resumed[step - 1]["rollout/staleness_max"] == 1.0


TWO_AHEAD = (*DISAGGREGATED, "rollout.max_staleness=2", "algorithm.behavior_is=tis", *HF)


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
def test_two_steps_ahead_draws_two_versions_back_and_resumes_its_queue(tmp_path, warm_start):
    env = _hook_env(tmp_path, DRAWN_AHEAD)
    marker = f"EMPG_TEST_RUN={tmp_path.name}"
    steps = 9  # room for the signal to land a few steps late on a loaded machine
    full = run_train(
        _one_step_off(tmp_path, warm_start, "full", steps),
        tmp_path,
        "full",
        *TWO_AHEAD,
        nproc=3,
        timeout=LAUNCH_TIMEOUT_S,
        env=env,
    )
    assert full.returncode == 0, full.stderr[-4000:]
    reference = read_metrics(tmp_path / "full" / "metrics.jsonl")
    # every sample of step t drawn by the weights of step max(t - 3, 0): steps t + 1 and t + 2 were
    # drawn while step t trained (the hook), with the newest weights pushed by then
    assert [r["rollout/staleness_max"] for r in reference] == [0.0, 1.0] + [2.0] * (steps - 2)
    assert [r["rollout/staleness_mean"] for r in reference] == [0.0, 1.0] + [2.0] * (steps - 2)
    assert all(r["sync/gate_max_logprob_diff"] < 1e-4 for r in reference)

    # pre-empted once two steps are logged
    config = _one_step_off(tmp_path, warm_start, "cut", 1000)
    stopped = _preempt_after_two_steps(config, tmp_path, TWO_AHEAD, env)
    assert stopped + 3 <= steps, stopped
    assert processes_with(marker) == [], "a rank or engine process outlived the pre-empted run"

    resumed = _resume(config, tmp_path, TWO_AHEAD, env, stopped, more=3)
    for step in (stopped + 1, stopped + 2, stopped + 3):  # the two restored rollouts, then one drawn after
        _same_step(resumed[step - 1], reference[step - 1])
        assert resumed[step - 1]["rollout/staleness_max"] == reference[step - 1]["rollout/staleness_max"]


PARTIAL_HANDSHAKE = """
import os
import time
from pathlib import Path

SIGNALS = Path(os.environ["EMPG_TEST_SIGNALS"])
SWITCH = int(os.environ.get("EMPG_TEST_SWITCH", "3"))  # the decode step (engine step) the weights change at
DEADLINE_S = 300


def wait_for(condition, what):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


if os.environ.get("RANK") == "2":  # the engine rank: each rollout t >= 2 gets step t - 1's weights at decode step SWITCH
    import megatron_empg.trainer.engines.engine_rank as engine_rank

    EngineRank = engine_rank.EngineRank
    _serve_ahead, _draw, _load = EngineRank._serve_ahead, EngineRank.draw, EngineRank._load_between_decode_steps

    def serve_ahead(self, start):
        self.rollout_step = start.step + start.pending + 1  # the step of the next rollout drawn
        return _serve_ahead(self, start)

    def draw(self):
        self.decode_step, self.started_from = 0, self.stage.weights_version
        try:
            return _draw(self)
        finally:
            self.rollout_step += 1

    def load(self):
        self.decode_step += 1
        if self.decode_step == 1:  # tells the trainer it may push: this rollout has begun with older weights
            (SIGNALS / f"drawing-{self.rollout_step}").touch()
        if self.decode_step == SWITCH and self.rollout_step >= 2:
            stage = self.listener.stage
            llm = getattr(self.stage.engine, "_llm", None)
            if llm is not None:  # vLLM's engine core steps on its own: held (requests kept) until the weights come
                llm.sleep(level=0, mode="keep")
            wait_for(lambda: stage.newest > self.started_from or self.listener.pending(),
                     f"no weights pushed while rollout {self.rollout_step} was drawn")
        return _load(self)

    EngineRank._serve_ahead, EngineRank.draw, EngineRank._load_between_decode_steps = serve_ahead, draw, load

if os.environ.get("RANK") == "0":  # training rank 0: step s's weights go out once rollout s + 1 has begun
    import megatron_empg.trainer.engines.placements as engines

    _push = engines.DisaggregatedEngines.push

    def push(self, shards, groups, step):
        if 0 < step < self.config.train.steps:  # (step 0's weights draw rollout 1)
            wait_for((SIGNALS / f"drawing-{step + 1}").exists, f"rollout {step + 1} never began")
        return _push(self, shards, groups, step)

    engines.DisaggregatedEngines.push = push
"""
PARTIAL = (*DISAGGREGATED, "rollout.max_staleness=1", "rollout.partial=true", "algorithm.behavior_is=tis", *HF)


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
def test_partial_rollouts_take_the_next_weights_mid_response_and_resume(tmp_path, warm_start):
    hooked = _hook_env(tmp_path, PARTIAL_HANDSHAKE)
    marker = f"EMPG_TEST_RUN={tmp_path.name}"

    def env(name: str) -> dict[str, str]:
        signals = tmp_path / f"signals_{name}"
        signals.mkdir(exist_ok=True)
        return {**hooked, "EMPG_TEST_SIGNALS": str(signals)}

    steps = 8  # room for the signal to land a few steps late on a loaded machine
    full = run_train(
        _one_step_off(tmp_path, warm_start, "full", steps),
        tmp_path,
        "full",
        *PARTIAL,
        nproc=3,
        timeout=LAUNCH_TIMEOUT_S,
        env=env("full"),
    )
    assert full.returncode == 0, full.stderr[-4000:]
    reference = read_metrics(tmp_path / "full" / "metrics.jsonl")
    # rollout t >= 2 began with step t - 2's weights (its first tokens one step stale) and took step
    # t - 1's at decode step 3: responses still running then span both versions
    assert [r["rollout/staleness_max"] for r in reference] == [0.0] + [1.0] * (steps - 1)
    assert [r["rollout/versions_per_sample_max"] for r in reference] == [1.0] + [2.0] * (steps - 1)
    assert reference[0]["rollout/partial_fraction"] == 0.0
    assert all(r["rollout/partial_fraction"] > 0.5 for r in reference[1:])
    assert all(0.0 < r["rollout/staleness_token_mean"] < 1.0 for r in reference[1:])  # 3 old tokens, the rest new
    assert all(r["sync/gate_max_logprob_diff"] < 1e-4 for r in reference)  # each loaded version probed

    # pre-empted once two steps are logged; the rollout in flight at the checkpoint is drawn again
    config = _one_step_off(tmp_path, warm_start, "cut", 1000)
    stopped = _preempt_after_two_steps(config, tmp_path, PARTIAL, env("cut"))
    assert stopped + 2 <= steps, stopped
    assert processes_with(marker) == [], "a rank or engine process outlived the pre-empted run"

    resumed = _resume(config, tmp_path, PARTIAL, env("cut"), stopped, more=2)
    for step in (stopped + 1, stopped + 2):  # the restored rollout, then one drawn (and updated) after the resume
        _same_step(resumed[step - 1], reference[step - 1])
        for key in ("rollout/staleness_token_mean", "rollout/partial_fraction", "rollout/versions_per_sample_max"):
            assert resumed[step - 1][key] == reference[step - 1][key], key


@pytest.mark.dist
@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_partial_rollouts_on_vllm_engine_processes(tmp_path, warm_start):
    """The same handshake with vLLM in its own process on the engine rank (the launcher's CPU
    defaults: ``rollout.in_process=false``, weights through ``shm_file``), held at its first
    engine step after the prefill until the weights come."""
    signals = tmp_path / "signals"
    signals.mkdir()
    env = {**_hook_env(tmp_path, PARTIAL_HANDSHAKE), "EMPG_TEST_SIGNALS": str(signals), "EMPG_TEST_SWITCH": "1"}
    steps = 4
    config = _one_step_off(tmp_path, warm_start, "vllm", steps)
    partial = (*DISAGGREGATED, "rollout.max_staleness=1", "rollout.partial=true", "algorithm.behavior_is=tis")
    done = run_train(config, tmp_path, "vllm", *partial, nproc=3, timeout=LAUNCH_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert processes_with(f"EMPG_TEST_RUN={tmp_path.name}") == []
    records = read_metrics(tmp_path / "vllm" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # rollout t >= 2 began with step t - 2's weights and took step t - 1's after its first token
    assert [r["rollout/staleness_max"] for r in records] == [0.0] + [1.0] * (steps - 1)
    assert [r["rollout/versions_per_sample_max"] for r in records] == [1.0] + [2.0] * (steps - 1)
    assert all(r["rollout/partial_fraction"] > 0.5 for r in records[1:])
    assert all(0.0 < r["rollout/staleness_token_mean"] < 1.0 for r in records[1:])
    # every version the engine loaded mid-rollout was probed against the trainer's log-probs
    assert all(r["sync/gate_max_logprob_diff"] < 1e-4 for r in records)


DROP_SECOND_PUSH = '''
import os

import megatron_empg.weight_sync.transport as transport

_receive, _calls = transport.receive_weights, []


def receive_weights(link, local):
    """Engine 1 (global rank 3) drains the second push from the link but loads none of it."""
    _calls.append(os.environ["RANK"] == "3")

    class Dropped:
        def begin(self): local.begin()
        def send(self, bucket): pass
        def finish(self, version): local.finish(version)

    return _receive(link, Dropped() if len(_calls) == 2 and _calls[-1] else local)


transport.receive_weights = receive_weights
'''


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_a_push_dropped_by_one_of_two_engines_fails_the_gate_naming_it(tmp_path, warm_start):
    config = small_demo_config(tmp_path, "dropped", warm_start, 3)
    marker = f"EMPG_TEST_RUN={tmp_path.name}"
    done = run_train(
        config,
        tmp_path,
        "dropped",
        "rollout.placement=disaggregated",
        "rollout.engine_ranks=2",
        *HF,
        nproc=4,
        timeout=LAUNCH_TIMEOUT_S,
        env=_hook_env(tmp_path, DROP_SECOND_PUSH),
    )
    assert done.returncode != 0
    assert "weight sync step-1: engine 1 and trainer log-probs differ" in done.stderr, done.stderr[-4000:]
    assert processes_with(marker) == [], "the engine rank outlived the failed run"
    assert not (tmp_path / "dropped" / "metrics.jsonl").exists() or not read_metrics(
        tmp_path / "dropped" / "metrics.jsonl"
    )  # step 1 never completed
