"""Actors in their own OS processes: ask/tell, errors, stop, titles, bad input."""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from runtime import (
    Actor,
    ActorDeadError,
    ActorRef,
    ActorSystem,
    AskTimeoutError,
    Cause,
    Message,
    RemoteActorError,
    Request,
    SpawnError,
    StartMethod,
    handler,
)
from runtime._protocol import Header, Kind, encode_header
from tests.conftest import actor_pids

from ._actors import (
    ArgumentKinds,
    BadStart,
    Collector,
    Count,
    Crash,
    Echo,
    Fail,
    Failure,
    Failures,
    FdWriter,
    Forward,
    Fragile,
    Gathered,
    GetCount,
    GetKinds,
    Ping,
    Pong,
    Slow,
    TellTo,
    Tick,
    Write,
)


class TestAskAndTell:
    async def test_ask_returns_the_handlers_reply_across_processes(self) -> None:
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, 3, name="echo")
            assert await echo.ask(Ping(n=7)) == Pong(n=21)

    async def test_tells_are_handled_in_order_and_counted(self) -> None:
        async with ActorSystem() as system:
            recorder = await system.spawn(Recorder, name="recorder")
            order = list(range(1000))
            random.Random(7).shuffle(order)  # sent in this order: handled in this order
            for n in order:
                await recorder.tell(Tick(n=n))
            assert await recorder.ask(GetSeen()) == Seen(ticks=order)

    async def test_spawn_returns_only_once_on_start_has_finished(self) -> None:
        async with ActorSystem() as system:
            started = anyio.current_time()
            slow = await system.spawn(SlowStart, 0.5, name="slow-start")
            assert anyio.current_time() - started >= 0.5
            assert await slow.ask(GetSeen()) == Seen(ticks=[], started=True)

    async def test_an_actors_own_ref_equals_the_one_its_parent_holds(self) -> None:
        async with ActorSystem() as system:
            recorder = await system.spawn(Recorder, name="recorder")
            me = await recorder.ask(WhoAmI())
            # Same owner too: whoever gets the actor's own ref subscribes to its death at
            # the node that sees it die, not at the actor's own node, which dies with it.
            assert me.ref == recorder

    async def test_no_socket_to_a_dead_childs_reply_inbox_is_kept(self) -> None:
        async with ActorSystem() as system:
            local = await system.spawn(Echo, 5, name="local", process=False)
            child = await system.spawn(Echo, name="asker")
            # The child asks an actor of this process: the answer needs a socket to the
            # child's reply inbox.
            assert await child.ask(Forward(target=local, n=1)) == Pong(n=5)
            record = system.spawner.children.get(child.address)
            assert record is not None
            inbox = record.station_address
            assert inbox in system.station.outbox.connected()
            await system.stop(child)
            assert inbox not in system.station.outbox.connected()

    async def test_an_ask_of_a_type_the_actor_does_not_accept_fails_as_a_protocol_error(
        self,
    ) -> None:
        async with ActorSystem() as system:
            recorder = await system.spawn(Recorder, name="recorder")
            with pytest.raises(RemoteActorError) as info:
                await recorder.ask(Ping(n=1))
            assert info.value.type_name == "runtime.ProtocolError"
            assert "recorder refused the message" in info.value.remote_message
            stats = await system.statistics(recorder)
            assert stats.rejected == 1
            assert await recorder.ask(GetSeen()) == Seen(ticks=[])  # and it still serves

    async def test_an_actor_can_ask_another_from_inside_a_handler(self) -> None:
        async with ActorSystem() as system:
            a = await system.spawn(Echo, 1, name="a")
            b = await system.spawn(Echo, 5, name="b")
            assert await a.ask(Forward(target=b, n=3)) == Pong(n=15)

    async def test_a_ref_sent_inside_a_message_can_be_used_by_the_receiver(self) -> None:
        gathered = Gathered()
        async with ActorSystem() as system:
            collector = await system.spawn(Collector, gathered, process=False, name="col")
            echo = await system.spawn(Echo, name="echo")
            await echo.tell(TellTo(target=collector, n=42))
            with anyio.fail_after(10):
                await gathered.wait_for(n_pings=1)
        assert gathered.pings == [42]

    @pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
    async def test_tcp_transport_works_the_same_on_the_configured_interface(
        self, host: str
    ) -> None:
        gathered = Gathered()
        async with ActorSystem(transport="tcp", tcp_host=host) as system:
            collector = await system.spawn(Collector, gathered, process=False, name="col")
            echo = await system.spawn(Echo, 2, collector, name="echo")
            assert echo.address.startswith(f"tcp://{host}:")
            assert collector.address.startswith(f"tcp://{host}:")
            assert await echo.ask(Ping(n=4)) == Pong(n=8)
            for i in range(100):
                await echo.tell(Tick(n=i))
            down = await system.stop(echo)
            assert down.normal
        assert gathered.counts == [Count(n=100, name="echo")]  # reported on its way out


