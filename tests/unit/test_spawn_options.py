"""A spawn option is declared once, as a field of `SpawnOptions`: ``spawn`` forwards its
keywords there, `ChildSpec` is one, and the remote request and the spawn spec embed it.
Adding an option is one field and its use."""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import msgspec
import pytest

import runtime
from runtime import ActorSystem, ChildSpec, SystemHandle
from runtime._protocol import RemoteSpawn, SpawnOptions, SpawnTarget, spawn_decoder
from runtime._spawn import SpawnSpec

PACKAGE = Path(runtime.__file__).parent
OPTIONS = SpawnOptions.__struct_fields__
#: Option names no other meaning in the runtime takes: declared anywhere but in
#: `SpawnOptions`, whatever the type, they are a second declaration.
DISTINCT = {"spawn_timeout", "shutdown_timeout", "stall_timeout", "inherit"}
#: Where such a name is declared on purpose, and why.
ALLOWED = {
    # The system's defaults for the spawns that name none: its public constructor.
    ("ActorSystem.__init__", "spawn_timeout"),
    ("ActorSystem.__init__", "shutdown_timeout"),
}


def annotations_of_options() -> dict[str, str]:
    """Each option's annotation as `SpawnOptions` writes it."""
    tree = ast.parse((PACKAGE / "_protocol.py").read_text(encoding="utf-8"))
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpawnOptions")
    return {
        st.target.id: ast.unparse(st.annotation)
        for st in cls.body
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
    }


