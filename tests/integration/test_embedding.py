"""The runtime in a host's own event loop: what the host's tasks (cancelled, timed out, in
another thread) and an in-process actor's own failures may do to the system, and what
they may not: end the host's task, lose a reply, leave a process or a socket file behind."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import re
import signal
import tempfile
import threading
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import zmq

from runtime import (
    Actor,
    ActorNotFoundError,
    ActorRef,
    ActorSystem,
    AskTimeoutError,
    Cause,
    ChildSpec,
    MailboxClosedError,
    MailboxFullError,
    ProtocolError,
    Request,
    SpawnError,
    Supervisor,
    TokenyardError,
    handler,
)
from runtime._transport import LONGEST_STEM
from tests.conftest import unread_mailbox

from ._actors import (
    Echo,
    GetCount,
    GetPid,
    Journal,
    Ping,
    Pong,
    Recorder,
    Slow,
    Started,
    StartsThenWaits,
    Tick,
    Worker,
)
from ._scripts import run_script_to_end

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


class Gate:
    """What an in-process actor's ``on_start`` and the test share."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.open = anyio.Event()
        self.cancelled = False


class HeldStart(Actor[Ping]):
    """Its ``on_start`` waits at the gate (and notes a cancellation)."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def on_start(self) -> None:
        self.gate.entered.set()
        try:
            await self.gate.open.wait()
        except anyio.get_cancelled_exc_class():
            self.gate.cancelled = True
            raise

    @handler
    def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n)


class LoadsInAThread(Actor[Ping]):
    """Its ``on_start`` loads in a thread, which no cancellation interrupts, until let go;
    then it notes that it is over."""

    def __init__(self, gate: Gate, release: threading.Event, over: list[str]) -> None:
        self.gate = gate
        self.release = release
        self.over = over

    async def on_start(self) -> None:
        self.gate.entered.set()
        try:
            await anyio.to_thread.run_sync(self.release.wait)
        finally:
            self.over.append("on_start")

    @handler
    def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n)


class Quit(Request[Pong]):
    """Raise this BaseException from the handler."""

    kind: str


class Quitter(Actor[Quit]):
    @handler
    def quit(self, msg: Quit) -> Pong:
        if msg.kind == "exit":
            raise SystemExit(3)
        if msg.kind == "exit0":
            raise SystemExit(0)
        raise KeyboardInterrupt


class ExitsInStart(Actor[Ping]):
    async def on_start(self) -> None:
        raise SystemExit(2)

    @handler
    def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n)


class Add(Request[Pong]):
    n: int


class Adder(Actor[Add]):
    """Answers each ``Add`` after a turn of the loop (asks queue up behind it)."""

    def __init__(self, handled: list[int]) -> None:
        self.handled = handled

    @handler
    async def add(self, msg: Add) -> Pong:
        await anyio.lowlevel.checkpoint()
        self.handled.append(msg.n)
        return Pong(n=msg.n)


async def still_serves(system: ActorSystem) -> None:
    echo = await system.spawn(Echo, process=False)
    assert await echo.ask(Ping(n=7), timeout=10) == Pong(n=7)


class TestAHostTaskCancelled:
    async def test_its_in_process_actors_end_with_no_warning(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The host's own cancellation (a Ctrl-C, a timeout) is no fault of its actors:
        before, each logged a WARNING that it had died."""
        with caplog.at_level(logging.INFO, logger="tokenyard.system"):
            with anyio.CancelScope() as scope:
                async with ActorSystem() as system:
                    echo = await system.spawn(Echo, name="echo", process=False)
                    assert await echo.ask(Ping(n=1), timeout=10) == Pong(n=1)
                    scope.cancel()
                    await anyio.sleep_forever()
        ends = [r for r in caplog.records if r.getMessage().startswith("actor echo ")]
        assert [(r.levelno, r.getMessage()) for r in ends] == [
            (logging.INFO, "actor echo ended: cancelled with its system's task")
        ]


