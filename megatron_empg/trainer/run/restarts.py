"""Whether a launcher restarts a run that ended, and the history of its restarts.

The launchers (``launchers/torchrun.sh``, ``launchers/slurm/train.sbatch``) run an attempt, then ask:

    python -m megatron_empg.trainer.run.restarts CONFIG [overrides] --attempt N --started T --status S [--signalled]

which appends the attempt to ``<logging.dir>/restarts.jsonl`` and exits 0 when the run is to be
started again with ``--resume``, 1 when not (it prints the reason either way). Before an attempt,
``--begin`` removes the previous attempt's restart request. ``--watch PID --started T`` runs beside
an attempt (``launchers/torchrun.sh``) while PID (torchrun) lives: a rank stopped once a peer ended
has no watchdog left to find it, and torchrun would wait on it for ever, so this kills it
(``watch``). Torch-free (it runs in the launcher).

A run is restarted when it ended restartable: a rank declared a hang or a lost peer
(``<logging.dir>/restart-request.json`` written during the attempt, ``trainer.run.watchdog``), the
launcher's child exited with ``RESTARTABLE_EXIT`` or was killed by a signal the launcher did not
send, or a rank's heartbeat ended without a word (a process killed with no crash reported, and no
rank crashed). It is not restarted after a clean end (status 0), a configuration error (status 2),
a crash (a rank reported an exception that was not a lost peer), a signal to the launcher
(pre-emption: Slurm requeues the job) or ``supervisor.max_restarts`` restarts within
``supervisor.restart_window_s``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_empg.config import ConfigError, RunConfig, load_config
from megatron_empg.trainer.run.watchdog import (
    HEARTBEATS,
    REQUEST,
    RESTARTABLE_EXIT,
    STALE_BEATS,
    claim_request,
    fresh_request,
)

HISTORY = "restarts.jsonl"
CONFIG_ERROR_EXIT = 2


@dataclass(frozen=True)
class Decision:
    restart: bool
    cause: str


def decide(
    run_dir: Path,
    *,
    status: int,
    started: float,
    signalled: bool,
    max_restarts: int,
    window_s: float,
    now: float | None = None,
) -> Decision:
    """What follows an attempt that began at ``started`` (epoch seconds) and ended with ``status``
    (the launcher's child: 128 + N for a signal N); ``signalled``: the launcher itself got a stop
    signal. Reads the restart request, the heartbeats and the history of ``run_dir``."""
    now = time.time() if now is None else now
    cause = _cause(Path(run_dir), status, started, signalled)
    if cause is None or cause.startswith("not restartable"):
        return Decision(False, cause or "clean end")
    recent = [r for r in read_history(run_dir) if r.get("restart") and now - r["time"] <= window_s]
    if len(recent) >= max_restarts:
        return Decision(
            False,
            f"{cause}; not restarted: {len(recent)} restarts within the last {window_s:.0f} s "
            f"(supervisor.max_restarts={max_restarts})",
        )
    return Decision(True, cause)


def _cause(run_dir: Path, status: int, started: float, signalled: bool) -> str | None:
    if signalled:
        return "not restartable: the launcher was signalled (pre-emption: the run checkpointed and stopped)"
    if status == 0:
        return None
    if status == CONFIG_ERROR_EXIT:
        return "not restartable: a configuration error (exit 2)"
    request = fresh_request(run_dir, started)
    if request is not None:
        return f"{request['cause']}: {request['detail']} (rank {request['rank']})"
    beats = _beats(run_dir, started)
    crashed = {rank: b for rank, b in beats.items() if b.get("state") == "crashed"}
    if crashed:
        rank, beat = min(crashed.items())
        return f"not restartable: rank {rank} crashed ({beat.get('error')})"
    if status == RESTARTABLE_EXIT:
        return "exit 3 (restartable)"
    silent = sorted(rank for rank, b in beats.items() if b.get("state") == "running")
    if status > 128:
        return f"killed by signal {status - 128}" + (f" (ranks {silent} ended without a word)" if silent else "")
    if silent:
        return f"ranks {silent} ended without a word (killed: a lost process or node), exit {status}"
    return f"not restartable: exit {status} with no restartable cause"


def _beats(run_dir: Path, started: float) -> dict[int, dict]:
    """The last heartbeat of each rank of the attempt that began at ``started``."""
    beats = {}
    for path in (Path(run_dir) / HEARTBEATS).glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if beat.get("time", 0) >= started:
            beats[int(beat["rank"])] = beat
    return beats


def stopped_after_the_end(
    run_dir: Path, started: float, stale_s: float, now: float | None = None, stopped_s: dict[int, float] | None = None
) -> list[int]:
    """The ranks of the attempt begun at ``started`` that are stopped with no watchdog left to find
    them: some rank ended (its last beat says done or crashed), and these still say running with no
    beat for ``stale_s`` (a live process beats from a thread, even inside a collective), or their
    process has been stopped for ``stale_s`` (``stopped_s``: seconds by pid, as seen by the caller;
    a rank stopped after its own last beat said done). While every rank runs, a stopped one is its
    peers' watchdogs' to find."""
    beats = _beats(run_dir, started)
    if not any(b.get("state") in ("done", "crashed") for b in beats.values()):
        return []
    now = time.time() if now is None else now
    stopped_s = stopped_s or {}
    return sorted(
        r
        for r, b in beats.items()
        if (b.get("state") == "running" and now - b["time"] > stale_s) or stopped_s.get(b.get("pid"), 0) > stale_s
    )


def watch(run_dir: Path, started: float, interval_s: float, child: int) -> None:
    """While the launcher's ``child`` (torchrun) runs: SIGKILL the ranks on this host that
    ``stopped_after_the_end`` finds (torchrun would wait on them for ever), a line each, with a
    restart request (cause ``lost``): the attempt is restarted, and its resume finds what is left
    (``--resume`` past the last step: nothing to do, exit 0)."""
    host, killed, stopped_at = socket.gethostname(), set(), {}
    while _alive(child):
        now = time.time()
        beats = {r: b for r, b in _beats(run_dir, started).items() if b.get("host") == host}
        pids = {b.get("pid") for b in beats.values()} - killed
        stopped_at = {pid: stopped_at.get(pid, now) for pid in pids if isinstance(pid, int) and _stopped(pid)}
        stopped_s = {pid: now - t for pid, t in stopped_at.items()}
        for rank in stopped_after_the_end(run_dir, started, STALE_BEATS * interval_s, now, stopped_s):
            pid = beats.get(rank, {}).get("pid")
            if not isinstance(pid, int) or pid <= 1 or pid in killed:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                detail = f"rank {rank} (pid {pid}) stopped after its peers ended: killed (SIGKILL)"
                print(f"restarts: {detail}", flush=True)
                # restartable: the resume finds what is left to do (nothing, when the last step was saved)
                claim_request(run_dir, started, cause="lost", rank=rank, phase=None, step=None, detail=detail)
        time.sleep(interval_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return True


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state T in /proc; not on Linux: never)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def read_history(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / HISTORY
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a torn last line of a killed launcher
            continue
    return records


def record(run_dir: Path, entry: dict) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(run_dir) / HISTORY, "a") as out:
        out.write(json.dumps(entry) + "\n")


def begin(run_dir: Path) -> None:
    """Before an attempt: the previous attempt's restart request and heartbeats removed."""
    (Path(run_dir) / REQUEST).unlink(missing_ok=True)
    for path in (Path(run_dir) / HEARTBEATS).glob("rank*.json"):
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="megatron_empg.trainer.run.restarts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--begin", action="store_true", help="before an attempt: clear the last one's request")
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--started", type=float, help="the attempt's start (epoch seconds)")
    p.add_argument("--status", type=int, help="the attempt's exit status")
    p.add_argument("--signalled", action="store_true", help="the launcher got a stop signal")
    p.add_argument("--watch", type=int, metavar="PID", help="while PID (torchrun) runs: stopped_after_the_end")
    args = p.parse_args(argv)
    try:
        config = load_config(RunConfig, args.config, args.overrides)
    except (ConfigError, OSError) as error:
        sys.stderr.write(f"restarts: error: {error}\n")
        return 2
    run_dir = Path(config.logging.dir)
    if args.begin:
        begin(run_dir)
        return 0
    if args.watch is not None:
        if args.started is None:
            p.error("--watch needs --started")
        watch(run_dir, args.started, config.supervisor.heartbeat_interval_s, args.watch)
        return 0
    if args.started is None or args.status is None:
        p.error("--started and --status are needed (or --begin)")
    supervisor = config.supervisor
    decision = decide(
        run_dir,
        status=args.status,
        started=args.started,
        signalled=args.signalled,
        max_restarts=supervisor.max_restarts,
        window_s=supervisor.restart_window_s,
    )
    now = time.time()
    record(
        run_dir,
        {
            "time": now,
            "attempt": args.attempt,
            "started": args.started,
            "seconds": now - args.started,
            "status": args.status,
            "cause": decision.cause,
            "restart": decision.restart,
        },
    )
    print(
        f"{'restarting' if decision.restart else 'not restarting'} after attempt {args.attempt} "
        f"(exit {args.status}): {decision.cause}"
    )
    return 0 if decision.restart else 1


if __name__ == "__main__":
    sys.exit(main())