def declarations() -> list[tuple[str, str, str, str]]:
    """Every parameter and class field in ``runtime/`` named like an option: its module,
    where (``Class.method``), its name and its annotation ('' when it has none)."""
    found: list[tuple[str, str, str, str]] = []

    def visit(module: str, node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                args = child.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                    if arg.arg in OPTIONS:
                        note = ast.unparse(arg.annotation) if arg.annotation else ""
                        found.append((module, scope + child.name, arg.arg, note))
                visit(module, child, f"{scope}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                found.extend(
                    (module, child.name, st.target.id, ast.unparse(st.annotation))
                    for st in child.body
                    if isinstance(st, ast.AnnAssign)
                    and isinstance(st.target, ast.Name)
                    and st.target.id in OPTIONS
                )
                visit(module, child, f"{scope}{child.name}.")

    for path in sorted(PACKAGE.glob("*.py")):
        visit(path.stem, ast.parse(path.read_text(encoding="utf-8")), "")
    return found


class TestDeclaredOnce:
    def test_the_options_are_the_fields_of_spawn_options(self) -> None:
        assert set(annotations_of_options()) == set(OPTIONS)
        assert set(OPTIONS) >= DISTINCT

    def test_no_other_signature_or_struct_declares_an_option(self) -> None:
        """An option's name with any type (``stall_timeout``, ...), or a generic one
        (``process``, ``start``, ``node``) with the type `SpawnOptions` gives it, anywhere
        but in `SpawnOptions`, is a second declaration."""
        typed = annotations_of_options()
        again = [
            f"{module}: {where} declares {name}: {note}"
            for module, where, name, note in declarations()
            if where != "SpawnOptions"
            and (where, name) not in ALLOWED
            and (name in DISTINCT or note == typed[name])
        ]
        assert again == []

    def test_the_check_finds_a_second_declaration(self) -> None:
        typed = annotations_of_options()
        assert typed["stall_timeout"] == "float | None"
        assert typed["node"] == "str | tuple[str, ...] | None"
        assert ("_protocol", "SpawnOptions", "node", typed["node"]) in declarations()

    @pytest.mark.parametrize("spawn", [ActorSystem.spawn, SystemHandle.spawn])
    def test_spawn_declares_none_and_forwards_its_keywords(self, spawn: object) -> None:
        assert callable(spawn)
        params = inspect.signature(spawn).parameters
        assert list(params) == ["self", "actor", "args", "name", "kwargs"]
        assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD

    def test_every_field_is_taken_from_spawns_keywords_and_only_those(self) -> None:
        given = {name: getattr(SpawnOptions(), name) for name in OPTIONS}
        how, rest = SpawnOptions.take({**given, "size": 3})
        assert rest == {"size": 3}
        assert msgspec.structs.asdict(how) == given

    def test_a_child_spec_is_spawn_options_and_names_none_of_its_own(self) -> None:
        assert issubclass(ChildSpec, SpawnOptions)
        spec = ChildSpec("tests.unit._messages:Echo", name="e", stall_timeout=2.0)
        assert spec.options() == SpawnOptions(stall_timeout=2.0)
        assert set(ChildSpec.__annotations__).isdisjoint(OPTIONS)

    def test_the_spawn_spec_and_the_remote_request_embed_the_structs(self) -> None:
        fields = {f.name: f.type for f in msgspec.structs.fields(SpawnSpec)}
        assert fields["target"] is SpawnTarget
        assert fields["how"] is SpawnOptions
        remote = {f.name: f.type for f in msgspec.structs.fields(RemoteSpawn)}
        assert remote["target"] is SpawnTarget
        assert remote["how"] is SpawnOptions


class TestOptionsRuleEachOtherOut:
    @pytest.mark.parametrize(
        ("options", "match"),
        [
            ({"stall_timeout": 0.0}, "must be positive"),
            # NaN: the probe's deadline raised in the system's task group, ending the system.
            ({"stall_timeout": math.nan}, "stall_timeout=nan must be positive"),
            ({"spawn_timeout": math.nan}, "spawn_timeout=nan must be positive"),
            ({"spawn_timeout": -1.0}, "spawn_timeout=-1.0 must be positive"),
            ({"spawn_timeout": 0.0}, "spawn_timeout=0.0 must be positive"),
            # NaN: the stop's deadline raised when the system closed, ending it with an error.
            ({"shutdown_timeout": math.nan}, "shutdown_timeout=nan must be 0 or more"),
            ({"shutdown_timeout": -1.0}, "shutdown_timeout=-1.0 must be 0 or more"),
            ({"stall_timeout": 1.0, "process": False}, "stall_timeout is for actor processes"),
            ({"node": "n", "process": False}, "node= starts a process on another host"),
            ({"node": "n", "inherit": (3,)}, "inherit= cannot cross to another host"),
        ],
    )
    def test_each_refusal_names_the_knob(self, options: dict[str, object], match: str) -> None:
        with pytest.raises(ValueError, match=match):
            SpawnOptions.take(options)
        with pytest.raises(ValueError, match=f"ChildSpec 'c': .*{match}"):
            ChildSpec("m:C", name="c", **options)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("options", "match"),
        [
            ({"process": "no"}, r"process='no': Expected `bool`"),
            ({"spawn_timeout": "5"}, r"spawn_timeout='5': Expected `float \| null`"),
            ({"inherit": (3, "4")}, r"inherit=\(3, '4'\): Expected `int`"),
            ({"node": 5}, r"node=5: Expected `str \| array \| null`"),
        ],
    )
    def test_an_option_of_another_type_is_refused_naming_it(
        self, options: dict[str, object], match: str
    ) -> None:
        # msgspec checks a struct's types when it decodes it only: before, `spawn` went on
        # with process='no' (truthy), and a ChildSpec's failed at each restart.
        with pytest.raises(TypeError, match=match):
            SpawnOptions.take(options)
        with pytest.raises(TypeError, match=f"ChildSpec 'c': {match}"):
            ChildSpec("m:C", name="c", **options)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("fields", "match"),
        [
            ({"kwargs": None}, r"kwargs=None: Expected `object`, got `null`"),
            ({"args": 5}, r"args=5: Expected `array`"),
            ({"kwargs": {1: "x"}}, r"kwargs=\{1: 'x'\}: Expected `str`"),
        ],
    )
    def test_a_child_spec_field_of_another_type_is_refused(
        self, fields: dict[str, object], match: str
    ) -> None:
        with pytest.raises(TypeError, match=f"ChildSpec 'c': {match}"):
            ChildSpec("m:C", name="c", **fields)  # type: ignore[arg-type]

    def test_what_a_user_writes_for_a_sequence_or_a_number_is_taken(self) -> None:
        spec = ChildSpec("m:C", name="c", args=[1, 2], inherit=[3], spawn_timeout=5)  # type: ignore[arg-type]
        assert spec.spawn_timeout == 5

    def test_none_is_filled_in_from_the_defaults_and_nothing_else(self) -> None:
        defaults = SpawnOptions(spawn_timeout=30.0, shutdown_timeout=5.0, start="spawn")
        given = SpawnOptions(shutdown_timeout=1.0, stall_timeout=2.0)
        assert given.over(defaults) == SpawnOptions(
            spawn_timeout=30.0, shutdown_timeout=1.0, stall_timeout=2.0, start="spawn"
        )


class TestTheRemoteRequestOnTheWire:
    def test_it_round_trips(self) -> None:
        request = RemoteSpawn(
            target=SpawnTarget(
                actor="tests.unit._messages:Echo",
                main="",
                name="echo",
                incarnation=3,
                args=[msgspec.Raw(msgspec.msgpack.encode(1))],
                kwargs={"size": msgspec.Raw(msgspec.msgpack.encode([1, 2]))},
            ),
            how=SpawnOptions(
                spawn_timeout=3.0, shutdown_timeout=1.5, stall_timeout=4.0, start="spawn"
            ),
            transport=msgspec.Raw(msgspec.msgpack.encode({"hwm": 10})),
            root="tcp://10.0.0.1:5000",
        )
        decoded = spawn_decoder.decode(msgspec.msgpack.encode(request))
        assert decoded.target.name == "echo"
        assert decoded.target.incarnation == 3
        assert [bytes(a) for a in decoded.target.args] == [msgspec.msgpack.encode(1)]
        assert msgspec.msgpack.decode(decoded.target.kwargs["size"]) == [1, 2]
        assert decoded.how == request.how
        assert msgspec.msgpack.decode(decoded.transport) == {"hwm": 10}
        assert decoded.root == request.root
