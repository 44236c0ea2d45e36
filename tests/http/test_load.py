"""actors.http.load: the load generator against the real app, and against small
scripted servers that refuse, close, reset and fail streams the ways real servers do."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import resource
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from actors.__main__ import main as actors_main
from actors.http import ApiKey, ServeConfig
from actors.http.load import (
    CHUNKS_PER_TOKEN,
    MAX_EVENT,
    LoadResult,
    LoadSpec,
    main,
    run_load,
    summarize,
)
from tests.conftest import stop_signals_by_default

from ._server import ROOT, running_serve, serve_pipeline

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

OK_EVENTS = (
    b'data: {"choices":[{"index":0,"text":"Hel"}]}\n\n'
    b'data: {"choices":[{"index":0,"text":"lo","finish_reason":"length"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)


def chunked(*parts: bytes) -> bytes:
    """A chunked body of ``parts``, its last chunk included."""
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


def sse_response(body: bytes, *headers: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    return head + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


@contextlib.asynccontextmanager
async def scripted(
    answer: Callable[[int], bytes],
    close_after: Callable[[int], bool],
    heads: list[bytes] | None = None,
    host: str = "127.0.0.1",
) -> AsyncIterator[str]:
    """A server on 127.0.0.1 answering request ``i`` (counted over all connections) with
    ``answer(i)``, then closing the connection if ``close_after(i)``; each request's head
    is kept in ``heads``, when given."""
    count = 0
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                if heads is not None:
                    heads.append(head)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                i, count = count, count + 1
                writer.write(answer(i))
                await writer.drain()
                if close_after(i):
                    return
        except ConnectionError:
            return
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    finally:
        server.close()
        await server.wait_closed()
        if handlers:
            await asyncio.wait(handlers)


class TestAgainstTheApp:
    @pytest.mark.parametrize("api", ["completions", "chat"])
    async def test_every_request_streams_to_done_with_its_tokens_counted(self, api: str) -> None:
        async with serve_pipeline(workers=1, step_time=0.001) as served:
            spec = LoadSpec(url=served.url, api=api, concurrency=4, requests=24, max_tokens=8)
            result = await run_load(spec)
        assert len(result.records) == 24
        assert all(r.ok and r.error is None for r in result.records)
        assert [r.output_tokens for r in result.records] == [8] * 24
        assert all(r.ttft is not None and 0 < r.ttft <= r.e2e for r in result.records)
        assert any(r.itl for r in result.records)
        assert (result.connects, result.server_closes) == (4, 0)  # kept alive throughout
        assert result.cpu_seconds > 0
        summary = summarize(result)
        assert (summary["ok"], summary["errors"]) == (24, {})
        assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p99"]
        assert summary["client_cpu_us_per_request"] > 0

    async def test_a_duration_bounds_the_run_and_refusals_are_counted_by_status(self) -> None:
        async with serve_pipeline(workers=1) as served:
            ok = await run_load(
                LoadSpec(url=served.url, concurrency=2, duration=0.3, requests=None)
            )
            refused = await run_load(
                LoadSpec(url=served.url, concurrency=2, requests=6, max_tokens=0)
            )
        assert ok.records
        assert all(r.ok for r in ok.records)
        assert max(r.start for r in ok.records) < 0.3
        assert summarize(refused)["errors"] == {"http_400": 6}
        assert refused.connects == 2  # the error bodies were read: the connections lived on


class TestFailures:
    async def test_a_port_nobody_listens_on_is_refused(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        result = await run_load(LoadSpec(url=f"http://127.0.0.1:{port}", concurrency=1, requests=3))
        assert summarize(result)["errors"] == {"refused": 3}
        assert result.connects == 0

    async def test_connections_the_server_closes_after_each_answer_are_replaced(self) -> None:
        async with scripted(lambda i: sse_response(chunked(OK_EVENTS)), lambda i: True) as url:
            result = await run_load(LoadSpec(url=url, concurrency=2, requests=10))
        assert all(r.ok for r in result.records)
        assert [r.output_tokens for r in result.records] == [2] * 10
        assert result.connects >= 10
        assert result.server_closes >= 8

    async def test_a_connection_close_header_is_honoured_before_the_next_request(self) -> None:
        answer = sse_response(chunked(OK_EVENTS), b"connection: close")
        async with scripted(lambda i: answer, lambda i: True) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=5))
        assert all(r.ok for r in result.records)
        assert (result.connects, result.server_closes) == (5, 5)

    async def test_a_connection_closed_mid_stream_fails_its_request_and_the_next_reconnects(
        self,
    ) -> None:
        cut = sse_response(b"40\r\n" + OK_EVENTS[:20])  # a chunk cut short, then EOF

        def answer(i: int) -> bytes:
            return cut if i == 1 else sse_response(chunked(OK_EVENTS))

        async with scripted(answer, lambda i: i == 1) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=4))
        assert [r.error for r in result.records] == [None, "closed", None, None]
        assert result.connects == 2

    async def test_error_events_and_streams_without_done_are_failures(self) -> None:
        error = b'data: {"error":{"message":"worker died","type":"server_error"}}\n\n'
        first = OK_EVENTS.split(b"\n\n")[0] + b"\n\n"
        bodies = [OK_EVENTS, OK_EVENTS[:-14], first + error, first + b"data: {oops\n\n" + OK_EVENTS]

        def answer(i: int) -> bytes:
            return sse_response(chunked(bodies[i]))

        async with scripted(answer, lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=4))
        errors = [r.error for r in result.records]
        assert errors == [None, "incomplete", "stream_error", "bad_event"]
        assert result.records[1].output_tokens == 2

    def test_the_command_line_prints_a_summary_and_exits_nonzero_on_failures(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        assert main(["--url", f"http://127.0.0.1:{port}", "--requests", "1"]) == 1
        assert '"refused": 1' in capsys.readouterr().out
        # The same command as `python -m actors load`.
        assert actors_main(["load", "--url", f"http://127.0.0.1:{port}", "--requests", "2"]) == 1
        assert '"refused": 2' in capsys.readouterr().out

    def test_json_writes_every_record_and_the_summary_is_printed_too(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        path = tmp_path / "records.json"
        url = f"http://127.0.0.1:{port}"
        assert main(["--url", url, "--requests", "2", "--json", str(path)]) == 1
        assert '"refused": 2' in capsys.readouterr().out
        result = msgspec.json.decode(path.read_bytes(), type=LoadResult)
        assert [r.error for r in result.records] == ["refused", "refused"]

    @pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
    def test_a_json_file_that_fails_to_be_written_after_the_run_costs_no_summary(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Before, the summary was printed only after the file was written: a write that
        failed lost every measurement of the run, with a traceback. /dev/full takes the
        check made before the run and fails the write (no space left)."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        assert main(["--url", url, "--requests", "1", "--json", "/dev/full"]) == 1
        out, err = capsys.readouterr()
        assert '"refused": 1' in out
        failed, line = err.splitlines()
        assert failed.startswith("python -m actors load: 1 request failed as refused")
        assert line.startswith("python -m actors load: --json /dev/full: the records were not")
        assert "No space left on device" in line

    async def test_extra_headers_go_with_every_request(self) -> None:
        heads: list[bytes] = []
        traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        spec = LoadSpec(url="", concurrency=2, requests=4, headers=(("traceparent", traceparent),))
        async with scripted(
            lambda i: sse_response(chunked(OK_EVENTS)), lambda i: False, heads
        ) as url:
            result = await run_load(dataclasses.replace(spec, url=url))
        assert all(r.ok for r in result.records)
        assert len(heads) == 4
        assert all(f"\r\ntraceparent: {traceparent}\r\n".encode() in head for head in heads)

    def test_a_header_cannot_break_the_request_it_goes_with(self) -> None:
        with pytest.raises(ValueError, match="header"):
            LoadSpec(url="http://x", headers=(("x-a", "1\r\nx-b: 2"),))
        with pytest.raises(ValueError, match="header"):
            LoadSpec(url="http://x", headers=(("x a:", "1"),))

    def test_a_spec_needs_a_bound_and_a_known_api(self) -> None:
        with pytest.raises(ValueError, match="duration, a request count"):
            LoadSpec(url="http://x", duration=None, requests=None)
        with pytest.raises(ValueError, match="api="):
            LoadSpec(url="http://x", api="embeddings")


KEY = "load-test-key-1"


class TestAnApiKey:
    async def test_a_keyed_server_serves_a_load_that_sends_its_key(self) -> None:
        config = ServeConfig(api_key=ApiKey(KEY))
        async with serve_pipeline(workers=1, config=config, step_time=0.001) as served:
            spec = LoadSpec(url=served.url, concurrency=2, requests=6, max_tokens=4, api_key=KEY)
            keyed = await run_load(spec)
            unkeyed = await run_load(dataclasses.replace(spec, api_key=None))
            wrong = await run_load(dataclasses.replace(spec, api_key=KEY + "x"))
        assert summarize(keyed)["ok"] == 6
        assert summarize(unkeyed)["errors"] == {"http_401": 6}
        assert summarize(wrong)["errors"] == {"http_401": 6}
        assert KEY not in repr(spec)

    def test_the_command_line_sends_the_key_the_server_reads_from_the_environment(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.setenv("TOKENYARD_API_KEY", KEY)
        with running_serve(workers=1, env={"TOKENYARD_API_KEY": KEY}) as run:
            url = f"http://127.0.0.1:{run.port}"
            load = ["--url", url, "--requests", "4", "--concurrency", "2", "--max-tokens", "4"]
            assert actors_main(["load", *load]) == 0
            assert '"ok": 4' in capsys.readouterr().out
            # --api-key wins over the variable.
            assert actors_main(["load", *load, "--api-key", KEY + "x"]) == 1
            assert '"http_401": 4' in capsys.readouterr().out

    def test_an_empty_key_variable_is_refused_not_taken_as_no_key(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.setenv("TOKENYARD_API_KEY", "")
        assert main(["--url", "http://127.0.0.1:1", "--requests", "1"]) == 2
        assert "TOKENYARD_API_KEY is set but empty" in capsys.readouterr().err


class TestRefusedArguments:
    @pytest.mark.parametrize(
        ("arguments", "named"),
        [
            (["--requests", "0"], "--requests 0: it must be at least 1"),
            (["--requests", "-3"], "--requests -3: it must be at least 1"),
            (["--concurrency", "0"], "--concurrency 0: it must be at least 1"),
            (["--duration", "0"], "--duration 0: it must be more than 0 seconds"),
            (["--duration", "nan"], "--duration nan: it must be more than 0 seconds"),
            (["--duration", "inf"], "--duration inf: it must be more than 0 seconds, and finite"),
            (["--timeout", "0"], "--timeout 0: it must be more than 0 seconds, and finite"),
            (["--timeout", "nan"], "--timeout nan: it must be more than 0 seconds, and finite"),
            (["--max-tokens", "0"], "--max-tokens 0: it must be at least 1"),
            (["--prompt", ""], "--prompt '': a prompt must not be empty"),
            (["--url", "127.0.0.1:8000"], "url '127.0.0.1:8000': give the server as http://"),
            (["--url", "https://127.0.0.1:8000"], "url 'https://127.0.0.1:8000'"),
            (["--url", "http://127.0.0.1"], "url 'http://127.0.0.1'"),
            (["--url", "http://127.0.0.1:abc"], "url 'http://127.0.0.1:abc'"),
            (["--url", "http://127.0.0.1:99999"], "url 'http://127.0.0.1:99999'"),
            (["--url", "http://:8000"], "url 'http://:8000'"),
            (["--api-key", "two words"], "the API key is empty or has a character"),
            (["--json", "/nonexistent-dir/records.json"], "no directory /nonexistent-dir"),
            (["--json", "."], "--json .: a directory"),
        ],
        ids=[
            "requests-0",
            "requests-negative",
            "concurrency-0",
            "duration-0",
            "duration-nan",
            "duration-inf",
            "timeout-0",
            "timeout-nan",
            "max-tokens-0",
            "prompt-empty",
            "no-scheme",
            "https",
            "no-port",
            "port-not-a-number",
            "port-out-of-range",
            "no-host",
            "key-with-a-space",
            "json-in-no-directory",
            "json-a-directory",
        ],
    )
    def test_a_bad_value_exits_2_with_one_line_naming_it(
        self,
        arguments: list[str],
        named: str,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        """Before, --requests 0 sent 100 requests and --concurrency 0 or a bad port was a
        traceback; a URL without http:// went to port 80 of another host; a --json file
        that could not be written was a traceback after the whole run, its summary lost;
        --max-tokens 0 or an empty --prompt ran the whole load, every request a 400;
        --duration inf ran for ever; there was no --timeout."""
        monkeypatch.delenv("TOKENYARD_API_KEY", raising=False)
        argv = ["--url", "http://127.0.0.1:8000", *arguments]
        assert actors_main(["load", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        (line,) = err.splitlines()
        assert line.startswith("python -m actors load: ")
        assert named in line

    async def test_a_url_with_a_path_is_taken_and_a_url_without_a_port_is_not(self) -> None:
        async with serve_pipeline(workers=1, step_time=0.001) as served:
            spec = LoadSpec(url=served.url + "/v1", concurrency=1, requests=2, max_tokens=2)
            assert summarize(await run_load(spec))["ok"] == 2
        with pytest.raises(ValueError, match="give the server as http://host:port"):
            await run_load(LoadSpec(url="http://127.0.0.1", concurrency=1, requests=1))


def raw_response(status: bytes, *headers: bytes, body: bytes = b"") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


class TestAServerThatMisbehaves:
    """Servers an operator does not control: each misbehaviour fails its request with a
    kind and a line saying what the server did, within its bounds, never a traceback."""

    @pytest.mark.parametrize(
        ("answer", "said"),
        [
            (b"SSH-2.0-OpenSSH_8.9\r\n\r\n", "an answer that is not HTTP/1.x: 'SSH-2.0"),
            (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "a header line without ':'"),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: ten\r\n\r\n",
                "a content-length of 'ten'",
            ),
            (sse_response(b"zz\r\nhello\r\n"), "a chunk size that is not a number: 'zz\\r\\n'"),
            (sse_response(b"5" * 70_000), "a chunk-size line longer than 65536"),
            (sse_response(b"3\r\nabcde\r\n"), "a chunk longer than its size said"),
            (b"HTTP/1.1 200 OK\r\nx-pad: " + b"x" * 70_000, "whose head is longer than 65536"),
        ],
        ids=[
            "not-http",
            "header-without-colon",
            "length-not-a-number",
            "chunk-size-not-hex",
            "chunk-size-line-too-long",
            "chunk-longer-than-said",
            "head-too-long",
        ],
    )
    async def test_an_answer_that_breaks_http_fails_as_bad_response(
        self, answer: bytes, said: str
    ) -> None:
        """Before, each was a ValueError or LimitOverrunError traceback out of the task
        group, the whole load lost (or, for a long head, counted as the server closing)."""
        async with scripted(lambda i: answer, lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=2, timeout=5))
        assert [r.error for r in result.records] == ["bad_response"] * 2
        assert all(r.detail is not None and said in r.detail for r in result.records), [
            r.detail for r in result.records
        ]
        assert result.connects == 2  # the connection of a broken answer is not reused

    async def test_chunks_larger_than_a_read_and_small_ones_stream_alike(self) -> None:
        """A chunk over 64 KiB is read in pieces, the small ones after it whole."""
        comment = b": " + b"p" * 100_000 + b"\n\n"  # an SSE comment, skipped
        events = OK_EVENTS.split(b"\n\n")
        body = chunked(comment + events[0] + b"\n\n", *(e + b"\n\n" for e in events[1:-1]))
        async with scripted(lambda i: sse_response(body), lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=3))
        assert [(r.ok, r.output_tokens, len(r.itl)) for r in result.records] == [(True, 2, 1)] * 3
        assert result.connects == 1

    @pytest.mark.parametrize(
        "body",
        [
            chunked(OK_EVENTS.replace(b"\n", b"\r\n")),
            # Each CR the last byte of a chunk, its LF the first of the next.
            chunked(*(p + b"\r" for p in OK_EVENTS.replace(b"\n", b"\r\n").split(b"\r")[:-1])),
            chunked(OK_EVENTS.replace(b"\n", b"\r")),
            chunked(OK_EVENTS.replace(b"data: ", b"data:")),
            chunked(OK_EVENTS.replace(b"data: ", b": ping\nevent: completion\nid: 7\ndata: ")),
            chunked(OK_EVENTS.replace(b'"index":0,', b'"index":0,\ndata: ')),
        ],
        ids=["crlf", "crlf-split", "cr", "data-without-space", "more-fields", "data-lines"],
    )
    async def test_every_framing_sse_allows_streams_alike(self, body: bytes) -> None:
        """Lines ended with CRLF (sse-starlette's default) or CR, ``data:`` without its
        space, an event with other fields or its data on several lines: before, none of
        its events was read, and each request failed as incomplete."""
        async with scripted(lambda i: sse_response(body), lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=2))
        assert [(r.ok, r.error, r.output_tokens, len(r.itl)) for r in result.records] == [
            (True, None, 2, 1)
        ] * 2

    async def test_a_worker_header_that_is_not_a_number_is_left_out(self) -> None:
        """Before, a ValueError traceback: the header is only informational."""
        answer = sse_response(chunked(OK_EVENTS), b"x-tokenyard-worker: abc")
        async with scripted(lambda i: answer, lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=2))
        assert [(r.ok, r.worker) for r in result.records] == [(True, None)] * 2

    async def test_an_answer_with_a_length_ends_there_not_at_the_timeout(self) -> None:
        """A 200 that is JSON, not a stream, on a kept-alive connection: before, the client
        read until the server closed, so the request waited for its whole timeout."""
        body = b'{"choices":[{"text":"hi"}]}'
        answer = raw_response(
            b"200 OK",
            b"content-type: application/json",
            b"content-length: %d" % len(body),
            body=body,
        )
        async with scripted(lambda i: answer, lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=2, timeout=3))
        assert [r.error for r in result.records] == ["incomplete"] * 2
        assert all(r.e2e < 2 for r in result.records)
        assert result.connects == 1

    @pytest.mark.parametrize(
        "answer",
        [
            raw_response(b"204 No Content"),
            raw_response(b"304 Not Modified", b"transfer-encoding: chunked"),
            raw_response(b"100 Continue") + raw_response(b"204 No Content"),
        ],
        ids=["204", "304-chunked", "100-then-204"],
    )
    async def test_an_answer_without_a_body_by_its_status_ends_at_its_head(
        self, answer: bytes
    ) -> None:
        """A 204 or 304 has no body whatever its head says: before, the client read one
        until the kept-alive connection closed, and each request failed as a timeout."""
        async with scripted(lambda i: answer, lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=2, timeout=3))
        status = answer.rsplit(b"HTTP/1.1 ", 1)[1][:3].decode()
        assert [r.error for r in result.records] == [f"http_{status}"] * 2
        assert all(r.e2e < 2 for r in result.records)
        assert result.connects == 1

    async def test_an_error_answer_that_ends_with_its_connection_is_read_to_that_end(
        self,
    ) -> None:
        """Before, its body was not read: the next request went on the closed connection,
        was sent again and counted as the server closing, alternately."""
        answer = raw_response(b"503 Service Unavailable", body=b"try later, no length")
        async with scripted(lambda i: answer, lambda i: True) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=4))
        assert [r.error for r in result.records] == ["http_503"] * 4
        assert result.records[0].detail == (
            "the server answered 503 Service Unavailable: 'try later, no length'"
        )
        assert (result.connects, result.server_closes) == (4, 4)

    @pytest.mark.parametrize(
        ("body", "said"),
        [
            (
                b'{"error":{"message":"boom","type":"server_error"}}',
                "500 Internal Server Error: 'boom'",
            ),
            (b'{"detail":"Not Found"}', "500 Internal Server Error: 'Not Found'"),
            (b"\x1b[2Jplain", "500 Internal Server Error: '\\x1b[2Jplain'"),
        ],
        ids=["openai", "fastapi", "text-with-an-escape"],
    )
    async def test_an_error_answer_says_what_the_server_said(self, body: bytes, said: str) -> None:
        answer = raw_response(
            b"500 Internal Server Error", b"content-length: %d" % len(body), body=body
        )
        async with scripted(lambda i: answer, lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=1))
        (record,) = result.records
        assert (record.error, record.detail) == ("http_500", f"the server answered {said}")

    async def test_a_chunk_or_event_past_the_bound_fails_as_too_large_at_once(self) -> None:
        """Before, a chunk announced as 256 MiB was waited for whole (its bytes kept, until
        the timeout), and an event line without end was kept however long it grew."""
        endless_line = sse_response(chunked(b"data: " + b"x" * (MAX_EVENT + 10)))
        huge_chunk = sse_response(b"10000000\r\n" + b"y" * (MAX_EVENT + 10))
        answers = [endless_line, huge_chunk]
        async with scripted(lambda i: answers[i], lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=2, timeout=5))
        assert [r.error for r in result.records] == ["too_large"] * 2
        assert all(
            f"an event longer than {MAX_EVENT} bytes" in (r.detail or "") for r in result.records
        )
        assert result.connects == 2

    async def test_a_stream_with_far_more_text_than_asked_for_fails_as_too_long(self) -> None:
        """Before, every chunk's gap was kept: a stream that never ends grew the record
        until the timeout (hundreds of MB a minute)."""
        text = b'data: {"choices":[{"text":"a"}]}\n\n'
        limit = CHUNKS_PER_TOKEN * 2 + 64
        answers = [text * limit + b"data: [DONE]\n\n", text * (limit + 1) + b"data: [DONE]\n\n"]
        async with scripted(lambda i: sse_response(chunked(answers[i])), lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=2, max_tokens=2))
        assert [r.error for r in result.records] == [None, "too_long"]
        assert len(result.records[0].itl) == limit - 1
        assert result.records[1].detail == f"more than {limit} chunks of text for max_tokens 2"

    @pytest.mark.parametrize(
        ("events", "said"),
        [
            (OK_EVENTS + b'data: {"choices":[{"text":"more"}]}\n\n', "an event after [DONE]"),
            (
                b'data: {"choices":[],"usage":{"completion_tokens":-5}}\n\ndata: [DONE]\n\n',
                "an event that is not a completion chunk (Expected `int` >= 0",
            ),
            (
                b'data: {"choices":[],"usage":{"completion_tokens":"7"}}\n\ndata: [DONE]\n\n',
                "an event that is not a completion chunk (Expected `int`, got `str`",
            ),
        ],
        ids=["data-after-done", "negative-usage", "usage-a-string"],
    )
    async def test_events_a_stream_must_not_carry_fail_it_as_bad_event(
        self, events: bytes, said: str
    ) -> None:
        """Before, text after [DONE] was counted in the request's figures, and a negative
        token count was taken into the throughput."""
        async with scripted(lambda i: sse_response(chunked(events)), lambda i: False) as url:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=1))
        (record,) = result.records
        assert record.error == "bad_event"
        assert record.detail is not None
        assert said in record.detail


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def load_process(*arguments: str, **popen: Any) -> subprocess.Popen[bytes]:
    """``python -m actors load`` with ``arguments``, in a process of its own."""
    command = [sys.executable, "-m", "actors", "load", *arguments]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TOKENYARD_API_KEY", None)
    return subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, preexec_fn=stop_signals_by_default, **popen
    )


class TestTheCommandAgainstAServerThatMisbehaves:
    async def test_a_stalled_answer_fails_at_the_timeout_given(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Before, there was no --timeout: a stalled answer held its client 60 s."""
        answer = raw_response(b"200 OK", b"transfer-encoding: chunked")  # and nothing more
        async with scripted(lambda i: answer, lambda i: False) as url:
            argv = ["--url", url, "--requests", "1", "--concurrency", "1", "--timeout", "0.5"]
            assert await asyncio.to_thread(main, argv) == 1
        out, err = capsys.readouterr()
        assert msgspec.json.decode(out)["errors"] == {"timeout": 1}
        (line,) = err.splitlines()
        assert line.startswith("python -m actors load: 1 request failed as timeout; the first, ")
        assert line.endswith(
            ": the answer did not end within --timeout 0.5 s (0 bytes of its body came)"
        )

    async def test_each_kind_of_failure_is_one_line_naming_the_first_request(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Before, the summary counted the kinds and nothing said what the server did."""
        refused = raw_response(b"401 Unauthorized", b"content-length: 4", body=b"\x1b[2J")
        answers = [refused, b"SSH-2.0-OpenSSH_8.9\r\n\r\n", refused]
        async with scripted(lambda i: answers[i % 3], lambda i: False) as url:
            argv = ["--url", url, "--requests", "3", "--concurrency", "1"]
            assert await asyncio.to_thread(main, argv) == 1
        out, err = capsys.readouterr()
        assert msgspec.json.decode(out)["errors"] == {"http_401": 2, "bad_response": 1}
        first, second = err.splitlines()
        prog = "python -m actors load: "
        assert first.startswith(
            prog + "2 requests failed as http_401; the first, request 0 (sent at "
        )
        assert first.endswith("): the server answered 401 Unauthorized: '\\x1b[2J'")
        assert second.startswith(prog + "1 request failed as bad_response; the first, request 1 (")
        assert second.endswith(
            "): an answer that is not HTTP/1.x: 'SSH-2.0-OpenSSH_8.9\\r\\n\\r\\n'"
        )

    @pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
    async def test_a_stop_signal_prints_what_ended_and_exits_128_plus_it(
        self, signum: signal.Signals
    ) -> None:
        """Before, SIGINT was a KeyboardInterrupt traceback and SIGTERM killed the process
        without a word, the measurements lost either way."""
        stalled = raw_response(b"200 OK", b"transfer-encoding: chunked")
        waiting = asyncio.Event()

        def answer(i: int) -> bytes:
            if i < 2:
                return sse_response(chunked(OK_EVENTS))
            waiting.set()
            return stalled

        async with scripted(answer, lambda i: False) as url:
            proc = load_process(
                "--url", url, "--requests", "5", "--concurrency", "1", stdout=subprocess.PIPE
            )
            try:
                await waiting.wait()  # the third request waits on its answer
                proc.send_signal(signum)
                out, err = await asyncio.to_thread(proc.communicate, timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 128 + signum
        summary = msgspec.json.decode(out)
        assert (summary["requests"], summary["ok"]) == (2, 2)
        assert err.decode().splitlines() == [
            f"python -m actors load: {signum.name}: stopped, 1 request in flight left out"
        ]

    def test_main_called_from_a_program_leaves_its_signal_handlers_as_they_were(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Before, a program's own SIGTERM handler was SIG_DFL once ``main`` returned (so
        the next SIGTERM killed it without a word), and its SIGINT one Python's."""

        def mine(signum: int, frame: object) -> None:
            """The program's own."""

        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for s in saved:
                signal.signal(s, mine)
            assert main(["--url", refused_url(), "--requests", "1"]) == 1
            assert [signal.getsignal(s) for s in saved] == [mine, mine]
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
        capsys.readouterr()

    def test_a_closed_stdout_is_one_line_and_status_1(self) -> None:
        """Before, a BrokenPipeError traceback (and AttributeError for a stdout closed at
        start)."""
        proc = load_process("--url", refused_url(), "--requests", "1", stdout=subprocess.PIPE)
        try:
            assert proc.stdout is not None
            proc.stdout.close()  # the reader is gone before the summary
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 1
        assert err.decode().splitlines() == [
            "python -m actors load: the summary was not printed: [Errno 32] Broken pipe",
            "python -m actors load: 1 request failed as refused; the first, request 0 (sent at "
            + err.decode().split("(sent at ", 1)[1].split("\n")[0],
        ]

    @pytest.mark.skipif(
        resource.getrlimit(resource.RLIMIT_NOFILE)[1] == resource.RLIM_INFINITY,
        reason="needs a hard open-file limit",
    )
    def test_more_clients_than_the_open_file_limit_allows_are_refused_before_the_run(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Before, the clients past the limit failed to connect (EMFILE) and were counted as
        refused by the server. Clients beyond the requests are not run, so they count for
        nothing."""
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        url = refused_url()
        argv = ["--url", url, "--duration", "0.2", "--concurrency", str(hard)]
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line == (
            f"python -m actors load: --concurrency {hard}: each client holds a connection, and "
            f"the open-file limit (RLIMIT_NOFILE) is {hard}: give at most {hard - 16}, or raise "
            f"the limit (ulimit -n {hard + 16})"
        )
        assert main(["--url", url, "--requests", "1", "--concurrency", str(hard)]) == 1

    async def test_an_ipv6_server_gets_its_address_in_brackets_in_the_host_header(self) -> None:
        """Before, ``host: ::1:PORT``, which a server may refuse."""
        heads: list[bytes] = []
        try:
            server = scripted(
                lambda i: sse_response(chunked(OK_EVENTS)), lambda i: False, heads, "::1"
            )
            url = await server.__aenter__()
        except OSError:
            pytest.skip("no IPv6 loopback")
        try:
            result = await run_load(LoadSpec(url=url, concurrency=1, requests=1))
        finally:
            await server.__aexit__(None, None, None)
        assert result.records[0].ok
        port = url.rsplit(":", 1)[1]
        assert f"\r\nhost: [::1]:{port}\r\n".encode() in heads[0]
