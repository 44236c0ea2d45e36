"""The bounds of every connection a serving worker takes (`actors.http._bounded`), tried
from outside as an attacker would, over raw TCP against a real ``open_server``.

Each finding this reproduces held a connection (or a worker's memory) without bound before:
a head streamed for ever, too many headers, a head sent a byte at a time, a silent
connection, a body promised and never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import openai
import pytest
import uvicorn
from uvicorn.server import ServerState

from actors.http import ServeConfig, open_server
from actors.http._bounded import MAX_PIPELINED, BoundedProtocol
from actors.http._pipeline_engine import BUNDLED_MODEL_ID as MODEL
from actors.messages import GetSchedulerStatistics, Member, SchedulerStatistics
from runtime import Throttle
from tests.http._server import running_serve

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from actors.http import Server

#: Short timeouts, so that each one is seen to fire within a test.
CONFIG = ServeConfig(header_timeout=1.0, body_timeout=1.0, idle_timeout=1.0, send_timeout=1.0)
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


@pytest.fixture(scope="module")
async def module_server() -> AsyncIterator[Server]:
    async with open_server(workers=2, port=0, config=CONFIG) as server:
        yield server


@pytest.fixture
async def server(module_server: Server) -> AsyncIterator[Server]:
    yield module_server
    # Each test leaves every worker serving: a request reaches the app.
    status, _, _ = await exchange(module_server, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status == 200


async def connect(server: Server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = server.dispatcher.address
    return await asyncio.open_connection(host, port)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer: status, headers, body (by its Content-Length)."""
    status_line = await reader.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readline()).strip(), 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readline()
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def exchange(server: Server, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await connect(server)
    try:
        writer.write(request)
        with anyio.fail_after(10):
            return await read_answer(reader)
    finally:
        writer.close()


def refusal(headers: dict[str, str], body: bytes, request_id: str | None = None) -> Any:
    """The OpenAI error object of an answer the connection's protocol wrote itself, checked
    to be one, with ``connection: close`` and an ``X-Request-Id`` (``request_id``, else a
    new one)."""
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    if request_id is None:
        assert re.fullmatch("[0-9a-f]{32}", headers["x-request-id"]), headers
    else:
        assert headers["x-request-id"] == request_id
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What arrives until the server closes the connection (failing after ``seconds``)."""
    with anyio.fail_after(seconds):
        return await reader.read()


def _reader_of(data: bytes) -> asyncio.StreamReader:
    """A reader of bytes already received."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def worker_rss(server: Server) -> int:
    """The resident bytes of every worker process together."""
    total = 0
    for k in range(server.pipeline.config.workers):
        ref = server.pipeline.worker_ref(k)
        assert ref is not None
        pid = server.pipeline.system.pid_of(ref)
        status = Path(f"/proc/{pid}/status").read_text()
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))
        total += int(kib) << 10
    return total


