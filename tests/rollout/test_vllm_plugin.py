"""vLLM's processes die with their owner (``rollout/vllm_plugin.py``): a process that
``multiprocessing`` started, in which vLLM loads its general plugins (as its engine core and workers
do) with ``EMPG_ENGINE_DIES_WITH_PARENT=1`` (what ``VllmEngine`` sets), is killed by the kernel when
its owner is SIGKILLed. Without the variable it outlives the owner (the negative control: what a
SIGKILLed rank used to leave behind, 1.7 GB per engine worker on the CPU demo)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from importlib.metadata import entry_points

import pytest

from megatron_empg.rollout import vllm_plugin
from tests.trainer.test_signals import _alive, _gone_within


def _engine_like(pids) -> None:
    """Stands for vLLM's engine core: loads vLLM's general plugins as ``EngineCore.__init__`` does."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    pids.put(os.getpid())
    time.sleep(300)


def _owner(pids, dies_with_parent: bool) -> None:
    """Stands for a rank: starts the engine-like process, then waits to be killed."""
    if dies_with_parent:
        os.environ[vllm_plugin.DIES_WITH_PARENT_ENV] = "1"
    else:
        os.environ.pop(vllm_plugin.DIES_WITH_PARENT_ENV, None)
    multiprocessing.get_context("spawn").Process(target=_engine_like, args=(pids,)).start()
    time.sleep(300)


def test_the_entry_point_is_vllms_hook():
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "empg"]
    assert plugin.load() is vllm_plugin.register


@pytest.mark.vllm
@pytest.mark.timeout(180)
@pytest.mark.parametrize("dies_with_parent", [True, False])
def test_an_engine_process_dies_when_its_owner_is_killed(dies_with_parent):
    pytest.importorskip("vllm")
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    owner = context.Process(target=_owner, args=(pids, dies_with_parent))
    owner.start()
    engine = pids.get(timeout=120)
    try:
        assert _alive(engine)
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(timeout=30)
        assert _gone_within(engine) is dies_with_parent
    finally:
        if _alive(engine):
            os.kill(engine, signal.SIGKILL)