class TestFailures:
    async def test_a_handler_exception_comes_back_as_remote_actor_error(self) -> None:
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, name="echo")
            with pytest.raises(RemoteActorError) as info:
                await echo.ask(Fail(text="broken on purpose"))
            assert info.value.type_name == "builtins.ValueError"
            assert info.value.remote_message == "broken on purpose"
            assert "raise ValueError(msg.text)" in info.value.remote_traceback
            # The actor lives on.
            assert await echo.ask(Ping(n=1)) == Pong(n=1)

    async def test_a_failing_tell_fails_only_that_message(self) -> None:
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, name="echo")
            await echo.tell(Fail(text="one bad message"))
            await echo.tell(Tick(n=1))
            assert await echo.ask(GetCount()) == Count(n=1, name="echo")
            stats = await system.statistics(echo)
            assert stats.failed == 1
            assert stats.handled == 2  # the Tick and the GetCount

    async def test_no_reply_in_time_raises_ask_timeout_error(self) -> None:
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, name="echo")
            with pytest.raises(AskTimeoutError) as info:
                await echo.ask(Slow(seconds=2.0), timeout=0.2)
            assert isinstance(info.value, TimeoutError)
            assert "within 0.2 s" in str(info.value)

    async def test_unencodable_spawn_arguments_fail_in_the_caller(self) -> None:
        async with ActorSystem() as system:
            with pytest.raises(SpawnError, match="not msgspec-encodable"):
                await system.spawn(Echo, object(), name="echo")
            assert actor_pids() == set()

    @pytest.mark.parametrize("process", [False, True])
    async def test_spawning_what_is_not_an_actor_class_says_so(self, process: bool) -> None:
        """Before, an instance failed on its missing ``__name__`` (an AttributeError from
        inside the runtime), and another class on having no handlers."""
        async with ActorSystem() as system:
            for wrong in (Echo(), int):
                with pytest.raises(TypeError, match="spawn takes an Actor subclass, not"):
                    await system.spawn(wrong, process=process)  # type: ignore[arg-type]
            assert actor_pids() == set()

    async def test_an_out_of_range_or_too_deep_spawn_argument_is_a_spawn_error_too(
        self,
    ) -> None:
        deep: list[Any] = []
        for _ in range(100_000):
            deep = [deep]
        async with ActorSystem() as system:
            for bad in (2**64, -(2**63) - 1, deep):
                with pytest.raises(SpawnError, match=r"argument 0 of Echo .* not msgspec-enc"):
                    await system.spawn(Echo, bad, name="echo")
                with pytest.raises(SpawnError, match=r"argument 'factor' of Echo"):
                    await system.spawn(Echo, factor=bad, name="echo")
            assert actor_pids() == set()
            assert await (await system.spawn(Echo, 2**63 - 1, name="echo")).ask(Ping(n=1)) == Pong(
                n=2**63 - 1
            )

    async def test_a_spawn_argument_of_another_type_than_annotated_is_named(self) -> None:
        async with ActorSystem() as system:
            with pytest.raises(
                SpawnError, match=r"argument 'factor' of Echo does not decode as .*int"
            ):
                await system.spawn(Echo, "three", name="echo")
            with pytest.raises(SpawnError, match=r"argument 'factor' of Echo does not decode"):
                await system.spawn(Echo, factor=[3], name="echo")

    async def test_one_unresolvable_annotation_leaves_the_other_arguments_typed(self) -> None:
        # `price` is annotated with a type imported under TYPE_CHECKING: the child cannot
        # resolve it, and that alone used to make every argument arrive untyped (a dict, a
        # list).
        async with ActorSystem() as system:
            ref = await system.spawn(ArgumentKinds, Count(n=1), (1, 2))
            assert (await ref.ask(GetKinds())).names == ["Count", "tuple", "NoneType"]

    async def test_an_on_start_failure_is_a_spawn_error_with_the_remote_text(self) -> None:
        async with ActorSystem() as system:
            with pytest.raises(SpawnError, match="on_start refuses"):
                await system.spawn(BadStart, name="bad")

    async def test_a_stopped_actor_refuses_further_asks(self) -> None:
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, name="echo")
            down = await system.stop(echo)
            assert down.reason == "normal"
            assert down.exitcode == 0
            with pytest.raises(ActorDeadError):
                await echo.ask(Ping(n=1))


