"""``Dispatcher``: the owner of the HTTP port, handing each connection to a worker process.

Why one owner, not a listener per worker: a ``SO_REUSEPORT`` listener per process resets
the connections waiting in its accept queue when its process dies, and a listening socket
that every worker inherits and accepts from itself is unbalanced (the kernel wakes the
waiters in an order that can give one worker most of the connections). Here the one
listening socket stays in the process that owns the pipeline, which accepts every
connection and gives it to the live worker serving the fewest, over that worker's channel
(`actors.http._connections`). So:

- **No waiting connection is lost.** A connection waits in the listener's accept queue, or
  in a worker's channel until that worker takes it; when a worker dies, the connections it
  had not taken go to another one. Only connections a worker had taken die with it (their
  clients see the connection close).
- **Balanced.** Connections go to the worker serving the fewest (ties in turn).
- **A restarted worker serves on the same port** as soon as it registers.

Only the connection's file descriptor crosses: the request's bytes go straight to the
worker, which answers on the same connection.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import logging
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from ._config import ServeConfig
from ._connections import CLOSED, TAKEN
from ._pipeline_engine import DEFAULT_CONTEXT_LENGTH
from ._worker import HttpSettings

if TYPE_CHECKING:
    from actors.messages import Origin

__all__ = ("DispatchStatistics", "Dispatcher")

logger = logging.getLogger("tokenyard.http")

#: Connections a listener keeps waiting for accept.
BACKLOG = 4096
#: How many handed connections `Dispatcher.recent` remembers.
RECENT = 100_000


class DispatchStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What the port's owner did.

    Attributes:
        accepted: Connections accepted.
        handed: Connections given to a worker, per worker index (re-handed ones counted
            again).
        rehanded: Connections a dying worker had not taken, given to another.
        open: Connections each live worker serves now, by worker index.
    """

    accepted: int
    handed: dict[int, int]
    rehanded: int
    open: dict[int, int]


@dataclass(eq=False)
class _Channel:
    origin: Origin
    sock: socket.socket
    #: Connections sent and not yet taken, oldest first (this process's copies).
    untaken: collections.deque[socket.socket] = field(default_factory=collections.deque)
    #: Connections the worker took and that are still open.
    open: int = 0


