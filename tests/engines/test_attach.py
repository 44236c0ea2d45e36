"""``Vllm(handshake=...)``: the pipeline attached to a headless engine this test starts, and
what happens when that engine is killed (a new one, started anew, is taken)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from typing import TYPE_CHECKING

import aiohttp
import anyio
import pytest
from openai import OpenAI

from actors import Vllm, WorkerDiedError
from actors._vllm_engine import engine_command, private_temp_env, shared_memory_of
from actors.http import open_server
from actors.messages import GetSchedulerStatistics, GetWorkerStatistics, SamplingParams
from tests.conftest import free_port
from tests.http._server import sse_events

from ._vllm import ARGS, ENV, PYTHON, engine_core_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

    from actors.http import Server

pytestmark = pytest.mark.timeout(240)

PROMPT = "The harbour of Yokohama"


def start_engine(model_dir: Path, port: int) -> subprocess.Popen[bytes]:
    """``vllm serve --headless`` dialling ``tcp://127.0.0.1:port``, in a group of its own,
    its ipc sockets and temporary files in a directory of its own (`stop_group` removes
    it)."""
    rpc_dir = tempfile.mkdtemp(prefix="tokenyard-vllm-")
    proc = subprocess.Popen(
        engine_command(PYTHON, str(model_dir), "127.0.0.1", port, ARGS),
        env={**os.environ, **ENV, **private_temp_env(rpc_dir)},
        start_new_session=True,
    )
    RPC_DIRS[proc.pid] = rpc_dir
    return proc


#: The directory of each started engine's ipc sockets, by its pid.
RPC_DIRS: dict[int, str] = {}


@contextlib.contextmanager
def headless_engine(model_dir: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """`start_engine`, ended with its group (where no actor system runs meanwhile)."""
    proc = start_engine(model_dir, port)
    try:
        yield proc
    finally:
        stop_group(proc)


@contextlib.asynccontextmanager
async def headless_engine_beside(
    model_dir: Path, port: int
) -> AsyncIterator[subprocess.Popen[bytes]]:
    """`headless_engine` for a test whose actor system runs meanwhile: its end (up to 20 s
    while vLLM cleans up) waits in a thread, never in the event loop, whose liveness probes
    would go unanswered meanwhile and every member be killed as stuck."""
    proc = start_engine(model_dir, port)
    try:
        yield proc
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stop_group, proc)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the engine's group (vLLM cleans up), SIGKILL it after 20 s."""
    shm = shared_memory_of(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for path in shm:
        path.unlink(missing_ok=True)
    shutil.rmtree(RPC_DIRS.pop(proc.pid, ""), ignore_errors=True)


@pytest.fixture(scope="module")
def handshake() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def engine(model_dir: Path, handshake: str) -> Iterator[subprocess.Popen[bytes]]:
    with headless_engine(model_dir, int(handshake.rsplit(":", 1)[1])) as proc:
        yield proc


@pytest.fixture(scope="module")
async def server(
    model_dir: Path, handshake: str, engine: subprocess.Popen[bytes]
) -> AsyncIterator[Server]:
    async with open_server(
        workers=2,
        tokenizer=model_dir,
        port=0,
        # The scheduler the engine's one client: its path is tested here (the workers as
        # clients are, below and by test_launch).
        engine=Vllm(handshake=handshake, direct=False),
        context_length=4096,
        model="tiny",
    ) as running:
        yield running


def openai_round(url: str) -> None:
    """Completions and chats, streamed and not, through the openai client."""
    with OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=180) as client:
        done = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None
        assert done.usage.completion_tokens == 16
        streamed = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with streamed:
            text = "".join([c.choices[0].text for c in streamed if c.choices])
        assert text == done.choices[0].text  # greedy: the same ids
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=12
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        chunks = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=12,
            stream=True,
        )
        with chunks:
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] in ("stop", "length")


async def completion(url: str, body: dict[str, object]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.read()


class TestAttached:
    async def test_the_openai_client_gets_completions_and_chats_streamed_or_not(
        self, server: Server
    ) -> None:
        # The sync client, in a thread: the async one leaves an async generator for the
        # event loop to finalise after the test, which the suite's task guard refuses.
        await anyio.to_thread.run_sync(openai_round, server.url)

    async def test_stop_ids_end_a_request_with_stop_and_the_id_kept(self, server: Server) -> None:
        p = server.pipeline
        first = await p.generate(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True)
        stop_at = first.output_ids[4]
        stopped = await p.generate(
            PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]
        )
        assert stopped.output_ids == first.output_ids[: first.output_ids.index(stop_at) + 1]
        assert stopped.finish_reason == "stop"

    async def test_more_requests_than_the_engine_runs_all_finish(self, server: Server) -> None:
        results: list[int] = []

        async def one(k: int) -> None:
            done = await server.pipeline.generate(
                PROMPT, max_new_tokens=8 + k, temperature=0.0, ignore_eos=True
            )
            results.append(len(done.output_ids))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for k in range(12):  # max_num_seqs is 8
                    tg.start_soon(one, k)
        assert sorted(results) == [8 + k for k in range(12)]
        scheduler = await server.pipeline.system.lookup("scheduler")
        assert (await scheduler.ask(GetSchedulerStatistics(), timeout=10)).received >= 12


