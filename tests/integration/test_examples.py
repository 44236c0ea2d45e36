"""Every example in docs/examples/ and the README's example run and exit cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
#: Examples with a test of their own (they need a server, or arguments).
DRIVEN_ELSEWHERE = {"fastapi_app.py"}


def run_python(path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        check=False,
    )


@pytest.mark.parametrize(
    "example",
    [p for p in EXAMPLES if p.name not in DRIVEN_ELSEWHERE],
    ids=lambda p: p.name,
)
def test_each_docs_example_runs_to_a_clean_exit(example: Path) -> None:
    done = run_python(example)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "an example should show what it did"


def test_the_readme_example_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"```python\n(.*?)```", readme, re.S)
    assert match is not None
    script = tmp_path / "readme_example.py"
    script.write_text(match.group(1), encoding="utf-8")
    done = run_python(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "Pong(n=42)"
