"""Import layering of ``megatron_empg`` (docs/design/architecture.md "Packages and layers"), checked with ``ast``.

Every module's imports are read from its source, never executed, and checked against the row of
its layer in ``MODULE_LEVEL`` (imports that run when the module is imported) and
``INSIDE_FUNCTIONS`` (lazy imports inside a function body or under ``if TYPE_CHECKING:``, which
run only when called). In a row, the longest matching prefix decides; an import that matches no
prefix is forbidden. ``from a import b`` is checked as ``a.b`` (so ``from torch import
distributed`` is ``torch.distributed``), relative imports are resolved, ``importlib.import_module``
/ ``__import__`` with a literal name count as imports, and an attribute path on an imported
module (``torch.distributed.all_reduce`` after ``import torch``) counts as a use of that module.

To add a layer or loosen a row, edit the tables; keep the direction downward
(config/core, kernels -> parallel -> mcore / rollout / weight_sync -> trainer, with tasks on top of
rollout: a task builds on rollout's generic data and rewards, and rollout never imports a task;
kernels, the fused GPU kernels, import torch and triton only, and core never imports them).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "megatron_empg"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

STDLIB = "<stdlib>"  # sys.stdlib_module_names
THIRD_PARTY = "<third-party>"  # anything neither stdlib nor megatron_empg
ENGINES = ("vllm", "sglang")  # rollout engines: heavy, GPU-initialising; never at import time
VERSION_GATES = {"packaging": True}  # base dependency; version-gated shims (mcore/patches, engines)

# layer -> {import prefix: allowed} for imports that run at module import time.
MODULE_LEVEL: dict[str, dict[str, bool]] = {
    "package": {STDLIB: True},  # megatron_empg/__init__.py: importing the package is free
    "config": {STDLIB: True, "yaml": True, "megatron_empg.config": True},
    "core": {STDLIB: True, "torch": True, "torch.distributed": False, "megatron_empg.core": True},
    # triton is imported only by the kernel modules, which the package imports on first use
    "kernels": {
        STDLIB: True,
        "torch": True,
        "torch.distributed": False,
        "triton": True,
        "megatron_empg.kernels": True,
    },
    "parallel": {
        STDLIB: True,
        "torch": True,
        "megatron_empg.core": True,
        "megatron_empg.kernels": True,
        "megatron_empg.parallel": True,
    },
    "mcore": {
        STDLIB: True,
        "torch": True,
        **VERSION_GATES,
        "megatron": True,
        "megatron_empg.core": True,
        "megatron_empg.kernels": True,  # the FP8 anchor's row quantization
        "megatron_empg.parallel": True,
        "megatron_empg.mcore": True,
        "megatron_empg.config": True,
    },
    "rollout": {
        STDLIB: True,
        "torch": True,
        **VERSION_GATES,
        "megatron_empg.core": True,
        "megatron_empg.parallel": True,
        "megatron_empg.rollout": True,
        "megatron_empg.config": True,
    },
    "weight_sync": {
        STDLIB: True,
        "torch": True,
        **VERSION_GATES,
        "megatron_empg.core": True,
        "megatron_empg.parallel": True,
        "megatron_empg.weight_sync": True,
        "megatron_empg.config": True,
    },
    "tasks": {
        STDLIB: True,
        "torch": True,
        "megatron_empg.core": True,
        "megatron_empg.rollout": True,
        "megatron_empg.tasks": True,
        "megatron_empg.config": True,
    },
    "trainer": {
        STDLIB: True,
        THIRD_PARTY: True,
        "megatron": False,
        **dict.fromkeys(ENGINES, False),
        "megatron_empg": True,
    },
}

# layer -> extra {prefix: allowed} for lazy imports (inside functions / TYPE_CHECKING), laid over
# the layer's MODULE_LEVEL row. `megatron` stays forbidden outside mcore even lazily.
INSIDE_FUNCTIONS: dict[str, dict[str, bool]] = {
    "mcore": {THIRD_PARTY: True, **dict.fromkeys(ENGINES, False)},
    "rollout": {THIRD_PARTY: True, "megatron": False},
    "tasks": {THIRD_PARTY: True, "megatron": False, **dict.fromkeys(ENGINES, False)},
    "weight_sync": {THIRD_PARTY: True, "megatron": False},
    "trainer": dict.fromkeys(ENGINES, True),
}


# --------------------------------------------------------------------------------------------
# The checker.


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name
    line: int
    lazy: bool  # inside a function body or an `if TYPE_CHECKING:` block


def layer_of(module: str) -> str | None:
    """``megatron_empg.core.kl`` -> ``core``; ``megatron_empg`` -> ``package``; unknown -> None."""
    parts = module.split(".")
    layer = "package" if len(parts) == 1 else parts[1]
    return layer if layer in MODULE_LEVEL else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None if the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.imports: list[Import] = []
        # local name bound by `import x.y [as z]` -> (module, whether only lazily imported)
        self.aliases: dict[str, tuple[str, bool]] = {}
        self.lazy = False

    def _add(self, module: str, node: ast.AST) -> None:
        self.imports.append(Import(module, node.lineno, self.lazy))

    def _visit_deferred(self, node: ast.AST) -> None:
        outer, self.lazy = self.lazy, True
        self.generic_visit(node)
        self.lazy = outer

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_deferred

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        outer, self.lazy = self.lazy, True
        for child in node.body:
            self.visit(child)
        self.lazy = outer
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)
            if alias.asname:
                local, target = alias.asname, alias.name
            else:  # `import a.b` binds `a`
                local = target = alias.name.split(".")[0]
            if local not in self.aliases or not self.lazy:  # an eager import of the name wins
                self.aliases[local] = (target, self.lazy)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        for alias in node.names:
            self._add(prefix if alias.name == "*" else f"{prefix}.{alias.name}", node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        if (
            name in (["importlib", "import_module"], ["import_module"], ["__import__"])
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            self._add(node.args[0].value, node)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parts = _dotted(node)
        if parts and parts[0] in self.aliases:
            target, alias_lazy = self.aliases[parts[0]]
            # a name imported only lazily (in a function, under TYPE_CHECKING) is used lazily
            path = ".".join([target, *parts[1:]])
            self.imports.append(Import(path, node.lineno, self.lazy or alias_lazy))
            return  # the full chain covers its prefixes
        self.generic_visit(node)


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every import (and module attribute path) of ``source``, resolved to absolute names."""
    collector = _ImportCollector(module, is_package)
    collector.visit(ast.parse(source))
    return collector.imports