class TestGracefulStop:
    async def test_every_tell_accepted_before_stop_is_handled(self) -> None:
        gathered = Gathered()
        async with ActorSystem() as system:
            collector = await system.spawn(Collector, gathered, process=False, name="col")
            echo = await system.spawn(Echo, 1, collector, name="echo")
            for i in range(100_000):
                await echo.tell(Tick(n=i))
            await system.stop(echo)
            with anyio.fail_after(10):
                await gathered.wait_for(n_counts=1)
        assert gathered.counts == [Count(n=100_000, name="echo")]

    async def test_leaving_the_system_handles_every_accepted_tell(self) -> None:
        gathered = Gathered()
        async with ActorSystem() as system:
            collector = await system.spawn(Collector, gathered, process=False, name="col")
            echo = await system.spawn(Echo, 1, collector, name="echo")
            for i in range(20_000):
                await echo.tell(Tick(n=i))
        # The collector was spawned first, so it stopped last: it got the report.
        assert gathered.counts == [Count(n=20_000, name="echo")]

    async def test_tells_an_actor_sent_before_it_stopped_reach_a_busy_receiver(
        self,
    ) -> None:
        async with ActorSystem(hwm=1000) as system:
            receiver = await system.spawn(Echo, name="receiver")
            sender = await system.spawn(Blaster, name="sender")
            # Busy for longer than a closing socket lingers: the sender's queue to it is
            # still full when the sender exits.
            await receiver.tell(Slow(seconds=1.5))
            await sender.ask(Blast(target=receiver, n=1500))
            down = await system.stop(sender)
            assert down.normal
            assert await receiver.ask(GetCount()) == Count(n=1500, name="receiver")

    async def test_tells_the_root_sent_reach_an_actor_it_does_not_stop_itself(self) -> None:
        gathered = Gathered()
        async with ActorSystem(hwm=1000) as system:
            # Spawned first, stopped last: it outlives the grandchild's report.
            collector = await system.spawn(Collector, gathered, process=False, name="col")
            parent = await system.spawn(Spawner, name="parent")
            spawned = await parent.ask(SpawnEcho(name="grandchild", report_to=collector))
            grandchild = spawned.ref
            await grandchild.tell(Slow(seconds=1.5))
            for i in range(1500):
                await grandchild.tell(Tick(n=i))
        # The root stops only its parent, which stops the grandchild: the root's ticks
        # reached it first, though the grandchild was busy when the root left.
        assert gathered.counts == [Count(n=1500, name="grandchild")]


class GetSeen(Request["Seen"]):
    pass


class Seen(Message):
    ticks: list[int]
    started: bool = False


class WhoAmI(Request["Me"]):
    pass


class Me(Message):
    ref: ActorRef[Any]


class Recorder(Actor[Tick | GetSeen | WhoAmI]):
    """Records every tick in the order handled."""

    def __init__(self) -> None:
        self.ticks: list[int] = []
        self.started = False

    @handler
    def tick(self, msg: Tick) -> None:
        self.ticks.append(msg.n)

    @handler
    def seen(self, msg: GetSeen) -> Seen:
        return Seen(ticks=self.ticks, started=self.started)

    @handler
    def who_am_i(self, msg: WhoAmI) -> Me:
        return Me(ref=self.ref)


