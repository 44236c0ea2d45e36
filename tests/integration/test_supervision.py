"""Supervision with real processes: restarts, strategies, intensity, death watch, stale refs,
shutdown escalation, supervision events."""

from __future__ import annotations

import logging
import os
import select
import signal
from typing import Any

import anyio
import anyio.to_thread
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime import (
    ActorDeadError,
    ActorRef,
    ActorSystem,
    Children,
    ChildSpec,
    Down,
    GetSupervisorStatistics,
    ProtocolError,
    Restart,
    SpawnError,
    Strategy,
    Supervisor,
    SupervisorStatistics,
    WhichChildren,
    handler,
)
from runtime._children import TERM_GRACE
from tests.conftest import actor_pids

from ._actors import (
    Collector,
    Crash,
    Echo,
    Gathered,
    GetCount,
    GetPid,
    Journal,
    Pid,
    Quit,
    Recorder,
    Slow,
    Started,
    StartsSlowly,
    StartsThenWaits,
    Stubborn,
    Tick,
    Worker,
)


async def next_incarnation(
    system: ActorSystem, sup: ActorRef[Any], old: ActorRef[Any]
) -> ActorRef[Any]:
    """The incarnation that replaced ``old`` under ``sup``.

    It waits for ``old``'s death first (a watch: an event), and only then asks the supervisor,
    which answers once it has handled the death and restarted the child. Asking in a loop
    before the death is known would be a busy ping-pong with the supervisor; on a 2-core
    machine that can starve the dying process of the CPU it needs to exit.
    """
    with anyio.fail_after(30):
        await system.watch(old)
        while True:
            children: Children = await sup.ask(WhichChildren())
            ref = children.refs[old.name]
            if ref is not None and ref != old:
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


def still_running(pid: int) -> bool:
    """Whether ``pid`` runs now: its pidfd, checked once (no waiting, no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False  # exited and reaped
    try:
        exited, _, _ = select.select([fd], [], [], 0)
        return not exited
    finally:
        os.close(fd)


def anyone_listens_at(address: str) -> bool:
    """Whether anything accepts connections at ``address``: the outcome of a fresh PUSH
    socket's first connection attempt, as its monitor reports it (an event, not a timer)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    monitor = push.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
    monitor.setsockopt(zmq.RCVTIMEO, 20_000)
    try:
        push.connect(address)
        event = recv_monitor_message(monitor)["event"]
    finally:
        push.disable_monitor()
        monitor.close(0)
        push.close(0)
        ctx.term()
    return bool(event == zmq.EVENT_CONNECTED)


