"""The protocol structs against frames recorded from vLLM 0.32.0 (`record_golden`), and the
generator against a fake engine that replays them: no vLLM process here."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from actors import Vllm
from actors import _vllm_protocol as proto
from actors._tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from actors._vllm_engine import EngineLostError, VllmModel, open_vllm
from actors.engines import Produced
from actors.messages import SamplingParams
from tests.conftest import free_port

from .record_golden import GOLDEN, PROMPT, requests

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

FRAMES: list[dict[str, Any]] = json.loads(GOLDEN.read_text())


def frames(name: str) -> list[list[bytes]]:
    return [[bytes.fromhex(h) for h in f["frames"]] for f in FRAMES if f["name"] == name]


def outputs(name: str) -> list[proto.EngineCoreOutputs]:
    return [msgspec.msgpack.decode(f[0], type=proto.EngineCoreOutputs) for f in frames(name)]


def ids_of(name: str) -> list[int]:
    return [i for m in outputs(name) for o in m.outputs for i in o.new_token_ids]


class TestTheEnginesFrames:
    def test_the_handshake_decodes(self) -> None:
        hello = msgspec.msgpack.decode(frames("hello")[0][0], type=proto.Handshake)
        assert (hello.status, hello.headless) == ("HELLO", True)
        ready = msgspec.msgpack.decode(frames("ready")[0][0], type=proto.Handshake)
        assert ready.status == "READY"
        response = msgspec.msgpack.decode(frames("ready-response")[0][0], type=proto.ReadyResponse)
        assert response.vllm_version == proto.VLLM_VERSION
        assert (response.max_num_seqs, response.max_model_len) == (8, 512)

    def test_outputs_decode_to_the_ids_and_ends_asked_for(self) -> None:
        greedy = outputs("outputs-greedy")
        assert len(ids_of("outputs-greedy")) == 8
        assert greedy[-1].outputs[-1].finish_reason == proto.FinishReason.LENGTH
        stop_id = ids_of("outputs-greedy")[2]
        last = outputs("outputs-stop-id")[-1].outputs[-1]
        assert last.finish_reason == proto.FinishReason.STOP
        assert last.stop_reason == stop_id
        assert ids_of("outputs-stop-id")[-1] == stop_id
        assert len(ids_of("outputs-seeded")) <= 4

    def test_a_utility_answer_and_the_death_frame_decode(self) -> None:
        answer = outputs("utility-output")[0].utility_output
        assert answer is not None
        assert (answer.call_id, answer.failure_message) == (1, None)
        assert frames("engine-core-dead") == [[proto.ENGINE_CORE_DEAD]]

    def test_finish_codes_map_to_the_pipelines_reasons(self) -> None:
        texts = [proto.finish_reason_text(c) for c in (0, 1, 2, 3, 4, 99)]
        assert texts == ["stop", "length", "abort", "abort", "stop", "abort"]


class TestOurFrames:
    def test_requests_encode_to_the_bytes_the_engine_accepted(self) -> None:
        prompt = load_tokenizer(DEFAULT_TOKENIZER_PATH).encode(PROMPT, add_special_tokens=False)
        rebuilt = requests(prompt.ids, ids_of("outputs-greedy")[2])
        encoder = msgspec.msgpack.Encoder()
        for name, request in rebuilt.items():
            assert frames(f"add-{name}") == [[proto.ADD, encoder.encode(request)]], name
        assert frames("abort-long") == [[proto.ABORT, encoder.encode(["long"])]]

    def test_the_handshake_answer_names_the_sockets(self) -> None:
        sent = msgspec.msgpack.decode(frames("handshake-metadata")[0][0])
        assert set(sent) == {"addresses", "parallel_config"}
        assert set(sent["addresses"]) == {
            "inputs",
            "outputs",
            "coordinator_input",
            "coordinator_output",
            "frontend_stats_publish_address",
        }


class FakeEngine:
    """An engine that replays the recorded frames over real sockets.

    It connects to every client the handshake names, as vLLM's engine does: client 0 (the
    scheduler) through `input` and `output`, every client through `inputs` and `outputs`.
    """

    def __init__(
        self, handshake: str, *, connect_inputs: bool = True, connect_outputs: bool = True
    ) -> None:
        self.connect_inputs = connect_inputs
        self.connect_outputs = connect_outputs
        self.client_addresses: list[str] = []
        self.ctx = zmq.asyncio.Context()
        self.handshake = self.ctx.socket(zmq.DEALER)
        self.handshake.setsockopt(zmq.IDENTITY, b"\x00\x00")
        self.handshake.setsockopt(zmq.LINGER, 0)
        self.handshake.connect(handshake)
        self.inputs: list[zmq.asyncio.Socket] = []
        self.outputs: list[zmq.asyncio.Socket] = []

    @property
    def input(self) -> zmq.asyncio.Socket:
        return self.inputs[0]

    @property
    def output(self) -> zmq.asyncio.Socket:
        return self.outputs[0]

    async def start(self) -> None:
        await self.handshake.send(frames("hello")[0][0])
        sent = msgspec.msgpack.decode(await self.handshake.recv(), type=proto.HandshakeMetadata)
        self.client_addresses = list(sent.addresses.inputs)
        for k, address in enumerate(sent.addresses.inputs):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, b"\x00\x00")
            sock.setsockopt(zmq.LINGER, 0)
            if k == 0 or self.connect_inputs:  # else: as if the worker's port were closed
                sock.connect(address)
                await sock.send(frames("ready-response")[0][0])  # on every input, as vLLM
            self.inputs.append(sock)
        for k, address in enumerate(sent.addresses.outputs):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if k == 0 or self.connect_outputs:  # else: as if the worker's port were closed
                sock.connect(address)
            self.outputs.append(sock)
        await self.handshake.send(frames("ready")[0][0])

    async def request(self, client: int = 0) -> tuple[bytes, Any]:
        kind, body = await self.inputs[client].recv_multipart()
        return kind, msgspec.msgpack.decode(body)

    async def push(self, rid: str, name: str, client: int = 0) -> None:
        for frame in frames(name):
            message = msgspec.msgpack.decode(frame[0])
            for out in message[1]:
                out[0] = rid
            await self.outputs[client].send(msgspec.msgpack.encode(message))

    async def answer_liveness(self, client: int = 0) -> None:
        """Answer every question of ``client`` whether the engine lives (its utility
        calls), as vLLM's engine does, until cancelled; it must send nothing else."""
        while True:
            kind, _ = await self.request(client)
            assert kind == proto.UTILITY, kind
            await self.outputs[client].send(frames("utility-output")[0][0])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class Woken:
    def __init__(self) -> None:
        self.event = anyio.Event()

    def __call__(self) -> None:
        self.event.set()

    async def until(self, check: Any) -> None:
        with anyio.fail_after(10):
            while not check():
                self.event = anyio.Event()
                await self.event.wait()


