"""`actors._vllm_client.VllmClient`, a worker's own connection to vLLM's engine, in this
process: no engine connects to it, or a stand-in one (a DEALER with engine 0's identity)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio
import pytest
import zmq
import zmq.asyncio

from actors import _vllm_protocol as proto
from actors._vllm_client import VllmClient
from actors._vllm_engine import ENGINE_IDENTITY
from actors.engines import EngineClient
from actors.messages import SamplingParams

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

pytestmark = pytest.mark.timeout(30)


class Unreachable:
    """What the client said it gave up, each time it did."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.event = anyio.Event()

    async def __call__(self, reason: str, dropped: list[str]) -> None:
        self.calls.append((reason, dropped))
        self.event.set()

    async def next(self) -> tuple[str, list[str]]:
        with anyio.fail_after(10):
            await self.event.wait()
        self.event = anyio.Event()
        return self.calls[-1]


def said(vllm: VllmClient) -> str | None:
    """Why the client says the engine does not reach it (read anew each time)."""
    return vllm.unreachable


async def no_outputs(outputs: list[proto.EngineCoreOutput]) -> None:
    del outputs


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[tuple[VllmClient, Unreachable, EngineClient]]:
    """A running client that gives up on an engine not connected after 0.1 s."""
    addresses = EngineClient(
        1, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", unreachable_after=0.1
    )
    unreachable = Unreachable()
    vllm = VllmClient(addresses, eos=2, on_outputs=no_outputs, on_unreachable=unreachable)
    async with anyio.create_task_group() as tg:
        tg.start_soon(vllm.run)
        yield vllm, unreachable, addresses
        tg.cancel_scope.cancel()


class TestAnEngineThatIsNotConnected:
    async def test_fails_what_waits_and_says_why_until_the_engine_is_replaced(
        self, client: tuple[VllmClient, Unreachable, EngineClient]
    ) -> None:
        vllm, unreachable, addresses = client
        assert vllm.add("r1", [1, 2, 3], SamplingParams(max_new_tokens=4))
        reason, dropped = await unreachable.next()
        assert dropped == ["r1"]
        assert said(vllm) == reason
        vllm.forget()  # the engine was replaced: nothing is known of the new one yet
        assert said(vllm) is None
        # The new engine connects: what is sent now goes to it.
        ctx = zmq.asyncio.Context()
        engine = ctx.socket(zmq.DEALER)
        try:
            engine.setsockopt(zmq.IDENTITY, ENGINE_IDENTITY)
            engine.setsockopt(zmq.LINGER, 0)
            engine.connect(addresses.input)
            assert vllm.add("r2", [1, 2, 3], SamplingParams(max_new_tokens=4))
            with anyio.fail_after(10):
                kind, _ = await engine.recv_multipart()
            assert kind == proto.ADD
            assert said(vllm) is None
        finally:
            ctx.destroy(linger=0)

    async def test_logs_its_outage_once_however_many_requests_it_fails(
        self,
        client: tuple[VllmClient, Unreachable, EngineClient],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        vllm, unreachable, _ = client
        with caplog.at_level(logging.ERROR, logger="tokenyard.vllm"):
            for k in range(3):
                assert vllm.add(f"r{k}", [1, 2, 3], SamplingParams(max_new_tokens=4))
                _, dropped = await unreachable.next()
                assert dropped == [f"r{k}"]
        lines = [r for r in caplog.records if "has not been connected" in r.getMessage()]
        assert len(lines) == 1
