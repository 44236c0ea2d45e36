"""Every name the docs and the code's own docstrings and comments give for code exists.

A rename that misses a page or a comment leaves a reference to nothing; this test finds
each one and names its file and line. It starts no process: it reads text, imports modules
and walks attributes.

Where it looks:

* Markdown: ``docs/**/*.md`` and ``README.md``. The prose, outside fenced blocks; of fenced
  blocks, only the import lines of ``python`` blocks, the ``python -m`` commands of any
  block, and the names in ``mermaid`` diagrams (rule 6).
* Python: the docstrings (module, class, function) and the comments of every module under
  ``runtime/``, ``actors/`` and ``benchmarks/``.

What is a reference (anything else is prose, and is not checked):

1. A code span (text between two equal runs of backticks: one in Markdown, one or two in
   Python text) whose content, once a leading ``await``, one trailing call ``(...)`` and
   one subscript ``[...]`` are dropped, is a Python name or dotted name, and:

   a. starts with ``runtime``, ``actors`` or ``benchmarks`` (``runtime._codec``,
      ``runtime.ActorSystem.spawn``): the longest prefix that is a module must import, and
      each further part must be an attribute of what precedes it;
   b. starts with a top-level module that the code of those three packages imports
      (``msgspec.Raw``, ``anyio.Event``, ``os._exit``): the same;
   c. starts with a public name of ``runtime`` or ``actors`` (``Batch.group``), or, in a
      Python file, with a global of that module (``Report.samples`` in
      ``benchmarks/_stream.py``) or a private module of its package (``_proc.run_driver``
      in ``benchmarks/``): each further part must be an attribute;
   d. starts with ``system`` or ``ref``, the names these docs give an ``ActorSystem`` and an
      ``ActorRef`` (``system.spawn``, ``ref.ask``), or with ``self``: the attributes must
      exist on ``runtime.ActorSystem``, on ``runtime.ActorRef``, or, for ``self``, on
      ``runtime.Actor`` or (in a Python file) the class the docstring or comment is in;
   e. is one CapWords identifier (``Down``, ``RouteUpdate``, ``Origin(worker,
      incarnation)``): it must be defined somewhere, as a class, function or assigned name
      in ``runtime/``, ``actors/``, ``benchmarks/`` or ``docs/examples/``, in a fenced
      python block of the same page, or as a builtin.

   Not checked: any other dotted name (``err.reason``, ``p.generate``: variables of an
   example), a lowercase name alone (``on_start``, ``rid``: a method, a parameter, a
   field) and an ALL_CAPS one (``STOP``, ``PYTHONPATH``, ``ZMQ_RCVMORE``: header kinds,
   environment variables, C constants). An attribute of a class is one it or a base has,
   one its annotations or ``__struct_fields__`` declare, or one its methods assign to
   ``self``; the parts after the first that is neither a module nor a class (a method, a
   property, a field) are not checked, since their type is not known.
2. A mkdocstrings directive, ``::: dotted.name`` at the start of a line: as 1a.
3. ``python -m module`` in a code span or a fenced block, for a module of the three
   packages: the module must be found (``importlib.util.find_spec``).
4. ``from runtime import A, B`` or ``import actors.x`` in a fenced python block: the
   module must import and have each name.
5. ``FILE.md §Section`` or ``NAME §Section`` (``DESIGN.md §actors``, ``DESIGN §Mailboxes``):
   the file (``NAME`` means ``NAME.md``) must exist at the root or under ``docs/``, and have
   a heading whose text, or its anchor, is the section.
6. In a diagram (a ``mermaid`` block, or a docstring's ``::`` literal block), every
   CamelCase identifier with at least two capitals (``TokenizedGenerate``): as 1e.

7. A code span that is a path into one of the project's directories (it starts with
   ``runtime/``, ``actors/``, ``benchmarks/``, ``tests/`` or ``docs/``, as
   ``actors/http/load.py`` or ``tests/integration/test_top.py::TestTop``): the file or
   directory must exist, from the root, ``docs/`` or the file's own directory.

Never a reference: any other code span that names an existing file or directory (from the
root, ``docs/`` or the file's own directory), one whose last dotted part is a file extension
(``results.json``), and the spans of ``ALLOWLIST``, each with its reason.

``KNOWN_STALE`` holds the stale references in ``runtime/`` and ``actors/`` that only the
runtime refactor may fix; a second test fails once one of them is gone, so the set only
shrinks.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "actors", "benchmarks")
#: A span starting with one of these is a path in the repository (rule 7).
PROJECT_DIRS = ("runtime/", "actors/", "benchmarks/", "tests/", "docs/")
#: What ``system.x``, ``ref.x`` and (in Markdown) ``self.x`` stand for.
CONVENTIONAL = {"system": "runtime.ActorSystem", "ref": "runtime.ActorRef"}
MARKDOWN_SELF = "runtime.Actor"
#: A dotted span ending in one of these is a file name (``results.json``), not code.
FILE_EXTENSIONS = frozenset(
    {"py", "md", "json", "toml", "txt", "png", "svg", "yml", "yaml", "cfg", "ini", "sh"}
    | {"css", "html", "lock", "log", "whl", "gz", "pyc", "so"}
)

#: Code spans that look like code and are not (span -> why). Keep it short.
ALLOWLIST: dict[str, str] = {}

#: Stale references in runtime/ and actors/ (path, reference), left for the runtime/actors
#: refactor to fix (the branch that wrote this test could not edit those files); whoever
#: merges that refactor empties this set.
KNOWN_STALE: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Stale:
    """A reference to nothing: where it is, what it says, what is missing."""

    path: str
    line: int
    reference: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reference!r}: {self.why}"


@dataclass(frozen=True)
class Context:
    """What a piece of text is about: its file, its module and the class it sits in."""

    path: Path
    module: types.ModuleType | None = None
    cls: type | None = None
    markdown: bool = False
    local_names: frozenset[str] = frozenset()


# -- what exists ---------------------------------------------------------------------------


def source_files() -> list[Path]:
    """Every module of the three packages."""
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def module_name(path: Path) -> str:
    """``runtime/_codec.py`` -> ``runtime._codec``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def names_defined_in(tree: ast.AST) -> set[str]:
    """Classes, functions and assigned names anywhere in ``tree`` (class bodies too)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


@functools.cache
def defined_names() -> frozenset[str]:
    """Every name the project defines (rule 1e), with the builtins."""
    files = [*source_files(), *sorted((ROOT / "docs" / "examples").glob("*.py"))]
    names = set(dir(builtins))
    for path in files:
        names |= names_defined_in(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names)


@functools.cache
def imported_top_level_modules() -> frozenset[str]:
    """The top-level modules the three packages import (rule 1b), but themselves."""
    found: set[str] = set()
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return frozenset(found - set(PACKAGES))


def methods_of(cls: type) -> list[types.FunctionType]:
    """The functions ``cls`` itself defines: methods, class and static methods, getters."""
    found: list[types.FunctionType] = []
    for value in vars(cls).values():
        function = value.__func__ if isinstance(value, staticmethod | classmethod) else value
        function = function.fget if isinstance(function, property) else function
        if isinstance(function, types.FunctionType):
            found.append(function)
    return found


@functools.cache
def assigned_on_self(cls: type) -> frozenset[str]:
    """Attributes the methods of ``cls`` assign to ``self`` (set in ``__init__``, mostly).

    Read from each method's own source: a class of ``runtime`` names the package as its
    ``__module__``, where ``inspect.getsource`` of the class cannot find it.
    """
    names: set[str] = set()
    for method in methods_of(cls):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
        except (OSError, TypeError, SyntaxError):
            continue
        names |= _self_targets(tree)
    return frozenset(names)


def _self_targets(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                    ):
                        names.add(sub.attr)
    return names


def has_attribute(obj: object, name: str) -> bool:
    """Whether ``obj`` has ``name``, counting what instances of a class get (rule 1)."""
    if hasattr(obj, name):
        return True
    if not isinstance(obj, type):
        return False
    for klass in obj.__mro__:
        declared = (
            vars(klass).get("__annotations__"),
            vars(klass).get("__struct_fields__"),
            vars(klass).get("__slots__"),
        )
        # Builtin classes hold descriptors under these names, not collections of names.
        if any(isinstance(d, dict | tuple | list) and name in d for d in declared):
            return True
        if name in assigned_on_self(klass):
            return True
    return False


def walk(obj: object, parts: list[str], shown: str) -> str | None:
    """Follow ``parts`` from ``obj``; ``None`` when they exist, else what is missing."""
    for part in parts:
        if not isinstance(obj, type | types.ModuleType):
            return None  # a method, a property or a field: its type is not known
        if not has_attribute(obj, part):
            kind = "module" if isinstance(obj, types.ModuleType) else "class"
            return f"{kind} {shown} has no attribute {part!r}"
        obj = getattr(obj, part, None)
        shown = f"{shown}.{part}"
    return None


def resolve_dotted(dotted: str) -> str | None:
    """Rule 1a/1b: import the longest module prefix, walk the rest; ``None`` when it exists."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and not name.startswith(err.name):
                raise  # the module exists and fails to import something else
            continue
        return walk(module, parts[i:], name)
    return f"no module {parts[0]!r}"


