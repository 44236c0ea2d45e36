"""A lean HTTP load generator for OpenAI-compatible streaming endpoints:
``python -m actors load``.

What an operator measures a server with, the main job drives its load with, and the serve
and engines benchmarks compare front ends with (any OpenAI-compatible server: tokenyard's,
``vllm serve``, llama.cpp's). It needs nothing beyond msgspec and the standard library.

``C`` closed-loop clients, each on its own keep-alive connection, send streaming
``/v1/completions`` or ``/v1/chat/completions`` requests (``stream_options.include_usage``
on) for a fixed duration or a fixed number of requests. The client is a hand-written
HTTP/1.1 one over asyncio streams (chunked decoding, SSE parsing, msgspec decoding of each
chunk), chosen because it costs this process less CPU per request than the same loop on
aiohttp, so the generator stays out of the way of the server it measures on a small
machine. Measured on a 2-CPU machine against `actors.http.OpenAIApp` over a one-worker
pipeline, 8 clients, 32 tokens a request: 310-350 us of client CPU per request against
aiohttp's 480-570 when the server coalesced the tokens into a few chunks, 1.65-1.84 ms
against 2.13 ms at about 28 chunks a request (2 ms engine steps).

Per request it records the time to the first text (TTFT), the gaps between text chunks
(a chunk may carry several tokens when the server coalesces), the end-to-end latency, the
output tokens of the usage chunk, and how it failed if it did: ``refused`` (no connection),
``closed`` (the server closed or reset the connection mid-response), ``http_<status>``,
``stream_error`` (an error event), ``bad_event`` (an event that is not a completion chunk,
or one after ``[DONE]``), ``incomplete`` (the body ended without ``[DONE]``), ``timeout``
(the answer did not end within the request's timeout), ``bad_response`` (not HTTP/1.x, or
its framing broken), ``too_large`` (an event over ``MAX_EVENT``), ``too_long`` (far more
chunks of text than tokens asked for), with a line of what the server did. Whatever a
server sends, a client holds a bounded part of it and no request outlives its timeout;
a server's misbehaviour is a figure, never a traceback. A connection the server
closed is counted and replaced; a request that found its reused connection already closed,
before any byte of its answer, is sent again on a fresh one (the race every keep-alive
client has), so only real failures are failures.

Run ``python -m actors load --url http://127.0.0.1:8000 --concurrency 8
--duration 10`` (``--help`` for the rest); ``--json PATH`` writes every record; SIGINT or
SIGTERM ends a run early with the summary of what ended. Against a
server that asks for an API key, each request carries ``Authorization: Bearer KEY``: the
key of ``--api-key``, else of ``TOKENYARD_API_KEY``, the variable the server reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import resource
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import msgspec

from actors._stop_signals import watched as watched_signals

from ._auth import API_KEY_ENV, key_given, usable_key

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

__all__ = ("LoadResult", "LoadSpec", "RequestRecord", "main", "run_load", "summarize")

#: Seconds a client waits after a refused connection before it tries again, so that a
#: dead server is not hammered in a tight loop.
REFUSED_BACKOFF = 0.05
#: The longest event a stream may send, in bytes (an SSE event: its ``data:`` line up to
#: the blank line after it). A longer one fails its request as ``too_large`` and ends its
#: connection, so a server that never ends a line costs at most this much memory a client.
#: A completion chunk is a few hundred bytes; one with every token's logprobs a few KiB.
MAX_EVENT = 1 << 20
#: The most of an answer other than a stream (a 4xx or 5xx) read to report it, in bytes;
#: the connection of a longer one is closed.
MAX_ERROR_BODY = 1 << 16
#: A stream may carry at most this many chunks of text per token asked for (``max_tokens``),
#: plus ``_SPARE_CHUNKS``: each chunk carries at least a character of a token, so a stream
#: past that is one that does not end, and every chunk's gap is kept in its record.
CHUNKS_PER_TOKEN = 16
_SPARE_CHUNKS = 64
_DONE = b"[DONE]"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Descriptors the command holds besides its clients' connections (stdio, the event loop's,
#: the --json file).
_FDS_BESIDES = 16
#: The largest piece of a body read at once (a chunk a server says is larger is read in
#: pieces), and of a head, a chunk-size or a trailer line.
_PIECE = 65536
#: Characters of what a server sent shown in a failure's detail.
_SHOWN = 200
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([^\r\n]*))?\r\n")
#: An HTTP header name (RFC 9110's token).
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request's fate.

    Attributes:
        ok: It streamed to ``[DONE]``.
        error: How it failed (``None`` when ``ok``): ``refused``, ``closed``,
            ``http_<status>``, ``stream_error``, ``bad_event``, ``incomplete``, ``timeout``,
            ``bad_response``, ``too_large``, ``too_long``.
        start: When it was sent, in seconds since the load began.
        ttft: Seconds from sending to the first non-empty text.
        itl: Seconds between successive chunks carrying text.
        e2e: Seconds from sending to the end of the answer (or the failure).
        output_tokens: Completion tokens of the usage chunk (0 without one).
        worker: The worker that answered (its ``x-tokenyard-worker`` header), when known.
        local_port: The client's port of the connection it went on (0 before one).
        detail: What went wrong, in a line (``None`` when ``ok``): what the server
            answered or did, its own words quoted and cut short.
        index: Its number in the order the requests were sent, from 0.
    """

    ok: bool
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = msgspec.field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    worker: int | None = None
    local_port: int = 0
    detail: str | None = None
    index: int = 0