class Dispatcher:
    """Owns the listening socket and each worker's channel (`WorkerChannels` for
    `actors.PipelineSupervisor`).

    Args:
        host: The interface to listen on.
        port: The port (0: any free one; `address` says which).
        config: The HTTP layer's limits, for the workers.
        model: The model id (None: derived from the tokenizer).
        context_length: Most prompt plus completion tokens of one request.
        max_stream_buffer: Most bytes of a stream held for a client that does not read.
        backlog: Connections the listener keeps waiting.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        config: ServeConfig | None = None,
        model: str | None = None,
        context_length: int | None = None,
        max_stream_buffer: int = 4 << 20,
        backlog: int = BACKLOG,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((host, port))
            self.listener.listen(backlog)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self._template = HttpSettings(
            channel=-1,
            config=config or ServeConfig(),
            model=model,
            context_length=context_length or DEFAULT_CONTEXT_LENGTH,
            max_stream_buffer=max_stream_buffer,
        )
        self._pending: dict[int, tuple[socket.socket, socket.socket]] = {}
        #: Accepted connections no live worker could take yet (all were down).
        self._waiting: collections.deque[socket.socket] = collections.deque()
        self._channels: dict[int, _Channel] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._turn = 0
        self.accepted = 0
        self.rehanded = 0
        self.handed: collections.Counter[int] = collections.Counter()
        #: The latest connections handed: (the client's port, the worker incarnation).
        self.recent: collections.deque[tuple[int, Origin]] = collections.deque(maxlen=RECENT)
        self.closed = False

    # -- WorkerChannels -------------------------------------------------------------------

    def open(self, worker: int) -> int:
        """A new channel for worker ``worker``'s next start; its end for the worker."""
        self._drop_pending(worker)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        self._pending[worker] = (mine, theirs)
        return theirs.fileno()

    def settings(self, fd: int) -> HttpSettings:
        """What a worker needs to serve on the channel ``fd``."""
        return msgspec.structs.replace(self._template, channel=fd)

    def up(self, origin: Origin) -> None:
        """Worker incarnation ``origin`` registered: it gets connections from now on."""
        pending = self._pending.pop(origin.worker, None)
        if pending is None or self.closed:
            return
        mine, theirs = pending
        theirs.close()  # the worker holds its end: its death is an EOF here
        old = self._channels.get(origin.worker)
        if old is not None:
            self._remove(old)
        channel = self._channels[origin.worker] = _Channel(origin, mine)
        loop = self._running_loop()
        loop.add_reader(mine.fileno(), self._on_channel, channel)
        waiting, self._waiting = list(self._waiting), collections.deque()
        for conn in waiting:
            self._hand(conn)
        self._start_accepting()

    def down(self, origin: Origin) -> None:
        """Worker incarnation ``origin`` died: what it had not taken goes to the others."""
        channel = self._channels.get(origin.worker)
        if channel is not None and channel.origin == origin:
            self._remove(channel)
        pending = self._pending.get(origin.worker)
        if pending is not None and channel is None:
            self._drop_pending(origin.worker)

    # -- accepting ------------------------------------------------------------------------

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _start_accepting(self) -> None:
        if not self._accepting and self._channels and not self.closed:
            self._accepting = True
            self._running_loop().add_reader(self.listener.fileno(), self._on_accept)
            self._on_accept()

    def _stop_accepting(self) -> None:
        # With no worker, connections wait in the listener's queue, not here.
        if self._accepting:
            self._accepting = False
            self._running_loop().remove_reader(self.listener.fileno())

    def _on_accept(self) -> None:
        while self._channels:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                logger.warning("accept failed: %s", err)
                return
            self.accepted += 1
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._hand(conn)
        self._stop_accepting()

    def _hand(self, conn: socket.socket) -> None:
        """Give ``conn`` to the live worker serving the fewest (ties in turn)."""
        while self._channels:
            channel = self._least_busy()
            try:
                channel.sock.sendmsg(
                    [b"C"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_bytes(conn))]
                )
            except (BlockingIOError, InterruptedError):
                # Its channel is full (it is stuck): the others take the connection.
                logger.warning("%s takes no connections: trying another", channel.origin)
                self._remove(channel)
                continue
            except OSError as err:
                logger.info("%s is gone (%s): trying another", channel.origin, err)
                self._remove(channel)
                continue
            channel.untaken.append(conn)
            self.handed[channel.origin.worker] += 1
            with contextlib.suppress(OSError):
                self.recent.append((conn.getpeername()[1], channel.origin))
            return
        # No worker at all (only ever the connections a dying last worker had not taken:
        # no more are accepted meanwhile): it waits here for the next one.
        self._waiting.append(conn)

    def _least_busy(self) -> _Channel:
        channels = sorted(self._channels.values(), key=lambda c: c.origin.worker)
        self._turn += 1
        n = len(channels)
        order = [channels[(self._turn + i) % n] for i in range(n)]
        return min(order, key=lambda c: c.open + len(c.untaken))

    def _on_channel(self, channel: _Channel) -> None:
        while True:
            try:
                data = channel.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:  # the worker's process ended: its end closed
                self._remove(channel)
                return
            for mark in data:
                if mark == TAKEN[0] and channel.untaken:
                    channel.untaken.popleft().close()  # it holds its own copy now
                    channel.open += 1
                elif mark == CLOSED[0]:
                    channel.open = max(0, channel.open - 1)

    def _remove(self, channel: _Channel) -> None:
        if self._channels.get(channel.origin.worker) is channel:
            del self._channels[channel.origin.worker]
        with contextlib.suppress(ValueError, OSError):
            self._running_loop().remove_reader(channel.sock.fileno())
        channel.sock.close()
        untaken, channel.untaken = list(channel.untaken), collections.deque()
        for conn in untaken:  # it never took them: their clients are still waiting
            self.rehanded += 1
            self._hand(conn)
        if not self._channels:
            self._stop_accepting()

    def _drop_pending(self, worker: int) -> None:
        pending = self._pending.pop(worker, None)
        if pending is not None:
            for sock in pending:
                sock.close()

    # -- state ----------------------------------------------------------------------------

    def statistics(self) -> DispatchStatistics:
        """What was accepted and handed, and what each worker serves now."""
        return DispatchStatistics(
            accepted=self.accepted,
            handed=dict(self.handed),
            rehanded=self.rehanded,
            open={k: c.open for k, c in sorted(self._channels.items())},
        )

    def close(self) -> None:
        """Stop accepting, close the listener and every channel (workers finish theirs)."""
        if self.closed:
            return
        self.closed = True
        self._stop_accepting()
        self.listener.close()
        for channel in list(self._channels.values()):
            if self._channels.get(channel.origin.worker) is channel:
                del self._channels[channel.origin.worker]
            with contextlib.suppress(ValueError, OSError):
                self._running_loop().remove_reader(channel.sock.fileno())
            channel.sock.close()
            for conn in channel.untaken:
                conn.close()
        for conn in self._waiting:
            conn.close()
        self._waiting.clear()
        for worker in list(self._pending):
            self._drop_pending(worker)


def _fd_bytes(conn: socket.socket) -> bytes:
    return array.array("i", [conn.fileno()]).tobytes()