def _matches(name: str, prefix: str) -> int:
    """Length of the match of ``prefix`` against ``name`` (-1: none; specials match at 0)."""
    top = name.split(".")[0]
    if prefix == STDLIB:
        return 0 if top in sys.stdlib_module_names else -1
    if prefix == THIRD_PARTY:
        return 0 if top not in sys.stdlib_module_names and top != PACKAGE else -1
    return len(prefix) + 1 if name == prefix or name.startswith(prefix + ".") else -1


def is_allowed(name: str, row: dict[str, bool]) -> bool:
    best = max(row, key=lambda prefix: _matches(name, prefix), default=None)
    return best is not None and _matches(name, best) >= 0 and row[best]


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Human-readable layering violations of ``source`` as module ``module``."""
    layer = layer_of(module)
    if layer is None:
        return [f"{module}: no layering rule for this module; add its layer to MODULE_LEVEL"]
    eager = MODULE_LEVEL[layer]
    lazy = {**eager, **INSIDE_FUNCTIONS.get(layer, {})}
    found = []
    for imp in imports_of(source, module, is_package):
        if not is_allowed(imp.module, lazy if imp.lazy else eager):
            where = "inside a function" if imp.lazy else "at module level"
            found.append(f"{module}:{imp.line}: layer {layer!r} may not import {imp.module} {where}")
    return found


def package_modules(package_dir: Path = PACKAGE_DIR) -> list[tuple[str, Path]]:
    """``(dotted name, path)`` of every module under ``package_dir``."""
    modules = []
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append((".".join(parts), path))
    return modules


def tree_violations(package_dir: Path = PACKAGE_DIR) -> list[str]:
    found = []
    for module, path in package_modules(package_dir):
        found += violations(path.read_text(), module, is_package=path.name == "__init__.py")
    return found


# --------------------------------------------------------------------------------------------
# The package obeys the rules.


def test_package_modules_are_found():
    names = [name for name, _ in package_modules()]
    assert "megatron_empg" in names and "megatron_empg.core.aggregation" in names


def test_every_module_respects_the_layering():
    found = tree_violations()
    assert not found, "import layering violated:\n" + "\n".join(found)


def test_tree_scan_reports_a_violating_file(tmp_path):
    core = tmp_path / PACKAGE / "core"
    core.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text('__version__ = "0"\n')
    (core / "__init__.py").write_text("from . import good\n")
    (core / "good.py").write_text("import torch\n")
    (core / "bad.py").write_text("import torch\n\n\nfrom torch import distributed as dist\n")
    assert tree_violations(tmp_path / PACKAGE) == [
        "megatron_empg.core.bad:4: layer 'core' may not import torch.distributed at module level"
    ]


def test_importing_the_package_imports_neither_megatron_nor_vllm():
    """Import the package and every module of the layers that must not pull in an engine."""
    light = [m for m, _ in package_modules() if layer_of(m) not in ("mcore", "trainer")]
    code = textwrap.dedent(
        f"""
        import importlib, sys
        import megatron_empg
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", *{ENGINES!r}))
        assert not heavy, f"import megatron_empg loaded {{heavy}}"
        for name in {light!r}:
            importlib.import_module(name)
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", *{ENGINES!r}))
            assert not heavy, f"import {{name}} loaded {{heavy}}"
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PACKAGE_DIR.parent,
    )
    assert result.returncode == 0, result.stderr[-4000:]


