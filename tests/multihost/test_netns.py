"""The two "hosts" themselves (`benchmarks._netns`): what a run killed inside them leaves
behind is removed by the next run, and nothing else is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._netns import names, namespaces, sweep_orphans, two_hosts

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]

#: A run that makes the two hosts, says so, then waits to be killed.
_HOLDS_THEM = (
    "import sys, time\n"
    "from benchmarks._netns import two_hosts\n"
    "with two_hosts() as hosts:\n"
    "    print(hosts.netns, flush=True)\n"
    "    sys.stdin.read()\n"
)


def _links() -> str:
    return subprocess.run(
        ["ip", "-o", "link"], check=True, capture_output=True, text=True, timeout=10
    ).stdout


def test_what_a_run_killed_inside_them_left_is_removed_by_the_next() -> None:
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root: CI runs as root")
    run = subprocess.Popen(
        [sys.executable, "-c", _HOLDS_THEM],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        text=True,
    )
    assert run.stdout is not None
    try:
        left = run.stdout.readline().strip()
    finally:
        run.send_signal(signal.SIGKILL)  # no exit of its context: nothing is removed
        run.wait(timeout=30)
        run.stdout.close()
        if run.stdin is not None:
            run.stdin.close()
    netns, link_here, _ = names(str(run.pid))
    try:
        assert left == netns
        assert left in namespaces()  # left behind, with its veth end here
        assert link_here in _links()
        alive = set(namespaces())  # any other run's, side by side with this one, stays
        with two_hosts() as hosts:
            now = set(namespaces())
            assert left not in now
            assert link_here not in _links()
            assert hosts.netns in now
            assert (alive - {left}) <= now
        assert hosts.netns not in namespaces()
    finally:
        sweep_orphans()  # this test leaves nothing behind either, whatever failed