@functools.cache
def public_names() -> dict[str, object]:
    """The public names of ``runtime`` and ``actors`` (rule 1c)."""
    found: dict[str, object] = {}
    for package in ("runtime", "actors"):
        module = importlib.import_module(package)
        found.update({name: getattr(module, name) for name in module.__all__})
    return found


def headings(path: Path) -> set[str]:
    """The normalised text and anchor of every heading of a Markdown file (rule 5)."""
    found: set[str] = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        match = re.match(r"#+\s+(.*?)\s*#*\s*$", line)
        if match:
            found.add(normalised(match.group(1)))
            found.add(re.sub(r"[^\w\- ]", "", match.group(1).lower()).strip().replace(" ", "-"))
    return found


def normalised(text: str) -> str:
    """Lower case, punctuation dropped, runs of spaces as one: how sections are compared."""
    return " ".join(re.sub(r"[^\w\s-]", " ", text.lower()).split())


# -- what a reference is ----------------------------------------------------------------

IDENT = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"{IDENT}(?:\.{IDENT})*")
CAPWORDS = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")
CAMEL_IN_DIAGRAM = re.compile(r"(?<![\w.])[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+(?![\w.])")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
PYTHON_M = re.compile(r"python3?\s+-m\s+([\w.]+)")
SECTION = re.compile(r"(?P<file>\b[\w./-]+\.md|\b[A-Z][A-Z_]{2,})\s*§\s*(?P<section>[\w' -]+)")
IMPORT_LINE = re.compile(rf"^\s*(?:from\s+({IDENT}(?:\.{IDENT})*)\s+import\s+(.+)|import\s+(.+))$")