class LoadResult(msgspec.Struct, kw_only=True):
    """A whole load.

    Attributes:
        records: Every request, in the order they ended.
        elapsed: Seconds from the first request to the last answer.
        cpu_seconds: User plus system CPU time this process spent meanwhile.
        connects: Connections opened.
        server_closes: Connections the server closed (cleanly or not), each replaced.
        in_flight: Requests sent but left out of ``records``: in flight when the load
            was abandoned.
    """

    records: list[RequestRecord]
    elapsed: float
    cpu_seconds: float
    connects: int
    server_closes: int
    in_flight: int = 0


@dataclass(frozen=True)
class LoadSpec:
    """What to send.

    Attributes:
        url: The server, ``http://host:port``.
        api: ``"completions"`` or ``"chat"``.
        concurrency: Closed-loop clients, one connection each.
        duration: Seconds to keep sending (``None``: until ``requests`` are sent).
        requests: Requests to send in all (``None``: until ``duration`` is over).
        max_tokens: ``max_tokens`` of each request.
        prompts: Prompts (chat: the user message), used in turn.
        model: The ``model`` field (``None``: left out).
        ignore_eos: Ask for every ``max_tokens`` token (vLLM's and SGLang's extension).
        timeout: Seconds one request may take, from sending it to the end of its answer
            (then it fails as ``timeout``): a request in flight when ``duration`` is over
            ends within it.
        keepalive: Reuse each client's connection (``False``: a new connection for every
            request, ``Connection: close``).
        headers: More request headers, as (name, value) pairs (a ``traceparent``, say).
        api_key: Sent as ``Authorization: Bearer <key>`` with every request (``None``: no
            key). Not shown in the spec's repr.
    """

    url: str
    api: str = "completions"
    concurrency: int = 8
    duration: float | None = None
    requests: int | None = 100
    max_tokens: int = 32
    prompts: tuple[str, ...] = ("Tell me about the harbour of Yokohama.",)
    model: str | None = None
    ignore_eos: bool = True
    timeout: float = 60.0
    keepalive: bool = True
    headers: tuple[tuple[str, str], ...] = ()
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api not in ("completions", "chat"):
            raise ValueError(f"api={self.api!r}: choose 'completions' or 'chat'")
        if self.duration is None and self.requests is None:
            raise ValueError("give a duration, a request count, or both")
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency}: it must be at least 1")
        if not self.prompts:
            raise ValueError("give at least one prompt")
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"timeout={self.timeout}: it must be a finite number above 0")
        for name, value in self.headers:
            if not _TOKEN.fullmatch(name) or any(c in value for c in "\r\n\0"):
                raise ValueError(
                    f"header {name!r}: {value!r}: a name is an HTTP token and a value "
                    "has no line break"
                )
        if self.api_key is not None and not usable_key(self.api_key):
            # The message does not show the key.
            raise ValueError(
                "the API key is empty or has a character other than visible ASCII: a "
                "server could not match it"
            )


# -- the wire -------------------------------------------------------------------------------


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Usage(msgspec.Struct):
    completion_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class _Event(msgspec.Struct):
    """What the generator reads of a chunk (msgspec skips every other field)."""

    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


_EVENT = msgspec.json.Decoder(_Event)


class _ClosedError(Exception):
    """The server closed the connection; ``answered`` says whether any byte came back."""

    def __init__(self, answered: bool) -> None:
        super().__init__("the server closed the connection")
        self.answered = answered


class _BadAnswerError(ValueError):
    """The server's answer broke HTTP, or a bound of this client: ``kind`` is the failure
    its request is counted as, ``detail`` what the server did."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def _shown(data: bytes | str) -> str:
    """What a server sent, for a line of text: at most ``_SHOWN`` characters, every
    control character escaped (a hostile answer cannot drive the terminal)."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    cut = text[:_SHOWN]
    return repr(cut) + ("..." if len(text) > _SHOWN else "")


