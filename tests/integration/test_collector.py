"""The metrics collector keeps dead incarnations by its rule: for ``retention`` seconds after
their ``Down``, and at most ``max_dead`` of them, the oldest dropped first.

The actors are real processes, stopped one at a time; the collector runs in the test's
loop, as it is meant to (``process=False``), so its clock can be the test's.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import signal
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from runtime import (
    ActorRef,
    ActorSystem,
    Cause,
    ChildSpec,
    GetMetrics,
    MetricsCollector,
    Supervisor,
    SystemMetrics,
)

from ._actors import Echo, Metered, MeteredWithChild, Ping, Pong, Slow

if TYPE_CHECKING:
    from collections.abc import Callable


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


def pings(metrics: SystemMetrics) -> float:
    """``test_pings_total``, summed over the system's processes."""
    family = next((f for f in metrics.families if f.name == "test_pings_total"), None)
    return 0.0 if family is None else sum(s.value for s in family.series)


class TestProcessesThatDoNotAnswerInTime:
    """A process whose loop a handler holds answers a gathering late: left out, its series
    dropped from the sums for a scrape and came back at the next (a counter reset, to
    Prometheus)."""

    async def test_a_busy_process_is_shown_as_last_gathered(self) -> None:
        async with ActorSystem() as system, anyio.create_task_group() as tg:
            collector: ActorRef[Any] = await system.spawn(
                MetricsCollector, timeout=0.5, name="metrics", process=False
            )
            busy = await system.spawn(Metered, name="busy")
            for n in range(3):
                await busy.ask(Ping(n=n))
            before = await metrics_once(collector, lambda m: pings(m) == 3)
            tg.start_soon(functools.partial(busy.ask, Slow(seconds=3), timeout=10))
            await metrics_once(collector, lambda m: True)  # the first gathering it holds
            held = await collector.ask(GetMetrics(max_age=0))
            assert "busy" in live_names(held)
            assert pings(held) == 3
            (process,) = [p for p in held.processes if p.name == "busy"]
            assert process == next(p for p in before.processes if p.name == "busy")

    async def test_a_process_stopped_just_now_is_not_shown_as_one_that_did_not_answer(
        self,
    ) -> None:
        async with ActorSystem() as system:
            collector: ActorRef[Any] = await system.spawn(
                MetricsCollector, name="metrics", process=False
            )
            echo = await system.spawn(Echo, name="echo")
            await metrics_once(collector, lambda m: "echo" in live_names(m))
            await system.stop(echo)  # its Down may reach the collector after the next ask
            assert "echo" not in live_names(await collector.ask(GetMetrics(max_age=0)))

    async def test_a_busy_process_holds_up_no_process_beside_it_or_above_it(self) -> None:
        """A supervisor's process gathers its children's before it answers: it waited 5 s
        for a busy one, past the collector's 2 s, and its whole subtree was left out."""
        children = [ChildSpec(Metered, name="busy"), ChildSpec(Metered, name="idle")]
        async with ActorSystem() as system, anyio.create_task_group() as tg:
            collector: ActorRef[Any] = await system.spawn(
                MetricsCollector, timeout=1.0, name="metrics", process=False
            )
            await system.spawn(Supervisor, children=children, name="sup")
            busy, idle = await system.lookup("busy"), await system.lookup("idle")
            await metrics_once(collector, lambda m: {"sup", "busy", "idle"} <= live_names(m))
            tg.start_soon(functools.partial(busy.ask, Slow(seconds=4), timeout=10))
            await idle.ask(Ping(n=1))
            # The idle sibling's count is fresh: its supervisor's process gave the busy one
            # three quarters of the collector's second, and answered in time.
            seen = await collector.ask(GetMetrics(max_age=0))
            assert {"sup", "busy", "idle"} <= live_names(seen)
            assert pings(seen) == 1


class TestAProcessOfSeveralActorsThatDies:
    async def test_keeps_what_it_counted_in_the_sums(self) -> None:
        """Its counters were retired only with a process of one actor: summed, they dropped
        by what it had counted when it died."""
        async with ActorSystem() as system:
            collector: ActorRef[Any] = await system.spawn(
                MetricsCollector, name="metrics", process=False
            )
            two = await system.spawn(MeteredWithChild, name="two")
            for n in range(3):
                await two.ask(Ping(n=n))
            await metrics_once(collector, lambda m: {"two", "two-child"} <= live_names(m))
            assert pings(await collector.ask(GetMetrics(max_age=0))) == 3
            pid = system.pid_of(two)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            metrics = await metrics_once(
                collector, lambda m: {"two", "two-child"} <= set(dead_names(m))
            )
            assert pings(metrics) == 3


class TestAGaugeWhoseFunctionFails:
    async def test_is_left_out_and_its_actor_lives_on(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Before, the first gathering killed the actor (the error left its mailbox's loop)."""
        async with ActorSystem() as system:
            collector: ActorRef[Any] = await system.spawn(
                MetricsCollector, name="metrics", process=False
            )
            with caplog.at_level(logging.ERROR, logger="tokenyard.metrics"):
                local = await system.spawn(Metered, True, name="local", process=False)
                await local.ask(Ping(n=1))
                metrics = await collector.ask(GetMetrics(max_age=0))
            remote = await system.spawn(Metered, True, name="remote")
            await remote.ask(Ping(n=1))
            metrics = await metrics_once(collector, lambda m: pings(m) == 2)
            assert {"local", "remote"} <= live_names(metrics)
            assert await remote.ask(Ping(n=2)) == Pong(n=2)  # alive after the gathering
            broken = [f for f in metrics.families if f.name == "test_broken"]
            assert all(not f.series for f in broken)
        assert any("test_broken" in r.getMessage() for r in caplog.records)


class TestArguments:
    @pytest.mark.parametrize(
        ("arguments", "named"),
        [
            ({"timeout": math.nan}, "timeout=nan"),
            ({"timeout": math.inf}, "timeout=inf"),
            ({"timeout": 0.0}, "timeout=0.0"),
            ({"retention": math.nan}, "retention=nan"),
            ({"retention": math.inf}, "retention=inf"),
            ({"retention": -1.0}, "retention=-1.0"),
            ({"max_dead": -1}, "max_dead=-1"),
        ],
        ids=[
            "timeout-nan",
            "timeout-inf",
            "timeout-0",
            "retention-nan",
            "retention-inf",
            "retention-negative",
            "max-dead-negative",
        ],
    )
    def test_a_value_out_of_range_or_not_finite_is_refused_with_its_name(
        self, arguments: dict[str, Any], named: str
    ) -> None:
        """Before, NaN passed the range checks: with timeout=nan every gathering then
        failed, and with retention=nan dead incarnations never expired."""
        with pytest.raises(ValueError, match=re.escape(named)):
            MetricsCollector(**arguments)

    @pytest.mark.parametrize("max_dead", [2.5, "2", True, None])
    def test_a_max_dead_that_is_not_a_whole_number_is_refused(self, max_dead: object) -> None:
        # 2.5 kept two and True one; a str or None failed on a comparison that named neither.
        with pytest.raises(TypeError, match=re.escape(f"max_dead={max_dead!r}")):
            MetricsCollector(max_dead=max_dead)  # type: ignore[arg-type]

    @pytest.mark.parametrize("timeout", [math.nan, math.inf, 0.0, -1.0])
    async def test_a_gathering_refuses_a_timeout_out_of_range(self, timeout: float) -> None:
        """Before, one out of range was silently the default."""
        async with ActorSystem() as system:
            with pytest.raises(ValueError, match="finite number of seconds above 0"):
                await system.gather_metrics(timeout)
