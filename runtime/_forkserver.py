"""The fork server process: `main`, run as ``python -c`` `COMMAND` ``<fd> <parent pid>``.

One per ``ActorSystem`` that starts actors with ``start="fork-server"`` (`runtime._forking`
starts and talks to it). It imports the runtime and the system's ``preload`` modules once,
then forks one actor process per request, importing each actor's module the first time it
is asked for it. It never creates a ZeroMQ context, an event loop or a thread, and checks
after every import that nothing else did: a process with threads cannot be forked safely
(a lock held by another thread stays held forever in the copy), so an import that started
one is refused (`Reply.refused`) and the server exits rather than fork again.

Requests come on one end of a private ``SOCK_SEQPACKET`` socket pair, inherited from the
parent and reachable by no other process, as msgspec messages (`Hello`, then `ForkRequest`),
never pickle. Each request carries, as ``SCM_RIGHTS`` descriptors, the child's end of a
socket pair of its own (it becomes the child's stdin, on which the parent writes the
``SpawnSpec`` as it does for a fresh interpreter, and whose end of file tells the child that
its parent died), the parent's stdout and stderr, and the ``inherit=`` descriptors, each
then placed under the number the caller gave.

The child is forked with `runtime._clone.fork_sibling`: it is the *parent's* child, not
this server's, so the parent reaps it and sees its exit status and signal itself. This
server has no children, and dies with its parent (parent-death signal SIGKILL, and end of
file on its socket).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import importlib
import os
import signal
import socket
import sys
from typing import NoReturn

import anyio
import anyio.lowlevel
import msgspec

from . import _child
from ._cell import Cell
from ._clone import fork_sibling
from ._forkwire import (
    MAX_FDS,
    MAX_REQUEST,
    PID,
    ForkRequest,
    Hello,
    Reply,
    encoder,
    request_decoder,
)
from ._spawn import _import_main, decode_arguments, resolve_class

_PR_SET_PDEATHSIG = 1
#: What every fork server imports before it serves: the actor process's own code, and
#: what the child's event loop would otherwise import lazily when it starts.
BASE_PRELOAD = ("runtime._child", "anyio._backends._asyncio")


def thread_count() -> int:
    """Threads of this process, as the kernel counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


class _Refusal(Exception):
    """An import left this process unsafe to fork."""

    def __init__(self, module: str, threads: int) -> None:
        super().__init__(module)
        self.module = module
        self.threads = threads


def _import(module: str) -> None:
    """Import ``module``, then check that this process may still fork."""
    # A failed import is the child's to report: it imports the module again, and fails.
    with contextlib.suppress(Exception, SystemExit):
        importlib.import_module(module)
    threads = thread_count()
    if threads > 1:
        raise _Refusal(module, threads)
    zmq = sys.modules.get("zmq")
    if zmq is not None and getattr(zmq.Context, "_instance", None) is not None:
        raise _Refusal(module, threads)


def _run_an_event_loop() -> None:
    """Run an event loop through anyio for a few turns, as every child does first.

    Python specialises a function's code in place as it runs it: what runs here first is
    already specialised in the pages the children share, where each child would otherwise
    write, and so copy, them (an idle actor's private memory, 0.15 MiB less). The loop is
    closed after; it starts no thread.
    """

    async def ticks() -> None:
        for _ in range(32):
            await anyio.lowlevel.checkpoint()

    async def turns() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(ticks)

    anyio.run(turns)


class _Server:
    """The serving loop's state: the socket, and which modules are in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.imported: set[str] = set()
        #: The actor classes whose handlers and decoder are built.
        self.prepared: set[str] = set()
        self.frozen = False

    def send(self, reply: Reply) -> None:
        with contextlib.suppress(OSError):  # the parent is gone: the next recv says so
            self.sock.send(encoder.encode(reply))

    def preload(self, modules: list[str]) -> None:
        for module in modules:
            self.need(module)
        with contextlib.suppress(Exception):  # a warm-up only: the children run it anyway
            _run_an_event_loop()

    def need(self, module: str) -> None:
        if module in self.imported:
            return
        self.imported.add(module)
        _import(module)
        self.frozen = False

    def prepare(self, request: ForkRequest) -> None:
        """Import what the child will need, in the parent's path and directory."""
        if request.sys_path != sys.path:
            sys.path[:] = request.sys_path
        with contextlib.suppress(OSError):
            os.chdir(request.cwd)
        if request.main and "__mp_main__" not in sys.modules:
            self.imported.add("__mp_main__")
            try:
                _import_main(request.main)
            except (Exception, SystemExit):  # noqa: BLE001 - the child reports it
                sys.modules.pop("__mp_main__", None)
            if thread_count() > 1:
                raise _Refusal(request.main.partition(":")[2], thread_count())
            self.frozen = False
        self.need(request.actor.partition(":")[0])
        if request.actor not in self.prepared:
            self.prepared.add(request.actor)
            # Its handlers and mailbox decoder, built here once instead of in every child.
            with contextlib.suppress(Exception):  # a wrong class: its child reports it
                cls = resolve_class(request.actor, "")
                Cell.decoder_for(cls)
                decode_arguments(cls, (), {})  # what reads its annotations runs once here
            if thread_count() > 1:  # evaluating its annotations started one
                raise _Refusal(request.actor.partition(":")[0], thread_count())
            self.frozen = False
        if not self.frozen:  # something was imported since the last fork
            _reassert_environment()
            # Objects that exist now are never scanned by a child's collector, so its
            # collections do not write to (and so copy) the pages they share with us. The
            # server never collects (`runtime._forkwire.COMMAND`): a collection's freed
            # blocks would be holes in shared pages, which a child's allocations fill.
            gc.freeze()
            self.frozen = True


