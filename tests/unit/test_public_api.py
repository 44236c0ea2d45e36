"""The public surface: every public name exported, listed, and reported where users import it."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import msgspec
import pytest

import runtime
from runtime import (
    ActorDeadError,
    AskTimeoutError,
    MailboxClosedError,
    MailboxFullError,
    ProtocolError,
    RemoteActorError,
    SpawnError,
    TokenyardError,
)

PACKAGES = ["runtime", "actors"]


def package(name: str) -> ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_of_a_package_is_in_its_all(name: str) -> None:
    pkg = package(name)
    public = {
        n
        for n, obj in vars(pkg).items()
        if not n.startswith("_") and not isinstance(obj, ModuleType) and n != "annotations"
    }
    assert public == set(pkg.__all__)
    assert isinstance(pkg.__all__, tuple)


@pytest.mark.parametrize("name", PACKAGES)
def test_public_classes_report_the_public_module(name: str) -> None:
    pkg = package(name)
    for attr in pkg.__all__:
        obj = getattr(pkg, attr)
        # msgspec structs keep their defining module, where msgspec resolves annotations.
        if isinstance(obj, type) and not issubclass(obj, msgspec.Struct):
            assert obj.__module__ == name, attr


@pytest.mark.parametrize("name", PACKAGES)
def test_every_private_module_imports(name: str) -> None:
    pkg = package(name)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in {"__main__"}:
            importlib.import_module(f"{name}.{info.name}")


def test_runtime_never_imports_actors() -> None:
    for info in pkgutil.iter_modules(runtime.__path__):
        source = importlib.util.find_spec(f"runtime.{info.name}")
        assert source is not None
        assert source.origin is not None
        with open(source.origin, encoding="utf-8") as f:
            text = f.read()
        assert "import actors" not in text, info.name
        assert "from actors" not in text, info.name


class TestErrorTree:
    @pytest.mark.parametrize(
        "cls",
        [
            ActorDeadError,
            AskTimeoutError,
            MailboxClosedError,
            MailboxFullError,
            ProtocolError,
            RemoteActorError,
            SpawnError,
        ],
    )
    def test_every_error_has_the_one_root(self, cls: type[Exception]) -> None:
        assert issubclass(cls, TokenyardError)

    def test_timeouts_are_also_builtin_timeout_errors(self) -> None:
        assert issubclass(AskTimeoutError, TimeoutError)
        assert issubclass(MailboxFullError, TimeoutError)

    def test_a_remote_error_prints_the_remote_traceback(self) -> None:
        err = RemoteActorError("builtins.ValueError", "bad", "Traceback: here\n")
        assert "builtins.ValueError: bad" in str(err)
        assert "Traceback: here" in str(err)