class TestAnInProcessSpawnGivenUp:
    async def test_a_cancelled_spawn_cancels_its_actor_and_nothing_else(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        gate = Gate()
        with caplog.at_level(logging.INFO, logger="tokenyard.system"):
            async with ActorSystem() as system:
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tg:
                        spawn = functools.partial(
                            system.spawn, HeldStart, gate, name="held", process=False
                        )
                        tg.start_soon(spawn)
                        await gate.entered.wait()
                        scope.cancel()  # as a client that went away
                assert scope.cancelled_caught
                with anyio.fail_after(10):
                    await still_serves(system)
                assert gate.cancelled
                assert await system.lookup("held", missing_ok=True) is None
        # Its caller's doing, as the host's own cancellation is: no warning that it died.
        ends = [r for r in caplog.records if r.getMessage().startswith("actor held ")]
        assert [(r.levelno, r.getMessage()) for r in ends] == [
            (logging.INFO, "actor held ended: cancelled: its spawn was given up")
        ]

    @pytest.mark.parametrize("turns", [0, 1, 2, 3, 5, 8])
    async def test_a_spawn_cancelled_at_any_turn_leaves_the_host_running(self, turns: int) -> None:
        async with ActorSystem() as system:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        functools.partial(system.spawn, Echo, name="early", process=False)
                    )
                    for _ in range(turns):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()
            with anyio.fail_after(10):
                await still_serves(system)

    async def test_an_on_start_that_never_returns_fails_its_spawn_at_the_timeout(self) -> None:
        gate = Gate()
        async with ActorSystem() as system:
            with anyio.fail_after(10), pytest.raises(SpawnError, match=r"within 0\.3 s"):
                await system.spawn(HeldStart, gate, process=False, spawn_timeout=0.3)
            assert gate.cancelled
            with anyio.fail_after(10):
                await still_serves(system)

    async def test_a_system_closed_during_an_on_start_fails_the_spawn(self) -> None:
        gate = Gate()
        outcome: list[BaseException] = []

        async def spawn(system: ActorSystem) -> None:
            try:
                await system.spawn(HeldStart, gate, process=False)
            except SpawnError as err:
                outcome.append(err)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg, ActorSystem(shutdown_timeout=1) as system:
                tg.start_soon(spawn, system)
                await gate.entered.wait()
        (err,) = outcome
        assert "stopped before its on_start returned" in str(err)

    async def test_a_spawn_cancelled_twice_by_asyncio_raises_once_its_actor_is_gone(
        self,
    ) -> None:
        # asyncio's own cancellation passes anyio's shielded scopes: a spawn cancelled again
        # while its actor's on_start held out against the first cancellation raised at
        # once, the actor still starting, though an in-process actor is gone before its
        # given-up spawn raises.
        gate, release, over = Gate(), threading.Event(), list[str]()
        async with ActorSystem(shutdown_timeout=10) as system:
            task = asyncio.ensure_future(
                system.spawn(LoadsInAThread, gate, release, over, name="loads", process=False)
            )
            try:
                with anyio.fail_after(10):
                    await gate.entered.wait()
                task.cancel()  # as asyncio.timeout does
                await anyio.wait_all_tasks_blocked()  # waiting for its actor to end
                task.cancel()  # and again, as an outer timeout or a task group does
                await anyio.wait_all_tasks_blocked()
                assert not task.done()
            finally:
                release.set()
            with anyio.fail_after(10), pytest.raises(asyncio.CancelledError):
                await task
            assert over == ["on_start"]
            assert await system.lookup("loads", missing_ok=True) is None
            with anyio.fail_after(10):
                await still_serves(system)