def _reassert_environment() -> None:
    """Write every variable of ``os.environ`` to the C environment again.

    An import may have changed the C environment behind ``os.environ``'s back
    (``os.putenv``, a C extension's ``setenv``), and a forked child takes its parent's
    environment by changing only the variables whose ``os.environ`` value differs
    (`runtime._child.take_environment`): it would have kept such a change.
    """
    for key, value in os.environ.items():
        os.putenv(key, value)


def _send_fail(server: _Server, request_id: int, err: BaseException) -> None:
    server.send(Reply(id=request_id, error=f"{type(err).__name__}: {err}"))


def serve(sock: socket.socket) -> tuple[ForkRequest, list[int]] | None:
    """Preload, then fork per request until the parent closes its end.

    Returns:
        In a forked child: its request and descriptors; ``None`` in the server, at the end.
    """
    server = _Server(sock)
    data = sock.recv(MAX_REQUEST)
    if not data:
        return None
    hello = request_decoder.decode(data)
    assert isinstance(hello, Hello)
    from setproctitle import setproctitle

    setproctitle(f"tokenyard::{hello.name}.fork-server:{os.getpid()}")
    sys.path[:] = hello.sys_path
    try:
        server.preload([*BASE_PRELOAD, *hello.preload])
    except _Refusal as refusal:
        server.send(Reply(id=0, refused=refusal.module, threads=refusal.threads))
        return None
    server.send(Reply(id=0, pid=os.getpid()))
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, MAX_FDS)
        except OSError:
            return None
        if not data:
            return None
        try:
            request = request_decoder.decode(data)
        except msgspec.DecodeError as err:
            for fd in fds:
                os.close(fd)
            _send_fail(server, 0, err)
            continue
        assert isinstance(request, ForkRequest)
        if len(fds) != len(request.fds) + 1:
            for fd in fds:
                os.close(fd)
            _send_fail(server, request.id, ValueError("descriptors do not match the request"))
            continue
        try:
            server.prepare(request)
        except _Refusal as refusal:
            for fd in fds:
                os.close(fd)
            server.send(Reply(id=request.id, refused=refusal.module, threads=refusal.threads))
            return None
        try:
            pid = fork_sibling()
        except OSError as err:
            for fd in fds:
                os.close(fd)
            _send_fail(server, request.id, err)
            continue
        if pid == 0:
            return request, fds
        for fd in fds:
            os.close(fd)
        server.send(Reply(id=request.id, pid=pid))


def _place(fds: list[int], targets: list[int]) -> None:
    """Put each received descriptor under its number (the first on 0), closing the rest."""
    # Move them all above every number in play first, so no dup2 clobbers one not yet
    # placed (a received descriptor may already sit on another's target number).
    floor = max([*fds, *targets, 2]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for src, dst in zip(moved, [0, *targets], strict=True):
        os.dup2(src, dst, inheritable=True)
        os.close(src)


def become_actor(request: ForkRequest, fds: list[int], sock: socket.socket) -> NoReturn:
    """In the forked child: report the pid, take the descriptors, run the actor process."""
    gc.enable()  # the server's objects are frozen: a collection here scans the child's own
    with contextlib.suppress(OSError):
        # The parent reads this only if the server dies before its reply: then this is how
        # it learns that the child exists, and that it must reap it.
        os.write(fds[0], PID.pack(os.getpid()))
    sock.close()
    # Its own process group in its parent's session, as a fresh interpreter gets.
    os.setpgid(0, 0)
    _place(fds, request.fds)
    _child.main()
    sys.exit(0)  # main() always exits; this satisfies NoReturn


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the signal was asked for
        sys.exit(1)


def main() -> None:
    """Serve the parent until it closes the socket; in a forked child, become the actor."""
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(parent)
    sock = socket.socket(fileno=fd)
    forked = serve(sock)
    if forked is None:
        # No interpreter shutdown: it would wait for any thread a refused import started.
        os._exit(0)
    request, fds = forked
    become_actor(request, fds, sock)