class TestHeads:
    async def test_a_head_streamed_without_end_is_refused_431_before_a_megabyte(
        self, server: Server
    ) -> None:
        rss = worker_rss(server)
        reader, writer = await connect(server)
        writer.write(HEAD + b"x-long: ")
        sent = 0
        chunk = b"a" * 4096
        answer = asyncio.ensure_future(read_answer(reader))
        with anyio.fail_after(60):  # the finding: one header value streamed for 60 s
            while not answer.done() and sent < 4 << 20:
                writer.write(chunk)
                sent += len(chunk)
                try:
                    await writer.drain()
                except ConnectionError:
                    break
                await anyio.lowlevel.checkpoint()
            status, headers, body = await answer
            assert await reader.read() == b""  # and it closed the connection
        writer.close()
        assert status == 431
        error = refusal(headers, body)
        assert error["code"] == "request_header_fields_too_large"
        # Refused at the limit (what the client sent past it sat unread in socket buffers).
        assert "65536 bytes" in error["message"]
        assert worker_rss(server) - rss < 16 << 20

    async def test_a_head_just_under_the_limit_is_served(self, server: Server) -> None:
        value = b"v" * (CONFIG.max_header_bytes - 200)
        request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + value + b"\r\n\r\n"
        status, _, _ = await exchange(server, request)
        assert status == 200

    async def test_more_header_fields_than_max_headers_are_refused_431(
        self, server: Server
    ) -> None:
        many = b"".join(b"x-h%d: 1\r\n" % i for i in range(CONFIG.max_headers + 1))
        request = b"GET /health HTTP/1.1\r\nx-request-id: not-read\r\n" + many + b"\r\n"
        status, headers, body = await exchange(server, request)
        assert status == 431
        # Its headers were never read: a new id, not the one it sent.
        error = refusal(headers, body)
        assert f"more than {CONFIG.max_headers} header fields" in error["message"]
        fewer = b"".join(b"x-h%d: 1\r\n" % i for i in range(CONFIG.max_headers - 1))
        status, _, _ = await exchange(
            server, b"GET /health HTTP/1.1\r\nhost: x\r\n" + fewer + b"\r\n"
        )
        assert status == 200

    async def test_a_head_sent_a_byte_at_a_time_gets_408_at_the_header_timeout(
        self, server: Server
    ) -> None:
        reader, writer = await connect(server)
        started = time.monotonic()
        answer = asyncio.ensure_future(read_answer(reader))
        with anyio.fail_after(10):
            for byte in HEAD + b"x-slow: " + b"z" * 1000:
                if answer.done():
                    break
                writer.write(bytes([byte]))
                with anyio.move_on_after(0.1):  # sync-ok: a slowloris client's pace
                    await asyncio.shield(answer)
            status, headers, body = await answer
        writer.close()
        elapsed = time.monotonic() - started
        assert status == 408
        assert "did not arrive within 1 s" in refusal(headers, body)["message"]
        assert CONFIG.header_timeout <= elapsed < CONFIG.header_timeout + 2


class TestRequestsThatAreNotHTTP:
    @pytest.mark.parametrize(
        ("request_bytes", "reason"),
        [
            (b"GET / HTTP/1.2\r\nhost: x\r\n\r\n", "Invalid HTTP version"),
            (b"\x00 not http\r\n\r\n", "Invalid method"),
            (
                HEAD + b"content-length: 2\r\ncontent-length: 2\r\n\r\n{}",
                "Duplicate Content-Length",
            ),
            (b"CONNECT x:443 HTTP/1.1\r\nhost: x\r\n\r\n", "its method or target cannot"),
        ],
        ids=["version", "method", "duplicate-content-length", "connect"],
    )
    async def test_a_request_the_parser_cannot_read_gets_400_as_an_openai_error(
        self, server: Server, request_bytes: bytes, reason: str
    ) -> None:
        """Before, uvicorn's plain-text 400, with no X-Request-Id."""
        reader, writer = await connect(server)
        writer.write(request_bytes)
        with anyio.fail_after(10):
            status, headers, body = await read_answer(reader)
            assert await reader.read() == b""  # then it closes
        writer.close()
        assert status == 400
        error = refusal(headers, body)
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "invalid_http_request"
        assert error["message"].startswith("the request is not valid HTTP/1.1: " + reason)

    async def test_a_body_the_parser_cannot_read_gets_400_with_the_requests_id(
        self, server: Server
    ) -> None:
        bad_chunk = b"x-request-id: bad-chunk-1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
        status, headers, body = await exchange(server, HEAD + bad_chunk)
        assert status == 400
        error = refusal(headers, body, "bad-chunk-1")
        assert (
            error["message"] == "the request is not valid HTTP/1.1: Invalid character in chunk size"
        )

    def test_many_requests_the_parser_cannot_read_log_a_few_lines(self) -> None:
        """Before, a WARNING line for each: a client could fill the server's disk."""
        flood = 500
        with running_serve(workers=1, stderr=True) as run:
            for _ in range(flood):
                with socket.create_connection(("127.0.0.1", run.port), timeout=10) as sock:
                    sock.sendall(b"GET / HTTP/1.2\r\nhost: x\r\n\r\n")
                    answer = b""
                    while data := sock.recv(65536):
                        answer += data
                assert answer.startswith(b"HTTP/1.1 400 "), answer
            run.proc.send_signal(signal.SIGTERM)
            _, err = run.proc.communicate(timeout=30)
        lines = [line for line in err.splitlines() if "Invalid HTTP request received." in line]
        assert 1 <= len(lines) <= 3, err


