"""The metrics collector keeps dead incarnations by its rule: for ``retention`` seconds after
their ``Down``, and at most ``max_dead`` of them, the oldest dropped first.

The actors are real processes, stopped one at a time; the collector runs in the test's
loop, as it is meant to (``process=False``), so its clock can be the test's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from runtime import ActorRef, ActorSystem, Cause, GetMetrics, MetricsCollector, SystemMetrics

from ._actors import Echo

if TYPE_CHECKING:
    from collections.abc import Callable

    import pytest


def dead_names(metrics: SystemMetrics) -> list[str]:
    return [d.actor.ref.name for d in metrics.dead]


def live_names(metrics: SystemMetrics) -> set[str]:
    return {a.ref.name for p in metrics.processes for a in p.actors}


async def metrics_once(
    collector: ActorRef[Any], done: Callable[[SystemMetrics], bool]
) -> SystemMetrics:
    """The collector's statistics once ``done`` holds of them (each ask, gathering anew, is
    the wait: the ``Down`` it waits for comes from another process)."""
    with anyio.fail_after(20):
        while not done(metrics := await collector.ask(GetMetrics(max_age=0))):
            pass
    return metrics


async def stop_and_see_it_dead(
    system: ActorSystem, collector: ActorRef[Any], echo: ActorRef[Any]
) -> SystemMetrics:
    await system.stop(echo)
    return await metrics_once(collector, lambda m: echo.name in dead_names(m))


class TestDeadIncarnations:
    async def test_beyond_max_dead_the_oldest_are_dropped_and_the_newest_kept(self) -> None:
        async with ActorSystem() as system:
            collector: ActorRef[Any] = await system.spawn(
                MetricsCollector, max_dead=2, name="metrics", process=False
            )
            echoes = [await system.spawn(Echo, name=f"echo-{i}") for i in range(4)]
            names = {e.name for e in echoes}
            await metrics_once(collector, lambda m: names <= live_names(m))
            for echo in echoes:
                metrics = await stop_and_see_it_dead(system, collector, echo)
                assert len(metrics.dead) <= 2
            assert dead_names(metrics) == ["echo-2", "echo-3"]
            for dead in metrics.dead:
                assert dead.cause == Cause.NORMAL.value
                assert dead.process is not None  # each was the actor of its own process
            assert not names & live_names(metrics)

    async def test_past_retention_a_dead_incarnation_is_dropped_and_a_younger_one_kept(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        clock = [1_000_000.0]
        monkeypatch.setattr("runtime._collector.now", lambda: clock[0])
        retention = 300.0
        async with ActorSystem() as system:
            collector: ActorRef[Any] = await system.spawn(
                MetricsCollector, retention=retention, name="metrics", process=False
            )
            old, young = [await system.spawn(Echo, name=n) for n in ("old", "young")]
            await metrics_once(collector, lambda m: {"old", "young"} <= live_names(m))
            await stop_and_see_it_dead(system, collector, old)
            clock[0] += retention * 0.6
            metrics = await stop_and_see_it_dead(system, collector, young)
            assert dead_names(metrics) == ["old", "young"]
            clock[0] += retention * 0.6  # old died 1.2 retentions ago, young 0.6
            metrics = await collector.ask(GetMetrics(max_age=0))
            assert dead_names(metrics) == ["young"]
            clock[0] += retention * 0.6
            metrics = await collector.ask(GetMetrics(max_age=0))
            assert dead_names(metrics) == []
