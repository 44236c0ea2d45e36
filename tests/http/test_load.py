"""actors.http.load: the load generator against the real app, and against small
scripted servers that refuse, close, reset and fail streams the ways real servers do."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
from typing import TYPE_CHECKING

import msgspec
import pytest

from actors.__main__ import main as actors_main
from actors.http import ApiKey, ServeConfig
from actors.http.load import LoadResult, LoadSpec, main, run_load, summarize

from ._server import running_serve, serve_pipeline

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

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
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
        (line,) = err.splitlines()
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
        --max-tokens 0 or an empty --prompt ran the whole load, every request a 400."""
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
