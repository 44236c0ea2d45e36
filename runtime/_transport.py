"""ZeroMQ plumbing: socket options, readiness waits on the event loop, and the outbox.

Sockets are plain (synchronous) pyzmq sockets used with ``NOBLOCK``; the event loop only
learns of readiness through the socket's ``FD``. That lets a receiver drain everything queued
without an await per message, which is where most of an asyncio receiver's cost goes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import resource
from typing import TYPE_CHECKING

import msgspec
import zmq

from ._auth import make_client, make_server
from ._errors import MailboxClosedError, MailboxFullError, ProtocolError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._auth import AddressPolicy, Keys
    from ._protocol import TellHeaders

#: The longest heartbeat, seconds: a day (libzmq's heartbeat settings, three heartbeats in
#: milliseconds in a C int, overflow past about eight).
MAX_HEARTBEAT = 86_400.0


class TransportOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Socket settings shared by every socket of a system (they travel to child processes).

    Attributes:
        hwm: High-water mark, in messages, of every send queue (never 0).
        rcvhwm: High-water mark, in messages, of every mailbox's receive queue in libzmq
            (never 0): with ``max_message_size`` it bounds what libzmq holds for a mailbox.
        max_message_size: Largest message accepted, in bytes; larger ones are refused.
        mailbox_bytes: Byte budget of a mailbox: messages read off its socket but not yet
            handled; past it, the mailbox reads no more until its handlers catch up.
        linger_ms: How long a closing socket may keep trying to deliver.
        send_timeout: Default seconds a ``tell`` waits on a full mailbox before failing.
        transport: ``"ipc"`` (default) or ``"tcp"``.
        tcp_host: Interface that ``tcp`` mailboxes bind to.
        max_peers: Most outgoing sockets a process keeps open; the least recently used is
            closed to make room (and reopened when needed again). Never more than
            `peer_limit` lets the file-descriptor limit hold.
        peer_idle: Seconds an outgoing socket may go unused before it is closed (so a
            process never keeps reconnecting to an address that is gone).
        curve: Encrypt and authenticate tcp with CURVE (the default). Turning it off is
            for measuring its cost only: anyone who can reach a port can then send to it.
        heartbeat: Over tcp, seconds without an answer after which a process that holds
            refs owned by another process (a node on another host) counts that owner as
            lost, and its actors ``Down`` with `Cause.NOCONNECTION` (`runtime._heartbeat`);
            above 0, at most `MAX_HEARTBEAT` (a day).
    """

    hwm: int = 1_000
    rcvhwm: int = 64
    max_message_size: int = 16 * 1024 * 1024
    mailbox_bytes: int = 64 * 1024 * 1024
    linger_ms: int = 1_000
    send_timeout: float = 10.0
    transport: str = "ipc"
    tcp_host: str = "127.0.0.1"
    max_peers: int = 512
    peer_idle: float = 60.0
    curve: bool = True
    heartbeat: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat <= MAX_HEARTBEAT:  # NaN too
            raise ValueError(
                f"heartbeat={self.heartbeat}: give seconds above 0 and at most "
                f"{MAX_HEARTBEAT:g} (a day)"
            )
        for name in ("send_timeout", "peer_idle"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(
                    f"{name}={getattr(self, name)}: give a finite number of seconds above 0"
                )
        for name in ("hwm", "rcvhwm"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(
                    f"{name}={value}: a high-water mark must be positive (0 is unbounded)"
                )
        for name in ("max_message_size", "mailbox_bytes", "max_peers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport={self.transport!r}: choose 'ipc' or 'tcp'")

    def memory_bound(self) -> int:
        """The most bytes one mailbox can hold: its budget (plus the one message that
        crosses it) and libzmq's receive queue."""
        return self.mailbox_bytes + (self.rcvhwm + 1) * self.max_message_size


def refuse_nan(timeout: float, what: str) -> None:
    """Refuse a timeout that is NaN before it reaches the event loop: asyncio keeps its
    timers in a heap ordered by comparison, which NaN answers ``False`` to, so one NaN timer
    can hold back every timer of the loop scheduled after it (the host's own included).

    Raises:
        ValueError: ``timeout`` is NaN.
    """
    if math.isnan(timeout):
        raise ValueError(f"{what}(timeout={timeout}): give a number of seconds, not NaN")


def bind_pull(
    ctx: zmq.Context[zmq.Socket[bytes]],
    ipc_dir: str,
    stem: str,
    options: TransportOptions,
    keys: Keys | None = None,
    port: int = 0,
) -> tuple[zmq.Socket[bytes], str]:
    """Bind a PULL socket (a mailbox or reply inbox) and return it with its address
    (over tcp on ``port``, or a free port when 0).

    Raises:
        ProtocolError: The socket could not be made or bound (out of file descriptors, the
            address is taken, ...).
    """
    try:
        sock = ctx.socket(zmq.PULL)
    except zmq.ZMQError as err:
        raise ProtocolError(f"cannot open a mailbox socket: {err}") from err
    sock.setsockopt(zmq.RCVHWM, options.rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, options.max_message_size)
    sock.setsockopt(zmq.LINGER, 0)
    if options.transport == "tcp":
        # A peer whose host vanished sends no FIN: ZeroMQ's own heartbeat (answered by the
        # peer's I/O thread, whatever its event loop does) ends such a connection after
        # three unanswered, and a handshake gets two heartbeats, not libzmq's 30 s, so
        # strangers that connect and stall hold their descriptors that much less.
        beat = max(round(options.heartbeat * 1000), 1)
        sock.setsockopt(zmq.HEARTBEAT_IVL, beat)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * beat)
        sock.setsockopt(zmq.HANDSHAKE_IVL, 2 * beat)
    try:
        make_server(sock, keys)
        if options.transport == "ipc":
            sock.bind(f"ipc://{os.path.join(ipc_dir, stem)}")
        else:
            sock.bind(f"tcp://{bracketed(options.tcp_host)}:{port or '*'}")
    except zmq.ZMQError as err:
        sock.close(0)
        raise ProtocolError(f"cannot bind a mailbox socket: {err}") from err
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, address


def bracketed(host: str) -> str:
    """``host`` as a tcp address spells it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def ipc_path(address: str) -> str | None:
    """The socket file behind an ``ipc://`` address, else ``None``."""
    return address[len("ipc://") :] if address.startswith("ipc://") else None


def close_listener(sock: zmq.Socket[bytes], address: str, bound_by: int) -> None:
    """Close a socket `bind_pull` bound at ``address`` and remove its ipc socket file,
    which libzmq leaves behind (a system's directory would otherwise hold one per actor
    that ever lived in it), unless this process is not ``bound_by`` (a fork of it: the
    file is still its parent's)."""
    sock.close(0)
    path = ipc_path(address)
    if path is not None and os.getpid() == bound_by:
        with contextlib.suppress(OSError):
            os.unlink(path)


def socket_stem(prefix: str, pid: int, nonce: str, n: int) -> str:
    """The name of an ipc socket file in a system's directory: a one-letter ``prefix``,
    then the binding process's pid, its station's ``nonce`` and a count, so that
    `remove_sockets_of` finds every file a process bound."""
    return f"{prefix}{pid}-{nonce}-{n}"


#: The longest socket file name `socket_stem` makes: the largest pid Linux gives
#: (``pid_max`` at most 2**22), a station's nonce (8 hex digits) and a count of 10 digits.
LONGEST_STEM = len(socket_stem("r", 2**22, "0" * 8, 10**9))


def check_ipc_dir(directory: str) -> None:
    """Refuse a system directory under which no socket file fits: an ipc path is at most
    ``zmq.IPC_PATH_MAX_LEN`` bytes (the size of ``sockaddr_un.sun_path``, 107 on Linux).

    Raises:
        ProtocolError: Naming the temporary directory, which ``TMPDIR`` sets.
    """
    longest = len(os.fsencode(os.path.join(directory, "x" * LONGEST_STEM)))
    limit = zmq.IPC_PATH_MAX_LEN
    if limit and longest > limit:
        parent = os.path.dirname(directory)
        raise ProtocolError(
            f"the temporary directory {parent!r} is too long for ipc sockets: their paths "
            f"are at most {limit} bytes, and one under it takes {longest}; set TMPDIR to a "
            f"directory at least {longest - limit} bytes shorter"
        )


def remove_sockets_of(directory: str, pid: int) -> None:
    """Remove every ipc socket file the dead process ``pid`` bound in ``directory`` (its
    system's; ``""``: none, tcp only): a process that ends by a signal cannot remove its
    own, and the directory would otherwise keep them until it is removed itself. The kernel
    gives a reaped pid to a new process only once the pids have wrapped around, so no live
    process's files have its name."""
    if not directory:
        return
    mark = f"{pid}-"
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name[1:].startswith(mark):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def unwatch(loop: asyncio.AbstractEventLoop, fd: int, pid: int) -> None:
    """Remove ``loop``'s reader of ``fd``, which process ``pid`` added; in a process forked
    from it, nothing: the child's copy of the loop shares its epoll set with the parent, and
    removing the reader there (as cancelling an in-process actor's task did, when the
    child's ``asyncio.run`` unwound) removed it from the parent's, whose actor never woke
    again."""
    if os.getpid() == pid:
        loop.remove_reader(fd)


class ReadinessWaiter:
    """Lets any number of tasks wait until a zmq socket is readable or writable.

    The zmq ``FD`` is edge-triggered: it signals a change, and reading ``EVENTS`` consumes the
    signal. So a waiter always checks ``EVENTS`` before it sleeps, and one loop reader per
    socket wakes every waiter, which re-checks. The reader stays registered from the first
    wait until ``close``, as pyzmq's own asyncio sockets keep theirs: adding and removing it
    around every wait cost two ``epoll_ctl`` calls per message on a mailbox that is not
    busy. The reader consumes every signal as it fires, by reading ``EVENTS``, whether
    anybody waits or not: so the loop never spins on one, nor reports it twice.
    """

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._fd = int(sock.getsockopt(zmq.FD))
        self._waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The process that added the loop's reader (`unwatch`).
        self._pid = 0
        self._closed = False
        #: The fd fired while nobody waited, since `rearmed` was last called.
        self._fired = False

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    @property
    def waiting(self) -> bool:
        """Whether a task waits on the socket now."""
        return bool(self._waiters)

    def _wake(self) -> None:
        # Consume the signal here, whoever waits. Left to the woken task's read, it was
        # still set when the loop polled again before running that task, and the stale
        # report woke the waiter the task had registered by then: a second wake-up per
        # message, with a loop iteration and a failed read (an actor answering asks did
        # three iterations per ask instead of two).
        events(self._sock)
        if not self._release():  # nobody to tell: the next `woken` returns at once
            self._fired = True

    def _release(self) -> bool:
        """Wake every waiter; whether one was still waiting."""
        waiters, self._waiters = self._waiters, []
        woke = False
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
                woke = True
        return woke

    async def wait(self, event: int) -> None:
        """Return once ``EVENTS`` has ``event`` (``POLLIN`` or ``POLLOUT``), or the waiter
        is closed (its socket with it)."""
        while not self._closed and not events(self._sock) & event:
            await self._woken()

    def rearmed(self) -> None:
        """Note that a non-blocking read just failed: it processed the socket's pending
        commands, which re-arms the fd just as reading ``EVENTS`` does."""
        self._fired = False

    async def woken(self) -> None:
        """Return once the socket's fd has fired since `rearmed` was last called (at once
        if it already did, while nobody waited), or the waiter is closed: for a reader
        that reads again next.

        A wake-up almost always means a message: unlike `wait`, this reads no ``EVENTS``
        before sleeping nor after waking (2 us each here); a spurious wake-up costs the
        reader one failed read instead.
        """
        if self._fired or self._closed:
            self._fired = False
            return
        await self._woken()

    async def _woken(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._watch(loop)
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            # Cancelled once woken, before it ran: the signal it was woken by is consumed,
            # so the next wait must not sleep on it.
            if fut.done() and not fut.cancelled():
                self._fired = True
            raise
        finally:
            if not fut.done() or fut.cancelled():
                fut.cancel()
                self._waiters = [w for w in self._waiters if w is not fut]

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not None:
            unwatch(self._loop, self._fd, self._pid)
        self._loop = loop
        self._pid = os.getpid()
        loop.add_reader(self._fd, self._wake)

    def close(self) -> None:
        """Stop watching the socket; pending waiters are woken."""
        self._closed = True
        self._release()
        if self._loop is not None:
            unwatch(self._loop, self._fd, self._pid)
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


def recv_rest(sock: zmq.Socket[bytes], keep: int, more: bool | None = None) -> list[bytes] | None:
    """Read the remaining parts of the message whose first part was just read.

    libzmq delivers a message's parts together, so they are all queued already. Reading by
    ``RCVMORE`` rather than by what a header announces means a header that lies about its
    frame count can never swallow the messages that follow it. The parts are read as
    frames, whose ``more`` pyzmq fills in as it reads each (its own ``RCVMORE`` query, in
    C): asking the socket from Python costs 0.7 us here, most of it pyzmq's option enum,
    and a frame 0.3 us more than bytes.

    Args:
        more: Whether the first part has more after it, when it was read as a frame; the
            socket is asked when not given.

    Returns:
        The parts, or ``None`` when there were more than ``keep`` (all were consumed).
    """
    rest: list[bytes] = []
    if more is None:
        more = _get(sock, _RCVMORE) == 1
    while more:
        part = recv_frame(sock, NOBLOCK, False)
        more = part.more
        if len(rest) <= keep:
            rest.append(part.bytes)
    return rest if len(rest) <= keep else None


_bundle_encoder = msgspec.msgpack.Encoder()

#: Frames at least this large are sent zero-copy.
COPY_THRESHOLD = 64 * 1024
#: File descriptors one connected outgoing socket holds: its signalling eventfd and its
#: connection.
FDS_PER_PEER = 2


def raise_fd_limit() -> None:
    """Take the hard ``RLIMIT_NOFILE`` as the soft one, in this process.

    Every process that connects to an actor's mailbox or a process's reply inbox costs the
    listening process a descriptor (a child process costs its parent three: its pidfd, its
    stdin and its connection), and libzmq aborts a process whose listener cannot accept one
    (the common soft limit of 1,024 is far below the usual hard one): every process does
    this as its ``ActorSystem`` opens, the root's, every actor process's and a node's (and
    so ``python -m actors serve``, whose connections are descriptors too). A limit the
    system refuses to raise is left as it is.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def peer_limit(max_peers: int) -> int:
    """Most outgoing sockets a process may hold open now: ``max_peers``, and no more than
    take half its soft ``RLIMIT_NOFILE`` at `FDS_PER_PEER` each.

    The other half is for its mailboxes, the connections other processes make to them and
    its files. libzmq aborts the process when an ipc listener cannot accept a connection
    for want of a descriptor, so the outbox must never be what spends the last ones.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_peers
    return max(1, min(max_peers, soft // (2 * FDS_PER_PEER)))


#: A bundle is sent once it holds this many tells (and never more than an eighth of the
#: high-water mark: a queue of ``hwm`` bundles then holds at most ``hwm**2 / 8`` tells, and
#: below ``hwm=16`` nothing coalesces, so a small hwm keeps its tight back-pressure), or
#: this many bytes of them; a tell of more bytes than `BUNDLE_FRAME` goes alone (after the
#: bundle before it).
BUNDLE_TELLS = 256
BUNDLE_HWM_SHARE = 8
BUNDLE_BYTES = 64 * 1024
BUNDLE_FRAME = 16 * 1024
#: What a bundle adds to its tells' bytes, at most: the array's head and each item's.
_BUNDLE_OVERHEAD = 5 + 5 * BUNDLE_TELLS

#: One tell waiting in a bundle: its encoded message, or that and its trace context.
Bundled = bytes | tuple[bytes, tuple[str, ...]]


class _Peer:
    """One PUSH socket connected to one address, and when it was last used: the outbox's
    count of uses then.

    Attributes:
        turn: The outbox's turn of the event loop in which a tell last went out alone on
            the socket: a second tell in the same turn opens a bundle.
        traced_turn: The same for a traced tell: a second traced tell opens a bundle.
        bundle: Tells of this turn waiting to go out as one frame, or ``None``.
        stalled: A bundle frame that met a full queue, sent before anything else.
    """

    __slots__ = (
        "bundle",
        "bundle_bytes",
        "sock",
        "stalled",
        "traced_turn",
        "turn",
        "used",
        "waiter",
    )

    def __init__(self, sock: zmq.Socket[bytes], used: int) -> None:
        self.sock = sock
        self.waiter = ReadinessWaiter(sock)
        self.used = used
        self.turn = -1
        self.traced_turn = -1
        self.bundle: list[Bundled] | None = None
        self.bundle_bytes = 0
        self.stalled: tuple[bytes, bytes] | None = None


class Outbox:
    """The PUSH sockets of one process, one per destination address, made on first use.

    One socket per destination keeps every message from this process to that actor in one
    FIFO pipe: a stop request sent after a run of tells is handled after all of them.

    The sockets are bounded: only addresses the system's policy allows are connected to; at
    most ``max_peers`` are open (fewer where the file-descriptor limit says so: `peer_limit`),
    the least recently used closed first to make room; and one unused for ``peer_idle``
    seconds is closed by `sweep`, so an address that is gone is not reconnected to for ever.
    A closed socket still delivers what it holds for ``linger_ms``, and is reopened on the
    next send. (FIFO order holds per socket: a destination closed and reopened while it
    still had messages queued may see the old ones last.)

    Tells to a mailbox of the system (whose ref names the node that started it: a ref made
    by hand may point at any socket) coalesce. The first tell to an address in a turn of
    the event loop goes out at once, as its own frame; the ones after it in the same turn
    (a handler answering a batch, a loop of tells that never waits) wait in a *bundle*, one
    ``Kind.TELLS`` frame sent when the turn ends, when it holds `BUNDLE_TELLS` tells (at
    most ``hwm / 8``: with ``hwm`` under 16 nothing coalesces) or
    `BUNDLE_BYTES`, or before anything else is sent to that address, so the order of
    everything sent to one address holds. A bundle is opened only when the queue has room
    for it, so a tell to a full mailbox waits as before; libzmq's per-message work (and
    the receiver's) is then paid once per bundle instead of once per tell. The same holds
    for traced tells: the turn's first to an address goes out at once as a ``TELL`` header
    and its body, the next ones in the bundle, each with its trace context; neither header
    is encoded per tell.

    Args:
        ctx: The process's zmq context.
        options: Transport settings.
        policy: Which addresses belong to the system.
        keys: The system's CURVE keys, for tcp.
        tells: The headers of this process's tells, encoded once (`TellHeaders`);
            ``None``: no bundles, every tell is its own frame, and no traced tells.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        options: TransportOptions,
        policy: AddressPolicy,
        keys: Keys | None = None,
        tells: TellHeaders | None = None,
    ) -> None:
        self._ctx = ctx
        self._options = options
        self._policy = policy
        self._keys = keys
        self._max = options.max_message_size
        self._tells = tells
        self._bundle_header = b"" if tells is None else tells.bundle
        # Bundles stay well inside the message size the receiver accepts.
        room = (self._max - len(self._bundle_header) - _BUNDLE_OVERHEAD) // 2
        self._bundle_tells = min(BUNDLE_TELLS, options.hwm // BUNDLE_HWM_SHARE)
        coalesce = tells is not None and self._bundle_tells >= 2
        self._bundle_bytes = max(min(BUNDLE_BYTES, room), 0) if coalesce else 0
        self._bundle_frame = min(BUNDLE_FRAME, self._bundle_bytes)
        #: Turns of the event loop in which this outbox sent a tell, and whether the end
        #: of the current one is scheduled; the peers with an open bundle.
        self._turn = 0
        self._turn_ends = False
        self._bundling: list[_Peer] = []
        #: Tasks sending a bundle that met a full queue (held so they are not collected).
        self._unstalling: set[asyncio.Task[None]] = set()
        self._peers: dict[str, _Peer] = {}
        #: Uses of a socket so far: a peer's ``used`` orders the peers by their last use.
        self._uses = 0
        #: ``_uses`` at the last two sweeps, the older first.
        self._swept = collections.deque([0, 0], maxlen=2)
        self._closed = False
        #: Sockets closed to stay under ``max_peers``, and for being idle.
        self.evicted = 0
        self.idled = 0

    def allows(self, address: str) -> bool:
        """Whether ``address`` is one of the system's own."""
        return self._policy.allows(address)

    def _peer(self, address: str) -> _Peer:
        self._uses += 1
        peer = self._peers.get(address)
        if peer is not None:
            peer.used = self._uses
            return peer
        if self._closed:
            raise MailboxClosedError("the outbox of this actor system is closed")
        if not self._policy.allows(address):
            raise ProtocolError(
                f"{address!r} is not an address of this actor system: a process only "
                "connects to its own system's ipc directory or tcp hosts"
            )
        if len(self._peers) >= peer_limit(self._options.max_peers):
            self._evict()
        try:
            sock = self._ctx.socket(zmq.PUSH)
        except zmq.ZMQError as err:
            raise ProtocolError(f"cannot open a socket to {address!r}: {err}") from err
        sock.setsockopt(zmq.SNDHWM, self._options.hwm)
        sock.setsockopt(zmq.LINGER, self._options.linger_ms)
        # A destination that is gone is retried ever more slowly until the socket idles out.
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5_000)
        try:
            make_client(sock, self._keys)
            sock.connect(address)
        except zmq.ZMQError as err:
            sock.close(0)
            raise ProtocolError(f"cannot connect to {address!r}: {err}") from err
        peer = self._peers[address] = _Peer(sock, self._uses)
        return peer

    def _evict(self) -> None:
        idle = [(p.used, a) for a, p in self._peers.items() if not p.waiter.waiting]
        if idle:
            self.evicted += 1
            # At once: a socket left to linger keeps its descriptors for up to linger_ms,
            # and a burst of new peers would then spend far more than the share.
            self._close(min(idle)[1], 0)

    def sweep(self) -> None:
        """Close the sockets unused since the previous sweep but one (call every
        ``peer_idle / 2`` seconds)."""
        horizon = self._swept[0]
        self._swept.append(self._uses)
        stale = [a for a, p in self._peers.items() if p.used <= horizon and not p.waiter.waiting]
        for address in stale:
            self.idled += 1
            self._close(address, self._options.linger_ms)

    def _too_big(self, size: int) -> ProtocolError:
        return ProtocolError(
            f"a message of {size} bytes exceeds max_message_size={self._max}; "
            "raise it with ActorSystem(max_message_size=...)"
        )

    def try_send(self, address: str, frame: bytes, coalesce: bool = False) -> bool:
        """Send one tell's frame, or with ``coalesce`` add it to the turn's bundle, if the
        queue has room now; ``False`` if it is full.

        Raises:
            ProtocolError: The frame is larger than ``max_message_size``, or the address is
                not the system's.
        """
        size = len(frame)
        if size > self._max:
            raise self._too_big(size)
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peer(address)
        else:
            self._uses += 1
            peer.used = self._uses
        if coalesce and size <= self._bundle_frame:
            bundle = peer.bundle
            if bundle is not None:
                bundle.append(frame)
                peer.bundle_bytes += size
                if len(bundle) >= self._bundle_tells or peer.bundle_bytes >= self._bundle_bytes:
                    self._flush(peer)
                return True
            if peer.turn == self._turn and not peer.stalled:
                return self._open_bundle(peer, frame, size)
        if (peer.bundle is not None or peer.stalled) and not self._clear(peer):
            return False
        try:
            _send(peer.sock, frame, NOBLOCK)
        except zmq.Again:
            return False
        if coalesce:
            self._sent_in_turn(peer)
        return True

    def try_send_traced(
        self,
        address: str,
        frame: bytes,
        trace: tuple[str, ...],
        chars: int,
        coalesce: bool = False,
    ) -> bool:
        """Send a traced tell if the queue has room now (``False`` if it is full): as a
        ``TELL`` header and its body, or with ``coalesce``, when it is not the turn's first
        traced tell to ``address``, in its bundle. ``chars``: of its contexts, together
        (`runtime._protocol.trace_chars`, which checked them).

        Raises:
            ProtocolError: The message is larger than ``max_message_size``, or the address
                is not the system's.
        """
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peer(address)
        else:
            self._uses += 1
            peer.used = self._uses
        if coalesce and not peer.stalled:
            bundle = peer.bundle
            if bundle is not None or peer.traced_turn == self._turn:
                size = len(frame) + chars
                if size <= self._bundle_frame:
                    if bundle is None:
                        return self._open_bundle(peer, (frame, trace), size)
                    bundle.append((frame, trace))
                    peer.bundle_bytes += size
                    if len(bundle) >= self._bundle_tells or peer.bundle_bytes >= self._bundle_bytes:
                        self._flush(peer)
                    return True
        assert self._tells is not None, "a node's outbox has its tell headers"
        if not self.try_send_frames(address, (self._tells.traced(trace), frame)):
            return False
        if coalesce:
            self._sent_in_turn(peer)
            peer.traced_turn = peer.turn
        return True

    def _open_bundle(self, peer: _Peer, first: Bundled, size: int) -> bool:
        if not events(peer.sock) & POLLOUT:
            return False  # full: the tell waits for room, as a frame of its own would
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        peer.bundle = [first]
        peer.bundle_bytes = size
        if loop is None:
            self._flush(peer)  # no turn to end: nothing to coalesce with
            return True
        self._bundling.append(peer)
        if not self._turn_ends:
            self._turn_ends = True
            loop.call_soon(self._end_turn)
        return True

    def _sent_in_turn(self, peer: _Peer) -> None:
        """Note a tell sent alone: a second one in this turn opens a bundle."""
        if not self._bundle_bytes or self._turn_ends:
            peer.turn = self._turn
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        peer.turn = self._turn
        self._turn_ends = True
        loop.call_soon(self._end_turn)

    def _end_turn(self) -> None:
        self._turn += 1
        self._turn_ends = False
        bundling, self._bundling = self._bundling, []
        for peer in bundling:
            if peer.bundle is not None:
                self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        """Send the peer's bundle. Its room was checked when it was opened and nothing else
        was sent to its address since, so only a lost connection can make this fail: then
        the frame is kept (``stalled``) and sent before anything else."""
        bundle = peer.bundle
        assert bundle is not None
        peer.bundle = None
        body = _bundle_encoder.encode(bundle)
        try:
            _send(peer.sock, self._bundle_header, _NOBLOCK_MORE)
        except zmq.Again:
            peer.stalled = (self._bundle_header, body)
            with contextlib.suppress(RuntimeError):  # no loop: the next send clears it
                task = asyncio.get_running_loop().create_task(self._unstall(peer))
                self._unstalling.add(task)
                task.add_done_callback(self._unstalling.discard)
            return
        _send(peer.sock, body, 0)

    def _clear(self, peer: _Peer) -> bool:
        """Send what must go before anything else on this socket (an open bundle, a
        stalled one); ``False`` if the queue is full."""
        if peer.bundle is not None:
            self._flush(peer)
        stalled = peer.stalled
        if stalled is None:
            return True
        try:
            _send(peer.sock, stalled[0], _NOBLOCK_MORE)
        except zmq.Again:
            return False
        _send(peer.sock, stalled[1], 0)
        peer.stalled = None
        return True

    async def _unstall(self, peer: _Peer) -> None:
        while peer.stalled is not None and not peer.waiter.closed:
            await peer.waiter.wait(POLLOUT)
            self._clear(peer)

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

        Raises:
            ProtocolError: The message is larger than ``max_message_size``, or the address
                is not the system's.
        """
        size = sum(map(len, frames))
        if size > self._max:
            raise self._too_big(size)
        peer = self._peer(address)
        if (peer.bundle is not None or peer.stalled) and not self._clear(peer):
            return False
        sock = peer.sock
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
        refuse_nan(limit, "tell")
        peer = self._peer(address)
        try:
            # Not ``asyncio.wait_for``: Python 3.11's returns the result, swallowing the
            # caller's cancellation, when it is cancelled once its inner wait is done.
            async with asyncio.timeout(limit):
                await peer.waiter.wait(POLLOUT)
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
        self._close(address, 0)

    def _close(self, address: str, linger_ms: int) -> None:
        peer = self._peers.pop(address, None)
        if peer is not None:
            self._clear(peer)  # what it still delivers includes the bundle of this turn
            peer.waiter.close()
            peer.sock.close(linger_ms)

    def close(self, linger_ms: int | None = None) -> None:
        """Close every socket (``linger_ms`` overrides the configured linger)."""
        self._closed = True
        for address in list(self._peers):
            self._close(address, self._options.linger_ms if linger_ms is None else linger_ms)
