"""``BoundedProtocol``: uvicorn's httptools protocol, with the bounds a server that faces
any client needs.

uvicorn's own protocol bounds neither the bytes nor the number of a request's headers, and
times out only a kept-alive connection after a response: a client that sends its headers
a byte at a time, opens connections and says nothing, or promises a body it never sends,
holds its connection (and a worker's memory: the parser grows a header value by copying,
so the cost of a long head is quadratic) for as long as it likes. Here:

- **Head bytes and header count.** A request's head is gathered until its blank line and
  then parsed in one go, so it costs time linear in its size (fed piece by piece, the
  parser copies a long header value anew for every piece). A head that does not end within
  `ServeConfig.max_header_bytes` gets 431, as does one with more than
  `ServeConfig.max_headers` fields; nothing past the limit is kept or parsed. A head that
  reaches the parser in the same read as the request before it is counted as it is
  parsed, and held to the same bound.
- **Pipelined requests.** At most `MAX_PIPELINED` requests wait behind the one being
  answered; a client that sends more before reading its answers gets those, and then the
  connection closes (what it sent past them is dropped, unread by the parser). Before, each
  read of pipelined requests (a few hundred KB) was parsed into thousands of waiting
  requests, a worker's memory growing about 60 times faster than what the client sent.
- **Timeouts.** A connection with no request open is closed after
  `ServeConfig.idle_timeout` (before its first request too); a request whose headers have
  not all arrived `ServeConfig.header_timeout` after its first byte gets 408; so does one
  whose body goes `ServeConfig.body_timeout` without a byte while the server waits for it
  (a Content-Length or chunk size that lies). Time the application leaves the body unread
  (reading paused) does not count.
- **Answers nobody reads.** Bytes of an answer that wait for the client (past what the
  kernel holds) and of which the client takes none for `ServeConfig.send_timeout` close
  the connection: a client that stops reading would otherwise hold its connection, and
  the answer's bytes, for ever (a close waits for them to go out, however long).
- **Log lines.** A request the parser cannot read is logged (uvicorn's line), at most
  once per `runtime.Throttle` interval per worker, with the count of those held back: a
  client sending thousands of them would otherwise write a line for each.
- **Draining.** Once its server drains, a connection idle between two requests closes,
  and every request answered from then on closes its connection after the answer. A
  connection that has brought no request yet (handed to the worker just now, its request
  perhaps on its way) is kept for one: closing it would reset a request already sent (the
  kernel answers unread bytes with a reset); its idle timeout, or the drain's deadline,
  closes it if none comes.

A refusal (those, or a 400 for a request the parser cannot read) is an OpenAI-shaped JSON
error with ``connection: close`` and an ``X-Request-Id`` (the request's own when its
headers were read, else a new one), written by the protocol itself (no application task is
started for a request that never completed its head), after the answers to the requests
pipelined ahead of it, then the connection is closed lingering, as the port's owner closes
its refusals (`actors.http._refuse`). So is a connection the application's answer closes
while its request's body is still coming (a 413, an error answered before the body was
read): closed at once, it was reset under a client still sending, which never read the
answer. And so is one whose request was answered while its body still came, unread (a
route that takes none): that body is not read to its end, however long it is.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ._asgi import request_id
from ._errors import HTTPError
from ._refuse import LINGER

if TYPE_CHECKING:
    from collections.abc import Callable

    from runtime import Throttle

    from ._config import ServeConfig

__all__ = ("BoundedProtocol",)


#: Most requests of a connection parsed and waiting behind the one being answered.
MAX_PIPELINED = 16

#: What a connection's timer watches.
_HEAD, _BODY = 1, 2


def _end_of_head(head: bytes | bytearray, start: int) -> int:
    """Where the blank line that ends ``head`` ends (``-1``: not come yet), searched from
    ``start`` (lines end in CRLF, or in a bare LF as the parser allows)."""
    ends = [
        at + len(mark)
        for mark in (b"\r\n\r\n", b"\n\n", b"\n\r\n")
        if (at := head.find(mark, start)) >= 0
    ]
    return min(ends, default=-1)


class _HeadTooLargeError(Exception):
    """Raised in the parser's URL or header callback: the parser stops at once."""