@pytest.fixture
async def attached() -> AsyncIterator[tuple[VllmModel, FakeEngine, Woken]]:
    address = f"tcp://127.0.0.1:{free_port()}"
    woken = Woken()
    spec = Vllm(handshake=address, heartbeat=0.2, silence_timeout=3.0)
    model = await open_vllm(spec, load_tokenizer(DEFAULT_TOKENIZER_PATH), woken)
    engine = FakeEngine(address)
    try:
        assert model.capacity == 0
        await engine.start()
        await woken.until(lambda: model.capacity == 8)
        yield model, engine, woken
    finally:
        engine.close()
        await model.aclose()


async def follow_with_output(model: VllmModel, engine: FakeEngine, woken: Woken) -> None:
    """Run a request whose output comes after what the engine sent before: once it is
    taken, the engine's earlier frames were handled (the output socket keeps their order)."""
    model.admit("after", [7], SamplingParams(max_new_tokens=8))
    kind, body = await engine.request()
    assert kind == proto.ADD
    await engine.push(body[0], "outputs-greedy")
    taken: list[int] = []

    def drained() -> bool:
        if model.ready():
            for produced in model.take().values():
                taken.extend(produced.ids)
        return len(taken) == 8

    await woken.until(drained)


def alive(model: VllmModel) -> bool:
    try:
        model.ready()
    except EngineLostError:
        return False
    return True