# --------------------------------------------------------------------------------------------
# The checker catches violations (synthetic sources) and lets legal imports through.

VIOLATIONS = [
    ("megatron_empg.core.x", "import torch.distributed as dist", "torch.distributed"),
    ("megatron_empg.core.x", "from torch import distributed", "torch.distributed"),
    ("megatron_empg.core.x", "from torch.distributed import all_reduce", "torch.distributed"),
    ("megatron_empg.core.x", "import torch\ndef f(t):\n    torch.distributed.all_reduce(t)", "torch.distributed"),
    ("megatron_empg.core.x", "import numpy", "numpy"),
    ("megatron_empg.core.x", "from megatron_empg import config", "megatron_empg.config"),
    ("megatron_empg.core.x", "from ..parallel import vocab_parallel", "megatron_empg.parallel"),
    ("megatron_empg.core.x", "def f():\n    import megatron.core", "megatron.core"),
    ("megatron_empg.core.x", "from megatron_empg.kernels import vocab_logprob_kernels", "megatron_empg.kernels"),
    ("megatron_empg.core.x", "import triton", "triton"),
    ("megatron_empg.kernels.x", "from megatron_empg.core import logprob", "megatron_empg.core"),
    ("megatron_empg.kernels.x", "from megatron_empg.parallel import vocab_parallel", "megatron_empg.parallel"),
    ("megatron_empg.kernels.x", "import torch.distributed as dist", "torch.distributed"),
    ("megatron_empg.parallel.x", "import triton", "triton"),
    ("megatron_empg.parallel.x", "from megatron_empg.mcore import model", "megatron_empg.mcore"),
    ("megatron_empg.parallel.x", "from megatron.core import parallel_state", "megatron.core"),
    ("megatron_empg.rollout.x", "import vllm", "vllm"),
    ("megatron_empg.rollout.x", "try:\n    import vllm\nexcept ImportError:\n    vllm = None", "vllm"),
    ("megatron_empg.rollout.x", "def f():\n    from megatron.core import mpu", "megatron.core"),
    ("megatron_empg.rollout.x", "from megatron_empg.trainer import loop", "megatron_empg.trainer"),
    ("megatron_empg.rollout.x", "from megatron_empg.tasks.arithmetic import ArithmeticTask", "megatron_empg.tasks"),
    ("megatron_empg.rollout.x", "def f():\n    from megatron_empg.tasks import registry", "megatron_empg.tasks"),
    ("megatron_empg.tasks.x", "from megatron_empg.trainer.bind.build import bind", "megatron_empg.trainer"),
    ("megatron_empg.tasks.x", "from megatron_empg.mcore import model", "megatron_empg.mcore"),
    ("megatron_empg.tasks.x", "from megatron_empg.weight_sync import transport", "megatron_empg.weight_sync"),
    ("megatron_empg.tasks.x", "import numpy", "numpy"),
    ("megatron_empg.tasks.x", "def f():\n    import vllm", "vllm"),
    ("megatron_empg.weight_sync.x", "import importlib\nm = importlib.import_module('vllm')", "vllm"),
    ("megatron_empg.weight_sync.x", "from megatron_empg.mcore.export import f", "megatron_empg.mcore"),
    ("megatron_empg.trainer.x", "from megatron.core import parallel_state", "megatron.core"),
    ("megatron_empg.trainer.x", "from vllm import LLM", "vllm"),
    ("megatron_empg.mcore.x", "import vllm", "vllm"),
    ("megatron_empg.config", "import torch", "torch"),
    ("megatron_empg", "import torch", "torch"),
    ("megatron_empg.newlayer.x", "import os", "no layering rule"),
]