def supervision_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The structured part of each supervision record: level, event, and every extra.

    A record's plain attributes are those of one the installed record factory makes: a
    library imported earlier in the process may add its own (Ray adds ``_ray_timestamp_ns``),
    which are no extras of ours."""
    plain = {*logging.makeLogRecord({}).__dict__, "message", "asctime"}
    return [
        {"level": r.levelno, **{k: v for k, v in r.__dict__.items() if k not in plain}}
        for r in caplog.records
        if r.name == "tokenyard.supervisor"
    ]


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
            second = await next_incarnation(system, sup, first)
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
            await next_incarnation(system, sup, worker)

    async def test_a_killed_temporary_child_is_not_restarted_and_its_siblings_are_left_alone(
        self,
    ) -> None:
        specs = [
            ChildSpec(Worker, name="temp", restart=Restart.TEMPORARY),
            ChildSpec(Worker, name="sibling"),
        ]
        async with ActorSystem() as system:
            # ONE_FOR_ALL: had the death triggered a restart, the sibling would restart too.
            sup = await system.spawn(
                Supervisor, children=specs, strategy=Strategy.ONE_FOR_ALL, name="sup"
            )
            temp, sibling = await system.lookup("temp"), await system.lookup("sibling")
            sibling_pid = await pid_of(sibling)
            watch = system.watch(temp)
            os.kill(await pid_of(temp), signal.SIGKILL)
            with anyio.fail_after(10):
                down = await watch
            assert down.reason == "killed by SIGKILL"
            stats = await stats_when(sup, died=1)
            assert (stats.started, stats.died, stats.restarted) == (2, 1, 0)
            children: Children = await sup.ask(WhichChildren())
            assert children.refs == {"temp": None, "sibling": sibling}
            assert await pid_of(sibling) == sibling_pid


class TestStrategies:
    @pytest.mark.parametrize("process", [False, True], ids=["in-process-crash", "process-sigkill"])
    @pytest.mark.parametrize(
        ("strategy", "stopped", "restarted"),
        [
            pytest.param(Strategy.ONE_FOR_ONE, [], ["b"], id="one_for_one"),
            pytest.param(Strategy.ONE_FOR_ALL, ["c", "a"], ["a", "b", "c"], id="one_for_all"),
            pytest.param(Strategy.REST_FOR_ONE, ["c"], ["b", "c"], id="rest_for_one"),
        ],
    )
    async def test_each_strategy_restarts_exactly_the_right_siblings_in_order(
        self, strategy: Strategy, stopped: list[str], restarted: list[str], process: bool
    ) -> None:
        journal = Journal()
        async with ActorSystem() as system:
            recorder = await system.spawn(Recorder, journal, process=False, name="rec")
            specs = [ChildSpec(Worker, (recorder,), name=n, process=process) for n in "abc"]
            sup = await system.spawn(Supervisor, specs, strategy, name="sup", process=process)
            with anyio.fail_after(10):
                await journal.wait_for(3)
            b = await system.lookup("b")
            if process:
                os.kill(await pid_of(b), signal.SIGKILL)  # no on_stop, no last words
            else:
                await b.tell(Crash())
            expected = 3 + len(stopped) + len(restarted)
            with anyio.fail_after(20):
                events = await journal.wait_for(expected)
            # Reports from several processes arrive on several sockets: order by when.
            after = sorted(events, key=lambda e: e.at)[3:]
            assert [e.name for e in after if e.stopped] == stopped
            assert [e.name for e in after if not e.stopped] == restarted
            assert all(e.incarnation == 2 for e in after if not e.stopped)
            stats = await stats_when(sup, died=1)
            assert stats.restarted == len(restarted)
            assert stats.started == 3 + len(restarted)
            children: Children = await sup.ask(WhichChildren())
            incarnations = {n: ref.incarnation for n, ref in children.refs.items() if ref}
            assert incarnations == {n: 2 if n in restarted else 1 for n in "abc"}
            assert len(journal.events) == expected


class TestIntensity:
    async def test_too_many_restarts_fail_the_supervisor_upward_and_leave_nothing(
        self,
    ) -> None:
        async with ActorSystem() as system:
            sup = await system.spawn(
                Supervisor,
                children=[ChildSpec(Worker, name="w"), ChildSpec(Worker, name="bystander")],
                max_restarts=2,
                period=30.0,
                backoff=0.001,
                name="sup",
            )
            sup_pid = system.pid_of(sup)
            assert sup_pid is not None
            # Every process the supervisor ran: the bystander, and each incarnation of w.
            bystander = await system.lookup("bystander")
            pids = {await pid_of(bystander)}
            sup_down, bystander_down = system.watch(sup), system.watch(bystander)
            worker = await system.lookup("w")
            for crash in range(3):
                if crash:
                    worker = await next_incarnation(system, sup, worker)
                pids.add(await pid_of(worker))
                await worker.tell(Crash())
            with anyio.fail_after(20):
                down = await sup_down
            assert "RestartIntensityError" in down.reason
            assert "more than 2 restarts in 30 s" in down.reason
            assert down.exitcode == 1
            assert len(pids) == 4
            # The supervisor stopped the bystander itself, gracefully, before it failed (not
            # the parent-death signal after it: that would read "its owner 'sup' died").
            with anyio.fail_after(10):
                assert (await bystander_down).normal
            # So none is left, not even for the moment a parent-death signal takes to act.
            assert [pid for pid in sorted(pids | {sup_pid}) if still_running(pid)] == []
            assert actor_pids() == set()

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
            second_inner = await next_incarnation(system, outer, first_inner)
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
            pid = await pid_of(old)  # this ask also subscribes us to its death
            os.kill(pid, signal.SIGKILL)
            # Nothing yields to the event loop until these are sent: this process cannot
            # know of the death yet, so they go out (and are lost with the old incarnation).
            for n in range(5):
                await old.tell(Tick(n=n))
            new = await next_incarnation(system, sup, old)
            assert new.address != old.address
            # Nobody took over the old address: a raw socket finds no one to connect to.
            assert not await anyio.to_thread.run_sync(anyone_listens_at, old.address)
            # Now that the death is known here, a tell through the stale ref raises (it is
            # not counted as a dead letter), and so does an ask.
            with pytest.raises(ActorDeadError, match="killed by SIGKILL") as raised:
                await old.tell(Tick(n=5))
            assert raised.value.reason == "killed by SIGKILL"
            with pytest.raises(ActorDeadError):
                await old.ask(GetCount())
            assert (await new.ask(GetCount())).n == 0

    async def test_a_process_that_only_tells_an_actor_learns_of_its_death(self) -> None:
        journal = Journal()
        async with ActorSystem() as system:
            recorder = await system.spawn(Recorder, journal, process=False, name="rec")
            spec = ChildSpec(Worker, (recorder,), name="w")
            sup = await system.spawn(Supervisor, children=[spec], name="sup")
            old = await system.lookup("w")  # asks the supervisor's process, not w
            # The first tell subscribes this process at the owner; this one kills w. Nothing
            # here watches or asks w: that would subscribe too.
            await old.tell(Crash(text="told to die"))
            with anyio.fail_after(20):
                await journal.wait_for(2)  # the restarted w reported its start
            # The owner reported the death to us before it answered this (one socket from
            # its process to ours keeps the order).
            children: Children = await sup.ask(WhichChildren())
            assert children.refs["w"] != old
            with pytest.raises(ActorDeadError, match="told to die"):
                await old.tell(Tick(n=1))

    @pytest.mark.parametrize("process", [False, True])
    async def test_a_watch_of_a_ref_of_a_closed_system_is_refused_at_once(
        self, process: bool
    ) -> None:
        """Before, its WATCH could not be sent (a warning in the log) and the watch waited
        for a Down for ever."""
        async with ActorSystem() as closed:
            echo = await closed.spawn(Echo, process=process)
        async with ActorSystem() as system:
            with pytest.raises(ProtocolError, match="not an address of this actor system"):
                system.watch(echo)


class TestShutdownTimeout:
    async def test_a_process_child_that_ignores_stop_and_sigterm_is_killed_in_bounded_time(
        self,
    ) -> None:
        spec = ChildSpec(
            Stubborn, kwargs={"ignore_sigterm": True}, name="stubborn", shutdown_timeout=0.3
        )
        # A system default this long would fail the time bound below were it used instead.
        async with ActorSystem(shutdown_timeout=30.0) as system:
            sup = await system.spawn(Supervisor, children=[spec], name="sup")
            stubborn = await system.lookup("stubborn")
            pid = await pid_of(stubborn)
            watch = system.watch(stubborn)
            started = anyio.current_time()
            await system.stop(sup)
            elapsed = anyio.current_time() - started
            with anyio.fail_after(10):
                down = await watch
            assert down.signal == signal.SIGKILL
            assert down.exitcode == -signal.SIGKILL
            assert down.reason == "killed by SIGKILL"
            # Stop request, 0.3 s, SIGTERM (ignored), the grace, SIGKILL: and no longer.
            assert TERM_GRACE <= elapsed < 0.3 + TERM_GRACE + 3.0
            assert not still_running(pid)

    async def test_an_in_process_child_that_does_not_stop_in_time_is_cancelled(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        spec = ChildSpec(Stubborn, name="stubborn", process=False, shutdown_timeout=0.3)
        async with ActorSystem(shutdown_timeout=30.0) as system:
            sup = await system.spawn(Supervisor, children=[spec], name="sup", process=False)
            stubborn = await system.lookup("stubborn")
            watch = system.watch(stubborn)
            started = anyio.current_time()
            await system.stop(sup)
            elapsed = anyio.current_time() - started
            with anyio.fail_after(10):
                down = await watch
            assert down.reason == "cancelled: it did not stop in time"
            assert (down.exitcode, down.signal) == (None, None)
            assert 0.3 <= elapsed < TERM_GRACE  # cancelled at once, not waited on
        # The log says what was done to it: no signal reaches an actor of this process.
        said = [r.getMessage() for r in caplog.records if ": cancelling" in r.getMessage()]
        assert not [r for r in caplog.records if "SIGTERM" in r.getMessage()]
        assert said == ["actor stubborn did not stop in 0.3 s: cancelling it"]


class TestSupervisionEvents:
    async def test_each_event_is_a_structured_record_and_counted_in_statistics(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="tokenyard.supervisor")
        async with ActorSystem() as system:
            # In this process, so that its records reach caplog.
            sup = await system.spawn(
                Supervisor,
                children=[ChildSpec(Worker, name="w")],
                max_restarts=1,
                period=30.0,
                name="sup",
                process=False,
            )
            sup_down = system.watch(sup)
            first = await system.lookup("w")
            first_pid = system.pid_of(first)
            assert first_pid is not None
            killed = anyio.current_time()
            os.kill(first_pid, signal.SIGKILL)
            second = await next_incarnation(system, sup, first)
            kill_to_ready_ms = (anyio.current_time() - killed) * 1000
            stats: SupervisorStatistics = await sup.ask(GetSupervisorStatistics())
            assert (stats.started, stats.died, stats.restarted) == (2, 1, 1)
            assert stats.intensity_exceeded == 0
            assert stats.last_restart_ms is not None
            assert 0 < stats.last_restart_ms < kill_to_ready_ms
            second_pid = system.pid_of(second)
            assert second_pid is not None
            os.kill(second_pid, signal.SIGKILL)  # the second restart in 30 s: one too many
            with anyio.fail_after(10):
                down = await sup_down
            assert "RestartIntensityError" in down.reason
        where = {"supervisor": "sup", "child": "w"}
        info, warning = logging.INFO, logging.WARNING
        assert supervision_records(caplog) == [
            {"level": info, "event": "child_started", **where, "incarnation": 1},
            {"level": warning, "event": "child_died", **where, "reason": "killed by SIGKILL"},
            {"level": info, "event": "child_started", **where, "incarnation": 2},
            {"level": info, "event": "restarted", **where, "ms": round(stats.last_restart_ms, 1)},
            {"level": warning, "event": "child_died", **where, "reason": "killed by SIGKILL"},
            {
                "level": warning,
                "event": "intensity_exceeded",
                **where,
                "error": "supervisor 'sup': more than 1 restarts in 30 s",
            },
        ]
        died = next(
            r for r in caplog.records if r.name == "tokenyard.supervisor" and r.levelno == warning
        )
        assert died.getMessage() == "sup: child_died w reason=killed by SIGKILL"


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

    async def test_a_watch_made_after_the_death_still_gets_the_exit_status_and_signal(
        self,
    ) -> None:
        async with ActorSystem() as system:
            worker = await system.spawn(Worker, name="w")
            first = system.watch(worker)
            os.kill(await pid_of(worker), signal.SIGKILL)
            with anyio.fail_after(10):
                seen = await first
                late = await system.watch(worker)
            assert (seen.exitcode, seen.signal) == (-signal.SIGKILL, signal.SIGKILL)
            assert late == seen


def test_started_reports_are_messages() -> None:
    assert Started(name="a", incarnation=1).stopped is False


class TestTemporaryChildren:
    @pytest.mark.parametrize("strategy", [Strategy.ONE_FOR_ALL, Strategy.REST_FOR_ONE])
    @pytest.mark.parametrize("ended_first", [False, True], ids=["running", "ended"])
    async def test_a_siblings_death_never_starts_a_temporary_child_again(
        self, strategy: Strategy, ended_first: bool
    ) -> None:
        specs = [
            ChildSpec(Worker, name="perm", process=False),
            ChildSpec(Worker, name="temp", restart=Restart.TEMPORARY, process=False),
        ]
        async with ActorSystem() as system:
            sup = await system.spawn(Supervisor, specs, strategy, name="sup", process=False)
            perm, temp = await system.lookup("perm"), await system.lookup("temp")
            with anyio.fail_after(20):
                if ended_first:
                    ended = system.watch(temp)
                    await temp.tell(Quit())
                    await ended
                gone = system.watch(temp)
                await perm.tell(Crash())
                await next_incarnation(system, sup, perm)
                await gone  # stopped with its group, or before
            children: Children = await sup.ask(WhichChildren())
            assert children.refs["temp"] is None
            stats: SupervisorStatistics = await sup.ask(GetSupervisorStatistics())
            assert (stats.started, stats.restarted) == (3, 1)


class FailOnce:
    """Shared with a `HookFails` supervisor in this process: how many hook calls to fail."""

    def __init__(self) -> None:
        self.failures = 0
        self.starts: list[ActorRef[Any]] = []
        #: What ``on_restart_failed`` was called with.
        self.failed: list[tuple[str, str]] = []


class HookFails(Supervisor[Any]):
    """Its ``on_child_started`` raises while ``fail.failures`` is above zero, as a hook
    that publishes each start to an actor that has just died would."""

    def __init__(self, fail: FailOnce, children: list[ChildSpec]) -> None:
        super().__init__(children, max_restarts=5, backoff=0.0)
        self.fail = fail

    async def on_child_started(self, name: str, ref: ActorRef[Any]) -> None:
        self.fail.starts.append(ref)
        if self.fail.failures:
            self.fail.failures -= 1
            raise ActorDeadError("the registry is gone")


class GivesUp(HookFails):
    """A `HookFails` that gives up at its second failed restart, as a supervisor does whose
    child cannot start again (an engine whose model no longer loads)."""

    async def on_restart_failed(self, name: str, error: Exception) -> None:
        self.fail.failed.append((name, str(error)))
        if len(self.fail.failed) == 2:
            await self.give_up(RuntimeError(f"{name} failed to restart twice: {error}"))


async def hook_fails(
    system: ActorSystem, fail: FailOnce, kind: type[HookFails] = HookFails
) -> tuple[ActorRef[Any], ActorRef[Any]]:
    """A `HookFails` supervisor (or ``kind``) of one worker, "w", in this process; and the
    worker."""
    children = [ChildSpec(Worker, name="w", process=False)]
    sup = await system.spawn(kind, fail, children, process=False)
    return sup, await system.lookup("w")


async def reason_after_a_crash(
    system: ActorSystem, fail: FailOnce, kind: type[HookFails] = HookFails
) -> str:
    """Crash the worker of a `hook_fails` supervisor (or ``kind``) whose hook fails from then
    on; the reason the supervisor died of."""
    sup, first = await hook_fails(system, fail, kind)
    fail.failures = 1_000
    down = system.watch(sup)
    await first.tell(Crash())
    with anyio.fail_after(30):
        return (await down).reason


class TestFailedRestarts:
    async def test_a_restart_whose_start_raises_anything_is_tried_again(self) -> None:
        fail = FailOnce()
        async with ActorSystem() as system:
            sup, first = await hook_fails(system, fail)
            fail.failures = 1
            await first.tell(Crash())
            with anyio.fail_after(20):
                now = await next_incarnation(system, sup, first)
                # The attempt whose hook raised was stopped: one live incarnation.
                failed = fail.starts[1]
                await system.watch(failed)
            assert fail.starts == [first, failed, now]
            assert now.incarnation == 3
            stats: SupervisorStatistics = await sup.ask(GetSupervisorStatistics())
            assert (stats.died, stats.restarted) == (1, 1)

    async def test_a_start_that_keeps_failing_fails_the_supervisor_past_the_intensity(
        self,
    ) -> None:
        fail = FailOnce()
        async with ActorSystem() as system:
            assert "restarts in" in await reason_after_a_crash(system, fail)

    async def test_a_supervisor_told_of_failed_restarts_can_give_up_before_the_intensity(
        self,
    ) -> None:
        fail = FailOnce()
        async with ActorSystem() as system:
            reason = await reason_after_a_crash(system, fail, GivesUp)
            assert "w failed to restart twice" in reason
            assert "the registry is gone" in reason
            assert [name for name, _ in fail.failed] == ["w", "w"]
            assert len(fail.starts) == 3  # the first start and the two failed attempts


#: The children a `GivesUpAtFirstStart` saw started, in order.
STARTED: list[str] = []


class GivesUpAtFirstStart(Supervisor[Any]):
    """Gives up as its first child starts, as a supervisor does that cannot publish it."""

    async def on_child_started(self, name: str, ref: ActorRef[Any]) -> None:
        STARTED.append(name)
        if name == "a":
            await self.give_up(RuntimeError("a cannot be published"))


@pytest.mark.parametrize("process", [False, True])
async def test_a_supervisor_that_gives_up_while_starting_starts_no_more_children(
    process: bool,
) -> None:
    # In-process children, quick to start, went on starting after it had given up: which
    # of them ran before its failure ended the start depended on how long each took.
    STARTED.clear()
    async with ActorSystem() as system:
        children = [ChildSpec(Worker, name=n, process=process) for n in "abc"]
        with pytest.raises(SpawnError, match="a cannot be published"):
            await system.spawn(GivesUpAtFirstStart, children, process=False)
        assert STARTED == ["a"]


class DiedHookRaises(Supervisor[Any]):
    """Its ``on_child_died`` raises, as a hook that publishes a death to a gone registry
    would."""

    async def on_child_died(self, name: str, down: Down) -> None:
        raise ActorDeadError("the registry is gone")


class RestartFailedHookRaises(HookFails):
    """A `HookFails` whose ``on_restart_failed`` raises too."""

    async def on_restart_failed(self, name: str, error: Exception) -> None:
        raise RuntimeError(f"cannot count the failure of {name}")


class TestHooksThatRaise:
    """A handler's error fails its message only; a supervisor's message here is a death, so
    the dead child stayed down for good under a supervisor that looked healthy (no restart,
    no Down of its own). Now the supervisor gives up with the hook's error."""

    async def test_an_on_child_died_that_raises_fails_the_supervisor(self) -> None:
        children = [ChildSpec(Worker, name="w", process=False), ChildSpec(Worker, name="other")]
        async with ActorSystem() as system:
            sup = await system.spawn(DiedHookRaises, children, process=False)
            worker, other = await system.lookup("w"), await system.lookup("other")
            sup_down, other_down = system.watch(sup), system.watch(other)
            await worker.tell(Crash())
            with anyio.fail_after(20):
                reason = (await sup_down).reason
                assert (await other_down).normal  # stopped by the supervisor, gracefully
            assert reason == "exception: runtime.ActorDeadError: the registry is gone"

    async def test_an_on_restart_failed_that_raises_fails_the_supervisor(self) -> None:
        fail = FailOnce()
        async with ActorSystem() as system:
            reason = await reason_after_a_crash(system, fail, RestartFailedHookRaises)
            assert reason == "exception: builtins.RuntimeError: cannot count the failure of w"
            assert len(fail.starts) == 2  # the first start and the one failed attempt


