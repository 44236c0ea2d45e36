"""An actor's mailbox: a bound PULL socket, its decoder, and its counters."""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from ._codec import (
    CONTROL_KINDS,
    HEADER_MARK,
    MAX_FRAMES,
    ErrorBody,
    Header,
    Kind,
    MailboxDecoder,
    decode_header,
)
from ._message import Message
from ._transport import NOBLOCK, POLLIN, ReadinessWaiter, recv_frame, recv_rest
from ._watch import LookupQuery

logger = logging.getLogger("tokenyard.mailbox")

#: One received item: the header and its decoded body (or an ``ErrorBody`` saying why an
#: ask's body was refused: the asker is told, not left waiting); for a plain tell, ``None``
#: and the raw frame, decoded only just before its handler runs. Decoding a whole drained
#: run up front would keep hundreds of decoded messages alive at once, and the garbage
#: collector would walk them all on every collection (measured: 10x slower for batches).
Item = tuple[Header | None, Message | ErrorBody | bytes | None]

_LOG_EVERY = 5.0
_lookup_decoder = msgspec.msgpack.Decoder(LookupQuery)


class MailboxStatistics(Message):
    """Counters of one mailbox.

    Attributes:
        received: Frames read off the socket (control frames included).
        rejected: Frames refused: undecodable, or of a type this actor does not accept.
        handled: Messages whose handler returned.
        failed: Messages whose handler raised.
        queued: Messages read off the socket and not yet handled.
    """

    received: int
    rejected: int
    handled: int
    failed: int
    queued: int


class Mailbox:
    """Receives, decodes and counts what arrives for one actor.

    Args:
        sock: The bound PULL socket (the mailbox owns and closes it).
        address: The address it is bound to.
        decoder: Decoder of the actor's accepted message union.
        owner: The actor's name, for logs.
        cookie: The system's secret, required on control frames.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        address: str,
        decoder: MailboxDecoder,
        owner: str,
        cookie: bytes,
    ) -> None:
        self.sock = sock
        self.cookie = cookie
        self.address = address
        self.decoder = decoder
        self.owner = owner
        self.received = 0
        self.rejected = 0
        self.handled = 0
        self.failed = 0
        self.queued = 0
        self._waiter = ReadinessWaiter(sock)
        #: The last drain emptied the socket: the next receive waits (its readiness check
        #: is cheaper than a ``recv`` that fails) instead of draining again.
        self._emptied = False
        self._unlogged = 0
        self._last_log = 0.0

    def statistics(self) -> MailboxStatistics:
        """A snapshot of the counters."""
        return MailboxStatistics(
            received=self.received,
            rejected=self.rejected,
            handled=self.handled,
            failed=self.failed,
            queued=self.queued,
        )

    def drain(self, limit: int = 1024) -> list[Item]:
        """Read up to ``limit`` queued messages without waiting (tells stay undecoded)."""
        items: list[Item] = []
        sock = self.sock
        while len(items) < limit:
            try:
                frame = recv_frame(sock, NOBLOCK)
            except zmq.Again:
                self._emptied = True
                break
            self.received += 1
            if frame and frame[0] == HEADER_MARK:
                item = self._framed(frame)
                if item is not None:
                    items.append(item)
                continue
            items.append((None, frame))
        self.queued += len(items)
        return items

    async def receive(self, limit: int = 1024) -> list[Item]:
        """Wait for at least one message, then drain up to ``limit`` without awaiting."""
        while True:
            if self._emptied:
                await self._waiter.wait(POLLIN)
                self._emptied = False
            items = self.drain(limit)
            if items:
                return items

    def _framed(self, first: bytes) -> Item | None:
        rest = recv_rest(self.sock, MAX_FRAMES)
        try:
            header = decode_header(first)
            if not rest or len(rest) != header.frames:
                parts = f"more than {MAX_FRAMES}" if rest is None else len(rest)
                raise msgspec.ValidationError(
                    f"a header announcing {header.frames} frames, followed by {parts}"
                )
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self.reject(err, first)
            return None
        if header.kind in CONTROL_KINDS and header.cookie != self.cookie:
            self.reject(msgspec.ValidationError("a control frame without the cookie"), first)
            return None
        if header.kind is Kind.LOOKUP:
            try:
                return (header, _lookup_decoder.decode(rest[0]))
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                self.reject(err, rest[0])
                return None
        if header.kind is not Kind.ASK:
            return (header, None)
        if not header.reply_to.startswith(("ipc://", "tcp://")):
            self.reject(msgspec.ValidationError("an ask with no usable reply address"), first)
            return None
        try:
            return (header, self.decoder.decode(rest[0]))
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self.reject(err, rest[0])
            text = f"{self.owner} refused the message: {err}"
            return (header, ErrorBody("runtime.ProtocolError", text, ""))

    def reject(self, err: Exception, frame: bytes) -> None:
        """Count a refused frame and log it (at most one line per few seconds)."""
        self.rejected += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY:
            logger.warning(
                "%s rejected %d message(s); latest: %s (first bytes %r)",
                self.owner,
                self._unlogged,
                err,
                frame[:16],
            )
            self._unlogged = 0
            self._last_log = now

    def close(self) -> None:
        """Close the socket (libzmq removes an ipc socket file when its listener closes)."""
        self._waiter.close()
        self.sock.close(0)
