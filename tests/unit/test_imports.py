"""The packages import each other's modules without a circle, ``TYPE_CHECKING`` imports and
imports inside functions included: each module knows only the ones below it.

The graph spans ``runtime``, ``actors`` and ``benchmarks``, subpackages included: a circle
through two packages is a circle too. A package's ``__init__`` is the module named after the
package; ``from package import x`` imports the module ``package.x`` when there is one, else
the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The packages whose modules the graph holds.
PACKAGES = ("runtime", "actors", "benchmarks")
#: Imports known to close a circle, each with why it is left for now. The engine specs'
#: factory (``actors.engines``) imports each engine's generator inside a function, and each
#: generator imports the engine contract back: the engines' own work (point 5 of the core
#: reshape issue) moves the factory. An entry whose import is gone fails
#: `test_every_known_circle_is_still_there`, so that it is struck off.
KNOWN_CIRCLES = {
    ("actors.engines", "actors._fake_model"),
    ("actors.engines", "actors._llamacpp_engine"),
    ("actors.engines", "actors._vllm_engine"),
}


def module_name(path: Path) -> str:
    """The dotted name of the module in ``path`` (a package by its own name)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_files() -> dict[str, Path]:
    """Every module of the packages, by its dotted name."""
    return {
        module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that the module ``name`` (in ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{node.module}" if node.module else anchor
            else:
                base = node.module or ""
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(base)
    return (found & known) - {name}


def graph() -> dict[str, set[str]]:
    """Each module of the packages and the modules of them it imports."""
    files = module_files()
    known = set(files)
    return {name: imports_of(path, name, known) for name, path in files.items()}


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


def test_no_module_imports_one_that_imports_it_back() -> None:
    edges = graph()
    for importer, imported in KNOWN_CIRCLES:
        edges[importer].discard(imported)
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle or [])


def reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    """Whether ``start`` imports ``goal``, directly or through other modules."""
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges[todo.pop()] - seen:
            if nxt == goal:
                return True
            seen.add(nxt)
            todo.append(nxt)
    return False


def test_every_known_circle_is_still_there() -> None:
    edges = graph()
    gone = {
        (importer, imported)
        for importer, imported in KNOWN_CIRCLES
        if imported not in edges[importer] or not reaches(edges, imported, importer)
    }
    assert gone == set(), "strike these off KNOWN_CIRCLES"


def test_the_graph_spans_the_three_packages() -> None:
    edges = graph()
    assert {name.partition(".")[0] for name in edges} == set(PACKAGES)
    assert "runtime" in edges["benchmarks.pipeline"]  # one package's module importing another's
    assert "runtime._context" in edges["runtime._station"]  # from . import _context
    assert "actors.http._serve" in edges["actors.http"]  # a subpackage's relative imports


def test_runtime_never_imports_actors_or_benchmarks() -> None:
    edges = graph()
    above = {m for m in edges if not m.startswith("runtime")}
    assert {
        m: edges[m] & above for m in edges if m.startswith("runtime") and edges[m] & above
    } == {}


def test_actors_and_benchmarks_import_only_the_public_runtime() -> None:
    """What ``actors`` and ``benchmarks`` need of the runtime is public (``runtime``,
    ``runtime.top``, ...): a private module of it is free to change under them."""
    edges = graph()
    private = {
        m: sorted(i for i in edges[m] if i.startswith("runtime._"))
        for m in edges
        if not m.startswith("runtime")
    }
    assert {m: found for m, found in private.items() if found} == {}


def test_refs_and_the_current_station_sit_at_the_bottom() -> None:
    edges = graph()
    assert edges["runtime._context"] <= {"runtime._errors", "runtime._message"}
    assert edges["runtime._ref"] <= {"runtime._context", "runtime._errors", "runtime._message"}


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