@pytest.mark.parametrize(("module", "source", "expected"), VIOLATIONS)
def test_checker_catches_violation(module, source, expected):
    found = violations(source, module)
    assert len(found) == 1 and expected in found[0], found


ALLOWED = [
    (
        "megatron_empg.core.x",
        "import math\nimport torch\nimport torch.nn.functional as F\n"
        "from torch import Tensor, nn\nfrom .checks import check_bool\n"
        "from megatron_empg.core.aggregation import aggregate\nx = torch.nn.functional.softmax",
    ),
    (
        "megatron_empg.parallel.x",
        "import torch.distributed as dist\nfrom torch import distributed\n"
        "from megatron_empg.core import kl\nfrom megatron_empg.kernels import vocab_logprob_kernels",
    ),
    (
        "megatron_empg.kernels.x",
        "import torch\nimport triton\nimport triton.language as tl\n"
        "def f():\n    from megatron_empg.kernels import vocab_logprob_triton",
    ),
    (
        "megatron_empg.mcore.x",
        "from megatron.core import parallel_state\nimport megatron.core\n"
        "from megatron_empg.parallel import vocab_parallel\n"
        "from megatron_empg.config import RunConfig\n"
        "def f():\n    import transformer_engine",
    ),
    ("megatron_empg.rollout.x", "def f():\n    import vllm\n    return vllm.LLM"),
    (
        "megatron_empg.rollout.x",
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import vllm\nclass Engine:\n    llm: vllm.LLM",
    ),
    (
        "megatron_empg.tasks.x",
        "from megatron_empg.rollout.data import PromptExample\n"
        "from megatron_empg.rollout.rewards import RewardResult\nfrom megatron_empg.config import DataConfig\n"
        "from megatron_empg.tasks.task import Task\ndef f():\n    from math_verify import parse",
    ),
    (
        "megatron_empg.weight_sync.x",
        "import torch.distributed as dist\ndef f():\n    import importlib\n    return importlib.import_module('vllm')",
    ),
    (
        "megatron_empg.trainer.x",
        "import yaml\nfrom megatron_empg.mcore import model\n"
        "from megatron_empg import rollout\ndef f():\n    import vllm",
    ),
    ("megatron_empg.config", "import dataclasses\nimport yaml\nfrom typing import Literal"),
    ("megatron_empg", "from __future__ import annotations\n__version__ = '0'"),
]