def _server_address(url: str) -> tuple[str, int]:
    """The host and port of ``url``, ``http://host:port`` (a path after it is ignored).

    Raises:
        ValueError: ``url`` is not of that form (another scheme, no host, no port or one
            that is not a port number).
    """
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ValueError(
            f"url {url!r}: give the server as http://host:port (plain HTTP; a path after "
            "it is ignored)"
        )
    return parts.hostname, port


def _host_header(host: str, port: int) -> str:
    """The ``host`` header of the server at ``host`` and ``port`` (an IPv6 address in
    brackets, as in a URL)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _requests(spec: LoadSpec, host: str) -> list[bytes]:
    """Each prompt's whole request, head and body, encoded once."""
    path = b"/v1/chat/completions" if spec.api == "chat" else b"/v1/completions"
    out: list[bytes] = []
    for prompt in spec.prompts:
        body: dict[str, Any] = {
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if spec.model is not None:
            body["model"] = spec.model
        if spec.ignore_eos:
            body["ignore_eos"] = True
        data = msgspec.json.encode(body)
        head = (
            b"POST " + path + b" HTTP/1.1\r\nhost: " + host.encode() + b"\r\n"
            b"content-type: application/json\r\naccept: text/event-stream\r\n"
            + (b"" if spec.keepalive else b"connection: close\r\n")
            + b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in spec.headers)
            + (
                b""
                if spec.api_key is None
                else f"authorization: Bearer {spec.api_key}\r\n".encode()
            )
            + b"content-length: "
            + str(len(data)).encode()
            + b"\r\n\r\n"
        )
        out.append(head + data)
    return out


class _Head:
    """What the client needs of an answer's head.

    Raises:
        _BadAnswerError: The head is not HTTP/1.x, or its framing headers are malformed.
    """

    def __init__(self, head: bytes) -> None:
        match = _STATUS_LINE.match(head)
        if match is None:
            raise _BadAnswerError("bad_response", f"an answer that is not HTTP/1.x: {_shown(head)}")
        self.status = int(match[2])
        self.reason = (match[3] or b"").decode("latin-1")
        fields: dict[bytes, bytes] = {}
        for line in head[match.end() :].split(b"\r\n"):
            if not line:
                continue
            name, colon, value = line.partition(b":")
            if not colon:
                raise _BadAnswerError("bad_response", f"a header line without ':': {_shown(line)}")
            fields[name.strip().lower()] = value.strip()
        codings = fields.get(b"transfer-encoding", b"").lower()
        self.chunked = codings.rsplit(b",", 1)[-1].strip() == b"chunked"
        self.length: int | None = None
        if not self.chunked and b"content-length" in fields:
            length = fields[b"content-length"]
            if not length.isdigit():
                raise _BadAnswerError("bad_response", f"a content-length of {_shown(length)}")
            self.length = int(length)
        if self.status < 200 or self.status in (204, 304):
            # No body, whatever the head says (RFC 9112, 6.3): read to the connection's
            # end, a kept-alive one would hold its request until the timeout.
            self.chunked, self.length = False, 0
        connection = fields.get(b"connection", b"").lower()
        # HTTP/1.0 keeps a connection only when it says so.
        self.close = b"close" in connection or (
            match[1] == b"0" and b"keep-alive" not in connection
        )
        worker = fields.get(b"x-tokenyard-worker", b"")
        self.worker = int(worker) if worker.isdigit() and len(worker) < 10 else None
        self.location = fields.get(b"location")


