"""Entry point of an actor process: ``python -m runtime._child`` (started by ``spawn``), or
`main` called in a fork of a fork server (`runtime._forkserver`), which reads its spec the
same way.

The actor lives the same life as an in-process one (`runtime._cell.live`); this module adds
only what a process needs: reading its spawn spec, its title, its ready report and last
words to the parent, its exit status, and dying with its parent.

Parent death is seen two ways: the kernel's parent-death signal (SIGTERM), and EOF on the
spec's pipe, read by a thread so that it is seen even when the event loop is stuck. Either
way the process removes its socket files, kills its own children outright, and dies; on the
pipe's EOF it dies by SIGKILL, so an actor that ignores SIGTERM cannot outlive its root.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import threading
from typing import TYPE_CHECKING

import anyio
import msgspec
from setproctitle import setproctitle

from ._logging import configure_logging
from ._spawn import SpawnSpec, read_spec, resolve_class
from ._transport import remove_sockets_of

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

    from ._system import ActorSystem

logger = logging.getLogger("tokenyard.child")

_PR_SET_PDEATHSIG = 1
#: ipc socket files this process bound; removed by hand when it dies by a signal.
_bound: list[str] = []
_spec: SpawnSpec | None = None
#: Pids of this process's own child actor processes, while they live.
_children: Callable[[], list[int]] = list


#: One clean-up at a time: the parent-death signal's handler and the pipe's watcher often
#: run together, and the watcher SIGKILLs the process when done, which must not cut the
#: other's removal of the directory short (each would skip what the other was removing).
_cleaning = threading.RLock()


def _clean_up() -> None:
    """Before dying of a signal: kill our own children outright (they would get only the
    parent-death SIGTERM, which one ignoring SIGTERM would survive), remove our socket
    files, and the system directory too when the root is gone."""
    with _cleaning:
        _clean_up_now()


def _clean_up_now() -> None:
    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        if _spec is not None:  # nobody reaps them now, to remove their files
            remove_sockets_of(_spec.ipc_dir, pid)
    for path in _bound:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if _spec is not None and not _alive(_spec.root_pid):
        shutil.rmtree(_spec.ipc_dir, ignore_errors=True)


def _die_by_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (an escalated stop, or the parent died) or SIGINT: clean up our files and
    go, by that signal."""
    _clean_up()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _watch_parent_pipe(fd: int) -> None:
    """EOF on the spec's pipe means the parent is gone: clean up, and die for sure."""
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass
    _clean_up()
    os.kill(os.getpid(), signal.SIGKILL)


#: The kernel's flag of a process that is exiting (``/proc/<pid>/stat``'s 9th field).
_PF_EXITING = 0x4


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a killed parent not yet reaped (a zombie) counts as dead, and
    so does one still exiting: its descriptors close (the end of file that wakes
    `_watch_parent_pipe`) before it is a zombie. So does one reaped between the two looks:
    `kill` finds a killed root's zombie, whoever waits for it reaps it, and its ``/proc``
    entry is gone when read. Taken for alive, that root's children would each skip removing
    the system directory, which would then outlive them all (left to the guardian)."""
    if not _signalable(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        state, flags = fields[0], int(fields[6])
    except (FileNotFoundError, ProcessLookupError):
        # Reaped since (or no /proc on this system): ask the kernel again.
        return _signalable(pid)
    except (OSError, IndexError, ValueError):
        return True
    return state not in (b"Z", b"X") and not flags & _PF_EXITING


def _signalable(pid: int) -> bool:
    """Whether ``pid`` exists (running, exiting or a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        pass
    return True


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _track(system: ActorSystem) -> None:
    """Keep what a signal's clean-up needs: the socket files bound, the children's pids."""
    global _children
    _children = system.child_pids
    _bound.extend(path for path in system.bound_paths() if path not in _bound)


async def _run(spec: SpawnSpec, cls: type | BaseException) -> int:
    from ._system import run_actor_process

    return await run_actor_process(spec, cls, _track)


def take_environment(env: dict[str, str]) -> None:
    """Make ``os.environ`` equal to ``env``, changing only the variables that differ.

    A forked actor shares its fork server's memory until it writes to it. Rebuilding the
    whole environment (``os.environ.clear()``, then every variable encoded and put again)
    wrote to about 230 kB of it, scattered: an idle actor's own memory fell from about
    6.0 to 5.8 MiB when only the differences were written (usually none: the fork server
    was started with the environment its parent still has).
    """
    for key in [key for key in os.environ if key not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def main() -> None:
    """Read the spawn spec, become the actor, serve until stopped."""
    global _spec
    _set_parent_death_signal()
    spec = _spec = read_spec(sys.stdin.buffer)
    name = spec.target.name
    if spec.env is not None:
        # A fork of a fork server: take the environment and directory its parent has now,
        # as a fresh interpreter is started with them.
        take_environment(spec.env)
        with contextlib.suppress(OSError):
            os.chdir(spec.cwd)
    # An interrupt is a stop from outside too (`kill -INT`): the same prompt end as a
    # SIGTERM's, reported as that signal. Left to Python, it would raise KeyboardInterrupt
    # in the loop, and the graceful close that follows waits for the actor's children to
    # stop, each for as long as its own shutdown timeout.
    signal.signal(signal.SIGINT, _die_by_signal)
    signal.signal(signal.SIGTERM, _die_by_signal)
    if not _alive(spec.root_pid):
        sys.exit(1)
    threading.Thread(
        target=_watch_parent_pipe, args=(sys.stdin.fileno(),), name="parent-pipe", daemon=True
    ).start()
    setproctitle(f"tokenyard::{name}:{os.getpid()}")
    sys.path[:] = spec.sys_path
    configure_logging(spec.log_level, name)
    # Import the actor's module (and __main__) before the loop starts, as a script's own
    # top level would: a script that runs a loop at import time must guard it with
    # `if __name__ == "__main__":`, exactly as with multiprocessing's spawn.
    cls: type | BaseException
    try:
        cls = resolve_class(spec.target.actor, spec.target.main)
    except Exception as err:  # noqa: BLE001 - reported to the parent as a SpawnError
        cls = err
    try:
        code = anyio.run(_run, spec, cls, backend="asyncio")
    except KeyboardInterrupt:
        code = 130
    except msgspec.DecodeError:
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
