"""The per-process core of an actor system: zmq context, outbox, reply inbox, pending asks.

Every process that runs actors has one ``Node`` per open ``ActorSystem``. Refs find the node
to send from through a context variable, falling back to the most recently opened node, so
code running in tasks the system did not start (a web framework's request handlers) works.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq

from ._codec import (
    HEADER_BYTE,
    MAX_FRAMES,
    DownBody,
    ErrorBody,
    Header,
    Kind,
    WatchBody,
    body_encoder,
    decode_header,
    down_decoder,
    encode_header,
    error_decoder,
    watch_decoder,
)
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
    from collections.abc import Callable, Container

    from ._ref import ActorRef

logger = logging.getLogger("tokenyard.node")
#: How many dead addresses a node remembers (to refuse sends to them).
_DEAD_KEPT = 100_000
_encode = body_encoder.encode
_NONE = _encode(None)
_current: contextvars.ContextVar[Node] = contextvars.ContextVar("tokenyard_node")
_open_nodes: list[Node] = []
#: Address of the mailbox whose handler is running in this task, to refuse a self-ask.
handling_address: contextvars.ContextVar[str] = contextvars.ContextVar("tokenyard_handling")


def current_node() -> Node:
    """The node that sends on behalf of the running code.

    Raises:
        MailboxClosedError: No actor system is open in this process.
    """
    node = _current.get(None)
    if node is not None and not node.closed:
        return node
    if _open_nodes:
        return _open_nodes[-1]
    raise MailboxClosedError(
        "no ActorSystem is open in this process: use `async with ActorSystem()`"
    )


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
        cookie: The system's secret, sent on control frames.
    """

    def __init__(self, ipc_dir: str, options: TransportOptions, name: str, cookie: bytes) -> None:
        self.ipc_dir = ipc_dir
        self.cookie = cookie
        self.options = options
        self.name = name
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.outbox = Outbox(self.ctx, options)
        self._stems = itertools.count()
        self.reply_sock, self.reply_address = bind_pull(
            self.ctx, ipc_dir, self.new_stem("r"), options
        )
        self._reply_fd = int(self.reply_sock.getsockopt(zmq.FD))
        self._corr = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        #: Why a child process said it is exiting, by its spawn token.
        self.last_words: dict[int, str] = {}
        #: Known deaths, by address: the whole record, so a late watcher gets the exit
        #: status and signal too, not only the reason.
        self._dead: dict[str, DownBody] = {}
        #: Addresses this node has sent to (the hot path's one check before subscribing).
        self._known: set[str] = set()
        #: Addresses this node asked an owner about, and that owner's reply address.
        self._watched: dict[str, str] = {}
        #: Local callbacks waiting for a death, by address.
        self._listeners: dict[str, list[Callable[[DownBody], None]]] = {}
        #: Other nodes to tell when an actor this node owns dies, by address.
        self._subscribers: dict[str, set[str]] = {}
        self._reply_decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: contextvars.Token[Node] | None = None
        self.closed = False
        self.bound_paths: list[str] = []

    def new_stem(self, prefix: str) -> str:
        """A socket file name unique within the system directory."""
        return f"{prefix}{os.getpid()}-{id(self) & 0xFFFF:x}-{next(self._stems)}"

    def open(self) -> None:
        """Start reading replies on the running loop and make this the current node."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._reply_fd, self._on_replies)
        self._token = _current.set(self)
        _open_nodes.append(self)
        # The fd is edge-triggered: anything that arrived before the reader existed must be
        # read now or it would wait for the next arrival.
        self._loop.call_soon(self._on_replies)

    # -- sending --------------------------------------------------------------------------

    def check_alive(self, ref: ActorRef[Any]) -> None:
        """Raise ``ActorDeadError`` if ``ref``'s incarnation is known to be dead."""
        down = self._dead.get(ref.address)
        if down is not None:
            reason = down.reason
            raise ActorDeadError(
                f"actor {ref.name!r} (incarnation {ref.incarnation}) is dead: {reason}",
                reason=reason,
            )

    def try_tell(self, ref: ActorRef[Any], msg: Message) -> bytes | None:
        """Encode and send a one-way message (one frame) if its queue has room now.

        Returns:
            ``None`` when sent; else the encoded frame, for ``outbox.send`` to wait with.
        """
        address = ref.address
        if address not in self._known:
            self._learn(ref)
        if self._dead and address in self._dead:
            self.check_alive(ref)
        frame = _encode(msg)
        if self.outbox.try_send(address, frame):
            return None
        return frame

    def _learn(self, ref: ActorRef[Any]) -> None:
        """First message to an address: subscribe to its death if another node owns it."""
        self._known.add(ref.address)
        if ref.owner and ref.owner != self.reply_address:
            self.subscribe(ref)

    def new_request(self, target: str) -> tuple[int, asyncio.Future[Any]]:
        """Register a pending reply (an ask, a readiness or stop handshake)."""
        if self.closed or self._loop is None:
            raise MailboxClosedError("the actor system is closed")
        corr = next(self._corr)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[corr] = _Pending(future, target)
        return corr, future

    def drop_request(self, corr: int) -> None:
        """Forget a pending reply nobody waits for any more."""
        pending = self._pending.pop(corr, None)
        if pending is not None and pending.timer is not None:
            pending.timer.cancel()

    async def ask(self, ref: ActorRef[Any], msg: Message, timeout: float) -> Any:
        """Send ``msg`` with a correlation id and wait for the matching reply."""
        self.check_alive(ref)
        if handling_address.get(None) == ref.address:
            raise TokenyardError(
                f"actor {ref.name!r} asked itself from inside a handler: the reply could only "
                "be handled after the handler returns; use tell, or call the method directly"
            )
        self.subscribe(ref)
        corr, future = self.new_request(ref.address)
        header = Header(Kind.ASK, corr, self.reply_address, self.name)
        try:
            await self.outbox.send_frames(
                ref.address,
                (encode_header(header), _encode(msg)),
                timeout,
                lambda: self.check_alive(ref),
            )
            assert self._loop is not None
            pending = self._pending.get(corr)
            if pending is not None:
                pending.timer = self._loop.call_later(
                    timeout, self._expire, corr, ref.name, timeout
                )
            return await future
        finally:
            self.drop_request(corr)
            if future.done() and not future.cancelled():
                future.exception()  # failed while sending (a death): the caller has that

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
                    header = Header(Kind.FLUSH, corr, self.reply_address, self.name)
                    with contextlib.suppress(TokenyardError):  # dead or stuck: late below
                        await self.outbox.send_frames(address, (encode_header(header), _NONE))
                for _, future in acks.values():
                    with contextlib.suppress(TokenyardError):
                        await future
        finally:
            for corr, _ in acks.values():
                self.drop_request(corr)
        return [a for a, (_, f) in acks.items() if not _succeeded(f) and a not in self._dead]

    async def ask_control(
        self, ref: ActorRef[Any], kind: Kind, timeout: float, body: Message | None = None
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
        """Send a handler's return value back to an asker."""
        if not header.reply_to:
            return
        if result is not None and not isinstance(result, Message):
            err = ProtocolError(
                f"a handler returned {type(result).__name__}; handlers return a Message or None"
            )
            await self.reply_error(header, err)
            return
        body_type = "" if result is None else type_path(type(result))
        out = Header(Kind.REPLY, header.corr, "", self.name, body_type)
        await self.outbox.send_frames(
            header.reply_to, (encode_header(out), _encode(result)), timeout
        )

    async def reply_error(
        self, header: Header, err: BaseException | ErrorBody, timeout: float | None = None
    ) -> None:
        """Send a failure back to an asker, as data."""
        if not header.reply_to:
            return
        if isinstance(err, ErrorBody):
            body = err
        else:
            tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            body = ErrorBody(f"{type(err).__module__}.{type(err).__qualname__}", str(err), tb)
        out = Header(Kind.ERROR, header.corr, "", self.name)
        await self.outbox.send_frames(header.reply_to, (encode_header(out), _encode(body)), timeout)

    async def send_control(
        self, address: str, kind: Kind, corr: int, body: bytes = b"", timeout: float | None = None
    ) -> None:
        """Send a control frame (stop, ready, failed) that needs no handler."""
        header = Header(kind, corr, self.reply_address, self.name, cookie=self.cookie)
        await self.outbox.send_frames(address, (encode_header(header), body), timeout)

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
            self._resolve(first)

    def _resolve(self, first: bytes) -> None:
        pending: _Pending | None = None
        frames = recv_rest(self.reply_sock, MAX_FRAMES)
        try:
            if first[:1] != HEADER_BYTE:
                raise ProtocolError("a reply without a header")
            header = decode_header(first)
            if not frames or len(frames) != header.frames:
                raise ProtocolError(f"a header announcing {header.frames} frames, not what came")
            body = frames[0]
            if header.kind in (Kind.WATCH, Kind.DOWN):
                self._on_watch_frame(header, body)
                return
            pending = self._pending.pop(header.corr, None)
            if pending is None and header.kind is Kind.FAILED:
                # A child's last words: why it is about to exit (read by its monitor).
                err = error_decoder.decode(body)
                self.last_words[header.corr] = f"{err.type_name}: {err.message}"
                return
            if pending is None or pending.future.done():
                return  # the asker gave up (timeout, cancellation): a late reply is dropped
            if pending.timer is not None:
                pending.timer.cancel()
            if header.kind is Kind.REPLY:
                pending.future.set_result(self._decode_reply(header.body_type, body))
            elif header.kind in (Kind.ERROR, Kind.FAILED):
                err = error_decoder.decode(body)
                pending.future.set_exception(
                    RemoteActorError(err.type_name, err.message, err.traceback)
                )
            else:
                pending.future.set_result((header, body))
        except (msgspec.DecodeError, msgspec.ValidationError, ProtocolError) as err:
            logger.warning("%s: dropped an undecodable reply: %s", self.name, err)
            if pending is not None and not pending.future.done():
                pending.future.set_exception(ProtocolError(f"undecodable reply: {err}"))

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

    # -- death and shutdown ---------------------------------------------------------------

    def mark_dead(self, address: str, body: DownBody) -> None:
        """Record a death: fail every request pending on it, tell listeners and subscribers."""
        if address in self._dead:
            return
        reason = body.reason
        self._dead[address] = body
        if len(self._dead) > _DEAD_KEPT:
            del self._dead[next(iter(self._dead))]
        for corr, pending in list(self._pending.items()):
            if pending.target == address and not pending.future.done():
                del self._pending[corr]
                if pending.timer is not None:
                    pending.timer.cancel()
                pending.future.set_exception(
                    ActorDeadError(f"actor {body.name!r} died: {reason}", reason=reason)
                )
        self.outbox.forget(address)
        self._watched.pop(address, None)
        for listener in self._listeners.pop(address, []):
            listener(body)
        frame = _encode(body)
        for subscriber in self._subscribers.pop(address, set()):
            self._notify(subscriber, Kind.DOWN, frame)

    def on_death(self, address: str, listener: Callable[[DownBody], None]) -> None:
        """Call ``listener`` once when the actor at ``address`` is known dead."""
        down = self._dead.get(address)
        if down is not None:
            listener(down)
            return
        self._listeners.setdefault(address, []).append(listener)

    def subscribe(self, ref: ActorRef[Any]) -> None:
        """Ask the node owning ``ref`` to report its death here (once per address)."""
        owner = ref.owner
        if not owner or owner == self.reply_address or ref.address in self._watched:
            return
        self._watched[ref.address] = owner
        self._notify(owner, Kind.WATCH, _encode(WatchBody(ref.address, self.reply_address)))

    def owner_died(self, node_address: str, name: str) -> None:
        """A child process (whose node is ``node_address``) died: the actors it owned died
        with it (they follow their parent), and it can no longer report their deaths.

        The socket to its reply inbox (made to answer its asks) is closed too: libzmq would
        otherwise keep reconnecting to the dead path for as long as this process lives.
        """
        orphans = [a for a, owner in self._watched.items() if owner == node_address]
        for orphan in orphans:
            self.mark_dead(orphan, DownBody(orphan, "", f"its owner {name!r} died"))
        self.outbox.forget(node_address)

    def _notify(self, address: str, kind: Kind, body: bytes) -> None:
        """Best-effort control frame from a loop callback (never blocks)."""
        header = Header(kind, 0, self.reply_address, self.name, cookie=self.cookie)
        try:
            self.outbox.try_send_frames(address, (encode_header(header), body))
        except TokenyardError as err:
            logger.debug("%s: could not send %s to %s: %s", self.name, kind.name, address, err)

    def _on_watch_frame(self, header: Header, body: bytes) -> None:
        if header.cookie != self.cookie:
            logger.warning("%s: refused a %s frame without the cookie", self.name, header.kind)
            return
        if header.kind is Kind.WATCH:
            watch = watch_decoder.decode(body)
            dead = self._dead.get(watch.address)
            if dead is not None:
                self._notify(watch.subscriber, Kind.DOWN, _encode(dead))
            else:
                self._subscribers.setdefault(watch.address, set()).add(watch.subscriber)
        else:
            down = down_decoder.decode(body)
            self.mark_dead(down.address, down)

    def is_dead(self, address: str) -> bool:
        """Whether the actor at ``address`` is known to be dead."""
        return address in self._dead

    def close(self) -> None:
        """Close every socket and the context; fail what is still pending."""
        if self.closed:
            return
        self.closed = True
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
        self.reply_sock.close(0)
        self.outbox.close(0)
        self.ctx.term()
        if self in _open_nodes:
            _open_nodes.remove(self)
        if self._token is not None:
            # Closing from another context than the opening one cannot reset the variable;
            # current_node() skips a closed node anyway.
            with contextlib.suppress(ValueError):
                _current.reset(self._token)
            self._token = None