class TestBaseExceptionsOfInProcessActors:
    @pytest.mark.parametrize("kind", ["exit", "interrupt"])
    async def test_one_from_a_handler_is_the_actors_death_not_the_hosts(self, kind: str) -> None:
        async with ActorSystem() as system:
            quitter = await system.spawn(Quitter, process=False)
            watch = system.watch(quitter)
            quitter.try_tell(Quit(kind=kind))
            with anyio.fail_after(10):
                down = await watch
                await still_serves(system)
            assert down.cause is Cause.EXCEPTION
            name = "SystemExit" if kind == "exit" else "KeyboardInterrupt"
            assert name in down.reason

    async def test_a_system_exit_with_status_0_is_a_normal_end(self) -> None:
        async with ActorSystem() as system:
            quitter = await system.spawn(Quitter, process=False)
            watch = system.watch(quitter)
            quitter.try_tell(Quit(kind="exit0"))
            with anyio.fail_after(10):
                down = await watch
            assert down.cause is Cause.NORMAL

    async def test_one_from_on_start_fails_the_spawn(self) -> None:
        async with ActorSystem() as system:
            with anyio.fail_after(10), pytest.raises(SpawnError, match="SystemExit"):
                await system.spawn(ExitsInStart, process=False)
            with anyio.fail_after(10):
                await still_serves(system)


class TestRepliesBeforeADeath:
    async def test_every_ask_an_in_process_actor_answered_before_its_stop_gets_its_answer(
        self,
    ) -> None:
        handled: list[int] = []
        replies: list[int] = []
        async with ActorSystem(shutdown_timeout=10) as system:
            adder = await system.spawn(Adder, handled, process=False)

            async def ask(n: int) -> None:
                replies.append((await adder.ask(Add(n=n), timeout=10)).n)

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    for n in range(5):
                        tg.start_soon(ask, n)
                    await anyio.lowlevel.checkpoint()  # each task has sent its ask
                    await system.stop(adder)
        assert handled == [0, 1, 2, 3, 4]
        assert sorted(replies) == handled


class TestWhatAClosingSystemLeaves:
    async def test_a_process_still_starting_when_the_system_closes_goes_with_it(self) -> None:
        # The no_leaks fixture fails this test if the process outlives the system.
        journal = Journal()
        outcome: list[BaseException] = []

        async def spawn(system: ActorSystem, recorder: ActorRef[Started]) -> None:
            try:
                await system.spawn(StartsThenWaits, recorder, name="late")
            except MailboxClosedError as err:
                outcome.append(err)

        with anyio.fail_after(30):
            # The spawn runs in a task of the host's, outside the system.
            async with anyio.create_task_group() as tg, ActorSystem(shutdown_timeout=2) as system:
                recorder = await system.spawn(Recorder, journal, process=False)
                tg.start_soon(spawn, system, recorder)
                await journal.wait_for(1)  # its on_start runs, and will not return
        assert len(outcome) == 1

    @pytest.mark.parametrize("process", [False, True])
    async def test_an_actor_that_ended_leaves_no_socket_file(self, process: bool) -> None:
        async with ActorSystem() as system:
            files = set(os.listdir(system.ipc_dir))
            with anyio.fail_after(60):
                for _ in range(3 if process else 20):
                    await system.stop(await system.spawn(Echo, process=process))
            assert set(os.listdir(system.ipc_dir)) <= files


class TestAnOpenSystemEnteredAgain:
    async def test_it_is_refused_and_the_system_it_was_closes_fully(self) -> None:
        """Before, the second entry made a second directory and station over the first,
        and the close removed only the second: the first directory outlived the system
        (the no_leaks fixture fails the test on it)."""
        system = ActorSystem()
        async with system:
            directory = system.ipc_dir
            with pytest.raises(TokenyardError, match="open already"):
                await system.__aenter__()
            assert system.ipc_dir == directory
            await still_serves(system)
        assert not os.path.exists(directory)


