"""Supervision with real processes: restarts, strategies, intensity, death watch, lookup."""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import pytest

from runtime import (
    ActorDeadError,
    ActorRef,
    ActorSystem,
    Children,
    ChildSpec,
    GetSupervisorStatistics,
    Restart,
    Strategy,
    Supervisor,
    SupervisorStatistics,
    WhichChildren,
)
from tests.conftest import child_pids

from ._actors import (
    Crash,
    GetCount,
    GetPid,
    Journal,
    Pid,
    Quit,
    Recorder,
    Slow,
    Started,
    Tick,
    Worker,
)


async def next_incarnation(sup: ActorRef[Any], name: str, after: int) -> ActorRef[Any]:
    """Ask the supervisor (a message each time, no timer) until ``name`` is restarted."""
    with anyio.fail_after(30):
        while True:
            children: Children = await sup.ask(WhichChildren())
            ref = children.refs[name]
            if ref is not None and ref.incarnation > after:
                return ref


async def stats_when(sup: ActorRef[Any], died: int) -> SupervisorStatistics:
    """The supervisor's counters once it has handled ``died`` deaths."""
    with anyio.fail_after(30):
        while True:
            stats: SupervisorStatistics = await sup.ask(GetSupervisorStatistics())
            if stats.died >= died:
                return stats


async def pid_of(ref: ActorRef[Any]) -> int:
    reply: Pid = await ref.ask(GetPid())
    return reply.pid


class TestRestartOnDeath:
    async def test_a_killed_permanent_child_is_restarted_with_a_new_incarnation(self) -> None:
        async with ActorSystem() as system:
            sup = await system.spawn(
                Supervisor, children=[ChildSpec(Worker, name="worker")], name="sup"
            )
            first = await system.lookup("worker")
            assert first.incarnation == 1
            watch = system.watch(first)
            os.kill(await pid_of(first), signal.SIGKILL)
            with anyio.fail_after(10):
                down = await watch
            assert down.signal == signal.SIGKILL
            assert down.reason == "killed by SIGKILL"
            second = await next_incarnation(sup, "worker", first.incarnation)
            assert second.incarnation == 2
            assert await pid_of(second) > 0
            assert await system.lookup("worker") == second

    async def test_a_transient_child_that_exits_normally_is_not_restarted(self) -> None:
        async with ActorSystem() as system:
            spec = ChildSpec(Worker, name="once", restart=Restart.TRANSIENT)
            sup = await system.spawn(Supervisor, children=[spec], name="sup")
            worker = await system.lookup("once")
            watch = system.watch(worker)
            await worker.tell(Quit())
            with anyio.fail_after(10):
                down = await watch
            assert down.normal
            stats = await stats_when(sup, died=1)
            assert stats.restarted == 0
            children: Children = await sup.ask(WhichChildren())
            assert children.refs == {"once": None}

    async def test_a_transient_child_that_crashes_is_restarted(self) -> None:
        async with ActorSystem() as system:
            spec = ChildSpec(Worker, name="flaky", restart=Restart.TRANSIENT)
            sup = await system.spawn(Supervisor, children=[spec], name="sup")
            worker = await system.lookup("flaky")
            watch = system.watch(worker)
            await worker.tell(Crash(text="boom"))
            with anyio.fail_after(10):
                down = await watch
            assert "boom" in down.reason
            assert down.reason.startswith("exception:")
            await next_incarnation(sup, "flaky", worker.incarnation)


class TestStrategies:
    @pytest.mark.parametrize(
        ("strategy", "stopped", "restarted"),
        [
            (Strategy.ONE_FOR_ONE, [], ["b"]),
            (Strategy.ONE_FOR_ALL, ["c", "a"], ["a", "b", "c"]),
            (Strategy.REST_FOR_ONE, ["c"], ["b", "c"]),
        ],
    )
    async def test_each_strategy_restarts_exactly_the_right_siblings_in_order(
        self, strategy: Strategy, stopped: list[str], restarted: list[str]
    ) -> None:
        journal = Journal()
        async with ActorSystem() as system:
            recorder = await system.spawn(Recorder, journal, process=False, name="rec")
            specs = [ChildSpec(Worker, (recorder,), name=n, process=False) for n in "abc"]
            sup = await system.spawn(Supervisor, specs, strategy, name="sup", process=False)
            with anyio.fail_after(10):
                await journal.wait_for(3)
            b = await system.lookup("b")
            await b.tell(Crash())
            expected = 3 + len(stopped) + len(restarted)
            with anyio.fail_after(10):
                events = await journal.wait_for(expected)
            after = events[3:]
            assert [e.name for e in after if e.stopped] == stopped
            assert [e.name for e in after if not e.stopped] == restarted
            assert all(e.incarnation == 2 for e in after if not e.stopped)
            stats = await stats_when(sup, died=1)
            assert stats.restarted == len(restarted)