class _Body:
    """An answer's body, read in pieces of at most ``_PIECE`` bytes whatever its framing
    (chunked, a content-length, or to the connection's end), so no chunk size or length a
    server announces makes this process hold more.

    Raises (from ``read``):
        asyncio.IncompleteReadError: The connection ended inside the body.
        _BadAnswerError: A chunk's framing is malformed.
    """

    def __init__(self, reader: asyncio.StreamReader, head: _Head) -> None:
        self.reader = reader
        self.chunked = head.chunked
        # Chunked: what is left of the current chunk (-1 before the first); otherwise what
        # is left of the body (None: until the connection ends).
        self.left: int | None = -1 if head.chunked else head.length
        self.ended = False
        #: Bytes of the body read so far.
        self.received = 0

    async def read(self) -> bytes:
        """The next piece of the body; ``b""`` at its end."""
        left = self.left
        if self.chunked and left is not None and left <= 0 and not self.ended:
            # The next chunk (the path of every piece of a stream: kept to one coroutine).
            reader = self.reader
            if left == 0 and await reader.readexactly(2) != b"\r\n":
                raise _BadAnswerError("bad_response", "a chunk longer than its size said")
            try:
                line = await reader.readuntil(b"\r\n")
                # int() takes the spaces and the line end around the size.
                left = int(line.split(b";", 1)[0], 16)
            except asyncio.LimitOverrunError as err:
                raise _BadAnswerError(
                    "bad_response", f"a chunk-size line longer than {_PIECE} bytes"
                ) from err
            except ValueError:
                left = -1
            if left < 0:
                raise _BadAnswerError(
                    "bad_response", f"a chunk size that is not a number: {_shown(line)}"
                )
            self.received += len(line)
            if left == 0:
                while await self._line() != b"\r\n":  # trailers
                    pass
            elif left <= _PIECE:
                # A chunk of ordinary size, in one read with its line end.
                data = await reader.readexactly(left + 2)
                if data[-2:] != b"\r\n":
                    raise _BadAnswerError("bad_response", "a chunk longer than its size said")
                self.left = -1
                self.received += left + 2
                return data[:-2]
        if self.ended:
            return b""
        if left is None:
            data = await self.reader.read(_PIECE)
            self.ended = not data
            self.received += len(data)
            return data
        if left == 0:
            self.ended = True
            return b""
        data = await self.reader.read(min(left, _PIECE))
        if not data:
            raise asyncio.IncompleteReadError(b"", left)
        self.left = left - len(data)
        self.received += len(data)
        return data

    async def _line(self) -> bytes:
        try:
            line = await self.reader.readuntil(b"\r\n")
        except asyncio.LimitOverrunError as err:
            raise _BadAnswerError(
                "bad_response", f"a trailer line longer than {_PIECE} bytes"
            ) from err
        self.received += len(line)
        return line


class _Client:
    """One closed-loop client and its connection."""

    def __init__(self, host: str, port: int, result: _Tally) -> None:
        self.host = host
        self.port = port
        self.tally = result
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.local_port = 0
        #: The body being read (what a timeout says came of it).
        self.body: _Body | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.local_port = self.writer.get_extra_info("sockname")[1]
        self.tally.connects += 1

    async def drop(self) -> None:
        writer, self.reader, self.writer = self.writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def send(self, request: bytes, t0: float, record: RequestRecord, max_text: int) -> None:
        """Send one request and read its stream into ``record``; reconnect as needed."""
        for attempt in range(2):
            self.body = None
            fresh = self.writer is None
            if fresh:
                try:
                    await self.connect()
                except OSError as err:
                    record.error = "refused"
                    record.detail = f"no connection to {self.host}:{self.port}: {err}"
                    await asyncio.sleep(REFUSED_BACKOFF)
                    return
            record.local_port = self.local_port
            try:
                await self._exchange(request, t0, record, max_text)
                return
            except _ClosedError as err:
                self.tally.server_closes += 1
                await self.drop()
                if err.answered or fresh or attempt:
                    record.error = "closed"
                    received = 0 if self.body is None else self.body.received
                    record.detail = (
                        f"the server closed the connection {received} bytes into the body "
                        "of its answer"
                        if err.answered
                        else "the server closed the connection before answering"
                    )
                    return
                # The reused connection was closed before it answered: send again.
            except _BadAnswerError as err:
                # Whatever follows on this connection cannot be trusted to frame an answer.
                record.error, record.detail = err.kind, err.detail
                await self.drop()
                return

    def stalled(self, timeout: float) -> str:
        """What a request that timed out had received."""
        if self.body is None:
            return f"no answer within --timeout {timeout:g} s"
        return (
            f"the answer did not end within --timeout {timeout:g} s "
            f"({self.body.received} bytes of its body came)"
        )

    async def _exchange(
        self, request: bytes, t0: float, record: RequestRecord, max_text: int
    ) -> None:
        reader, writer = self.reader, self.writer
        assert reader is not None
        assert writer is not None
        try:
            writer.write(request)
            await writer.drain()
            head = _Head(await reader.readuntil(b"\r\n\r\n"))
            # An interim answer (100 Continue) comes before the real one.
            while 100 <= head.status < 200:
                head = _Head(await reader.readuntil(b"\r\n\r\n"))
        except asyncio.IncompleteReadError as err:
            if err.partial and not err.partial.startswith(b"HTTP/"):
                raise _BadAnswerError(
                    "bad_response", f"an answer that is not HTTP/1.x: {_shown(err.partial)}"
                ) from err
            raise _ClosedError(answered=bool(err.partial)) from err
        except asyncio.LimitOverrunError as err:
            raise _BadAnswerError(
                "bad_response", f"an answer whose head is longer than {_PIECE} bytes"
            ) from err
        except ConnectionError as err:
            raise _ClosedError(answered=False) from err
        record.worker = head.worker
        self.body = body = _Body(reader, head)
        try:
            if head.status != 200:
                record.error = f"http_{head.status}"
                record.detail = await self._refusal(body, head, record)
            else:
                await _stream(body, t0, record, max_text)
        except (asyncio.IncompleteReadError, ConnectionError) as err:
            raise _ClosedError(answered=True) from err
        # A body without a length or chunks ends with the connection.
        closed = head.close or (body.ended and not head.chunked and head.length is None)
        self.tally.server_closes += closed
        if closed or not body.ended:
            await self.drop()

    async def _refusal(self, body: _Body, head: _Head, record: RequestRecord) -> str:
        """Read an answer that is not a stream, up to ``MAX_ERROR_BODY`` bytes (the rest is
        left with its connection), and say what it was."""
        kept = bytearray()
        while len(kept) <= MAX_ERROR_BODY and (data := await body.read()):
            kept += data
        said = f"the server answered {head.status} {head.reason}".rstrip()
        message = _error_message(bytes(kept[:MAX_ERROR_BODY]))
        if message:
            said += f": {_shown(message)}"
        if head.location is not None:
            said += f" (location: {_shown(head.location)})"
        return said


