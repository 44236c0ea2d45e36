"""Both ends of the channel that carries accepted connections to the worker processes.

The process that owns the listening socket accepts every connection and hands it, as a file
descriptor over a ``SOCK_SEQPACKET`` socket pair (``SCM_RIGHTS``), to one worker; from then
on the connection's bytes go straight to that worker's HTTP server. The worker answers each
connection it took with ``+`` and each one that closed with ``-``, so the owner knows how
many each worker serves, and which connections a worker that died had not taken yet (those
it hands to another: a connection waiting for a worker is never lost).

`ConnectionServer` is the worker's end: it feeds each connection to uvicorn's httptools
protocol, bounded (`actors.http._bounded`), as uvicorn's own server does for connections
it accepts itself.
"""

from __future__ import annotations

import array
import asyncio
import logging
import socket
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from runtime import Throttle

from ._bounded import BoundedProtocol
from ._config import ServeConfig

__all__ = ("CLOSED", "MARKS_PER_MESSAGE", "TAKEN", "ConnectionServer", "receive_fds")

logger = logging.getLogger("tokenyard.http")

#: A worker took a connection.
TAKEN = b"+"
#: A connection a worker had taken closed.
CLOSED = b"-"
#: Most descriptors one channel message carries.
MAX_FDS = 64
#: Most marks (`TAKEN`, `CLOSED`) in one channel message; the owner reads up to this.
MARKS_PER_MESSAGE = 4096
#: One line per interval for connections lost for want of a descriptor, however many.
_lost_log = Throttle(logger)


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
    if _flags & socket.MSG_CTRUNC:
        # The kernel could not give this process the descriptors (it has too many open):
        # those connections are closed; their clients see them close.
        _lost_log.error(
            "connections handed to this worker were lost: it has no descriptor left "
            "(raise its RLIMIT_NOFILE, or lower ServeConfig.max_connections)"
        )
    if not data and not fds:
        raise EOFError("the channel's other end closed")
    return data, list(fds)


class ConnectionServer:
    """Serves an ASGI app on the connections that arrive on a channel (a worker's end).

    Args:
        app: The ASGI application.
        channel: This process's end of the channel (an inherited descriptor).
        limits: The connections' bounds and timeouts.
        log_level: uvicorn's log level.
    """

    def __init__(
        self,
        app: Any,
        channel: int,
        *,
        limits: ServeConfig | None = None,
        log_level: str = "warning",
    ) -> None:
        self.limits = limits = limits or ServeConfig()
        # log_config=None: uvicorn's lines go to the process's own handler, in the format
        # of every process of the system (runtime._logging), not in uvicorn's.
        self.config = uvicorn.Config(
            app,
            http="httptools",
            # No websockets: an upgraded connection would leave BoundedProtocol (its
            # bounds, and the close told to the owner); an Upgrade header is not acted on.
            ws="none",
            lifespan="off",
            log_level=log_level,
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_keep_alive=limits.idle_timeout,  # type: ignore[arg-type]
        )
        self.config.load()
        self.state = ServerState()
        self.state.default_headers = list(self.config.encoded_headers)
        self.channel = socket.socket(fileno=channel)
        self.channel.setblocking(False)
        self._fd = channel
        # uvicorn's line for a request that is not HTTP, in uvicorn's logger as before, but
        # one throttle for all of this worker's connections: a client cannot flood the log.
        self._invalid_requests = Throttle(logging.getLogger("uvicorn.error"))
        self.served = 0
        #: Connections open now.
        self.open = 0
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = asyncio.Event()
        self._none_open = asyncio.Event()
        self._none_open.set()
        self._starting: set[asyncio.Task[None]] = set()
        #: Marks not yet sent to the owner, oldest first.
        self._marks = bytearray()
        self._flush_soon = False
        self._waiting_to_send = False

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
            if self._waiting_to_send:
                self._waiting_to_send = False
                self._loop.remove_writer(self._fd)
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
            data, fds = got
            for _ in range(data.count(b"C") - len(fds)):
                # Handed, and lost for want of a descriptor: taken and closed at once, so
                # that the owner lets go of its copy (its client sees the close) and pairs
                # the next TAKEN with the next connection.
                self._send(TAKEN + CLOSED)
            for fd in fds:
                # Taken the moment it is received, in order: from here on it lives and dies
                # with this process, and its owner can let go of its own copy.
                self._send(TAKEN)
                conn = socket.socket(fileno=fd)
                conn.setblocking(False)
                self.open += 1
                self._none_open.clear()
                task = loop.create_task(self._serve(conn))
                self._starting.add(task)
                task.add_done_callback(self._starting.discard)

    def _protocol(self) -> BoundedProtocol:
        return BoundedProtocol(
            self.config,
            self.state,
            limits=self.limits,
            draining=self._is_draining,
            closed=self._closed_one,
            invalid_requests=self._invalid_requests,
        )

    def _is_draining(self) -> bool:
        return self.draining

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(self._protocol, conn)
        except OSError as err:
            logger.debug("a handed-over connection was gone already: %s", err)
            conn.close()
            self._closed_one()
            return
        self.served += 1

    def _closed_one(self) -> None:
        self.open -= 1
        if not self.open:
            self._none_open.set()
        self._send(CLOSED)

    def _send(self, mark: bytes) -> None:
        """Tell the owner ``mark``: in order, never dropped. Marks go out together once this
        loop iteration is over, and wait here while the channel is full (an owner busy
        elsewhere), so the owner's counts never drift from what this worker serves."""
        self._marks += mark
        if not self._flush_soon and self._loop is not None:
            self._flush_soon = True
            self._loop.call_soon(self._flush_marks)

    def _flush_marks(self) -> None:
        self._flush_soon = False
        marks = self._marks
        while marks:
            chunk = bytes(marks[:MARKS_PER_MESSAGE])
            try:
                self.channel.send(chunk)
            except (BlockingIOError, InterruptedError):
                if not self._waiting_to_send and self._loop is not None:
                    self._waiting_to_send = True
                    self._loop.add_writer(self._fd, self._flush_marks)
                return
            except OSError:  # the owner is gone: nobody counts any more
                marks.clear()
                break
            del marks[: len(chunk)]
        if self._waiting_to_send and self._loop is not None:
            self._waiting_to_send = False
            self._loop.remove_writer(self._fd)

    def drain(self) -> None:
        """Close every connection with no request open, and every other one after the
        answer to its request; connections still handed to this worker are served the same
        way (one request each)."""
        self.draining = True
        for connection in list(self.state.connections):
            connection.shutdown()

    async def wait_closed(self) -> None:
        """Wait until no connection is open."""
        await self._none_open.wait()

    def close(self) -> None:
        """Stop taking connections and close every one now (answers unfinished or not)."""
        self.draining = True
        self._done.set()
        self._stop_reading()
        for connection in list(self.state.connections):
            transport = connection.transport
            if transport is not None:
                transport.abort()
        self.channel.close()
