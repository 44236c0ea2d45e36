"""Tokenizer workers as clients of vLLM's engine themselves (`actors.engines.Vllm.direct`):
each worker sends its requests on its own socket, takes their outputs from its own and
detokenizes them, the scheduler passing none of them on.

The engine here is the fake of its protocol that replays frames recorded from vLLM 0.32
(`tests.engines.test_protocol.FakeEngine`), over real sockets to a real pipeline's worker
and scheduler processes; `make test-engines` runs the same paths against the real engine.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from actors import Pipeline, RequestFailedError, Vllm
from actors import _vllm_protocol as proto
from actors._tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from actors.messages import GetSchedulerStatistics, GetWorkerStatistics, WorkerStatistics
from tests.conftest import free_port
from tests.engines.record_golden import PROMPT
from tests.engines.test_protocol import FakeEngine, ids_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.timeout(60)

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
PROMPT_IDS: list[int] = TOKENIZER.encode(PROMPT, add_special_tokens=False).ids
#: What the recorded greedy request generated.
GREEDY = ids_of("outputs-greedy")


#: The largest frame the pipelines below take from the engine (`Vllm.max_frame`): its
#: least, far above a recorded step's few hundred bytes.
MAX_FRAME = 64 << 10


@contextlib.asynccontextmanager
async def _attached(direct: bool) -> AsyncIterator[tuple[Pipeline, FakeEngine]]:
    """A one-worker pipeline whose engine is the fake: its worker is the engine's client
    (``direct``), or its scheduler is."""
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEngine(address)
    spec = Vllm(handshake=address, unreachable_after=1.0, direct=direct, max_frame=MAX_FRAME)
    try:
        async with Pipeline(workers=1, engine=spec) as pipeline:
            await engine.start()
            yield pipeline, engine
    finally:
        engine.close()


@pytest.fixture
async def served() -> AsyncIterator[tuple[Pipeline, FakeEngine]]:
    async with _attached(direct=True) as attached:
        yield attached


async def worker_statistics(pipeline: Pipeline) -> WorkerStatistics:
    worker = pipeline.worker_ref(0)
    assert worker is not None
    stats: WorkerStatistics = await worker.ask(GetWorkerStatistics(), timeout=10)
    return stats


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
        # Its later outputs (sent before the abort landed) are its own: dropped, not strays.
        await engine.push(rid, "outputs-greedy", client=1)
        await serve_one_more(pipeline, engine)
        assert (await worker_statistics(pipeline)).engine_strays == 0

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
        stats = await worker_statistics(pipeline)
        assert (stats.engine_strays, stats.engine_rejected) == (1, 2)  # the two bad frames
        async with anyio.create_task_group() as tg:
            results = []

            async def generate() -> None:
                results.append(await pipeline.generate(PROMPT_IDS, max_new_tokens=8))

            tg.start_soon(generate)
            await serve_one(engine)  # an ADD next: the stray was not aborted again
        assert results[0].output_ids == GREEDY

    async def test_ids_outside_the_vocabulary_fail_their_request_not_the_worker(
        self, served: tuple[Pipeline, FakeEngine]
    ) -> None:
        pipeline, engine = served
        before = pipeline.worker_ref(0)
        async with anyio.create_task_group() as tg:
            failures = []

            async def generate() -> None:
                try:
                    await pipeline.generate(PROMPT_IDS, max_new_tokens=8)
                except RequestFailedError as err:
                    failures.append(str(err))

            tg.start_soon(generate)
            _, body = await next_frame(engine)
            forged = [0, [[body[0], [-1, 1 << 40]]]]
            await engine.outputs[1].send(msgspec.msgpack.encode(forged))
            assert await next_frame(engine) == (proto.ABORT, [body[0]])
        assert "outside the vocabulary" in failures[0]
        assert pipeline.worker_ref(0) == before  # the same incarnation serves on
        await serve_one_more(pipeline, engine)

    async def test_an_engine_that_never_pauses_leaves_it_answering(
        self, served: tuple[Pipeline, FakeEngine]
    ) -> None:
        # Frames waiting on its output socket the whole time: a reader that never lets its
        # event loop turn would leave every ask (and liveness probe) unanswered.
        pipeline, engine = served
        address = engine.outputs[1].getsockopt_string(zmq.LAST_ENDPOINT)
        nothing = msgspec.msgpack.encode([0, []])  # a step's outputs: none
        flooding = threading.Event()
        stop = threading.Event()

        def flood() -> None:
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(address)
            try:
                while not stop.is_set():
                    if push.poll(10, zmq.POLLOUT):  # the worker takes them at its pace
                        push.send(nothing)
                        flooding.set()
            finally:
                ctx.destroy(linger=0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, flood)
            try:
                await anyio.to_thread.run_sync(flooding.wait, 10.0)
                for _ in range(5):
                    await worker_statistics(pipeline)  # each within its 10 s
            finally:
                stop.set()
        assert flooding.is_set()
        await serve_one_more(pipeline, engine)

    async def test_a_frame_over_the_bound_ends_its_connection_unread(
        self, served: tuple[Pipeline, FakeEngine]
    ) -> None:
        # What libzmq holds for the worker is bounded in bytes: frames of at most
        # Vllm.max_frame (before, 64 MiB, 10,000 of them queued: 640 GiB).
        pipeline, engine = served
        address = engine.outputs[1].getsockopt_string(zmq.LAST_ENDPOINT)
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as push:
            push.setsockopt(zmq.LINGER, 0)
            push.connect(address)
            push.send(b"\xc1" * MAX_FRAME)  # at the bound: taken, and refused as garbage
            with anyio.fail_after(10):
                # A worker's counters announce nothing: polled.
                while (await worker_statistics(pipeline)).engine_rejected < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.05)  # sync-ok: polling a counter

        def send_too_large() -> bool:
            """Whether the worker's side ended the connection that sent it."""
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.RECONNECT_IVL, -1)  # an ended connection stays ended
            monitor = push.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            try:
                push.connect(address)
                if not monitor.poll(10_000):
                    return False
                assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
                push.send(b"\xc1" * (MAX_FRAME + 1))
                if not monitor.poll(10_000):
                    return False
                return bool(recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED)
            finally:
                push.disable_monitor()
                monitor.close(0)
                ctx.destroy(linger=0)

        assert await anyio.to_thread.run_sync(send_too_large)
        assert (await worker_statistics(pipeline)).engine_rejected == 1  # never decoded
        await serve_one_more(pipeline, engine)

    async def test_a_peer_claiming_the_engines_identity_gets_no_request(
        self, served: tuple[Pipeline, FakeEngine]
    ) -> None:
        pipeline, engine = served
        thief = engine.ctx.socket(zmq.DEALER)
        thief.setsockopt(zmq.IDENTITY, b"\x00\x00")
        thief.setsockopt(zmq.LINGER, 0)
        thief.connect(engine.client_addresses[1])
        await thief.send(b"")  # connected: its handshake is done once the worker reads it
        await serve_one_more(pipeline, engine)  # the engine still gets the worker's requests
        assert not await thief.poll(100)
        thief.close()


