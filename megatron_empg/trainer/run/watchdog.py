"""Hangs found and explained: a heartbeat per process and a deadline per phase.

Every process that makes progress (training ranks, engine ranks) installs one ``Watchdog``; the
loop marks its phases (``with watchdog.phase("update", step): ...``, a no-op where none is
installed, as in unit tests). A thread of the watchdog, every ``supervisor.heartbeat_interval_s``:

* writes the heartbeat ``<run_dir>/heartbeats/rank<R>.json`` (``Beat``: phase, step, when the phase
  began, the time of the beat). The thread beats while the main thread waits in a collective, so a
  stale heartbeat means a process that is stopped or dead, not one that waits.
* looks for a restart request ``<run_dir>/restart-request.json`` newer than its process: another
  rank declared a hang, so this one writes all its Python stacks (``faulthandler``, every thread)
  to ``<run_dir>/hang-<time>/rank<R>.txt`` and exits with ``RESTARTABLE_EXIT``.
* checks its phase's deadline (``trainer.run.phase_limits``: set, learned from the run's own history,
  or a default until there is history): past it, the rank writes the
  request (the first rank to do so names the hang directory: an exclusive create), explains the
  hang from every rank's heartbeat (``diagnose``: the ranks that did not arrive, each with its
  phase and step, or the age of its last beat), logs it in one line, writes its stacks and exits
  with ``RESTARTABLE_EXIT`` (3). The launchers restart a run that exits so (``trainer.run.restarts``).

A rank that ends by an exception writes a ``crashed`` beat first, so that a peer whose collective
then fails can tell a crash (not restartable: the same error would come back) from a rank that is
lost (its beats stop with no word: a killed process or node, restartable: ``peer_lost``).

The files are on ``logging.dir``, shared storage on a cluster (as the checkpoints are): one small
write per rank and beat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from megatron_empg.config import RunConfig
from megatron_empg.trainer.run.phase_limits import PhaseLimits

log = logging.getLogger(__name__)

RESTARTABLE_EXIT = 3  # the launchers restart a run that exits with it (trainer.run.restarts)


class RestartableError(RuntimeError):
    """A failure that a restart from the last checkpoint may not meet again (an engine lost past
    ``rollout.engine_restarts``): the process exits ``RESTARTABLE_EXIT`` (``failed``)."""


REQUEST = "restart-request.json"
HEARTBEATS = "heartbeats"
STALE_BEATS = 3  # a heartbeat older than this many intervals: the process is stopped or dead


@dataclasses.dataclass
class Beat:
    """One process's heartbeat. ``state``: running, crashed (an exception ended it: ``error``) or done."""

    rank: int
    role: str
    host: str
    pid: int
    phase: str | None
    step: int | None
    phase_started: float | None
    time: float
    state: str = "running"
    error: str | None = None


