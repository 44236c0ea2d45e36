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

from runtime import ActorRef, ActorSystem, MailboxFullError, current_trace
from runtime._protocol import HEADER_MARK, Header, Kind, decode_header, encode_header

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
            sock = system.node.ctx.socket(zmq.PULL)
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
            assert header.cookie == system.node.cookie
            assert decode(traced[1]) == Traced(n=2)

    async def test_a_traced_tell_to_a_full_mailbox_waits_its_timeout_then_fails(self) -> None:
        async with ActorSystem(hwm=10, send_timeout=0.2, shutdown_timeout=0.3) as system:
            sock = system.node.ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.RCVHWM, 10)
            path = os.path.join(system.ipc_dir, "stuck")
            sock.bind(f"ipc://{path}")
            stuck: ActorRef[Traced] = ActorRef("stuck", f"ipc://{path}")

            async def flood() -> None:
                for i in range(1_000_000):
                    await stuck.tell(Traced(n=i), trace=(PARENT,))

            try:
                with pytest.raises(MailboxFullError, match=r"stayed full"):
                    await flood()
                assert not stuck.try_tell(Traced(n=-1), trace=(PARENT,))
                started = anyio.current_time()
                with pytest.raises(MailboxFullError):
                    await stuck.tell(Traced(n=-1), trace=(PARENT,))
                assert anyio.current_time() - started >= 0.2
            finally:
                sock.close(0)


class TestFromAPeer:
    async def test_a_traced_tell_without_the_cookie_is_refused_and_the_actor_carries_on(
        self,
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(TraceRecorder, name="recorder", process=True)
            body = msgspec.msgpack.encode(Traced(n=1))
            forged = Header(Kind.TELL, 0, "", "attacker", trace=(PARENT,))
            cookied = Header(Kind.TELL, 0, "", "attacker", cookie=system.node.cookie, trace=("x",))
            push = system.node.ctx.socket(zmq.PUSH)
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