class TestTwoSystemsInOneLoop:
    @pytest.mark.parametrize(
        ("transport", "process"), [("ipc", False), ("ipc", True), ("tcp", False), ("tcp", True)]
    )
    async def test_a_ref_of_the_other_system_is_refused_naming_both_and_the_way_out(
        self, transport: str, process: bool
    ) -> None:
        """A task sends through the system it opened last. Before, over tcp, a tell to the
        other system's actor was lost, an ask timed out ('pass a longer timeout'), and that
        system logged a connection refused for another system's keys; over ipc, both said
        the address was 'not an address of this actor system', naming neither."""
        answers: list[Pong] = []
        go, answered = anyio.Event(), anyio.Event()

        async def ask_from_a(echo: ActorRef[Ping]) -> None:  # started before b: a's task
            await go.wait()
            answers.append(await echo.ask(Ping(n=2), timeout=30))
            answered.set()

        with anyio.fail_after(60):
            async with ActorSystem(name="a", transport=transport) as a:
                echo = await a.spawn(Echo, name="echo", process=process)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ask_from_a, echo)
                    async with ActorSystem(name="b", transport=transport):
                        sends = (lambda: echo.tell(Tick(n=1)), lambda: echo.ask(Ping(n=1)))
                        for send in sends:
                            with pytest.raises(
                                ProtocolError,
                                match=r"'echo' is of ActorSystem 'a', not of 'b', which this "
                                r"task sends through .* a task started before 'b' opened",
                            ):
                                await send()
                        go.set()
                        await answered.wait()
                assert answers == [Pong(n=2)]
                assert (await echo.ask(GetCount())).n == 0  # the tick was refused, not lost


class TestAnAttachedClient:
    @pytest.mark.parametrize("transport", ["ipc", "tcp"])
    async def test_it_looks_up_the_actors_of_the_system_it_joined_at_any_depth(
        self, tmp_path: Path, transport: str
    ) -> None:
        """Before, an attached client's lookup searched only its own (no) actors: every
        name of the system it joined was 'no live actor named ...'."""
        path = tmp_path / "credentials.json"
        async with ActorSystem(name="served", transport=transport) as system:
            await system.spawn(Echo, name="echo")  # a process of its own
            await system.spawn(Echo, name="near", process=False)
            # A child of a supervisor's process: found by asking that process in turn.
            await system.spawn(Supervisor, children=[ChildSpec(Echo, name="deep")], name="sup")
            system.credentials().save(path)
            names = ("echo", "near", "deep", "nobody")
            done = await anyio.to_thread.run_sync(
                functools.partial(
                    run_script_to_end, "attached_lookup.py", str(path), *names, timeout=60
                )
            )
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in done.stdout.splitlines()]
        assert lines[:3] == [
            {"name": name, "incarnation": 1, "pong": 7} for name in ("echo", "near", "deep")
        ]
        assert lines[3] == {
            "name": "nobody",
            "error": "no live actor named 'nobody' under system 'client' nor in the system "
            "it is attached to",
        }

    async def test_its_lookup_finds_a_live_actor_in_its_time_while_a_member_does_not_answer(
        self,
    ) -> None:
        """The system asked searches for the share of the asker's time, not for its own
        default. Before, with a member stopped, the root searched for 5 s, the client gave
        up at 3 and said the live actor was not there."""
        async with ActorSystem(name="served") as system:
            stopped = await system.spawn(Echo, name="stopped")  # started first: asked first
            pid = system.pid_of(stopped)
            assert pid is not None
            await system.spawn(Supervisor, children=[ChildSpec(Echo, name="deep")], name="sup")
            os.kill(pid, signal.SIGSTOP)
            try:
                async with ActorSystem(attach=system.credentials(), name="client") as client:
                    with anyio.fail_after(10):
                        deep = await client.lookup("deep", timeout=3)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert deep.name == "deep"
            assert await deep.ask(Ping(n=3)) == Pong(n=3)


