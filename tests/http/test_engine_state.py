"""The engine's state as the server shows it: ``/health`` says 503 with the reason while
the scheduler's engine has not connected (a vLLM engine attached over its own protocol,
here a fake one replaying frames recorded from the real engine) and 200 once it has; an
engine that never starts makes ``serve`` give up and exit 1 with the reason, not launch
it again for ever."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import aiohttp
import anyio
import pytest

from actors._hf_model import write_hf_model_dir
from tests.conftest import free_port
from tests.engines.test_protocol import FakeEngine

from ._server import ROOT, running_serve

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.timeout(60)


async def health(session: aiohttp.ClientSession, url: str) -> tuple[int, str, str | None]:
    async with session.get(f"{url}/health") as response:
        return response.status, await response.text(), response.headers.get("Retry-After")


async def until_healthy(session: aiohttp.ClientSession, url: str) -> None:
    """Poll /health until it answers 200 (20 s at most): the engine's READY reaches the
    scheduler, the supervisor, then each worker, a chain an HTTP client cannot wait on."""
    for _ in range(400):
        if (await health(session, url))[0] == 200:
            return
        await anyio.sleep(0.05)  # sync-ok: polling the server from outside
    pytest.fail("/health did not answer 200 within 20 s of the engine's READY")


async def test_health_is_503_until_the_engine_attaches_and_200_after() -> None:
    handshake = f"tcp://127.0.0.1:{free_port()}"
    with running_serve("--engine", "vllm", "--engine-handshake", handshake, workers=2) as srv:
        url = f"http://127.0.0.1:{srv.port}"
        async with aiohttp.ClientSession() as session:
            # Every worker says so (a connection each time: the owner hands them round).
            for _ in range(4):
                status, body, retry_after = await health(session, url)
                assert status == 503, body
                assert "the engine is not ready" in body
                assert retry_after == "1"
            engine = FakeEngine(handshake)
            try:
                await engine.start()
                await until_healthy(session, url)
                for _ in range(4):
                    assert (await health(session, url))[0] == 200
            finally:
                engine.close()


async def test_a_ready_engine_is_healthy_as_soon_as_the_server_says_it_serves() -> None:
    """The stand-in is ready at once: no 503 window after ``serving`` is printed (the
    supervisor asks a started scheduler for its engine's state before it starts a worker)."""
    with running_serve(workers=2) as srv:
        url = f"http://127.0.0.1:{srv.port}"
        async with aiohttp.ClientSession() as session:
            for _ in range(4):
                status, body, _ = await health(session, url)
                assert status == 200, body


def test_an_engine_that_never_starts_makes_serve_exit_1_after_its_tries(tmp_path: Path) -> None:
    """A launched engine that exits at once (its "Python" is ``false``: as a wrong ``vllm
    serve`` argument does, only sooner) kills the scheduler before the engine was ever
    ready; after ``--engine-start-tries`` such deaths in a row the pipeline gives up."""
    write_hf_model_dir(tmp_path)
    command = [
        sys.executable,
        "-m",
        "actors",
        "serve",
        "--workers",
        "1",
        "--port",
        str(free_port()),
        "--engine",
        "vllm",
        "--model",
        str(tmp_path),
        "--vllm-python",
        "/bin/false",
        "--engine-start-tries",
        "2",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "serving http://" in done.stdout
    assert "the engine was never ready in 2 starts in a row" in done.stderr
    assert "its process exited (status 1)" in done.stderr
    assert done.stderr.count("launched vLLM's engine") == 2


async def completion(
    session: aiohttp.ClientSession, url: str, prompt: list[int]
) -> tuple[int, str, str | None]:
    body = {"prompt": prompt, "max_tokens": 1}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status, await response.text(), response.headers.get("Retry-After")


@pytest.mark.parametrize("clients", ["workers", "scheduler"])
async def test_a_prompt_too_long_for_the_engines_context_is_400_not_503(clients: str) -> None:
    """The fake engine reports a ``max_model_len`` of 512, shorter than the HTTP layer's
    default context: a request that came before it was known is refused by the engine's
    client once it is (400, not 503: trying again cannot help), and one that comes after
    by the HTTP layer, whose context is now the engine's."""
    handshake = f"tcp://127.0.0.1:{free_port()}"
    options = ("--engine", "vllm", "--engine-handshake", handshake, "--vllm-clients", clients)
    with running_serve(*options, workers=1) as srv:
        url = f"http://127.0.0.1:{srv.port}"
        engine = FakeEngine(handshake)
        try:
            async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
                early: list[tuple[int, str, str | None]] = []

                async def before_ready() -> None:
                    early.append(await completion(session, url, [5] * 600))

                tg.start_soon(before_ready)
                await engine.start()
                await until_healthy(session, url)
                status, body, retry_after = await completion(session, url, [5] * 600)
                assert (status, retry_after) == (400, None), body
                assert "context_length_exceeded" in body
                assert "512" in body
            status, body, retry_after = early[0]
            assert (status, retry_after) == (400, None), body
            assert "context_length_exceeded" in body
        finally:
            engine.close()


async def test_a_request_waiting_when_the_pipeline_gives_up_is_answered_503(
    tmp_path: Path,
) -> None:
    """The engine's "Python" here blocks until the test lets it exit 1 (as a wrong ``vllm
    serve`` argument does): a request waits at the scheduler meanwhile; the pipeline then
    gives up, and the request is answered 503 with the reason before serve exits 1, not
    left with its connection closed."""
    write_hf_model_dir(tmp_path)
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    python = tmp_path / "python"
    python.write_text('#!/bin/bash\nexec 3<>"$RELEASE"\nread -t 50 -u 3 line\nexit 1\n')
    python.chmod(0o755)
    options = ("--engine", "vllm", "--model", str(tmp_path), "--vllm-python", str(python))
    release = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        with running_serve(
            *options,
            "--vllm-clients",
            "scheduler",
            "--engine-start-tries",
            "1",
            workers=1,
            env={"RELEASE": str(fifo)},
            stderr=True,
        ) as srv:
            url = f"http://127.0.0.1:{srv.port}"
            async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
                answers: list[tuple[int, str, str | None]] = []

                async def waiting() -> None:
                    answers.append(await completion(session, url, [5, 6, 7]))

                tg.start_soon(waiting)
                # The request waits at the scheduler (its queue says so) before the engine
                # may fail.
                for _ in range(400):
                    async with session.get(f"{url}/metrics") as response:
                        lines = (await response.text()).splitlines()
                    if any(
                        line.startswith("tokenyard:num_requests_waiting{")
                        and float(line.rsplit(" ", 1)[1]) == 1
                        for line in lines
                    ):
                        break
                    await anyio.sleep(0.05)  # sync-ok: polling the server from outside
                else:
                    pytest.fail("the request was not waiting at the scheduler within 20 s")
                os.write(release, b"exit\n")
            status, body, _ = answers[0]
            assert status == 503, body
            assert "the pipeline failed" in body
            assert "never ready" in body
            assert srv.proc.wait(timeout=30) == 1
    finally:
        os.write(release, b"exit\n" * 4)  # whatever still waits on it exits
        os.close(release)
