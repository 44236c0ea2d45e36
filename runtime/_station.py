"""A process's station: its zmq context and outbox, where its messages leave, and its reply
inbox and pending asks, where their answers arrive.

Every process that runs actors has one ``Station`` per open ``ActorSystem`` (a *node*, in
contrast, is a member of the system on another host: `runtime._nodes`). Refs find it
through `runtime._context`. Its reply inbox takes everything that is not a mailbox's: replies
and errors, readiness reports and last words of its child processes, watch requests and
death notices from other processes, and liveness probes, which it answers from the event loop
at once. It dispatches each frame by its kind through a table of small methods; what a
process knows of deaths is its `Deaths` (`runtime._deaths`), and its pings over tcp are its
`Heartbeat` (`runtime._heartbeat`), each handed `Station.notify` to send with. Like a mailbox,
the reply inbox survives any bytes: whatever fails to decode, or lacks the system's cookie,
is counted and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq

from . import _context
from ._auth import AddressPolicy, Keys, ZapHandler
from ._context import handling_address
from ._deadlines import Deadlines
from ._deaths import Deaths
from ._errors import (
    ActorDeadError,
    AskTimeoutError,
    MailboxClosedError,
    ProtocolError,
    RemoteActorError,
    TokenyardError,
)
from ._heartbeat import BEAT_CORR, Heartbeat
from ._message import Message, type_path
from ._message import registry as message_registry
from ._metrics import ENABLED, POW2_SLOTS, HistogramSnapshot, pow2_snapshot
from ._protocol import (
    HEADER_BYTE,
    MAX_FRAMES,
    NODE_KINDS,
    ErrorBody,
    Header,
    HeaderTemplate,
    Kind,
    TellHeaders,
    body_encoder,
    checked_trace,
    contexts_of,
    cookie_ok,
    decode_header,
    down_decoder,
    encode_header,
    error_decoder,
    new_corr,
    trace_chars,
    watch_decoder,
)
from ._throttle import Throttle
from ._transport import (
    NOBLOCK,
    POLLIN,
    Outbox,
    TransportOptions,
    bind_pull,
    close_listener,
    events,
    recv_frame,
    recv_rest,
    refuse_nan,
    socket_stem,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Container, Sequence

    from ._context import Frames, RefLike
    from ._protocol import Down

logger = logging.getLogger("tokenyard.station")
#: How many addresses the tell path remembers having subscribed for.
_KNOWN_KEPT = 100_000
#: Sockets one process's zmq context may hold.
_MAX_SOCKETS = 16_384
#: How many asked names get a round-trip histogram of their own (the rest share one).
_ASKED_KEPT = 1_024
#: How many untraced headers (kind, reply body type) are kept encoded but for their id.
_HEADERS_KEPT = 4_096
_OTHER = "(other)"
_encode = body_encoder.encode
_NONE = _encode(None)


def _succeeded(future: asyncio.Future[Any]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


#: What msgspec raises for a value it cannot encode: a type it does not know, an int outside
#: 64 bits, nesting past the recursion limit.
_UNENCODABLE = (TypeError, msgspec.EncodeError, OverflowError, RecursionError)


def _unencodable(msg: object, err: Exception) -> TypeError:
    """The error for a message msgspec cannot encode, naming its type (msgspec's own names
    only the value's)."""
    return TypeError(
        f"{type(msg).__qualname__} cannot be sent: msgspec cannot encode it ({err}); a "
        "message's fields hold msgspec values (str, int within 64 bits, float, bytes, "
        "lists, dicts, structs, ...)"
    )


def _unreadable(future: asyncio.Future[Any], err: Exception) -> None:
    """Fail ``future`` at once when its reply does not decode: the asker is told, not left
    waiting (the caller raises the error on, to be counted as a rejection)."""
    future.set_exception(ProtocolError(f"an undecodable reply: {err}"))


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    target: str
    #: The name of the actor asked, its timeout and its deadline on the loop's clock (an
    #: ask's, once it is sent; NaN, which equals nothing: none).
    asked: str = ""
    timeout: float = 0.0
    deadline: float = math.nan


class Station:
    """Sockets and bookkeeping shared by everything of one system in one process.

    Args:
        ipc_dir: The system's private directory for ipc socket files.
        options: Transport settings.
        name: Used in socket names and logs.
        cookie: The system's secret, carried by every header.
        keys: The system's CURVE keys (tcp only).
        port: The tcp port of the reply inbox (0: any free one); a system's root binds a
            known one so that nodes on other hosts can join it.
    """

    def __init__(
        self,
        ipc_dir: str,
        options: TransportOptions,
        name: str,
        cookie: bytes,
        keys: Keys | None = None,
        port: int = 0,
    ) -> None:
        self.cookie = cookie
        self.options = options
        self.name = name
        self.keys = keys
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # libzmq's default of 1023 sockets is below what max_peers and lingering closed
        # sockets may need; the file-descriptor limit is the real bound.
        self.ctx.set(zmq.MAX_SOCKETS, _MAX_SOCKETS)
        tcp_hosts = frozenset({options.tcp_host}) if options.transport == "tcp" else frozenset()
        self.policy = AddressPolicy(
            ipc_dir if options.transport == "ipc" else "", tcp_hosts, any_tcp=keys is not None
        )
        #: Answers CURVE handshakes for this process's servers (it must exist first).
        self.zap = ZapHandler(self.ctx, keys) if keys is not None else None
        self.outbox = Outbox(self.ctx, options, self.policy, keys, TellHeaders(name, cookie))
        self._stems = itertools.count()
        self._nonce = secrets.token_hex(4)
        try:
            self.reply_sock, self.reply_address = bind_pull(
                self.ctx, ipc_dir, self.new_stem("r"), options, keys, port
            )
        except ProtocolError:
            self._close_context()
            raise
        if self.zap is not None:  # a node with another system's key joins here first
            self.zap.watch(self.reply_sock, self.reply_address)
        self._bound_by = os.getpid()
        #: The thread whose event loop it runs in (set by `open`).
        self.thread = threading.get_ident()
        self._reply_fd = int(self.reply_sock.getsockopt(zmq.FD))
        self._pending: dict[int, _Pending] = {}
        #: What this process knows of deaths, and its children's last words.
        self.deaths = Deaths(self.reply_address, self.notify, self._cut)
        #: The same dict as ``deaths.dead``, read on the tell path without a lookup more.
        self._dead = self.deaths.dead
        #: Addresses the tell path has subscribed for (its one check before subscribing).
        self._known: set[str] = set()
        #: Over tcp, the pings to the owners of watched refs and to linked processes; on
        #: any transport, the answers to pings.
        self.heartbeat = Heartbeat(
            name,
            self.reply_address,
            options.heartbeat,
            self.deaths,
            self.notify,
            f"{os.getpid()}:{self._nonce}".encode(),
        )
        self._reply_decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {}
        self._headers: dict[tuple[Kind, str], HeaderTemplate] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The asks' timeouts, on the loop's clock (set by `open`).
        self._deadlines: Deadlines | None = None
        self._token: Any = None
        self._sweeper: asyncio.TimerHandle | None = None
        self.closed = False
        #: Takes the frames of the node protocol (JOIN, SPAWN, KILL, NODES) when this
        #: process is the system's root or one of its nodes (`runtime._nodes`).
        self.on_node_frame: Callable[[Header, bytes], None] | None = None
        #: Answers a LOOKUP on the reply inbox (its system sets it).
        self.on_lookup: Callable[[Header, bytes], None] | None = None
        #: Frames the reply inbox refused (undecodable, no cookie, unexpected).
        self.rejected = 0
        self._rejections = Throttle(logger)
        self._sends = Throttle(logger)
        #: Ask round trips by the name asked: power-of-two nanosecond slots, and their sum.
        self._asks: dict[str, tuple[list[int], list[int]]] = {}
        #: How the reply inbox handles each kind of frame (any other kind: `_unexpected`).
        self._inbox: dict[Kind, Callable[[Header, bytes], None]] = {
            Kind.REPLY: self._on_reply,
            Kind.ERROR: self._on_error,
            Kind.FAILED: self._on_failed,
            Kind.READY: self._on_answer,
            Kind.ANSWER: self._on_answer,
            Kind.PONG: self._on_pong,
            Kind.PING: self.heartbeat.pinged,
            Kind.WATCH: self._on_watch,
            Kind.UNWATCH: self._on_unwatch,
            Kind.DOWN: self._on_down,
            Kind.LOOKUP: self._on_lookup,
            **dict.fromkeys(NODE_KINDS, self._on_node_frame),
        }

    def new_stem(self, prefix: str) -> str:
        """A socket file name never used before in the system directory (a name used
        again could meet a peer still reconnecting to its previous owner)."""
        return socket_stem(prefix, os.getpid(), self._nonce, next(self._stems))

    def open(self) -> None:
        """Start reading replies on the running loop and make this the current station."""
        self._loop = asyncio.get_running_loop()
        self._deadlines = Deadlines(self._loop, self._pending, self._due, self._expire)
        self.thread = threading.get_ident()
        if self.zap is not None:
            self.zap.start(self._loop)
        self._loop.add_reader(self._reply_fd, self._on_replies)
        self._token = _context.enter(self)
        # The fd is edge-triggered: anything that arrived before the reader existed must be
        # read now or it would wait for the next arrival.
        self._loop.call_soon(self._on_replies)
        self._sweeper = self._loop.call_later(self.options.peer_idle / 2, self._sweep)
        if self.options.transport == "tcp":
            self.heartbeat.start(self._loop)

    def _sweep(self) -> None:
        if self.closed or self._loop is None:
            return
        self.outbox.sweep()
        self._sweeper = self._loop.call_later(self.options.peer_idle / 2, self._sweep)

    # -- sending --------------------------------------------------------------------------

    def try_tell(self, ref: RefLike, msg: Message, trace: Sequence[str] = ()) -> Frames | None:
        """Encode and send a one-way message if its queue has room now: one frame, or a
        ``TELL`` header and the body when it carries ``trace``.

        Returns:
            ``None`` when sent; else the encoded frames, for `tell_when_room` to wait with.
        """
        address = ref.address
        if address not in self._known:
            self._learn(ref)
        if self._dead and address in self._dead:
            self.deaths.check_alive(ref)
        try:
            body = _encode(msg)
        except _UNENCODABLE as err:
            raise _unencodable(msg, err) from err
        # Coalesced only to a mailbox a node started (its ref names it): one of this system.
        coalesce = bool(ref.owner)
        if trace:
            contexts = trace if type(trace) is tuple else contexts_of(trace)
            chars = trace_chars(contexts)
            if self.outbox.try_send_traced(address, body, contexts, chars, coalesce):
                return None
            return (self.header(Kind.TELL, trace=contexts), body)
        if self.outbox.try_send(address, body, coalesce):
            return None
        return body

    async def tell_when_room(self, ref: RefLike, frames: Frames, timeout: float | None) -> None:
        """Send an encoded tell, waiting while its mailbox is full (failing if it dies)."""
        check = functools.partial(self.deaths.check_alive, ref)
        if isinstance(frames, bytes):
            await self.outbox.send(ref.address, frames, timeout, check)
        else:
            await self.outbox.send_frames(ref.address, frames, timeout, check)

    def _learn(self, ref: RefLike) -> None:
        """First message to an address: subscribe to its death if another process owns it."""
        if ref.owner and ref.owner != self.reply_address:
            self.deaths.subscribe(ref)  # first: known once it did not refuse the ref
        if len(self._known) >= _KNOWN_KEPT:
            self._known.clear()  # subscribing again is harmless; remembering all is not
        self._known.add(ref.address)

    def check_loop(self) -> asyncio.AbstractEventLoop:
        """The loop this station runs in, when it is the running one.

        Its sockets are its loop's alone (zmq sockets are not thread-safe), its replies are
        read by that loop's reader, and the system's tasks run there: used from another
        loop, a reply could never arrive, and an in-process actor started there lived in
        a loop that was not its system's.

        Raises:
            MailboxClosedError: The system is closed, or the running loop is not its own.
        """
        if self.closed or self._loop is None:
            raise MailboxClosedError("the actor system is closed")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # a thread with no loop: not the system's, then
            running = None
        if running is not self._loop:
            # Which of the two, asked only here: every ask comes this way.
            if threading.get_ident() != self.thread:
                raise MailboxClosedError(
                    "the ActorSystem runs in another thread's event loop: use it from that "
                    "loop (asyncio.run_coroutine_threadsafe, anyio.from_thread)"
                )
            raise MailboxClosedError(
                "the ActorSystem was opened in another event loop of this thread, which "
                "does not run now: use it from the loop that opened it"
            )
        return self._loop

    def new_request(self, target: str) -> tuple[int, asyncio.Future[Any]]:
        """Register a pending reply (an ask, a readiness or stop handshake) under a fresh
        unguessable correlation id."""
        loop = self.check_loop()
        corr = new_corr()
        while corr in self._pending:
            corr = new_corr()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[corr] = _Pending(future, target)
        return corr, future

    def drop_request(self, corr: int) -> None:
        """Forget a pending reply nobody waits for any more."""
        self._pending.pop(corr, None)

    def header(
        self, kind: Kind, corr: int = 0, body_type: str = "", trace: Sequence[str] = ()
    ) -> bytes | bytearray:
        """An encoded header from this station, with the cookie (and trace context, if any).

        Raises:
            ProtocolError: More than `MAX_TRACE` contexts, or one longer than
                `MAX_TRACE_CHARS` (the receiver would refuse the message).
        """
        if not trace:
            template = self._headers.get((kind, body_type))
            if template is None:
                template = HeaderTemplate(
                    kind, self.reply_address, self.name, self.cookie, body_type
                )
                if len(self._headers) < _HEADERS_KEPT:
                    self._headers[kind, body_type] = template
            return template.encode(corr)
        contexts = checked_trace(trace)
        return encode_header(
            Header(
                kind,
                corr,
                self.reply_address,
                self.name,
                body_type,
                cookie=self.cookie,
                trace=contexts,
            )
        )

    async def ask(
        self, ref: RefLike, msg: Message, timeout: float, trace: Sequence[str] = ()
    ) -> Any:
        """Send ``msg`` with a correlation id and wait for the matching reply."""
        if timeout != timeout:  # NaN (inline: a call here costs every ask 60 ns)
            refuse_nan(timeout, "ask")
        self.deaths.subscribe(ref)  # first: it learns the death of what a dead owner had
        self.deaths.check_alive(ref)
        if handling_address.get(None) == ref.address:
            raise TokenyardError(
                f"actor {ref.name!r} asked itself from inside a handler: the reply could only "
                "be handled after the handler returns; use tell, or call the method directly"
            )
        corr, future = self.new_request(ref.address)
        try:
            try:
                body = _encode(msg)
            except _UNENCODABLE as err:
                raise _unencodable(msg, err) from err
            frames = (self.header(Kind.ASK, corr, trace=trace), body)
            left = timeout
            if not self.outbox.try_send_frames(ref.address, frames):
                assert self._loop is not None  # opened: new_request checked
                begun = self._loop.time()
                await self.outbox.send_frames(
                    ref.address, frames, timeout, lambda: self.deaths.check_alive(ref)
                )
                left -= self._loop.time() - begun  # the wait for room is part of the ask
            pending = self._pending.get(corr)
            if pending is not None:
                assert self._deadlines is not None  # opened: new_request checked
                pending.asked, pending.timeout = ref.name, timeout
                pending.deadline = self._deadlines.add(corr, left)
            if not ENABLED:
                return await future
            started = time.perf_counter_ns()
            result = await future
            self._count_ask(ref.name, time.perf_counter_ns() - started)
            return result
        finally:
            self.drop_request(corr)
            if future.done() and not future.cancelled():
                future.exception()  # failed while sending (a death): the caller has that

    def _count_ask(self, name: str, took: int) -> None:
        asks = self._asks
        entry = asks.get(name)
        if entry is None:
            if len(asks) >= _ASKED_KEPT:
                name = _OTHER
            entry = asks.get(name)
            if entry is None:
                entry = asks[name] = ([0] * POW2_SLOTS, [0])
        entry[0][(took // 1000).bit_length()] += 1
        entry[1][0] += took

    def ask_statistics(self) -> dict[str, HistogramSnapshot]:
        """Round trips of the asks answered so far, by the name of the actor asked."""
        return {name: pow2_snapshot(s, total[0]) for name, (s, total) in self._asks.items()}

    async def send_stop(self, ref: RefLike) -> None:
        """Ask ``ref`` to stop gracefully, expecting no acknowledgement."""
        await self.send_control(ref.address, Kind.STOP, 0)

    async def flush(self, timeout: float, skip: Container[str] = ()) -> list[str]:
        """Wait until every mailbox this station told has handled all it was told.

        PUSH/PULL gives no receipt: a process that exits while its queue to a busy mailbox
        is full loses the tail, whatever its linger. So a FLUSH frame follows the tells down
        each pipe, and the receiving actor acknowledges it once it has handled everything
        before it.

        Args:
            timeout: Seconds to wait for every acknowledgement.
            skip: Addresses not to flush (children about to get an in-band stop).

        Returns:
            The addresses that did not acknowledge in time (what was sent there may be lost).
        """
        acks: dict[str, tuple[int, asyncio.Future[Any]]] = {}
        try:
            with anyio.move_on_after(timeout):
                for address in self.outbox.connected():
                    if address not in self._known or address in self._dead or address in skip:
                        continue
                    corr, future = acks[address] = self.new_request(address)
                    with contextlib.suppress(TokenyardError):  # dead or stuck: late below
                        await self.outbox.send_frames(
                            address, (self.header(Kind.FLUSH, corr), _NONE)
                        )
                for _, future in acks.values():
                    with contextlib.suppress(TokenyardError):
                        await future
        finally:
            for corr, _ in acks.values():
                self.drop_request(corr)
        return [a for a, (_, f) in acks.items() if not _succeeded(f) and a not in self._dead]

    async def ask_control(
        self, ref: RefLike, kind: Kind, timeout: float, body: Message | None = None
    ) -> Any:
        """Send a control request (no handler involved) and wait for its reply."""
        self.deaths.check_alive(ref)
        corr, future = self.new_request(ref.address)
        try:
            with anyio.fail_after(timeout):
                payload = b"" if body is None else _encode(body)
                await self.send_control(ref.address, kind, corr, payload, timeout=timeout)
                return await future
        except TimeoutError as err:
            raise AskTimeoutError(
                f"no {kind.name} reply from {ref.name!r} in {timeout:g} s"
            ) from err
        finally:
            self.drop_request(corr)

    async def request(self, address: str, kind: Kind, body: bytes, timeout: float) -> bytes:
        """Send a node-protocol request and wait for its `Kind.ANSWER` body.

        Raises:
            AskTimeoutError: No answer within ``timeout``.
            RemoteActorError: The other side failed to do it (the error as data).
        """
        corr, future = self.new_request(address)
        try:
            with anyio.fail_after(timeout):
                await self.send_control(address, kind, corr, body, timeout=timeout)
                _, answer = await future
                assert isinstance(answer, bytes)
                return answer
        except TimeoutError as err:
            raise AskTimeoutError(
                f"no answer to {kind.name} from {address} in {timeout:g} s"
            ) from err
        finally:
            self.drop_request(corr)

    def answer(self, header: Header, body: bytes) -> None:
        """Answer a node-protocol request (from a loop callback: never waits)."""
        if header.reply_to:
            self.notify(header.reply_to, Kind.ANSWER, body, header.corr)

    def answer_error(self, header: Header, error: BaseException) -> None:
        """Answer a node-protocol request with the failure, as data."""
        if header.reply_to:
            self.notify(header.reply_to, Kind.ERROR, _encode(ErrorBody.of(error)), header.corr)

    async def ping(self, address: str, timeout: float) -> bool:
        """Probe the process whose reply inbox is ``address``: whether its event loop
        answered in time."""
        corr, future = self.new_request(address)
        try:
            with anyio.move_on_after(timeout):
                await self.send_control(address, Kind.PING, corr, timeout=timeout)
                await future
                return True
        except TokenyardError:
            return False
        finally:
            self.drop_request(corr)
        return False

    def _due(self, corr: int, deadline: float) -> bool:
        """Whether the ask ``corr`` still waits for a reply due by ``deadline``."""
        pending = self._pending.get(corr)
        return pending is not None and pending.deadline == deadline

    def _expire(self, corr: int) -> None:
        pending = self._pending.pop(corr)
        if not pending.future.done():
            pending.future.set_exception(
                AskTimeoutError(
                    f"no reply from actor {pending.asked!r} within {pending.timeout:g} s; pass "
                    "a longer ask(timeout=...) if the handler is slow"
                )
            )

    async def reply(self, header: Header, result: object, timeout: float | None = None) -> None:
        """Send a handler's return value back to an asker.

        Raises:
            ProtocolError: ``result`` is not a ``Message`` (or ``None``), cannot be encoded
                (a field holding a type msgspec does not know, an int outside 64 bits), or
                is too large.
        """
        if not header.reply_to:
            return
        if result is not None and not isinstance(result, Message):
            raise ProtocolError(
                f"a handler returned {type(result).__name__}; handlers return a Message or None"
            )
        body_type = "" if result is None else type_path(type(result))
        try:
            body = _encode(result)
        except _UNENCODABLE as err:
            raise ProtocolError(
                f"a handler returned a {type(result).__name__} that msgspec cannot encode: {err}"
            ) from err
        frames = (self.header(Kind.REPLY, header.corr, body_type), body)
        if not self.outbox.try_send_frames(header.reply_to, frames):
            await self.outbox.send_frames(header.reply_to, frames, timeout)

    async def reply_error(
        self, header: Header, body: ErrorBody, timeout: float | None = None
    ) -> None:
        """Send a failure back to an asker, as data."""
        if not header.reply_to:
            return
        await self.outbox.send_frames(
            header.reply_to, (self.header(Kind.ERROR, header.corr), _encode(body)), timeout
        )

    async def send_control(
        self, address: str, kind: Kind, corr: int, body: bytes = b"", timeout: float | None = None
    ) -> None:
        """Send a control frame (stop, ready, failed, ...) that needs no handler."""
        await self.outbox.send_frames(address, (self.header(kind, corr), body), timeout)

    # -- receiving replies ----------------------------------------------------------------

    def read_replies(self) -> None:
        """Read every reply queued now (a monitor does, before it reads last words)."""
        while self._read_reply(check=True):
            pass

    def _on_replies(self) -> None:
        """The reply inbox's fd fired: read a frame at once (a wake-up almost always means
        one; a spurious one costs a failed read), and any more later in this turn of the
        event loop, after whatever this one woke: the asker resumes without waiting for two
        ``EVENTS`` reads (2 us each here)."""
        if self._read_reply(check=False) and self._loop is not None:
            self._loop.call_soon(self._more_replies)

    def _more_replies(self) -> None:
        if self._read_reply(check=True) and self._loop is not None:
            self._loop.call_soon(self._more_replies)

    def _read_reply(self, check: bool) -> bool:
        """Read and act on one frame of the reply inbox; whether there was one.

        Args:
            check: Ask ``EVENTS`` first (when a frame is unlikely: the read that would fail
                then costs more than asking). Either way, the socket's fd is re-armed.
        """
        if self.closed:
            return False
        sock = self.reply_sock
        if check and not events(sock) & POLLIN:
            return False
        try:
            head = recv_frame(sock, NOBLOCK, False)  # a frame: it says whether more follow
        except zmq.Again:
            return check  # asked and told yes, yet none: ask again
        first = head.bytes
        frames = recv_rest(sock, MAX_FRAMES, head.more)
        try:
            self._resolve(first, frames)
        except Exception as err:  # noqa: BLE001 - no bytes may end the reply inbox
            self.rejected += 1
            self._rejections.warning(
                "%s: refused a frame on its reply inbox: %s (first bytes %r)",
                self.name,
                err,
                bytes(first[:16]),
            )
        return True

    def _resolve(self, first: bytes, frames: list[bytes] | None) -> None:
        if first[:1] != HEADER_BYTE:
            raise ProtocolError("a frame without a header")
        header = decode_header(first)
        if not frames or len(frames) != header.frames:
            raise ProtocolError(f"a header announcing {header.frames} frames, not what came")
        if not cookie_ok(header, self.cookie):
            raise ProtocolError(f"a {header.kind.name} frame without the system's cookie")
        self._inbox.get(header.kind, self._unexpected)(header, frames[0])

    # The reply inbox's table: one method per kind of frame, each from a loop callback.

    def _take(self, corr: int) -> _Pending | None:
        """The request ``corr`` answers, now settled; ``None`` when the asker gave up
        (timeout, cancellation) or never asked: a late or stray answer is dropped."""
        pending = self._pending.get(corr)
        if pending is None or pending.future.done():
            return None
        del self._pending[corr]
        return pending

    def _on_reply(self, header: Header, body: bytes) -> None:
        pending = self._take(header.corr)
        if pending is not None:
            try:
                reply = self._decode_reply(header.body_type, body)
            except Exception as err:
                _unreadable(pending.future, err)
                raise
            pending.future.set_result(reply)

    def _on_error(self, header: Header, body: bytes) -> None:
        pending = self._take(header.corr)
        if pending is not None:
            try:
                err = error_decoder.decode(body)
            except Exception as error:
                _unreadable(pending.future, error)
                raise
            pending.future.set_exception(
                RemoteActorError(err.type_name, err.message, err.traceback)
            )

    def _on_failed(self, header: Header, body: bytes) -> None:
        """A child's failure before it was ready fails its spawn; after, its last words."""
        if header.corr in self._pending:
            self._on_error(header, body)
        else:
            self.deaths.last_words(header.corr, body)

    def _on_answer(self, header: Header, body: bytes) -> None:
        """READY, ANSWER and a probe's PONG: the waiter reads the header and body itself."""
        pending = self._take(header.corr)
        if pending is not None:
            pending.future.set_result((header, body))

    def _on_pong(self, header: Header, body: bytes) -> None:
        if header.corr == BEAT_CORR:
            self.heartbeat.answered(header.reply_to, body)
        else:
            self._on_answer(header, body)

    def _on_watch(self, _: Header, body: bytes) -> None:
        self.deaths.watched(watch_decoder.decode(body))

    def _on_unwatch(self, _: Header, body: bytes) -> None:
        self.deaths.unwatched(watch_decoder.decode(body))

    def _on_down(self, header: Header, body: bytes) -> None:
        self.deaths.reported(down_decoder.decode(body), header.reply_to)

    def _on_node_frame(self, header: Header, body: bytes) -> None:
        if self.on_node_frame is None:
            raise ProtocolError(f"a {header.kind.name} frame to a process that is no node")
        self.on_node_frame(header, body)

    def _on_lookup(self, header: Header, body: bytes) -> None:
        if self.on_lookup is None:
            raise ProtocolError("a LOOKUP frame to a process with no open system")
        self.on_lookup(header, body)

    def _unexpected(self, header: Header, _: bytes) -> None:
        """A mailbox's kind: refused when it answers a pending request, else dropped."""
        pending = self._pending.get(header.corr)
        if pending is not None and not pending.future.done():
            raise ProtocolError(f"a {header.kind.name} frame sent to a reply inbox")

    def _decode_reply(self, body_type: str, body: bytes) -> Any:
        if not body_type:
            return None
        decoder = self._reply_decoders.get(body_type)
        if decoder is None:
            cls = message_registry.get(body_type)
            if cls is None:
                raise ProtocolError(
                    f"reply of type {body_type} is not a Message class imported in this process"
                )
            decoder = self._reply_decoders[body_type] = msgspec.msgpack.Decoder(cls)
        return decoder.decode(body)

    def _cut(self, address: str, down: Down | None) -> None:
        """Nothing more comes from ``address`` (`Deaths` calls this): fail the requests
        pending on the actor that died there (``down``, if one did) and close the socket to
        it."""
        if down is not None:
            reason = down.reason
            for corr, pending in list(self._pending.items()):
                if pending.target == address and not pending.future.done():
                    del self._pending[corr]
                    pending.future.set_exception(
                        ActorDeadError(f"actor {down.ref.name!r} died: {reason}", reason=reason)
                    )
        self.outbox.forget(address)

    def notify(self, address: str, kind: Kind, body: bytes, corr: int = 0) -> None:
        """Best-effort control frame from a loop callback (never blocks)."""
        try:
            self.outbox.try_send_frames(address, (self.header(kind, corr), body))
        except TokenyardError as err:
            self._sends.warning(
                "%s: could not send %s to %s: %s", self.name, kind.name, address, err
            )

    @property
    def inherited(self) -> bool:
        """Whether this process is one forked from the station's, which owns it."""
        return self._bound_by != os.getpid()

    def abandon(self) -> None:
        """In a process forked from this station's: closed here, with nothing touched (its
        sockets, its context and the loop's readers are the parent's; closing them here
        would reach into the parent's libzmq and epoll)."""
        self.closed = True
        self._token = None

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket and the context; fail what is still pending.

        Args:
            linger_ms: How long what was sent may still be delivered (an actor process
                leaving lets its last replies and notices reach their peers).
        """
        if self.closed:
            return
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.heartbeat.close()
        if self._loop is not None:
            self._loop.remove_reader(self._reply_fd)
        if self._deadlines is not None:
            self._deadlines.close()
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(MailboxClosedError("the actor system closed"))
                # Whoever awaits it still gets the error; nobody awaiting is no news.
                pending.future.exception()
        self._pending.clear()
        self.deaths.unwatch_all()
        close_listener(self.reply_sock, self.reply_address, self._bound_by)
        self._close_context(linger_ms)
        _context.leave(self, self._token)
        self._token = None

    def _close_context(self, linger_ms: int = 0) -> None:
        self.outbox.close(linger_ms)
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()
