"""The launchers' restart decision (``trainer.run.restarts``): what ends a run and what starts it again,
read from the exit status, the restart request, the heartbeats and the history; and its command
line, as the launchers call it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_empg.trainer.run.restarts import (
    HISTORY,
    begin,
    decide,
    read_history,
    record,
    stopped_after_the_end,
    watch,
)
from megatron_empg.trainer.run.watchdog import REQUEST

REPO = Path(__file__).resolve().parents[2]
STARTED = 1000.0


def beat(run_dir: Path, rank: int, state: str, when: float = STARTED + 5, error: str | None = None) -> None:
    (run_dir / "heartbeats").mkdir(parents=True, exist_ok=True)
    (run_dir / "heartbeats" / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "role": "training",
                "host": "h",
                "pid": 1,
                "phase": "update",
                "step": 4,
                "phase_started": when,
                "time": when,
                "state": state,
                "error": error,
            }
        )
    )


def request(run_dir: Path, when: float) -> None:
    (run_dir / REQUEST).write_text(
        json.dumps(
            {
                "cause": "hang",
                "rank": 0,
                "phase": "update",
                "step": 4,
                "time": when,
                "detail": "phase update of step 4 outlasted 20 s",
                "dir": "hang-x",
            }
        )
    )


def outcome(
    run_dir: Path, status: int, signalled: bool = False, max_restarts: int = 3, started: float = STARTED
) -> tuple[bool, str]:
    d = decide(
        run_dir,
        status=status,
        started=started,
        signalled=signalled,
        max_restarts=max_restarts,
        window_s=3600,
        now=started + 60,
    )
    return d.restart, d.cause


def test_a_clean_end_a_config_error_and_a_preemption_are_not_restarted(tmp_path):
    assert outcome(tmp_path, 0) == (False, "clean end")
    assert outcome(tmp_path, 2) == (False, "not restartable: a configuration error (exit 2)")
    request(tmp_path, STARTED + 10)  # even with a request: the launcher was told to stop
    restart, cause = outcome(tmp_path, 143, signalled=True)
    assert not restart and "the launcher was signalled" in cause


def test_a_hang_request_of_this_attempt_restarts_and_an_older_one_does_not(tmp_path):
    request(tmp_path, STARTED + 10)
    assert outcome(tmp_path, 1) == (True, "hang: phase update of step 4 outlasted 20 s (rank 0)")
    request(tmp_path, STARTED - 10)  # the previous attempt's
    assert outcome(tmp_path, 1) == (False, "not restartable: exit 1 with no restartable cause")


def test_heartbeats_tell_a_crash_from_a_lost_rank(tmp_path):
    beat(tmp_path, 0, "crashed", error="RuntimeError: Connection closed by peer")
    beat(tmp_path, 1, "crashed", error="ValueError: a bug")
    restart, cause = outcome(tmp_path, 1)
    assert not restart and cause.startswith("not restartable: rank 0 crashed")
    beat(tmp_path, 0, "done")
    beat(tmp_path, 1, "running")  # its heartbeat ended without a word: SIGKILL, OOM killer, a lost node
    assert outcome(tmp_path, 1) == (True, "ranks [1] ended without a word (killed: a lost process or node), exit 1")
    beat(tmp_path, 1, "running", when=STARTED - 5)  # an earlier attempt's heartbeat says nothing of this one
    assert outcome(tmp_path, 1)[0] is False


def test_exit_3_and_signals_restart(tmp_path):
    assert outcome(tmp_path, 3) == (True, "exit 3 (restartable)")
    assert outcome(tmp_path, 137) == (True, "killed by signal 9")


def test_at_most_max_restarts_within_the_window(tmp_path):
    for t in (STARTED - 7200, STARTED - 100, STARTED - 50):  # one outside the hour's window
        record(tmp_path, {"time": t, "restart": True, "cause": "hang"})
    record(tmp_path, {"time": STARTED - 20, "restart": False, "cause": "clean end"})
    assert outcome(tmp_path, 3, max_restarts=3) == (True, "exit 3 (restartable)")
    restart, cause = outcome(tmp_path, 3, max_restarts=2)
    assert not restart and "2 restarts within the last 3600 s (supervisor.max_restarts=2)" in cause
    with open(tmp_path / HISTORY, "a") as out:
        out.write('{"time": 12')  # a torn line of a killed launcher is skipped
    assert len(read_history(tmp_path)) == 4


def test_the_command_line_records_each_attempt(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "megatron_empg.trainer.run.restarts",
        str(REPO / "recipes/demo_cpu.yaml"),
        f"logging.dir={run_dir}",
        "supervisor.max_restarts=1",
    ]
    request(run_dir.mkdir(parents=True) or run_dir, time.time())
    beat(run_dir, 0, "running", when=time.time())
    assert subprocess.run([*command, "--begin"], cwd=REPO).returncode == 0
    assert not (run_dir / REQUEST).exists() and not list((run_dir / "heartbeats").glob("*.json"))
    started = time.time()
    request(run_dir, started + 1)
    first = subprocess.run(
        [*command, "--attempt", "0", "--started", str(started), "--status", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("restarting after attempt 0 (exit 1): hang: phase update of step 4")
    second = subprocess.run(
        [*command, "--attempt", "1", "--started", str(started), "--status", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert second.returncode == 1 and "supervisor.max_restarts=1" in second.stdout
    history = read_history(run_dir)
    assert [(r["attempt"], r["restart"]) for r in history] == [(0, True), (1, False)]
    bad = subprocess.run([*command, "supervisor.max_restarts=-1", "--begin"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "supervisor.max_restarts" in bad.stderr


@pytest.mark.parametrize("leftover", ["request", "beats"])
def test_begin_clears_the_last_attempt(tmp_path, leftover):
    request(tmp_path, STARTED) if leftover == "request" else beat(tmp_path, 3, "running")
    begin(tmp_path)
    assert not (tmp_path / REQUEST).exists() and not list(tmp_path.glob("heartbeats/*.json"))


def _live_beat(run_dir: Path, rank: int, state: str, pid: int, when: float) -> None:
    beat(run_dir, rank, state, when)
    path = run_dir / "heartbeats" / f"rank{rank}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "host": socket.gethostname(), "pid": pid}))


def test_a_rank_stopped_after_its_peers_ended_is_killed_by_the_watch(tmp_path, capsys):
    """A stopped rank whose peers ended has no watchdog left to find it (torchrun waits on it for
    ever): the launcher's ``--watch`` kills it, whether its beats stopped (rank 1) or its last beat
    said done before it stopped (rank 2). While every rank runs, or while a stop is recent, it is
    left alone."""
    ranks = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    torchrun = subprocess.Popen(["sleep", "600"])  # the launcher's child, which the watch does not outlive
    try:
        for proc in ranks:
            os.kill(proc.pid, signal.SIGSTOP)
        now = time.time()
        started = now - 60
        _live_beat(tmp_path, 0, "running", torchrun.pid, now)
        _live_beat(tmp_path, 1, "running", ranks[0].pid, now - 10)
        _live_beat(tmp_path, 2, "running", ranks[1].pid, now)
        stopped_s = {ranks[1].pid: 10.0}
        assert stopped_after_the_end(tmp_path, started, 3, now, stopped_s) == []  # rank 0's watchdog finds them
        _live_beat(tmp_path, 0, "done", torchrun.pid, now)
        _live_beat(tmp_path, 2, "done", ranks[1].pid, now - 10)
        assert stopped_after_the_end(tmp_path, started, 30, now, stopped_s) == []  # not stopped for long enough
        assert stopped_after_the_end(tmp_path, started, 3, now, stopped_s) == [1, 2]
        assert stopped_after_the_end(tmp_path, started, 3, now) == [1]  # rank 2 said done: its process tells

        watching = threading.Thread(target=watch, args=(tmp_path, started, 0.1, torchrun.pid))
        watching.start()
        assert [proc.wait(timeout=30) for proc in ranks] == [-signal.SIGKILL, -signal.SIGKILL]
        torchrun.kill()
        torchrun.wait()
        watching.join(timeout=30)
        assert not watching.is_alive()  # it ends with the launcher's child
        lines = sorted(capsys.readouterr().out.splitlines())
        assert lines == [
            f"restarts: rank {rank} (pid {proc.pid}) stopped after its peers ended: killed (SIGKILL)"
            for rank, proc in zip((1, 2), ranks)
        ]
        assert outcome(tmp_path, status=1, started=started) == (
            True,
            f"lost: rank 1 (pid {ranks[0].pid}) stopped after its peers ended: killed (SIGKILL) (rank 1)",
        )  # the first kill's request: restarted
    finally:
        for proc in (*ranks, torchrun):
            proc.kill()
            proc.wait()