class Watchdog:
    """The heartbeat and the phase deadlines of one process (module docstring).

    ``run_dir``: ``logging.dir``; ``rank`` / ``world_size``: in the job (engine ranks included);
    ``limits``: each phase's deadline, which learns from the phases that end here (saved into
    ``run_dir`` by the thread); ``interval_s``: between beats."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        limits: PhaseLimits,
        interval_s: float,
        role: str = "training",
    ) -> None:
        self.run_dir, self.rank, self.world_size = Path(run_dir), rank, world_size
        self.limits, self.interval_s, self.role = limits, interval_s, role
        self.started = time.time()
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._step: int | None = None
        self._phase_started: float | None = None
        self._last_step: int | None = None  # the last step trained and logged
        self._crashed: str | None = None
        self.failed_in: tuple[str, int] | None = None
        self._stop = threading.Event()
        (self.run_dir / HEARTBEATS).mkdir(parents=True, exist_ok=True)
        self._beat()
        self._thread = threading.Thread(target=self._watch, name="empg-watchdog", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop's side

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """Mark ``name`` of ``step`` (a phase of ``limits``) while inside. Phases nest: the outer
        one's deadline comes back on exit, and its clock counts only its time outside the inner
        ones (their time has its own limits). A phase that ends normally teaches ``limits``."""
        if name not in self.limits:
            raise KeyError(f"watchdog: unknown phase {name!r}; known: {self.limits.names()}")
        with self._lock:
            outer = (self._phase, self._step, self._phase_started)
            self._phase, self._step, self._phase_started = name, step, time.time()
        self._beat()
        ended = False
        try:
            yield
            ended = True
        except BaseException:
            self.failed_in = self.failed_in or (name, step)  # the innermost phase an exception left
            raise
        finally:
            with self._lock:
                now, began = time.time(), self._phase_started
                phase, step_, started = outer
                self._phase, self._step = phase, step_
                self._phase_started = None if started is None else started + (now - began)
            if ended:
                self.limits.observe(name, now - began)

    def step_done(self, step: int) -> None:
        """``step`` is trained and logged (the last step a hang report names)."""
        self._last_step = step

    def crashed(self, error: BaseException) -> None:
        """Say in the heartbeat that an exception ends this process (before it exits)."""
        self._crashed = f"{type(error).__name__}: {error}"[:500]
        self._beat(state="crashed", error=self._crashed)

    def close(self) -> None:
        """Stop the thread; the last beat says ``done`` (a clean end) unless it said ``crashed``."""
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s)
        self._save_limits()
        if self._crashed is None:
            self._beat(state="done")

    # ------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()
            request = fresh_request(self.run_dir, self.started)
            if request is not None:  # another rank found a hang: this one's stacks, then out
                self._dump_and_exit(request)
            self._save_limits()
            with self._lock:
                phase, step, began = self._phase, self._step, self._phase_started
            if phase is not None and time.time() - began > self.limits.limit(phase):
                self._declare_hang(phase, step, began)

    def _save_limits(self) -> None:
        try:
            self.limits.save(self.run_dir, self.rank)
        except OSError as error:  # as a beat: a full disk must not end the run from this thread
            log.warning("watchdog: could not save the phase times: %s", error)

    def _declare_hang(self, phase: str, step: int, began: float) -> None:
        limit, source = self.limits.explain(phase)
        request = claim_request(
            self.run_dir,
            self.started,
            cause="hang",
            rank=self.rank,
            phase=phase,
            step=step,
            detail=f"phase {phase} of step {step} outlasted {limit:.0f} s",
        )
        lines = diagnose(self.run_dir, self.world_size, self.rank, self.interval_s)
        lines += _kill_stopped_peers(self.run_dir, self.world_size, self.rank, self.interval_s)
        behind = [line for line in lines if "did not arrive" in line]
        log.error(
            "hang: rank %d spent %.0f s in phase %s of step %d (limit %.0f s, %s); "
            "%s; last step logged %s; stacks in %s",
            self.rank,
            time.time() - began,
            phase,
            step,
            limit,
            source,
            "; ".join(behind) or "every rank arrived (a collective or an engine stopped answering)",
            self._last_step,
            self.run_dir / request["dir"],
        )
        directory = self.run_dir / request["dir"]
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"summary-rank{self.rank}.txt").write_text(
            f"{request['detail']} (detected by rank {self.rank} at {_stamp(time.time())})\n"
            f"last step logged: {self._last_step}\n" + "".join(f"{line}\n" for line in lines)
        )
        self._dump_and_exit(request)

    def _dump_and_exit(self, request: dict) -> None:
        directory = self.run_dir / request["dir"]
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            where = f"phase {self._phase} of step {self._step}" if self._phase else "between phases"
        with open(directory / f"rank{self.rank}.txt", "w") as out:
            out.write(
                f"rank {self.rank} ({self.role}) on {socket.gethostname()} pid {os.getpid()}, {where}, "
                f"at {_stamp(time.time())}; restart requested by rank {request['rank']}: {request['detail']}\n\n"
            )
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        _flush_and_exit()

    def _beat(self, state: str = "running", error: str | None = None) -> None:
        with self._lock:
            beat = Beat(
                self.rank,
                self.role,
                socket.gethostname(),
                os.getpid(),
                self._phase,
                self._step,
                self._phase_started,
                time.time(),
                state,
                error,
            )
        path = self.run_dir / HEARTBEATS / f"rank{self.rank}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(dataclasses.asdict(beat)))
            os.replace(tmp, path)
        except OSError as error:  # a full or unreachable disk must not end the run from this thread
            log.warning("watchdog: could not write %s: %s", path, error)


# ---------------------------------------------------------------------- the files


def _stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y%m%dT%H%M%SZ")


def fresh_request(run_dir: Path, since: float) -> dict | None:
    """The restart request of this attempt (written after ``since``), or None."""
    try:
        request = json.loads((Path(run_dir) / REQUEST).read_text())
    except (OSError, ValueError):  # none, or one being written
        return None
    return request if request.get("time", 0) >= since else None


def claim_request(
    run_dir: Path, since: float, *, cause: str, rank: int, phase: str | None, step: int | None, detail: str
) -> dict:
    """Write this attempt's restart request unless another rank did first; the request in force."""
    now = time.time()
    request = {
        "cause": cause,
        "rank": rank,
        "phase": phase,
        "step": step,
        "detail": detail,
        "time": now,
        "dir": f"hang-{_stamp(now)}" if cause == "hang" else f"restart-{_stamp(now)}",
    }
    path = Path(run_dir) / REQUEST
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            existing = fresh_request(run_dir, since)
            if existing is not None:
                return existing
            with contextlib.suppress(OSError):  # an earlier attempt's (or one half written): replaced
                if fresh_request(run_dir, since) is None:
                    path.unlink()
            continue
        with os.fdopen(fd, "w") as out:
            json.dump(request, out)
        return request
    return fresh_request(run_dir, since) or request


