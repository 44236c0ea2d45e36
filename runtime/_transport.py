"""ZeroMQ plumbing: socket options, readiness waits on the event loop, and the outbox.

Sockets are plain (synchronous) pyzmq sockets used with ``NOBLOCK``; the event loop only
learns of readiness through the socket's ``FD``. That lets a receiver drain everything queued
without an await per message, which is where most of an asyncio receiver's cost goes.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import msgspec
import zmq

from ._errors import MailboxClosedError, MailboxFullError, ProtocolError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class TransportOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Socket settings shared by every socket of a system (they travel to child processes).

    Attributes:
        hwm: High-water mark, in messages, of every send and receive queue (never 0).
        max_message_size: Largest frame accepted, in bytes; larger ones are refused.
        linger_ms: How long a closing socket may keep trying to deliver.
        send_timeout: Default seconds a ``tell`` waits on a full mailbox before failing.
        transport: ``"ipc"`` (default) or ``"tcp"``.
        tcp_host: Interface that ``tcp`` mailboxes bind to.
    """

    hwm: int = 10_000
    max_message_size: int = 64 * 1024 * 1024
    linger_ms: int = 1_000
    send_timeout: float = 10.0
    transport: str = "ipc"
    tcp_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.hwm <= 0:
            raise ValueError(f"hwm={self.hwm}: a high-water mark must be positive (0 is unbounded)")
        if self.max_message_size <= 0:
            raise ValueError(f"max_message_size={self.max_message_size} must be positive")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport={self.transport!r}: choose 'ipc' or 'tcp'")


def bind_pull(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str, stem: str, options: TransportOptions
) -> tuple[zmq.Socket[bytes], str]:
    """Bind a PULL socket (a mailbox or reply inbox) and return it with its address."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, options.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, options.max_message_size)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if options.transport == "ipc":
            sock.bind(f"ipc://{os.path.join(ipc_dir, stem)}")
        else:
            sock.bind(f"tcp://{options.tcp_host}:*")
    except zmq.ZMQError:
        sock.close(0)
        raise
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, address


def ipc_path(address: str) -> str | None:
    """The socket file behind an ``ipc://`` address, else ``None``."""
    return address[len("ipc://") :] if address.startswith("ipc://") else None


class ReadinessWaiter:
    """Lets any number of tasks wait until a zmq socket is readable or writable.

    The zmq ``FD`` is edge-triggered: it signals a change, and reading ``EVENTS`` consumes the
    signal. So a waiter always checks ``EVENTS`` before it sleeps, and one loop reader per
    socket wakes every waiter, which re-checks. The reader stays registered from the first
    wait until ``close``, as pyzmq's own asyncio sockets keep theirs: adding and removing it
    around every wait cost two ``epoll_ctl`` calls per message on a mailbox that is not
    busy. A signal nobody waits for is consumed by reading ``EVENTS``, so the loop never
    spins on it.
    """

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._fd = int(sock.getsockopt(zmq.FD))
        self._waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def _wake(self) -> None:
        if not self._waiters:
            events(self._sock)  # consume the edge nobody waits for
            return
        self._release()

    def _release(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, event: int) -> None:
        """Return once ``EVENTS`` has ``event`` (``POLLIN`` or ``POLLOUT``), or the waiter
        is closed (its socket with it)."""
        while not self._closed and not events(self._sock) & event:
            loop = asyncio.get_running_loop()
            if self._loop is not loop:
                self._watch(loop)
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if not fut.done():
                    fut.cancel()
                    self._waiters = [w for w in self._waiters if w is not fut]

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._loop = loop
        loop.add_reader(self._fd, self._wake)

    def close(self) -> None:
        """Stop watching the socket; pending waiters are woken."""
        self._closed = True
        self._release()
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None


# pyzmq's Python-level Socket.send/recv wrappers add about 0.4 us a call, and its flag enums
# about 0.7 us an operation (``int & PollEvent`` builds a new enum member); the hot path calls
# the Cython methods underneath directly, with plain int flags.
_send = zmq.backend.Socket.send
recv_frame = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK_MORE = NOBLOCK | SNDMORE


def events(sock: zmq.Socket[bytes]) -> int:
    """The socket's ``EVENTS`` bits; reading them also consumes the ``FD``'s signal."""
    value = _get(sock, _EVENTS)
    assert isinstance(value, int)
    return value


def recv_rest(sock: zmq.Socket[bytes], keep: int) -> list[bytes] | None:
    """Read the remaining parts of the message whose first part was just read.

    libzmq delivers a message's parts together, so they are all queued already. Reading by
    ``RCVMORE`` rather than by what a header announces means a header that lies about its
    frame count can never swallow the messages that follow it.

    Returns:
        The parts, or ``None`` when there were more than ``keep`` (all were consumed).
    """
    rest: list[bytes] = []
    while _get(sock, _RCVMORE):
        part = recv_frame(sock, NOBLOCK)
        if len(rest) <= keep:
            rest.append(part)
    return rest if len(rest) <= keep else None


