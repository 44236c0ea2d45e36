"""``Dispatcher``: the owner of the HTTP port, handing each connection to a worker process.

Why one owner, not a listener per worker: a ``SO_REUSEPORT`` listener per process resets
the connections waiting in its accept queue when its process dies, and a listening socket
that every worker inherits and accepts from itself is unbalanced (the kernel wakes the
waiters in an order that can give one worker most of the connections). Here the one
listening socket stays in the process that owns the pipeline, which accepts every
connection and gives it to the live worker serving the fewest, over that worker's channel
(`actors.http._connections`). So:

- **No waiting connection is lost.** A connection waits in the listener's accept queue,
  in this process, or in a worker's channel until that worker takes it; when a worker
  dies, the connections it had not taken go to another one. Only connections a worker had
  taken die with it (their clients see the connection close).
- **Balanced.** Connections go to the worker serving the fewest (ties in turn).
- **A restarted worker serves on the same port** as soon as it registers.
- **No client, and no stall of a worker, cuts a worker off.** A worker holds at most
  `MAX_UNTAKEN` connections handed and not yet taken, and `ServeConfig.max_connections`
  in all; a full channel is back-pressure, never a death. What no worker can take now
  waits here, oldest first, up to `ServeConfig.max_waiting`; past that a new connection is
  answered 503 with ``Retry-After`` at once (`actors.http._refuse`), so the listen backlog
  never fills unseen. A worker that leaves connections untaken for
  `ServeConfig.take_timeout` is stuck: it is reported (its supervisor kills and restarts
  it) and gets nothing more meanwhile.
- **Never more connections than descriptors.** The owner holds at most ``hold``
  connections at once (waiting, handed and not taken, lingering after a 503), and keeps
  the last of them for the next one it accepts: a connection it cannot keep is answered
  503 and closed at once. `open_server` takes ``hold`` from the open-file limit, and bounds
  each worker's ``max_connections`` the same way (`actors.http._descriptors`): libzmq
  aborts a process that has no descriptor for a connection to its mailbox.
- **Out of descriptors** all the same (``EMFILE``: something else took them), the owner
  stops accepting for `FD_PAUSE` seconds instead of spinning on a listener that stays
  readable, as asyncio's own accept loop does, and says so once per interval.

Only the connection's file descriptor crosses: the request's bytes go straight to the
worker, which answers on the same connection.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import errno
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from runtime import Throttle

from ._config import ServeConfig
from ._connections import CLOSED, MARKS_PER_MESSAGE, TAKEN
from ._errors import HTTPError
from ._pipeline_engine import DEFAULT_CONTEXT_LENGTH
from ._refuse import Refuser
from ._worker import HttpSettings

if TYPE_CHECKING:
    from collections.abc import Callable

    from actors.messages import Origin

__all__ = ("DispatchStatistics", "Dispatcher")

logger = logging.getLogger("tokenyard.http")

#: Connections a listener keeps waiting for accept.
BACKLOG = 4096
#: How many handed connections `Dispatcher.recent` remembers.
RECENT = 100_000
#: Most connections handed to one worker and not yet taken: what a stopped worker holds
#: back from the others (the channel itself would hold a few hundred).
MAX_UNTAKEN = 64
#: Seconds accepting pauses when this process has no descriptor left.
FD_PAUSE = 0.25
#: What the owner answers when no worker can take a connection and its queue is full.
BUSY = HTTPError(
    503,
    "the server is at capacity: every worker serves its most connections and the queue of "
    "waiting ones is full (ServeConfig.max_connections, max_waiting, and the open-file "
    "limit, which may bound both); retry shortly",
    code="service_unavailable",
    headers=((b"retry-after", b"1"),),
)


class DispatchStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What the port's owner did.

    Attributes:
        accepted: Connections accepted.
        handed: Connections given to a worker, per worker index (re-handed ones counted
            again).
        rehanded: Connections a dying worker had not taken, given to another.
        open: Connections each live worker serves now, by worker index.
        waiting: Connections accepted and waiting here for a worker now.
        refused: Connections answered 503 because no worker could take them.
        stuck: Workers reported stuck (connections left untaken past take_timeout).
        fd_pauses: Times accepting paused for want of a descriptor.
        dropped: Connections a worker had taken that were still open when its channel
            closed: the worker died with them (a request in flight on one ended
            unanswered), or closed them at its drain's deadline.
    """

    accepted: int
    handed: dict[int, int]
    rehanded: int
    open: dict[int, int]
    waiting: int = 0
    refused: int = 0
    stuck: int = 0
    fd_pauses: int = 0
    dropped: int = 0


