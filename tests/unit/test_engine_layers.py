"""The engine's sub-packages are layers, not folders (issue 96): each imports only the layers below it, none imports
the composition root (``engine.py``, ``executor.py``, ``build.py``, ...), and the import graph has no cycle. Imports
under ``if TYPE_CHECKING:`` (types only, never run) do not count."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "lightning_pd2bw" / "engine"
# the run: the options resolved once and their rules; every layer may read them
RUN = {"layout", "options", "precision", "partition", "sync_start", "compiled", "torch_compat"}
# each sub-package and the sub-packages it may import (the program is schedules; the runtime state, updates, comm;
# verify reads the program and the update's declarations)
LAYERS = {
    "comm": set(),
    "schedules": set(),
    "state": {"comm"},
    "updates": {"comm", "schedules", "state"},
    "verify": {"comm", "schedules", "updates"},
}


def _imports(tree: ast.Module) -> list[ast.ImportFrom]:
    found: list[ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom) and node.level:
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def engine_graph(engine: Path = ENGINE) -> dict[str, set[str]]:
    """Node -> the nodes it imports at run time: a sub-package's name, or ``root:MODULE`` for the engine's own modules."""
    graph: dict[str, set[str]] = {}
    for path in engine.rglob("*.py"):
        rel = path.relative_to(engine)
        here = rel.parts[0] if len(rel.parts) > 1 else f"root:{rel.stem}"
        for node in _imports(ast.parse(path.read_text())):
            folder = list(rel.parts[:-1])
            if node.level - 1 > len(folder):
                continue  # above the engine (the package's other layers: test_layout_rules.py)
            base = folder[: len(folder) - (node.level - 1)]
            target = [*base, *node.module.split(".")] if node.module else [*base, node.names[0].name]
            there = target[0] if (engine / target[0]).is_dir() else f"root:{target[0]}"
            if there != here:
                graph.setdefault(here, set()).add(there)
    return graph


def test_each_sub_package_imports_only_the_layers_below_it_and_the_run():
    graph = engine_graph()
    for package, allowed in LAYERS.items():
        imported = graph.get(package, set())
        root = {node.removeprefix("root:") for node in imported if node.startswith("root:")}
        assert root <= RUN, f"engine/{package} imports the composition root's {sorted(root - RUN)}"
        assert imported - {f"root:{m}" for m in RUN} <= allowed, f"engine/{package} imports {sorted(imported)}"


def test_the_engines_import_graph_has_no_cycle():
    graph = engine_graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(f"an import cycle: {' -> '.join([*path, node, nxt])}")
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_the_graph_sees_an_edge_that_breaks_the_rule(tmp_path):
    """The checker is real: the cycle this house had (the lowering importing the update, the update the schedules)
    is two edges it reports."""
    fake = tmp_path / "engine"
    (fake / "schedules").mkdir(parents=True)
    (fake / "updates").mkdir()
    (fake / "schedules" / "__init__.py").write_text("")
    (fake / "updates" / "__init__.py").write_text("")
    (fake / "schedules" / "lowering.py").write_text("from ..updates.update import X\n")
    (fake / "updates" / "update.py").write_text("from ..schedules import actions\n")
    (fake / "schedules" / "types.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..updates import u\n"
    )
    assert engine_graph(fake) == {"schedules": {"updates"}, "updates": {"schedules"}}