class TestALookupSomeProcessDidNotAnswer:
    async def test_it_raises_that_the_actor_may_be_there_rather_than_say_it_is_missing(
        self,
    ) -> None:
        """Before, a lookup whose search a stopped process did not answer said "no live
        actor named ..." (or gave None with ``missing_ok``), whether or not the actor was
        under that process."""
        async with ActorSystem(name="served") as system:
            stopped = await system.spawn(Echo, name="stopped")
            pid = system.pid_of(stopped)
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                with anyio.fail_after(20):
                    for missing_ok in (False, True):
                        with pytest.raises(AskTimeoutError, match="it may be there") as raised:
                            await system.lookup("nowhere", timeout=1, missing_ok=missing_ok)
                        assert "1 did not search (stopped: " in str(raised.value)
                    # Asked through the system it joined, which did not hear back either.
                    async with ActorSystem(attach=system.credentials(), name="client") as client:
                        with pytest.raises(AskTimeoutError, match="the system it is attached"):
                            await client.lookup("nowhere", timeout=2)
            finally:
                os.kill(pid, signal.SIGCONT)
            with anyio.fail_after(20):  # everyone answers again: missing is missing
                with pytest.raises(ActorNotFoundError):
                    await system.lookup("nowhere")
                assert await system.lookup("nowhere", missing_ok=True) is None

    async def test_a_search_a_nested_process_did_not_answer_says_so_on_one_line(self) -> None:
        """Before, what the supervisor's process answered came with its remote traceback
        inside the message, over several lines, one more at each level."""
        async with ActorSystem(name="served") as system:
            await system.spawn(Supervisor, children=[ChildSpec(Worker, name="leaf")], name="sup")
            leaf = await system.lookup("leaf")
            pid = (await leaf.ask(GetPid())).pid
            os.kill(pid, signal.SIGSTOP)
            try:
                with anyio.fail_after(20), pytest.raises(AskTimeoutError) as raised:
                    await system.lookup("nowhere", timeout=2, missing_ok=True)
            finally:
                os.kill(pid, signal.SIGCONT)
            text = str(raised.value)
            assert "\n" not in text
            assert "traceback" not in text
            nested = r"\(sup: no actor named 'nowhere' .*\(leaf: no answer in [\d.]+ s\)"
            assert re.search(nested, text), text

    async def test_a_process_that_died_while_it_was_asked_had_nothing_to_give(self) -> None:
        async with ActorSystem(name="served") as system:
            dying = await system.spawn(Echo, name="dying")
            pid = system.pid_of(dying)
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)  # asked, it cannot answer before it dies
            asked = anyio.Event()
            outcome: list[BaseException] = []

            async def look() -> None:
                asked.set()  # the lookup takes the children to ask before it first waits
                try:
                    await system.lookup("nowhere", timeout=3)
                except TokenyardError as err:
                    outcome.append(err)

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(look)
                    await asked.wait()
                    down = system.watch(dying)
                    os.kill(pid, signal.SIGKILL)
                    await down
            assert [type(err) for err in outcome] == [ActorNotFoundError]


class TestManyLookupsAtOnce:
    async def test_a_burst_past_what_a_system_searches_at_once_waits_its_turn(self) -> None:
        """Before, a system asked for more than 64 lookups at once refused the rest, and
        the asker said no actor had the name (or, later, that some process did not
        search)."""
        async with ActorSystem(name="served") as system:
            slow = await system.spawn(Echo, name="slow")  # asked first, so waited for
            pid = system.pid_of(slow)
            assert pid is not None
            await system.spawn(Supervisor, children=[ChildSpec(Echo, name="deep")], name="sup")
            burst = 100
            found: list[ActorRef[Any] | BaseException] = []
            async with ActorSystem(attach=system.credentials(), name="client") as client:

                async def look() -> None:
                    try:
                        found.append(await client.lookup("deep", timeout=20))
                    except TokenyardError as err:
                        found.append(err)

                os.kill(pid, signal.SIGSTOP)  # every search waits on it: they pile up
                try:
                    with anyio.fail_after(20):
                        async with anyio.create_task_group() as tg:
                            for _ in range(burst):
                                tg.start_soon(look)
                            # All of them under way at the root (or some answered early).
                            while system._lookups < burst and not found:  # sync-ok
                                await anyio.lowlevel.checkpoint()
                            os.kill(pid, signal.SIGCONT)
                finally:
                    os.kill(pid, signal.SIGCONT)
            assert [ref.name if isinstance(ref, ActorRef) else ref for ref in found] == [
                "deep"
            ] * burst


