"""The health of a vLLM engine in its own process, watched while a call runs.

vLLM 0.32's synchronous client waits for ever on an engine core that died (its monitor shuts the
client down without waking the caller) or is stopped (SIGSTOP, a frozen container). ``watched``
runs a call with a thread that checks the core processes every ``HEALTH_POLL_S``: on a problem it
kills them (a stopped core would hold its memory for ever), fails what the caller may be waiting
on (the outputs queue and pending utility calls) and the call raises ``EngineFailure``, naming
the process and what happened to it.

Between calls, ``ping`` is the cheap health request (one utility round trip, ``is_sleeping``) the
trainer makes before each rollout: a core that runs but no longer answers fails it within
``PING_TIMEOUT_S`` and is killed, so that the rollout's engine restart takes over instead of the
watchdog's rollout deadline. A core that stops answering inside a call is left to that deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

from megatron_empg.rollout.engine import EngineFailure, EngineState

HEALTH_POLL_S = 0.5
PING_TIMEOUT_S = 10.0  # a utility call answers in milliseconds; a core busy with nothing else


def core_problem(processes) -> str | None:
    """What is wrong with an engine's core processes (``multiprocessing.Process``): dead,
    stopped, or None."""
    for process in processes:
        if not process.is_alive():
            return f"process {process.pid} died (exit code {process.exitcode})"
        try:
            state = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            return f"process {process.pid} is stopped (state {state})"
    return None


@contextlib.contextmanager
def watched(client, processes: list, state: EngineState, call: str):
    """Run the body (an engine's ``call``) with its core ``processes`` watched (module docstring);
    ``client``: vLLM's engine-core client (``llm_engine.engine_core``); a failure marks ``state``
    broken. Nothing is watched without processes (an engine in this process)."""
    if not processes:
        yield
        return
    problem = core_problem(processes)
    if problem is not None:
        state.broken = problem
        raise EngineFailure(f"{call}: the vLLM engine core {problem}")
    failure: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(HEALTH_POLL_S):
            problem = core_problem(processes)
            if problem is None:
                continue
            failure.append(problem)
            _kill(client, processes)
            return

    thread = threading.Thread(target=watch, name="empg-engine-health", daemon=True)
    thread.start()
    try:
        yield
    except Exception as error:
        if failure:
            state.broken = failure[0]
            raise EngineFailure(f"{call}: the vLLM engine core {failure[0]}") from error
        raise
    finally:
        done.set()
        thread.join()


def _kill(client, processes: list) -> None:
    """Kill the core ``processes`` and fail what a caller of ``client`` may wait on."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
    from vllm.v1.engine.exceptions import EngineDeadError

    client.outputs_queue.put_nowait(EngineDeadError())  # wakes a caller waiting for outputs
    for future in list(client.utility_results.values()):  # or for a utility call
        if not future.done():
            future.set_exception(EngineDeadError())


def ping(client, processes: list, state: EngineState, timeout_s: float = PING_TIMEOUT_S) -> None:
    """The health request between calls (module docstring): ``EngineFailure`` (the core killed,
    ``state`` broken) unless the core processes run and answer within ``timeout_s``. Nothing is
    asked of an engine in this process (no ``processes``)."""
    if not processes:
        return
    answered, errors = threading.Event(), []

    def ask() -> None:
        try:
            client.call_utility("is_sleeping")
        except Exception as error:  # noqa: BLE001 (the core died meanwhile: raised below, named by watched)
            errors.append(error)
        answered.set()

    thread = threading.Thread(target=ask, name="empg-engine-ping", daemon=True)
    with watched(client, processes, state, "health request"):  # dead or stopped: named as in a call
        thread.start()
        timed_out = not answered.wait(timeout_s)  # once: killing the core wakes the asking thread
        if errors and not timed_out:
            raise errors[0]
        if timed_out:
            _kill(client, processes)  # the asking thread wakes with EngineDeadError
    if timed_out:
        thread.join(timeout=timeout_s)
        state.broken = f"did not answer a health request within {timeout_s:g} s"
        raise EngineFailure(f"health request: the vLLM engine core {state.broken}")
