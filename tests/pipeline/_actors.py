"""In-process helpers for the pipeline tests: inboxes that record what reaches them, and
pipeline members whose route updates wait at a gate the test opens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from actors import Detokenizer, PipelineConfig, PipelineSupervisor, Router
from actors.messages import (
    FlushReply,
    LoadReply,
    Origin,
    RequestOutputs,
    RouteAck,
    RouteUpdate,
    WorkerDown,
    WorkerUp,
)
from runtime import Actor, ActorRef, Message, Request, handler

if TYPE_CHECKING:
    from collections.abc import Callable

    from runtime import ChildSpec


class Replies:
    """Control replies one inbox received (shared with the test)."""

    def __init__(self) -> None:
        self.loads: list[LoadReply] = []
        self.flushes: list[FlushReply] = []
        self.arrived = anyio.Event()

    def add(self, msg: LoadReply | FlushReply) -> None:
        if isinstance(msg, LoadReply):
            self.loads.append(msg)
        else:
            self.flushes.append(msg)
        self.arrived.set()
        self.arrived = anyio.Event()

    def from_worker(self, k: int) -> int:
        """How many load and flush replies came from worker ``k`` (any incarnation)."""
        loads = sum(r.origin.worker == k for r in self.loads)
        return loads + sum(r.origin.worker == k for r in self.flushes)

    async def wait_until(self, done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds, checked at every arrival."""
        while not done():
            await self.arrived.wait()


class ReplyInbox(Actor[LoadReply | FlushReply]):
    """Receives the control replies a worker passes on."""

    def __init__(self, replies: Replies) -> None:
        self.replies = replies

    @handler
    def load(self, msg: LoadReply) -> None:
        self.replies.add(msg)

    @handler
    def flush(self, msg: FlushReply) -> None:
        self.replies.add(msg)


# -- a stand-in for the Pipeline's caller inbox -----------------------------------------------


class Events:
    """What the pipeline supervisor and the workers told a client, in arrival order."""

    def __init__(self) -> None:
        self.log: list[WorkerUp | WorkerDown | RequestOutputs] = []
        self.changed = anyio.Event()

    def add(self, msg: WorkerUp | WorkerDown | RequestOutputs) -> None:
        self.log.append(msg)
        self.changed.set()
        self.changed = anyio.Event()

    @property
    def ups(self) -> list[WorkerUp]:
        return [m for m in self.log if isinstance(m, WorkerUp)]

    def finished(self, rid: str) -> bool:
        """Whether the last output of ``rid`` arrived."""
        return any(
            o.rid == rid and o.finish_reason is not None
            for m in self.log
            if isinstance(m, RequestOutputs)
            for o in m.outputs
        )

    def first_output_at(self, rid: str) -> int:
        """The position in ``log`` of the first output of ``rid``."""
        for i, m in enumerate(self.log):
            if isinstance(m, RequestOutputs) and any(o.rid == rid for o in m.outputs):
                return i
        raise LookupError(rid)

    async def wait_until(self, done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds, checked at every arrival."""
        while not done():
            await self.changed.wait()


class EventInbox(Actor[WorkerUp | WorkerDown | RequestOutputs]):
    """Records ``WorkerUp``, ``WorkerDown`` and request outputs, as the Pipeline's inbox
    would receive them."""

    def __init__(self, events: Events) -> None:
        self.events = events

    @handler
    def up(self, msg: WorkerUp) -> None:
        self.events.add(msg)

    @handler
    def down(self, msg: WorkerDown) -> None:
        self.events.add(msg)

    @handler
    def outputs(self, msg: RequestOutputs) -> None:
        self.events.add(msg)


# -- members whose route updates wait at a gate ---------------------------------------------


class Gate:
    """Holds route updates until the test opens it (in-process members only)."""

    def __init__(self) -> None:
        self.asked = anyio.Event()
        self.opened = anyio.Event()

    async def pass_through(self) -> None:
        self.asked.set()
        await self.opened.wait()

    def open(self) -> None:
        self.opened.set()


class GatedRouter(Router):
    """A router that takes a route only once its gate is open."""

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = gate

    # The same name as the overridden handler (one message type, one handler), made async.
    @handler
    async def route(self, msg: RouteUpdate) -> RouteAck:  # type: ignore[override]
        await self.gate.pass_through()
        return super().route(msg)


class GatedDetokenizer(Detokenizer):
    """A detokenizer that takes a route only once its gate is open."""

    def __init__(self, gate: Gate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate

    @handler
    async def route(self, msg: RouteUpdate) -> RouteAck:  # type: ignore[override]
        await self.gate.pass_through()
        return super().route(msg)


class GetRegistry(Request["Registry"]):
    """Ask an `InspectableSupervisor` for its registry."""


class Registry(Message):
    """The registered worker incarnations and the registration counters."""

    origins: list[Origin]
    addresses: list[str]
    duplicate_registrations: int
    failed_registrations: int


class InspectableSupervisor(PipelineSupervisor):
    """The pipeline supervisor, answering `GetRegistry`, with one member optionally gated
    (then run in the supervisor's event loop, so it can share the test's `Gate`)."""

    def __init__(
        self,
        config: PipelineConfig,
        client: ActorRef[Any],
        gated: str | None = None,
        gate: Gate | None = None,
    ) -> None:
        super().__init__(config, client)
        self.gated = gated
        self.gate = gate

    def spec_for(self, spec: ChildSpec) -> ChildSpec:
        spec = super().spec_for(spec)
        if spec.name != self.gated:
            return spec
        member = {"router": GatedRouter, "detokenizer:0": GatedDetokenizer}[spec.name]
        kwargs = {**spec.kwargs, "gate": self.gate}
        return msgspec.structs.replace(
            spec, actor=member, process=False, kwargs=kwargs, stall_timeout=None
        )

    @handler
    def registry(self, msg: GetRegistry) -> Registry:
        return Registry(
            origins=list(self.routes),
            addresses=[ref.address for ref in self.routes.values()],
            duplicate_registrations=self.duplicate_registrations,
            failed_registrations=self.failed_registrations,
        )
