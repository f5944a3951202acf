"""The ``vllm.general_plugins`` entry point ``empg`` (pyproject.toml): engine processes that die with
their rank.

vLLM loads its general plugins in every process it starts, the engine core included
(``EngineCore.__init__``) and its workers. With ``rollout.in_process: false`` the engine core is a
child of the rank that does not watch it: a rank killed on its own (SIGKILL, the OOM killer) left
the engine core and its worker running, with their memory (1.7 GB for the CPU demo's worker; on a
GPU the next run's engine cannot start). ``VllmEngine`` sets ``EMPG_ENGINE_DIES_WITH_PARENT=1``
before it starts an engine; where that is set, ``register`` calls
``parallel.process_lifetime.die_with_parent``. Elsewhere (the trainer itself, a ``vllm serve`` of
the user's) it does nothing.
"""

from __future__ import annotations

import os

from megatron_empg.parallel.process_lifetime import die_with_parent

DIES_WITH_PARENT_ENV = "EMPG_ENGINE_DIES_WITH_PARENT"


def register() -> None:
    """vLLM's hook, called once in each of its processes."""
    if os.environ.get(DIES_WITH_PARENT_ENV) == "1":
        die_with_parent()