def bare(span: str) -> str:
    """The span without a leading ``await``, one trailing call and one subscript."""
    text = " ".join(span.split())
    text = text.removeprefix("await ")
    text = re.sub(r"\(.*\)$", "", text)
    return re.sub(r"\[.*\]$", "", text)


def is_path(span: str, context: Context) -> bool:
    """Whether a span names a file: it exists, or ends in a file extension."""
    text = span.strip().rstrip("/")
    if not text or any(c in text for c in "\n*<>?") or "\x00" in text:
        return False
    for base in (ROOT, ROOT / "docs", context.path.parent):
        try:
            if (base / text).exists():
                return True
        except OSError:  # a name too long for a path, say
            return False
    return "." in text and text.rsplit(".", 1)[-1] in FILE_EXTENSIONS


def check_repo_path(span: str, context: Context) -> str | None:
    """Rule 7: a path into one of the project's directories must exist."""
    text = span.strip().split("::")[0]
    if not text.startswith(PROJECT_DIRS) or any(c in text for c in " \n*<>?{}"):
        return None
    for base in (ROOT, ROOT / "docs", context.path.parent):
        if (base / text).exists():
            return None
    return f"no file or directory {text} in the repository"


def check_span(span: str, context: Context) -> str | None:
    """Rules 1, 3 and 7 for one code span; ``None`` when it is not a reference or exists."""
    if span in ALLOWLIST:
        return None
    for module in PYTHON_M.findall(span):
        why = check_python_m(module)
        if why:
            return why
    why = check_repo_path(span, context)
    if why:
        return why
    if is_path(span, context):
        return None
    text = bare(span)
    if not DOTTED.fullmatch(text):
        return None
    first, *rest = text.split(".")
    if first in PACKAGES or first in imported_top_level_modules():
        return resolve_dotted(text)
    if first in ("self", *CONVENTIONAL):
        target = CONVENTIONAL.get(first, MARKDOWN_SELF)
        why = walk(_import_object(target), rest, target)
        if first == "self" and context.cls is not None and why:
            # The class the text is in, or an actor's self (the runtime's docstrings show
            # actor code): either will do.
            why = walk(context.cls, rest, context.cls.__name__) and why
        return why
    if context.module is not None:
        if hasattr(context.module, first):
            shown = f"{context.module.__name__}.{first}"
            return walk(getattr(context.module, first), rest, shown)
        sibling = f"{context.module.__name__.rpartition('.')[0]}.{first}"
        if first.startswith("_") and importlib.util.find_spec(sibling) is not None:
            return resolve_dotted(f"{sibling}.{'.'.join(rest)}".rstrip("."))
    if first in public_names():
        return walk(public_names()[first], rest, first)
    if not rest and CAPWORDS.fullmatch(first):
        return check_defined(first, context)
    return None


