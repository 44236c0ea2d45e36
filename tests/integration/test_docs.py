"""The docs site builds with ``mkdocs build --strict`` and documents every public name.

mkdocs is imported, not skipped when missing: ``make test`` installs the docs extras, so a
missing mkdocs is a broken environment, and must fail like one.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import mkdocs
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Packages with an API reference page, docs/reference/<package>.md.
REFERENCED = sorted(p.stem for p in (ROOT / "docs" / "reference").glob("*.md"))
#: Seconds the strict build may take: up to ~50 on a loaded 2-core machine.
BUILD_TIMEOUT = 100
#: The tests that use the site pay for its build: more than the global 60 s timeout.
builds_the_site = pytest.mark.timeout(BUILD_TIMEOUT + 20)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
    done = subprocess.run(
        [*command, "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, (
        f"mkdocs {mkdocs.__version__} build --strict failed:\n{done.stderr[-5000:]}"
    )
    return out


@builds_the_site
def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    pages = sorted(p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.md"))
    for page in pages:
        html = site / page.with_suffix("") / "index.html"
        if page.name == "index.md":
            html = site / page.parent / "index.html"
        assert html.is_file(), f"{page} was not rendered"


@builds_the_site
@pytest.mark.parametrize("package", REFERENCED)
def test_the_api_reference_shows_every_public_name(site: Path, package: str) -> None:
    html = (site / "reference" / package / "index.html").read_text(encoding="utf-8")
    anchors = set(re.findall(rf'id="{package}\.(\w+)"', html))
    public: tuple[str, ...] = importlib.import_module(package).__all__
    missing = [name for name in public if name not in anchors]
    assert not missing, f"{package} names missing from its reference page: {missing}"


def test_the_home_page_example_is_the_readmes() -> None:
    def first_python_block(path: Path) -> str:
        match = re.search(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)
        assert match is not None, f"{path.name} has no python example"
        return match.group(1)

    assert first_python_block(ROOT / "docs" / "index.md") == first_python_block(
        ROOT / "README.md"
    ), "docs/index.md's example drifted from the README's (the README's is the tested one)"
