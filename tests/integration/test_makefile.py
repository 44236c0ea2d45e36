"""What each ``make`` target installs and runs, read from ``make -n`` (a dry run: it prints
the commands a fresh checkout would run, and runs none)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dry_run(target: str, venv: Path) -> list[str]:
    """The commands ``make TARGET`` runs from scratch (``venv`` does not exist yet)."""
    done = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        check=True,
    )
    return done.stdout.splitlines()


def installed_extras(commands: list[str]) -> list[str]:
    """The extras of each ``pip install -e '.[...]'`` among ``commands``."""
    return [m.group(1) for c in commands if (m := re.search(r"pip install .*'\.\[([\w,]+)\]'", c))]


class TestMakeDocs:
    def test_it_installs_the_docs_extra_alone_under_a_marker_of_its_own(
        self, tmp_path: Path
    ) -> None:
        commands = dry_run("docs", tmp_path / "venv")
        assert installed_extras(commands) == ["docs"], commands
        assert f"touch {tmp_path / 'venv'}/.installed-docs" in commands
        assert any(c.endswith("mkdocs build --strict") for c in commands), commands

    def test_the_docs_extra_is_the_site_builder_and_nothing_of_the_dev_extra_but_ruff(
        self,
    ) -> None:
        with (ROOT / "pyproject.toml").open("rb") as f:
            extras = tomllib.load(f)["project"]["optional-dependencies"]
        names = {re.split(r"[<>=\[]", r, maxsplit=1)[0] for r in extras["docs"]}
        # mkdocstrings formats the separated signatures with ruff.
        assert names == {"mkdocs", "mkdocs-material", "mkdocstrings", "ruff"}

    def test_it_puts_mermaid_in_the_built_site(self, tmp_path: Path) -> None:
        commands = dry_run("docs", tmp_path / "venv")
        build = next(i for i, c in enumerate(commands) if c.endswith("mkdocs build --strict"))
        fetch = next(i for i, c in enumerate(commands) if "docs/tools/mermaid.py" in c)
        copy = next(i for i, c in enumerate(commands) if c.startswith("cp "))
        assert fetch < build < copy
        assert "mermaid.min.js" in commands[copy]
        assert commands[copy].endswith(" site/assets/javascripts/")

    @pytest.mark.parametrize("target", ["lint", "typecheck", "pytest"])
    def test_the_checks_keep_the_dev_and_docs_extras(self, tmp_path: Path, target: str) -> None:
        commands = dry_run(target, tmp_path / "venv")
        assert installed_extras(commands) == ["dev,docs"], commands
        assert f"touch {tmp_path / 'venv'}/.installed-test" in commands
