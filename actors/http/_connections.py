"""Both ends of the channel that carries accepted connections to the worker processes.

The process that owns the listening socket accepts every connection and hands it, as a file
descriptor over a ``SOCK_SEQPACKET`` socket pair (``SCM_RIGHTS``), to one worker; from then
on the connection's bytes go straight to that worker's HTTP server. The worker answers each
connection it took with ``+`` and each one that closed with ``-``, so the owner knows how
many each worker serves, and which connections a worker that died had not taken yet (those
it hands to another: a connection waiting for a worker is never lost).

`ConnectionServer` is the worker's end: it feeds each connection to uvicorn's HTTP protocol
(httptools when installed, else h11), as uvicorn's own server does for connections it
accepts itself.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.server import ServerState

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ("CLOSED", "TAKEN", "ConnectionServer", "receive_fds")

logger = logging.getLogger("tokenyard.http")

#: A worker took a connection.
TAKEN = b"+"
#: A connection a worker had taken closed.
CLOSED = b"-"
#: Most descriptors one channel message carries.
MAX_FDS = 64


def receive_fds(channel: socket.socket) -> tuple[bytes, list[int]] | None:
    """Read one message and the descriptors riding on it; ``None`` when there is none now.

    Raises:
        EOFError: The other end closed.
    """
    fds = array.array("i")
    try:
        data, ancillary, _flags, _addr = channel.recvmsg(
            16, socket.CMSG_SPACE(MAX_FDS * fds.itemsize)
        )
    except (BlockingIOError, InterruptedError):
        return None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % fds.itemsize
            fds.frombytes(payload[:usable])
    if not data and not fds:
        raise EOFError("the channel's other end closed")
    return data, list(fds)


class ConnectionServer:
    """Serves an ASGI app on the connections that arrive on a channel (a worker's end).

    Args:
        app: The ASGI application.
        channel: This process's end of the channel (an inherited descriptor).
        log_level: uvicorn's log level.
    """

    def __init__(self, app: Any, channel: int, *, log_level: str = "warning") -> None:
        # log_config=None: uvicorn's lines go to the process's own handler, in the format
        # of every process of the system (runtime._logging), not in uvicorn's.
        self.config = uvicorn.Config(
            app,
            lifespan="off",
            log_level=log_level,
            log_config=None,
            access_log=False,
            server_header=False,
        )
        self.config.load()
        self.state = ServerState()
        self.state.default_headers = list(self.config.encoded_headers)
        self.channel = socket.socket(fileno=channel)
        self.channel.setblocking(False)
        self._fd = channel
        self.served = 0
        self._protocol = _counted(self.config.http_protocol_class, self._closed_one)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = asyncio.Event()
        self._starting: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Serve until the channel's other end closes (this worker's task)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._on_readable)
        self._on_readable()  # what arrived before the reader existed
        try:
            await self._done.wait()
        finally:
            self._stop_reading()

    def _stop_reading(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def _on_readable(self) -> None:
        loop = self._loop
        if loop is None:
            return
        while not self._done.is_set():
            try:
                got = receive_fds(self.channel)
            except (EOFError, OSError) as err:
                logger.info("connection channel closed: %s", err)
                self._done.set()
                return
            if got is None:
                return
            for fd in got[1]:
                # Taken the moment it is received, in order: from here on it lives and dies
                # with this process, and its owner can let go of its own copy.
                self._send(TAKEN)
                conn = socket.socket(fileno=fd)
                conn.setblocking(False)
                task = loop.create_task(self._serve(conn))
                self._starting.add(task)
                task.add_done_callback(self._starting.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(lambda: self._protocol(self), conn)
        except OSError as err:
            logger.debug("a handed-over connection was gone already: %s", err)
            conn.close()
            self._send(CLOSED)
            return
        self.served += 1

    def _closed_one(self) -> None:
        self._send(CLOSED)

    def _send(self, what: bytes) -> None:
        with contextlib.suppress(OSError):  # the owner is gone: nobody counts any more
            self.channel.send(what)

    def close(self) -> None:
        """Ask every connection to finish its response and close; stop taking new ones."""
        self._done.set()
        self._stop_reading()
        for connection in list(self.state.connections):
            connection.shutdown()
        self.channel.close()


def _counted(base: type[Any], closed: Callable[[], None]) -> Callable[[ConnectionServer], Any]:
    """A factory of ``base`` protocols that report their connection's end to ``closed``."""

    class Counted(base):  # type: ignore[misc]
        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            closed()

    def make(server: ConnectionServer) -> Any:
        return Counted(config=server.config, server_state=server.state, app_state={})

    return make