class _TooManyPipelinedError(Exception):
    """Raised in the parser's headers-complete callback: the parser stops at once."""


class _AnswerTransport(asyncio.Transport):
    """The connection's transport as one request's answer (uvicorn's cycle) uses it: its
    close is `BoundedProtocol._close_answered`. The cycle writes, closes and asks whether
    it closes, nothing else."""

    def __init__(self, protocol: BoundedProtocol, cycle: Any) -> None:
        super().__init__()
        self._protocol = protocol
        self._cycle = cycle

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._protocol.transport.write(data)

    def is_closing(self) -> bool:
        return self._protocol.transport.is_closing()

    def close(self) -> None:
        self._protocol._close_answered(self._cycle)


class BoundedProtocol(HttpToolsProtocol):
    """One HTTP/1.1 connection, bounded (see the module).

    Args:
        config: uvicorn's configuration (its ``timeout_keep_alive`` is the idle timeout).
        server_state: uvicorn's shared state (the connections, the request tasks).
        limits: The bounds.
        draining: Whether the server drains (read when a request's headers complete).
        closed: Called once when the connection is gone.
        invalid_requests: Where a request the parser cannot read is logged: one throttle
            for every connection of the worker.
    """

    def __init__(
        self,
        config: Any,
        server_state: Any,
        *,
        limits: ServeConfig,
        draining: Callable[[], bool],
        closed: Callable[[], None],
        invalid_requests: Throttle,
    ) -> None:
        super().__init__(config=config, server_state=server_state, app_state={})
        self._max_head = limits.max_header_bytes
        self._max_headers = limits.max_headers
        self._header_timeout = limits.header_timeout
        self._body_timeout = limits.body_timeout
        self._send_timeout = limits.send_timeout
        self._max_request_id = limits.max_request_id_length
        self._draining = draining
        self._closed = closed
        self._invalid_requests = invalid_requests
        #: The head being read, until its blank line has come.
        self._head = bytearray()
        self._in_head = True
        self._headers = 0
        #: Bytes of the request line's target and header fields the parser has given.
        self._head_bytes = 0
        #: Why the head being parsed is refused 431 (``None``: it is not).
        self._too_large: str | None = None
        #: The parser has begun a head and not ended it.
        self._in_parsed_head = False
        #: The last bytes fed, when the parser stopped inside a head (else none).
        self._carry = b""
        #: The parser stopped at a request past MAX_PIPELINED waiting ones.
        self._pipeline_full = False
        self._refused = False
        #: A refusal of a pipelined request, written once the answers ahead of it are
        #: complete: its status, message, code and request id.
        self._deferred: tuple[int, str, str, bytes | None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        #: What the timer watches: `_HEAD`, `_BODY` or nothing.
        self._watching = 0
        #: When the head being read began (``None``: none is).
        self._head_since: float | None = None
        #: When the body being waited for last brought a byte (``None``: none waited for).
        self._body_seen: float | None = None
        #: Watches the answer's bytes waiting for the client (``None``: none wait).
        self._send_timer: asyncio.TimerHandle | None = None
        #: How many waited when it was armed.
        self._send_left = 0
        #: Every request whose answer is not complete, oldest (the one being answered)
        #: first: uvicorn's ``self.cycle`` is the newest, a pipelined one included.
        self._open: list[Any] = []
        #: Bytes of the open request fed to the parser since its body last moved (a chunk
        #: extension or a trailer field the parser gathers): bounded as a head is.
        self._stalled_bytes = 0
        self._body_moved = False
        #: The parser's callbacks are not heard: it is fed a head of its own making.
        self._muted = False

    # -- the connection -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Before its first request, a connection is idle as between two requests.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._stop_watching_sends()
        # uvicorn tells only its newest cycle: the one being answered, when a request is
        # pipelined behind it, would never hear the disconnect (its generation running on
        # for nobody, each write logged).
        self._disconnect_all()
        super().connection_lost(exc)
        self._closed()

    def _disconnect_all(self) -> None:
        for cycle in self._open:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self._open.clear()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped until the client closes, or LINGER passes
        self._unset_keepalive_if_required()
        if self._in_head:
            if self._head_since is None:
                # From its first byte (a blank line before a request included), a head has
                # header_timeout to end.
                self._head_since = self.loop.time()
            # A head is gathered here until its blank line, then parsed in one go: fed to
            # the parser piece by piece, a long header value would be copied anew for each
            # piece (the cost of a head quadratic in its size).
            head = self._head
            # A head the parser began in an earlier feed (pipelined in the read of the
            # request before it) may end in a blank line that begins in what it was fed.
            carry = self._carry
            scan = max(len(carry) + len(head) - 3, 0)
            head += data
            end = _end_of_head(carry + head if carry else head, scan) - len(carry)
            if end < 0 or end > self._max_head:
                if end > self._max_head or len(head) > self._max_head:
                    self._refuse(
                        431,
                        f"the request's head is longer than {self._max_head} bytes",
                        "request_header_fields_too_large",
                    )
                else:
                    self._watch()
                return
            data = bytes(head)
            head.clear()
        elif self._body_seen is not None:
            self._body_seen = self.loop.time()
        in_body = not self._in_head
        self._body_moved = False
        if not self._feed(data):
            return
        if in_body and not self._body_moved:
            # Bytes that brought no body: a chunk's extension, or the trailer fields after
            # the last chunk, which the parser gathers (a value by copying, as in a head)
            # and which neither max_body_bytes nor max_header_bytes counted.
            self._stalled_bytes += len(data)
            if self._stalled_bytes > self._max_head:
                self._refuse(
                    431,
                    f"the request's chunk extensions or trailer fields are longer than "
                    f"{self._max_head} bytes",
                    "request_header_fields_too_large",
                )
                return
        else:
            self._stalled_bytes = 0
        self._watch()

    def _feed(self, data: bytes) -> bool:
        """Parse ``data``; ``False`` when the connection was refused for it."""
        try:
            self.parser.feed_data(data)
            # Its last bytes, when the parser stopped inside a head: the start of its end.
            self._carry = data[-3:] if self._in_parsed_head else b""
        except httptools.HttpParserUpgrade as upgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
                return self._feed_past_upgrade(data[upgrade.args[0] :])
        except httptools.HttpParserError as err:
            if self._too_large is not None:
                self._refuse(431, self._too_large, "request_header_fields_too_large")
            elif self._pipeline_full:
                # The requests parsed are answered, the last one closing the connection;
                # the parser has stopped, so what comes is read and dropped.
                self._refused = True
                self.cycle.keep_alive = False
            else:
                self._invalid_requests.warning("Invalid HTTP request received.")
                # The parser's reason is one of its own fixed phrases, never the client's
                # bytes ("Invalid HTTP version", "Duplicate Content-Length"); a callback's
                # failure is uvicorn's refusal of a request line (a CONNECT target, a path
                # that is not ASCII), which the phrase does not say.
                why = (
                    "its method or target cannot be served"
                    if isinstance(err, httptools.HttpParserCallbackError)
                    else str(err)
                )
                self._refuse(
                    400, f"the request is not valid HTTP/1.1: {why}", "invalid_http_request"
                )
            return False
        return True

    def _feed_past_upgrade(self, rest: bytes) -> bool:
        """Go on parsing a request whose upgrade is not acted on as the plain request it
        also is: its body, then the requests after it.

        The parser skipped its body (httptools tells llhttp to, for any request offering an
        upgrade) and stopped after its head, for good. A new parser is given a head of the
        request's framing alone, unheard (`_muted`), and then what came after the head:
        before, the app got an empty body, and the connection's later requests were never
        answered.
        """
        framing = b"".join(
            b"%s: %s\r\n" % (name, value)
            for name, value in self.headers
            if name in (b"content-length", b"transfer-encoding")
        )
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3, as uvicorn allows
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self._muted = True
        try:
            self.parser.feed_data(b"POST / HTTP/1.1\r\n%s\r\n" % framing)
        finally:
            self._muted = False
        self._carry = b""
        return self._feed(rest) if rest else True

    def _unsupported_upgrade_warning(self) -> None:
        # Answered as the plain request it also is; two warnings a request were a client's
        # way to flood the log.
        self.logger.debug("an Upgrade header was not acted on")

    def shutdown(self) -> None:
        """Close now if idle between two requests; else close after the answer to the one
        open, or to the first one on a connection that has brought none yet."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        elif self.cycle is not None and self._head_since is None:  # no head begun either
            self._close()
        # A head being read, or none yet: its request's answer closes the connection
        # (`_draining`).

    # -- parser callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._muted:
            return
        super().on_message_begin()
        self._headers = 0
        self._head_bytes = 0
        self._in_parsed_head = True

    def on_url(self, url: bytes) -> None:
        if self._muted:
            return
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._muted:
            return
        self._headers += 1
        if self._headers > self._max_headers:
            self._too_large = f"the request has more than {self._max_headers} header fields"
            raise _HeadTooLargeError
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        """Count bytes of the head being parsed: a head pipelined in the same read as the
        request before it reaches the parser without being gathered (and measured)."""
        self._head_bytes += size
        if self._head_bytes > self._max_head:
            self._too_large = f"the request's head is longer than {self._max_head} bytes"
            raise _HeadTooLargeError

    def on_headers_complete(self) -> None:
        if self._muted:
            return
        if len(self.pipeline) >= MAX_PIPELINED:
            self._pipeline_full = True
            raise _TooManyPipelinedError
        self._in_head = False
        self._in_parsed_head = False
        self._head_since = None
        super().on_headers_complete()
        if self.cycle is not None:
            self._open.append(self.cycle)
            self.cycle.transport = _AnswerTransport(self, self.cycle)
        if self._draining() and self.cycle is not None:
            self.cycle.keep_alive = False
        self._body_seen = self.loop.time()

    def on_body(self, body: bytes) -> None:
        self._body_moved = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade() and not self._should_upgrade():
            return  # its body, skipped, is still to come (`_feed_past_upgrade`)
        self._body_moved = True
        self._stalled_bytes = 0
        self._in_head = True
        self._body_seen = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        unread = any(c.more_body for c in self._open if c.response_complete)
        self._open = [c for c in self._open if not c.response_complete]
        super().on_response_complete()
        if self.transport.is_closing():  # closed after its answer: that may wait
            self._watch_sends()
        elif unread and not self._refused:
            # Answered while its body still comes (a route that takes none, GET /health
            # with a Content-Length): uvicorn would drop that body as it came, for as long
            # as it came, a worker parsing a client's endless body at 50-150 MB/s here.
            self._linger()
        elif self._deferred is not None and not self._open:
            # The answers ahead of a refused request are complete: its refusal is next.
            self._unset_keepalive_if_required()
            self._write_refusal(*self._deferred)

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing() and not self._refused:  # lingering: LINGER closes
            self._close()

    # -- answers the client does not read -------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_sends()

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self.transport.is_closing():
            self._stop_watching_sends()  # taken: the writer may write again

    def _close(self) -> None:
        """Close once what waits is sent, or once the client has taken none of it for
        send_timeout."""
        self.transport.close()
        self._watch_sends()

    def _watch_sends(self) -> None:
        if self._send_timer is None and (left := self.transport.get_write_buffer_size()):
            self._send_left = left
            self._send_timer = self.loop.call_later(self._send_timeout, self._sends_due)

    def _stop_watching_sends(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _sends_due(self) -> None:
        self._send_timer = None
        left = self.transport.get_write_buffer_size()
        if left and left >= self._send_left:
            self.logger.info(
                "closing a connection whose client took no byte of its answer for %g s "
                "(ServeConfig.send_timeout)",
                self._send_timeout,
            )
            self.transport.abort()
        elif left:
            self._watch_sends()  # it took some: it reads, slowly

    # -- timeouts -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Arm the timer for what is awaited now, after a feed (most requests arrive whole
        in one: they never arm one)."""
        if self._head_since is not None:
            if self._watching != _HEAD:
                delay = self._head_since + self._header_timeout - self.loop.time()
                self._arm(_HEAD, delay, self._head_expired)
        elif self._body_seen is not None:
            if self._watching != _BODY:
                self._arm(_BODY, self._body_timeout, self._body_expired)
        elif self._timer is not None:
            self._cancel_timer()

    def _arm(self, what: int, delay: float, then: Callable[[], None]) -> None:
        self._cancel_timer()
        self._watching = what
        self._timer = self.loop.call_later(delay, then)

    def _cancel_timer(self) -> None:
        self._watching = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_expired(self) -> None:
        self._timer, self._watching = None, 0
        if any(not c.response_complete for c in self._open):
            # A request pipelined behind one still being answered: the client may well
            # wait for that answer before it sends the rest; its head is timed from then.
            self._head_since = self.loop.time()
            self._arm(_HEAD, self._header_timeout, self._head_expired)
            return
        self._refuse(
            408,
            f"the request's headers did not arrive within {self._header_timeout:g} s",
            "request_timeout",
        )

    def _body_expired(self) -> None:
        self._timer, self._watching = None, 0
        seen = self._body_seen
        if seen is None:
            return
        now = self.loop.time()
        if self.flow.read_paused:
            # The application has not read what came: the client is not the one waiting.
            self._body_seen = seen = now
        if now - seen < self._body_timeout:
            self._arm(_BODY, self._body_timeout - (now - seen), self._body_expired)
            return
        self._refuse(
            408,
            f"the request body stopped arriving: no byte for {self._body_timeout:g} s",
            "request_timeout",
        )

    # -- refusing -------------------------------------------------------------------------

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` (an OpenAI error: ``message``, ``code``) once the requests
        ahead of the refused one are answered, and close the connection; only close it
        when the refused request's own answer has begun."""
        self._cancel_timer()
        if self.transport.is_closing():
            return
        # The refused request: the one whose body is being read, else a head not parsed
        # yet (no cycle). Its answer carries its id, as the application's answers do; a
        # head not read gets a new one. uvicorn's ``self.cycle`` is the newest request.
        refused: Any = None if self._in_head else self.cycle
        rid = None if refused is None else request_id(refused.scope, self._max_request_id)
        if refused is not None and refused.response_started:
            # An answer has begun: the refusal cannot be written into its middle.
            self._disconnect_all()
            self.transport.close()
            return
        # What the client still sends is read and dropped: the parser cannot go on.
        self._refused = True
        if refused is not None:
            # Its application hears a disconnect, and what it might still send goes
            # nowhere; pipelined, it is never started.
            refused.disconnected = True
            refused.message_event.set()
            self._open.remove(refused)
            for waiting in self.pipeline:
                if waiting[0] is refused:
                    self.pipeline.remove(waiting)
                    break
        if any(not c.response_complete for c in self._open):
            # Requests pipelined ahead of it are answered first, in order (an answer
            # ahead carries no refusal of another request's).
            self._deferred = (status, message, code, rid)
            return
        self._write_refusal(status, message, code, rid)

    def _write_refusal(self, status: int, message: str, code: str, rid: bytes | None) -> None:
        self._deferred = None
        self.transport.write(HTTPError(status, message, code=code).response(rid))
        self._linger()

    def _linger(self) -> None:
        """Close lingering: the answer, then our end shut; what the client still sends is
        read and dropped until it closes (or LINGER passes), so that unread bytes do not
        reset the connection before it has read the answer."""
        self._cancel_timer()
        self._refused = True
        self.transport.write_eof()
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER, self._close)

    def _close_answered(self, cycle: Any) -> None:
        """Close the connection after ``cycle``'s answer, which closes it: lingering when
        its request's body is still coming (a 413, or any error answered before the body
        was read). Closed at once, the bytes the client still sends would reset the
        connection, and a client that sends its whole body before reading (httpx, so the
        openai client) would see the reset, never the answer."""
        if cycle.more_body and not cycle.disconnected and not self.transport.is_closing():
            self._linger()
        else:
            self.transport.close()