class TestIdleAndBodies:
    async def test_a_silent_connection_is_closed_at_the_idle_timeout(self, server: Server) -> None:
        reader, writer = await connect(server)
        started = time.monotonic()
        assert await closed_within(reader, CONFIG.idle_timeout + 3) == b""
        assert time.monotonic() - started >= CONFIG.idle_timeout * 0.9
        writer.close()

    async def test_a_kept_alive_connection_is_closed_at_the_idle_timeout(
        self, server: Server
    ) -> None:
        reader, writer = await connect(server)
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, _ = await read_answer(reader)
        assert status == 200
        assert await closed_within(reader, CONFIG.idle_timeout + 3) == b""
        writer.close()

    @pytest.mark.parametrize(
        "promise",
        [
            b"content-length: 100\r\n\r\n" + b'{"prompt": ',
            b"transfer-encoding: chunked\r\n\r\nffff\r\n" + b'{"prompt": ',
        ],
        ids=["content-length", "chunk-size"],
    )
    async def test_a_body_that_stops_arriving_gets_408_at_the_body_timeout(
        self, server: Server, promise: bytes
    ) -> None:
        reader, writer = await connect(server)
        writer.write(HEAD + b"x-request-id: slow-body-1\r\n" + promise)
        started = time.monotonic()
        with anyio.fail_after(CONFIG.body_timeout + 5):
            status, headers, body = await read_answer(reader)
            assert await reader.read() == b""  # then it closes
        writer.close()
        assert status == 408
        # Its headers were read: the answer carries its id, as the app's answers do.
        assert "stopped arriving" in refusal(headers, body, "slow-body-1")["message"]
        assert time.monotonic() - started >= CONFIG.body_timeout * 0.9

    async def test_a_body_arriving_slowly_but_steadily_is_read_whole(self, server: Server) -> None:
        body = json.dumps({"prompt": "Hello there", "max_tokens": 2}).encode()
        reader, writer = await connect(server)
        writer.write(HEAD + b"content-length: %d\r\n\r\n" % len(body))
        # Each byte well within the body timeout, the whole body well past it.
        pace = CONFIG.body_timeout / 8
        with anyio.fail_after(30):
            for i in range(0, len(body), 2):
                writer.write(body[i : i + 2])
                await writer.drain()
                if i < 24:
                    await anyio.sleep(pace)  # sync-ok: a slow client's pace
            status, _, _ = await read_answer(reader)
        writer.close()
        assert status == 200


#: A /detokenize request whose answer (about 10 MB) is more than the kernel's buffers of a
#: connection hold: what is left waits in the worker for the client.
LARGE_ANSWER = b'{"tokens": [' + b",".join([b"2694"] * 800_000) + b"]}"


