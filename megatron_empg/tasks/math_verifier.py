"""math-verify in worker processes: ``(gold answers, prediction)`` -> equal / different / timeout / error
(/ unscored: not checked by a deadline).

The ``math`` rewards (``tasks.math``) ask a ``MathVerifierPool`` whether an extracted answer equals
a gold one (symbolic and numeric equivalence: ``\\frac{1}{2}`` = ``0.5``), each sample given at
most ``timeout_s`` seconds: sympy can work on an expression for ever, even in C, so a worker that
overruns is killed. math-verify is imported only inside the workers; this module needs only the
standard library.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

VerifyOutcome = Literal["equal", "different", "timeout", "error", "unscored"]
_READY = "ready"
_WORKER_MODULE = "megatron_empg.tasks.math_verifier"  # `python -m` of this file serves math-verify
_REPOSITORY_ROOT = str(Path(__file__).resolve().parents[2])


def _as_boxed(answer: str) -> str:
    """An extracted or gold answer as ``\\boxed{...}``, the form math-verify's LaTeX extraction reads
    best (bare ``\\frac12`` or ``\\sqrt{2}/2`` are not extracted); math delimiters are dropped."""
    text = answer.strip()
    if "\\boxed" in text:
        return text
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : len(text) - len(right)].strip()
            break
    return "\\boxed{" + text + "}"


def _serve_math_verify() -> None:
    """The worker loop (``python -m megatron_empg.tasks.math_verifier``), one JSON value per line:
    writes "ready" (or an error message), then reads ``[golds, prediction]`` and answers an outcome
    until stdin closes. Its stdout is reserved for the protocol (prints go to stderr).

    math-verify's own timeouts (``signal.alarm``) are off: the parent kills a worker that overruns.
    SIGUSR1 and SIGTERM are ignored (the parent ends a worker with SIGKILL). On Linux the worker is
    also killed when the parent dies (``PR_SET_PDEATHSIG``), so a crashed trainer leaves no worker
    stuck on an expression.
    """
    import signal

    # torchrun and Slurm send SIGUSR1 / SIGTERM (pre-emption: "checkpoint after this step") to the whole
    # process group; the trainer finishes the step in flight, which needs its verifiers alive
    for stop in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def send(message: str) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    try:
        from math_verify import parse, verify
    except ImportError as error:
        send(f"the math reward needs the math-verify package (pip install math-verify): {error}")
        return
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warnings
    send(_READY)
    for line in sys.stdin:
        golds, prediction = json.loads(line)
        try:
            target = parse(_as_boxed(prediction), parsing_timeout=None)
            equal = bool(target) and any(
                verify(parse(_as_boxed(gold), parsing_timeout=None), target, timeout_seconds=None) for gold in golds
            )
            send("equal" if equal else "different")
        except Exception:  # noqa: BLE001 (a math-verify bug on one odd expression scores that sample 0)
            send("error")


@dataclass
class _Worker:
    process: subprocess.Popen
    started: float  # time.monotonic() at start
    ready: bool = False
    task: int | None = None  # index of the task it works on
    deadline: float = 0.0  # time.monotonic() by which the task must be done


class MathVerifierPool:
    """``num_workers`` math-verify processes, each sample given at most ``timeout_s`` seconds.

    Workers are plain subprocesses (``python -m megatron_empg.tasks.math_verifier``: no fork of the
    trainer's threads, no re-import of its main script), started at the first ``check`` (importing
    sympy takes about a second) and stopped by ``close()`` or when their stdin closes. A worker
    that overruns a sample is killed and replaced, so even a C-level sympy loop cannot hang the
    step; the sample's outcome is ``"timeout"``. A ``check`` with a ``deadline`` stops there: the
    workers still busy are killed and replaced, and what was not checked is ``"unscored"``.
    """

    def __init__(self, *, num_workers: int = 2, timeout_s: float = 5.0, startup_timeout_s: float = 120.0) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"MathVerifierPool: num_workers must be an int >= 1, got {num_workers!r}")
        for name, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
            if not value > 0:
                raise ValueError(f"MathVerifierPool: {name} must be > 0, got {value!r}")
        self.num_workers, self.timeout_s, self.startup_timeout_s = num_workers, timeout_s, startup_timeout_s
        self._workers: list[_Worker] = []

    @staticmethod
    def _start() -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPOSITORY_ROOT, env.get("PYTHONPATH")]))
        process = subprocess.Popen(
            [sys.executable, "-m", _WORKER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            env=env,
        )
        return _Worker(process, started=time.monotonic())

    @staticmethod
    def _stop(worker: _Worker) -> None:
        worker.process.kill()
        worker.process.wait()
        worker.process.stdin.close()
        worker.process.stdout.close()

    def check(
        self, tasks: Sequence[tuple[Sequence[str], str]], *, deadline: float | None = None
    ) -> list[VerifyOutcome]:
        """Outcome of each ``(gold answers, prediction)``: ``equal`` if the prediction equals any gold;
        ``unscored`` if not checked by ``deadline`` (``time.monotonic()`` seconds; None: none). Tasks
        start in order, so a deadline leaves the last ones unscored."""
        if not tasks:
            return []
        if not self._workers:
            if importlib.util.find_spec("math_verify") is None:
                raise ImportError("the math reward needs the math-verify package: pip install math-verify")
            self._workers = [self._start() for _ in range(self.num_workers)]
        try:
            return self._run(tasks, deadline)
        except BaseException:  # a worker may still owe an answer: start afresh next time
            self.close()
            raise

    def _run(self, tasks: Sequence[tuple[Sequence[str], str]], deadline: float | None) -> list[VerifyOutcome]:
        outcomes: list[VerifyOutcome | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        while queue or any(w.task is not None for w in self._workers):
            if deadline is not None and time.monotonic() >= deadline:
                for worker in [w for w in self._workers if w.task is not None]:
                    self._replace(worker)  # its sample stays unscored; the replacement starts for the next check
                break
            for worker in list(self._workers):
                if worker.ready and worker.task is None and queue:
                    golds, prediction = tasks[queue[0]]
                    try:
                        worker.process.stdin.write(json.dumps([list(golds), prediction]) + "\n")
                        worker.process.stdin.flush()
                    except BrokenPipeError:  # it died while idle: the task waits for its replacement
                        self._replace(worker)
                        continue
                    worker.task = queue.popleft()
                    worker.deadline = time.monotonic() + self.timeout_s
            waiting = [w for w in self._workers if not w.ready or w.task is not None]
            deadlines = [w.deadline if w.ready else w.started + self.startup_timeout_s for w in waiting]
            wait_s = max(0.0, min(deadlines if deadline is None else [*deadlines, deadline]) - time.monotonic())
            readable, _, _ = select.select([w.process.stdout for w in waiting], [], [], wait_s)
            for worker, due in zip(waiting, deadlines):
                if worker.process.stdout in readable:
                    self._receive(worker, outcomes)
                elif time.monotonic() >= due:
                    if not worker.ready:
                        raise RuntimeError(f"a math-verify worker did not start within {self.startup_timeout_s} s")
                    outcomes[worker.task] = "timeout"
                    self._replace(worker)
        return [outcome or "unscored" for outcome in outcomes]

    def _replace(self, worker: _Worker) -> None:
        self._stop(worker)
        self._workers[self._workers.index(worker)] = self._start()

    def _receive(self, worker: _Worker, outcomes: list[VerifyOutcome | None]) -> None:
        """Read the one line a worker has written (each request gets one answer, so no line waits
        in the pipe's buffer unseen by ``select``)."""
        line = worker.process.stdout.readline()
        if not line:  # the worker died
            if not worker.ready:
                raise RuntimeError(
                    f"a math-verify worker exited while starting (exit code {worker.process.wait()}); "
                    "its error is on stderr above"
                )
            outcomes[worker.task] = "error"
            self._replace(worker)
            return
        message = json.loads(line)
        if not worker.ready:
            if message != _READY:
                raise ImportError(message)
            worker.ready = True
            return
        outcomes[worker.task] = message
        worker.task = None

    def close(self) -> None:
        """Stop the workers (a later ``check`` starts new ones)."""
        for worker in self._workers:
            worker.process.stdin.close()  # the worker's loop ends
            try:
                worker.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.process.stdout.close()
        self._workers = []


if __name__ == "__main__":
    _serve_math_verify()
