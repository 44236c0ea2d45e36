"""The module map of ``docs/design.md`` names every module of ``runtime`` and ``actors``,
and nothing else, and its ``runtime`` table is bottom up.

A table row names a module by its dotted name (``runtime._codec``; a package by its own,
``actors.http``) and a ``__main__`` file by its path (``actors/__main__.py``). Bottom up
means that no module imports one listed below it, ``TYPE_CHECKING`` imports and imports
inside functions included; ``tests/unit/test_imports.py`` checks that there is such an
order at all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
#: The map's tables: the package each one lists, and its heading in the design page.
TABLES = {"runtime": "### `runtime`, bottom up", "actors": "### `actors`"}
_FIRST_CELL = re.compile(r"^\|\s*`([^`]+)`\s*\|")


def map_section() -> str:
    """The text of the design page's "Module map" section."""
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index("\n## Module map\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table(package: str) -> list[str]:
    """The modules the map's table for ``package`` names, in its order."""
    section = map_section()
    start = section.index(TABLES[package] + "\n")
    end = section.find("\n### ", start + 1)
    rows = section[start : end if end != -1 else len(section)].splitlines()
    return [m.group(1) for row in rows if (m := _FIRST_CELL.match(row))]


def table_name(path: Path) -> str:
    """How the map names the module in ``path``: ``runtime._codec``, ``actors.http``, or,
    for a ``__main__`` file, its path from the root."""
    relative = path.relative_to(ROOT)
    if relative.stem == "__main__":
        return relative.as_posix()
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_files(package: str) -> dict[str, Path]:
    """Every module of ``package``, subpackages included, by its name in the map."""
    return {table_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def dotted(name: str) -> str:
    """A map name as a dotted module name (``runtime/__main__.py`` -> ``runtime.__main__``)."""
    return name.removesuffix(".py").replace("/", ".")


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` (dotted names) that the module ``name`` in ``path`` imports,
    anywhere in its source.

    ``from package import x`` imports the module ``package.x`` when there is one, else the
    package itself; the parent packages that Python imports first are not counted.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{node.module}" if node.module else anchor
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(base)
    return (found & known) - {name}


def import_graph(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (by its map name) and the modules of it that it imports."""
    files = module_files(package)
    by_dotted = {dotted(name): name for name in files}
    return {
        name: {by_dotted[m] for m in imports_of(path, dotted(name), set(by_dotted))}
        for name, path in files.items()
    }


def imports_listed_below(order: list[str], edges: dict[str, set[str]]) -> list[str]:
    """Each import of a module listed below the importer in ``order``, as a sentence."""
    position = {module: i for i, module in enumerate(order)}
    return [
        f"{module} imports {imported}, listed below it"
        for module in order
        for imported in sorted(edges.get(module, set()))
        if position.get(imported, -1) > position[module]
    ]


@pytest.mark.parametrize("package", sorted(TABLES))
def test_the_map_names_every_module_of_the_package_once(package: str) -> None:
    listed = table(package)
    assert len(listed) == len(set(listed)), sorted(m for m in listed if listed.count(m) > 1)
    assert sorted(set(module_files(package)) - set(listed)) == [], "missing from the map"


@pytest.mark.parametrize("package", sorted(TABLES))
def test_the_map_names_no_module_that_does_not_exist(package: str) -> None:
    assert sorted(set(table(package)) - set(module_files(package))) == [], "not in the tree"


def test_the_runtime_table_lists_every_module_below_the_ones_it_imports() -> None:
    assert imports_listed_below(table("runtime"), import_graph("runtime")) == []


def test_the_import_graph_sees_every_kind_of_import() -> None:
    edges = import_graph("runtime")
    assert "runtime._errors" in edges["runtime"]  # from ._errors import ...
    assert "runtime._context" in edges["runtime._station"]  # from . import _context
    assert "runtime.top" in edges["runtime/__main__.py"]  # inside the __main__ guard
    assert "runtime._spawn" in edges["runtime._forking"]  # under TYPE_CHECKING too
    assert "runtime" not in edges["runtime._station"]  # a parent package is no import


@pytest.mark.parametrize(
    ("order", "edges", "found"),
    [
        (["a", "b"], {"b": {"a"}}, []),
        (["b", "a"], {"b": {"a"}}, ["b imports a, listed below it"]),
        (["a"], {"a": {"unlisted"}}, []),
    ],
)
def test_the_order_check_finds_imports_of_modules_listed_below_and_only_those(
    order: list[str], edges: dict[str, set[str]], found: list[str]
) -> None:
    assert imports_listed_below(order, edges) == found
