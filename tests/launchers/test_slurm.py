"""The Slurm launchers on a real Slurm: a one-node cluster started for this module
(``slurm_cluster.py``: munged, slurmctld, slurmd from Debian's packages, on a config in a temporary
directory), and jobs of 2 gloo ranks running a few steps of the CPU demo recipe (4 prompts x 4 samples
per step, from the short warm start) without a container:

1. A layout that does not fit the allocation ends a ``sbatch launchers/slurm/train.sbatch`` job
   (EMPG_CPU=1) with exit code 2 before any rank starts.
2. A job through ``launchers/nemo_run_launch.py slurm`` (run.SlurmExecutor over run.LocalTunnel)
   trains and checkpoints every step.
3. Pre-emption of a ``train.sbatch`` job: SIGUSR1 to the batch script (what ``--signal=B:USR1@300``
   sends before the time limit) mid-run, after periodic checkpoints: the ranks checkpoint the step
   they reached, the script requeues the job, and the requeued run resumes from that checkpoint with
   the step counter going on; every step equals the run in one process. (CI time: this job is also
   the test of a plain ``train.sbatch`` run.)

Skipped when Slurm or munge is not installed, unless EMPG_REQUIRE_SLURM=1 (CI: ``.ci/run`` installs
them with ``tools/ci_install_slurm.sh``), where that is a failure; the same for the nemo-run
environment (``make launch-venv``, or EMPG_NEMO_RUN_PYTHON).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_empg.mcore.checkpoint import read_checkpoint_info
from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.launchers.slurm_cluster import CRED_EXPIRE_S, SlurmCluster
from tests.trainer.demo_runs import (
    REFERENCE_STEPS,
    REPO,
    assert_same_steps,
    small_demo_config,
    unexpected_errors,
)

# timeout: the pre-emption test runs a job twice (its own waits are bounded by JOB_TIMEOUT_S each).
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.dist,
    pytest.mark.vllm,
    pytest.mark.megatron,
    pytest.mark.timeout(900),
]

SBATCH = REPO / "launchers" / "slurm" / "train.sbatch"
NEMO_RUN_LAUNCH = REPO / "launchers" / "nemo_run_launch.py"
# Override train.sbatch's #SBATCH defaults (2 nodes x 8 GPUs): 2 gloo ranks on this node.
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]
CPU_DEFAULTS = "rollout.in_process=false weight_sync.transport=shm_file"
JOB_TIMEOUT_S = 240  # one run: ~40 s of start-up (vLLM engine, Megatron) and a few steps
# A training rank's steps, while the file EMPG_TEST_PACE exists, each followed by a 2 s pause (and
# the file's .used sibling touched, so that the test knows the pause took effect).
PACE_STEPS = """
import os
import time
from pathlib import Path

if "SLURM_PROCID" in os.environ and os.environ.get("EMPG_TEST_PACE"):  # an srun task (empg sets RANK later)
    import megatron_empg.trainer.loop as loop

    _step = loop.Trainer.step

    def step(self):
        out = _step(self)
        pace = Path(os.environ["EMPG_TEST_PACE"])
        if pace.exists():
            pace.with_suffix(".used").touch()
            time.sleep(2.0)
        return out

    loop.Trainer.step = step
