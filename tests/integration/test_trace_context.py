"""Trace context in the frame header: what a sender passes as ``trace=`` reaches the handler
as `runtime.current_trace`, in this event loop or another process, and costs an untraced
tell nothing on the wire."""

from __future__ import annotations

import os

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import pytest
import zmq

from runtime import (
    Actor,
    ActorRef,
    ActorSystem,
    MailboxFullError,
    Message,
    ProtocolError,
    Request,
    current_trace,
    handler,
)
from runtime._protocol import (
    HEADER_MARK,
    MAX_TRACE,
    MAX_TRACE_CHARS,
    Header,
    Kind,
    decode_header,
    encode_header,
)
from tests.conftest import unread_mailbox

from ._actors import GetTraces, Relay, Traced, TraceRecorder

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTHER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class TestTheHandlerSeesTheContext:
    @pytest.mark.parametrize("process", [False, True])
    async def test_each_tell_is_handled_with_its_own_context_and_none_leaks_to_the_next(
        self, process: bool
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(TraceRecorder, name="recorder", process=process)
            await ref.tell(Traced(n=1), trace=(PARENT,))
            await ref.tell(Traced(n=2))
            # A batch's contexts: one per request, "" for an untraced one.
            assert ref.try_tell(Traced(n=3), trace=(PARENT, "", OTHER))
            await ref.tell(Traced(n=4))
            traces = await ref.ask(GetTraces())
            assert traces.seen == [
                (1, (PARENT,)),
                (2, ()),
                (3, (PARENT, "", OTHER)),
                (4, ()),
            ]
            assert traces.asked == ()
            stats = await system.statistics(ref)
            assert stats.handled == 5  # four tells and the ask
            assert stats.rejected == 0

    async def test_an_ask_carries_its_context_to_the_handler(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(TraceRecorder, name="recorder", process=True)
            assert (await ref.ask(GetTraces(), trace=(OTHER,))).asked == (OTHER,)
            assert (await ref.ask(GetTraces())).asked == ()

    async def test_a_handler_passes_the_context_on_across_processes(self) -> None:
        async with ActorSystem() as system:
            first = await system.spawn(TraceRecorder, name="first", process=True)
            second = await system.spawn(TraceRecorder, name="second", process=True)
            relayed = await first.ask(Relay(n=7, to=second), trace=(PARENT,))
            assert relayed.seen == [(7, (PARENT,))]
            relayed = await first.ask(Relay(n=8, to=second))
            assert relayed.seen == [(7, (PARENT,)), (8, ())]

    def test_outside_a_handler_there_is_no_context(self) -> None:
        assert current_trace() == ()


class TestOnTheWire:
    async def test_an_untraced_tell_is_one_frame_and_a_traced_one_a_header_and_its_body(
        self,
    ) -> None:
        async with ActorSystem(shutdown_timeout=0.3) as system:
            sock = system.station.ctx.socket(zmq.PULL)
            path = os.path.join(system.ipc_dir, "wire")
            sock.bind(f"ipc://{path}")
            ref: ActorRef[Traced] = ActorRef("wire", f"ipc://{path}")
            try:
                await ref.tell(Traced(n=1))
                await ref.tell(Traced(n=2), trace=(PARENT, ""))
                plain = await anyio.to_thread.run_sync(sock.recv_multipart)
                traced = await anyio.to_thread.run_sync(sock.recv_multipart)
            finally:
                sock.close(0)
            decode = msgspec.msgpack.Decoder(Traced).decode
            assert len(plain) == 1
            assert decode(plain[0]) == Traced(n=1)
            assert len(traced) == 2
            assert traced[0][0] == HEADER_MARK
            header = decode_header(traced[0])
            assert header.kind is Kind.TELL
            assert header.trace == (PARENT, "")
            assert header.cookie == system.station.cookie
            assert decode(traced[1]) == Traced(n=2)

    async def test_a_traced_tell_to_a_full_mailbox_waits_its_timeout_then_fails(self) -> None:
        async with ActorSystem(hwm=10, send_timeout=0.2, shutdown_timeout=0.3) as system:
            with unread_mailbox(system) as stuck:

                async def flood() -> None:
                    for i in range(1_000_000):
                        await stuck.tell(Traced(n=i), trace=(PARENT,))

                with pytest.raises(MailboxFullError, match=r"stayed full"):
                    await flood()
                assert not stuck.try_tell(Traced(n=-1), trace=(PARENT,))
                started = anyio.current_time()
                with pytest.raises(MailboxFullError):
                    await stuck.tell(Traced(n=-1), trace=(PARENT,))
                assert anyio.current_time() - started >= 0.2


class TestFromAPeer:
    async def test_a_traced_tell_without_the_cookie_is_refused_and_the_actor_carries_on(
        self,
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(TraceRecorder, name="recorder", process=True)
            body = msgspec.msgpack.encode(Traced(n=1))
            forged = Header(Kind.TELL, 0, "", "attacker", trace=(PARENT,))
            cookied = Header(
                Kind.TELL, 0, "", "attacker", cookie=system.station.cookie, trace=("x",)
            )
            push = system.station.ctx.socket(zmq.PUSH)
            push.connect(ref.address)
            try:
                push.send_multipart([bytes(encode_header(forged)), body])
                # A well-formed traced tell from a peer that has the cookie is handled.
                push.send_multipart([bytes(encode_header(cookied)), body])
                with anyio.fail_after(10):
                    while (await system.statistics(ref)).rejected < 1:
                        await anyio.lowlevel.checkpoint()
            finally:
                push.close(0)
            with anyio.fail_after(10):
                while not (traces := await ref.ask(GetTraces())).seen:
                    await anyio.lowlevel.checkpoint()
            assert traces.seen == [(1, ("x",))]


class Later(Message):
    n: int


class Seen(Message):
    traces: list[tuple[str, ...]]


class GetSeen(Request[Seen]):
    pass


class Spawner(Actor[Later | GetSeen]):
    """A traced handler that starts a task: what does the task see?"""

    def __init__(self) -> None:
        self.seen: list[tuple[str, ...]] = []
        self.go = anyio.Event()

    async def _later(self) -> None:
        await self.go.wait()
        self.seen.append(current_trace())

    @handler
    def later(self, msg: Later) -> None:
        if msg.n == 0:
            self.start_soon(self._later)
        else:
            self.go.set()

    @handler
    async def get(self, msg: GetSeen) -> Seen:
        while not self.seen:
            await anyio.lowlevel.checkpoint()
        return Seen(traces=self.seen)


class TestTheTraceArgument:
    async def test_a_trace_over_its_bounds_is_refused_before_it_is_sent(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(TraceRecorder, name="recorder", process=False)
            with pytest.raises(ProtocolError, match="65,536"):
                await ref.tell(Traced(n=1), trace=[""] * (MAX_TRACE + 1))
            with pytest.raises(ProtocolError, match="513 characters"):
                ref.try_tell(Traced(n=2), trace=("x" * (MAX_TRACE_CHARS + 1),))
            with pytest.raises(ProtocolError, match="at most"):
                await ref.ask(GetTraces(), trace=[""] * (MAX_TRACE + 1))
            assert (await ref.ask(GetTraces())).seen == []

    @pytest.mark.parametrize("process", [False, True])
    async def test_one_traceparent_given_as_a_string_reaches_the_handler_whole(
        self, process: bool
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(TraceRecorder, name="recorder", process=process)
            await ref.tell(Traced(n=1), trace=PARENT)
            traces = await ref.ask(GetTraces())
            assert traces.seen == [(1, (PARENT,))]


class TestTasksOfATracedHandler:
    async def test_a_task_a_traced_handler_started_does_not_keep_its_context(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Spawner, name="spawner", process=False)
            await ref.tell(Later(n=0), trace=(PARENT,))
            await ref.tell(Later(n=1))  # untraced: the task runs after this one
            seen = await ref.ask(GetSeen())
            # A task copies its starter's context: it must not report that message's trace.
            assert seen.traces == [()]


class TestTracedTellsFromAPeer:
    async def test_refused_and_odd_traced_tells_are_counted_and_leak_nothing(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(TraceRecorder, name="recorder", process=True)
            cookie = system.station.cookie
            body = msgspec.msgpack.encode(Traced(n=1))

            def frame(trace: object, kind: Kind = Kind.TELL) -> bytes:
                h = msgspec.msgpack.encode([int(kind), 0, "", "peer", "", 1, cookie, trace])
                return b"\xc1" + h

            push = system.station.ctx.socket(zmq.PUSH)
            push.connect(ref.address)
            try:
                push.send_multipart([frame([1, 2]), body])  # wrong types: rejected
                push.send_multipart([frame("abc"), body])  # a string: rejected
                push.send_multipart([frame([PARENT]), b"\xc1garbage"])  # body refused late
                push.send_multipart([frame([PARENT]), msgspec.msgpack.encode({"x": 1})])
                push.send_multipart([frame([""] * MAX_TRACE), body])  # at the bound: handled
                push.send_multipart([frame([""] * (MAX_TRACE + 1)), body])  # over: rejected
                push.send_multipart([frame(["x" * (MAX_TRACE_CHARS + 1)]), body])  # too long
                push.send_multipart([bytes(encode_header(Header(Kind.TELL, cookie=cookie))), body])
                push.send(msgspec.msgpack.encode(Traced(n=2)))
                with anyio.fail_after(10):  # the socket stays open until all arrived
                    while len((traces := await ref.ask(GetTraces())).seen) < 3:
                        await anyio.lowlevel.checkpoint()
            finally:
                push.close(0)
            assert [(n, len(t)) for n, t in traces.seen] == [(1, MAX_TRACE), (1, 0), (2, 0)]
            stats = await system.statistics(ref)
            assert stats.rejected == 6
            assert stats.failed == 0
            assert stats.queued == 0
            assert stats.queued_bytes == 0
            assert stats.received == stats.rejected + stats.handled + 1  # and the STATS frame