async def serve_one_more(pipeline: Pipeline, engine: FakeEngine) -> None:
    """A request the engine (client 1's socket) gets and answers: the worker serves."""
    async with anyio.create_task_group() as tg:
        results = []

        async def generate() -> None:
            results.append(await pipeline.generate(PROMPT_IDS, max_new_tokens=8))

        tg.start_soon(generate)
        await serve_one(engine)
    assert results[0].output_ids == GREEDY


@pytest.fixture(params=["worker", "scheduler"])
async def either_client(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[Pipeline, FakeEngine, int]]:
    """A pipeline whose engine's client is its worker (client 1), or its scheduler (client
    0, ``direct=False``); the engine; the client's index."""
    direct = request.param == "worker"
    async with _attached(direct) as (pipeline, engine):
        yield pipeline, engine, 1 if direct else 0


class TestWhatTheEngineMustNotSee:
    async def test_is_refused_before_it_is_sent_as_the_same_failure_on_either_path(
        self, either_client: tuple[Pipeline, FakeEngine, int]
    ) -> None:
        pipeline, engine, client = either_client
        with pytest.raises(RequestFailedError, match=r"outside the .*vocabulary"):
            await pipeline.generate([1 << 30], max_new_tokens=4)
        with pytest.raises(RequestFailedError, match="no room is left"):
            await pipeline.generate([5] * 512, max_new_tokens=4)
        # vLLM's input thread dies of these while decoding them: never sent.
        with pytest.raises(RequestFailedError, match="temperature"):
            await pipeline.generate(PROMPT_IDS, max_new_tokens=4, temperature=float("nan"))
        with pytest.raises(RequestFailedError, match="temperature"):
            await pipeline.generate(PROMPT_IDS, max_new_tokens=4, temperature=-1.0)
        nothing = await pipeline.generate(PROMPT_IDS, max_new_tokens=0)
        assert (nothing.finish_reason, nothing.completion_tokens) == ("length", 0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipeline.generate, PROMPT_IDS)
            with anyio.fail_after(10):
                kind, body = await engine.request(client=client)  # the first frame sent
            assert (kind, body[1]) == (proto.ADD, PROMPT_IDS)
            tg.cancel_scope.cancel()

    async def test_fails_with_the_same_reason_on_either_path_generated_or_streamed(
        self,
    ) -> None:
        refused: list[tuple[list[int], dict[str, Any]]] = [
            ([1 << 30], {}),
            ([5] * 512, {}),
            (PROMPT_IDS, {"temperature": float("nan")}),
            (PROMPT_IDS, {"temperature": -1.0}),
        ]

        async def reasons(direct: bool) -> list[str]:
            found = []
            async with _attached(direct) as (pipeline, _):
                for ids, sampling in refused:
                    with pytest.raises(RequestFailedError) as generated:
                        await pipeline.generate(ids, max_new_tokens=4, **sampling)
                    with pytest.raises(RequestFailedError) as streamed:
                        async for _piece in pipeline.stream(ids, max_new_tokens=4, **sampling):
                            pass
                    found += [generated.value.reason, streamed.value.reason]
            return found

        direct, scheduled = await reasons(True), await reasons(False)
        assert direct == scheduled
        assert len(set(direct)) == len(refused)  # generated and streamed alike


