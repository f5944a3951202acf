"""The training loop asks its engines (``trainer.engines.placements``) and never where they run: no name in
``trainer/loop.py`` reads the placement, the engine ranks or one placement's state. The
behaviour of both placements is tested end to end (``test_disaggregated_e2e.py``,
``test_trainer_e2e.py``, ``test_trainer_multirank.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_empg.trainer.loop as loop

# What a placement branch would read: the layout's engine ranks, the rollout config's placement
# and mode, or one implementation's parts.
PLACEMENT_NAMES = {
    "engine_ranks",
    "disaggregated",
    "mode",
    "remote",
    "rollouts",
    "pending",
    "collector",
    "transport",
    "RemoteEngines",
    "RolloutStage",
    "RolloutCollector",
    "ColocatedEngines",
    "DisaggregatedEngines",
}


def _names(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.split(".")[-1])
    return found


def test_the_loop_reads_no_placement():
    tree = ast.parse(Path(loop.__file__).read_text())
    assert _names(tree) & PLACEMENT_NAMES == set()


def test_the_check_sees_a_branch():
    """The check itself: the loop's old branch on the placement is caught."""
    branch = ast.parse("if self.remote is not None:\n    self.remote.control(stop=stop)\n")
    assert _names(branch) & PLACEMENT_NAMES == {"remote"}