"""


def _write_config(tmp_path: Path, warm_start: Path, steps: int, interval: int = 1) -> tuple[Path, dict]:
    config = small_demo_config(tmp_path, "run", warm_start, steps)
    config["checkpoint"]["interval"] = interval
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def _sbatch(slurm: SlurmCluster, log: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Submit train.sbatch in CPU mode (``env`` on top) from the repository root; the job id."""
    env = {**slurm.env, "EMPG_CPU": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(
        ["sbatch", "--parsable", *CPU_JOB, f"--output={log}", str(SBATCH), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")]


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.mark.parametrize(
    "extra_env, overrides, message",
    [
        (
            {},
            ["parallel.tensor_model_parallel_size=4"],
            "train.sbatch: error: parallel.tensor_model_parallel_size: the world of 2 processes is not divisible by "
            "parallel.tensor_model_parallel_size x parallel.pipeline_model_parallel_size = 4 x 1 "
            "(checked for 1 nodes x 2 tasks per node, 0 GPUs per node)",
        ),
        (
            {"EMPG_CPU": "0"},
            [],
            "train.sbatch: error: no GPUs requested (--gpus-per-node=0): request GPUs, or set EMPG_CPU=1 for gloo ranks",
        ),
    ],
)
def test_sbatch_bad_layout_ends_the_job_before_the_ranks_start(
    slurm, warm_start, tmp_path, extra_env, overrides, message
):
    config, _ = _write_config(tmp_path, warm_start, steps=3)
    log = tmp_path / "job.out"
    fields = slurm.wait_done(_sbatch(slurm, log, str(config), *overrides, env=extra_env), 60, log)
    text = log.read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0") and message in text, text
    assert "megatron_empg.trainer.cli train" not in text and not (tmp_path / "run").exists()


def test_nemo_run_slurm_executor_over_a_local_tunnel(slurm, nemo_run_python, warm_start, tmp_path):
    config, _ = _write_config(tmp_path, warm_start, steps=3)
    home = tmp_path / "nemorun-home"
    env = {**slurm.env, "NEMORUN_HOME": str(home), "OMP_NUM_THREADS": "1"}
    command = [
        nemo_run_python,
        str(NEMO_RUN_LAUNCH),
        "slurm",
        "--account",
        "test",
        "--gpus-per-node",
        "0",
        "--ntasks-per-node",
        "2",
        "--cpus-per-task",
        "1",
        "--packager",
        "none",
        "--python",
        sys.executable,
        "--name",
        "empg-slurm-test",
        str(config),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    job = re.search(r"submitted Slurm job (\d+) \(experiment (\S+)\)", done.stdout)
    assert job, done.stdout[-4000:]
    job_id, experiment = job.groups()
    task_dir = home / "experiments" / "empg-slurm-test" / experiment / "train"
    log = task_dir / f"log-empg-slurm-test-train_{job_id}_0.out"  # nemo-run's srun log of the first run
    fields = slurm.wait_done(job_id, JOB_TIMEOUT_S, log)
    state = (fields["JobState"], fields["ExitCode"], fields["Restarts"])
    assert state == ("COMPLETED", "0:0", "0"), slurm.report(job_id, log)
    sbatch_script = (task_dir.parent / "train_sbatch.sh").read_text()
    assert "#SBATCH --ntasks-per-node=2" in sbatch_script and "#SBATCH --signal=USR1@300" in sbatch_script
    task_script = (task_dir / "scripts" / "train.sh").read_text()
    assert f"{sys.executable} -m megatron_empg.trainer.cli train {config} {CPU_DEFAULTS} $resume" in task_script
    run = tmp_path / "run"
    assert _steps(run) == [1, 2, 3]
    assert _checkpoints(run) == ["step_00000001", "step_00000002", "step_00000003"]
    assert "saved checkpoint" in log.read_text()


def test_preempted_job_checkpoints_requeues_and_resumes(slurm, warm_start, small_demo_reference, tmp_path):
    """SIGUSR1 to the batch script once two steps are logged; the job's config asks for 1000 steps
    with a checkpoint after every step (so the signalled save is not the first one: Megatron's writer
    must have survived the signal). Once the ranks report the step N they stopped after, the config
    is cut to N + 1 steps for the requeued run, which starts once its credential lifetime has passed
    (``CRED_EXPIRE_S``). Every step, before and after the requeue, equals the uninterrupted run in
    one process (two engines, one per replica: the digests are each one's share of the samples).

    Until the signal has landed, the ranks pause after each step (``PACE_STEPS``): the signal takes
    its time through Slurm on a loaded machine, and the steps it lands after must be within the
    reference run's."""
    config, data = _write_config(tmp_path, warm_start, steps=1000, interval=1)
    log = tmp_path / "job.out"
    run = tmp_path / "run"
    hook, pace = tmp_path / "hook", tmp_path / "pace"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PACE_STEPS)
    pace.touch()
    job = _sbatch(slurm, log, str(config), env={"PYTHONPATH": f"{hook}:{REPO}", "EMPG_TEST_PACE": str(pace)})
    metrics = run / "metrics.jsonl"  # two whole records: two newlines
    slurm.wait_job(
        job, lambda f: metrics.exists() and metrics.read_text().count("\n") >= 2, JOB_TIMEOUT_S, "2 steps in", log
    )
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm.env, check=True, timeout=60)
    stop = r"\[rank (\d)\] WARNING megatron_empg\.trainer\.loop: signal 10: checkpointed at step (\d+)"
    slurm.wait_job(job, lambda f: len(re.findall(stop, log.read_text())) == 2, JOB_TIMEOUT_S, "checkpointed", log)
    stops = re.findall(stop, log.read_text())
    assert sorted(rank for rank, _ in stops) == ["0", "1"] and stops[0][1] == stops[1][1], stops
    stopped = int(stops[0][1])
    pace.unlink()  # the requeued run at full speed
    assert pace.with_suffix(".used").exists()  # the ranks did pause
    assert stopped + 1 <= REFERENCE_STEPS, stopped
    data["train"]["steps"] = stopped + 1
    config.write_text(yaml.safe_dump(data))

    fields = slurm.wait_done(job, CRED_EXPIRE_S + JOB_TIMEOUT_S, log)
    text = log.read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), slurm.report(
        job, log
    )
    launch = f"train.sbatch: job {job} (restart 0): 1 nodes x 2 tasks, master {slurm.node}:{20000 + int(job) % 20000},"
    assert launch in text and f"train {config} {CPU_DEFAULTS}\n" in text
    assert f"train.sbatch: pre-empted: requeueing job {job}" in text
    assert f"train.sbatch: job {job} (restart 1):" in text and f"{CPU_DEFAULTS} --resume" in text
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", text)
    assert resumed == [(str(run / "checkpoints" / f"step_{stopped:08d}"), str(stopped))], resumed
    assert _steps(run) == list(range(1, stopped + 2))  # the step counter goes on from the checkpoint
    assert_same_steps(read_metrics(run / "metrics.jsonl"), small_demo_reference, same_tokens=False)
    kept = range(max(1, stopped - 3), stopped + 2)  # keep_last 5
    assert _checkpoints(run) == [f"step_{step:08d}" for step in kept]
    info = read_checkpoint_info(run / "checkpoints" / f"step_{stopped + 1:08d}")
    assert info["step"] == stopped + 1 and info["layout"]["world_size"] == 2 and info["layout"]["dp"] == 2
    assert not unexpected_errors(text), text[-4000:]
