"""How an actor process tells that its root is gone (`runtime._child._alive`), which decides
whether its clean-up removes the system directory."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

from runtime import _child

if TYPE_CHECKING:
    import pytest


def sleeper() -> subprocess.Popen[bytes]:
    """A process that stays alive until the test kills it (its sleep is its whole life,
    not a wait of the test's)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # sync-ok


class TestAlive:
    def test_a_running_process_is_alive(self) -> None:
        proc = sleeper()
        try:
            assert _child._alive(proc.pid)
        finally:
            proc.kill()
            proc.wait()

    def test_a_killed_process_not_yet_reaped_is_dead(self) -> None:
        proc = sleeper()
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped
        try:
            assert not _child._alive(proc.pid)
        finally:
            proc.wait()

    def test_a_process_reaped_between_the_two_looks_is_dead(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The race of a killed root: `kill(pid, 0)` still finds its zombie, then whoever
        # waits for it (the test that killed it) reaps it before `/proc/<pid>/stat` is read.
        proc = sleeper()
        proc.kill()
        proc.wait()
        real_kill, calls = os.kill, []

        def kill(pid: int, signum: int) -> None:
            calls.append(pid)
            if len(calls) > 1:
                real_kill(pid, signum)

        monkeypatch.setattr(os, "kill", kill)
        assert not _child._alive(proc.pid)