def check_defined(name: str, context: Context) -> str | None:
    """Rules 1e and 6: a CapWords name must be defined somewhere."""
    if name in defined_names() or name in context.local_names or name in ALLOWLIST:
        return None
    return f"{name!r} is defined nowhere (runtime, actors, benchmarks, docs/examples)"


def check_python_m(module: str) -> str | None:
    """Rule 3: ``python -m`` of a project module must find it."""
    if module.split(".")[0] not in PACKAGES:
        return None
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    return None if found else f"python -m {module}: no such module"


def check_section(file: str, section: str) -> str | None:
    """Rule 5: the file exists and has the section."""
    name = file if file.endswith(".md") else f"{file}.md"
    candidates = [ROOT / name, ROOT / "docs" / name]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        return f"no file {name} (at the root or under docs/)"
    if normalised(section) not in headings(found) and section.strip() not in headings(found):
        return f"{found.relative_to(ROOT)} has no section {section.strip()!r}"
    return None


def check_import(line: str) -> str | None:
    """Rule 4: a fenced block's import of a project module."""
    match = IMPORT_LINE.match(line)
    if not match:
        return None
    module, names, plain = match.groups()
    if plain:
        for item in plain.split(","):
            target = item.split(" as ")[0].strip()
            if target.split(".")[0] in PACKAGES:
                why = resolve_dotted(target)
                if why:
                    return why
        return None
    if module.split(".")[0] not in PACKAGES:
        return None
    for item in names.strip("()").split(","):
        name = item.split(" as ")[0].strip()
        if name:
            why = resolve_dotted(f"{module}.{name}")
            if why:
                return why
    return None


def _import_object(dotted: str) -> object:
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


# -- scanning -------------------------------------------------------------------------------


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def scan_text(text: str, first_line: int, context: Context) -> list[Stale]:
    """Rules 1, 3 and 5 over prose (a paragraph, a docstring, a comment block)."""
    stale: list[Stale] = []

    def add(offset: int, reference: str, why: str | None) -> None:
        if why:
            line = first_line + text.count("\n", 0, offset)
            stale.append(Stale(relative(context.path), line, " ".join(reference.split()), why))

    for match in SPAN.finditer(text):
        add(match.start(), match.group(2), check_span(match.group(2), context))
    for match in SECTION.finditer(text):
        add(match.start(), match.group(0), check_section(match["file"], match["section"]))
    return stale