class TestKills:
    async def test_a_killed_worker_and_then_a_killed_engine(self, model_dir: Path) -> None:
        """The workers the engine's clients (`Vllm.direct`): a killed worker's successor
        binds its sockets again and the engine serves it; a killed engine ends the streams
        and a new one is taken. A server and an engine of the test's own: the restarted
        members must end with it."""
        handshake = f"tcp://127.0.0.1:{free_port()}"
        port = int(handshake.rsplit(":", 1)[1])
        async with (
            headless_engine_beside(model_dir, port) as engine,
            open_server(
                workers=2,
                tokenizer=model_dir,
                port=0,
                engine=Vllm(handshake=handshake),
                context_length=4096,
            ) as server,
        ):
            await self.kill_a_worker(server, engine)
            await self.kill_under_load(server, engine)
            # The scheduler restarted and waits for an engine's HELLO: an engine started
            # anew (the killed one's handshake cannot be reused) is taken.
            async with headless_engine_beside(model_dir, port):
                with anyio.fail_after(180):
                    status, answer = await completion(
                        server.url, {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
                    )
                assert status == 200, answer
                # None went through the scheduler, whose client only watches the engine
                # (asked while the engine lives: its end is the scheduler's death).
                scheduler = await server.pipeline.system.lookup("scheduler")
                stats = await scheduler.ask(GetSchedulerStatistics(), timeout=10)
                assert stats.received == 0

    @staticmethod
    async def kill_a_worker(server: Server, engine: subprocess.Popen[bytes]) -> None:
        p = server.pipeline
        long = p.stream_outputs(
            PROMPT, SamplingParams(max_new_tokens=4000, temperature=0.0, ignore_eos=True)
        )
        killed: list[tuple[int, int]] = []
        held: list[int] = []

        async def kill_its_worker() -> None:
            async with contextlib.aclosing(long):
                async for out in long:
                    if not killed:  # the engine runs it: its worker dies, the engine not
                        # Held while the worker restarts: the tiny model generates its
                        # 4,000 tokens in seconds, and one that ended first leaves the
                        # successor nothing to tell apart.
                        core = engine_core_of(engine.pid)
                        assert core is not None
                        os.kill(core, signal.SIGSTOP)
                        held.append(core)
                        killed.append((out.worker, p.kill_worker(out.worker).incarnation))

        try:
            with anyio.fail_after(120), pytest.raises(WorkerDiedError):
                await kill_its_worker()
            k, incarnation = killed[0]
            ref = await p.wait_worker(k, after=incarnation, timeout=60)
        finally:
            for core in held:
                os.kill(core, signal.SIGCONT)
        # The engine reconnects to the successor's sockets: the dead worker's request, which
        # it still runs, reaches the successor, which aborts it there.
        with anyio.fail_after(60):
            while (await ref.ask(GetWorkerStatistics(), timeout=10)).engine_strays < 1:
                pass  # each ask is itself the wait
        with anyio.fail_after(120):
            served = [
                await p.generate(PROMPT, max_new_tokens=8, temperature=0.0, ignore_eos=True)
                for _ in range(4)
            ]
        assert {r.worker for r in served} == {0, 1}  # round robin: the successor served too
        assert all(r.completion_tokens == 8 for r in served)

    @staticmethod
    async def kill_under_load(server: Server, engine: subprocess.Popen[bytes]) -> None:
        body = {
            "prompt": PROMPT,
            "max_tokens": 4000,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        events: list[list[object]] = []
        with anyio.fail_after(180):
            async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
                started = [anyio.Event(), anyio.Event()]

                async def stream(k: int) -> None:
                    async with http.post(server.url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        head = await r.content.readuntil(b"\n\n")
                        started[k].set()
                        events.append(sse_events(head + await r.content.read()))

                for k in range(2):
                    tg.start_soon(stream, k)
                for event in started:
                    await event.wait()
                core = engine_core_of(engine.pid)
                assert core is not None
                shm = shared_memory_of(engine.pid)  # its mapper is killed: removed here
                os.kill(core, signal.SIGKILL)
        # A stream still running when the engine was killed ends with an error event; one
        # may have ended whole first (the other's start came later, and the tiny model
        # generates its 4,000 tokens in seconds): it then says so in its usage.
        cut = 0
        for stream_events in events:
            assert stream_events[-1] == "[DONE]"
            last = stream_events[-2]
            assert isinstance(last, dict)
            if "error" in last:
                cut += 1
            else:
                usage = last.get("usage")
                assert usage is not None, json.dumps(stream_events[-3:])[-1500:]
                assert usage["completion_tokens"] == 4000, usage
        assert cut >= 1
        await anyio.to_thread.run_sync(stop_group, engine)  # not in the system's event loop
        for path in shm:
            path.unlink(missing_ok=True)