async def ask_large_answer(server: Server) -> socket.socket:
    """A connection that asked for `LARGE_ANSWER`'s answer, with a small receive buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, server.dispatcher.address)
    head = b"POST /detokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    await loop.sock_sendall(sock, head + b"content-length: %d\r\n\r\n" % len(LARGE_ANSWER))
    await loop.sock_sendall(sock, LARGE_ANSWER)
    return sock


async def open_until(server: Server, count: int, seconds: float) -> None:
    """Wait until the workers serve ``count`` connections, as the port's owner counts them
    (nothing announces it)."""
    with anyio.fail_after(seconds):
        for _ in itertools.count():
            if sum(server.statistics().open.values()) == count:
                return
            await anyio.sleep(0.05)  # sync-ok: polling the owner's counts


class TestAnswersNobodyReads:
    async def test_a_client_that_reads_nothing_of_a_large_answer_is_closed(
        self, server: Server
    ) -> None:
        """Before, its connection and the answer's bytes were held for ever: neither the
        idle timeout's close nor a drain's waits for bytes nobody takes."""
        socks = [await ask_large_answer(server) for _ in range(3)]
        try:
            await open_until(server, 3, 10)
            started = time.monotonic()
            await open_until(server, 0, CONFIG.send_timeout + CONFIG.idle_timeout + 5)
            assert time.monotonic() - started >= CONFIG.send_timeout * 0.9
        finally:
            for sock in socks:
                sock.close()

    async def test_a_client_that_reads_slowly_but_steadily_gets_the_whole_answer(
        self, server: Server
    ) -> None:
        sock = await ask_large_answer(server)
        loop = asyncio.get_running_loop()
        got = bytearray()
        try:
            with anyio.fail_after(30):
                # 1 MB each 0.4 s: each read well within the send timeout, the whole
                # answer well past it.
                while not got.endswith(b'"}'):
                    taken = 0
                    while taken < 1 << 20:
                        data = await loop.sock_recv(sock, 1 << 16)
                        assert data, "the server closed the connection"
                        got += data
                        taken += len(data)
                        if got.endswith(b'"}'):
                            break
                    await anyio.sleep(CONFIG.send_timeout * 0.4)  # sync-ok: a slow reader
        finally:
            sock.close()
        head, _, body = bytes(got).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert json.loads(body)["prompt"] == "Ġtemperature".replace("Ġ", " ") * 800_000


HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


class TestPipelinedRequests:
    async def test_a_few_pipelined_requests_are_all_answered_on_a_kept_connection(
        self, server: Server
    ) -> None:
        reader, writer = await connect(server)
        writer.write(HEALTH * MAX_PIPELINED)
        with anyio.fail_after(10):
            answers = [await read_answer(reader) for _ in range(MAX_PIPELINED)]
            writer.write(HEALTH)
            answers.append(await read_answer(reader))
        writer.close()
        assert [status for status, _, _ in answers] == [200] * (MAX_PIPELINED + 1)

    async def test_past_the_bound_the_parsed_ones_are_answered_then_the_connection_closes(
        self, server: Server
    ) -> None:
        reader, writer = await connect(server)
        writer.write(HEALTH * 1000)  # one read of the server's
        statuses = []
        with anyio.fail_after(10):
            while not reader.at_eof():
                with contextlib.suppress(AssertionError):  # the end: b""
                    statuses.append((await read_answer(reader))[0])
        writer.close()
        assert MAX_PIPELINED < len(statuses) < 100
        assert set(statuses) == {200}

    async def test_a_head_pipelined_in_the_same_read_is_held_to_the_bound(
        self, server: Server
    ) -> None:
        """A head that reaches the parser in the read of the request before it is not
        gathered first: before, it was parsed whole, whatever its size."""
        long_head = HEALTH[:-2] + b"x-pad: %s\r\n\r\n" % (b"v" * CONFIG.max_header_bytes)
        reader, writer = await connect(server)
        writer.write(HEALTH + long_head)
        with anyio.fail_after(10):
            first = await read_answer(reader)
            status, headers, body = await read_answer(reader)
            assert await closed_within(reader, 10) == b""
        writer.close()
        assert first[0] == 200
        assert status == 431
        assert refusal(headers, body)["code"] == "request_header_fields_too_large"

    async def test_a_pipelined_head_whose_blank_line_comes_in_the_next_read_is_served(
        self, server: Server
    ) -> None:
        """The first read brings a request and the next one's head but for its last line
        end; the parser holds that head. Before, the gatherer looked for the blank line in
        the next read alone, never found it, and the request got 408."""
        reader, writer = await connect(server)
        writer.write(HEALTH + HEALTH[:-2])
        with anyio.fail_after(10):
            first = await read_answer(reader)
            writer.write(b"\r\n")
            second = await read_answer(reader)
        writer.close()
        assert (first[0], second[0]) == (200, 200)

    async def test_a_client_pipelining_without_end_grows_no_worker(self, server: Server) -> None:
        """Before, each read of pipelined requests was parsed into thousands of waiting
        ones: 12 MB sent in 4 s grew the worker by 700 MB."""
        before = worker_rss(server)
        reader, writer = await connect(server)
        flood = HEALTH * (256 * 1024 // len(HEALTH))

        async def read_all() -> None:
            with contextlib.suppress(ConnectionError):
                while await reader.read(1 << 20):
                    pass

        sent = 0
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_all)
                with contextlib.suppress(ConnectionError):
                    while sent < 12 << 20:
                        writer.write(flood)
                        await writer.drain()
                        sent += len(flood)
        writer.close()
        assert sent < 12 << 20  # the server closed the connection first
        assert worker_rss(server) - before < 50 << 20


STREAM = json.dumps(
    {"prompt": "Hello there", "max_tokens": 300, "stream": True, "ignore_eos": True}
).encode()
#: A streamed completion of 300 tokens: 3 s at `streaming`'s step time.
STREAMED = HEAD + b"content-length: %d\r\n\r\n" % len(STREAM) + STREAM


@pytest.fixture(scope="module")
async def streaming() -> AsyncIterator[Server]:
    """One worker whose engine takes 10 ms a token: an answer streams for seconds."""
    async with open_server(workers=1, port=0, config=CONFIG, step_time=0.01) as server:
        yield server


async def scheduler_running(server: Server) -> int:
    ref = await server.pipeline.system.lookup(Member.SCHEDULER.value)
    stats = await ref.ask(GetSchedulerStatistics(), timeout=10)
    assert isinstance(stats, SchedulerStatistics)
    return stats.running + stats.waiting


class TestAStreamWithARequestPipelinedBehindIt:
    """uvicorn tells only its newest request (a pipelined one) of what happens to the
    connection; the one being answered is the oldest."""

    async def test_a_client_that_leaves_ends_the_answer_being_streamed(
        self, streaming: Server
    ) -> None:
        reader, writer = await connect(streaming)
        writer.write(STREAMED + HEALTH)
        with anyio.fail_after(10):
            await reader.readuntil(b"data: ")  # it streams
        assert await scheduler_running(streaming) == 1
        writer.close()
        # Before, the engine generated its 300 tokens for nobody, each write logged.
        for _ in range(100):  # 2 s: the scheduler's counters, polled from outside
            if not await scheduler_running(streaming):
                break
            await anyio.sleep(0.02)  # sync-ok: polling the scheduler's counters
        else:
            pytest.fail("the engine still generates for a client that left 2 s ago")

    async def test_a_refused_pipelined_request_is_answered_after_the_stream_ahead(
        self, streaming: Server
    ) -> None:
        bad = HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\n"  # not a chunk size
        reader, writer = await connect(streaming)
        writer.write(STREAMED)
        with anyio.fail_after(10):
            first = await reader.readuntil(b"data: ")
            writer.write(bad)
            rest = await closed_within(reader, 10)
        writer.close()
        # The stream ends whole (before, it was cut), and the refusal comes after it, never
        # inside its chunked body; then the connection closes.
        stream, done, after = (first + rest).partition(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert stream.startswith(b"HTTP/1.1 200 ")
        assert done
        status, headers, body = await read_answer(_reader_of(after))
        assert status == 400
        assert refusal(headers, body)["code"] == "invalid_http_request"

    async def test_a_refusal_behind_a_whole_answer_not_begun_comes_after_that_answer(
        self, streaming: Server
    ) -> None:
        """Before, the refusal of the request behind was written as the answer to the one
        ahead, with its id, and that one's own answer never came."""
        whole = json.dumps({"prompt": "Hello", "max_tokens": 30, "ignore_eos": True}).encode()
        ahead = HEAD + b"x-request-id: ahead\r\ncontent-length: %d\r\n\r\n" % len(whole)
        too_long = HEALTH[:-2] + b"x-pad: %s\r\n\r\n" % (b"v" * (1 << 20))
        reader, writer = await connect(streaming)
        writer.write(ahead + whole + too_long)  # the answer ahead takes 0.3 s to begin
        with anyio.fail_after(10):
            first = await read_answer(reader)
            status, headers, body = await read_answer(reader)
        writer.close()
        assert first[0] == 200
        assert first[1]["x-request-id"] == "ahead"
        assert json.loads(first[2])["usage"]["completion_tokens"] == 30
        assert status == 431
        assert refusal(headers, body)["code"] == "request_header_fields_too_large"

    async def test_a_head_pipelined_behind_a_long_stream_is_timed_once_it_is_answered(
        self, streaming: Server
    ) -> None:
        reader, writer = await connect(streaming)
        writer.write(STREAMED)
        with anyio.fail_after(20):
            started = await reader.readuntil(b"data: ")  # it streams
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: ")  # and no more
            rest = await closed_within(reader, 20)
        writer.close()
        # The stream outlives the header timeout (1 s) whole (before, the connection was
        # cut then, mid-stream); the half head is timed from its turn, and the connection
        # ends at the header or idle timeout.
        stream, done, after = (started + rest).partition(b"data: [DONE]")
        assert stream.startswith(b"HTTP/1.1 200 ")
        assert done
        assert b"HTTP/1.1" not in after or b"HTTP/1.1 408 " in after