def scan_diagram(lines: list[str], first_line: int, context: Context) -> list[Stale]:
    """Rule 6 over a diagram's lines."""
    return [
        Stale(relative(context.path), first_line + i, name, why)
        for i, line in enumerate(lines)
        for name in CAMEL_IN_DIAGRAM.findall(line)
        if (why := check_defined(name, context))
    ]


def fence_names(block: list[str]) -> frozenset[str]:
    """The names a fenced python block defines (rule 1e counts them on its page)."""
    try:
        return frozenset(names_defined_in(ast.parse("\n".join(block))))
    except SyntaxError:  # a fragment: take what looks like a definition
        text = "\n".join(block)
        return frozenset(re.findall(rf"^\s*(?:class|def|async def)\s+({IDENT})", text, re.M))


def scan_markdown(path: Path) -> list[Stale]:
    """Every reference of one Markdown page."""
    lines = path.read_text(encoding="utf-8").splitlines()
    prose: list[str] = []
    fences: list[tuple[str, int, list[str]]] = []  # (language, first line, lines)
    fence: tuple[str, int, list[str]] | None = None
    for number, line in enumerate(lines, 1):
        marker = re.match(r"\s*(```|~~~)\s*([\w-]*)", line)
        if fence is None and marker:
            fence = (marker.group(2), number + 1, [])
            prose.append("")
        elif fence is not None and marker and not marker.group(2):
            fences.append(fence)
            fence = None
            prose.append("")
        elif fence is not None:
            fence[2].append(line)
            prose.append("")
        else:
            prose.append(line)
    local = frozenset().union(*(fence_names(b) for lang, _, b in fences if lang == "python"))
    context = Context(path=path, markdown=True, local_names=local)
    stale: list[Stale] = []
    start = 0
    for i, line in enumerate([*prose, ""]):
        if not line.strip():
            paragraph = "\n".join(prose[start:i])
            stale += scan_text(paragraph, start + 1, context)
            start = i + 1
    for number, line in enumerate(prose, 1):
        directive = re.match(r"\s*:::\s+(\S+)", line)
        if directive:
            why = resolve_dotted(directive.group(1))
            if why:
                stale.append(Stale(relative(path), number, line.strip(), why))
    for language, first, block in fences:
        if language == "mermaid":
            stale += scan_diagram(block, first, context)
        for i, line in enumerate(block):
            whys = [check_python_m(m) for m in PYTHON_M.findall(line)]
            if language == "python":
                whys.append(check_import(line))
            stale += [Stale(relative(path), first + i, line.strip(), w) for w in whys if w]
    return stale


def enclosing_classes(tree: ast.Module, module: types.ModuleType) -> list[tuple[int, int, type]]:
    """(first line, last line, class) of every class of a module, innermost last."""
    found: list[tuple[int, int, type]] = []

    def visit(node: ast.AST, owner: object) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                cls = getattr(owner, child.name, None)
                if isinstance(cls, type):
                    found.append((child.lineno, child.end_lineno or child.lineno, cls))
                    visit(child, cls)

    visit(tree, module)
    return found


def class_at(classes: list[tuple[int, int, type]], line: int) -> type | None:
    inside = [c for first, last, c in classes if first <= line <= last]
    return inside[-1] if inside else None


def docstring_parts(docstring: str) -> tuple[list[str], list[tuple[int, str]]]:
    """Split a docstring into its prose (literal lines blanked, so line numbers hold) and
    the lines of its ``::`` literal blocks, as (line offset, line)."""
    prose: list[str] = []
    literal: list[tuple[int, str]] = []
    in_block, indent = False, 0
    for i, line in enumerate(docstring.splitlines()):
        depth = len(line) - len(line.lstrip())
        if in_block and line.strip() and depth <= indent:
            in_block = False
        if in_block:
            literal.append((i, line))
        prose.append("" if in_block else line)
        if not in_block and line.rstrip().endswith("::"):
            in_block, indent = True, depth
    return prose, literal


