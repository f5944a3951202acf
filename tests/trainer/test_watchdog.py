"""The watchdog (``trainer.run.watchdog``): a phase past its deadline ends the process restartable with
its stacks and a diagnosis of the other ranks from their heartbeats; a restart request of another
rank makes a process dump and exit; a failed collective with a lost peer is restartable, one with a
crashed peer is not. The processes are real (``subprocess``), the heartbeats real files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_empg.config import RunConfig, load_config
from megatron_empg.trainer.run.phase_limits import phase_timeouts
from megatron_empg.trainer.run.watchdog import REQUEST, RESTARTABLE_EXIT, Beat, diagnose

REPO = Path(__file__).resolve().parents[2]
INTERVAL = 0.1


def run_script(body: str, run_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """``body`` in a fresh interpreter, with ``RUN_DIR`` and ``watchdog`` (the module) defined."""
    script = (
        f"import sys, time\nfrom pathlib import Path\nfrom megatron_empg.trainer.run import watchdog\n"
        "from megatron_empg.trainer.run.phase_limits import PhaseLimits\n"
        f"RUN_DIR = Path({str(run_dir)!r})\n" + textwrap.dedent(body)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)


def write_beat(run_dir: Path, **fields) -> None:
    beat = {
        "rank": 1,
        "role": "training",
        "host": socket.gethostname(),
        "pid": 0,
        "phase": "update",
        "step": 4,
        "phase_started": time.time(),
        "time": time.time(),
        "state": "running",
        "error": None,
        **fields,
    }
    (run_dir / "heartbeats").mkdir(parents=True, exist_ok=True)
    (run_dir / "heartbeats" / f"rank{beat['rank']}.json").write_text(json.dumps(beat))


def test_phase_timeouts_scale_with_the_step_unless_set():
    demo = load_config(RunConfig, str(REPO / "recipes/demo_cpu.yaml"))
    bigger = load_config(RunConfig, str(REPO / "recipes/demo_cpu.yaml"), ["train.prompts_per_step=64"])
    set_one = load_config(RunConfig, str(REPO / "recipes/demo_cpu.yaml"), ["supervisor.phase_timeout_s.update=7"])
    small, large = phase_timeouts(demo), phase_timeouts(bigger)
    tokens = demo.train.prompts_per_step * demo.rollout.sampling.n * demo.rollout.max_model_len
    assert small["rollout"] == pytest.approx(1200 + 2e-3 * tokens)
    assert large["rollout"] - 1200 == pytest.approx(4 * (small["rollout"] - 1200))  # 4x the prompts
    assert large["checkpoint"] == small["checkpoint"] == 3600  # no per-token term
    assert phase_timeouts(set_one)["update"] == 7 and phase_timeouts(set_one)["old_pass"] == small["old_pass"]


def test_phase_timeouts_of_an_engine_at_the_model_context_use_the_model_context():
    """``rollout.max_model_len`` null: the engine takes the model's ``max_position_embeddings``."""
    config = load_config(RunConfig, str(REPO / "recipes/demo_cpu.yaml"), ["rollout.max_model_len=null"])
    context = config.model_config().max_position_embeddings
    at_context = load_config(RunConfig, str(REPO / "recipes/demo_cpu.yaml"), [f"rollout.max_model_len={context}"])
    assert phase_timeouts(config) == phase_timeouts(at_context)
    tokens = config.train.prompts_per_step * config.rollout.sampling.n * context
    assert phase_timeouts(config)["rollout"] == pytest.approx(1200 + 2e-3 * tokens)


def test_a_phase_past_its_deadline_dumps_the_stacks_and_exits_restartable(tmp_path):
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        write_beat(tmp_path, pid=stopped.pid, time=time.time() - 60)  # rank 1 stopped beating a minute ago
        write_beat(tmp_path, rank=2, phase="old_pass", time=time.time() + 60)  # rank 2 beats, a phase behind
        done = run_script(
            f"""
            w = watchdog.Watchdog(RUN_DIR, 0, 3, PhaseLimits({{"update": 0.5}}, explicit=frozenset({{"update"}})), {INTERVAL})
            w.step_done(3)
            def stuck_in_the_update():
                with w.phase("update", 4):
                    time.sleep(60)
            stuck_in_the_update()
        """,
            tmp_path,
        )
        assert done.returncode == RESTARTABLE_EXIT, done.stderr
        assert stopped.wait(timeout=10) == -signal.SIGKILL  # a stopped peer on this host is not left behind
    finally:
        stopped.kill()
    (hang,) = tmp_path.glob("hang-*")
    stacks = (hang / "rank0.txt").read_text()
    assert "phase update of step 4" in stacks and "stuck_in_the_update" in stacks  # the main thread's stack
    assert "empg-watchdog" in stacks or "_watch" in stacks  # every thread
    summary = (hang / "summary-rank0.txt").read_text()
    assert "last step logged: 3" in summary
    assert f"rank 1 on {socket.gethostname()} pid {stopped.pid}: did not arrive (no heartbeat for" in summary
    assert "rank 2: did not arrive (still in phase old_pass of step 4)" in summary
    assert f"rank 1: pid {stopped.pid} killed (SIGKILL) by rank 0" in summary
    assert "hang: rank 0 spent" in done.stderr and "supervisor.phase_timeout_s.update" in done.stderr
    request = json.loads((tmp_path / REQUEST).read_text())
    assert (request["cause"], request["phase"], request["step"], request["rank"]) == ("hang", "update", 4, 0)
    assert request["dir"] == hang.name


