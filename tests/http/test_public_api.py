"""actors.http's public surface: every public name listed, reported where users import it."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import msgspec

import actors.http


def test_every_public_name_is_in_all() -> None:
    public = {
        n
        for n, obj in vars(actors.http).items()
        if not n.startswith("_") and not isinstance(obj, ModuleType) and n != "annotations"
    }
    assert public == set(actors.http.__all__)
    assert isinstance(actors.http.__all__, tuple)


def test_public_classes_report_the_public_module() -> None:
    for name in actors.http.__all__:
        obj = getattr(actors.http, name)
        # msgspec structs keep their defining module, where msgspec resolves annotations.
        if isinstance(obj, type) and not issubclass(obj, msgspec.Struct):
            assert obj.__module__ == "actors.http", name


def test_every_private_module_imports() -> None:
    for info in pkgutil.iter_modules(actors.http.__path__):
        importlib.import_module(f"actors.http.{info.name}")