class TestHTTP10Clients:
    """HTTP/1.0 has no chunked transfer encoding: an answer to it has a length, or is
    refused when it cannot have one (a stream)."""

    async def test_health_and_a_whole_completion_come_with_their_length(
        self, server: Server
    ) -> None:
        status, headers, body = await exchange(server, b"GET /health HTTP/1.0\r\n\r\n")
        assert (status, headers.get("content-length"), body) == (200, "0", b"")
        assert "transfer-encoding" not in headers
        whole = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        request = b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
        request += b"content-length: %d\r\n\r\n%s" % (len(whole), whole)
        status, headers, body = await exchange(server, request)
        assert status == 200
        assert "transfer-encoding" not in headers
        assert json.loads(body)["choices"][0]["finish_reason"] == "length"

    async def test_a_stream_asked_over_http10_is_refused_505(self, server: Server) -> None:
        request = b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
        request += b"content-length: %d\r\n\r\n%s" % (len(STREAM), STREAM)
        status, headers, body = await exchange(server, request)
        assert status == 505
        assert "transfer-encoding" not in headers
        assert json.loads(body)["error"]["code"] == "http_version_not_supported"


class TestChunkedBodies:
    @pytest.mark.parametrize("where", ["trailer", "extension"])
    async def test_a_trailer_or_chunk_extension_without_end_is_refused_431(
        self, server: Server, where: str
    ) -> None:
        body = b'{"prompt": "hi", "max_tokens": 2}'
        if where == "trailer":  # after the last chunk, a field whose value never ends
            opening = b"%x\r\n%s\r\n0\r\nx-trailer: " % (len(body), body)
        else:  # a chunk size followed by an extension that never ends
            opening = b"%x;ext=" % len(body)
        reader, writer = await connect(server)
        writer.write(HEAD + b"transfer-encoding: chunked\r\n\r\n" + opening)
        with anyio.fail_after(10), contextlib.suppress(ConnectionError):
            for _ in range(16):  # 1 MiB, sixteen times the head's bound (64 KiB)
                writer.write(b"a" * (64 << 10))
                await writer.drain()
        with anyio.fail_after(10):
            status, headers, answer = await read_answer(reader)
        writer.close()
        # Refused as a head that long is, not parsed on for ever (the parser kept a
        # trailer's value whole: a worker grew by 170 MB a minute).
        assert status == 431
        assert refusal(headers, answer)["code"] == "request_header_fields_too_large"


