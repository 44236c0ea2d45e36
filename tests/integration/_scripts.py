"""The scripts of ``tests/integration/scripts``, run as a separate Python process each (a
root to kill, a host that forks), with this checkout on their path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"


def _command(name: str, args: tuple[str, ...]) -> list[str]:
    return [sys.executable, str(SCRIPTS / name), *args]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def run_script(name: str, *args: str) -> subprocess.Popen[str]:
    """Start script ``name``, its standard output a pipe."""
    return subprocess.Popen(
        _command(name, args), stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env()
    )


def run_script_to_end(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run script ``name`` to its end (at most ``timeout`` seconds), its output captured."""
    return subprocess.run(
        _command(name, args),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=timeout,
        check=False,
    )
