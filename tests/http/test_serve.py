"""``python -m actors serve`` for real: every worker process serves HTTP on one port.

The official ``openai`` client and a raw HTTP load against a real server on 127.0.0.1: the
API, the balance over workers, a worker SIGKILLed under a streaming load with new
connections arriving throughout, a detokenizer killed under load, bad requests, shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import anyio.lowlevel
import msgspec
import openai
import pytest
from openai import AsyncOpenAI

from actors import InvalidRequestError
from actors.http import ApiKey, ServeConfig, open_server
from actors.http._auth import API_KEY_ENV
from actors.http._serve import _access_config, _config, _engine_options, _parser
from actors.http._serve import main as serve_main
from actors.http.load import LoadResult, LoadSpec, run_load
from actors.messages import GetWorkerStatistics
from tests.conftest import free_port, is_fork_server, process_title, stop_signals_by_default
from tests.http._server import Running, running_serve, sse_events
from tests.http.test_bounded import ask_large_answer, connect, open_until, read_answer
from tests.http.test_dispatch import HEALTH, until, worker_pid

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from anyio.abc import ByteReceiveStream, TaskGroup

    from actors.http import Server

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("Tell me about the harbour of Yokohama.", "你好, 世界", "Bonjour à tous 😀")
KEY = "tk-serve-5e8c2a9f0d"
APP = "https://app.example.com"
ENV_KEY = "tk-the-environments"


def balance(counts: Counter[int], workers: int) -> float:
    """Busiest over idlest (inf when a worker served nothing)."""
    values = [counts.get(k, 0) for k in range(workers)]
    return max(values) / min(values) if min(values) else float("inf")


class TestTheApi:
    async def test_the_openai_client_gets_completions_and_chats_streamed_or_not(self) -> None:
        async with open_server(workers=2, port=0) as server:
            client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            try:
                whole = await client.completions.create(
                    model=server.pipeline.config.tokenizer or "tokenyard-bundled-bpe",
                    prompt="Hello there",
                    max_tokens=12,
                    seed=7,
                    temperature=0.5,
                )
                streamed = await client.completions.create(
                    model="tokenyard-bundled-bpe",
                    prompt="Hello there",
                    max_tokens=12,
                    seed=7,
                    temperature=0.5,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                pieces: list[str] = []
                usage = None
                async for chunk in streamed:
                    pieces.extend(c.text for c in chunk.choices)
                    usage = chunk.usage or usage
                assert "".join(pieces) == whole.choices[0].text
                assert usage is not None
                assert whole.usage is not None
                assert usage.completion_tokens == whole.usage.completion_tokens
                chat = await client.chat.completions.create(
                    model="tokenyard-bundled-bpe",
                    messages=[{"role": "user", "content": "Hi!"}],
                    max_tokens=8,
                )
                assert chat.choices[0].message.content
                assert chat.choices[0].finish_reason in ("stop", "length")
                stream = await client.chat.completions.create(
                    model="tokenyard-bundled-bpe",
                    messages=[{"role": "user", "content": "Hi!"}],
                    max_tokens=8,
                    stream=True,
                )
                text = "".join([c.choices[0].delta.content or "" async for c in stream])
                assert text == chat.choices[0].message.content
            finally:
                await client.close()

    async def test_bad_requests_are_4xx_and_the_workers_keep_serving(self) -> None:
        async with open_server(workers=2, port=0) as server, aiohttp.ClientSession() as s:
            url = f"{server.url}/v1/completions"
            bad: list[tuple[bytes, int]] = [
                (b"{not json", 400),
                (b'{"prompt": 5, "max_tokens": 4}', 400),
                (b'{"prompt": "x", "max_tokens": -1}', 400),
                (b'{"prompt": "", "max_tokens": 4}', 400),
                (b'{"prompt": "x", "model": "nope"}', 404),
                (b'{"prompt": "x", "n": 3}', 400),
            ]
            for body, status in bad * 3:  # every worker sees some
                async with s.post(
                    url, data=body, headers={"content-type": "application/json"}
                ) as r:
                    assert r.status == status, await r.text()
                    assert "error" in await r.json()
            async with s.post(url, json={"prompt": "still fine", "max_tokens": 4}) as r:
                assert r.status == 200
            stats = server.statistics()
            assert set(stats.open) == {0, 1}  # both workers still registered

    async def test_an_http_request_is_held_to_serve_config_s_limits_alone(self) -> None:
        # The pipeline's own limits are far tighter: they hold `Pipeline` callers, not
        # HTTP requests, which the HTTP layer checks once against ServeConfig.
        config = ServeConfig(max_prompt_tokens=30, max_tokens_limit=16, default_max_tokens=8)
        async with (
            open_server(
                workers=1, port=0, config=config, max_prompt_tokens=4, max_new_tokens=2
            ) as server,
            aiohttp.ClientSession() as s,
        ):
            url = f"{server.url}/v1/completions"
            prompt = list(range(10, 30))  # 20 tokens
            async with s.post(
                url, json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
            ) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 8
            over = [
                ({"prompt": list(range(10, 41)), "max_tokens": 1}, "ServeConfig.max_prompt_tokens"),
                ({"prompt": prompt, "max_tokens": 17}, "ServeConfig.max_tokens_limit"),
            ]
            for body, setting in over:
                async with s.post(url, json=body) as r:
                    assert r.status == 400
                    assert setting in (await r.json())["error"]["message"]
            with pytest.raises(InvalidRequestError, match=r"PipelineConfig\.max_prompt_tokens"):
                await server.pipeline.generate(prompt, max_new_tokens=1)


class TestConnections:
    async def test_no_client_is_answered_before_the_server_is_ready(self, tmp_path: Path) -> None:
        """A client that connects while the server starts is answered once `open_server`
        has yielded, its credentials written. Before, the first worker up answered while
        the others still started, and before the credentials were (a readiness probe on
        /health, then a read of the credentials, failed)."""
        port = free_port()
        credentials = tmp_path / "credentials.json"
        ready, answered = anyio.Event(), anyio.Event()
        seen: list[tuple[int, bool, bool]] = []

        async def client() -> None:
            for _ in range(3000):  # until the listener is bound: a port, polled
                with contextlib.suppress(ConnectionRefusedError):
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    break
                await anyio.sleep(0.01)  # sync-ok: polling for the port to be bound
            else:
                pytest.fail("the server never bound its port")
            writer.write(HEALTH)
            status, _, _ = await read_answer(reader)
            seen.append((status, ready.is_set(), credentials.exists()))
            answered.set()
            writer.close()

        with anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client)
                async with open_server(workers=2, port=port, credentials=credentials):
                    ready.set()  # no await since the port opened: the answer comes after
                    await answered.wait()
        assert seen == [(200, True, True)]
        assert not credentials.exists()

    async def test_new_connections_are_balanced_over_the_workers(self) -> None:
        async with open_server(workers=2, port=0, step_time=0.002) as server:
            spec = LoadSpec(
                url=server.url, concurrency=8, requests=200, max_tokens=8, keepalive=False
            )
            result = await run_load(spec)
            assert all(r.ok for r in result.records), Counter(r.error for r in result.records)
            served = Counter(r.worker for r in result.records if r.worker is not None)
            assert sum(served.values()) == 200
            assert balance(served, 2) <= 1.25, served

    async def test_a_worker_killed_under_load_loses_no_waiting_connection(self) -> None:
        async with open_server(workers=2, port=0, step_time=0.003) as server:
            keep = LoadSpec(url=server.url, concurrency=8, duration=6.0, max_tokens=24)
            fresh = LoadSpec(
                url=server.url, concurrency=4, duration=6.0, max_tokens=8, keepalive=False
            )
            results: list[LoadResult] = []

            async def load(spec: LoadSpec) -> None:
                results.append(await run_load(spec))

            async with anyio.create_task_group() as tg:
                tg.start_soon(load, keep)
                tg.start_soon(load, fresh)
                await anyio.sleep(2.0)  # sync-ok: the kill lands mid-load, not at its start
                killed = server.pipeline.kill_worker(1)
                back = await server.pipeline.wait_worker(1, after=killed.incarnation)
            records = [r for result in results for r in result.records]
            errors = Counter(r.error for r in records if r.error is not None)
            assert "refused" not in errors  # the port never closed
            # Every failure was on a connection the killed worker had taken.
            on_killed = {
                port
                for port, origin in server.dispatcher.recent
                if origin.worker == 1 and origin.incarnation == killed.incarnation
            }
            failed = [r for r in records if not r.ok]
            assert all(r.local_port in on_killed for r in failed), (errors, len(failed))
            assert sum(r.ok for r in records) > 100
            # The restarted worker serves on the same port again.
            assert back.incarnation == killed.incarnation + 1
            after = await run_load(
                LoadSpec(url=server.url, concurrency=4, requests=40, max_tokens=4, keepalive=False)
            )
            assert all(r.ok for r in after.records)
            assert 1 in {r.worker for r in after.records}

    async def test_a_killed_detokenizer_fails_only_its_own_streams(self) -> None:
        async with open_server(workers=2, port=0, detokenizers=2, step_time=0.003) as server:
            victim = await server.pipeline.system.lookup("detokenizer:1")
            pid = server.pipeline.system.pid_of(victim)
            assert pid is not None
            spec = LoadSpec(url=server.url, concurrency=12, duration=4.0, max_tokens=24)
            async with anyio.create_task_group() as tg:
                results: list[LoadResult] = []

                async def load() -> None:
                    results.append(await run_load(spec))

                tg.start_soon(load)
                await anyio.sleep(1.5)  # sync-ok: the kill lands mid-load
                os.kill(pid, signal.SIGKILL)
            records = results[0].records
            ok = sum(r.ok for r in records)
            failed = [r for r in records if not r.ok]
            # Its requests that had output ended with an error event; the rest (on the
            # other detokenizer, or resubmitted) streamed to the end; none hung.
            assert all(r.error in ("stream_error",) for r in failed), Counter(
                r.error for r in failed
            )
            assert ok > 3 * len(failed)
            with anyio.fail_after(30):
                lookup = server.pipeline.system.lookup
                while (back := await lookup("detokenizer:1", missing_ok=True)) in (None, victim):
                    await anyio.lowlevel.checkpoint()
            assert back is not None
            assert back.incarnation == victim.incarnation + 1


class TestDraining:
    async def test_a_second_drain_that_ends_a_request_makes_both_say_not_clean(self) -> None:
        with anyio.fail_after(30):
            async with _one_long_stream() as (server, tg, r):
                first = _start_drain(tg, server)
                # The first drain (30 s) waits for the connections to close.
                while server.dispatcher._idle is None:
                    await anyio.lowlevel.checkpoint()
                second = await server.drain(0.0)  # a second Ctrl-C
                events = sse_events(await r.content.read())
        # The stream was ended by the second drain: neither drain may call it clean
        # (before, the first, woken only by the connection closing, returned True, and
        # `serve` exited 0 after a second SIGTERM had cut requests).
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "service_unavailable"
        assert first == [False]
        assert second is False

    async def test_a_stream_a_second_drain_ends_is_told_so_not_blamed_on_the_timeout(
        self,
    ) -> None:
        with anyio.fail_after(30):
            async with _one_long_stream() as (server, tg, r):
                _start_drain(tg, server)
                while server.dispatcher._idle is None:
                    await anyio.lowlevel.checkpoint()
                await server.drain(0.0)  # a second Ctrl-C
                events = sse_events(await r.content.read())
        # Before, the error named the drain timeout and its flag, which had 30 s to go:
        # a client (or an operator reading the log) was sent to the wrong knob.
        message = events[-2]["error"]["message"]
        assert "drain_timeout" not in message, message
        assert "cut short" in message, message

    async def test_a_drain_whose_loop_wakes_after_the_cut_says_not_clean(self) -> None:
        # The process that owns the port gets no CPU from before its drain's deadline until
        # the worker has ended the stream and closed it (a loaded machine): when its loop
        # turns again, the connection's close and the deadline are due in the same turn,
        # the close first. Before, the wait for the connections then ended with no
        # cancellation to catch and the drain said clean: `serve` exited 0 having cut
        # requests.
        with anyio.fail_after(30):
            async with _one_long_stream() as (server, tg, r):
                drained = _start_drain(tg, server, 0.2)
                while server.dispatcher._idle is None:  # told the worker; waiting
                    await anyio.lowlevel.checkpoint()
                # The loop stalls until the worker's mark that the connection closed
                # is there to read (it ends the stream at its own deadline, after
                # this process's).
                channel = server.dispatcher._channels[0].sock
                assert select.select([channel], [], [], 20)[0]
                events = sse_events(await r.content.read())
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "service_unavailable"
        assert drained == [False]

    async def test_a_connection_with_no_request_yet_is_served_one_through_a_drain(self) -> None:
        # A client connected just before the drain sends its request just after it began:
        # it is answered, then closed. Before, the drain closed the connection at once, and
        # the request met a closed connection (a reset, when its bytes had arrived unread).
        async with open_server(workers=1, port=0) as server:
            reader, writer = await connect(server)
            try:
                await open_until(server, 1, 10)
                async with anyio.create_task_group() as tg:
                    drained = _start_drain(tg, server, 30.0)
                    while server.dispatcher._idle is None:  # told the worker; waiting
                        await anyio.lowlevel.checkpoint()
                    writer.write(HEALTH)
                    with anyio.fail_after(10):
                        status, headers, _ = await read_answer(reader)
                        assert await reader.read() == b""
                assert (status, headers.get("connection")) == (200, "close")
            finally:
                writer.close()
        assert drained == [True]

    async def test_a_worker_restarted_during_a_drain_drains_what_it_is_handed(self) -> None:
        # A connection the worker never took (stopped, then killed, during the drain) goes
        # to its successor, which must drain too: answer its request, then close it. Before,
        # nobody told the successor, which kept the connection open for more requests, and
        # the drain waited for it until its deadline.
        # Idle connections stay open for a minute: only the drain closes this one.
        async with open_server(workers=1, port=0, config=ServeConfig(idle_timeout=60)) as server:
            before = server.pipeline.worker_ref(0)
            assert before is not None
            pid = worker_pid(server, 0)
            os.kill(pid, signal.SIGSTOP)
            handed = server.statistics().handed.get(0, 0)
            reader, writer = await connect(server)
            try:
                writer.write(HEALTH)
                await until(lambda: server.statistics().handed.get(0, 0) > handed)
                async with anyio.create_task_group() as tg:
                    drained = _start_drain(tg, server, 60.0)
                    while server._cut_at is None:
                        await anyio.lowlevel.checkpoint()
                    os.kill(pid, signal.SIGKILL)  # the drain goes on with its successor
                    with anyio.fail_after(20):
                        status, _, _ = await read_answer(reader)
                        assert status == 200
                        assert await reader.read() == b""  # closed after the one request
                        after = await server.pipeline.wait_worker(0, after=before.incarnation)
                    assert after.incarnation == before.incarnation + 1
            finally:
                writer.close()
        assert drained == [True]

    async def test_a_worker_that_dies_with_a_stream_during_a_drain_makes_it_not_clean(
        self,
    ) -> None:
        # The worker serving a stream is killed while the drain waits for it: the stream
        # ends without [DONE], its connection closes, and nothing else is open. Before, the
        # drain then found every connection closed in time and said clean: `serve` exited
        # 0, as if every request had finished.
        with anyio.fail_after(30):
            async with _one_long_stream() as (server, tg, r):
                drained = _start_drain(tg, server, 30.0)
                while server.dispatcher._idle is None:  # told the worker; waiting
                    await anyio.lowlevel.checkpoint()
                server.pipeline.kill_worker(0)
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.content.read()
        assert drained == [False]

    async def test_a_drain_that_ends_no_request_is_clean_though_a_connection_stays_open(
        self,
    ) -> None:
        # A client that reads nothing of a large answer keeps its connection open past a
        # drain(0)'s deadline (until send_timeout), yet no request was ended: only a
        # request ended by the drain makes it unclean (before, an open connection did, and
        # `serve --drain-timeout 0` exited 1 as if it had cut requests).
        async with open_server(workers=1, port=0) as server:
            sock = await ask_large_answer(server)
            try:
                await open_until(server, 1, 10)
                started = time.monotonic()
                with anyio.fail_after(30):
                    assert await server.drain(0.0) is True
                # It was open past the deadline: the worker closed it only at its cut's grace.
                assert time.monotonic() - started >= 1.0
                ref = server.pipeline.worker_ref(0)
                assert ref is not None
                assert (await ref.ask(GetWorkerStatistics())).cut == 0
            finally:
                sock.close()


class TestAccess:
    async def test_every_worker_asks_for_the_key_echoes_ids_and_tells_one_start_time(
        self,
    ) -> None:
        config = ServeConfig(api_key=ApiKey(KEY), cors_origins=(APP,))
        before = int(time.time())
        auth = {"authorization": f"Bearer {KEY}", "origin": APP}
        async with (
            open_server(workers=2, port=0, config=config) as server,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
        ):
            started = server.dispatcher.created
            assert before <= started <= time.time()

            async def created_by_each_worker(n: int) -> dict[int, int]:
                """Ask on new connections until both workers answered ``n`` times each."""
                answers: dict[int, list[int]] = {0: [], 1: []}
                with anyio.fail_after(30):
                    while min(map(len, answers.values())) < n:
                        rid = f"serve-{len(answers[0])}-{len(answers[1])}"
                        headers = {**auth, "x-request-id": rid}
                        async with s.get(f"{server.url}/v1/models", headers=headers) as r:
                            assert r.status == 200
                            assert r.headers["x-request-id"] == rid
                            assert r.headers["access-control-allow-origin"] == APP
                            worker = int(r.headers["x-tokenyard-worker"])
                            answers[worker].append((await r.json())["data"][0]["created"])
                        async with s.get(f"{server.url}/v1/models") as r:
                            assert r.status == 401
                        preflight = {"origin": APP, "access-control-request-method": "POST"}
                        async with s.options(
                            f"{server.url}/v1/completions", headers=preflight
                        ) as r:
                            assert r.status == 204
                return {k: v for k, values in answers.items() for v in values}

            assert set((await created_by_each_worker(2)).values()) == {started}
            # A restarted worker tells the same time.
            killed = server.pipeline.kill_worker(1)
            await server.pipeline.wait_worker(1, after=killed.incarnation)
            assert set((await created_by_each_worker(2)).values()) == {started}
            async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY) as client:
                done = await client.completions.create(
                    model="tokenyard-bundled-bpe", prompt="Hi", max_tokens=4
                )
                assert done.choices[0].text
            async with AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key=KEY[:-1], max_retries=0
            ) as client:
                with pytest.raises(openai.AuthenticationError):
                    await client.models.list()


class TestTheAccessFlags:
    def config(self, *argv: str) -> ServeConfig:
        return ServeConfig(**_access_config(_parser().parse_args(list(argv))))

    def test_none_given_asks_for_no_key_and_keeps_cors_off(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        config = self.config()
        assert (config.api_key, config.cors_origins, config.max_request_id_length) == (
            None,
            (),
            128,
        )

    def test_each_flag_sets_its_setting(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(API_KEY_ENV, "from-the-environment")
        config = self.config(
            "--api-key",
            KEY,
            "--cors-origin",
            APP,
            "--cors-origin",
            "http://localhost:3000",
            "--max-request-id-length",
            "64",
        )
        assert config.api_key == ApiKey(KEY)  # the flag wins
        assert config.cors_origins == (APP, "http://localhost:3000")
        assert config.max_request_id_length == 64

    def test_the_key_comes_from_the_environment_without_the_flag(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(API_KEY_ENV, KEY)
        assert self.config().api_key == ApiKey(KEY)

    @pytest.mark.parametrize(
        ("argv", "env", "message"),
        [
            ([], "", f"{API_KEY_ENV} is set but empty"),
            (["--api-key", ""], None, "the API key is empty"),
            (["--api-key", "two words"], None, "visible ASCII"),
            (["--cors-origin", f"{APP}/"], None, "is not an origin"),
            (["--max-request-id-length", "0"], None, "max_request_id_length=0"),
            (["--step-time", "nan"], None, "--step-time: step_time must be a finite number"),
            (["--step-time", "inf"], None, "--step-time: step_time must be a finite number"),
            (["--step-time", "-1"], None, "--step-time: step_time must be a finite number"),
            (["--port", "70000"], None, "--port 70000: a TCP port is 0"),
            (["--port", "-1"], None, "--port -1: a TCP port is 0"),
            (["--engine-start-tries", "0"], None, "--engine-start-tries must be at least 1"),
            (["--max-restarts", "-1"], None, "--max-restarts -1: it must be at least 0"),
            (["--restart-period", "0"], None, "--restart-period 0: it must be a number of"),
            (["--restart-period", "nan"], None, "--restart-period nan: it must be a number of"),
            (["--max-body-bytes", str(1 << 64)], None, "max_body_bytes=18446744073709551616"),
            (["--max-waiting", str(1 << 63)], None, "at most 9223372036854775807"),
            (["--max-prompt-tokens", "8192"], None, "leaves no room to generate"),
            (["--credentials", "/"], None, "--credentials /: a directory"),
            (["--credentials", "/no/such/dir/c.json"], None, "no directory /no/such/dir"),
        ],
    )
    def test_a_refused_setting_stops_the_command_before_it_starts_anything(
        self,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
        argv: list[str],
        env: str | None,
        message: str,
    ) -> None:
        if env is None:
            monkeypatch.delenv(API_KEY_ENV, raising=False)
        else:
            monkeypatch.setenv(API_KEY_ENV, env)
        assert serve_main(argv) == 2
        assert message in capsys.readouterr().err

    @pytest.mark.parametrize(
        ("content", "argv", "message"),
        [
            (b"PK\x03\x04 a zip", [], "is not a GGUF file"),
            (b"", [], "is not a GGUF file"),
            (b"GGUF", ["--engine-context", "1"], "--engine-context must be at least 2"),
            (b"GGUF", ["--engine-threads", "100000"], "more than the"),
        ],
    )
    def test_a_refused_llama_cpp_setting_stops_the_command_before_it_starts_anything(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        content: bytes,
        argv: list[str],
        message: str,
    ) -> None:
        model = tmp_path / "model.gguf"
        model.write_bytes(content)
        command = ["--engine", "llamacpp", "--model", str(model), *argv]
        assert serve_main(command) == 2
        err = capsys.readouterr().err
        assert message in err
        assert len(err.splitlines()) == 1


class TestTheVllmArguments:
    @pytest.mark.parametrize(
        ("vllm_args", "message"),
        [
            (["--headless"], "serve sets --headless itself"),
            (["--data-parallel-address", "10.0.0.1"], "sets --data-parallel-address"),
            (["--data_parallel_rpc_port=1234"], "sets --data-parallel-rpc-port"),
            (["-dp", "2"], "sets --data-parallel-size"),
            (["--data-parallel-size=2"], "sets --data-parallel-size"),
            (["--api_server_count", "2"], "sets --api-server-count"),
            (["--skip-tokenizer-init"], "sets --skip-tokenizer-init"),
            (["--max-model-len", "lots"], "not a length vLLM takes"),
            (["--max_model_len=1.5K"], "not a length vLLM takes"),
        ],
    )
    def test_a_vllm_argument_serve_cannot_launch_with_stops_the_command_in_one_line(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        vllm_args: list[str],
        message: str,
    ) -> None:
        (tmp_path / "config.json").write_text("{}")
        command = ["--engine", "vllm", "--model", str(tmp_path), "--vllm-python", sys.executable]
        assert serve_main([*command, "--", "--dtype", "bfloat16", *vllm_args]) == 2
        err = capsys.readouterr().err
        assert message in err
        assert len(err.splitlines()) == 1

    def test_the_largest_frame_taken_from_the_engine_is_a_flag(self) -> None:
        args = _parser().parse_args(
            ["--engine", "vllm", "--engine-handshake", "tcp://h:1", "--vllm-max-frame", "65536"]
        )
        args.vllm_args = []  # what follows -- (none), as `main` splits it off
        assert _engine_options(args)["engine"].max_frame == 65536
        assert "--vllm-max-frame BYTES" in _parser().format_help()

    def test_a_largest_frame_out_of_its_bounds_stops_the_command_in_one_line(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        command = ["--engine", "vllm", "--engine-handshake", "tcp://h:1", "--vllm-max-frame"]
        assert serve_main([*command, "1000"]) == 2
        err = capsys.readouterr().err
        assert "bad --vllm-max-frame: Vllm.max_frame=1000: give bytes within" in err
        assert len(err.splitlines()) == 1


class TestTheLimitFlags:
    def test_every_limit_of_serve_config_is_a_flag_with_its_default_in_the_help(self) -> None:
        help_text = " ".join(_parser().format_help().split())
        defaults = ServeConfig()
        # The access settings have flags of their own names (--api-key, --cors-origin).
        named = {"cors_origins": "--cors-origin"}
        for field in msgspec.structs.fields(ServeConfig):
            if field.name in ("model_id", "context_length"):
                continue
            flag = named.get(field.name, "--" + field.name.replace("_", "-"))
            assert flag in help_text, flag
            default = getattr(defaults, field.name)
            if isinstance(default, int | float) and not isinstance(default, bool):
                assert f"(default {default})" in help_text, flag

    def test_a_flag_sets_its_field_and_the_others_keep_their_defaults(self) -> None:
        args = _parser().parse_args(["--header-timeout", "2.5", "--max-waiting", "7"])
        config = _config(args)
        assert (config.header_timeout, config.max_waiting) == (2.5, 7)
        assert config.body_timeout == ServeConfig().body_timeout

    def test_a_refused_limit_stops_the_command_naming_it(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert serve_main(["--header-timeout", "0"]) == 2
        assert "ServeConfig.header_timeout=0.0: it must be positive" in capsys.readouterr().err

    @pytest.mark.parametrize(
        ("flag", "value", "text"),
        [
            # An infinite timeout is its bound switched off; 1e400 reads as infinity.
            ("--send-timeout", "1e400", "send_timeout=inf: it must be positive and finite"),
            ("--drain-timeout", "inf", "drain_timeout=inf: it must be at least 0 and finite"),
            ("--idle-timeout", "nan", "idle_timeout=nan: it must be positive and finite"),
        ],
    )
    def test_a_timeout_that_is_no_bound_is_refused(
        self, capsys: pytest.CaptureFixture[str], flag: str, value: str, text: str
    ) -> None:
        assert serve_main([flag, value]) == 2
        assert text in capsys.readouterr().err


def serve_command(
    *args: str,
    timeout: float = 60,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m actors serve ARGS`` run to its end, and checked to leave no process
    behind: every process it started carries a mark in its environment, and none with the
    mark is alive (or a zombie) once it has exited. ``env`` adds to its environment;
    ``preexec_fn`` runs in its process before it starts (a limit to set, say)."""
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), TOKENYARD_TEST_MARK=mark, COLUMNS="400", **(env or {})
    )
    done = subprocess.run(
        [sys.executable, "-m", "actors", "serve", *args],
        capture_output=True, text=True, timeout=timeout, check=False, env=env, cwd=ROOT,
        preexec_fn=preexec_fn,
    )  # fmt: skip
    left = _pids_with(f"TOKENYARD_TEST_MARK={mark}".encode())
    assert not left, f"serve {args} left processes behind: {left}"
    return done