class TestIntensity:
    async def test_too_many_restarts_fail_the_supervisor_upward_and_leave_nothing(
        self,
    ) -> None:
        async with ActorSystem() as system:
            sup = await system.spawn(
                Supervisor,
                children=[ChildSpec(Worker, name="w")],
                max_restarts=2,
                period=30.0,
                backoff=0.001,
                name="sup",
            )
            sup_down = system.watch(sup)
            incarnation = 0
            for _ in range(3):
                worker = await next_incarnation(sup, "w", incarnation)
                incarnation = worker.incarnation
                await worker.tell(Crash())
            with anyio.fail_after(20):
                down = await sup_down
            assert "RestartIntensityError" in down.reason
            assert "more than 2 restarts in 30 s" in down.reason
            assert down.exitcode == 1
            assert child_pids() == set()

    async def test_a_nested_supervisor_that_fails_is_restarted_by_its_parent(self) -> None:
        inner = ChildSpec(
            Supervisor,
            kwargs={
                "children": [ChildSpec(Worker, name="leaf", process=False)],
                "max_restarts": 0,
            },
            name="inner",
        )
        async with ActorSystem() as system:
            outer = await system.spawn(Supervisor, children=[inner], name="outer")
            leaf = await system.lookup("leaf")
            first_inner = await system.lookup("inner")
            await leaf.tell(Crash())
            second_inner = await next_incarnation(outer, "inner", first_inner.incarnation)
            assert second_inner.incarnation == 2
            new_leaf = await system.lookup("leaf")
            assert new_leaf.address != leaf.address


class TestNoHangingCallers:
    async def test_a_pending_ask_fails_as_soon_as_the_actor_is_killed(self) -> None:
        async with ActorSystem() as system:
            worker = await system.spawn(Worker, name="w")
            pid = await pid_of(worker)
            failure: list[BaseException] = []

            async def ask_slow() -> None:
                try:
                    await worker.ask(Slow(seconds=60), timeout=60)
                except ActorDeadError as err:
                    failure.append(err)

            started = anyio.current_time()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask_slow)
                os.kill(pid, signal.SIGKILL)
            assert failure, "the ask should have failed with ActorDeadError"
            assert anyio.current_time() - started < 10
            assert "SIGKILL" in str(failure[0])

    async def test_a_pending_ask_on_a_supervised_grandchild_fails_when_it_is_killed(
        self,
    ) -> None:
        async with ActorSystem() as system:
            await system.spawn(Supervisor, children=[ChildSpec(Worker, name="w")], name="sup")
            worker = await system.lookup("w")
            pid = await pid_of(worker)  # this ask also subscribes us to its death

            async def kill_soon() -> None:
                os.kill(pid, signal.SIGKILL)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(kill_soon)
                    with pytest.raises(ActorDeadError, match="SIGKILL"):
                        await worker.ask(Slow(seconds=60), timeout=60)

    async def test_a_message_to_a_stale_ref_never_reaches_the_new_incarnation(self) -> None:
        async with ActorSystem() as system:
            sup = await system.spawn(Supervisor, children=[ChildSpec(Worker, name="w")], name="sup")
            old = await system.lookup("w")
            watch = system.watch(old)
            os.kill(await pid_of(old), signal.SIGKILL)
            with anyio.fail_after(10):
                await watch
            new = await next_incarnation(sup, "w", old.incarnation)
            with pytest.raises(ActorDeadError):
                await old.tell(Tick(n=1))
            with pytest.raises(ActorDeadError):
                await old.ask(GetCount())
            assert (await new.ask(GetCount())).n == 0


class TestDownReasons:
    async def test_down_tells_a_clean_stop_from_a_crash(self) -> None:
        async with ActorSystem() as system:
            clean = await system.spawn(Worker, name="clean")
            crashy = await system.spawn(Worker, name="crashy")
            clean_down, crash_down = system.watch(clean), system.watch(crashy)
            await system.stop(clean)
            await crashy.tell(Crash(text="bad state"))
            with anyio.fail_after(10):
                assert (await clean_down).normal
                down = await crash_down
            assert down.reason == "exception: builtins.RuntimeError: bad state"
            assert down.exitcode == 1
            assert down.signal is None


def test_started_reports_are_messages() -> None:
    assert Started(name="a", incarnation=1).stopped is False
