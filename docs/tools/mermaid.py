"""Fetch mermaid.js for the docs site, once: ``python docs/tools/mermaid.py VERSION SHA256 DIR``.

mkdocs-material draws the site's diagrams with mermaid.js, which it loads from a CDN unless
the page has it already: a reader without network access saw each diagram's source instead.
``make docs`` puts this pinned copy in the built site, where ``extra_javascript`` in
``mkdocs.yml`` names it, with mermaid's license beside it. It comes from the npm registry,
through npm (``npm pack``), and is checked against the SHA-256 pinned in the Makefile; it is
not committed: a 3.5 MB third-party bundle has no place in the repository.

Writes ``DIR/mermaid.min.js`` and ``DIR/mermaid.LICENSE``. Exit status 1, with one line on
standard error, when npm is missing or the file is not the one pinned.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

#: What is taken from the package, and the name it gets in the site.
FILES = {"package/dist/mermaid.min.js": "mermaid.min.js", "package/LICENSE": "mermaid.LICENSE"}


def fetch(version: str, sha256: str, out: Path) -> str | None:
    """Put mermaid ``version``'s bundle and license in ``out``; what went wrong, if anything."""
    npm = shutil.which("npm")
    if npm is None:
        return (
            "make docs needs npm to fetch mermaid.js once (the site's diagrams, readable "
            "offline): install it (apt-get install npm), or run mkdocs build for a site "
            "whose diagrams load mermaid from its CDN"
        )
    with tempfile.TemporaryDirectory() as tmp:
        packed = subprocess.run(
            [npm, "pack", "--silent", "--pack-destination", tmp, f"mermaid@{version}"],
            capture_output=True,
            text=True,
            check=False,
        )
        if packed.returncode != 0:
            return f"npm pack mermaid@{version} failed: {packed.stderr.strip()[-500:]}"
        (tarball,) = Path(tmp).glob("mermaid-*.tgz")
        staged = Path(tmp) / "out"
        staged.mkdir()
        with tarfile.open(tarball) as archive:
            for member, name in FILES.items():
                source = archive.extractfile(member)
                if source is None:
                    return f"mermaid@{version} has no {member}"
                (staged / name).write_bytes(source.read())
        got = hashlib.sha256((staged / "mermaid.min.js").read_bytes()).hexdigest()
        if got != sha256:
            return (
                f"mermaid@{version}'s dist/mermaid.min.js has SHA-256 {got}, not the pinned "
                f"{sha256}: check the release, then pin the new hash in the Makefile"
            )
        out.mkdir(parents=True, exist_ok=True)
        for name in FILES.values():
            shutil.copyfile(staged / name, out / name)
    return None


def main(argv: list[str]) -> int:
    """Fetch, or say in one line why not."""
    if len(argv) != 3:
        sys.stderr.write("usage: python docs/tools/mermaid.py VERSION SHA256 DIR\n")
        return 2
    version, sha256, out = argv
    problem = fetch(version, sha256, Path(out))
    if problem is not None:
        sys.stderr.write(problem + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
