"""The parent's side of a fork server: start it, ask it for actor processes, reap it.

A `ForkServer` is owned by one ``ActorSystem`` (one per process that spawns). It starts
the `runtime._forkserver` process once, hands it a private socket, and turns each spawn into
a `ForkRequest` on that socket. The forked child is this process's own child (see
`runtime._clone`), so it is watched and reaped like a fresh interpreter, through a
`ForkedProcess` with the interface ``runtime._spawn.ChildProcess`` uses of a ``subprocess.Popen``.

If the server dies, requests in flight learn it from end of file on its socket: a request
whose child was forked still gets it (the child writes its own pid on its stdin socket
first thing), one whose child was not raises `ForkServerGone` and the system retries it on
a new server. A request is never left waiting: the spawn's timeout bounds it, and a server
that does not answer within it is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import anyio
import msgspec

from ._errors import SpawnError, run_to_its_end, to_its_end
from ._forkwire import COMMAND, PID, ForkRequest, Hello, Reply, encoder, reply_decoder
from ._spawn import ChildProcess, child_env

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._spawn import SpawnSpec

#: Seconds a closing server gets to exit on end of file before it is killed.
_CLOSE_GRACE = 2.0
_LENGTH_BYTES = 4


class ForkServerGone(Exception):
    """The server died before it forked the child of a request: nothing was started."""


class ForkRefused(Exception):
    """Importing ``module`` in the server started a thread: it can no longer fork.

    Attributes:
        module: The module whose import did it.
        threads: Threads the server had then.
    """

    def __init__(self, module: str, threads: int) -> None:
        super().__init__(f"importing {module!r} started a thread ({threads} threads)")
        self.module = module
        self.threads = threads


class ForkedProcess:
    """A forked actor process, seen by its parent as ``subprocess.Popen`` would show it.

    Args:
        pid: The child (this process's own child: it is reaped here).
        stdin: This end of the child's stdin socket; closing it tells the child its
            parent is gone.
    """

    def __init__(self, pid: int, stdin: socket.socket) -> None:
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None

    def wait(self) -> int:
        """Reap the child (blocking until it exits) and return its status: negative for
        the signal that killed it, as ``subprocess.Popen.returncode``."""
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the child unless it was reaped (its pid may belong to another by then)."""
        if self.returncode is None:
            os.kill(self.pid, signum)


class ForkServer:
    """One fork server process and the requests in flight on its socket.

    Args:
        name: The system's name (in the server's process title).
        preload: Modules the server imports before it serves.
    """

    def __init__(self, name: str, preload: Sequence[str]) -> None:
        self.name = name
        self.preload = list(preload)
        self.process: ChildProcess | None = None
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._ready: asyncio.Future[Reply] | None = None
        #: Held by the request waiting for room on the socket (`_send`), and its wait.
        self._sending = asyncio.Lock()
        self._room: asyncio.Future[None] | None = None
        #: Set once the socket reached end of file (the server exited or was killed).
        self.gone = False
        #: Actor processes it forked.
        self.forked = 0
        #: Set when a request's timeout passed without its answer, and it was killed.
        self.stuck = False

    @property
    def pid(self) -> int | None:
        """The server's pid, once started."""
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        """Start the server process; it preloads while the caller goes on (`ready`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            popen = subprocess.Popen(
                [sys.executable, "-c", COMMAND, str(theirs.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                close_fds=True,
                # Its own process group, like every actor process (see ChildProcess.start).
                process_group=0,
                env=child_env(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.process = ChildProcess(popen)
        ours.setblocking(False)
        self._sock = ours
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._pending[0] = self._ready
        hello = Hello(name=self.name, preload=self.preload, sys_path=list(sys.path))
        ours.send(encoder.encode(hello))
        loop.add_reader(ours.fileno(), self._read)

    async def ready(self) -> None:
        """Wait until the server has preloaded and serves.

        Raises:
            ForkRefused: A preload started a thread.
            ForkServerGone: The server died first.
        """
        assert self._ready is not None
        reply = await asyncio.shield(self._ready)
        if reply.refused:
            raise ForkRefused(reply.refused, reply.threads)

    def _read(self) -> None:
        """Take every reply the socket holds; at end of file, fail what is pending."""
        sock = self._sock
        assert sock is not None
        while True:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            try:
                reply = reply_decoder.decode(data)
            except msgspec.DecodeError:
                continue  # only the server writes here; a bad frame is its bug, not ours
            future = self._pending.pop(reply.id, None)
            if future is not None and not future.done():
                future.set_result(reply)

    def _lost(self) -> None:
        self.gone = True
        if self._sock is not None:
            loop = asyncio.get_running_loop()
            loop.remove_reader(self._sock.fileno())
            # The request waiting for room sends now, and fails: the socket's number must
            # not stay watched once it is closed (a new server's socket may take it).
            loop.remove_writer(self._sock.fileno())
            if self._room is not None and not self._room.done():
                self._room.set_result(None)
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ForkServerGone())
                # Nobody may be waiting (a server started eagerly that died idle): that
                # is no error to log; whoever waits later gets it all the same.
                future.exception()

    async def fork(self, spec: SpawnSpec, payload: bytes, timeout: float) -> ChildProcess:
        """Ask for one actor process and hand it ``payload`` (its length-prefixed spec).

        Args:
            spec: What it runs (the module to import, the descriptors to pass).
            payload: The encoded spec, written on the child's stdin.
            timeout: Seconds the server has to answer; past them it is killed.

        Raises:
            ForkServerGone: The server died before it forked: retry on a new one.
            ForkRefused: The actor's module started a thread in the server.
            SpawnError: The server could not fork, or did not answer within ``timeout``.
        """
        await self.ready()
        ours, theirs = socket.socketpair()
        ours.setblocking(False)  # this end only: the child's end reads its spec blocking
        pid = 0
        try:
            # Waited for to its end: once the request is sent a child may exist, and only
            # the answer says which; a cancelled caller gets its cancellation right after.
            request = asyncio.ensure_future(self._request(spec, ours, theirs, timeout))
            cancelled = await run_to_its_end(request)
            if cancelled and request.exception() is not None:
                raise asyncio.CancelledError  # nothing was forked: no retry either
            pid = request.result()
        finally:
            theirs.close()
            if not pid:
                ours.close()
        proc = ChildProcess(ForkedProcess(pid, ours))
        if cancelled:
            proc.kill()
            await proc.reap()
            raise asyncio.CancelledError
        try:
            await asyncio.get_running_loop().sock_sendall(ours, payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died at once; wait() reports how
        except BaseException:
            proc.kill()
            await proc.reap()
            raise
        return proc

    async def _request(
        self, spec: SpawnSpec, ours: socket.socket, theirs: socket.socket, timeout: float
    ) -> int:
        request_id = next(self._ids)
        fds = _passed(spec.how.inherit)
        request = ForkRequest(
            id=request_id,
            actor=spec.target.actor,
            main=spec.target.main,
            sys_path=spec.sys_path,
            cwd=spec.cwd,
            fds=fds,
        )
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if self.gone:
            raise ForkServerGone()
        self._pending[request_id] = future
        reply: Reply | None = None
        sent = False
        # The timeout bounds the wait for room on the socket too: a server that takes no
        # request (stuck in an import, the requests before this one filling its socket's
        # buffer) must not hold a spawn for longer than its timeout.
        with anyio.move_on_after(timeout) as deadline:
            try:
                await self._send(encoder.encode(request), [theirs.fileno(), *fds])
            except OSError:
                self._pending.pop(request_id, None)
                raise ForkServerGone() from None
            sent = True
            theirs.close()  # the child's copy is all that must remain
            try:
                reply = await future
            except ForkServerGone:
                reply = None
        if reply is None:
            if deadline.cancelled_caught and not sent:
                # Queued behind requests that fill its socket: the server may be busy, not
                # stuck; a request it took and did not answer in time tells (below).
                self._pending.pop(request_id, None)
                raise SpawnError(
                    f"the fork server took no request for actor {spec.target.name!r} within "
                    f"the {timeout:.3g} s left of its spawn_timeout: the requests before it "
                    "fill its socket (too many spawns at once for that timeout, or a server "
                    "stuck in an import); a larger spawn(spawn_timeout=...), or start='spawn'"
                )
            if deadline.cancelled_caught:  # it did not answer in time: it is stuck, end it
                self._pending.pop(request_id, None)
                self.stuck = True
                self.kill()
            pid = await _self_reported(ours)
            if pid:
                self.forked += 1
                return pid
            if deadline.cancelled_caught:
                raise SpawnError(
                    f"the fork server did not fork actor {spec.target.name!r} within the "
                    f"{timeout:.3g} s left of its spawn_timeout "
                    f"(importing {spec.target.actor.partition(':')[0]!r} hangs?); a slow import "
                    "needs a larger spawn(spawn_timeout=...), or start='spawn'"
                )
            raise ForkServerGone()
        if reply.refused:
            raise ForkRefused(reply.refused, reply.threads)
        if reply.error or not reply.pid:
            raise SpawnError(
                f"the fork server could not fork actor {spec.target.name!r}: {reply.error}"
            )
        self.forked += 1
        return reply.pid

    async def _send(self, data: bytes, fds: list[int]) -> None:
        sock = self._sock
        assert sock is not None
        # One sender waits for room at a time: the event loop keeps one writer callback per
        # descriptor, so a second would replace the first's, whose wait would never end.
        async with self._sending:
            while True:
                try:
                    socket.send_fds(sock, [data], fds)
                    return
                except BlockingIOError:
                    await self._wait_for_room(sock)

    async def _wait_for_room(self, sock: socket.socket) -> None:
        """Until ``sock`` has room for a request, or the server is gone (`_lost`)."""
        if self.gone:
            return  # the next send says how
        loop = asyncio.get_running_loop()
        fd = sock.fileno()
        room = self._room = loop.create_future()
        loop.add_writer(fd, _resolve, room)
        try:
            await room
        finally:
            self._room = None
            if not self.gone:  # else `_lost` stopped the watch, before the socket closed
                loop.remove_writer(fd)

    def kill(self) -> None:
        """SIGKILL the server (its children, the actors, are not its own: they live on)."""
        if self.process is not None:
            self.process.signal(signal.SIGKILL)

    async def aclose(self) -> None:
        """Close the socket (the server exits on end of file), and reap the server; a
        cancellation meanwhile (anyio's or asyncio's) is raised once it is reaped."""
        if self._sock is not None:
            if not self.gone:
                self._lost()
            self._sock.close()
            self._sock = None
        if self.process is None:
            return
        # To its end: a shielded scope held off anyio's cancellation only, and asyncio's
        # (`Task.cancel`) left a server that did not exit running and unreaped.
        await to_its_end(_end(self.process))


async def _end(process: ChildProcess) -> None:
    """Give a fork server whose socket closed `_CLOSE_GRACE` seconds to exit, kill it
    after that, and reap it."""
    with anyio.move_on_after(_CLOSE_GRACE):
        await process.wait()
    process.kill()  # nothing once it is reaped
    await process.reap()


def _passed(inherited: Sequence[int]) -> list[int]:
    """The descriptors a child gets besides its stdin: this process's stdout and stderr
    (as a fresh interpreter would get them now) and the ``inherited`` ones, each under its
    number."""
    targets: list[int] = []
    for fd in (1, 2, *inherited):
        if fd in targets:
            continue
        try:
            os.fstat(fd)
        except OSError:
            if fd in (1, 2):
                continue  # closed here: the child keeps the server's
            raise SpawnError(
                f"inherit={list(inherited)}: descriptor {fd} is not open in this process"
            ) from None
        targets.append(fd)
    return targets


async def _self_reported(sock: socket.socket) -> int:
    """The pid a forked child wrote on its stdin socket, or 0 at end of file (no child)."""
    data = b""
    with contextlib.suppress(OSError):
        while len(data) < _LENGTH_BYTES:
            chunk = await asyncio.get_running_loop().sock_recv(sock, _LENGTH_BYTES - len(data))
            if not chunk:
                return 0
            data += chunk
    if len(data) < _LENGTH_BYTES:
        return 0
    (pid,) = PID.unpack(data)
    return int(pid)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # not given up meanwhile (cancelled in the same turn)
        future.set_result(None)