class TestAnotherThreadsLoop:
    async def test_a_ref_used_from_another_threads_loop_says_where_its_system_runs(
        self,
    ) -> None:
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, process=False)
            errors: list[BaseException] = []

            def elsewhere() -> None:
                async def use() -> None:
                    for send in (echo.ask(Ping(n=1), timeout=5), echo.tell(Ping(n=1))):
                        try:
                            await send
                        except MailboxClosedError as err:
                            errors.append(err)
                    try:
                        echo.try_tell(Ping(n=1))
                    except MailboxClosedError as err:
                        errors.append(err)

                anyio.run(use)

            await anyio.to_thread.run_sync(elsewhere)
            assert len(errors) == 3
            assert all("another thread" in str(err) for err in errors)
            with anyio.fail_after(10):
                await still_serves(system)

    async def test_the_system_used_from_another_threads_loop_says_where_it_runs(self) -> None:
        """A sync endpoint's ``asyncio.run(system.spawn(...))``: before, an in-process spawn
        answered with a ref to an actor running in that thread's loop, which ended with it,
        and the system's close then waited for it for ever; a process spawn and a stop
        said the system was opened in another loop "of this thread"."""
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, process=False)
            errors: list[BaseException] = []

            def elsewhere() -> None:
                async def use() -> None:
                    for call in (
                        system.spawn(Echo, process=False),
                        system.spawn(Echo),
                        system.stop(echo),
                        system.kill(echo, "from another thread"),
                    ):
                        try:
                            await call
                        except MailboxClosedError as err:
                            errors.append(err)
                    try:
                        system.watch(echo)
                    except MailboxClosedError as err:
                        errors.append(err)

                asyncio.run(use())

            await anyio.to_thread.run_sync(elsewhere)
            assert len(errors) == 5
            assert all("another thread" in str(err) for err in errors)
            with anyio.fail_after(10):
                assert await echo.ask(Ping(n=3), timeout=5) == Pong(n=3)
                await still_serves(system)


class TestATimeoutThatIsNotANumber:
    """A NaN timeout went into the host's event loop as a timer: asyncio keeps its timers in
    a heap ordered by comparisons, which NaN answers ``False`` to, so every timer of the loop
    scheduled after it could wait forever (the ask itself never timed out)."""

    async def test_an_ask_refuses_it_and_the_hosts_timers_keep_firing(self) -> None:
        async with ActorSystem(shutdown_timeout=1) as system:
            echo = await system.spawn(Echo, process=False)
            with pytest.raises(ValueError, match=r"timeout=nan"):
                await echo.ask(Slow(seconds=0.01), timeout=math.nan)
            with anyio.fail_after(10):
                for _ in range(3):  # each reply waits on a timer of the loop
                    assert await echo.ask(Slow(seconds=0.01), timeout=5) == Pong(n=0)

    async def test_a_tell_waiting_on_a_full_mailbox_refuses_it(self) -> None:
        async with ActorSystem(hwm=10) as system:
            with unread_mailbox(system) as stuck:

                async def flood() -> None:
                    for i in range(1_000_000):
                        await stuck.tell(Tick(n=i), timeout=0.2)

                with anyio.fail_after(10):
                    with pytest.raises(MailboxFullError):
                        await flood()
                    with pytest.raises(ValueError, match=r"timeout=nan"):
                        await stuck.tell(Tick(n=-1), timeout=math.nan)


class TestAnotherAsyncLibrary:
    def test_under_anyios_trio_backend_a_system_says_so_and_leaves_nothing(self) -> None:
        """Before, it failed halfway with asyncio's "no running event loop", leaving its
        directory (the no_leaks fixture checks), sockets and libzmq threads behind."""
        pytest.importorskip("trio")
        outcome: list[BaseException] = []

        async def main() -> None:
            try:
                async with ActorSystem():
                    pass
            except TokenyardError as err:
                outcome.append(err)

        anyio.run(main, backend="trio")
        (err,) = outcome
        assert "trio backend is not supported" in str(err)


