"""``docs/tools/mermaid.py``: mermaid.js for the site, fetched with npm and checked, here
against a stand-in ``npm`` that packs a small package (no network)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "tools" / "mermaid.py"
BUNDLE = b"window.mermaid = {};\n"
LICENSE = b"The MIT License (MIT)\n"

FAKE_NPM = """\
import io, pathlib, sys, tarfile
args = sys.argv[1:]
assert args[:2] == ["pack", "--silent"], args
out = pathlib.Path(args[args.index("--pack-destination") + 1])
version = args[-1].removeprefix("mermaid@")
with tarfile.open(out / f"mermaid-{version}.tgz", "w:gz") as tgz:
    for name, data in (("package/dist/mermaid.min.js", BUNDLE), ("package/LICENSE", LICENSE)):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tgz.addfile(info, io.BytesIO(data))
"""


def fetch(tmp_path: Path, sha256: str, *, npm: bool = True) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if npm:
        fake = bin_dir / "npm"
        fake.write_text(
            f"#!{sys.executable}\nBUNDLE = {BUNDLE!r}\nLICENSE = {LICENSE!r}\n{FAKE_NPM}"
        )
        fake.chmod(0o755)
    env = dict(os.environ, PATH=str(bin_dir))
    return subprocess.run(
        [sys.executable, str(SCRIPT), "11.17.2", sha256, str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=30, check=False,
    )  # fmt: skip


def test_it_writes_the_bundle_and_its_license_when_the_hash_is_the_pinned_one(
    tmp_path: Path,
) -> None:
    done = fetch(tmp_path, hashlib.sha256(BUNDLE).hexdigest())
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "mermaid.min.js").read_bytes() == BUNDLE
    assert (tmp_path / "out" / "mermaid.LICENSE").read_bytes() == LICENSE


def test_another_hash_is_refused_in_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    done = fetch(tmp_path, "0" * 64)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert hashlib.sha256(BUNDLE).hexdigest() in line
    assert "not the pinned" in line
    assert not (tmp_path / "out").exists()


def test_without_npm_it_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    done = fetch(tmp_path, "0" * 64, npm=False)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("make docs needs npm to fetch mermaid.js once")
    assert not (tmp_path / "out").exists()


def test_the_site_names_the_copy_make_docs_puts_in_it() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "extra_javascript:\n  - assets/javascripts/mermaid.min.js\n" in config
    assert "exclude_docs: |\n  examples/\n  tools/\n" in config  # docs/tools/ is no page