def test_another_ranks_request_makes_a_rank_dump_and_exit(tmp_path):
    done = run_script(
        f"""
        import json
        w = watchdog.Watchdog(RUN_DIR, 1, 2, PhaseLimits({{"update": 600}}), {INTERVAL})
        request = {{"cause": "hang", "rank": 0, "phase": "update", "step": 4, "detail": "planted",
                    "time": time.time(), "dir": "hang-planted"}}
        (RUN_DIR / "restart-request.json").write_text(json.dumps(request))
        with w.phase("update", 4):
            time.sleep(60)
    """,
        tmp_path,
    )
    assert done.returncode == RESTARTABLE_EXIT, done.stderr
    text = (tmp_path / "hang-planted" / "rank1.txt").read_text()
    assert "restart requested by rank 0: planted" in text and "phase update of step 4" in text


def test_an_earlier_attempts_request_is_ignored(tmp_path):
    (tmp_path / REQUEST).write_text(
        json.dumps(
            {
                "cause": "hang",
                "rank": 0,
                "phase": "update",
                "step": 1,
                "detail": "old",
                "time": time.time() - 100,
                "dir": "hang-old",
            }
        )
    )
    done = run_script(
        f"""
        w = watchdog.Watchdog(RUN_DIR, 1, 2, PhaseLimits({{"update": 600}}), {INTERVAL})
        with w.phase("update", 4):
            time.sleep(1)
        w.close()
    """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "heartbeats" / "rank1.json").read_text())["state"] == "done"


@pytest.mark.parametrize("peer_state, restartable", [("running", True), ("crashed", False)])
def test_a_failed_collective_is_restartable_only_if_the_peer_was_lost(tmp_path, peer_state, restartable):
    write_beat(
        tmp_path,
        time=time.time() - (60 if peer_state == "running" else 0),
        state=peer_state,
        error="ValueError: the peer's own bug" if peer_state == "crashed" else None,
    )
    done = run_script(
        f"""
        from megatron_empg.config import load_config, RunConfig
        config = load_config(RunConfig, {str(REPO / "recipes/demo_cpu.yaml")!r},
                             ["logging.dir=" + str(RUN_DIR), "supervisor.heartbeat_interval_s={INTERVAL}"])
        watchdog.install(config, 0, 2)
        try:
            with watchdog.phase("update", 4):
                raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
        except RuntimeError as error:
            watchdog.failed(error)
        watchdog.uninstall()
    """,
        tmp_path,
    )
    beat = json.loads((tmp_path / "heartbeats" / "rank0.json").read_text())
    if restartable:
        assert done.returncode == RESTARTABLE_EXIT, done.stderr
        request = json.loads((tmp_path / REQUEST).read_text())
        assert request["cause"] == "lost" and "rank(s) [1] stopped beating" in request["detail"]
        assert "phase update of step 4" in request["detail"]
    else:
        assert done.returncode == 0, done.stderr
        assert not (tmp_path / REQUEST).exists()
        assert beat["state"] == "crashed" and "Connection closed by peer" in beat["error"]


def test_diagnose_says_where_each_rank_is(tmp_path):
    now = time.time()
    for rank, fields in {
        0: dict(phase="update", step=4),
        1: dict(phase="update", step=4),
        2: dict(phase="rollout", step=4),
        3: dict(time=now - 30),
        4: dict(state="crashed", error="ValueError: x"),
    }.items():
        write_beat(tmp_path, rank=rank, **fields)
    lines = diagnose(tmp_path, 6, 0, interval_s=1.0)
    assert lines == [
        "rank 1: in phase update of step 4 too",
        "rank 2: did not arrive (still in phase rollout of step 4)",
        f"rank 3 on {socket.gethostname()} pid 0: did not arrive (no heartbeat for 30 s: stopped or dead, last in "
        "phase update of step 4)",
        "rank 4: did not arrive (crashed: ValueError: x)",
        "rank 5: did not arrive (no heartbeat)",
    ]
    assert Beat(**json.loads((tmp_path / "heartbeats" / "rank2.json").read_text())).phase == "rollout"
