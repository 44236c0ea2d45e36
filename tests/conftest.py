"""Suite-wide fixtures: the anyio backend and the leak guard every test runs under."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import select
import signal
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import zmq

from runtime import ActorRef

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

    from runtime import ActorSystem


def exits_within(pid: int, timeout: float) -> bool:
    """Whether ``pid`` has exited within ``timeout`` seconds (a zombie counts), waited on its
    pidfd (an event, not a timer loop), without reaping it. A pid already reaped has exited
    too: ``pidfd_open`` then finds no such process."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


@contextlib.contextmanager
def unread_mailbox(system: ActorSystem, hwm: int = 10) -> Iterator[ActorRef[Any]]:
    """A ref to a mailbox nobody reads: a bare PULL socket in ``system``'s directory, taking
    ``hwm`` messages, then full for good (closed on the way out)."""
    sock = system.station.ctx.socket(zmq.PULL)
    try:
        sock.setsockopt(zmq.RCVHWM, hwm)
        path = os.path.join(system.ipc_dir, "stuck")
        sock.bind(f"ipc://{path}")
        yield ActorRef("stuck", f"ipc://{path}")
    finally:
        sock.close(0)


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A directory of the test's own, short enough for ipc socket paths under it (107
    bytes at most): pytest's ``tmp_path`` can be too long for them."""
    with tempfile.TemporaryDirectory(prefix="ty-") as short:
        yield Path(short)


def stop_signals_by_default() -> None:
    """SIGINT, SIGTERM and SIGHUP as a terminal's program has them, for a child process
    that a test signals (``preexec_fn``): a suite run from a shell's background job
    ignores SIGINT, and so would the processes it starts, which keep a signal they were
    started ignoring ignored."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def process_title(pid: int) -> str:
    """A process's title (setproctitle rewrites its command line); '' once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def free_port() -> int:
    """A port nobody listens on now (bound to 0, then released for a server to take)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> None:
    """Give every ``async def`` test the task-leak guard (anyio runs them: anyio_mode=auto)."""
    if collector.istestfunction(obj, name) and inspect.iscoroutinefunction(obj):
        pytest.mark.usefixtures("no_task_leaks")(obj)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """tokenyard runs on asyncio."""
    return "asyncio"


def child_pids() -> set[int]:
    """Pids of this process's children (zombies included: an unreaped child is a leak)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            text = (task / "children").read_text()
        except FileNotFoundError:
            continue  # a thread that ended during the scan
        pids.update(int(p) for p in text.split())
    return pids


def is_fork_server(pid: int) -> bool:
    """Whether ``pid`` is an actor system's fork server (``runtime._forkserver``), by its
    command line: before it has set its title, or after."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"runtime._forkserver" in cmdline or b".fork-server:" in cmdline


def actor_pids() -> set[int]:
    """Pids of this process's child actor processes: its children but fork servers."""
    return {pid for pid in child_pids() if not is_fork_server(pid)}


def ipc_dirs() -> set[str]:
    """The private directories this process's actor systems created in the temp dir."""
    return {p.name for p in Path(tempfile.gettempdir()).glob(f"tokenyard-{os.getpid()}-*")}


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves a child process or an ipc directory behind."""
    procs_before, dirs_before = child_pids(), ipc_dirs()
    yield
    left_procs = child_pids() - procs_before
    left_dirs = ipc_dirs() - dirs_before
    assert not left_procs, f"child processes left behind: {sorted(left_procs)}"
    assert not left_dirs, f"ipc directories left behind: {sorted(left_dirs)}"


@pytest.fixture
async def no_task_leaks() -> AsyncIterator[None]:
    """Fail an async test that leaves a task running in its event loop."""
    before = asyncio.all_tasks()
    yield
    current = asyncio.current_task()
    left = [
        t
        for t in asyncio.all_tasks() - before
        if t is not current and not t.done() and not _is_test_runner(t)
    ]
    assert not left, f"tasks left running: {left}"


def _is_test_runner(task: asyncio.Task[object]) -> bool:
    """anyio's pytest runner keeps a task of its own alive between fixture and test."""
    name: str = getattr(task.get_coro(), "__qualname__", "")
    return name.endswith("_call_in_runner_task")
