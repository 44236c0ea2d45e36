"""Tokenizer workers as clients of vLLM's engine themselves (`actors.engines.Vllm.direct`):
each worker sends its requests on its own socket, takes their outputs from its own and
detokenizes them, the scheduler passing none of them on.

The engine here is the fake of its protocol that replays frames recorded from vLLM 0.32
(`tests.engines.test_protocol.FakeEngine`), over real sockets to a real pipeline's worker
and scheduler processes; `make test-engines` runs the same paths against the real engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest

from actors import Pipeline, RequestFailedError, Vllm
from actors import _vllm_protocol as proto
from actors._tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from actors.messages import GetSchedulerStatistics, GetWorkerStatistics
from tests.engines.record_golden import PROMPT
from tests.engines.test_protocol import FakeEngine, free_port, ids_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.timeout(60)

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
PROMPT_IDS: list[int] = TOKENIZER.encode(PROMPT, add_special_tokens=False).ids
#: What the recorded greedy request generated.
GREEDY = ids_of("outputs-greedy")


@pytest.fixture
async def served() -> AsyncIterator[tuple[Pipeline, FakeEngine]]:
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEngine(address)
    try:
        async with Pipeline(workers=1, engine=Vllm(handshake=address)) as pipeline:
            await engine.start()
            yield pipeline, engine
    finally:
        engine.close()


async def next_frame(engine: FakeEngine) -> tuple[bytes, Any]:
    """What the worker (the engine's client 1) sends next."""
    with anyio.fail_after(10):
        return await engine.request(client=1)


async def serve_one(engine: FakeEngine, recorded: str = "outputs-greedy") -> str:
    """Take the next ADD and answer it with a recorded request's outputs; its id there."""
    kind, body = await next_frame(engine)
    assert kind == proto.ADD, (kind, body)
    await engine.push(body[0], recorded, client=1)
    rid: str = body[0]
    return rid


class TestAWorkerAsTheEnginesClient:
    async def test_sends_its_request_itself_and_detokenizes_the_engines_output(
        self, served: tuple[Pipeline, FakeEngine]
    ) -> None:
        pipeline, engine = served
        async with anyio.create_task_group() as tg:
            results = []

            async def generate() -> None:
                results.append(
                    await pipeline.generate(PROMPT_IDS, max_new_tokens=8, ignore_eos=True)
                )

            tg.start_soon(generate)
            kind, body = await next_frame(engine)
            assert kind == proto.ADD
            request = msgspec.msgpack.decode(
                msgspec.msgpack.encode(body), type=proto.EngineCoreRequest
            )
            assert request.client_index == 1  # its outputs come to the worker's socket
            assert request.prompt_token_ids == PROMPT_IDS
            assert request.sampling_params.max_tokens == 8
            await engine.push(request.request_id, "outputs-greedy", client=1)
        (result,) = results
        assert result.output_ids == GREEDY
        assert result.text == TOKENIZER.decode(GREEDY)
        assert (result.completion_tokens, result.finish_reason) == (8, "length")
        scheduler = await pipeline.system.lookup("scheduler")
        stats = await scheduler.ask(GetSchedulerStatistics(), timeout=10)
        assert stats.received == 0  # nothing went through the scheduler
        assert stats.engine_ready
        assert stats.engine_context_length == 512  # the recorded engine's max_model_len

    async def test_a_stop_string_ends_the_request_and_aborts_it_at_the_engine(
        self, served: tuple[Pipeline, FakeEngine]
    ) -> None:
        pipeline, engine = served
        stop = TOKENIZER.decode(GREEDY[2:3])  # the third id's text
        async with anyio.create_task_group() as tg:
            results = []

            async def generate() -> None:
                results.append(await pipeline.generate(PROMPT_IDS, max_new_tokens=8, stop=[stop]))

            tg.start_soon(generate)
            rid = await serve_one(engine)
            assert await next_frame(engine) == (proto.ABORT, [rid])
        (result,) = results
        assert result.finish_reason == "stop"
        assert result.text == TOKENIZER.decode(GREEDY[:2])

    async def test_a_caller_that_gives_up_aborts_its_request_at_the_engine(
        self, served: tuple[Pipeline, FakeEngine]
    ) -> None:
        pipeline, engine = served
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipeline.generate, PROMPT_IDS)
            kind, body = await next_frame(engine)
            assert kind == proto.ADD
            tg.cancel_scope.cancel()
        assert await next_frame(engine) == (proto.ABORT, [body[0]])

    async def test_what_the_engine_must_not_see_is_refused_before_it_is_sent(
        self, served: tuple[Pipeline, FakeEngine]
    ) -> None:
        pipeline, engine = served
        with pytest.raises(RequestFailedError, match="outside the vocabulary"):
            await pipeline.generate([1 << 30], max_new_tokens=4)
        with pytest.raises(RequestFailedError, match="no room is left"):
            await pipeline.generate([5] * 512, max_new_tokens=4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipeline.generate, PROMPT_IDS)
            kind, body = await next_frame(engine)  # the first frame sent is this one's
            assert (kind, body[1]) == (proto.ADD, PROMPT_IDS)
            tg.cancel_scope.cancel()

    async def test_garbage_death_frames_and_strays_leave_it_serving(
        self, served: tuple[Pipeline, FakeEngine]
    ) -> None:
        pipeline, engine = served
        out = engine.outputs[1]
        await out.send(b"\xc1 not msgpack")
        await out.send_multipart([b"\x93", b"two frames"])
        await out.send(proto.ENGINE_CORE_DEAD)
        # Outputs of a request it does not know (an earlier incarnation's): aborted once.
        await engine.push("0.0.ff", "outputs-greedy", client=1)
        assert await next_frame(engine) == (proto.ABORT, ["0.0.ff"])
        worker = pipeline.worker_ref(0)
        assert worker is not None
        assert (await worker.ask(GetWorkerStatistics(), timeout=10)).engine_strays == 1
        async with anyio.create_task_group() as tg:
            results = []

            async def generate() -> None:
                results.append(await pipeline.generate(PROMPT_IDS, max_new_tokens=8))

            tg.start_soon(generate)
            await serve_one(engine)  # an ADD next: the stray was not aborted again
        assert results[0].output_ids == GREEDY
