"""The per-process core of an actor system: zmq context, outbox, reply inbox, pending asks,
and what this process knows of deaths.

Every process that runs actors has one ``Node`` per open ``ActorSystem``. Refs find it
through `runtime._context`. Its reply inbox takes everything that is not a mailbox's: replies
and errors, readiness reports and last words of its child processes, watch requests and
death notices from other nodes, and liveness probes, which it answers from the event loop at
once. Like a mailbox, it survives any bytes: whatever fails to decode, or lacks the
system's cookie, is counted and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq

from . import _context
from ._auth import AddressPolicy, Keys, ZapHandler
from ._context import handling_address
from ._errors import (
    ActorDeadError,
    AskTimeoutError,
    MailboxClosedError,
    ProtocolError,
    RemoteActorError,
    TokenyardError,
)
from ._message import Message, type_path
from ._message import registry as message_registry
from ._metrics import ENABLED, POW2_SLOTS, HistogramSnapshot, pow2_snapshot
from ._protocol import (
    HEADER_BYTE,
    MAX_FRAMES,
    NODE_KINDS,
    Cause,
    Down,
    ErrorBody,
    Header,
    Kind,
    TellHeaders,
    WatchBody,
    body_encoder,
    checked_trace,
    cookie_ok,
    decode_header,
    down_decoder,
    encode_header,
    error_decoder,
    new_corr,
    watch_decoder,
)
from ._ref import ActorRef
from ._throttle import Throttle
from ._transport import (
    NOBLOCK,
    POLLIN,
    Outbox,
    TransportOptions,
    bind_pull,
    events,
    recv_frame,
    recv_rest,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Container, Sequence

    from ._context import Frames, RefLike

logger = logging.getLogger("tokenyard.node")
#: How many dead addresses a node remembers (to refuse sends to them).
_DEAD_KEPT = 100_000
#: How many addresses the tell path remembers having subscribed for.
_KNOWN_KEPT = 100_000
#: How many other nodes may watch one actor here (the oldest are forgotten first).
_SUBSCRIBERS_KEPT = 1_024
#: Sockets one process's zmq context may hold.
_MAX_SOCKETS = 16_384
#: How many child processes' last words are kept until their monitors read them.
_WORDS_KEPT = 1_024
#: How many asked names get a round-trip histogram of their own (the rest share one).
_ASKED_KEPT = 1_024
_OTHER = "(other)"
#: The correlation id of heartbeat pings (their answers resolve no request).
_BEAT_CORR = 1
#: Heartbeat pings per ``heartbeat``.
BEATS = 8
#: A peer silent for this share of ``heartbeat`` is lost.
LOSS_SHARE = 0.8
_encode = body_encoder.encode
_NONE = _encode(None)


def _succeeded(future: asyncio.Future[Any]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    target: str
    timer: asyncio.TimerHandle | None = field(default=None)


class Node:
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
        self._reply_fd = int(self.reply_sock.getsockopt(zmq.FD))
        self._pending: dict[int, _Pending] = {}
        #: Why a child process said it is exiting, by its spawn token.
        self.last_words: dict[int, str] = {}
        #: Known deaths, by address: the whole record, so a late watcher gets it all.
        self._dead: dict[str, Down] = {}
        #: Addresses the tell path has subscribed for (its one check before subscribing).
        self._known: set[str] = set()
        #: Refs owned elsewhere whose deaths this node asked to hear of, by address.
        self._watched: dict[str, ActorRef[Any]] = {}
        #: Local callbacks waiting for a death, by address.
        self._listeners: dict[str, list[Callable[[Down], None]]] = {}
        #: Other nodes to tell when an actor this node owns dies, by address.
        self._subscribers: dict[str, dict[str, None]] = {}
        self._reply_decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: Any = None
        self._sweeper: asyncio.TimerHandle | None = None
        #: Over tcp, the other processes this one keeps a heartbeat with (the owners of the
        #: refs it watches, and `link`'s), by reply address: when each last answered.
        self._heard: dict[str, float] = {}
        #: Called when a linked process stops answering, by its address (`link`).
        self._links: dict[str, list[Callable[[str], None]]] = {}
        self._beater: asyncio.TimerHandle | None = None
        #: Called with the reply address of each process that pings this one (a node's
        #: leases, `runtime._nodes`).
        self.on_ping: Callable[[str], None] | None = None
        self.closed = False
        #: Takes the frames of the node protocol (JOIN, SPAWN, KILL, NODES) when this
        #: process is the system's root or one of its nodes (`runtime._nodes`).
        self.on_node_frame: Callable[[Header, bytes], None] | None = None
        #: Frames the reply inbox refused (undecodable, no cookie, unexpected).
        self.rejected = 0
        self._rejections = Throttle(logger)
        self._sends = Throttle(logger)
        #: Ask round trips by the name asked: power-of-two nanosecond slots, and their sum.
        self._asks: dict[str, tuple[list[int], list[int]]] = {}

    def new_stem(self, prefix: str) -> str:
        """A socket file name never used before in the system directory (a name used
        again could meet a peer still reconnecting to its previous owner)."""
        return f"{prefix}{os.getpid()}-{self._nonce}-{next(self._stems)}"

    def open(self) -> None:
        """Start reading replies on the running loop and make this the current node."""
        self._loop = asyncio.get_running_loop()
        if self.zap is not None:
            self.zap.start(self._loop)
        self._loop.add_reader(self._reply_fd, self._on_replies)
        self._token = _context.enter(self)
        # The fd is edge-triggered: anything that arrived before the reader existed must be
        # read now or it would wait for the next arrival.
        self._loop.call_soon(self._on_replies)
        self._sweeper = self._loop.call_later(self.options.peer_idle / 2, self._sweep)
        if self.options.transport == "tcp":
            self._beater = self._loop.call_later(self.options.heartbeat / BEATS, self._beat)

    # -- heartbeats -----------------------------------------------------------------------

    def link(self, address: str, on_lost: Callable[[str], None]) -> None:
        """Keep a heartbeat with the process whose reply inbox is ``address`` (tcp only), and
        call ``on_lost(address)`` once if it counts as lost (`_beat`)."""
        self._links.setdefault(address, []).append(on_lost)

    def unlink(self, address: str) -> None:
        """Forget `link`'s callbacks for ``address``."""
        self._links.pop(address, None)

    def _beat(self) -> None:
        """Every eighth of the heartbeat: ping each owner of a watched ref and each linked
        process; one silent for `LOSS_SHARE` of it is lost (`Cause.NOCONNECTION`), so a loss
        is known within 0.925 of a heartbeat of the last answer, counting the tick (the rest
        is room for a late timer).

        A lost ping or answer costs nothing (the next goes an eighth later); only most of a
        heartbeat without any answer does. The pings go from a loop callback, never waiting.
        """
        if self.closed or self._loop is None:
            return
        beat = self.options.heartbeat
        limit = beat * LOSS_SHARE
        self._beater = self._loop.call_later(beat / BEATS, self._beat)
        now = time.monotonic()
        peers = {ref.owner for ref in self._watched.values()}
        peers.update(self._links)
        peers.discard(self.reply_address)
        for gone in self._heard.keys() - peers:
            del self._heard[gone]
        for peer in peers:
            heard = self._heard.setdefault(peer, now)
            if now - heard > limit:
                self._lost(peer, now - heard)
            else:
                self.notify(peer, Kind.PING, b"", _BEAT_CORR)

    def _lost(self, address: str, silent: float) -> None:
        del self._heard[address]
        reason = f"no answer from {address} for {silent:.1f} s (noconnection)"
        logger.warning("%s: %s: its actors count as dead", self.name, reason)
        self.owner_died(address, address, Cause.NOCONNECTION, reason)
        for on_lost in self._links.pop(address, []):
            on_lost(address)

    def _sweep(self) -> None:
        if self.closed or self._loop is None:
            return
        self.outbox.sweep()
        self._sweeper = self._loop.call_later(self.options.peer_idle / 2, self._sweep)

    # -- sending --------------------------------------------------------------------------

    def check_alive(self, ref: RefLike) -> None:
        """Raise ``ActorDeadError`` if ``ref``'s incarnation is known to be dead."""
        down = self._dead.get(ref.address)
        if down is not None:
            raise ActorDeadError(
                f"actor {ref.name!r} (incarnation {ref.incarnation}) is dead: {down.reason}",
                reason=down.reason,
            )

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
            self.check_alive(ref)
        body = _encode(msg)
        # Coalesced only to a mailbox a node started (its ref names it): one of this system.
        coalesce = bool(ref.owner)
        if trace:
            contexts = checked_trace(trace)
            if self.outbox.try_send_traced(address, body, contexts, coalesce):
                return None
            return (self.header(Kind.TELL, trace=contexts), body)
        if self.outbox.try_send(address, body, coalesce):
            return None
        return body

    async def tell_when_room(self, ref: RefLike, frames: Frames, timeout: float | None) -> None:
        """Send an encoded tell, waiting while its mailbox is full (failing if it dies)."""
        check = functools.partial(self.check_alive, ref)
        if isinstance(frames, bytes):
            await self.outbox.send(ref.address, frames, timeout, check)
        else:
            await self.outbox.send_frames(ref.address, frames, timeout, check)

    def _learn(self, ref: RefLike) -> None:
        """First message to an address: subscribe to its death if another node owns it."""
        if len(self._known) >= _KNOWN_KEPT:
            self._known.clear()  # subscribing again is harmless; remembering all is not
        self._known.add(ref.address)
        if ref.owner and ref.owner != self.reply_address:
            self.subscribe(ref)

    def new_request(self, target: str) -> tuple[int, asyncio.Future[Any]]:
        """Register a pending reply (an ask, a readiness or stop handshake) under a fresh
        unguessable correlation id."""
        if self.closed or self._loop is None:
            raise MailboxClosedError("the actor system is closed")
        corr = new_corr()
        while corr in self._pending:
            corr = new_corr()
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[corr] = _Pending(future, target)
        return corr, future

    def drop_request(self, corr: int) -> None:
        """Forget a pending reply nobody waits for any more."""
        pending = self._pending.pop(corr, None)
        if pending is not None and pending.timer is not None:
            pending.timer.cancel()

    def header(
        self, kind: Kind, corr: int = 0, body_type: str = "", trace: Sequence[str] = ()
    ) -> bytearray:
        """An encoded header from this node, with the cookie (and trace context, if any).

        Raises:
            ProtocolError: More than `MAX_TRACE` contexts, or one longer than
                `MAX_TRACE_CHARS` (the receiver would refuse the message).
        """
        contexts = checked_trace(trace) if trace else ()
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
        self.check_alive(ref)
        if handling_address.get(None) == ref.address:
            raise TokenyardError(
                f"actor {ref.name!r} asked itself from inside a handler: the reply could only "
                "be handled after the handler returns; use tell, or call the method directly"
            )
        self.subscribe(ref)
        corr, future = self.new_request(ref.address)
        try:
            await self.outbox.send_frames(
                ref.address,
                (self.header(Kind.ASK, corr, trace=trace), _encode(msg)),
                timeout,
                lambda: self.check_alive(ref),
            )
            assert self._loop is not None
            pending = self._pending.get(corr)
            if pending is not None:
                pending.timer = self._loop.call_later(
                    timeout, self._expire, corr, ref.name, timeout
                )
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
        """Wait until every mailbox this node told has handled all it was told.

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
        self.check_alive(ref)
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

    async def ping(self, node_address: str, timeout: float) -> bool:
        """Probe the node at ``node_address``: whether its event loop answered in time."""
        corr, future = self.new_request(node_address)
        try:
            with anyio.move_on_after(timeout):
                await self.send_control(node_address, Kind.PING, corr, timeout=timeout)
                await future
                return True
        except TokenyardError:
            return False
        finally:
            self.drop_request(corr)
        return False

    def _expire(self, corr: int, name: str, timeout: float) -> None:
        pending = self._pending.pop(corr, None)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(
                AskTimeoutError(
                    f"no reply from actor {name!r} within {timeout:g} s; pass a longer "
                    "ask(timeout=...) if the handler is slow"
                )
            )

    async def reply(self, header: Header, result: object, timeout: float | None = None) -> None:
        """Send a handler's return value back to an asker.

        Raises:
            ProtocolError: ``result`` is not a ``Message`` (or ``None``), or too large.
        """
        if not header.reply_to:
            return
        if result is not None and not isinstance(result, Message):
            raise ProtocolError(
                f"a handler returned {type(result).__name__}; handlers return a Message or None"
            )
        body_type = "" if result is None else type_path(type(result))
        await self.outbox.send_frames(
            header.reply_to,
            (self.header(Kind.REPLY, header.corr, body_type), _encode(result)),
            timeout,
        )

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
        self._on_replies()

    def _on_replies(self) -> None:
        if self.closed:
            return
        sock = self.reply_sock
        # One reply per wake-up is the common case: asking EVENTS (which also re-arms the
        # edge-triggered fd) is cheaper than the failing recv that would end a drain.
        while events(sock) & POLLIN:
            try:
                first = recv_frame(sock, NOBLOCK)
            except zmq.Again:
                continue
            frames = recv_rest(sock, MAX_FRAMES)
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

    def _resolve(self, first: bytes, frames: list[bytes] | None) -> None:
        if first[:1] != HEADER_BYTE:
            raise ProtocolError("a frame without a header")
        header = decode_header(first)
        if not frames or len(frames) != header.frames:
            raise ProtocolError(f"a header announcing {header.frames} frames, not what came")
        if not cookie_ok(header, self.cookie):
            raise ProtocolError(f"a {header.kind.name} frame without the system's cookie")
        body = frames[0]
        kind = header.kind
        if kind is Kind.PING:
            if header.reply_to:
                self.notify(header.reply_to, Kind.PONG, b"", header.corr)
                if self.on_ping is not None:
                    self.on_ping(header.reply_to)
            return
        if kind is Kind.PONG and header.corr == _BEAT_CORR:
            if header.reply_to in self._heard:
                self._heard[header.reply_to] = time.monotonic()
            return
        if kind is Kind.WATCH:
            self._on_watch(watch_decoder.decode(body))
            return
        if kind is Kind.UNWATCH:
            watch = watch_decoder.decode(body)
            self._subscribers.get(watch.ref.address, {}).pop(watch.subscriber, None)
            return
        if kind in NODE_KINDS:
            if self.on_node_frame is None:
                raise ProtocolError(f"a {kind.name} frame to a process that is no node")
            self.on_node_frame(header, body)
            return
        if kind is Kind.DOWN:
            down = down_decoder.decode(body)
            # Only the node we asked may report a death, and of the ref we asked about.
            watched = self._watched.get(down.ref.address)
            if watched is not None and header.reply_to == watched.owner:
                self.mark_dead(msgspec.structs.replace(down, ref=watched))
            return
        pending = self._pending.get(header.corr)
        if pending is None and kind is Kind.FAILED:
            # A child's last words after it was ready: why it is about to exit (read by
            # its monitor, which registered the token).
            if header.corr in self.last_words:
                err = error_decoder.decode(body)
                self.last_words[header.corr] = f"{err.type_name}: {err.message}"
            return
        if pending is None or pending.future.done():
            return  # the asker gave up (timeout, cancellation): a late reply is dropped
        if kind not in (Kind.REPLY, Kind.ERROR, Kind.FAILED, Kind.READY, Kind.PONG, Kind.ANSWER):
            raise ProtocolError(f"a {kind.name} frame sent to a reply inbox")
        del self._pending[header.corr]
        if pending.timer is not None:
            pending.timer.cancel()
        try:
            if kind is Kind.REPLY:
                pending.future.set_result(self._decode_reply(header.body_type, body))
            elif kind in (Kind.READY, Kind.PONG, Kind.ANSWER):
                pending.future.set_result((header, body))
            else:
                err = error_decoder.decode(body)
                pending.future.set_exception(
                    RemoteActorError(err.type_name, err.message, err.traceback)
                )
        except Exception as err:
            # The asker is told at once that its reply came unreadable, not left waiting.
            pending.future.set_exception(ProtocolError(f"an undecodable reply: {err}"))
            raise

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

    def expect_last_words(self, token: int) -> None:
        """Keep the last words a child process with spawn ``token`` may send."""
        if len(self.last_words) >= _WORDS_KEPT:
            del self.last_words[next(iter(self.last_words))]
        self.last_words[token] = ""

    def take_last_words(self, token: int) -> str | None:
        """The last words of the child with spawn ``token`` (``None`` when it sent none)."""
        return self.last_words.pop(token, "") or None

    # -- death and shutdown ---------------------------------------------------------------

    def mark_dead(self, down: Down) -> None:
        """Record a death: fail every request pending on it, tell listeners and subscribers."""
        address = down.ref.address
        if address in self._dead:
            return
        reason = down.reason
        self._dead[address] = down
        if len(self._dead) > _DEAD_KEPT:
            del self._dead[next(iter(self._dead))]
        for corr, pending in list(self._pending.items()):
            if pending.target == address and not pending.future.done():
                del self._pending[corr]
                if pending.timer is not None:
                    pending.timer.cancel()
                pending.future.set_exception(
                    ActorDeadError(f"actor {down.ref.name!r} died: {reason}", reason=reason)
                )
        self.outbox.forget(address)
        self._watched.pop(address, None)
        for listener in self._listeners.pop(address, []):
            listener(down)
        frame = _encode(down)
        for subscriber in self._subscribers.pop(address, {}):
            self.notify(subscriber, Kind.DOWN, frame)

    def on_death(self, address: str, listener: Callable[[Down], None]) -> None:
        """Call ``listener`` once when the actor at ``address`` is known dead."""
        down = self._dead.get(address)
        if down is not None:
            listener(down)
            return
        self._listeners.setdefault(address, []).append(listener)

    def subscribe(self, ref: RefLike) -> None:
        """Ask the node owning ``ref`` to report its death here (once per address)."""
        owner = ref.owner
        if not owner or owner == self.reply_address or ref.address in self._watched:
            return
        full: ActorRef[Any] = ActorRef(ref.name, ref.address, ref.incarnation, owner)
        self._watched[ref.address] = full
        self.notify(owner, Kind.WATCH, _encode(WatchBody(full, self.reply_address)))

    def _on_watch(self, watch: WatchBody) -> None:
        dead = self._dead.get(watch.ref.address)
        if dead is not None:
            self.notify(watch.subscriber, Kind.DOWN, _encode(dead))
            return
        subscribers = self._subscribers.setdefault(watch.ref.address, {})
        subscribers[watch.subscriber] = None
        if len(subscribers) > _SUBSCRIBERS_KEPT:
            del subscribers[next(iter(subscribers))]

    def owner_died(
        self,
        node_address: str,
        name: str,
        cause: Cause = Cause.OWNER_DIED,
        reason: str = "",
    ) -> None:
        """A child process (whose node is ``node_address``) died, or a node was lost: the
        actors it owned are dead to this process, and it can no longer report their deaths.

        The socket to its reply inbox (made to answer its asks) is closed too: libzmq would
        otherwise keep reconnecting to the dead path for as long as this process lives.
        """
        why = reason or f"its owner {name!r} died"
        orphans = [ref for ref in self._watched.values() if ref.owner == node_address]
        for orphan in orphans:
            self.mark_dead(Down(ref=orphan, cause=cause, reason=why))
        self.outbox.forget(node_address)

    def notify(self, address: str, kind: Kind, body: bytes, corr: int = 0) -> None:
        """Best-effort control frame from a loop callback (never blocks)."""
        try:
            self.outbox.try_send_frames(address, (self.header(kind, corr), body))
        except TokenyardError as err:
            self._sends.warning(
                "%s: could not send %s to %s: %s", self.name, kind.name, address, err
            )

    def is_dead(self, address: str) -> bool:
        """Whether the actor at ``address`` is known to be dead."""
        return address in self._dead

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
        if self._beater is not None:
            self._beater.cancel()
        if self._loop is not None:
            self._loop.remove_reader(self._reply_fd)
        for pending in self._pending.values():
            if pending.timer is not None:
                pending.timer.cancel()
            if not pending.future.done():
                pending.future.set_exception(MailboxClosedError("the actor system closed"))
                # Whoever awaits it still gets the error; nobody awaiting is no news.
                pending.future.exception()
        self._pending.clear()
        # Owners forget this node, so an actor watched by many short-lived processes does
        # not keep (and one day notify) every one of them.
        for ref in self._watched.values():
            self.notify(ref.owner, Kind.UNWATCH, _encode(WatchBody(ref, self.reply_address)))
        self.reply_sock.close(0)
        self._close_context(linger_ms)
        _context.leave(self, self._token)
        self._token = None

    def _close_context(self, linger_ms: int = 0) -> None:
        self.outbox.close(linger_ms)
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()