def read_beats(run_dir: Path, world_size: int) -> dict[int, Beat]:
    beats = {}
    for rank in range(world_size):
        try:
            beats[rank] = Beat(**json.loads((Path(run_dir) / HEARTBEATS / f"rank{rank}.json").read_text()))
        except (OSError, ValueError, TypeError):
            pass
    return beats


def diagnose(run_dir: Path, world_size: int, me: int, interval_s: float) -> list[str]:
    """One line per other rank: where its heartbeat says it is, against this rank's phase."""
    beats, now = read_beats(run_dir, world_size), time.time()
    mine = beats.get(me)
    lines = []
    for rank in range(world_size):
        if rank == me:
            continue
        beat = beats.get(rank)
        if beat is None:
            lines.append(f"rank {rank}: did not arrive (no heartbeat)")
            continue
        where = f"phase {beat.phase} of step {beat.step}" if beat.phase else f"between phases (after step {beat.step})"
        age = now - beat.time
        if beat.state != "running":
            lines.append(f"rank {rank}: did not arrive ({beat.state}{f': {beat.error}' if beat.error else ''})")
        elif age > STALE_BEATS * interval_s:
            lines.append(
                f"rank {rank} on {beat.host} pid {beat.pid}: did not arrive (no heartbeat for {age:.0f} s: "
                f"stopped or dead, last in {where})"
            )
        elif mine is not None and (beat.phase, beat.step) != (mine.phase, mine.step):
            lines.append(f"rank {rank}: did not arrive (still in {where})")
        else:
            lines.append(f"rank {rank}: in {where} too")
    return lines


def _kill_stopped_peers(run_dir: Path, world_size: int, me: int, interval_s: float) -> list[str]:
    """SIGKILL the ranks on this host whose heartbeats stopped (stopped processes: a SIGTERM from the
    launcher would wait for ever on them, and the attempt is over); what was done, one line each."""
    host, now, lines = socket.gethostname(), time.time(), []
    for rank, beat in read_beats(run_dir, world_size).items():
        stale = beat.state == "running" and now - beat.time > STALE_BEATS * interval_s
        if rank != me and beat.host == host and stale and beat.pid > 1 and beat.pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(beat.pid, signal.SIGKILL)
                lines.append(f"rank {rank}: pid {beat.pid} killed (SIGKILL) by rank {me}, its host's peer")
    return lines