def _error_message(body: bytes) -> str:
    """The message of an error answer's body: OpenAI's ``error.message``, FastAPI's
    ``detail``, or the body itself."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace").strip()
    if isinstance(decoded, dict):
        error = decoded.get("error", decoded)
        if isinstance(error, dict):
            error = error.get("message", error.get("detail", error))
        return error if isinstance(error, str) else msgspec.json.encode(error).decode()
    return body.decode("utf-8", "replace").strip()


def _too_large(event: bytearray) -> _BadAnswerError:
    return _BadAnswerError(
        "too_large",
        f"an event longer than {MAX_EVENT} bytes (MAX_EVENT), which began "
        f"{_shown(bytes(event[:_SHOWN]))}",
    )


def _event_data(event: bytes) -> bytes | None:
    """The data of a server-sent event, its lines ended with LF: the values of its
    ``data`` fields joined by LF (``None``: it has none, a comment or an ``id`` alone)."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # what OpenAI-compatible servers send: one field, one line
    values = []
    for line in event.split(b"\n"):
        name, _, value = line.partition(b":")
        if name == b"data":  # "data:" with or without its one space, or "data" alone
            values.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(values) if values else None


async def _stream(body: _Body, t0: float, record: RequestRecord, max_text: int) -> None:
    """Read a stream of events into ``record``, to the body's end.

    Raises:
        _BadAnswerError: An event longer than ``MAX_EVENT`` bytes, or more chunks of text
            than ``max_text``.
    """
    # An event not ended by the pieces read so far (most pieces hold whole events).
    pending = bytearray()
    last: float | None = None
    done = False
    texts = 0
    # The last piece ended with a CR: a LF first in the next ends the same line.
    cr = False

    def failed(kind: str, detail: str) -> None:
        if record.error is None:
            record.error, record.detail = kind, detail

    while data := await body.read():
        if cr and data.startswith(b"\n"):
            data = data[1:]
        cr = False
        if b"\r" in data:
            # Lines may end with CRLF or CR too (sse-starlette writes CRLF): LF from here.
            cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if pending:
            # Search only what came since the last search (a trickled event is not
            # searched again and again from its start).
            searched = len(pending) - 1
            pending += data
            if pending.find(b"\n\n", searched) < 0:
                if len(pending) > MAX_EVENT:
                    raise _too_large(pending)
                continue
            data = bytes(pending)
            pending.clear()
        start = 0
        while (end := data.find(b"\n\n", start)) >= 0:
            payload = _event_data(data[start:end])
            start = end + 2
            if payload is None:
                continue
            if done:
                failed("bad_event", f"an event after [DONE]: {_shown(payload)}")
                continue
            if payload == _DONE:
                done = True
                continue
            try:
                chunk = _EVENT.decode(payload)
            except msgspec.DecodeError as err:
                failed(
                    "bad_event",
                    f"an event that is not a completion chunk ({err}): {_shown(payload)}",
                )
                continue
            if chunk.error is not None:
                message = str(chunk.error.get("message", chunk.error))
                failed("stream_error", f"an error event: {_shown(message)}")
            if chunk.usage is not None:
                record.output_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text = choice.text if choice.delta is None else choice.delta.content
                if text:
                    texts += 1
                    if texts > max_text:
                        raise _BadAnswerError(
                            "too_long",
                            f"more than {max_text} chunks of text for max_tokens "
                            f"{(max_text - _SPARE_CHUNKS) // CHUNKS_PER_TOKEN}",
                        )
                    now = time.perf_counter()
                    if last is None:
                        record.ttft = now - t0
                    else:
                        record.itl.append(now - last)
                    last = now
        if start < len(data):
            pending += memoryview(data)[start:]
            if len(pending) > MAX_EVENT:
                raise _too_large(pending)
    if record.error is None:
        if done:
            record.ok = True
        else:
            record.error = "incomplete"
            record.detail = f"the stream ended without [DONE], {body.received} bytes into it"