class SlowStart(Recorder):
    """Takes ``seconds`` to start."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def on_start(self) -> None:
        await anyio.sleep(self.seconds)  # sync-ok: the start-up time under test
        self.started = True


class Blast(Request[None]):
    """Tell ``n`` ticks to ``target``."""

    target: ActorRef[Any]
    n: int


class Blaster(Actor[Blast]):
    @handler
    async def blast(self, msg: Blast) -> None:
        for i in range(msg.n):
            await msg.target.tell(Tick(n=i))


class SpawnEcho(Request["EchoSpawned"]):
    """Spawn an ``Echo`` child reporting its count to ``report_to`` when it stops."""

    name: str
    report_to: ActorRef[Any]


class EchoSpawned(Message):
    ref: ActorRef[Any]


class Spawner(Actor[SpawnEcho]):
    @handler
    async def spawn_echo(self, msg: SpawnEcho) -> EchoSpawned:
        ref = await self.system.spawn(Echo, 1, msg.report_to, name=msg.name)
        return EchoSpawned(ref=ref)


class TestDeathWhileFull:
    async def test_a_tell_and_an_ask_waiting_on_a_full_mailbox_fail_when_the_actor_dies(
        self,
    ) -> None:
        async with ActorSystem(hwm=100, send_timeout=30.0) as system:
            busy = await system.spawn(Echo, name="busy")
            await busy.tell(Slow(seconds=30.0))
            pid = system.pid_of(busy)
            assert pid is not None
            failed: list[str] = []

            async def flood() -> None:
                try:
                    for i in itertools.count():  # until a tell waits for room, and longer
                        await busy.tell(Tick(n=i))
                except ActorDeadError:
                    failed.append("tell")

            async def ask() -> None:
                with pytest.raises(ActorDeadError):
                    await busy.ask(Ping(n=1), timeout=30.0)
                failed.append("ask")

            with anyio.fail_after(10):  # well before their own 30 s
                async with anyio.create_task_group() as tg:
                    tg.start_soon(flood)
                    await anyio.wait_all_tasks_blocked()  # the queues are full
                    tg.start_soon(ask)
                    await anyio.wait_all_tasks_blocked()  # both wait for room
                    os.kill(pid, signal.SIGKILL)
            assert sorted(failed) == ["ask", "tell"]


class TestBadInput:
    async def test_garbage_frames_are_rejected_counted_and_the_actor_keeps_serving(
        self,
    ) -> None:
        rng = random.Random(1234)
        wrong_type = msgspec.msgpack.encode(Count(n=1))
        good = msgspec.msgpack.encode(Ping(n=1))
        frames: list[bytes] = []
        for i in range(10_000):
            kind = i % 4
            if kind == 0:
                frames.append(rng.randbytes(rng.randint(0, 64)))
            elif kind == 1:
                frames.append(good[: rng.randint(0, len(good) - 1)])  # truncated
            elif kind == 2:
                frames.append(wrong_type)  # well-formed, but not accepted
            else:
                frames.append(b"\xc1" + rng.randbytes(rng.randint(0, 32)))  # fake headers
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, name="echo")
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            try:
                sock.connect(echo.address)
                for frame in frames:
                    sock.send(frame)
                # Last on the same pipe, so handled after every bad frame before it.
                sock.send(msgspec.msgpack.encode(Tick(n=1)))
                asks = 1
                with anyio.fail_after(30):
                    while (await echo.ask(GetCount())).n < 1:
                        asks += 1  # each ask is a round trip through the mailbox
                assert await echo.ask(Ping(n=5)) == Pong(n=5)
                stats = await system.statistics(echo)
            finally:
                sock.close(linger=0)
                ctx.term()
            assert stats.rejected == len(frames)
            assert stats.handled == 1 + asks + 1  # the Tick, the GetCounts, the Ping

    async def test_a_header_lying_about_its_frame_count_swallows_no_other_message(
        self,
    ) -> None:
        ask = Header(Kind.ASK, 1, "ipc:///nowhere", "liar")
        lies: list[list[bytes | bytearray]] = [
            [encode_header(msgspec.structs.replace(ask, frames=3))],  # announces 3, has none
            [encode_header(ask), msgspec.msgpack.encode(Ping(n=1)), b"extra", b"parts"],
        ]
        gathered = Gathered()
        async with ActorSystem() as system:
            collector = await system.spawn(Collector, gathered, process=False, name="col")
            echo = await system.spawn(Echo, name="echo")
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            try:
                sock.connect(echo.address)
                # The actor sleeps in a handler meanwhile, so it reads the lies and the
                # good tells behind them in one drain.
                sock.send(msgspec.msgpack.encode(Slow(seconds=0.3)))
                for lie in lies:
                    sock.send_multipart(lie)
                    for i in range(3):
                        sock.send(msgspec.msgpack.encode(Tick(n=i)))
                # Last on the same pipe: handled after everything before it.
                sock.send(msgspec.msgpack.encode(TellTo(target=collector, n=99)))
                with anyio.fail_after(10):
                    await gathered.wait_for(n_pings=1)
                assert await echo.ask(GetCount()) == Count(n=6, name="echo")
                stats = await system.statistics(echo)
            finally:
                sock.close(linger=0)
                ctx.term()
            assert stats.rejected == len(lies)


class TestProcesses:
    async def test_each_actor_process_is_titled_with_its_name_and_pid(self) -> None:
        async with ActorSystem() as system:
            await system.spawn(Echo, name="titled")
            (pid,) = actor_pids()
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            assert title == f"tokenyard::titled:{pid}"

    async def test_an_actor_process_has_its_own_group_in_its_roots_session(self) -> None:
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, name="grouped")
            pid = system.pid_of(echo)
            assert pid is not None
            # Its own process group: a terminal's Ctrl-C (sent to the foreground group)
            # reaches the root only, which stops the tree in order.
            assert os.getpgid(pid) == pid != os.getpgrp()
            # The root's session: the same scheduling autogroup as the root.
            assert os.getsid(pid) == os.getsid(0)

    async def test_the_ipc_directory_is_private_and_removed_at_exit(self) -> None:
        async with ActorSystem() as system:
            await system.spawn(Echo, name="echo")
            mode = os.stat(system.ipc_dir).st_mode & 0o777
            assert mode == 0o700
            assert any(Path(system.ipc_dir).iterdir())
        assert not Path(system.ipc_dir).exists()


class TestLifecycleHooks:
    @pytest.mark.parametrize("process", [True, False])
    async def test_on_failure_runs_once_when_an_actor_dies_of_an_error_wherever_it_runs(
        self, process: bool
    ) -> None:
        async with ActorSystem() as system:
            journal: list[Failure] = []
            arrived = anyio.Event()
            failures = await system.spawn(Failures, journal, arrived, process=False)
            fragile = await system.spawn(Fragile, failures, name="fragile", process=process)
            watch = system.watch(fragile)
            await fragile.tell(Crash(text="on purpose"))
            with anyio.fail_after(10):
                down = await watch
                await arrived.wait()
            assert journal == [Failure(name="fragile", error="RuntimeError('on purpose')")]
            assert down.cause is Cause.EXCEPTION
            assert "on purpose" in down.reason

    @pytest.mark.parametrize("process", [True, False])
    async def test_on_failure_does_not_run_on_a_graceful_stop(self, process: bool) -> None:
        async with ActorSystem() as system:
            journal: list[Failure] = []
            failures = await system.spawn(Failures, journal, anyio.Event(), process=False)
            fragile = await system.spawn(Fragile, failures, name="fragile", process=process)
            down = await system.stop(fragile)
            assert down.cause is Cause.NORMAL
            assert down.normal
            await system.stop(failures)  # handled everything told before: nothing came
            assert journal == []


class TestInheritedDescriptors:
    @pytest.mark.parametrize("start", ["fork-server", "spawn"])
    async def test_an_actor_process_inherits_the_descriptors_it_is_given_and_no_other(
        self, start: StartMethod
    ) -> None:
        given, kept = socket.socketpair()
        other, other_peer = socket.socketpair()
        try:
            async with ActorSystem(start=start) as system:
                writer = await system.spawn(
                    FdWriter, given.fileno(), name="writer", inherit=[given.fileno()]
                )
                await writer.ask(Write(data=b"through the inherited end"))
                kept.setblocking(True)
                assert kept.recv(64) == b"through the inherited end"
                pid = system.pid_of(writer)
                assert pid is not None
                inodes = {
                    os.stat(f"/proc/{pid}/fd/{fd}").st_ino for fd in os.listdir(f"/proc/{pid}/fd")
                }
                assert os.fstat(given.fileno()).st_ino in inodes
                assert os.fstat(other.fileno()).st_ino not in inodes
        finally:
            for sock in (given, kept, other, other_peer):
                sock.close()
