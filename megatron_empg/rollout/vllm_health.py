"""The health of a vLLM engine in its own process, watched while a call runs.

vLLM 0.32's synchronous client waits for ever on an engine core that died (its monitor shuts the
client down without waking the caller) or is stopped (SIGSTOP, a frozen container). ``watched``
runs a call with a thread that checks the core processes every ``HEALTH_POLL_S``: on a problem it
kills them (a stopped core would hold its memory for ever), fails what the caller may be waiting
on (the outputs queue and pending utility calls) and the call raises ``EngineFailure``, naming
the process and what happened to it. A core that runs but never answers is not detected here
(``trainer.run.watchdog``'s phase deadline is).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

from megatron_empg.rollout.engine import EngineFailure, EngineState

HEALTH_POLL_S = 0.5


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
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
            from vllm.v1.engine.exceptions import EngineDeadError

            client.outputs_queue.put_nowait(EngineDeadError())  # wakes a caller waiting for outputs
            for future in list(client.utility_results.values()):  # or for a utility call
                if not future.done():
                    future.set_exception(EngineDeadError())
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