@dataclass
class _Tally:
    records: list[RequestRecord] = field(default_factory=list)
    connects: int = 0
    server_closes: int = 0
    sent: int = 0


def _clients(spec: LoadSpec) -> int:
    """The clients a load runs: one beyond the requests to send would send none."""
    return spec.concurrency if spec.requests is None else min(spec.concurrency, spec.requests)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_load(
    spec: LoadSpec,
    stop: asyncio.Event | None = None,
    on_record: Callable[[RequestRecord], object] | None = None,
    *,
    abandon: asyncio.Event | None = None,
) -> LoadResult:
    """Run the load described by ``spec`` and return every request's record.

    Args:
        spec: What to send, for how long.
        stop: Ends the load early once set (each client finishes its request first).
        on_record: Called with each request's record as it ends (a progress bar).
        abandon: Ends the load at once once set: the requests in flight are cancelled
            and left out of the records (a Ctrl-C).

    Raises:
        ValueError: ``spec.url`` is not ``http://host:port``.
    """
    host, port = _server_address(spec.url)
    requests = _requests(spec, _host_header(host, port))
    tally = _Tally()
    t0 = time.perf_counter()
    deadline = math.inf if spec.duration is None else t0 + spec.duration
    budget = math.inf if spec.requests is None else spec.requests

    max_text = CHUNKS_PER_TOKEN * spec.max_tokens + _SPARE_CHUNKS

    async def client() -> None:
        c = _Client(host, port, tally)
        try:
            while (
                tally.sent < budget
                and time.perf_counter() < deadline
                and not (stop is not None and stop.is_set())
            ):
                request = requests[tally.sent % len(requests)]
                start = time.perf_counter()
                record = RequestRecord(ok=False, start=start - t0, index=tally.sent)
                tally.sent += 1
                try:
                    async with asyncio.timeout(spec.timeout):
                        await c.send(request, start, record, max_text)
                except TimeoutError:
                    record.error = "timeout"
                    record.detail = c.stalled(spec.timeout)
                    await c.drop()
                record.e2e = time.perf_counter() - start
                tally.records.append(record)
                if on_record is not None:
                    on_record(record)
        finally:
            await c.drop()

    async def clients() -> None:
        async with asyncio.TaskGroup() as tg:
            # A client beyond the requests to send would send none.
            for _ in range(_clients(spec)):
                tg.create_task(client())

    cpu0 = _cpu_seconds()
    if abandon is None:
        await clients()
    else:
        running = asyncio.ensure_future(clients())
        abandoned = asyncio.ensure_future(abandon.wait())
        try:
            await asyncio.wait((running, abandoned), return_when=asyncio.FIRST_COMPLETED)
        finally:
            abandoned.cancel()
            running.cancel()
            # Each client closes its connection as it is cancelled.
            await asyncio.wait((running,))
        if not running.cancelled():
            running.result()
    return LoadResult(
        records=tally.records,
        elapsed=time.perf_counter() - t0,
        cpu_seconds=_cpu_seconds() - cpu0,
        connects=tally.connects,
        server_closes=tally.server_closes,
        in_flight=tally.sent - len(tally.records),
    )


async def stream_chat(url: str, prompt: str, max_tokens: int) -> AsyncIterator[str]:
    """Stream one chat completion of ``prompt`` from the server at ``url``: each chunk's
    text as it arrives, on a connection of its own (closed at the end).

    Raises:
        OSError: The server could not be reached, or closed the connection.
        ValueError: It answered with an error (the text of its error object), or ``url``
            is not ``http://host:port``.
    """
    host, port = _server_address(url)
    spec = LoadSpec(url=url, api="chat", max_tokens=max_tokens, prompts=(prompt,), ignore_eos=False)
    (request,) = _requests(spec, _host_header(host, port))
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        head = _Head(await reader.readuntil(b"\r\n\r\n"))
        if head.status != 200:
            raise ValueError(f"the server answered {head.status}")
        body = _Body(reader, head)
        buffer = b""
        while data := await body.read():
            buffer += data
            if len(buffer) > MAX_EVENT and b"\n\n" not in buffer:
                raise ValueError(f"the server sent an event longer than {MAX_EVENT} bytes")
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:end], buffer[end + 2 :]
                if not event.startswith(b"data: ") or event[6:] == _DONE:
                    continue
                chunk = _EVENT.decode(event[6:])
                if chunk.error is not None:
                    raise ValueError(str(chunk.error.get("message", chunk.error)))
                for choice in chunk.choices:
                    if choice.delta is not None and choice.delta.content:
                        yield choice.delta.content
    except asyncio.IncompleteReadError as err:
        raise ConnectionResetError("the server closed the connection mid-stream") from err
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# -- reporting ------------------------------------------------------------------------------


