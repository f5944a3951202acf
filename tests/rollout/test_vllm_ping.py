"""The health request between calls (``vllm_health.ping``): a core process that runs but does not
answer fails it within its timeout and is killed, the engine marked broken; one that answers passes
and is left alone; a stopped one is named as in a call. The client is a stand-in for vLLM's
synchronous engine-core client (its utility calls wait on a future, as vLLM 0.32's do)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
from concurrent.futures import Future

import pytest

from megatron_empg.rollout.engine import EngineFailure, EngineState
from megatron_empg.rollout.vllm_health import ping

pytest.importorskip("vllm")


class Core:
    """A process standing in for an engine core (``multiprocessing.Process``'s attributes)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.pid = self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self):
        return self.proc.poll()


class Client:
    def __init__(self, answers: bool) -> None:
        self.answers, self.outputs_queue, self.utility_results = answers, queue.Queue(), {}

    def call_utility(self, method: str, *args):
        future: Future = Future()
        self.utility_results[len(self.utility_results)] = future
        if self.answers:
            future.set_result(False)
        return future.result()


@pytest.fixture
def core():
    core = Core()
    yield core
    core.proc.kill()
    core.proc.wait()


def test_a_core_that_does_not_answer_fails_the_health_request_and_is_killed(core):
    state = EngineState()
    with pytest.raises(EngineFailure, match=r"health request: the vLLM engine core did not answer .* within 0.5 s"):
        ping(Client(answers=False), [core], state, timeout_s=0.5)
    assert core.proc.wait(timeout=10) == -signal.SIGKILL
    assert state.broken is not None  # the engine refuses work until it is shut down and started again


def test_a_core_that_answers_passes_and_runs_on(core):
    state = EngineState()
    ping(Client(answers=True), [core], state, timeout_s=0.5)
    assert core.is_alive() and state.broken is None


def test_a_stopped_core_is_named_without_asking(core):
    core.proc.send_signal(signal.SIGSTOP)
    os.waitpid(core.pid, os.WUNTRACED)  # the stop has taken effect (a signal is delivered asynchronously)
    with pytest.raises(EngineFailure, match=rf"health request: the vLLM engine core process {core.pid} is stopped"):
        ping(Client(answers=True), [core], EngineState(), timeout_s=0.5)


def test_an_engine_in_this_process_is_not_asked():
    ping(Client(answers=False), [], EngineState(), timeout_s=0.5)  # no core: returns at once
