"""The two "hosts" themselves (`benchmarks._netns`): what a run killed inside them leaves
behind is removed by the next run, and nothing else is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._netns import NETNS_PREFIX, sweep_orphans, two_hosts

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


def _namespaces() -> set[str]:
    listed = subprocess.run(
        ["ip", "netns", "list"], check=True, capture_output=True, text=True, timeout=10
    ).stdout
    return {line.split(" ", 1)[0] for line in listed.splitlines()}


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
    try:
        assert left == f"{NETNS_PREFIX}{run.pid}"
        assert left in _namespaces()  # left behind, with its veth end here
        assert f"tya{run.pid}" in _links()
        alive = _namespaces()  # any other run's, side by side with this one, stays
        with two_hosts() as hosts:
            now = _namespaces()
            assert left not in now
            assert f"tya{run.pid}" not in _links()
            assert hosts.netns in now
            assert (alive - {left}) <= now
        assert hosts.netns not in _namespaces()
    finally:
        sweep_orphans()  # this test leaves nothing behind either, whatever failed
