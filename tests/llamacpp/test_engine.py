"""The pipeline and the server with llama.cpp behind the scheduler (`actors.engines.LlamaCpp`):
real generation from the test model, which writes byte fragments, through tokenizer workers,
the scheduler, the detokenizer and HTTP.

The reference is llama.cpp's own non-streamed answer to the same prompt ids
(`LlamaCppServer` over the same GGUF, native ``/completion`` with ``return_tokens``).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import pytest
from openai import AsyncOpenAI

from actors import LlamaCpp, Pipeline, WorkerDiedError
from actors._gguf import MODEL_FILE
from actors._llamacpp import LlamaCppServer
from actors.http import open_server
from actors.messages import GetSchedulerStatistics, Member, SchedulerStatistics
from tests.http._server import ROOT, running_serve

from .conftest import CONTEXT
from .test_llamacpp import native

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

PROMPTS = ("The harbour of Yokohama", "你好，世界", "Bonjour à tous 😀")  # noqa: RUF001


def spec(model_dir: Path, n_parallel: int = 2) -> LlamaCpp:
    return LlamaCpp(
        model=str(model_dir / MODEL_FILE), n_parallel=n_parallel, context_length=CONTEXT
    )


@pytest.fixture(scope="module")
async def pipeline(model_dir: Path) -> AsyncIterator[Pipeline]:
    async with Pipeline(workers=2, tokenizer=model_dir, engine=spec(model_dir)) as p:
        yield p


class TestThePipeline:
    async def test_greedy_output_is_llama_cpps_own_and_its_pieces_join_to_its_decode(
        self, pipeline: Pipeline, model: Path, hf: Any
    ) -> None:
        with LlamaCppServer(model, n_parallel=1, context_length=CONTEXT) as reference:
            for prompt in PROMPTS:
                ids = hf.encode(prompt).ids
                own = native(reference, ids, 40, ignore_eos=True)
                done = await pipeline.generate(
                    prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True
                )
                assert done.output_ids == own["tokens"]
                # Special tokens are left out of text by default, as the stand-in's are.
                assert done.text == hf.decode(own["tokens"], skip_special_tokens=True)
                assert done.finish_reason == "length"
                pieces = [
                    piece
                    async for piece in pipeline.stream(
                        prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True
                    )
                ]
                assert "".join(pieces) == done.text

    async def test_stop_ids_and_eos_end_a_request_with_stop(
        self, pipeline: Pipeline, hf: Any
    ) -> None:
        first = await pipeline.generate(
            PROMPTS[0], max_new_tokens=24, temperature=0.0, ignore_eos=True
        )
        stop_at = first.output_ids[5]
        stopped = await pipeline.generate(
            PROMPTS[0],
            max_new_tokens=24,
            temperature=0.0,
            ignore_eos=True,
            stop_token_ids=[stop_at],
        )
        end = first.output_ids.index(stop_at) + 1
        assert stopped.output_ids == first.output_ids[:end]
        assert stopped.finish_reason == "stop"

    async def test_more_requests_than_slots_all_finish_and_the_scheduler_ends_empty(
        self, pipeline: Pipeline
    ) -> None:
        async with anyio.create_task_group() as tg:
            results: list[Any] = []

            async def one(k: int) -> None:
                results.append(
                    await pipeline.generate(
                        PROMPTS[k % 3], max_new_tokens=16 + k, temperature=0.0, ignore_eos=True
                    )
                )

            for k in range(7):  # 2 slots
                tg.start_soon(one, k)
        assert sorted(len(r.output_ids) for r in results) == [16 + k for k in range(7)]
        stats = await scheduler_stats(pipeline)
        assert (stats.running, stats.waiting) == (0, 0)


class TestTheServer:
    async def test_the_openai_client_gets_completions_and_chats_streamed_or_not(
        self, model_dir: Path
    ) -> None:
        async with (
            open_server(
                workers=2,
                tokenizer=model_dir,
                port=0,
                engine=spec(model_dir),
                context_length=CONTEXT,
                model="tiny",
            ) as server,
            AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client,
        ):
            done = await client.completions.create(
                model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0
            )
            assert done.choices[0].finish_reason == "length"
            assert done.usage is not None
            assert done.usage.completion_tokens == 16
            streamed = await client.completions.create(
                model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True
            )
            text = "".join([c.choices[0].text async for c in streamed if c.choices])
            assert text == done.choices[0].text
            chat = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=12
            )
            assert chat.choices[0].message.content is not None
            chunks = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": PROMPTS[2]}],
                max_tokens=12,
                stream=True,
            )
            reasons = [c.choices[0].finish_reason async for c in chunks if c.choices]
            assert reasons[-1] in ("stop", "length")

    async def test_clients_that_leave_free_their_slots(self, model_dir: Path) -> None:
        async with open_server(
            workers=1,
            tokenizer=model_dir,
            port=0,
            engine=spec(model_dir, n_parallel=2),
            context_length=CONTEXT,
        ) as server:
            body = {"prompt": PROMPTS[0], "max_tokens": 400, "stream": True, "ignore_eos": True}
            async with aiohttp.ClientSession() as http:
                for _ in range(2):  # both slots taken, then the clients leave mid-stream
                    async with http.post(server.url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        await r.content.readuntil(b"\n\n")
                with anyio.fail_after(20):
                    for _ in itertools.count():
                        if not (await scheduler_stats(server.pipeline)).running:
                            break
                        await anyio.sleep(0.02)  # sync-ok: polling the scheduler's counters
                # Slots freed: two whole requests run at once and finish.
                short = {"prompt": PROMPTS[1], "max_tokens": 8, "ignore_eos": True}
                with anyio.fail_after(20):
                    async with anyio.create_task_group() as tg:
                        for _ in range(2):
                            tg.start_soon(post_ok, http, server.url, short)

    def test_serve_says_which_model_it_loads_and_how_long_the_load_took(
        self, model_dir: Path
    ) -> None:
        model = model_dir / MODEL_FILE
        options = ("--engine", "llamacpp", "--model", str(model), "--tokenizer", str(model_dir))
        with running_serve(*options, workers=1, stderr=True) as run:
            run.proc.send_signal(signal.SIGTERM)
            _, err = run.proc.communicate(timeout=30)
        assert run.proc.returncode == 0, err
        assert re.search(rf"loading llama.cpp's model {re.escape(str(model))} \(\d+\.\d GiB\)", err)
        assert re.search(r"llama.cpp's model loaded in \d+\.\d s", err), err


class TestDeaths:
    async def test_a_killed_engine_fails_or_resubmits_every_request_and_restarts(
        self, model_dir: Path
    ) -> None:
        async with Pipeline(workers=1, tokenizer=model_dir, engine=spec(model_dir)) as p:
            victim = await p.system.lookup(Member.SCHEDULER.value)
            pid = p.system.pid_of(victim)
            assert pid is not None
            outcomes: dict[str, str] = {}
            streaming = [anyio.Event(), anyio.Event()]

            async def streamed(k: int) -> None:
                try:
                    async for _ in p.stream(PROMPTS[k], max_new_tokens=500, ignore_eos=True):
                        streaming[k].set()
                    outcomes[f"stream {k}"] = "done"
                except WorkerDiedError as err:
                    outcomes[f"stream {k}"] = f"lost its {err.member.value}"

            async def whole(k: int) -> None:
                done = await p.generate(PROMPTS[k % 3], max_new_tokens=200, ignore_eos=True)
                outcomes[f"whole {k}"] = f"{len(done.output_ids)} ids"

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for k in range(2):  # the two slots, streaming when the engine dies
                        tg.start_soon(streamed, k)
                    for event in streaming:
                        await event.wait()
                    for k in range(2):  # waiting behind them: no output before the death
                        tg.start_soon(whole, k)
                    os.kill(pid, signal.SIGKILL)
            # None left waiting: the streams that had output fail, the others are
            # resubmitted to the successor and finish.
            assert outcomes == {
                "stream 0": "lost its scheduler",
                "stream 1": "lost its scheduler",
                "whole 0": "200 ids",
                "whole 1": "200 ids",
            }
            back = await p.system.lookup(Member.SCHEDULER.value)
            assert back.incarnation == victim.incarnation + 1
            done = await p.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True)
            assert len(done.output_ids) == 8

    async def test_a_model_that_no_longer_loads_fails_the_pipeline_after_its_tries(
        self, model_dir: Path, tmp_path: Path
    ) -> None:
        shutil.copytree(model_dir, tmp_path / "model")
        engine = spec(tmp_path / "model")
        async with Pipeline(
            workers=1, tokenizer=model_dir, engine=engine, engine_start_tries=2
        ) as p:
            victim = await p.system.lookup(Member.SCHEDULER.value)
            pid = p.system.pid_of(victim)
            assert pid is not None
            # The file is replaced while it serves (a botched copy): the loaded engine runs
            # on, and each restart of the scheduler fails in its on_start.
            (tmp_path / "model" / MODEL_FILE).write_bytes(b"GGUF" + bytes(64))
            os.kill(pid, signal.SIGKILL)
            with anyio.fail_after(60):
                failure = await p.until_failed()
        assert "the engine was never ready in 2 starts in a row" in failure
        assert "could not load" in failure

    def test_a_model_that_does_not_load_stops_serve_with_the_reason_in_one_line(
        self, model_dir: Path, tmp_path: Path
    ) -> None:
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(b"GGUF" + bytes(64))  # passes the flag check, fails the load
        command = [sys.executable, "-m", "actors", "serve", "--workers", "1", "--port", "0"]
        command += ["--engine", "llamacpp", "--model", str(broken), "--tokenizer", str(model_dir)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 1, done.stderr[-3000:]
        last = done.stderr.splitlines()[-1]
        assert last.startswith("the pipeline did not start: actor 'scheduler' failed to start")
        assert "could not load" in last
        assert f"loading llama.cpp's model {broken} (0.0 GiB)" in done.stderr
        assert "model loaded in" not in done.stderr
        # The scheduler's own log has its traceback; serve does not repeat it, level by level,
        # nor as the escaped text of a repr in the supervisor's death.
        assert "The above exception was the direct cause" not in done.stderr
        assert "\\n--- remote traceback ---" not in done.stderr


async def scheduler_stats(pipeline: Pipeline) -> SchedulerStatistics:
    ref = await pipeline.system.lookup(Member.SCHEDULER.value)
    stats = await ref.ask(GetSchedulerStatistics(), timeout=10)
    assert isinstance(stats, SchedulerStatistics)
    return stats


async def post_ok(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