@dataclass(eq=False)
class _Channel:
    origin: Origin
    sock: socket.socket
    #: Connections sent and not yet taken, oldest first (this process's copies).
    untaken: collections.deque[socket.socket] = field(default_factory=collections.deque)
    #: Connections the worker took and that are still open.
    open: int = 0
    #: The kernel said the channel is full: nothing more until the worker takes some.
    blocked: bool = False
    #: Since when it has held untaken connections without taking any (``None``: it has
    #: none, or took one since the last was handed).
    stalled_since: float | None = None
    #: Reported stuck: it gets nothing more, and dies.
    stuck: bool = False


class Dispatcher:
    """Owns the listening socket and each worker's channel (`WorkerChannels` for
    `actors.PipelineSupervisor`).

    Args:
        host: The interface to listen on.
        port: The port (0: any free one; `address` says which).
        config: The HTTP layer's limits, here and in the workers.
        model: The model id (None: derived from the tokenizer).
        context_length: Most prompt plus completion tokens of one request.
        max_stream_buffer: Most bytes of a stream held for a client that does not read.
        backlog: Connections the listener keeps waiting.
        hold: Most connections this process holds at once, the one just accepted
            included: waiting, handed and not yet taken, or answered 503 and lingering
            (``None``: no bound but ``config``'s). At least 2.

    Attributes:
        created: When it started listening, Unix seconds: the model's ``created`` that
            every worker reports in ``/v1/models``.
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
        hold: int | None = None,
    ) -> None:
        if hold is not None and hold < 2:
            raise ValueError(
                f"Dispatcher hold={hold}: it must be at least 2 (one connection held, and "
                "one descriptor for the next to be answered with); raise the open-file limit"
            )
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
        self.config = config = config or ServeConfig()
        self.hold = hold
        self.created = int(time.time())
        self._template = HttpSettings(
            channel=-1,
            config=config,
            model=model,
            context_length=context_length or DEFAULT_CONTEXT_LENGTH,
            max_stream_buffer=max_stream_buffer,
            created=self.created,
        )
        self._pending: dict[int, tuple[socket.socket, socket.socket]] = {}
        #: Accepted connections no worker could take yet, oldest first.
        self._waiting: collections.deque[socket.socket] = collections.deque()
        self._channels: dict[int, _Channel] = {}
        self._refuser = Refuser(BUSY)
        #: Answers what no worker took once the pipeline failed (`fail`).
        self._failure: Refuser | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        #: Connections wait in the listen backlog until `release` (the server is ready).
        self._held = True
        self._listening = True
        self._paused: asyncio.TimerHandle | None = None
        self._checking: asyncio.TimerHandle | None = None
        self._stuck_report: Callable[[Origin, str], None] | None = None
        self._idle: asyncio.Event | None = None
        self._fd_log = Throttle(logger)
        self._turn = 0
        self.accepted = 0
        self.rehanded = 0
        self.stuck = 0
        self.fd_pauses = 0
        self.dropped = 0
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

    def report_stuck(self, report: Callable[[Origin, str], None]) -> None:
        """Call ``report`` with a worker incarnation that leaves connections untaken past
        ``take_timeout``, and why (its supervisor kills it)."""
        self._stuck_report = report

    def up(self, origin: Origin) -> None:
        """Worker incarnation ``origin`` registered: it gets connections from now on."""
        pending = self._pending.pop(origin.worker, None)
        if pending is None or self.closed or self._failure is not None:
            return
        mine, theirs = pending
        theirs.close()  # the worker holds its end: its death is an EOF here
        old = self._channels.get(origin.worker)
        if old is not None:
            self._remove(old)
        channel = self._channels[origin.worker] = _Channel(origin, mine)
        loop = self._running_loop()
        loop.add_reader(mine.fileno(), self._on_channel, channel)
        self._flush()
        self._start_accepting()

    def down(self, origin: Origin) -> None:
        """Worker incarnation ``origin`` died: what it had not taken goes to the others."""
        channel = self._channels.get(origin.worker)
        if channel is not None and channel.origin == origin:
            self._remove(channel)
        pending = self._pending.get(origin.worker)
        if pending is not None and channel is None:
            self._drop_pending(origin.worker)

    def fail(self, reason: str) -> None:
        """The pipeline failed and its workers are stopped: nothing more is served. What
        waits in the listen backlog is accepted and the listener closed (new clients are
        refused by the kernel, as in a drain), and every connection no worker took
        (waiting here, or handed and never taken) is answered 503 with ``reason`` rather
        than left unanswered until `close` resets it."""
        if self.closed or self._failure is not None:
            return
        error = HTTPError(
            503, reason, code="service_unavailable", headers=((b"retry-after", b"1"),)
        )
        failure = self._failure = Refuser(error)
        self._stop_accepting()
        if self._listening:
            self._accept_backlog()
        self.stop_listening()
        untaken: list[socket.socket] = []
        for channel in list(self._channels.values()):
            untaken += self._detach(channel)
        untaken.extend(self._waiting)
        self._waiting.clear()
        for conn in untaken:
            failure.refuse(conn)
        self._check_idle()

    def _accept_backlog(self) -> None:
        """Accept the connections of the listen backlog into the waiting queue, as many as
        this process may hold (those left are reset by the kernel with the listener)."""
        while self._room() and isinstance(conn := self._accept_one(), socket.socket):
            self._waiting.append(conn)

    def _accept_one(self) -> socket.socket | OSError | None:
        """The next connection of the listen backlog: ``None`` when there is none now, the
        error when there is no descriptor for it."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return err
                # The client gave up while it waited (ECONNABORTED, ...): the next one.
                logger.debug("accept failed: %s", err)
                continue
            self.accepted += 1
            return conn

    # -- accepting ------------------------------------------------------------------------

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _start_accepting(self) -> None:
        if (
            not self._accepting
            and not self._held
            and self._channels
            and self._listening
            and self._paused is None
            and not self.closed
        ):
            self._accepting = True
            self._running_loop().add_reader(self.listener.fileno(), self._on_accept)
            self._on_accept()

    def release(self) -> None:
        """Start handing connections to the workers that are up: until then, clients wait in
        the listen backlog (a worker up before the others, or before what the server's
        opener writes once all are, does not answer early)."""
        self._held = False
        self._start_accepting()

    def _stop_accepting(self) -> None:
        # With no worker, connections wait in the listener's queue, not here.
        if self._accepting:
            self._accepting = False
            self._running_loop().remove_reader(self.listener.fileno())

    def _on_accept(self) -> None:
        while self._accepting:
            conn = self._accept_one()
            if not isinstance(conn, socket.socket):
                if conn is not None:
                    self._pause_accepting(conn)
                return
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._place(conn)

    def _pause_accepting(self, err: OSError) -> None:
        """No descriptor left: a listener that stays readable must not be polled in a loop."""
        self.fd_pauses += 1
        self._fd_log.error(
            "cannot accept connections: %s; pausing %g s (raise this process's "
            "RLIMIT_NOFILE, or lower ServeConfig.max_waiting)",
            err.strerror,
            FD_PAUSE,
        )
        self._stop_accepting()
        self._paused = self._running_loop().call_later(FD_PAUSE, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._paused = None
        self._start_accepting()

    # -- handing over ---------------------------------------------------------------------

    def _place(self, conn: socket.socket) -> None:
        """A new connection goes to a worker now, else waits here, else is answered 503
        (and closed at once when this process may hold no more)."""
        if not self._room():
            self._refuser.refuse(conn, linger=False)
            return
        if not self._waiting and self._hand(conn):
            return
        if len(self._waiting) < self.config.max_waiting:
            self._waiting.append(conn)
            self._watch_stalls()
            return
        self._refuser.refuse(conn)

    def _room(self) -> bool:
        """Whether one more connection may be held: one descriptor of `hold` always stays
        free for the next connection accepted, to be answered with."""
        if self.hold is None:
            return True
        held = len(self._waiting) + self._refuser.lingering
        held += sum(len(c.untaken) for c in self._channels.values())
        if self._failure is not None:
            held += self._failure.lingering
        return held + 2 <= self.hold

    def _flush(self) -> None:
        """Hand what waits here, oldest first, while some worker has room."""
        waiting = self._waiting
        while waiting and self._hand(waiting[0]):
            waiting.popleft()
        self._check_idle()

    def _hand(self, conn: socket.socket) -> bool:
        """Give ``conn`` to the live worker with room serving the fewest (ties in turn);
        ``False`` when none has room."""
        while True:
            channel = self._least_busy()
            if channel is None:
                return False
            try:
                channel.sock.sendmsg(
                    [b"C"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_bytes(conn))]
                )
            except (BlockingIOError, InterruptedError):
                channel.blocked = True  # back-pressure: another worker, or wait
                continue
            except OSError as err:
                logger.info("%s is gone (%s): trying another", channel.origin, err)
                self._remove(channel)
                continue
            if not channel.untaken:
                channel.stalled_since = time.monotonic()
            channel.untaken.append(conn)
            self.handed[channel.origin.worker] += 1
            with contextlib.suppress(OSError):
                self.recent.append((conn.getpeername()[1], channel.origin))
            self._watch_stalls()
            return True

    def _least_busy(self) -> _Channel | None:
        limit = self.config.max_connections
        channels = [
            c
            for c in self._channels.values()
            if not (c.blocked or c.stuck)
            and len(c.untaken) < MAX_UNTAKEN
            and c.open + len(c.untaken) < limit
        ]
        if not channels:
            return None
        channels.sort(key=lambda c: c.origin.worker)
        self._turn += 1
        n = len(channels)
        order = [channels[(self._turn + i) % n] for i in range(n)]
        return min(order, key=lambda c: c.open + len(c.untaken))

    def _on_channel(self, channel: _Channel) -> None:
        room = False
        while True:
            try:
                data = channel.sock.recv(MARKS_PER_MESSAGE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:  # the worker's process ended: its end closed
                self._remove(channel)
                return
            for mark in data:
                if mark == TAKEN[0] and channel.untaken:
                    channel.untaken.popleft().close()  # it holds its own copy now
                    channel.open += 1
                    channel.blocked = False
                    channel.stalled_since = time.monotonic() if channel.untaken else None
                    room = True
                elif mark == CLOSED[0]:
                    channel.open = max(0, channel.open - 1)
                    room = True
        if room:
            self._flush()

    def _detach(self, channel: _Channel) -> collections.deque[socket.socket]:
        """Forget ``channel`` and close this end of it: the connections its worker never
        took are returned."""
        if self._channels.get(channel.origin.worker) is channel:
            del self._channels[channel.origin.worker]
        with contextlib.suppress(ValueError, OSError):
            self._running_loop().remove_reader(channel.sock.fileno())
        channel.sock.close()
        untaken, channel.untaken = channel.untaken, collections.deque()
        return untaken

    def _remove(self, channel: _Channel) -> None:
        self.dropped += channel.open  # they closed with it
        channel.open = 0
        untaken = self._detach(channel)
        # It never took them: their clients are still waiting, and have waited longest.
        self.rehanded += len(untaken)
        self._waiting.extendleft(reversed(untaken))
        if not self._channels:
            self._stop_accepting()
        self._flush()

    def _drop_pending(self, worker: int) -> None:
        pending = self._pending.pop(worker, None)
        if pending is not None:
            for sock in pending:
                sock.close()

    # -- stuck workers --------------------------------------------------------------------

    def _watch_stalls(self) -> None:
        """Look for stuck workers every quarter of take_timeout while any connection waits
        (for a worker, or here)."""
        if self._checking is None and not self.closed:
            delay = self.config.take_timeout / 4
            self._checking = self._running_loop().call_later(delay, self._check_stalls)

    def _check_stalls(self) -> None:
        self._checking = None
        now = time.monotonic()
        limit = self.config.take_timeout
        for channel in list(self._channels.values()):
            since = channel.stalled_since
            if channel.stuck or since is None or now - since < limit:
                continue
            channel.stuck = True
            self.stuck += 1
            reason = (
                f"it left {len(channel.untaken)} connection(s) untaken for {now - since:.1f} s "
                f"(ServeConfig.take_timeout={limit:g})"
            )
            logger.warning("worker %s takes no connections: %s", channel.origin, reason)
            if self._stuck_report is not None:
                self._stuck_report(channel.origin, reason)
        if self._waiting or any(c.untaken for c in self._channels.values()):
            self._watch_stalls()

    # -- draining -------------------------------------------------------------------------

    def stop_listening(self) -> None:
        """Accept what waits in the listen backlog, then close the listener: new clients
        are refused by the kernel; the connections accepted are still handed out."""
        if not self._listening:
            return
        if self._accepting:
            self._on_accept()
        self._listening = False
        self._stop_accepting()
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        self.listener.close()
        self._check_idle()

    def busy(self) -> bool:
        """Whether a connection is open in a worker or waits for one."""
        return bool(self._waiting) or any(c.open or c.untaken for c in self._channels.values())

    async def wait_idle(self) -> None:
        """Wait until no connection is open in any worker, nor waits for one."""
        while self.busy():
            idle = self._idle = self._idle or asyncio.Event()
            await idle.wait()

    def _check_idle(self) -> None:
        if self._idle is not None and not self.busy():
            self._idle.set()
            self._idle = None

    # -- state ----------------------------------------------------------------------------

    def statistics(self) -> DispatchStatistics:
        """What was accepted and handed, and what each worker serves now."""
        return DispatchStatistics(
            accepted=self.accepted,
            handed=dict(self.handed),
            rehanded=self.rehanded,
            open={k: c.open for k, c in sorted(self._channels.items())},
            waiting=len(self._waiting),
            refused=self._refuser.refused,
            stuck=self.stuck,
            fd_pauses=self.fd_pauses,
            dropped=self.dropped,
        )

    def close(self) -> None:
        """Stop accepting, close the listener and every channel (workers finish theirs)."""
        if self.closed:
            return
        self.closed = True
        self._stop_accepting()
        for timer in (self._paused, self._checking):
            if timer is not None:
                timer.cancel()
        self._listening = False
        self.listener.close()
        for channel in list(self._channels.values()):
            for conn in self._detach(channel):
                conn.close()
        for conn in self._waiting:
            conn.close()
        self._waiting.clear()
        self._refuser.close()
        if self._failure is not None:
            self._failure.close()
        for worker in list(self._pending):
            self._drop_pending(worker)
        if self._idle is not None:
            self._idle.set()


def _fd_bytes(conn: socket.socket) -> bytes:
    return array.array("i", [conn.fileno()]).tobytes()
