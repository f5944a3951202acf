"""No import cycle inside the package, lazy imports (in a function, under ``TYPE_CHECKING``)
included: a module that needs another at run time, and is needed by it, is one unit in two files.

Each module's imports (``tests.test_import_layers.imports_of``) are resolved to the package's
modules (an imported name to the longest module path it starts with); an import of one of the
module's own ancestor packages is not an edge (Python initialises the parent first, and a package
``__init__`` that re-exports its submodules would otherwise close a loop with each of them). The
strongly connected components of that graph with more than one module (or a module importing itself)
are the cycles. A planted cycle of two lazy imports is found (the negative control).
"""

from __future__ import annotations

from pathlib import Path

from tests.test_import_layers import PACKAGE, PACKAGE_DIR, imports_of, package_modules


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """module -> the package's modules it imports (eagerly or lazily)."""
    modules = package_modules(package_dir)
    names = {name for name, _ in modules}
    graph: dict[str, set[str]] = {}
    for name, path in modules:
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges = set()
        for imp in imports_of(path.read_text(), name, is_package=path.name == "__init__.py"):
            parts = imp.module.split(".")
            target = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in names), None)
            if target is not None and target != name and target not in ancestors:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (lazy imports count):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_a_planted_cycle_of_lazy_imports_is_found(tmp_path):
    package = tmp_path / PACKAGE
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("from megatron_empg.core import a\n")  # a re-export: no cycle
    (package / "core" / "a.py").write_text("def f():\n    from megatron_empg.core import b\n")
    (package / "core" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_empg.core.a import f\n"
    )
    (package / "core" / "c.py").write_text("from megatron_empg.core import a\nimport megatron_empg.core\n")
    graph = import_graph(package)
    assert graph["megatron_empg.core.c"] == {"megatron_empg.core.a"}  # its own package is no edge
    assert cycles(graph) == [["megatron_empg.core.a", "megatron_empg.core.b"]]
