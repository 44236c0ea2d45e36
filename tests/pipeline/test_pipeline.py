"""The pipeline end to end: real processes, real ZeroMQ, the bundled tokenizer."""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors import Pipeline, WorkerDiedError
from actors._tokenizer import load_tokenizer
from actors.messages import CheckLoad, Origin, RegisterWorker

from ._actors import Replies, ReplyInbox

if TYPE_CHECKING:
    from collections.abc import Callable

TOKENIZER = load_tokenizer()
PROMPTS = ["Hello there", "你好, 世界", "Bonjour à tous 😀", "def f(x): return x", "🇯🇵 東京"]


class TestGenerate:
    @pytest.mark.parametrize("workers", [1, 4])
    async def test_generate_and_stream_agree_through_n_workers(self, workers: int) -> None:
        async with Pipeline(workers=workers) as p:
            results = []
            async with anyio.create_task_group() as tg:

                async def one(prompt: str) -> None:
                    results.append(await p.generate(prompt, max_new_tokens=24))

                for prompt in PROMPTS * 2:
                    tg.start_soon(one, prompt)
            assert len(results) == 10
            assert {r.worker for r in results} <= set(range(workers))
            if workers == 4:
                assert len({r.worker for r in results}) > 1
            for r in results:
                assert r.completion_tokens == len(r.output_ids) <= 24
                assert r.finish_reason in ("length", "stop")
                assert r.text == TOKENIZER.decode(r.output_ids)
            pieces = [piece async for piece in p.stream(PROMPTS[2], max_new_tokens=24)]
            same = await p.generate(PROMPTS[2], max_new_tokens=24)
            assert "".join(pieces) == same.text
            assert len(pieces) > 1

    async def test_stop_strings_trim_the_text(self) -> None:
        async with Pipeline(workers=1) as p:
            plain = await p.generate(PROMPTS[0], max_new_tokens=32)
            assert len(plain.text) > 6
            stop = plain.text[3:6]
            cut = await p.generate(PROMPTS[0], max_new_tokens=32, stop=[stop])
            assert cut.finish_reason == "stop"
            assert cut.text == plain.text[: plain.text.index(stop)]
            pieces = [x async for x in p.stream(PROMPTS[0], max_new_tokens=32, stop=[stop])]
            assert "".join(pieces) == cut.text


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


class TestStreamingProperty:
    @settings(
        max_examples=12,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(
        prompt=st.text(
            st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20
        )
    )
    async def test_joined_stream_pieces_equal_the_one_shot_decode(self, prompt: str) -> None:
        if not TOKENIZER.encode(prompt, add_special_tokens=False).ids:
            return
        async with Pipeline(workers=1) as p:
            pieces = [x async for x in p.stream(prompt, max_new_tokens=16)]
            result = await p.generate(prompt, max_new_tokens=16)
        assert "".join(pieces) == TOKENIZER.decode(result.output_ids)


class TestRegistrationAndControl:
    async def test_a_duplicate_registration_is_warned_about_and_ignored(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async with Pipeline(workers=1) as p:
            worker = p.worker_ref(0)
            assert worker is not None
            dup = RegisterWorker(worker_id=0, incarnation=worker.incarnation, address=worker)
            with caplog.at_level(logging.WARNING, logger="tokenyard.pipeline"):
                await p.supervisor.ask(dup)
            assert "duplicate registration" in caplog.text
            assert p.worker_ref(0) == worker
            assert (await p.generate("still serving", max_new_tokens=4)).completion_tokens == 4

    async def test_control_replies_reach_only_the_worker_that_asked(self) -> None:
        async with Pipeline(workers=2) as p:
            inboxes = []
            for k in range(2):
                replies = Replies()
                inbox = await p.system.spawn(ReplyInbox, replies, process=False, name=f"r{k}")
                inboxes.append((replies, inbox))
            for k, (_, inbox) in enumerate(inboxes):
                worker = p.worker_ref(k)
                assert worker is not None
                await worker.tell(CheckLoad(reply_to=inbox))
            for k, (replies, _) in enumerate(inboxes):
                with anyio.fail_after(10):
                    while not replies.loads:
                        await replies.arrived.wait()
                worker = p.worker_ref(k)
                assert worker is not None
                assert [r.origin for r in replies.loads] == [Origin(k, worker.incarnation)]


async def load_with_a_kill(
    p: Pipeline, kill: Callable[[], object], n: int = 500
) -> tuple[int, int]:
    """Run ``n`` concurrent requests; once 20 finished, call ``kill``. Every request must
    end (complete or WorkerDiedError) within the deadline: none may hang."""
    done = failed = 0
    busy = anyio.Event()

    async def one(i: int) -> None:
        nonlocal done, failed
        try:
            await p.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=24)
            done += 1
        except WorkerDiedError:
            failed += 1
        if done == 20:
            busy.set()

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
            await busy.wait()
            kill()
    return done, failed


class TestDeaths:
    async def test_a_worker_killed_under_500_requests_loses_none_and_comes_back(
        self,
    ) -> None:
        async with Pipeline(workers=4, step_time=0.002) as p:
            killed: list[int] = []
            done, failed = await load_with_a_kill(
                p, lambda: killed.append(p.kill_worker(1).incarnation)
            )
            assert done + failed == 500
            assert done > 0
            back = await p.wait_worker(1, after=killed[0])
            assert back.incarnation == killed[0] + 1
            result = await p.generate("after the restart", max_new_tokens=8)
            assert result.completion_tokens == 8

    async def test_a_detokenizer_killed_under_500_requests_loses_none_and_comes_back(
        self,
    ) -> None:
        async with Pipeline(workers=2, step_time=0.002) as p:
            detokenizer = await p.system.lookup("detokenizer")
            pid = p.system.pid_of(detokenizer)
            assert pid is not None
            done, failed = await load_with_a_kill(p, lambda: os.kill(pid, signal.SIGKILL))
            assert done + failed == 500
            with anyio.fail_after(60):
                while (await p.system.lookup("detokenizer", missing_ok=True)) in (
                    None,
                    detokenizer,
                ):
                    await anyio.lowlevel.checkpoint()
            result = await p.generate("after the restart", max_new_tokens=8)
            assert result.completion_tokens == 8
