"""An actor's mailbox: a bound PULL socket, its decoder, its byte budget and its counters.

The mailbox is the only writer of its counters: the cell that runs the actor takes each
message through `Mailbox.open` (a tell) or `Mailbox.take` (a framed message), and reports a
failed handler with `Mailbox.fail`.

Nothing a peer sends can end the actor: every frame that does not decode, or breaks the
framing or the trust rules, whatever the error (a ``RecursionError`` from deep nesting
included), is counted as rejected, logged at most once per few seconds, and skipped.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import zmq

from ._errors import ProtocolError
from ._message import Message
from ._protocol import (
    HANDLED_KINDS,
    HEADER_MARK,
    MAX_FRAMES,
    ErrorBody,
    Header,
    Kind,
    TellsDecoder,
    Traced,
    cookie_ok,
    lookup_decoder,
    metrics_decoder,
)
from ._throttle import Throttle
from ._transport import (
    NOBLOCK,
    POLLIN,
    ReadinessWaiter,
    close_listener,
    events,
    recv_frame,
    recv_rest,
)

if TYPE_CHECKING:
    import logging
    from collections.abc import Callable

    from ._codec import MailboxDecoder

#: Kinds a mailbox reads (the rest go to a node's reply inbox).
_MAILBOX_KINDS = frozenset(
    {
        Kind.ASK,
        Kind.TELL,
        Kind.TELLS,
        Kind.STOP,
        Kind.STATS,
        Kind.LOOKUP,
        Kind.FLUSH,
        Kind.METRICS,
    }
)


class MailboxStatistics(Message):
    """Counters of one mailbox.

    Attributes:
        received: Messages read off the socket (control frames included; each tell of a
            bundle counts as one).
        rejected: Frames refused: undecodable, of a type this actor does not accept, or
            breaking the framing or trust rules.
        handled: Messages handed to their handler that did not fail (the running one
            included).
        failed: Messages whose handler raised.
        queued: Messages read off the socket and not yet handled.
        queued_bytes: Bytes of those messages (bounded by ``mailbox_bytes``).
        received_bytes: Bytes of the messages read off the socket and accepted.
    """

    received: int
    rejected: int
    handled: int
    failed: int
    queued: int
    queued_bytes: int = 0
    received_bytes: int = 0


class Envelope:
    """A framed message taken off the socket: its header, and its body.

    Attributes:
        header: The header.
        body: The undecoded body of an ask or a traced tell, decoded by `Mailbox.open_body`
            just before its handler runs (as a plain tell's frame is); ``None`` for other
            kinds.
        message: The decoded body of a lookup or a metrics request; ``None`` for other
            kinds.
        size: Bytes it arrived as.
    """

    __slots__ = ("body", "header", "message", "size")

    def __init__(
        self,
        header: Header,
        size: int,
        message: Message | None = None,
        body: bytes | None = None,
    ) -> None:
        self.header = header
        self.size = size
        self.message = message
        self.body = body


#: One received item: a tell's frame, a traced tell of a bundle (`Traced`), or a framed
#: message. Bodies are decoded only just before their handler runs, framed or not
#: (decoding a whole drained run up front would keep hundreds of decoded messages alive at
#: once, and the garbage collector would walk them all on every collection: 10x slower for
#: batches, measured again for traced tells).
Item = bytes | Traced | Envelope


class Mailbox:
    """Receives, decodes and counts what arrives for one actor.

    Args:
        sock: The bound PULL socket (the mailbox owns and closes it).
        address: The address it is bound to.
        decoder: Decoder of the actor's accepted message union.
        actor_name: The actor's name, for logs.
        cookie: The system's secret, required on every framed message.
        allows: Whether an address is the system's own (an ask's reply address must be).
        budget: Most bytes read off the socket and not yet handled.
        logger: Where rejections are logged.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        address: str,
        decoder: MailboxDecoder,
        actor_name: str,
        cookie: bytes,
        allows: Callable[[str], bool],
        budget: int,
        logger: logging.Logger,
    ) -> None:
        self.sock = sock
        self.address = address
        self._bound_by = os.getpid()
        self.actor_name = actor_name
        self._cookie = cookie
        self._allows = allows
        self._budget = budget
        self._tells = TellsDecoder()
        self._received = 0
        self._rejected = 0
        self._opened = 0
        self._failed = 0
        self._queued = 0
        self._queued_bytes = 0
        self._received_bytes = 0
        self._waiter = ReadinessWaiter(sock)
        #: The last drain emptied the socket: the next receive waits (its readiness check
        #: is cheaper than a ``recv`` that fails) instead of draining again.
        self._emptied = False
        #: The last drain stopped at an ask, to answer it first: the next receive asks the
        #: socket whether more came before it reads (a request alone is the common case,
        #: and a ``recv`` that fails costs twice what ``EVENTS`` does).
        self._answering = False
        self._throttle = Throttle(logger)
        self._decode = decoder.decode
        #: Bytes the framed message read last came as (`_framed`).
        self._arrived = 0
        self._held = 0  # of which the tells' messages, when it held tells

    def statistics(self) -> MailboxStatistics:
        """A snapshot of the counters."""
        return MailboxStatistics(
            received=self._received,
            rejected=self._rejected,
            handled=self._opened - self._failed,
            failed=self._failed,
            queued=self._queued,
            queued_bytes=self._queued_bytes,
            received_bytes=self._received_bytes,
        )

    # -- reading ----------------------------------------------------------------------------

    def drain(self, limit: int = 1024) -> list[Item]:
        """Read up to ``limit`` queued messages without waiting (tells stay undecoded), and
        no more once the bytes read pass the budget (one at the least).

        The budget counts the bytes as they came, headers included (a traced tell's trace
        context with them); the queue's counters count the messages' own bytes. The drained
        run is handled whole before the next drain, so what one drain holds is bounded."""
        items: list[Item] = []
        sock = self.sock
        size = 0  # bytes read: what the budget bounds
        headers = 0  # of which framing: headers, a refused message, a bundle's own bytes
        budget = self._budget - self._queued_bytes
        while len(items) < limit and (size < budget or not items):
            try:
                frame = recv_frame(sock, NOBLOCK)
            except zmq.Again:
                self._emptied = True
                self._waiter.rearmed()
                break
            self._received += 1
            if frame and frame[0] == HEADER_MARK:
                framed = self._framed(frame)
                arrived = self._arrived
                size += arrived
                if isinstance(framed, Envelope):  # its size is what it arrived as
                    items.append(framed)
                    if framed.header.corr:
                        # Somebody waits for its answer: that goes out before the next
                        # read.
                        self._answering = True
                        break
                elif framed is not None:  # tells
                    items += framed
                    headers += arrived - self._held
                else:
                    headers += arrived
                continue
            items.append(frame)
            size += len(frame)
        held = size - headers
        self._queued += len(items)
        self._queued_bytes += held
        self._received_bytes += held
        return items

    async def receive(self, limit: int = 1024) -> list[Item]:
        """Wait for at least one message, then drain up to ``limit`` without awaiting."""
        while True:
            if self._emptied:  # the last read failed: sleep until the fd fires
                await self._waiter.woken()
                self._emptied = False
            elif self._answering:  # ask first: reading EVENTS re-arms the fd as a failed read
                self._answering = False
                if not events(self.sock) & POLLIN:
                    self._waiter.rearmed()
                    await self._waiter.woken()
            items = self.drain(limit)
            if items:
                return items

    def _framed(self, first: bytes) -> Envelope | list[bytes | Traced] | None:
        """What a framed message holds (``None``: refused); `_arrived` says the bytes it
        came as, and `_held` those of its tells' messages when it held tells."""
        rest = recv_rest(self.sock, MAX_FRAMES)
        if rest is not None and len(rest) == 1:  # a header and its body, as nearly always
            size = len(first) + len(rest[0])
        else:
            size = len(first) + (0 if rest is None else sum(map(len, rest)))
        self._arrived = size
        try:
            header = self._tells.header(first)
            if not rest or len(rest) != header.frames:
                parts = f"more than {MAX_FRAMES}" if rest is None else len(rest)
                raise ProtocolError(
                    f"a header announcing {header.frames} frames, followed by {parts}"
                )
            if not cookie_ok(header, self._cookie):
                raise ProtocolError(f"a {header.kind.name} frame without the system's cookie")
            if header.kind not in _MAILBOX_KINDS:
                raise ProtocolError(f"a {header.kind.name} frame sent to a mailbox")
            if header.reply_to and not self._allows(header.reply_to):
                raise ProtocolError(f"a reply address outside the system: {header.reply_to!r}")
        except Exception as err:  # noqa: BLE001 - any failure on peer bytes is a rejection
            self.reject(err, first)
            return None
        body = rest[0]
        if header.kind is Kind.TELLS:
            return self._unbundle(body)
        if header.kind is Kind.TELL:  # taken like a bundle's traced tell
            self._held = len(body)
            return [Traced(body, header.trace)]
        if header.kind is Kind.LOOKUP or (header.kind is Kind.METRICS and body):
            decoder = lookup_decoder if header.kind is Kind.LOOKUP else metrics_decoder
            try:
                return Envelope(header, size, decoder.decode(body))
            except Exception as err:  # noqa: BLE001
                self.reject(err, body)
                return None
        if header.kind is Kind.ASK and not header.reply_to:
            self.reject(ProtocolError("an ask with no reply address"), first)
            return None
        if header.kind in HANDLED_KINDS:
            return Envelope(header, size, body=body)
        return Envelope(header, size)

    def _unbundle(self, body: bytes) -> list[bytes | Traced] | None:
        """The tells of a bundle, in order: each a tell's frame, or a traced tell."""
        try:
            bundled, self._held = self._tells.bundle(body)
            if not bundled:  # never sent: a bundle carries one tell at least
                raise ProtocolError("an empty bundle")
        except Exception as err:  # noqa: BLE001 - any failure on peer bytes is a rejection
            self.reject(err, body)
            return None
        self._received += len(bundled) - 1  # the frame was counted as one
        return bundled

    def has_room(self) -> bool:
        """Whether the messages read and not yet handled leave room in the byte budget (a
        reader ahead of the handlers stops when they do not)."""
        return self._queued_bytes < self._budget

    # -- taking messages (the cell) ---------------------------------------------------------

    def open(self, frame: bytes) -> Message | None:
        """Take a tell off the queue and decode it (a traced tell of a bundle: its
        ``body``); ``None`` when it is refused."""
        self._queued -= 1
        self._queued_bytes -= len(frame)
        try:
            msg = self._decode(frame)
        except Exception as err:  # noqa: BLE001 - any failure on peer bytes is a rejection
            self.reject(err, frame)
            return None
        self._opened += 1
        return msg

    def take(self, envelope: Envelope) -> None:
        """Take a framed message off the queue (its body, if any, is opened next)."""
        self._queued -= 1
        self._queued_bytes -= envelope.size

    def open_body(self, envelope: Envelope) -> Message | ErrorBody:
        """Decode the body of an ask or a traced tell that was just taken.

        Returns:
            The message; or, when its body is refused (counted and logged), what an asker
            is told of the refusal.
        """
        body = envelope.body
        assert body is not None, "only asks and traced tells have a body to open"
        try:
            msg = self._decode(body)
        except Exception as err:  # noqa: BLE001 - any failure on peer bytes is a rejection
            self.reject(err, body)
            text = f"{self.actor_name} refused the message: {err}"
            return ErrorBody("runtime.ProtocolError", text, "")
        self._opened += 1
        return msg

    def fail(self) -> None:
        """Count the handler of the message opened last as failed."""
        self._failed += 1

    def reject(self, err: BaseException, frame: bytes) -> None:
        """Count a refused frame and log it (at most one line per few seconds)."""
        self._rejected += 1
        self._throttle.warning(
            "%s rejected a message: %s (first bytes %r)", self.actor_name, err, bytes(frame[:16])
        )

    def close(self) -> None:
        """Close the socket, and remove its ipc socket file."""
        self._waiter.close()
        close_listener(self.sock, self.address, self._bound_by)