def _quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(result: LoadResult) -> dict[str, Any]:
    """Throughput, latency percentiles (ms), failures by kind and CPU per request."""
    records = result.records
    ok = [r for r in records if r.ok]
    summary: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
        "connects": result.connects,
        "server_closes": result.server_closes,
        "elapsed_s": result.elapsed,
        "requests_per_s": len(ok) / result.elapsed if result.elapsed else math.nan,
        "output_tokens_per_s": (
            sum(r.output_tokens for r in ok) / result.elapsed if result.elapsed else math.nan
        ),
        "client_cpu_us_per_request": (
            result.cpu_seconds / len(records) * 1e6 if records else math.nan
        ),
    }
    series = {
        "ttft_ms": [r.ttft * 1e3 for r in ok if r.ttft is not None],
        "itl_ms": [gap * 1e3 for r in ok for gap in r.itl],
        "e2e_ms": [r.e2e * 1e3 for r in ok],
    }
    for name, values in series.items():
        summary[name] = {f"p{int(q * 100)}": _quantile(values, q) for q in (0.5, 0.9, 0.99)}
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: run a load and print its summary as JSON.

    Each kind of failure is one line on stderr after the summary: how many, and what the
    server did to the first. SIGINT or SIGTERM ends the run at once (a second acts as
    Python's): the requests in flight are left out, the summary of those that ended is
    printed and ``--json`` written.

    Returns:
        0 when every request streamed to its end; 1 when some failed, or when the summary
        could not be printed (stdout closed) or the ``--json`` file failed to be written
        (after the summary is printed); 2 for an argument refused before the load runs (a
        ``--json`` file that cannot be written is one); 128 + the signal's number after
        SIGINT or SIGTERM. A refusal or a failed write is one line on stderr.
    """
    parser = argparse.ArgumentParser(
        prog="python -m actors load",
        description="A streaming load against an OpenAI-compatible server; prints what it "
        "measured as JSON.",
    )
    parser.add_argument(
        "--url", required=True, help="http://host:port of the server (a path or query is ignored)"
    )
    parser.add_argument(
        "--api", choices=("completions", "chat"), default="completions", help="(%(default)s)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, help="closed-loop clients (%(default)s)"
    )
    parser.add_argument(
        "--duration", type=float, help="seconds to run, however many requests that is"
    )
    parser.add_argument(
        "--requests", type=int, help="requests to send (default 100 when --duration is not given)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="max_tokens of each request (%(default)s)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=LoadSpec.timeout,
        metavar="S",
        help="seconds a request may take, from sending it to the end of its answer, before "
        "it fails as a timeout (%(default)g); the requests in flight when --duration is over "
        "end within it",
    )
    parser.add_argument("--model")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write every record here, after the summary (checked before the load runs)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="send `Authorization: Bearer KEY` with every request (default: "
        f"${API_KEY_ENV}, which the server reads too, else no key); prefer the variable, "
        "which `ps` does not show",
    )
    args = parser.parse_args(argv)
    try:
        spec = _spec(args)
        _check_descriptors(spec)
        if args.json:
            _check_writable(args.json)
    except ValueError as err:
        sys.stderr.write(f"{parser.prog}: {err}\n")
        return 2
    result, signum = asyncio.run(_until_signalled(spec))
    status = 0 if result.records and all(r.ok for r in result.records) else 1
    # The summary first: a file that fails to be written (a full disk) loses no more.
    summary = msgspec.json.format(msgspec.json.encode(summarize(result)).decode()) + "\n"
    try:
        if sys.stdout is None:  # started with stdout closed (>&-)
            raise OSError("stdout is closed")
        sys.stdout.write(summary)
        sys.stdout.flush()
    except OSError as err:
        # A reader that went away (| head -0): say so once, not at every later flush.
        with contextlib.suppress(OSError, AttributeError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.stderr.write(f"{parser.prog}: the summary was not printed: {err}\n")
        status = 1
    for line in _failures(result.records):
        sys.stderr.write(f"{parser.prog}: {line}\n")
    if signum is not None:
        sys.stderr.write(
            f"{parser.prog}: {signal.Signals(signum).name}: stopped, "
            f"{_count(result.in_flight, 'request')} in flight left out\n"
        )
        status = 128 + signum
    if args.json:
        try:
            with open(args.json, "wb") as out:
                out.write(msgspec.json.encode(result))
        except OSError as err:
            sys.stderr.write(
                f"{parser.prog}: --json {args.json}: the records were not written: {err}\n"
            )
            return status if signum is not None else 1
    return status


async def _until_signalled(spec: LoadSpec) -> tuple[LoadResult, int | None]:
    """The load, and the stop signal that ended it early (``None``: it ran its course).

    A signal this process was started ignoring (SIGINT under ``&`` in a script) stays
    ignored; after the first, and at the end, the handlers it replaced are back (for the
    command, Python's; for a program calling `main`, its own). Only the main thread can
    watch for signals: elsewhere (``main`` called from a thread) none is watched.
    """
    loop = asyncio.get_running_loop()
    abandon = asyncio.Event()
    received: list[int] = []
    in_main_thread = threading.current_thread() is threading.main_thread()
    watched = watched_signals(_STOP_SIGNALS) if in_main_thread else ()
    before = {s: signal.getsignal(s) for s in watched}

    def restore() -> None:
        # asyncio's removal leaves SIG_DFL (SIGINT: Python's), not what was there.
        for s in watched:
            handler = before[s]
            if loop.remove_signal_handler(s) and handler is not None:
                signal.signal(s, handler)

    def on_signal(signum: int) -> None:
        received.append(signum)
        abandon.set()
        restore()

    for s in watched:
        loop.add_signal_handler(s, on_signal, s)
    try:
        result = await run_load(spec, abandon=abandon)
    finally:
        restore()
    return result, received[0] if received else None


def _failures(records: Sequence[RequestRecord]) -> list[str]:
    """One line a kind of failure, the most frequent first: how many, and the first's
    request and detail."""
    counts = Counter(r.error for r in records if r.error is not None)
    first: dict[str, RequestRecord] = {}
    for record in records:
        if record.error is not None and (
            record.error not in first or record.index < first[record.error].index
        ):
            first[record.error] = record
    lines = []
    for kind, n in counts.most_common():
        record = first[kind]
        port = f" on local port {record.local_port}" if record.local_port else ""
        lines.append(
            f"{_count(n, 'request')} failed as {kind}; the first, request {record.index} "
            f"(sent at {record.start:.3f} s{port}): {record.detail or kind}"
        )
    return lines


def _count(n: int, thing: str) -> str:
    return f"{n:,} {thing}" + ("" if n == 1 else "s")


def _check_descriptors(spec: LoadSpec) -> None:
    """Make room for a connection a client, under the hard open-file limit, or refuse the
    load: past it, clients would fail to connect and be counted as refused by the server.

    Raises:
        ValueError: The hard limit is too low for ``spec``'s clients.
    """
    clients = _clients(spec)
    needed = clients + _FDS_BESIDES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard == resource.RLIM_INFINITY or hard >= needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        return
    raise ValueError(
        f"--concurrency {spec.concurrency}: each client holds a connection, and the "
        f"open-file limit (RLIMIT_NOFILE) is {hard}: give at most "
        f"{max(hard - _FDS_BESIDES, 0)}, or raise the limit (ulimit -n {needed})"
    )


def _check_writable(path: str) -> None:
    """Refuse a ``--json`` file that cannot be written, before the load runs (a typo would
    otherwise cost the whole run).

    Raises:
        ValueError: ``path`` is a directory, or in none, or this user may not write it.
    """
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--json {path}: a directory; name a file in it")
    if not target.parent.is_dir():
        raise ValueError(f"--json {path}: no directory {target.parent}")
    if target.exists():
        if not os.access(target, os.W_OK):
            raise ValueError(f"--json {path}: this user may not write it")
    elif not os.access(target.parent, os.W_OK | os.X_OK):
        raise ValueError(f"--json {path}: this user may not make a file in {target.parent}")


def _spec(args: argparse.Namespace) -> LoadSpec:
    """The load `main`'s arguments ask for.

    Raises:
        ValueError: An argument is refused; the message names it (never the key).
    """
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests {args.requests}: it must be at least 1")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency {args.concurrency}: it must be at least 1")
    if args.duration is not None and not 0 < args.duration < math.inf:
        raise ValueError(
            f"--duration {args.duration:g}: it must be more than 0 seconds, and finite"
        )
    if not 0 < args.timeout < math.inf:
        raise ValueError(f"--timeout {args.timeout:g}: it must be more than 0 seconds, and finite")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: it must be at least 1")
    if "" in (args.prompt or ()):
        raise ValueError("--prompt '': a prompt must not be empty")
    _server_address(args.url)
    key = key_given(args.api_key, "send no key")
    return LoadSpec(
        url=args.url,
        api=args.api,
        concurrency=args.concurrency,
        duration=args.duration,
        requests=100 if args.requests is None and args.duration is None else args.requests,
        max_tokens=args.max_tokens,
        model=args.model,
        prompts=tuple(args.prompt or LoadSpec.prompts),
        timeout=args.timeout,
        api_key=key,
    )


if __name__ == "__main__":
    sys.exit(main())