class TestATemporaryDirectoryTooLong:
    async def test_a_system_refuses_it_naming_tmpdir_and_leaves_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Before, the first bind failed with libzmq's message about sun_path, after the
        directory and its guardian were made."""
        long = tmp_path / ("d" * 100)
        long.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(long))
        with pytest.raises(ProtocolError, match=r"too long for ipc sockets.*set TMPDIR"):
            async with ActorSystem():
                pass
        assert list(long.iterdir()) == []

    async def test_the_longest_it_lets_through_serves_a_process_actor(
        self, short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Every socket file a system and its children bind fits under the longest temporary
        # directory the check lets through.
        system_dir = len(f"/tokenyard-{os.getpid()}-") + 8  # mkdtemp's 8 characters
        pad = zmq.IPC_PATH_MAX_LEN - len(str(short_tmp_path)) - 1 - system_dir - 1 - LONGEST_STEM
        long = short_tmp_path / ("d" * pad)
        long.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(long))
        async with ActorSystem() as system:
            assert len(os.path.join(system.ipc_dir, "x" * LONGEST_STEM)) == 107
            ref = await system.spawn(Echo, name="echo", start="spawn")
            forked = await system.spawn(Echo, name="forked")
            assert await ref.ask(Ping(n=1)) == Pong(n=1)
            assert await forked.ask(Ping(n=2)) == Pong(n=2)


def _fork_a_sender(refs: list[ActorRef[Any]]) -> tuple[int, int]:
    """Fork a child that reports what each send through ``refs`` raises there (``""``:
    none), one line each, on the pipe whose read end this returns with its pid. A child
    that hangs is ended by an alarm, and reports nothing."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave, running nothing of the parent's
        try:
            os.close(read)
            signal.alarm(5)
            outcomes = []
            for ref in refs:
                for send in ("try_tell", "ask"):
                    try:
                        if send == "try_tell":
                            ref.try_tell(Tick(n=1))
                        else:
                            asyncio.run(ref.ask(Ping(n=1), timeout=2))
                        outcomes.append("")
                    except Exception as err:
                        outcomes.append(f"{type(err).__name__}: {err}")
            os.write(write, "\n".join(outcomes).encode())
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def _report_of(pid: int, read: int) -> list[str]:
    try:
        with os.fdopen(read, "rb") as pipe:
            report = pipe.read().decode()
    finally:
        os.waitpid(pid, 0)
    return report.split("\n") if report else []


class TestAnotherLoopOfTheSameThread:
    def test_an_ask_from_a_later_loop_says_where_its_system_runs(self) -> None:
        """A system opened in one loop and asked from the next (a second ``asyncio.run``,
        a test framework's loop per test): before, asyncio's "attached to a different
        loop" RuntimeError, after the request had gone out."""
        opened = asyncio.new_event_loop()
        refs: asyncio.Future[ActorRef[Any]] = opened.create_future()
        done = asyncio.Event()

        async def host() -> None:  # opens and closes the system in one task, as it must
            async with ActorSystem() as system:
                refs.set_result(await system.spawn(Echo, process=False))
                await done.wait()

        async def ask_from_the_next_loop(echo: ActorRef[Any]) -> None:
            with pytest.raises(MailboxClosedError, match="opened in another event loop"):
                await echo.ask(Ping(n=1), timeout=5)

        try:
            hosting = opened.create_task(host())
            echo = opened.run_until_complete(asyncio.wait_for(refs, 10))
            asyncio.run(asyncio.wait_for(ask_from_the_next_loop(echo), 10))
            assert opened.run_until_complete(echo.ask(Ping(n=2), timeout=5)) == Pong(n=2)
            done.set()
            opened.run_until_complete(asyncio.wait_for(hosting, 10))
        finally:
            opened.close()