class TestWatchesAndOwners:
    async def test_a_grandchild_whose_owner_died_is_dead_to_a_late_watcher(self) -> None:
        async with ActorSystem() as system:
            sup = await system.spawn(Supervisor, [ChildSpec(Worker, name="leaf")], name="sup")
            leaf = await system.lookup("leaf")  # owned by the supervisor's process
            sup_down = system.watch(sup)
            pid = system.pid_of(sup)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            with anyio.fail_after(20):
                await sup_down
                down = await system.watch(leaf)
            assert "its owner 'sup' died" in down.reason
            with pytest.raises(ActorDeadError):
                await leaf.ask(GetPid(), timeout=20)

    async def test_a_cancelled_watch_keeps_nothing(self) -> None:
        async with ActorSystem() as system:
            worker = await system.spawn(Worker, process=False)
            deaths = system.station.deaths
            for _ in range(1_000):
                system.watch(worker).cancel()
            kept = system.watch(worker)
            assert len(deaths._listeners[worker.address]) == 1
            kept.cancel()
            assert worker.address not in deaths._listeners
            with anyio.fail_after(10):
                await system.stop(worker)


class TestLookupsDuringRestarts:
    async def test_a_live_child_is_found_while_its_supervisor_is_busy_restarting_another(
        self,
    ) -> None:
        journal = Journal()
        async with ActorSystem(shutdown_timeout=1) as system:
            recorder = await system.spawn(Recorder, journal, process=False, name="rec")
            specs = [
                ChildSpec(Worker, name="db"),
                # Its restart's on_start never returns: the supervisor's Down handler waits.
                ChildSpec(StartsThenWaits, (recorder, 2), name="model", spawn_timeout=60),
            ]
            await system.spawn(Supervisor, specs, name="sup", shutdown_timeout=1)
            db = await system.lookup("db")
            with anyio.fail_after(20):
                await journal.wait_for(1)
                model = await system.lookup("model")
                os.kill(await pid_of(model), signal.SIGKILL)
                await journal.wait_for(2)  # the restart is under way, and stays so
                assert await system.lookup("db", timeout=10) == db