def _pids_with(entry: bytes) -> list[int]:
    """Processes whose environment has ``entry``."""
    found: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone meanwhile, or another user's
            continue
        if entry in environ.split(b"\0"):
            found.append(int(proc.name))
    return found


#: A log line of any process of the system (runtime._logging).
LOG_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\[[^\]]+\] [\w.]+: .*"
)


class Lines:
    """The lines a process writes to one of its pipes, read as they come."""

    def __init__(self, stream: ByteReceiveStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.lines: list[str] = []

    async def until(self, needle: str) -> str:
        """Read up to the first line with ``needle`` (the end of the pipe fails)."""
        while True:
            for line in self.lines:
                if needle in line:
                    return line
            chunk = await self.stream.receive()
            *full, self.buffer = (self.buffer + chunk).split(b"\n")
            self.lines += [line.decode() for line in full]

    async def rest(self) -> list[str]:
        """Every line, once the pipe has ended."""
        with contextlib.suppress(anyio.EndOfStream):
            while True:
                self.buffer += await self.stream.receive()
        self.lines += [line.decode() for line in self.buffer.split(b"\n") if line]
        self.buffer = b""
        return self.lines


class TestTheCommand:
    async def test_every_process_logs_one_format_and_a_worker_reads_as_one(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        command = [sys.executable, "-m", "actors", "serve", "--workers", "2", "--port", "0"]
        async with await anyio.open_process([*command, "--log-level", "info"], env=env) as proc:
            assert proc.stdout is not None
            assert proc.stderr is not None
            out, err = Lines(proc.stdout), Lines(proc.stderr)
            try:
                with anyio.fail_after(60):
                    port = int((await out.until("serving http://")).split(":")[2].split()[0])
                    # uvicorn, in a worker process, refuses a request that is not HTTP.
                    async with await anyio.connect_tcp("127.0.0.1", port) as conn:
                        await conn.send(b"\x00 not http\r\n\r\n")
                        assert b"400 Bad Request" in await conn.receive()
                    await err.until("Invalid HTTP request received.")
                    (worker,) = [p for p in _children(proc.pid) if process_title(p).startswith(
                        "tokenyard::tokenizer_worker:0:"
                    )]  # fmt: skip
                    os.kill(worker, signal.SIGKILL)
                    await err.until("worker 0 (incarnation 2) registered")
            finally:
                proc.terminate()
            lines = await err.rest()
            assert await proc.wait() == 0  # a clean drain
        assert lines
        assert [line for line in lines if not LOG_LINE.fullmatch(line)] == []
        assert not [line for line in lines if "Origin(" in line]
        assert any("uvicorn.error: Invalid HTTP request received." in x for x in lines), lines
        died = [x for x in lines if "worker 0 (incarnation 1) died (killed by SIGKILL)" in x]
        assert len(died) == 1, lines
        assert "INFO [serve] tokenyard.pipeline: " in died[0]

    def test_a_busy_port_is_one_line_naming_it_and_the_fix_and_status_1(self) -> None:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            done = serve_command("--workers", "1", "--port", str(port))
        assert done.returncode == 1
        assert done.stdout == ""
        assert done.stderr.splitlines() == [
            f"cannot serve on 127.0.0.1:{port}: address already in use "
            "(another server? pick another --port)"
        ]

    def test_an_address_not_of_this_machine_is_one_line_and_status_1(self) -> None:
        done = serve_command("--workers", "1", "--host", "192.0.2.1", "--port", "0")
        assert done.returncode == 1
        assert done.stderr.splitlines() == [
            "cannot serve on 192.0.2.1:0: cannot assign requested address "
            "(is --host an address of this machine?)"
        ]

    @pytest.mark.parametrize("what", ["missing", "directory", "not-json"])
    def test_a_bad_tokenizer_is_one_line_and_status_2_before_any_process_starts(
        self, tmp_path: Path, what: str
    ) -> None:
        if what == "missing":
            path, expected = tmp_path / "nonexistent", f"{tmp_path / 'nonexistent'} does not exist"
        elif what == "directory":
            path, expected = tmp_path, f"{tmp_path / 'tokenizer.json'} does not exist"
        else:
            path = tmp_path / "tokenizer.json"
            path.write_text("not json", encoding="utf-8")
            expected = f"{path} is not a valid tokenizer.json"
        # A pipeline that started would bind this port: the check comes first.
        done = serve_command("--workers", "1", "--port", "0", "--tokenizer", str(path))
        assert done.returncode == 2
        assert done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"bad --tokenizer: {expected}"), line
        if what != "not-json":
            assert line.endswith("leave --tokenizer out for the bundled one)"), line

    def test_a_temporary_directory_too_long_for_ipc_sockets_is_one_line_and_status_1(
        self, tmp_path: Path
    ) -> None:
        # 120 bytes: no socket path under it fits in sockaddr_un's 107.
        long = tmp_path / ("d" * (120 - len(str(tmp_path)) - 1))
        long.mkdir()
        done = serve_command("--workers", "1", "--port", "0", env={"TMPDIR": str(long)})
        assert done.returncode == 1, done.stderr
        assert done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert line.startswith(
            f"the pipeline did not start: the temporary directory {str(long)!r} is too long "
            "for ipc sockets"
        ), line
        assert "set TMPDIR to a directory at least" in line, line
        assert list(long.iterdir()) == []  # its system's directory was removed

    @pytest.mark.parametrize("stdout", ["closed", "a-pipe-whose-reader-left"])
    def test_a_standard_output_it_cannot_write_to_does_not_stop_it_serving(
        self, stdout: str
    ) -> None:
        port = free_port()
        command = [sys.executable, "-m", "actors", "serve", "--workers", "1", "--port", str(port)]
        if stdout == "closed":  # `serve >&-`
            command = ["/bin/sh", "-c", 'exec "$@" >&-', "sh", *command]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        ) as proc:
            try:
                assert proc.stdout is not None
                proc.stdout.close()  # a reader that left at once (`serve | true`)
                # A connection made during the start waits in the listen backlog: it is
                # answered once the server serves, after its line on standard output.
                status = anyio.run(_health_once_listening, port, proc)
                assert status == 200
                if stdout == "closed":
                    # Its processes write their standard output nowhere, not into
                    # whatever took descriptor 1 after it was closed (a socket, say).
                    children = [p for p in _children(proc.pid) if not is_fork_server(p)]
                    assert children
                    outputs = {os.readlink(f"/proc/{pid}/fd/1") for pid in children}
                    assert outputs == {os.devnull}, outputs
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
        assert "Exception ignored" not in err, err

    def test_an_open_file_limit_too_low_for_its_processes_is_one_line_and_status_1(
        self,
    ) -> None:
        def limit_files() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

        done = serve_command("--workers", "2", "--port", "0", preexec_fn=limit_files)
        assert done.returncode == 1, done.stderr
        assert done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert re.fullmatch(
            r"the open-file limit \(RLIMIT_NOFILE\) is 64, and 2 workers and 1 detokenizer "
            r"need at least (\d+) in this process: raise it \(ulimit -n \1, or LimitNOFILE= "
            r"under systemd\), or serve fewer --workers or --detokenizers",
            line,
        ), line

    def test_a_standard_error_nobody_reads_does_not_wedge_serving_or_the_drain(self) -> None:
        port = free_port()
        command = [sys.executable, "-m", "actors", "serve", "--workers", "1", "--port", str(port)]
        reader, writer = os.pipe()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=writer, text=True, env=env, cwd=ROOT
        ) as proc:
            os.close(writer)
            try:
                assert proc.stdout is not None
                assert "serving http://" in proc.stdout.readline()
                # Fill the pipe (through a description of its own, so that the server's
                # stays blocking): from here, a line written to it waits for a reader.
                filler = os.open(f"/proc/self/fd/{reader}", os.O_WRONLY | os.O_NONBLOCK)
                with contextlib.suppress(BlockingIOError):
                    while True:
                        os.write(filler, b"x" * 4096)
                os.close(filler)
                statuses = anyio.run(_logged_then_served, port)
                assert statuses == (400, 200)
                proc.send_signal(signal.SIGTERM)  # it logs that it drains
                assert proc.wait(timeout=30) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                os.close(reader)

    def test_a_bad_log_level_is_a_bad_argument(self) -> None:
        done = serve_command("--log-level", "chatty")
        assert done.returncode == 2
        assert "argument --log-level: invalid choice: 'CHATTY'" in done.stderr
        assert "Traceback" not in done.stderr

    def test_its_help_says_what_step_time_0_means_and_what_to_pass_instead(self) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "actors", "serve", "--help"],
            capture_output=True, text=True, timeout=30, check=False,
            env=dict(os.environ, COLUMNS="400"),  # one line per option: no wrapped words
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        (line,) = [x for x in done.stdout.splitlines() if x.lstrip().startswith("--step-time")]
        assert "The default, 0, leaves no pause between steps" in line
        assert "a streaming client gets it in one chunk or a few" in line
        assert "--step-time 0.02 (20 ms a token) streams token by token" in line

    def test_sigterm_drains_the_streams_in_flight_then_exits_0_leaving_nothing(
        self, tmp_path: Path
    ) -> None:
        credentials = tmp_path / "credentials.json"
        options = ("--step-time", "0.01", "--credentials", str(credentials))
        with running_serve(*options, stderr=True) as run:
            body = asyncio.run(_complete(run.port))
            assert body["choices"][0]["text"]
            children = [pid for pid in _children(run.proc.pid) if not is_fork_server(pid)]
            assert len(children) == 5  # 2 workers, the scheduler, detokenizer and router
            assert credentials.exists()
            streams = asyncio.run(_streams_through_sigterm(run, count=12, max_tokens=80))
            _, err = run.proc.communicate(timeout=30)
            assert run.proc.returncode == 0
        assert "Traceback" not in err
        assert "draining" in err
        # Every stream in flight at the signal streamed to its end.
        assert all(events[-1] == "[DONE]" for events in streams.finished), streams.finished
        assert all("error" not in e for events in streams.finished for e in events[:-1])
        assert len(streams.finished) == 12
        # New connections were refused once the signal came.
        assert streams.refused_after
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), pid
        assert not credentials.exists()
        with socket.socket() as again, pytest.raises(ConnectionRefusedError):
            again.connect(("127.0.0.1", run.port))

    def test_a_signal_it_was_started_ignoring_stays_ignored_once_it_serves(self) -> None:
        # Before, under nohup (SIGHUP ignored), the hangup of the terminal it was started
        # from drained and stopped it once it served.
        def ignore_sighup() -> None:
            stop_signals_by_default()
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

        with running_serve(stderr=True, preexec_fn=ignore_sighup) as run:
            run.proc.send_signal(signal.SIGHUP)  # ignored: SIGTERM is the first it hears
            run.proc.send_signal(signal.SIGTERM)
            _, err = run.proc.communicate(timeout=30)
        assert run.proc.returncode == 0, err
        assert "SIGTERM: draining" in err, err
        assert "SIGHUP" not in err

    def test_past_max_restarts_within_the_period_it_gives_up_and_exits_1(self) -> None:
        with running_serve("--max-restarts", "0", "--restart-period", "60", stderr=True) as run:
            (worker,) = [
                p for p in _children(run.proc.pid) if "tokenizer_worker:0" in process_title(p)
            ]
            os.kill(worker, signal.SIGKILL)  # one restart more than --max-restarts 0 allows
            _, err = run.proc.communicate(timeout=60)
            assert run.proc.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert "the pipeline failed" in last, err
        assert "more than 0 restarts in 60 s" in last, err

    def test_requests_past_the_drain_timeout_end_with_an_error_event_and_done(self) -> None:
        options = ("--step-time", "0.01", "--drain-timeout", "0.5")
        with running_serve(*options, stderr=True) as run:
            streams = asyncio.run(_streams_through_sigterm(run, count=4, max_tokens=3000))
            _, err = run.proc.communicate(timeout=30)
            assert run.proc.returncode == 1, err  # not a clean drain: requests were ended
        assert "Traceback" not in err
        # Each worker says how many it ended: the 4 streams and the one without a stream.
        ended = re.findall(r"worker \d+ ended (\d+) request\(s\) still running", err)
        assert sum(map(int, ended)) == 5, err
        assert len(streams.finished) == 4
        for events in streams.finished:
            assert events[-1] == "[DONE]"
            error = events[-2]["error"]
            assert error["code"] == "service_unavailable"
            assert "drain_timeout" in error["message"]
        assert streams.unstreamed == [503]

    def test_the_parents_sigkill_leaves_no_process_and_no_credentials_file(
        self, tmp_path: Path
    ) -> None:
        credentials = tmp_path / "credentials.json"
        with running_serve("--credentials", str(credentials)) as run:
            children = _children(run.proc.pid)
            assert credentials.exists()
            ipc_dirs = list(Path(tempfile.gettempdir()).glob(f"tokenyard-{run.proc.pid}-*"))
            assert ipc_dirs
            run.proc.kill()
            run.proc.wait(timeout=10)
            with anyio.from_thread.start_blocking_portal() as portal:
                portal.call(_until_gone, credentials, children)
                for path in ipc_dirs:  # the system's own guardian removes its directory
                    portal.call(_until_gone, path, [])

    @pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
    def test_a_signal_while_it_starts_stops_the_start_and_exits_0_leaving_nothing(
        self, tmp_path: Path, signum: int
    ) -> None:
        gate = tmp_path / "gate"
        os.mkfifo(gate)
        (tmp_path / "sitecustomize.py").write_text(_START_GATE)
        command = [sys.executable, "-m", "actors", "serve", "--port", str(free_port())]
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join((str(tmp_path), str(ROOT))),
            TOKENYARD_TEST_START_GATE=str(gate),
        )
        # The shell's pid is the server's once it execs: the one process the gate lets by.
        exempt = 'TOKENYARD_TEST_UNGATED=$$ exec "$@"'
        with subprocess.Popen(
            ["/bin/sh", "-c", exempt, "sh", *command],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
            preexec_fn=stop_signals_by_default,
        ) as proc:  # fmt: skip
            held = -1
            try:
                held = anyio.run(_at_the_gate, gate, proc)
                children = _children(proc.pid)
                assert children  # the first process of its pipeline, held at the gate
                ipc_dirs = list(Path(tempfile.gettempdir()).glob(f"tokenyard-{proc.pid}-*"))
                proc.send_signal(signum)
                out, err = proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if held >= 0:
                    os.close(held)
        assert proc.returncode == 0, err
        assert out == ""  # never said it serves
        name = signal.Signals(signum).name
        assert f"{name} while starting: stopped before serving anything" in err, err
        assert "Traceback" not in err
        with anyio.from_thread.start_blocking_portal() as portal:
            for path in ipc_dirs:
                portal.call(_until_gone, path, children)

    @pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
    def test_a_signal_while_python_still_imports_it_stops_it_the_same_way(
        self, tmp_path: Path, signum: int
    ) -> None:
        # Held while the package imports, before the server's own signal receivers are
        # open. Before, SIGINT there was a KeyboardInterrupt traceback from the import
        # (and Python's status for it), and SIGTERM killed it without a word.
        port = str(free_port())
        done = signalled_while_importing(
            tmp_path, signum, "serve", "--workers", "1", "--port", port
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == ""
        (line,) = done.stderr.splitlines()
        name = signal.Signals(signum).name
        assert LOG_LINE.fullmatch(line), line
        assert line.endswith(
            f"tokenyard.http: {name} while starting: stopped before serving anything"
        )

    @pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
    def test_the_same_signal_sent_again_while_it_is_held_acts_at_once(
        self, tmp_path: Path, signum: int
    ) -> None:
        # Held at the gate, it never gets as far as its receivers: the signal sent again
        # (as an operator does when the first seems to do nothing) ends it as Python would.
        port = str(free_port())
        done = signalled_while_importing(
            tmp_path, signum, "serve", "--workers", "1", "--port", port, again=True
        )
        assert done.returncode == -signum, done.stderr
        assert "stopped before serving anything" not in done.stderr


def signalled_while_importing(
    tmp_path: Path, signum: int, *args: str, again: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python -m actors ARGS``, sent ``signum`` while it imports the package (held at its
    first import of ``runtime``, from the package's ``__init__``), then let go (``again``:
    not let go, sent the signal again until it ends): how it ended, checked to leave no
    process and no ipc directory behind."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    (tmp_path / "sitecustomize.py").write_text(_IMPORT_GATE)
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join((str(tmp_path), str(ROOT))),
        TOKENYARD_TEST_START_GATE=str(gate),
        TOKENYARD_TEST_IMPORT_GATE="runtime",
        TOKENYARD_TEST_MARK=mark,
    )
    with subprocess.Popen(
        [sys.executable, "-m", "actors", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        preexec_fn=stop_signals_by_default,
    ) as proc:  # fmt: skip
        held = -1
        try:
            held = anyio.run(_at_the_gate, gate, proc)
            proc.send_signal(signum)  # pending before the gate opens: received at the gate
            if again:
                # Again and again: a signal sent while one of its kind waits to be handled
                # is one, so the count of those handled is not the count sent.
                deadline = time.monotonic() + 20
                while proc.poll() is None and time.monotonic() < deadline:  # sync-ok
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=0.1)
                    if proc.poll() is None:
                        proc.send_signal(signum)
            else:
                os.close(held)
                held = -1
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if held >= 0:
                os.close(held)
    left = _pids_with(f"TOKENYARD_TEST_MARK={mark}".encode())
    assert not left, f"python -m actors {args} left processes behind: {left}"
    assert not list(Path(tempfile.gettempdir()).glob(f"tokenyard-{proc.pid}-*"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@contextlib.asynccontextmanager
async def _one_long_stream() -> AsyncIterator[tuple[Server, TaskGroup, aiohttp.ClientResponse]]:
    """A one-worker server streaming one long completion, its first event read; with a
    task group in which the test starts its drain."""
    async with open_server(workers=1, port=0, step_time=0.01) as server:
        url = f"{server.url}/v1/completions"
        body = {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with (
            aiohttp.ClientSession() as http,
            anyio.create_task_group() as tg,
            http.post(url, json=body) as r,
        ):
            await r.content.readuntil(b"\n\n")
            yield server, tg, r


def _start_drain(tg: TaskGroup, server: Server, timeout: float | None = None) -> list[bool]:
    """Start ``server.drain(timeout)`` in ``tg``: the list gets what it returns."""
    drained: list[bool] = []

    async def drain() -> None:
        drained.append(await server.drain(timeout))

    tg.start_soon(drain)
    return drained


class _Streams:
    def __init__(self) -> None:
        #: Each stream's events, for the streams begun before the signal.
        self.finished: list[list[Any]] = []
        #: The statuses of the requests without a stream in flight at the signal.
        self.unstreamed: list[int] = []
        #: Whether a new connection was refused after the signal.
        self.refused_after = False


async def _streams_through_sigterm(run: Running, count: int, max_tokens: int) -> _Streams:
    """Begin ``count`` streams and one request without a stream, SIGTERM the server once
    each stream has its first event, and gather how each one ended."""
    out = _Streams()
    url = f"http://127.0.0.1:{run.port}/v1/completions"
    body = {"prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True}
    started = [anyio.Event() for _ in range(count)]

    async def stream(http: aiohttp.ClientSession, began: anyio.Event) -> None:
        async with http.post(url, json={**body, "stream": True}) as r:
            assert r.status == 200
            data = await r.content.readuntil(b"\n\n")
            began.set()
            data += await r.read()
        out.finished.append(sse_events(data))

    async def whole(http: aiohttp.ClientSession) -> None:
        async with http.post(url, json=body) as r:
            await r.read()
            out.unstreamed.append(r.status)

    with anyio.fail_after(60):
        async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
            for began in started:
                tg.start_soon(stream, http, began)
            tg.start_soon(whole, http)
            for began in started:
                await began.wait()
            run.proc.send_signal(signal.SIGTERM)
            # The listener closes at once: a new client is refused, not left waiting. One
            # that lands in the listen backlog after the owner's last accept and before the
            # close is reset by the kernel with the listener: turned away at once too.
            for _ in range(200):
                try:
                    with socket.create_connection(("127.0.0.1", run.port), timeout=1):
                        pass
                except (ConnectionRefusedError, ConnectionResetError):
                    out.refused_after = True
                    break
                await anyio.sleep(0.01)  # sync-ok: polling the port until it closes
    return out


async def _health_once_listening(port: int, proc: subprocess.Popen[str]) -> int:
    """Connect to ``port`` once ``proc`` listens on it, ask ``GET /health`` and return the
    answer's status (0: the connection closed unanswered)."""
    with anyio.fail_after(60):
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                conn = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                await anyio.sleep(0.05)  # sync-ok: polling for the listener, which says nothing
                continue
            async with conn:
                await conn.send(HEALTH)
                answer = b""
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    while b"\r\n" not in answer:
                        answer += await conn.receive()
                return int(answer.split()[1]) if answer else 0


async def _logged_then_served(port: int) -> tuple[int, int]:
    """A request the worker refuses and logs (not HTTP), then one it answers: their
    statuses, each within 10 s."""
    statuses: list[int] = []
    for request in (b"\x00 not http\r\n\r\n", HEALTH):
        with anyio.fail_after(10):
            async with await anyio.connect_tcp("127.0.0.1", port) as conn:
                await conn.send(request)
                answer = b""
                while b"\r\n" not in answer:
                    answer += await conn.receive()
                statuses.append(int(answer.split()[1]))
    return statuses[0], statuses[1]


async def _until_gone(path: Path, pids: list[int]) -> None:
    """Wait until ``path`` is removed and every pid has ended (nothing announces either)."""
    with anyio.fail_after(20):
        for _ in itertools.count():
            if not path.exists() and all(_zombie(p) for p in pids):
                return
            await anyio.sleep(0.05)  # sync-ok: polling the file system and /proc


async def _complete(port: int) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}
        ) as r,
    ):
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body


class TestTheCommandWithAKey:
    def test_the_flags_key_is_asked_for_and_hidden_from_the_process_list(self) -> None:
        options = ("--api-key", KEY, "--cors-origin", APP)
        with running_serve(*options, workers=1, env={API_KEY_ENV: ENV_KEY}) as run:
            assert "API key required" in run.line
            assert KEY.encode() not in Path(f"/proc/{run.proc.pid}/cmdline").read_bytes()
            statuses = asyncio.run(_access_statuses(run.port))
            assert statuses == {"none": 401, "environment's": 401, "flag's": 200, "pre": 204}
            run.proc.send_signal(signal.SIGTERM)
            assert run.proc.wait(timeout=30) == 0


async def _access_statuses(port: int) -> dict[str, int]:
    url = f"http://127.0.0.1:{port}"
    statuses: dict[str, int] = {}
    async with aiohttp.ClientSession() as s:
        keys = {"none": None, "environment's": ENV_KEY, "flag's": KEY}
        for name, key in keys.items():
            headers = {} if key is None else {"authorization": f"Bearer {key}"}
            async with s.get(f"{url}/v1/models", headers=headers) as r:
                statuses[name] = r.status
        preflight = {"origin": APP, "access-control-request-method": "POST"}
        async with s.options(f"{url}/v1/completions", headers=preflight) as r:
            statuses["pre"] = r.status
    return statuses


#: A ``sitecustomize`` that holds every Python process started with
#: ``TOKENYARD_TEST_START_GATE`` in its environment, but the one whose pid is
#: ``TOKENYARD_TEST_UNGATED``, at its start, until the FIFO it names is opened to write and
#: closed again: how a test holds a server's start (its children are such processes).
_START_GATE = """
import os

if os.environ.get("TOKENYARD_TEST_START_GATE") and str(os.getpid()) != os.environ.get(
    "TOKENYARD_TEST_UNGATED"
):
    with open(os.environ["TOKENYARD_TEST_START_GATE"], "rb") as gate:
        gate.read()
"""


#: A ``sitecustomize`` that holds the Python process started with
#: ``TOKENYARD_TEST_IMPORT_GATE`` in its environment at its first import of the module it
#: names, until the FIFO ``TOKENYARD_TEST_START_GATE`` is opened to write and closed again;
#: the processes it starts afterwards pass (the variable is gone from their environment).
_IMPORT_GATE = """
import os
import sys


class _Gate:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == os.environ.get("TOKENYARD_TEST_IMPORT_GATE"):
            sys.meta_path.remove(_Gate)
            del os.environ["TOKENYARD_TEST_IMPORT_GATE"]
            with open(os.environ["TOKENYARD_TEST_START_GATE"], "rb") as gate:
                gate.read()
        return None  # the usual finders find it


sys.meta_path.insert(0, _Gate)
"""


async def _at_the_gate(gate: Path, proc: subprocess.Popen[str]) -> int:
    """Wait until a process waits at ``gate`` (a FIFO: opening it to write fails while
    nobody reads it); the open descriptor, which holds it there until it is closed."""
    with anyio.fail_after(30):
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                return os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as err:
                if err.errno != errno.ENXIO:
                    raise
            await anyio.sleep(0.02)  # sync-ok: nothing announces a reader of the FIFO


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _zombie(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
