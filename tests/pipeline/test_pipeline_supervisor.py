"""Registration at the pipeline supervisor: real members in their own processes, except a
gated one that runs in the test's event loop so the test decides when it takes a route."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from actors import PipelineConfig
from actors.messages import (
    CheckLoad,
    Generate,
    GetRouterStatistics,
    GetSchedulerStatistics,
    Origin,
    RegisterWorker,
    RouterStatistics,
    SamplingParams,
    SchedulerStatistics,
)
from runtime import ActorRef, ActorSystem

from ._actors import (
    EventInbox,
    Events,
    Gate,
    GetRegistry,
    InspectableSupervisor,
    Registry,
    Replies,
    ReplyInbox,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


class Harness:
    """A pipeline supervisor under test, its client inbox and its system."""

    def __init__(
        self, system: ActorSystem, events: Events, client: ActorRef[Any], sup: ActorRef[Any]
    ) -> None:
        self.system = system
        self.events = events
        self.client = client
        self.supervisor = sup

    async def registry(self) -> Registry:
        registry = await self.supervisor.ask(GetRegistry(), timeout=10)
        assert isinstance(registry, Registry)
        return registry

    async def router_stats(self) -> RouterStatistics:
        router = await self.system.lookup("router")
        stats = await router.ask(GetRouterStatistics(), timeout=10)
        assert isinstance(stats, RouterStatistics)
        return stats

    async def generate(self, worker: ActorRef[Any], rid: str) -> None:
        """Send a request straight to ``worker``; its output goes to the client inbox."""
        sampling = SamplingParams(max_new_tokens=4)
        msg = Generate(rid=rid, reply_to=self.client, text="Hello there", sampling=sampling)
        await worker.tell(msg)


@asynccontextmanager
async def open_supervisor(
    *, gated: str | None = None, gate: Gate | None = None, **config: Any
) -> AsyncIterator[Harness]:
    """One worker under an `InspectableSupervisor`, as `Pipeline` starts it, minus the
    caller side: the client inbox only records what it is told."""
    async with ActorSystem(name="registration") as system:
        events = Events()
        client = await system.spawn(EventInbox, events, name="client", process=False)
        sup = await system.spawn(
            InspectableSupervisor,
            PipelineConfig(workers=1, **config),
            client,
            gated=gated,
            gate=gate,
            name="pipeline-supervisor",
            process=False,
        )
        try:
            yield Harness(system, events, client, sup)
        finally:
            if gate is not None:
                gate.open()  # a member stuck at its gate would hold up the shutdown


class TestRegistration:
    @pytest.mark.parametrize("member", ["detokenizer:0", "router"])
    async def test_a_worker_serves_only_once_the_detokenizer_and_the_router_hold_its_route(
        self, member: str
    ) -> None:
        gate = Gate()
        with anyio.fail_after(30):
            async with open_supervisor(gated=member, gate=gate) as h:
                await gate.asked.wait()  # the worker registered; the member holds its route
                worker = await h.system.lookup("tokenizer_worker:0")
                await h.generate(worker, "early")
                # A served request answers in milliseconds; this one must not be answered,
                # nor reach the scheduler, until the gate opens.
                await anyio.sleep(0.5)  # sync-ok: asserting an absence
                assert h.events.log == []
                scheduler = await h.system.lookup("scheduler")
                stats = await scheduler.ask(GetSchedulerStatistics(), timeout=10)
                assert isinstance(stats, SchedulerStatistics)
                assert stats.received == 0
                gate.open()
                await h.events.wait_until(lambda: h.events.finished("early"))
                ups = h.events.ups
                assert [(up.worker_id, up.ref) for up in ups] == [(0, worker)]
                assert h.events.log.index(ups[0]) < h.events.first_output_at("early")
                assert (await h.registry()).origins == [Origin(0, worker.incarnation)]

    async def test_a_duplicate_registration_at_another_address_is_warned_about_counted_and_ignored(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        with anyio.fail_after(30):
            async with open_supervisor() as h:
                await h.events.wait_until(lambda: bool(h.events.ups))
                worker = h.events.ups[0].ref
                before = await h.registry()
                assert before.origins == [Origin(0, worker.incarnation)]
                assert before.addresses == [worker.address]
                assert before.duplicate_registrations == 0
                # Not a worker at all: the supervisor must ignore it whatever it is.
                impostor: ActorRef[Any] = await h.system.spawn(
                    EventInbox, Events(), name="impostor", process=False
                )
                dup = RegisterWorker(worker_id=0, incarnation=worker.incarnation, address=impostor)
                with caplog.at_level(logging.WARNING, logger="tokenyard.pipeline"):
                    await h.supervisor.ask(dup, timeout=10)
                assert "duplicate registration" in caplog.text
                assert impostor.address in caplog.text
                after = await h.registry()
                assert (after.origins, after.addresses) == (before.origins, before.addresses)
                assert after.duplicate_registrations == 1
                assert (await h.router_stats()).routes == 1
                # Output and control replies still reach the registered worker, not the
                # impostor: the detokenizer and the router kept its route.
                await h.generate(worker, "after-the-duplicate")
                await h.events.wait_until(lambda: h.events.finished("after-the-duplicate"))
                replies = Replies()
                inbox = await h.system.spawn(ReplyInbox, replies, name="control", process=False)
                await worker.tell(CheckLoad(reply_to=inbox))
                await replies.wait_until(lambda: bool(replies.loads))
                assert replies.loads[0].origin == Origin(0, worker.incarnation)
                assert h.events.ups == [h.events.ups[0]]  # no WorkerUp for the impostor
                assert (await h.system.statistics(impostor)).received == 0

    async def test_a_registration_a_member_never_acknowledges_fails_and_the_worker_restarts(
        self,
    ) -> None:
        gate = Gate()
        with anyio.fail_after(30):
            async with open_supervisor(gated="router", gate=gate, register_timeout=2.0) as h:
                await gate.asked.wait()
                first = await h.system.lookup("tokenizer_worker:0")
                down = await h.system.watch(first)
                # The supervisor gave the router a quarter of register_timeout, then refused
                # the registration; the worker died of the refusal, unacknowledged.
                assert "not registered: the router did not take its route" in down.reason
                assert h.events.ups == []
                gate.open()
                await h.events.wait_until(lambda: bool(h.events.ups))
                (up,) = h.events.ups
                assert up.worker_id == 0
                assert up.ref.incarnation > first.incarnation
                registry = await h.registry()
                assert registry.origins == [Origin(0, up.ref.incarnation)]
                assert registry.failed_registrations >= 1
                # The refused route was taken back from the router once it got to it.
                assert (await h.router_stats()).routes == 1
                await h.generate(up.ref, "after-the-restart")
                await h.events.wait_until(lambda: h.events.finished("after-the-restart"))
