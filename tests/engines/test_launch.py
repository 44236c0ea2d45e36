"""``serve --engine vllm --model DIR``: the scheduler launches the engine as its own child;
killed, the engine's requests fail or are resubmitted, and a new engine is launched."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import TYPE_CHECKING

import aiohttp
import anyio
import pytest

from actors._vllm_engine import process_tree
from tests.http._server import Running, running_serve, sse_events

from ._vllm import ARGS, ENV, PYTHON, title
from .test_attach import PROMPT, completion, openai_round

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.timeout(300)

#: Two requests run at once: two streams fill the engine, more wait at the scheduler.
LAUNCH_ARGS = (
    *ARGS[: ARGS.index("--max-num-seqs")],
    "--max-num-seqs",
    "2",
    *ARGS[ARGS.index("--max-num-seqs") + 2 :],
)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Running]:
    env = {"TOKENYARD_VLLM_PYTHON": PYTHON, **ENV}
    options = ["--engine", "vllm", "--model", str(model_dir), "--served-model-name", "tiny"]
    options += ["--", *LAUNCH_ARGS]
    with running_serve(*options, env=env) as running:
        try:
            yield running
        finally:
            # SIGTERM drains and stops the pipeline: the scheduler ends its engine.
            running.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                running.proc.wait(90)


def engine_core(serve_pid: int) -> int | None:
    return next((p for p in process_tree(serve_pid)[1:] if "EngineCore" in title(p)), None)


class TestLaunched:
    async def test_the_openai_client_is_served_by_the_launched_engine(
        self, served: Running
    ) -> None:
        await anyio.to_thread.run_sync(openai_round, f"http://127.0.0.1:{served.port}")
        # The engine runs below the server's scheduler, in its own process group.
        core = engine_core(served.proc.pid)
        assert core is not None
        assert os.getpgid(core) != os.getpgid(served.proc.pid)

    async def test_a_killed_engine_fails_or_resubmits_its_requests_and_is_launched_again(
        self, served: Running
    ) -> None:
        url = f"http://127.0.0.1:{served.port}"
        core = engine_core(served.proc.pid)
        assert core is not None
        streamed = {"prompt": PROMPT, "max_tokens": 4000, "stream": True, "ignore_eos": True}
        whole = {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True}
        events: list[list[object]] = []
        answers: list[tuple[int, bytes]] = []
        with anyio.fail_after(240):
            async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
                started = [anyio.Event(), anyio.Event()]

                async def stream(k: int) -> None:
                    async with http.post(url + "/v1/completions", json=streamed) as r:
                        assert r.status == 200
                        head = await r.content.readuntil(b"\n\n")
                        started[k].set()
                        events.append(sse_events(head + await r.content.read()))

                async def one() -> None:
                    answers.append(await completion(url, whole))

                for k in range(2):  # the engine's two places, streaming when it dies
                    tg.start_soon(stream, k)
                for event in started:
                    await event.wait()
                for _ in range(2):  # waiting at the scheduler: no output before the death
                    tg.start_soon(one)
                os.kill(core, signal.SIGKILL)
        # A stream in flight when the engine died ends with an error event. One whose
        # 4,000 ids all came before it died (the other stream's first id can come seconds
        # after this one's: the kill waits for both) ended whole, with `length`.
        failed = 0
        for stream_events in events:
            assert stream_events[-1] == "[DONE]"
            last = stream_events[-2]
            assert isinstance(last, dict)
            if "error" in last:
                failed += 1
            else:
                assert last["choices"][0]["finish_reason"] == "length", stream_events[-3:]
        assert failed >= 1  # the later one had just begun
        # The waiting ones were resubmitted to the restarted scheduler's new engine.
        assert [status for status, _ in answers] == [200, 200], answers
        new_core = engine_core(served.proc.pid)
        assert new_core is not None
        assert new_core != core