@pytest.mark.parametrize(("module", "source"), ALLOWED)
def test_checker_allows_legal_imports(module, source):
    assert violations(source, module) == []


def test_relative_imports_resolve_from_a_package_init():
    source = "from . import kl\nfrom .. import config"
    found = imports_of(source, "megatron_empg.core", is_package=True)
    assert [i.module for i in found] == ["megatron_empg.core.kl", "megatron_empg.config"]


# --------------------------------------------------------------------------------------------
# Inside the trainer: its groups import downward (at module level; lazy imports are free).

# lowest first: a run's lifecycle (directories, signals, watchdog, restarts, logs) < the bind step
# (config checks, layout, memory plan) < batching (samples -> micro-batches) < the engines (rollout
# stage, placements, collection) < the loop, the policy and the command line (megatron_empg.trainer.*)
TRAINER_GROUPS = ("run", "bind", "batching", "engines")


def trainer_group_rank(module: str) -> int:
    """``megatron_empg.trainer.bind.build`` -> 1; the loop, the command line -> len(TRAINER_GROUPS)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[2] in TRAINER_GROUPS:
        return TRAINER_GROUPS.index(parts[2])
    return len(TRAINER_GROUPS)


def trainer_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Module-level imports of ``module`` (a trainer module) of a higher trainer group than its own."""
    rank = trainer_group_rank(module)
    found = []
    for imp in imports_of(source, module, is_package):
        if imp.lazy or not imp.module.startswith(f"{PACKAGE}.trainer."):
            continue
        if trainer_group_rank(imp.module) > rank:
            found.append(f"{module}:{imp.line}: may not import {imp.module} at module level (a higher trainer group)")
    return found


def test_trainer_groups_import_downward():
    found = []
    for module, path in package_modules():
        if module.startswith(f"{PACKAGE}.trainer."):
            found += trainer_violations(path.read_text(), module, is_package=path.name == "__init__.py")
    assert not found, "trainer group layering violated:\n" + "\n".join(found)


def test_every_trainer_module_is_in_a_group_or_the_top():
    top = {
        "megatron_empg.trainer",
        "megatron_empg.trainer.loop",
        "megatron_empg.trainer.cli",
        "megatron_empg.trainer.policy",
        "megatron_empg.trainer.teacher",
    }
    loose = [m for m, _ in package_modules() if m.startswith(f"{PACKAGE}.trainer") and m not in top]
    loose = [m for m in loose if m.split(".")[2] not in TRAINER_GROUPS]
    assert not loose, f"trainer modules outside the groups {TRAINER_GROUPS}: {loose}"


@pytest.mark.parametrize(
    "module, source, ok",
    [
        ("megatron_empg.trainer.run.x", "from megatron_empg.trainer.bind import build", False),
        ("megatron_empg.trainer.bind.x", "from megatron_empg.trainer.batching.batch import Sample", False),
        ("megatron_empg.trainer.batching.x", "from megatron_empg.trainer.engines import collect", False),
        ("megatron_empg.trainer.engines.x", "from megatron_empg.trainer import loop", False),
        ("megatron_empg.trainer.engines.x", "from megatron_empg.trainer.batching.batch import Sample", True),
        ("megatron_empg.trainer.bind.x", "def f():\n    from megatron_empg.trainer.engines import collect", True),
        ("megatron_empg.trainer.loop", "from megatron_empg.trainer.engines import collect", True),
    ],
)
def test_the_trainer_group_check_tells_downward_from_upward(module, source, ok):
    assert (trainer_violations(source, module) == []) == ok
