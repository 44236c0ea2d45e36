"""The runtime's modules import each other without a circle, ``TYPE_CHECKING`` imports and
imports inside functions included: each module knows only the ones below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import runtime

PACKAGE = Path(runtime.__file__).parent


def imports_of(module: str) -> set[str]:
    """The runtime modules ``runtime.<module>`` imports, anywhere in its source."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import _context
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("runtime."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(
                alias.name.split(".")[1]
                for alias in node.names
                if alias.name.startswith("runtime.")
            )
    return found - {module}


def graph() -> dict[str, set[str]]:
    modules = sorted(p.stem for p in PACKAGE.glob("_*.py") if p.stem != "__init__")
    return {m: imports_of(m) & set(modules) for m in modules}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, as the list of modules around it, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_runtime_module_imports_one_that_imports_it_back() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_refs_and_the_current_node_sit_at_the_bottom() -> None:
    edges = graph()
    assert edges["_context"] <= {"_errors", "_message"}
    assert edges["_ref"] <= {"_context", "_errors", "_message"}


@pytest.mark.parametrize(
    ("edges", "cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
    ],
)
def test_the_cycle_finder_finds_circles_and_only_circles(
    edges: dict[str, set[str]], cycle: list[str] | None
) -> None:
    assert find_cycle(edges) == cycle