def scan_python(path: Path) -> list[Stale]:
    """Every reference of one module's docstrings and comments."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    module = importlib.import_module(module_name(path))
    classes = enclosing_classes(tree, module)
    stale: list[Stale] = []
    for node in ast.walk(tree):
        if not isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        ) or not (body := node.body):
            continue
        first = body[0]
        if not (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            continue
        start = first.lineno
        cls = class_at(classes, start)
        context = Context(path=path, module=module, cls=cls)
        prose, literal = docstring_parts(first.value.value)
        stale += scan_text("\n".join(prose), start, context)
        stale += [
            Stale(relative(path), start + i, name, why)
            for i, line in literal
            for name in CAMEL_IN_DIAGRAM.findall(line)
            if (why := check_defined(name, context))
        ]
    comments = [
        (token.start[0], token.string.lstrip("#").strip())
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    block: list[tuple[int, str]] = []
    for line, text in [*comments, (sys.maxsize, "")]:
        if block and line != block[-1][0] + 1:
            context = Context(path=path, module=module, cls=class_at(classes, block[0][0]))
            stale += scan_text("\n".join(t for _, t in block), block[0][0], context)
            block = []
        block.append((line, text))
    return stale


@functools.cache
def every_stale_reference() -> tuple[Stale, ...]:
    """Every stale reference of the docs and the three packages, each once."""
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    found = [s for page in pages for s in scan_markdown(page)]
    found += [s for path in source_files() for s in scan_python(path)]
    return tuple(dict.fromkeys(found))


# -- the tests ------------------------------------------------------------------------------


def test_every_reference_in_the_docs_and_the_code_names_something_that_exists() -> None:
    stale = [s for s in every_stale_reference() if (s.path, s.reference) not in KNOWN_STALE]
    assert not stale, "references to code that does not exist:\n" + "\n".join(map(str, stale))


def test_each_known_stale_reference_is_still_there() -> None:
    found = {(s.path, s.reference) for s in every_stale_reference()}
    gone = sorted(KNOWN_STALE - found)
    assert not gone, f"fixed, so take them out of KNOWN_STALE: {gone}"


def test_each_allowlisted_span_is_still_in_the_text() -> None:
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md", *source_files()]
    text = "\n".join(p.read_text(encoding="utf-8") for p in pages)
    unused = sorted(span for span in ALLOWLIST if f"`{span}`" not in text)
    assert not unused, f"no text has these spans any more, so take them out: {unused}"


# -- the rules, on hand-made text -----------------------------------------------------------

HERE = Context(path=ROOT / "docs" / "index.md", markdown=True)


def stale_in(text: str, context: Context = HERE) -> list[str]:
    return [s.reference for s in scan_text(text, 1, context)]


def stale_in_page(tmp_path: Path, text: str) -> list[tuple[int, str]]:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return [(s.line, s.reference) for s in scan_markdown(page)]


class TestWhatIsAReference:
    """Each rule of the module docstring flags a name that is gone and passes one that is
    there."""

    def test_a_dotted_name_of_a_package_must_import_and_have_each_attribute(self) -> None:
        assert stale_in(
            "`runtime.ActorSystem.spawn`, `runtime.ActorSystem.spawned`, `runtime._codec`,"
            " `runtime._gone`, `actors.router.RouterLink`"
        ) == ["runtime.ActorSystem.spawned", "runtime._gone"]

    def test_an_attribute_that_init_assigns_or_a_field_declares_counts(self) -> None:
        assert stale_in("`runtime.ActorSystem.spawn_timeout`, `runtime.Down.reason`") == []

    def test_a_module_the_code_imports_is_checked_too(self) -> None:
        assert stale_in("`msgspec.Raw`, `msgspec.Rawr`, `os._exit`, `zmq.asyncio`") == [
            "msgspec.Rawr"
        ]

    def test_a_public_name_with_an_attribute_and_a_call_or_a_subscript(self) -> None:
        assert stale_in("`Batch.group(origins)`, `Batch.split(x)`, `ActorRef[Update]`") == [
            "Batch.split(x)"
        ]

    def test_system_ref_and_self_stand_for_the_system_a_ref_and_an_actor(self) -> None:
        assert stale_in(
            "`await system.lookup(name)`, `system.find`, `ref.ask()`, `self.crash(err)`,"
            " `self.explode()`"
        ) == ["system.find", "self.explode()"]

    def test_a_capwords_name_must_be_defined_somewhere(self) -> None:
        assert stale_in("`RouteUpdate`, `Origin(worker, incarnation)`, `ValueError`,"
                        " `ControlRequest(origin)`") == ["ControlRequest(origin)"]  # fmt: skip

    def test_a_class_of_the_pages_own_example_is_defined(self, tmp_path: Path) -> None:
        page = "```python\nclass Foreman:\n    job = 1\n```\n\nThe `Foreman` and `Foremen`.\n"
        assert stale_in_page(tmp_path, page) == [(6, "Foremen")]

    def test_python_dash_m_must_find_a_project_module(self) -> None:
        assert stale_in("`python -m benchmarks mailbox --json out.json`, `python -m"
                        " benchmarks.gone --json out.json`") == [
            "python -m benchmarks.gone --json out.json"
        ]  # fmt: skip

    def test_a_section_needs_its_file_and_a_heading_of_that_name(self) -> None:
        text = "DESIGN.md §actors; design.md §Process model, design.md §process-model; README §Nope"
        assert stale_in(text) == ["DESIGN.md §actors", "README §Nope"]

    def test_a_directive_an_import_and_a_diagram_in_a_page(self, tmp_path: Path) -> None:
        page = (
            "::: runtime\n\n::: runtime.Nowhere\n\n"
            "```python\nfrom runtime import Actor, Nowhere\nimport actors.router\n```\n\n"
            "```mermaid\nflowchart LR\n    A -->|RouteUpdate| B\n    B -->|ControlReply| A\n```\n"
        )
        assert stale_in_page(tmp_path, page) == [
            (3, "::: runtime.Nowhere"),
            (6, "from runtime import Actor, Nowhere"),
            (13, "ControlReply"),
        ]

    def test_a_path_into_the_project_must_exist(self) -> None:
        assert stale_in(
            "`benchmarks/_http_load.py`, `actors/http/load.py`, `docs/img/`, `docs/img/*.png`,"
            " `tests/integration/test_top.py::TestTop`, `tests/gone.py::test_x`, `bench.py`"
        ) == ["benchmarks/_http_load.py", "tests/gone.py::test_x"]

    def test_a_stale_reference_is_reported_on_its_own_line(self) -> None:
        assert [s.line for s in scan_text("one\ntwo `runtime.Nope`\nthree", 10, HERE)] == [11]

    def test_a_docstring_literal_block_is_a_diagram_not_prose(self) -> None:
        prose, literal = docstring_parts("Data flow::\n\n    A --Ping--> B\n\nAfter `x`.")
        assert prose == ["Data flow::", "", "", "", "After `x`."]
        assert literal == [(1, ""), (2, "    A --Ping--> B"), (3, "")]


class TestWhatIsNotAReference:
    """Shell commands, paths, message fields and example variables are left alone."""

    @pytest.mark.parametrize(
        "span",
        [
            "make bench",
            "kill -9",
            "docs/benchmarks.md",
            "results.json",
            "bench-results/results.json",
            'reason == "normal"',
            "err.reason",
            "p.generate",
            "ZMQ_RCVMORE",
            "exitcode=None",
            "ipc://",
        ],
    )
    def test_it_is_not_flagged(self, span: str) -> None:
        assert stale_in(f"`{span}`") == []
