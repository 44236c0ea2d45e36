"""The router: each control reply reaches the worker incarnation it names, and no other.

The router runs in the test's event loop (``process=False``) or, where the wire matters, in
its own process (``process=True``); the workers are in-process test actors that record what
reaches them and signal an event, so a test waits for a message, never for time. The router
is the only sender to each worker, and one sender to one mailbox is first in, first out: a
marker sent through the router last proves everything it forwarded to that worker before
has arrived, so "nothing else arrived" is checked by waiting for the marker.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from actors.messages import (
    AbortNotice,
    FlushReply,
    GetRouterStatistics,
    LoadReply,
    Origin,
    RouteAck,
    RouterStatistics,
    RouteUpdate,
)
from actors.router import Router
from runtime import Actor, ActorRef, ActorSystem, handler

from ._inbox import Inbox

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

ControlReply = LoadReply | FlushReply | AbortNotice

#: The request id of the marker `Harness.flushed` sends; the replies of a test use others.
MARKER = -1

A, B = Origin(0, 1), Origin(1, 1)
A_RESTARTED = Origin(0, 2)

in_loop_and_own_process = pytest.mark.parametrize(
    "process", [False, True], ids=["router-in-loop", "router-in-own-process"]
)


class RecordingWorker(Actor[LoadReply | FlushReply | AbortNotice]):
    """Stands for a tokenizer worker: records every control reply the router passes it."""

    def __init__(self, inbox: Inbox[ControlReply]) -> None:
        self.inbox = inbox

    @handler
    def load(self, msg: LoadReply) -> None:
        self.inbox.put(msg)

    @handler
    def flush(self, msg: FlushReply) -> None:
        self.inbox.put(msg)

    @handler
    def abort(self, msg: AbortNotice) -> None:
        self.inbox.put(msg)


def replies(origin: Origin, first_id: int = 0) -> list[ControlReply]:
    """One control reply of each kind for ``origin``, told apart by their ids."""
    return [
        LoadReply(origin=origin, request_id=first_id, running=3, waiting=1, step=9),
        FlushReply(origin=origin, request_id=first_id + 1, success=True),
        AbortNotice(origin=origin, rids=[f"rid-{first_id + 2}"], reason="queue full"),
    ]


def is_marker(item: ControlReply) -> bool:
    return isinstance(item, LoadReply) and item.request_id == MARKER


@dataclass
class Harness:
    system: ActorSystem
    router: ActorRef[Any]
    inboxes: dict[str, Inbox[ControlReply]] = field(default_factory=dict)
    workers: dict[str, ActorRef[Any]] = field(default_factory=dict)

    async def worker(self, name: str) -> ActorRef[Any]:
        """Start a recording worker whose inbox is ``self.inboxes[name]``."""
        inbox = Inbox[ControlReply]()
        ref = await self.system.spawn(RecordingWorker, inbox, name=name, process=False)
        self.inboxes[name], self.workers[name] = inbox, ref
        return ref

    async def route(self, origin: Origin, worker: str | None) -> None:
        """Route ``origin`` to the named worker, or drop its route (``None``)."""
        ref = None if worker is None else self.workers[worker]
        ack = await self.router.ask(RouteUpdate(origin=origin, ref=ref), timeout=10)
        assert ack == RouteAck(origin=origin)

    async def tell(self, *msgs: ControlReply) -> None:
        for msg in msgs:
            await self.router.tell(msg)

    async def stats(self) -> RouterStatistics:
        # Asked after the tells: the reply proves every reply told before was handled.
        stats = await self.router.ask(GetRouterStatistics(), timeout=10)
        assert isinstance(stats, RouterStatistics)
        return stats

    async def flushed(self, origin: Origin, worker: str) -> list[ControlReply]:
        """Everything the router passed ``worker`` before a marker for ``origin``, which
        must be routed to it; the marker itself is left out."""
        marker = LoadReply(origin=origin, request_id=MARKER, running=0, waiting=0, step=0)
        await self.router.tell(marker)
        got = await self.inboxes[worker].wait_until(lambda items: any(map(is_marker, items)))
        assert got[-1] == marker
        return got[:-1]


@asynccontextmanager
async def open_router(*, process: bool = False) -> AsyncIterator[Harness]:
    async with ActorSystem() as system:
        router = await system.spawn(Router, name="router", process=process)
        yield Harness(system, router)


class TestRouting:
    @in_loop_and_own_process
    async def test_each_control_reply_reaches_only_the_worker_of_its_origin(
        self, process: bool
    ) -> None:
        async with open_router(process=process) as h:
            await h.worker("worker-0")
            await h.worker("worker-1")
            await h.route(A, "worker-0")
            await h.route(B, "worker-1")
            for_a, for_b = replies(A), replies(B, first_id=10)
            for mine, theirs in zip(for_a, for_b, strict=True):
                await h.tell(mine, theirs)
            assert await h.flushed(A, "worker-0") == for_a
            assert await h.flushed(B, "worker-1") == for_b
            assert await h.stats() == RouterStatistics(
                forwarded=len(for_a) + len(for_b) + 2, dropped_unknown_origin=0, routes=2
            )

    async def test_a_worker_with_no_replies_gets_nothing(self) -> None:
        async with open_router() as h:
            await h.worker("worker-0")
            await h.worker("worker-1")
            await h.route(A, "worker-0")
            await h.route(B, "worker-1")
            await h.tell(*replies(A), *replies(A, first_id=3))
            assert await h.flushed(B, "worker-1") == []
            assert len(await h.flushed(A, "worker-0")) == 6


class TestDrops:
    @in_loop_and_own_process
    async def test_replies_for_an_origin_never_routed_are_dropped_and_counted(
        self, process: bool
    ) -> None:
        async with open_router(process=process) as h:
            await h.worker("worker-0")
            await h.route(A, "worker-0")
            # An unknown worker index, and an unknown incarnation of a routed index.
            await h.tell(*replies(Origin(7, 1)), *replies(A_RESTARTED))
            assert await h.stats() == RouterStatistics(
                forwarded=0, dropped_unknown_origin=6, routes=1
            )
            assert await h.flushed(A, "worker-0") == []

    async def test_replies_for_an_incarnation_whose_route_was_dropped_are_dropped_and_counted(
        self,
    ) -> None:
        async with open_router() as h:
            await h.worker("worker-0")
            await h.route(A, "worker-0")
            before = replies(A)
            await h.tell(*before)
            # Worker 0 died: the supervisor drops its route, then replies for it go stale.
            await h.route(A, None)
            await h.tell(*replies(A, first_id=3))
            assert await h.stats() == RouterStatistics(
                forwarded=3, dropped_unknown_origin=3, routes=0
            )
            # Its next incarnation records into the same inbox, so the marker proves the
            # stale replies never reached worker 0 at all.
            await h.route(A_RESTARTED, "worker-0")
            assert await h.flushed(A_RESTARTED, "worker-0") == before

    async def test_dropping_a_route_that_does_not_exist_is_acknowledged_and_changes_nothing(
        self,
    ) -> None:
        async with open_router() as h:
            await h.worker("worker-0")
            await h.route(A, "worker-0")
            await h.route(B, None)
            assert (await h.stats()).routes == 1


class TestRouteUpdates:
    async def test_a_new_ref_for_an_origin_takes_its_later_replies(self) -> None:
        async with open_router() as h:
            await h.worker("first")
            await h.worker("second")
            one, two = replies(A), replies(A, first_id=3)
            await h.route(A, "first")
            await h.tell(*one)
            await h.route(A, "second")
            await h.tell(*two)
            assert await h.flushed(A, "second") == two
            # Back to the first ref: its marker shows it never got the second batch.
            await h.route(A, "first")
            assert await h.flushed(A, "first") == one

    async def test_a_new_incarnations_route_replaces_the_old_incarnations(self) -> None:
        async with open_router() as h:
            await h.worker("worker-0-old")
            await h.worker("worker-0-new")
            await h.route(A, "worker-0-old")
            await h.route(A_RESTARTED, "worker-0-new")
            stale, fresh = replies(A), replies(A_RESTARTED, first_id=3)
            await h.tell(*stale, *fresh)
            assert await h.stats() == RouterStatistics(
                forwarded=3, dropped_unknown_origin=3, routes=1
            )
            assert await h.flushed(A_RESTARTED, "worker-0-new") == fresh