def peer_lost(run_dir: Path, world_size: int, me: int, interval_s: float) -> list[int]:
    """The ranks whose heartbeats stopped without a word (no crash, no clean end), after waiting
    ``STALE_BEATS`` intervals for them: a collective that failed because of them is restartable."""
    deadline = time.time() + STALE_BEATS * interval_s
    while True:
        beats, now = read_beats(run_dir, world_size), time.time()
        crashed = [r for r, b in beats.items() if r != me and b.state == "crashed"]
        lost = [
            r for r, b in beats.items() if r != me and b.state == "running" and now - b.time > STALE_BEATS * interval_s
        ]
        if crashed or lost or now > deadline:
            return [] if crashed else lost  # a crash explains the failure: not a lost rank
        time.sleep(interval_s / 2)


# ---------------------------------------------------------------------- the process's watchdog

_INSTALLED: Watchdog | None = None


def install(config: RunConfig, rank: int, world_size: int, role: str = "training") -> Watchdog:
    """This process's watchdog (one per process)."""
    global _INSTALLED
    if _INSTALLED is not None:
        raise RuntimeError("watchdog: already installed in this process")
    supervisor = config.supervisor
    run_dir = Path(config.logging.dir)
    limits = PhaseLimits.for_run(config, run_dir)
    _INSTALLED = Watchdog(run_dir, rank, world_size, limits, supervisor.heartbeat_interval_s, role)
    return _INSTALLED


def uninstall() -> None:
    global _INSTALLED
    if _INSTALLED is not None:
        _INSTALLED.close()
        _INSTALLED = None


def installed() -> Watchdog | None:
    return _INSTALLED


def failed(error: BaseException) -> None:
    """An exception ends this process. If a collective failed because a peer is lost (its
    heartbeat stopped without a word: ``peer_lost``), write the restart request and exit
    restartable; else say ``crashed`` in the heartbeat (the launcher does not restart a crash)."""
    w = _INSTALLED
    if w is None:
        return
    from megatron_empg.rollout.engine import EngineFailure

    if isinstance(error, (RestartableError, EngineFailure)):  # an engine lost outside a rollout too
        log.error("restartable: %s", error)
        exit_restartable(str(error))
    if isinstance(error, Exception) and _collective_failure(error):
        lost = peer_lost(w.run_dir, w.world_size, w.rank, w.interval_s)
        if lost:
            phase, step = w.failed_in or (None, None)
            detail = (
                f"rank(s) {lost} stopped beating (a killed process or a lost node) while rank {w.rank} was in "
                f"phase {phase} of step {step}: {type(error).__name__}: {str(error)[:300]}"
            )
            claim_request(w.run_dir, w.started, cause="lost", rank=w.rank, phase=phase, step=step, detail=detail)
            log.error("restartable: %s", detail)
            _flush_and_exit()
    w.crashed(error)


def exit_restartable(detail: str) -> None:
    """Write this attempt's restart request (cause ``restartable``: every rank's watchdog exits on
    it, the engine ranks' too) and exit ``RESTARTABLE_EXIT``; nothing where no watchdog is installed."""
    w = _INSTALLED
    if w is None:
        return
    phase, step = w.failed_in or (None, None)
    claim_request(w.run_dir, w.started, cause="restartable", rank=w.rank, phase=phase, step=step, detail=detail)
    _flush_and_exit()


def _flush_and_exit() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(RESTARTABLE_EXIT)  # no unwinding: the main thread may be blocked, or its clean-up wait on a lost peer


_COLLECTIVE_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL", "gloo")


def _collective_failure(error: Exception) -> bool:
    """Whether ``error`` is a failed collective or link message (a peer gone), not the code's own."""
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", ())
    return isinstance(error, dist_error) or any(word in str(error) for word in _COLLECTIVE_WORDS)


def step_done(step: int) -> None:
    if _INSTALLED is not None:
        _INSTALLED.step_done(step)


@contextlib.contextmanager
def phase(name: str, step: int) -> Iterator[None]:
    """``Watchdog.phase`` of this process's watchdog; nothing where none is installed."""
    if _INSTALLED is None:
        yield
    else:
        with _INSTALLED.phase(name, step):
            yield