class TestAnEngineThatNeverConnects:
    async def test_the_workers_requests_fail_after_unreachable_after_naming_why(self) -> None:
        address = f"tcp://127.0.0.1:{free_port()}"
        engine = FakeEngine(address, connect_inputs=False)  # as behind a closed port
        try:
            async with Pipeline(
                workers=1, engine=Vllm(handshake=address, unreachable_after=0.5)
            ) as pipeline:
                await engine.start()
                with anyio.fail_after(20), pytest.raises(RequestFailedError, match="port"):
                    await pipeline.generate(PROMPT_IDS, max_new_tokens=4)
                # Refused at once while it is unreachable.
                with anyio.fail_after(5), pytest.raises(RequestFailedError, match="port"):
                    await pipeline.generate(PROMPT_IDS, max_new_tokens=4)
        finally:
            engine.close()

    async def test_a_request_whose_outputs_never_come_fails_after_silence_timeout(self) -> None:
        address = f"tcp://127.0.0.1:{free_port()}"
        engine = FakeEngine(address, connect_outputs=False)  # its outputs reach nobody
        try:
            spec = Vllm(handshake=address, heartbeat=0.2, silence_timeout=1.0)
            async with (
                Pipeline(workers=1, engine=spec) as pipeline,
                anyio.create_task_group() as tg,
            ):
                await engine.start()
                # The scheduler's own output is connected and its questions are answered:
                # the engine is lost to the worker alone. Unanswered, the scheduler gives
                # the engine up after the same second, and whichever of the two is first
                # decides how the request ends (lost with the scheduler, it is resubmitted
                # and waits for the engine to be ready again).
                tg.start_soon(engine.answer_liveness)
                with anyio.fail_after(20), pytest.raises(RequestFailedError, match="nothing"):
                    await pipeline.generate(PROMPT_IDS, max_new_tokens=4)
                # Its ADD, the worker's questions whether the engine lives, its ABORT.
                kind, body = await next_frame(engine)
                assert kind == proto.ADD
                frames: list[tuple[bytes, Any]] = []
                with anyio.fail_after(10):
                    while not frames or frames[-1][0] != proto.ABORT:
                        frames.append(await next_frame(engine))
                assert frames[-1][1] == [body[0]]  # the request it gave up, aborted
                kinds = [k for k, _ in frames]
                assert proto.UTILITY in kinds
                tg.cancel_scope.cancel()
        finally:
            engine.close()