class TestTheGenerator:
    async def test_a_request_goes_out_as_vllms_front_end_sends_it_and_its_ids_come_back(
        self, attached: tuple[VllmModel, FakeEngine, Woken]
    ) -> None:
        model, engine, woken = attached
        sampling = SamplingParams(max_new_tokens=8, stop_token_ids=(5,), temperature=0.0)
        model.admit("k", [10, 11, 12], sampling)
        kind, body = await engine.request()
        assert kind == proto.ADD
        rid, prompt, _, params = body[:4]
        assert prompt == [10, 11, 12]
        assert params["max_tokens"] == 8
        assert model.eos is not None
        assert params["_eos_token_id"] == model.eos
        assert sorted(params["_all_stop_token_ids"]) == sorted({5, model.eos})
        assert params["output_kind"] == proto.OutputKind.DELTA
        await engine.push(rid, "outputs-greedy")
        taken: list[int] = []
        ends: list[str | None] = []

        def drained() -> bool:
            if model.ready():
                for produced in model.take().values():
                    taken.extend(produced.ids)
                    ends.append(produced.finished)
            return "length" in ends

        await woken.until(drained)
        assert taken == ids_of("outputs-greedy")

    async def test_a_cancel_sends_abort_and_later_outputs_are_dropped(
        self, attached: tuple[VllmModel, FakeEngine, Woken]
    ) -> None:
        model, engine, woken = attached
        model.admit("k", [10, 11], SamplingParams(max_new_tokens=8))
        _, body = await engine.request()
        model.cancel("k")
        assert await engine.request() == (proto.ABORT, [body[0]])
        await engine.push(body[0], "outputs-greedy")
        await follow_with_output(model, engine, woken)
        assert model.dropped_outputs == 8

    async def test_ids_outside_the_vocabulary_end_the_request_with_abort_at_the_engine_too(
        self, attached: tuple[VllmModel, FakeEngine, Woken]
    ) -> None:
        model, engine, woken = attached
        model.admit("k", [10, 11], SamplingParams(max_new_tokens=8))
        _, body = await engine.request()
        ends: list[Produced] = []

        def ended() -> bool:
            if model.ready():
                ends.extend(model.take().values())
            return bool(ends)

        # What no detokenizer could decode: a negative id, then (the request ended) one
        # past the vocabulary, which finds no request any more.
        for ids in ([5, -1], [5, model.vocab_size]):
            await engine.output.send(msgspec.msgpack.encode([0, [[body[0], ids]]]))
        await woken.until(ended)
        assert ends == [Produced([], "abort")]  # none of its ids reach the detokenizer
        assert await engine.request() == (proto.ABORT, [body[0]])
        await follow_with_output(model, engine, woken)
        assert model.rejected_outputs + model.dropped_outputs == 2
        assert model.rejected_outputs >= 1
        model.admit("k2", [10, 11], SamplingParams(max_new_tokens=8))
        _, body = await engine.request()
        await engine.output.send(msgspec.msgpack.encode([0, [[body[0], [model.vocab_size]]]]))
        ends.clear()
        await woken.until(ended)
        assert ends == [Produced([], "abort")]
        assert alive(model)

    async def test_frames_that_do_not_decode_are_counted_and_the_engine_lives_on(
        self, attached: tuple[VllmModel, FakeEngine, Woken]
    ) -> None:
        model, engine, woken = attached
        for junk in (b"\xc1", b"", b"\x93\x01\x02", msgspec.msgpack.encode({"a": 1})):
            await engine.output.send(junk)
        await engine.output.send_multipart([b"\x90", b"a tensor buffer"])  # no outputs
        await follow_with_output(model, engine, woken)
        assert model.rejected_frames == 4
        assert alive(model)

    async def test_engine_core_dead_loses_the_engine(
        self, attached: tuple[VllmModel, FakeEngine, Woken]
    ) -> None:
        model, engine, woken = attached
        await engine.output.send(proto.ENGINE_CORE_DEAD)
        await woken.until(lambda: not alive(model))
        with pytest.raises(EngineLostError, match="ENGINE_CORE_DEAD"):
            model.take()

    async def test_a_closed_connection_loses_the_engine(
        self, attached: tuple[VllmModel, FakeEngine, Woken]
    ) -> None:
        model, engine, woken = attached
        engine.input.close(linger=0)
        await woken.until(lambda: not alive(model))
        with pytest.raises(EngineLostError, match="closed its connection"):
            model.admit("k", [1], SamplingParams())

    async def test_an_engine_silent_past_the_timeout_is_lost_after_being_asked(
        self, attached: tuple[VllmModel, FakeEngine, Woken]
    ) -> None:
        model, engine, woken = attached
        kind, body = await engine.request()  # the heartbeat, unanswered
        assert (kind, body[2]) == (proto.UTILITY, "is_sleeping")
        await woken.until(lambda: not alive(model))
        with pytest.raises(EngineLostError, match="said nothing"):
            model.ready()
