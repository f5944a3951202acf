"""The RL loop on two gloo ranks (``launchers/torchrun.sh``, NPROC_PER_NODE=2) at TP2, PP2 and DP2,
against the same run in one process.

Three steps of the demo recipe (EMA-PG, reverse Top-k KL) from a short warm start, 4 prompts x 4
samples per step. The vLLM engines run in their own processes (the launcher's CPU defaults:
``rollout.in_process=false``, ``weight_sync.transport=shm_file``): at DP2 two of them
(``rollout.engines=2``, one per replica, each synced from its own rank and each sampling its
replica's 2 prompts) or one on a third rank of its own for both (``rollout.placement=disaggregated``,
weights over the link); at TP2 and PP2 one (a single replica). (One colocated engine for two
replicas, ``rollout.engines=single``, trains in ``test_packing_e2e.py``'s balancing test.)
The reference is one process with an in-process engine fed by reference, so the runs share no
transport code. Seeds follow the global prompt index and the weights are equal up to fp32
rounding, so the rollouts are identical (the same ``rollout/digest`` of their tokens) and the
per-step metrics must agree: the rollout statistics exactly, the training statistics to fp32 rounding. Also checked: one metrics record per
step (rank 0 writes them), the consistency gate after every sync on every engine (each serves the
weights gathered from both TP shards or both pipeline stages: same byte count as the single
process), the engines' sample counts, and checkpoints recording the layout. At DP2 with two
engines the run is pre-empted instead: SIGTERM to the launcher after two steps reaches every rank
(as SIGUSR1: the engines' processes ignore it), all ranks stop after the same step and checkpoint
it, no engine process and no weight file outlives the run, and ``--resume`` continues with the
next step, which must match the reference too.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest

from megatron_empg.mcore.checkpoint import read_checkpoint_info
from megatron_empg.trainer.metrics_log import read_metrics
from tests.dist import run_distributed
from tests.trainer.demo_runs import (CLOSE_ABS, CLOSE_REL, LAUNCH_TIMEOUT_S, REPO, interrupt, processes_with,
                                     run_train, small_demo_config, train_command)  # fmt: skip

STEPS = 3
REFERENCE_STEPS = 6  # enough for the pre-empted run (stopped after step 2 or 3) and its resumed step
# Functions of the rollouts and the schedule only: equal when the samples are.
EXACT = ("reward/mean", "reward/std", "reward/accuracy", "reward/malformed", "response/length_mean",
         "response/truncated_fraction", "actor/lr", "anchor/updates", "sync/gbytes")  # fmt: skip
# Sums over tokens of fp32 log-prob arithmetic whose reduction order depends on the layout: to
# CLOSE_REL, CLOSE_ABS (demo_runs.py).
CLOSE = ("actor/loss", "actor/policy_loss", "actor/kl", "actor/entropy", "actor/grad_norm", "actor/ratio")
GATE_TOLERANCE = 1e-4  # the recipe's weight_sync.gate_tolerance (fp32)

LAYOUTS = {  # command-line overrides, the layout the checkpoints must record, and the engines
    "tp2": (["parallel.tensor_model_parallel_size=2"], {"tp": 2, "pp": 1, "dp": 1}, 1),
    "pp2": (["parallel.pipeline_model_parallel_size=2"], {"tp": 1, "pp": 2, "dp": 1}, 1),
    "dp2-engines2": (["rollout.engines=2"], {"tp": 1, "pp": 1, "dp": 2}, 2),
    # two training ranks and an engine rank of its own (3 processes): the engine draws for both
    "dp2-disaggregated": (["rollout.placement=disaggregated", "rollout.engine_ranks=1"], {"tp": 1, "pp": 1, "dp": 2}, 1),
}
PREEMPTED = "dp2-engines2"  # SIGTERM after step 2, then --resume (one layout: each launch costs ~40 s)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, warm_start) -> list[dict]:
    """The per-step metrics of the run in one process (in-process engine), ``REFERENCE_STEPS`` steps."""
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("single")
    config = small_demo_config(tmp, "single", warm_start, REFERENCE_STEPS)
    done = run_train(config, tmp, "single", timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = read_metrics(tmp / "single" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, REFERENCE_STEPS + 1))
    # What is compared is not trivial: some samples are rewarded, the policy moves (lr > 0 from
    # step 2) and is pulled back by a non-zero KL at step 3.
    first = metrics[:STEPS]
    assert any(m["reward/mean"] > 0 for m in first) and any(abs(m["actor/policy_loss"]) > 1e-3 for m in first)
    assert first[-1]["actor/lr"] > 0 and abs(first[-1]["actor/kl"]) > 1e-5
    return metrics


def _preempt_then_resume(tmp_path, warm_start, overrides) -> int:
    """A long run on 2 ranks, SIGTERM to the launcher once two steps are logged: every rank stops
    after the same step N, which is checkpointed (the engine, on rank 0, survives the signal to
    finish the step); then ``--resume`` for step N + 1. Returns N + 1, the steps run in all."""
    config = small_demo_config(tmp_path, PREEMPTED, warm_start, 1000)
    config["checkpoint"]["interval"] = 0  # checkpoints only at the end or on a signal
    shm = tmp_path / "shm"  # the engines' bucket files
    shm.mkdir()
    config["weight_sync"]["shm_dir"] = str(shm)
    marker = f"EMPG_TEST_RUN={tmp_path.name}"  # every process of the run inherits it
    command, env = train_command(config, tmp_path, "long", *overrides, nproc=2, env=dict([marker.split("=")]))
    metrics = tmp_path / PREEMPTED / "metrics.jsonl"
    log = tmp_path / "long.log"
    with log.open("w") as out:
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + LAUNCH_TIMEOUT_S
            while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # whole records only
                assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=LAUNCH_TIMEOUT_S)  # its exit status is torchrun's: non-zero after a signal
        finally:
            interrupt(launcher)
    stop = (rf"\[rank (\d)\] WARNING megatron_empg\.trainer\.loop: signal {signal.SIGUSR1.value}: "
            r"checkpointed at step (\d+)")
    stops = re.findall(stop, log.read_text())
    assert sorted(rank for rank, _ in stops) == ["0", "1"] and stops[0][1] == stops[1][1], log.read_text()[-4000:]
    stopped = int(stops[0][1])
    assert len(read_metrics(metrics)) == stopped and stopped + 1 <= REFERENCE_STEPS
    assert processes_with(marker) == [], "engine or rank processes outlived the pre-empted run"
    assert list(shm.iterdir()) == []
    root = tmp_path / PREEMPTED / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{stopped:08d}"]

    config["train"]["steps"] = stopped + 1
    done = run_train(config, tmp_path, "resume", *overrides, "--resume", nproc=2, timeout=LAUNCH_TIMEOUT_S,
                     env=dict([marker.split("=")]))  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert processes_with(marker) == [] and list(shm.iterdir()) == []
    resumed = [line for line in done.stderr.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and resumed[0].endswith(f"step_{stopped:08d} at step {stopped}"), resumed  # rank 0's
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{stopped:08d}", f"step_{stopped + 1:08d}"]
    return stopped + 1


@pytest.mark.dist
@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_process(layout, reference, tmp_path, warm_start):
    overrides, expected_layout, engines = LAYOUTS[layout]
    root = tmp_path / layout / "checkpoints"
    if layout == PREEMPTED:
        steps = _preempt_then_resume(tmp_path, warm_start, overrides)
    else:
        steps = STEPS
        nproc = 3 if "rollout.engine_ranks=1" in overrides else 2
        done = run_train(small_demo_config(tmp_path, layout, warm_start, STEPS), tmp_path, layout, *overrides,
                         nproc=nproc, timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        assert sorted(p.name for p in root.glob("step_*")) == [f"step_{s:08d}" for s in range(1, STEPS + 1)]

    metrics = read_metrics(tmp_path / layout / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # one record per step (rank 0 writes them)
    for ours, ref in zip(metrics, reference):
        step = ours["step"]
        for key in EXACT:
            assert ours[key] == ref[key], (step, key, ours[key], ref[key])
        for key in CLOSE:
            assert ours[key] == pytest.approx(ref[key], rel=CLOSE_REL, abs=CLOSE_ABS), (step, key)
        if engines == 1:  # rank 0 holds every sample: the same tokens as the reference
            assert ours["rollout/digest"] == ref["rollout/digest"], step
        assert 0.0 <= ours["sync/gate_max_logprob_diff"] <= GATE_TOLERANCE, step
        # each engine samples its replicas' prompts: 16 samples per step in all
        assert (ours["engines/count"], ours["engines/samples_min"], ours["engines/samples_max"]) == (
            engines, 16 / engines, 16 / engines), step  # fmt: skip
        assert ours["engines/tokens_min"] * engines <= ours["response/length_mean"] * 16 <= ours["engines/tokens_max"] * engines

    info = read_checkpoint_info(root / f"step_{steps:08d}")
    assert {k: info["layout"][k] for k in expected_layout} == expected_layout and info["layout"]["world_size"] == 2
    assert info["parts"]["optimizer"] == "saved" and info["parts"]["anchor"] and info["parts"]["hf_assets"]


def _signalled(rank: int, world_size: int, received: list) -> list:
    from megatron_empg.trainer.loop import any_rank_signalled

    import torch.distributed as dist

    return [any_rank_signalled(r[rank], dist.group.WORLD) for r in received]


@pytest.mark.dist
def test_a_signal_on_some_ranks_stops_every_rank():
    """SIGTERM (15) / SIGUSR1 (10) seen by one rank only, or different ones on each: every rank
    takes the same decision (the largest number), so all of them checkpoint and stop together."""
    received = [(None, None), (15, None), (None, 10), (10, 15)]  # per case: rank 0's, rank 1's
    expected = [None, 15, 10, 15]
    assert run_distributed(_signalled, 2, received, timeout=120) == [expected, expected]
