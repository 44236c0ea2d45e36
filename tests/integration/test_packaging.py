"""``python -m build`` makes an sdist and a wheel that install into a clean venv and work.

The build runs on a copy of the source tree, so it writes no ``build/`` or ``*.egg-info`` into
the checkout. Without flags, ``python -m build`` builds the sdist and then the wheel *from the
sdist*: the wheel installed here proves the sdist complete too. The venv is made without
system site packages and without pip of its own (this interpreter's pip installs into it
with ``--python``, which saves ensurepip's seconds); the wheel's dependencies come from the
package index, through pip's cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What the wheel must carry besides the modules (the sdist too, under its top directory).
DATA_FILES = ("actors/data/tokenizer.json", "runtime/py.typed", "actors/py.typed")
#: Never copied into the build tree: environments, caches, VCS, earlier build output.
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    "site",
    "bench-results",
    ".*_cache",
    ".hypothesis",
)

pytestmark = pytest.mark.timeout(300)


def clean_env() -> dict[str, str]:
    """This environment minus what would let the venv see the source tree or this venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean_env(),
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, (
        f"{' '.join(command)} exited with {done.returncode}:\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@dataclass(frozen=True)
class Dist:
    wheel: Path
    sdist: Path


@dataclass(frozen=True)
class Installed:
    python: Path
    outside: Path  # a working directory outside the repository


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """The sdist and the wheel, built from a copy of the source tree."""
    source = tmp_path_factory.mktemp("source") / "tokenyard"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE, symlinks=True)
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", str(out), str(source)], source, 240)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return Dist(wheels[0], sdists[0])


@pytest.fixture(scope="module")
def installed(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A fresh venv with the wheel and its ``pipeline`` extra installed."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], venv, 60)
    python = venv / "bin" / "python"
    cfg = (venv / "pyvenv.cfg").read_text()
    assert re.search(r"include-system-site-packages\s*=\s*false", cfg), cfg
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
    run([*pip, f"{dist.wheel}[pipeline]"], venv, 240)
    return Installed(python, tmp_path_factory.mktemp("elsewhere"))


def test_the_wheel_and_the_sdist_carry_the_tokenizer_and_the_type_markers(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = set(wheel.namelist())
        (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [
            line.removeprefix("Requires-Dist:").strip()
            for line in wheel.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    assert set(DATA_FILES) <= names, sorted(names)
    for dependency in ("pyzmq", "anyio", "msgspec", "setproctitle"):
        assert any(r.startswith(dependency) and "extra" not in r for r in requires), requires
    assert any(r.startswith("tokenizers") and "extra == " in r for r in requires), requires
    assert any(r.startswith("prometheus-client") and 'extra == "serve"' in r for r in requires), (
        requires
    )
    with tarfile.open(dist.sdist) as sdist:
        members = {m.name.partition("/")[2] for m in sdist.getmembers()}
    assert {*DATA_FILES, "pyproject.toml", "README.md"} <= members, sorted(members)


#: The MD5 of apache.org's https://www.apache.org/licenses/LICENSE-2.0.txt, the text the
#: Apache License asks to be copied unchanged.
APACHE_2_0_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


def test_the_license_file_is_the_apache_license_2_0_verbatim() -> None:
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.md5(text, usedforsecurity=False).hexdigest() == APACHE_2_0_MD5
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]


def test_the_wheel_and_the_sdist_carry_the_license(dist: Dist) -> None:
    text = (ROOT / "LICENSE").read_bytes()
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = wheel.namelist()
        (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        (license_file,) = (n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert wheel.read(license_file) == text
        fields = wheel.read(metadata).decode().splitlines()
    assert "License-Expression: Apache-2.0" in fields
    assert "License-File: LICENSE" in fields
    with tarfile.open(dist.sdist) as sdist:
        (member,) = (m for m in sdist.getmembers() if m.name.partition("/")[2] == "LICENSE")
        extracted = sdist.extractfile(member)
        assert extracted is not None
        assert extracted.read() == text


def extras() -> dict[str, list[str]]:
    """The optional dependencies of pyproject.toml, by extra, as project names."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        declared = tomllib.load(f)["project"]["optional-dependencies"]
    return {
        extra: [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements]
        for extra, requirements in declared.items()
    }


def make_run_extras() -> list[str]:
    """The extras ``make run`` installs (its pip line in the Makefile)."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    match = re.search(
        r"^\$\(VENV\)/\.installed-run:.*\n\t.*pip install .*'\.\[([\w,]+)\]'", makefile, re.M
    )
    assert match is not None, "no pip install line under .installed-run"
    return match.group(1).split(",")


def test_the_serve_extra_and_make_run_bring_what_metrics_needs() -> None:
    # Without prometheus-client, /metrics of `python -m actors serve` answers 501.
    found = extras()
    assert "prometheus-client" in found["serve"]
    assert "serve" in make_run_extras()
    for package in ("uvicorn", "httptools", "jinja2", "tokenizers"):
        assert package in found["serve"]


def test_make_run_brings_its_default_engine() -> None:
    # python -m actors serves through llama.cpp unless told --engine stand-in.
    assert "llamacpp" in make_run_extras()
    assert {"xllamacpp", "gguf"} <= set(extras()["llamacpp"])


def test_the_readme_example_runs_from_the_installed_wheel(installed: Installed) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"```python\n(.*?)```", readme, re.S)
    assert match is not None
    script = installed.outside / "readme_example.py"
    script.write_text(match.group(1), encoding="utf-8")
    done = run([str(installed.python), str(script)], installed.outside, 60)
    assert done.stdout.strip() == "Pong(n=42)", done.stderr[-3000:]


CHECK_INSTALL = """
import json
from importlib.metadata import version

import anyio

import actors
import runtime
from actors import Pipeline
from actors._tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer


async def generate() -> str:
    async with Pipeline(workers=1) as p:
        return (await p.generate("Hello from the wheel", max_new_tokens=8)).text


tokenizer = load_tokenizer()
ids = tokenizer.encode("Bonjour à tous 😀").ids
print(json.dumps({
    "files": [runtime.__file__, actors.__file__, str(DEFAULT_TOKENIZER_PATH)],
    "roundtrip": tokenizer.decode(ids),
    "versions": {
        d: version(d) for d in ("pyzmq", "anyio", "msgspec", "setproctitle", "tokenizers")
    },
    "generated": anyio.run(generate),
}))
"""


def test_the_installed_wheel_loads_its_bundled_tokenizer_and_serves(
    installed: Installed,
) -> None:
    script = installed.outside / "check_install.py"
    script.write_text(CHECK_INSTALL, encoding="utf-8")
    done = run([str(installed.python), str(script)], installed.outside, 120)
    report = json.loads(done.stdout)
    venv = installed.python.parent.parent
    for file in report["files"]:
        assert Path(file).is_relative_to(venv), f"{file} is not the installed copy"
    assert report["roundtrip"] == "Bonjour à tous 😀"
    assert set(report["versions"]) == {"pyzmq", "anyio", "msgspec", "setproctitle", "tokenizers"}
    assert report["generated"]