async def restart_under_way(system: ActorSystem, journal: Journal) -> list[int]:
    """Kill the first incarnation of the `StartsThenWaits` named ``child`` and return once
    its restart is under way, and stays so: the second incarnation's ``on_start`` hangs, or
    it failed and the next attempt waits out a long backoff. Returns the pids of its
    supervisor's children then: its sibling ``db`` and the incarnation being started."""
    with anyio.fail_after(20):
        await journal.wait_for(1)
        first = await system.lookup("child")
        sibling = await system.lookup("db")
        os.kill(journal.events[0].pid, signal.SIGKILL)
        events = await journal.wait_for(2)  # its restart's on_start has begun (within down)
        assert events[1].incarnation == 2, events
        assert first.incarnation == 1
        return [await pid_of(sibling), events[1].pid]


#: For each Tick a `Tallies` handled, the incarnation its child ``slow`` had then.
TALLIED: list[int] = []


class Tallies(Supervisor[Tick]):
    """A supervisor that notes, for each Tick, the incarnation of its child ``slow``."""

    @handler
    def tick(self, msg: Tick) -> None:
        ref = self.child("slow")
        TALLIED.append(0 if ref is None else ref.incarnation)


class TestStopsDuringARestart:
    """A stop that reaches a supervisor while it restarts a child cuts the restart short:
    it does not wait out the child's start or its backoff, and the stop is a normal one."""

    @pytest.mark.parametrize("process", [True, False], ids=["process", "in-process"])
    @pytest.mark.parametrize("fails", [False, True], ids=["start-hangs", "long-backoff"])
    async def test_a_supervisor_stopped_while_it_restarts_stops_at_once_and_normally(
        self, process: bool, fails: bool
    ) -> None:
        journal = Journal()
        async with ActorSystem() as system:
            recorder = await system.spawn(Recorder, journal, process=False, name="rec")
            specs = [
                ChildSpec(Worker, name="db"),
                ChildSpec(StartsThenWaits, (recorder, 2, fails), name="child", spawn_timeout=60),
            ]
            sup = await system.spawn(
                Supervisor,
                specs,
                max_restarts=10,
                period=60,
                backoff=30,  # the second attempt of a failed restart waits 15 to 30 s
                backoff_max=30,
                name="sup",
                process=process,
                shutdown_timeout=30,
            )
            sup_pid = system.pid_of(sup)
            pids = await restart_under_way(system, journal)
            with anyio.fail_after(10):  # far within the supervisor's shutdown_timeout
                down = await system.stop(sup)
            assert down.normal, down
            assert [p for p in pids if still_running(p)] == []
            if sup_pid is not None:
                assert not still_running(sup_pid)
            assert actor_pids() == set()  # nothing of the tree is left, reaped or not

    @pytest.mark.parametrize("by", ["user", "parent"])
    async def test_a_transient_supervisor_stopped_while_it_restarts_is_not_taken_for_crashed(
        self, by: str
    ) -> None:
        journal = Journal()
        async with ActorSystem() as system:
            recorder = await system.spawn(Recorder, journal, process=False, name="rec")
            leaf = ChildSpec(StartsThenWaits, (recorder, 2), name="child", spawn_timeout=60)
            inner = ChildSpec(
                Supervisor,
                kwargs={"children": [ChildSpec(Worker, name="db"), leaf], "max_restarts": 10},
                name="inner",
                restart=Restart.TRANSIENT,
                shutdown_timeout=30,
            )
            # In-process: its children are the test system's own, which can stop them.
            outer = await system.spawn(Supervisor, [inner], name="outer", process=False)
            inner_ref = await system.lookup("inner")
            watch = system.watch(inner_ref)
            pids = await restart_under_way(system, journal)
            with anyio.fail_after(10):
                if by == "user":
                    down = await system.stop(inner_ref)
                else:
                    await system.stop(outer)
                    down = await watch
            assert down.normal, down
            assert [p for p in pids if still_running(p)] == []
            if by == "user":
                stats = await stats_when(outer, died=1)
                assert (stats.restarted, stats.intensity_exceeded) == (0, 0)
                children: Children = await outer.ask(WhichChildren())
                assert children.refs == {"inner": None}
            assert actor_pids() == set()

    async def test_what_arrives_during_a_restart_is_still_handled_after_it_in_order(
        self,
    ) -> None:
        # The mailbox is read while a restart runs (for a stop request): what it reads waits
        # for the restart, as before, and a subclass sees its messages in the same order.
        TALLIED.clear()
        gathered = Gathered()
        async with ActorSystem() as system:
            collector = await system.spawn(Collector, gathered, process=False, name="col")
            spec = ChildSpec(StartsSlowly, (collector, 1.0), name="slow")
            sup = await system.spawn(Tallies, [spec], name="sup", process=False)
            with anyio.fail_after(20):
                await gathered.wait_for(n_counts=1)
                os.kill(gathered.counts[0].n, signal.SIGKILL)
                await gathered.wait_for(n_counts=2)  # its restart's on_start has begun
                for n in range(3):
                    await sup.tell(Tick(n=n))
                children: Children = await sup.ask(WhichChildren())
            restarted = children.refs["slow"]
            assert restarted is not None
            assert restarted.incarnation == 2
            assert TALLIED == [2, 2, 2]