class TestClosedByAnotherTask:
    """A system's task group is left by the task that entered it; closing from any other
    task is refused, with the system left open for its own task to close."""

    def test_from_a_later_loop_it_says_so_and_its_own_loop_still_closes_it(self) -> None:
        """Before, with the opening loop still open, the close spun for ever: cancelling
        the system's tasks waited for a loop that did not run."""
        opened = asyncio.new_event_loop()
        system = ActorSystem(shutdown_timeout=2)
        refs: asyncio.Future[list[ActorRef[Any]]] = opened.create_future()
        done = asyncio.Event()

        async def host() -> None:
            async with system:
                refs.set_result([await system.spawn(Echo, process=False), await system.spawn(Echo)])
                await done.wait()

        async def close_from_the_next_loop() -> None:
            with pytest.raises(TokenyardError, match="opened in another event loop"):
                await system.__aexit__(None, None, None)

        try:
            hosting = opened.create_task(host())
            echoes = opened.run_until_complete(asyncio.wait_for(refs, 20))
            asyncio.run(asyncio.wait_for(close_from_the_next_loop(), 10))
            for n, echo in enumerate(echoes):  # still open, and serving
                assert opened.run_until_complete(echo.ask(Ping(n=n), timeout=5)) == Pong(n=n)
            done.set()
            opened.run_until_complete(asyncio.wait_for(hosting, 20))
        finally:
            opened.close()

    def test_after_its_loop_closed_it_says_so(self) -> None:
        """Before, asyncio.run then asyncio.run: anyio's RuntimeError about cancel scopes."""
        system = ActorSystem()

        async def close() -> None:
            with pytest.raises(TokenyardError, match="event loop that has closed since"):
                await system.__aexit__(None, None, None)

        asyncio.run(system.__aenter__())
        try:
            asyncio.run(asyncio.wait_for(close(), 10))
        finally:  # what nothing can close now but the end of the process
            system.station.close()
            system._remove_dir()

    def test_after_its_task_ended_it_says_so(self) -> None:
        """A system opened in a helper task that returned: no task can close it now."""
        system = ActorSystem()

        async def main() -> None:
            await asyncio.create_task(system.__aenter__())
            with pytest.raises(TokenyardError, match="task that has ended since"):
                await system.__aexit__(None, None, None)

        try:
            asyncio.run(asyncio.wait_for(main(), 10))
        finally:  # what nothing can close now but the end of the process
            system.station.close()
            system._remove_dir()

    async def test_from_another_task_it_says_so_and_leaves_it_open(self) -> None:
        """Before, another task's close stopped every actor, then failed on the task group,
        leaving the sockets open and the directory behind."""
        async with ActorSystem(shutdown_timeout=2) as system:
            echo = await system.spawn(Echo, process=False)
            with anyio.fail_after(10):
                closing = asyncio.ensure_future(system.__aexit__(None, None, None))
                with pytest.raises(TokenyardError, match="opened by another task"):
                    await closing
                assert await echo.ask(Ping(n=1), timeout=5) == Pong(n=1)


class TestAHostThatForks:
    @pytest.mark.filterwarnings("ignore:.*multi-threaded.*:DeprecationWarning")
    async def test_its_child_is_told_the_system_is_the_parents_and_the_parent_carries_on(
        self,
    ) -> None:
        """Before, a send in the child used the parent's sockets, copied without libzmq's
        threads: a tell hung for good, an ask failed on a future of the parent's loop."""
        async with ActorSystem() as system:
            refs = [
                await system.spawn(Echo, name="process"),
                await system.spawn(Echo, name="in-process", process=False),
            ]
            with anyio.fail_after(30):
                # Forked from the loop's own thread, as a host's handler would.
                outcomes = await anyio.to_thread.run_sync(_report_of, *_fork_a_sender(refs))
                assert len(outcomes) == 4
                for outcome in outcomes:
                    assert outcome.startswith("MailboxClosedError: ")
                    assert "forked from a process with one open" in outcome
                for ref in refs:
                    assert await ref.ask(Ping(n=2), timeout=10) == Pong(n=2)

    def test_a_child_that_unwinds_its_loop_leaves_the_parents_actors_serving(self) -> None:
        """Before, the child's ``asyncio.run``, cancelling its copy of an in-process
        actor's task, removed the mailbox's reader from the epoll set it shares with the
        parent: the parent's actor never answered again (and the child exited 1, its
        ``async with`` failing with no running loop)."""
        done = run_script_to_end("forks_and_exits.py", timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout) == {"child": 0, "in-process": 1, "process": 1}