#: Frames at least this large are sent zero-copy.
COPY_THRESHOLD = 64 * 1024


class _Peer:
    """One PUSH socket connected to one address."""

    __slots__ = ("sock", "waiter")

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.waiter = ReadinessWaiter(sock)


class Outbox:
    """The PUSH sockets of one process, one per destination address, made on first use.

    One socket per destination keeps every message from this process to that actor in one
    FIFO pipe: a stop request sent after a run of tells is handled after all of them.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], options: TransportOptions) -> None:
        self._ctx = ctx
        self._options = options
        self._max = options.max_message_size
        self._peers: dict[str, _Peer] = {}
        self._closed = False

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            if self._closed:
                raise MailboxClosedError("the outbox of this actor system is closed")
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self._options.hwm)
            sock.setsockopt(zmq.LINGER, self._options.linger_ms)
            try:
                sock.connect(address)
            except zmq.ZMQError as err:
                sock.close(0)
                raise ProtocolError(f"cannot connect to {address!r}: {err}") from err
            peer = self._peers[address] = _Peer(sock)
        return peer

    def _too_big(self, size: int) -> ProtocolError:
        return ProtocolError(
            f"a message of {size} bytes exceeds max_message_size={self._max}; "
            "raise it with ActorSystem(max_message_size=...)"
        )

    def try_send(self, address: str, frame: bytes) -> bool:
        """Send one frame if the queue has room now; ``False`` if it is full.

        Raises:
            ProtocolError: The frame is larger than ``max_message_size``.
        """
        if len(frame) > self._max:
            raise self._too_big(len(frame))
        peer = self._peers.get(address) or self._peer(address)
        try:
            _send(peer.sock, frame, NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def send(
        self,
        address: str,
        frame: bytes,
        timeout: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Send one frame, waiting while the destination's queue is full.

        ``check`` runs after each wait and may raise: the destination may have died while
        its queue was full, and its socket closed (a new one would take the frame and
        deliver it nowhere).

        Raises:
            MailboxFullError: The queue stayed full for ``timeout`` seconds.
            ProtocolError: The frame is larger than ``max_message_size``.
        """
        while not self.try_send(address, frame):
            await self._wait_writable(address, timeout)
            if check is not None:
                check()

    async def send_frames(
        self,
        address: str,
        frames: Sequence[bytes | bytearray | memoryview],
        timeout: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Send a multi-frame message atomically, waiting while the queue is full
        (``check`` as for `send`).

        Raises:
            MailboxFullError: The queue stayed full for ``timeout`` seconds.
            ProtocolError: The message is larger than ``max_message_size``.
        """
        size = sum(len(f) for f in frames)
        if size > self._max:
            raise self._too_big(size)
        while not self.try_send_frames(address, frames):
            await self._wait_writable(address, timeout)
            if check is not None:
                check()

    def try_send_frames(
        self, address: str, frames: Sequence[bytes | bytearray | memoryview]
    ) -> bool:
        """Send a multi-frame message if the queue has room now (never waits).

        Large frames go zero-copy; libzmq queues all parts of a message once the first
        is accepted, so only the first send can meet a full queue.
        """
        sock = (self._peers.get(address) or self._peer(address)).sock
        try:
            _send(sock, frames[0], _NOBLOCK_MORE)
        except zmq.Again:
            return False
        last = len(frames) - 1
        for i in range(1, last + 1):
            frame = frames[i]
            flags = 0 if i == last else SNDMORE
            if len(frame) < COPY_THRESHOLD:
                _send(sock, frame, flags)
            else:
                _send(sock, frame, flags, copy=False)
        return True

    async def _wait_writable(self, address: str, timeout: float | None) -> None:
        limit = self._options.send_timeout if timeout is None else timeout
        peer = self._peers.get(address) or self._peer(address)
        try:
            await asyncio.wait_for(peer.waiter.wait(POLLOUT), limit)
        except TimeoutError:
            raise MailboxFullError(
                f"the mailbox at {address} stayed full (hwm={self._options.hwm}) for "
                f"{limit:g} s; pass a longer tell(timeout=...) or raise ActorSystem(hwm=...)"
            ) from None

    def connected(self) -> list[str]:
        """The addresses this outbox has a socket to."""
        return list(self._peers)

    def forget(self, address: str) -> None:
        """Close the socket to an address that will never be served again."""
        peer = self._peers.pop(address, None)
        if peer is not None:
            peer.waiter.close()
            peer.sock.close(0)

    def close(self, linger_ms: int | None = None) -> None:
        """Close every socket (``linger_ms`` overrides the configured linger)."""
        self._closed = True
        for peer in self._peers.values():
            peer.waiter.close()
            peer.sock.close(self._options.linger_ms if linger_ms is None else linger_ms)
        self._peers.clear()
