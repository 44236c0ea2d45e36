"""Entry point of an actor process: ``python -m runtime._child`` (started by ``spawn``)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
from typing import TYPE_CHECKING

import anyio
import msgspec
from setproctitle import setproctitle

from ._codec import ErrorBody, Kind, ReadyBody, body_encoder
from ._errors import sole_error
from ._spawn import SpawnSpec, read_spec, resolve_class

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

logger = logging.getLogger("tokenyard.child")

_PR_SET_PDEATHSIG = 1
#: ipc socket files this process bound; removed by hand when it dies by a signal.
_bound: list[str] = []
_spec: SpawnSpec | None = None
#: Pids of this process's own child actor processes, while they live.
_children: Callable[[], list[int]] = list


def _die_by_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (an escalated stop, or the parent died): clean up our files and go.

    Our own children are killed outright: they would get only the parent-death SIGTERM,
    which an actor that ignores SIGTERM would survive, outliving the whole tree.
    """
    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for path in _bound:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if _spec is not None and not _alive(_spec.root_pid):
        # The root cannot clean its directory any more: the tree it owned is going away.
        shutil.rmtree(_spec.ipc_dir, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a killed parent not yet reaped (a zombie) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


async def _report_failure(system: object, spec: SpawnSpec, err: BaseException) -> None:
    import traceback

    from ._system import ActorSystem

    assert isinstance(system, ActorSystem)
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    body = ErrorBody(f"{type(err).__module__}.{type(err).__qualname__}", str(err), tb)
    await system.node.send_control(
        spec.parent_reply, Kind.FAILED, spec.token, body_encoder.encode(body)
    )


async def _run(spec: SpawnSpec, cls: type | BaseException) -> int:
    from ._system import ActorSystem

    global _children
    system = ActorSystem._for_child(spec)
    _children = system.child_pids
    async with system:
        _bound.extend(system.bound_paths())
        try:
            if isinstance(cls, BaseException):
                raise cls
            cell = system._make_cell(
                cls, spec.args, spec.kwargs, spec.name, spec.incarnation, owner=spec.parent_reply
            )
        except Exception as err:  # noqa: BLE001 - reported to the parent as a SpawnError
            await _report_failure(system, spec, err)
            return 1
        _bound.extend(system.bound_paths())
        started = False

        async def on_ready() -> None:
            nonlocal started
            started = True
            ready = ReadyBody(cell.mailbox.address, os.getpid(), system.node.reply_address)
            await system.node.send_control(
                spec.parent_reply, Kind.READY, spec.token, body_encoder.encode(ready)
            )

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_parent_pipe)
                stop = await cell.run(on_ready)
                tg.cancel_scope.cancel()
        except Exception as group:  # the actor crashed: say why, then exit 1
            cause = sole_error(group)
            logger.error(
                "actor %s %s",
                spec.name,
                "crashed" if started else "failed to start",
                exc_info=cause,
            )
            # Before ready, this fails the spawn; after, these are the actor's last words,
            # which its parent puts in the Down reason.
            await _report_failure(system, spec, cause)
            return 1
        finally:
            system._drop_cell(cell)
        system.closing = True
        await system._close_children()
        await system.deliver_tells(skip=[cell.mailbox.address])
        if stop is not None:
            await system.node.reply(stop, None)
    return 0


async def _watch_parent_pipe() -> None:
    """EOF on stdin means the parent is gone (the portable half of parent-death)."""
    fd = sys.stdin.fileno()
    loop = asyncio.get_running_loop()
    while True:
        # A plain loop reader: anyio.wait_readable would import anyio's socket modules,
        # about 15 ms more on every actor start.
        readable: asyncio.Future[None] = loop.create_future()

        def wake(future: asyncio.Future[None] = readable) -> None:
            if not future.done():  # the reader may fire again before this task resumes
                future.set_result(None)

        loop.add_reader(fd, wake)
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        if not os.read(fd, 4096):
            os.kill(os.getpid(), signal.SIGTERM)
            return


def main() -> None:
    """Read the spawn spec, become the actor, serve until stopped."""
    global _spec
    _set_parent_death_signal()
    spec = _spec = read_spec(sys.stdin.buffer)
    signal.signal(signal.SIGTERM, _die_by_signal)
    if not _alive(spec.root_pid):
        sys.exit(1)
    setproctitle(f"tokenyard::{spec.name}:{os.getpid()}")
    sys.path[:] = spec.sys_path
    logging.basicConfig(
        level=spec.log_level, format=f"%(levelname)s [{spec.name}] %(name)s: %(message)s"
    )
    # Import the actor's module (and __main__) before the loop starts, as a script's own
    # top level would: a script that runs a loop at import time must guard it with
    # `if __name__ == "__main__":`, exactly as with multiprocessing's spawn.
    cls: type | BaseException
    try:
        cls = resolve_class(spec.actor, spec.main)
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