class TestAnswersBeforeTheBody:
    async def test_a_client_still_sending_its_body_reads_the_413_not_a_reset(
        self, server: Server
    ) -> None:
        """The 413 is answered from the Content-Length, before the body is read. Before,
        the connection was closed at once, unread bytes in it: the kernel reset it, and
        httpx, which sends the whole body before it reads, raised a connection error (the
        openai client's ``APIConnectionError``, after two retries of as many megabytes)."""
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        prompt = "hello " * (3 * CONFIG.max_body_bytes // 6)  # three times the limit
        try:
            with anyio.fail_after(20), pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        finally:
            await client.close()
        assert refused.value.status_code == 413
        assert refused.value.code == "request_too_large"

    @pytest.mark.parametrize(
        ("framing", "chunk"),
        [
            (b"transfer-encoding: chunked", b"10000\r\n" + b"x" * 65_536 + b"\r\n"),
            (b"content-length: %d" % 2**62, b"x" * 65_536),
        ],
        ids=["chunked", "content-length"],
    )
    async def test_a_body_a_route_takes_no_part_of_is_not_read_to_its_end(
        self, server: Server, framing: bytes, chunk: bytes
    ) -> None:
        """GET /health is answered without its body. Before, the body was then read and
        dropped for as long as it came (a GB in a few seconds here): a client sending one
        without end kept a worker parsing it, and its connection open."""
        reader, writer = await connect(server)
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n%s\r\n\r\n" % framing)

        async def send_on() -> None:
            with contextlib.suppress(ConnectionError):
                while True:
                    writer.write(chunk)
                    await writer.drain()

        try:
            with anyio.fail_after(10):
                status, _, _ = await read_answer(reader)
                assert status == 200
                async with anyio.create_task_group() as tg:
                    tg.start_soon(send_on)
                    # The connection ends while the body still comes.
                    assert await reader.read() == b""
                    tg.cancel_scope.cancel()
        finally:
            writer.close()


#: What ``curl --http2`` adds to a request over plain HTTP, as Java's and Ktor's clients do.
H2C = (
    b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
    b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)


class TestUpgradeOffers:
    async def test_a_request_offering_an_upgrade_is_served_whole_as_http11(
        self, server: Server
    ) -> None:
        """The parser skips the body of a request offering an upgrade and stops after its
        head. Before, the app got an empty body (400, "Input data was truncated"), and the
        requests after it on the connection were never answered."""
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        sized = HEAD + H2C + b"content-length: %d\r\n\r\n%s" % (len(body), body)
        chunked = HEAD + H2C + b"transfer-encoding: chunked\r\n\r\n"
        chunked += b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        reader, writer = await connect(server)
        writer.write(sized + chunked + b"GET /health HTTP/1.1\r\nhost: x\r\n" + H2C + b"\r\n")
        with anyio.fail_after(10):
            answers = [await read_answer(reader) for _ in range(3)]
            writer.write(HEALTH)
            answers += [await read_answer(reader)]
            # Its body comes in a read of its own, as a client that writes it apart sends it.
            writer.write(HEAD + H2C + b"content-length: %d\r\n\r\n" % len(body))
            await writer.drain()
            await anyio.sleep(0.1)  # sync-ok: lets the head reach the server alone
            writer.write(body)
            answers += [await read_answer(reader)]
        writer.close()
        assert [status for status, _, _ in answers] == [200] * 5, answers
        for _, _, answer in (answers[0], answers[1], answers[4]):
            assert json.loads(answer)["usage"]["prompt_tokens"] > 0


class TestTheParsersWork:
    async def test_a_head_trickled_a_byte_at_a_time_is_parsed_once_whole(self) -> None:
        """Each byte its own read, as a slow client can make it: the parser is fed the head
        once, whole (fed piece by piece, it copies a long value anew for every piece)."""
        seen: list[list[tuple[bytes, bytes]]] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            seen.append(list(scope["headers"]))
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        config = uvicorn.Config(app, http="httptools", lifespan="off", log_config=None)
        config.load()
        state = ServerState()
        closed: list[bool] = []
        protocol = BoundedProtocol(
            config,
            state,
            limits=CONFIG,
            draining=lambda: False,
            closed=lambda: closed.append(True),
            invalid_requests=Throttle(logging.getLogger("uvicorn.error")),
        )
        fed: list[int] = []
        protocol.parser = _CountedParser(protocol.parser, fed)  # type: ignore[assignment]
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_accepted_socket(lambda: protocol, ours)
        value = b"v" * (CONFIG.max_header_bytes - 100)
        head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-long: " + value + b"\r\n\r\n"
        for i in range(len(head)):
            protocol.data_received(head[i : i + 1])
        with anyio.fail_after(10):
            while not seen:
                await anyio.lowlevel.checkpoint()
        transport.close()
        theirs.close()
        with anyio.fail_after(10):
            while not closed:
                await anyio.lowlevel.checkpoint()
        assert fed == [len(head)]
        assert (b"x-long", value) in seen[0]


class _CountedParser:
    """The connection's own parser, with the length of each piece fed to it recorded."""

    def __init__(self, parser: Any, fed: list[int]) -> None:
        self._parser = parser
        self._fed = fed

    def feed_data(self, data: bytes) -> None:
        self._fed.append(len(data))
        self._parser.feed_data(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)
