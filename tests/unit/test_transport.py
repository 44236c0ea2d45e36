"""Bounded queues and sizes: a full mailbox, an oversized message, bad settings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import select
import time
import tracemalloc
from typing import TYPE_CHECKING, Any

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
    AskTimeoutError,
    MailboxFullError,
    Message,
    ProtocolError,
    Request,
    current_trace,
    handler,
)
from runtime._codec import MailboxDecoder
from runtime._mailbox import Envelope, Item, Mailbox
from runtime._protocol import (
    MAX_TRACE,
    MAX_TRACE_CHARS,
    REMEMBERED_BYTES,
    REMEMBERED_CONTEXTS,
    Header,
    HeaderTemplate,
    Kind,
    TellHeaders,
    TellsDecoder,
    Traced,
    bundle_decoder,
    checked_trace,
    decode_header,
    encode_header,
    trace_chars,
)
from runtime._transport import POLLIN, Outbox, ReadinessWaiter, TransportOptions
from tests.conftest import unread_mailbox

from ._messages import Counter, Ping, Point, Pong

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator, Sequence


class TestOptions:
    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"hwm": 0}, "0 is unbounded"),
            ({"max_message_size": 0}, "must be positive"),
            ({"transport": "udp"}, "choose 'ipc' or 'tcp'"),
            # Before, NaN passed every range check (a traceback deep in the system's start
            # for a heartbeat of NaN); past a day, libzmq's heartbeat settings overflow.
            ({"heartbeat": math.nan}, "heartbeat=nan: give seconds above 0"),
            ({"heartbeat": 1e7}, "at most 86400"),
            ({"heartbeat": 0.0}, "heartbeat=0.0"),
            ({"send_timeout": math.nan}, "send_timeout=nan: give a finite number"),
            ({"peer_idle": math.inf}, "peer_idle=inf: give a finite number"),
        ],
    )
    def test_unsafe_or_unknown_settings_are_refused(
        self, kwargs: dict[str, object], match: str
    ) -> None:
        with pytest.raises(ValueError, match=match):
            TransportOptions(**kwargs)  # type: ignore[arg-type]


@contextlib.contextmanager
def bare_mailbox(
    system: ActorSystem, name: str
) -> Iterator[tuple[zmq.Socket[bytes], ActorRef[Ping]]]:
    """A PULL socket in ``system``'s directory, taking 10 messages and read by the test
    alone, and a ref to it (closed on the way out)."""
    sock = system.station.ctx.socket(zmq.PULL)
    try:
        sock.setsockopt(zmq.RCVHWM, 10)
        path = os.path.join(system.ipc_dir, name)
        sock.bind(f"ipc://{path}")
        yield sock, ActorRef(name, f"ipc://{path}")
    finally:
        sock.close(0)


async def fill(ref: ActorRef[Ping]) -> int:
    """Tell ``ref`` numbered pings until its mailbox stays full for 50 ms; how many went. (A
    tell refused at once is not enough: libzmq's I/O thread may still be making room.)"""
    sent = 0
    with contextlib.suppress(MailboxFullError):
        while True:
            await ref.tell(Ping(n=sent), timeout=0.05)
            sent += 1
    return sent


@contextlib.asynccontextmanager
async def full_mailbox(
    name: str,
) -> AsyncIterator[tuple[ActorSystem, zmq.Socket[bytes], ActorRef[Ping], int]]:
    """A system whose tells wait 30 s for room, a `bare_mailbox` in it that `fill` filled,
    and how many pings that took."""
    async with ActorSystem(hwm=10, send_timeout=30.0, shutdown_timeout=0.3) as system:
        with bare_mailbox(system, name) as (sock, reader):
            yield system, sock, reader, await fill(reader)


async def assert_read(sock: zmq.Socket[bytes], received: list[bytes], sent: int, last: int) -> None:
    """``received`` are the ``sent`` pings `fill` told, in order, and the next one on
    ``sock`` is ``Ping(n=last)``."""
    decode = msgspec.msgpack.Decoder(Ping).decode
    assert [decode(f).n for f in received] == list(range(sent))
    assert decode(await anyio.to_thread.run_sync(sock.recv)) == Ping(n=last)


class TestFullMailbox:
    async def test_a_tell_to_a_mailbox_that_stays_full_fails_after_its_timeout(self) -> None:
        # A bare socket never acknowledges the exit's flush: a short shutdown_timeout.
        async with ActorSystem(hwm=10, send_timeout=0.2, shutdown_timeout=0.3) as system:
            with unread_mailbox(system) as stuck:

                async def flood() -> None:
                    for i in range(1_000_000):
                        await stuck.tell(Ping(n=i))

                with pytest.raises(MailboxFullError, match=r"stayed full \(hwm=10\) for 0.2 s"):
                    await flood()
                # The failing tell waited its whole timeout first.
                started = anyio.current_time()
                with pytest.raises(MailboxFullError):
                    await stuck.tell(Ping(n=-1))
                assert anyio.current_time() - started >= 0.2

    async def test_a_tell_waiting_on_a_full_mailbox_goes_through_once_there_is_room(
        self,
    ) -> None:
        async with full_mailbox("slow-reader") as (_, sock, reader, sent):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader.tell, Ping(n=-1))
                await anyio.wait_all_tasks_blocked()  # the tell waits for room
                received = [sock.recv() for _ in range(sent)]  # makes room
            await assert_read(sock, received, sent, last=-1)

    async def test_a_tell_waiting_for_room_cancelled_as_it_is_woken_is_cancelled(
        self,
    ) -> None:
        # asyncio's cancellation may reach a task in the turn the room it waits for came
        # (``Task.cancel``, ``asyncio.timeout``): the tell must raise it. Waited through
        # ``asyncio.wait_for`` (Python 3.11's swallows a cancellation that meets a done
        # inner wait), it sent and returned instead, and the task lived on uncancelled.
        async with full_mailbox("cancelled-writer") as (system, sock, reader, sent):
            waiter = system.station.outbox._peers[reader.address].waiter
            release = waiter._release
            task: asyncio.Task[None] | None = None

            def release_then_cancel() -> bool:  # the loop's reader, once the room came
                woke = release()
                assert task is not None
                task.cancel()
                return woke

            waiter._release = release_then_cancel  # type: ignore[method-assign]
            task = asyncio.ensure_future(reader.tell(Ping(n=-1)))
            await anyio.wait_all_tasks_blocked()
            assert not task.done()  # the tell waits for room
            received = [sock.recv() for _ in range(sent)]  # makes room
            with anyio.fail_after(5), pytest.raises(asyncio.CancelledError):
                await task
            waiter._release = release  # type: ignore[method-assign]
            await reader.tell(Ping(n=-2))  # the ref and its socket serve on
            await assert_read(sock, received, sent, last=-2)  # the cancelled one: not sent

    async def test_an_ask_that_waited_for_room_times_out_within_its_own_timeout(self) -> None:
        # Its reply's timer began once the request was sent: an ask that had waited most of
        # its timeout for room then waited the whole timeout again for its reply.
        async with ActorSystem(hwm=10, shutdown_timeout=0.3) as system:
            with bare_mailbox(system, "late-reader") as (sock, reader):
                await fill(reader)

                async def make_room_late() -> None:
                    await anyio.sleep(0.6)  # sync-ok: the room comes late on purpose
                    while True:  # a reader at last, one that never answers
                        try:
                            sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            await anyio.sleep(0.005)  # sync-ok: a slow reader's pace

                async def ask() -> None:
                    with pytest.raises(AskTimeoutError, match=r"within 1 s"):
                        await reader.ask(Ping(n=1), timeout=1.0)

                started = anyio.current_time()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(make_room_late)
                    await ask()
                    tg.cancel_scope.cancel()
                assert anyio.current_time() - started < 1.3


class TestMessageSize:
    async def test_an_oversized_message_is_refused_by_the_sender_with_the_knob_named(
        self,
    ) -> None:
        async with ActorSystem(max_message_size=1024) as system:
            ref = await system.spawn(Counter, process=False)
            with pytest.raises(ProtocolError, match=r"max_message_size=1024"):
                await ref.tell(Point(x=1, y=2, label="x" * 2000))
            assert await ref.ask(Ping(n=1)) == Pong(n=2)


class TestRejections:
    async def test_rejections_are_counted_each_and_logged_at_most_once_a_few_seconds(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, process=False, name="counter")
            push = system.station.ctx.socket(zmq.PUSH)
            push.connect(ref.address)
            try:
                with caplog.at_level(logging.WARNING, logger="tokenyard.mailbox"):
                    for i in range(100):
                        push.send(b"\xff garbage %d" % i)
                    stats = await system.statistics(ref)
                    while stats.rejected < 100:  # another pipe than the garbage: ask again
                        assert await ref.ask(Ping(n=1)) == Pong(n=2)
                        stats = await system.statistics(ref)
            finally:
                push.close(0)
        assert stats.rejected == 100
        lines = [r for r in caplog.records if r.name == "tokenyard.mailbox"]
        assert len(lines) == 1
        assert "counter rejected a message" in lines[0].getMessage()


class Hold(Message):
    seconds: float


class Holder(Actor[Hold | Ping]):
    """Awaits inside a handler, as an actor asking another actor does (runs in-process)."""

    #: Set by the test: the hold has begun and nobody waits on the mailbox's fd.
    holding: anyio.Event | None = None

    @handler
    async def hold(self, msg: Hold) -> None:
        assert Holder.holding is not None
        Holder.holding.set()
        await anyio.sleep(msg.seconds)  # sync-ok: the handler's own work, not a wait on state

    @handler
    def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n + 1)


@contextlib.contextmanager
def watched_pull(
    name: str,
) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes], ReadinessWaiter, int]]:
    """An inproc PULL socket fed by a PUSH, the PULL's `ReadinessWaiter` and its fd; all
    closed on the way out."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(f"inproc://{name}")
    push.connect(f"inproc://{name}")
    waiter = ReadinessWaiter(pull)
    fd = pull.getsockopt(zmq.FD)
    assert isinstance(fd, int)
    try:
        yield pull, push, waiter, fd
    finally:
        waiter.close()
        pull.close(0)
        push.close(0)
        ctx.term()


class TestReadinessWaiter:
    """The loop reader stays registered between waits, so it must never spin the loop."""

    async def test_signals_nobody_waits_for_are_consumed_and_the_loop_stays_idle(self) -> None:
        with watched_pull("waiter") as (pull, push, waiter, _):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter.wait, POLLIN)
                await anyio.wait_all_tasks_blocked()  # it sleeps: the loop reader is registered
                push.send(b"first")
            assert pull.recv() == b"first"
            with pytest.raises(zmq.Again):  # the reader finds the pipe empty: the next
                pull.recv(zmq.NOBLOCK)  # message raises a signal on the fd
            # Signals while nobody waits: the reader fires and must consume each one.
            for i in range(100):
                push.send(b"%d" % i)
            cpu = time.process_time()
            await anyio.sleep(0.3)  # sync-ok: measures that an idle loop does not spin
            assert time.process_time() - cpu < 0.15, "the loop spun on a zmq fd signal"
            await waiter.wait(POLLIN)  # messages queued meanwhile: no wait at all
            assert [pull.recv() for _ in range(100)] == [b"%d" % i for i in range(100)]

    async def test_a_wake_up_consumes_its_signal_so_the_loop_reports_each_message_once(
        self,
    ) -> None:
        # Left set until the woken task read, the signal was reported again by the loop's
        # next poll, which runs before that task: the stale report then woke the wait the
        # task had begun after its read, for nothing (a loop iteration and a failed read
        # more per message, on every actor answering asks one at a time).
        with watched_pull("waiter") as (pull, push, waiter, fd):

            async def send_once_waiting(data: bytes) -> None:
                await anyio.wait_all_tasks_blocked()
                push.send(data)

            for i in range(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(send_once_waiting, b"%d" % i)
                    await waiter.woken()
                    # Woken, nothing read yet: the loop has nothing more to report.
                    assert select.select([fd], [], [], 0)[0] == [], f"message {i}"
                assert pull.recv(zmq.NOBLOCK) == b"%d" % i
                with pytest.raises(zmq.Again):  # as a mailbox's drain ends
                    pull.recv(zmq.NOBLOCK)
                waiter.rearmed()

    @pytest.mark.parametrize("cancelled", ["asleep", "woken"])
    async def test_a_wait_cancelled_loses_no_wake_up(self, cancelled: str) -> None:
        # The loop's reader consumes the signal as the fd fires. A waiter cancelled while
        # asleep, or woken and cancelled before it ran, must leave the wake-up to the next
        # wait: else that wait sleeps with a message queued, and no later message signals
        # again until a read has failed.
        with watched_pull("waiter-cancelled") as (pull, push, waiter, fd):
            pull.getsockopt(zmq.EVENTS)  # consumes the signal the connection itself raised
            assert select.select([fd], [], [], 0)[0] == []
            # Cancelled as asyncio cancels (``wait_for``, ``Task.cancel``): a task woken
            # and not yet run is cancelled all the same (anyio's scopes wait for it to run).
            task = asyncio.ensure_future(waiter.woken())
            await anyio.wait_all_tasks_blocked()
            if cancelled == "woken":
                push.send(b"m")
                waiter._wake()  # as the loop's reader does when the fd fires
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            if cancelled == "asleep":
                push.send(b"m")
                while select.select([fd], [], [], 0)[0]:  # until the reader has fired
                    await anyio.lowlevel.checkpoint()  # one loop turn
            with anyio.fail_after(2):
                await waiter.woken()
            assert pull.recv(zmq.NOBLOCK) == b"m"

    async def test_tells_arriving_while_a_handler_awaits_do_not_spin_the_loop(self) -> None:
        Holder.holding = anyio.Event()
        async with ActorSystem() as system:
            ref = await system.spawn(Holder, process=False)
            cpu = time.process_time()
            await ref.tell(Hold(seconds=0.3))
            await Holder.holding.wait()
            for i in range(50):  # queued while the handler awaits: nobody waits on the fd
                await ref.tell(Ping(n=i))
            assert await ref.ask(Ping(n=1)) == Pong(n=2)
            assert time.process_time() - cpu < 0.15, "the loop spun while the handler awaited"


@contextlib.contextmanager
def open_outbox(
    system: ActorSystem, sinks: int, **options: Any
) -> Iterator[tuple[Outbox, list[str]]]:
    """An outbox of its own in ``system``'s process, and ``sinks`` bare PULL sockets bound
    in its directory for it to send to."""
    outbox = Outbox(system.station.ctx, TransportOptions(**options), system.station.policy)
    socks: list[zmq.Socket[bytes]] = []
    addresses: list[str] = []
    try:
        for i in range(sinks):
            sock = system.station.ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            socks.append(sock)
            addresses.append(f"ipc://{system.ipc_dir}/sink-{i}")
            sock.bind(addresses[-1])
        yield outbox, addresses
    finally:
        outbox.close(0)
        for sock in socks:
            sock.close()


class TestOutbox:
    async def test_the_least_recently_used_socket_is_the_one_closed_to_make_room(self) -> None:
        async with ActorSystem() as system:
            with open_outbox(system, 3, max_peers=2) as (outbox, (a, b, c)):
                for address in (a, b, a):
                    assert outbox.try_send(address, b"x")
                assert outbox.try_send(c, b"x")
                assert sorted(outbox.connected()) == [a, c]
                assert outbox.evicted == 1

    async def test_a_socket_is_closed_at_the_third_sweep_after_its_last_use_and_reopened(
        self,
    ) -> None:
        async with ActorSystem() as system:
            with open_outbox(system, 2) as (outbox, (a, b)):
                assert outbox.try_send(a, b"x")
                assert outbox.try_send(b, b"x")
                outbox.sweep()
                assert outbox.try_send(b, b"x")  # b used again since the first sweep
                outbox.sweep()
                assert sorted(outbox.connected()) == [a, b]
                outbox.sweep()
                assert outbox.connected() == [b]
                assert outbox.idled == 1
                assert outbox.try_send(a, b"x")  # reopened on demand
                assert sorted(outbox.connected()) == [a, b]
                outbox.sweep()
                assert outbox.connected() == [a]
                assert outbox.idled == 2


class Seq(Message):
    n: int


class Seen(Message):
    seen: list[tuple[int, tuple[str, ...]]]


class GetSeen(Request[Seen]):
    pass


class Recorder(Actor[Seq | GetSeen]):
    """Records each tell's number and the trace context its handler saw; a negative number's
    handler raises after recording."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, tuple[str, ...]]] = []

    @handler
    def seq(self, msg: Seq) -> None:
        self.seen.append((msg.n, current_trace()))
        if msg.n < 0:
            raise ValueError(msg.n)

    @handler
    def get(self, msg: GetSeen) -> Seen:
        return Seen(seen=self.seen)


def _told(n: int) -> tuple[int, tuple[str, ...]]:
    """What the Recorder sees of tell ``n`` below: every third one traced."""
    return (n, (f"ctx-{n}",) if n % 3 == 0 else ())


def _traces(items: Sequence[object]) -> list[tuple[str, ...]]:
    """The contexts of the traced tells among ``items``, as the mailbox keeps them."""
    return [item.trace for item in items if isinstance(item, Traced)]


class TestBundles:
    async def test_tells_of_one_turn_arrive_in_order_each_with_its_context_counted_each(
        self,
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Recorder, process=False)
            for n in range(1_000):  # never yields: one turn, bundles of 256 and the rest
                await ref.tell(Seq(n=n), trace=_told(n)[1])
            got = await ref.ask(GetSeen())
            assert got.seen == [_told(n) for n in range(1_000)]
            stats = await system.statistics(ref)
            assert (stats.rejected, stats.queued, stats.queued_bytes) == (0, 0, 0)
            assert stats.received == stats.handled == 1_001  # every tell, and the ask

    async def test_tells_that_repeat_the_contexts_before_them_each_arrive_with_their_own(
        self,
    ) -> None:
        def told(n: int) -> tuple[int, tuple[str, ...]]:
            # Runs of the same contexts, broken by untraced tells and by other contexts.
            return (n, (f"ctx-{n // 7}", "") if n % 5 else ())

        async with ActorSystem() as system:
            ref = await system.spawn(Recorder, process=True)
            for n in range(1_000):  # one turn: bundles, each of several runs
                await ref.tell(Seq(n=n), trace=told(n)[1])
            got = await ref.ask(GetSeen())
            assert got.seen == [told(n) for n in range(1_000)]
            stats = await system.statistics(ref)
            assert (stats.rejected, stats.queued, stats.handled) == (0, 0, 1_001)

    async def test_on_the_wire_the_tells_after_a_turns_first_are_one_bundle(self) -> None:
        async with ActorSystem(shutdown_timeout=0.3) as system:
            sock = system.station.ctx.socket(zmq.PULL)
            path = os.path.join(system.ipc_dir, "wire")
            sock.bind(f"ipc://{path}")
            # A ref that names its owner, as the runtime's own refs do: tells coalesce.
            ref: ActorRef[Seq] = ActorRef("wire", f"ipc://{path}", 1, system.station.reply_address)
            try:
                for n in range(4):
                    await ref.tell(Seq(n=n), trace=_told(n)[1])
                first = await anyio.to_thread.run_sync(sock.recv_multipart)
                bundle = await anyio.to_thread.run_sync(sock.recv_multipart)
            finally:
                sock.close(0)
            decode = msgspec.msgpack.Decoder(Seq).decode
            header = decode_header(first[0])  # the turn's first, traced: a TELL
            assert (header.kind, header.trace, decode(first[1])) == (
                Kind.TELL,
                ("ctx-0",),
                Seq(n=0),
            )
            header = decode_header(bundle[0])
            assert (header.kind, header.cookie, len(bundle)) == (
                Kind.TELLS,
                system.station.cookie,
                2,
            )
            tells = bundle_decoder.decode(bundle[1])
            assert tells[:2] == [msgspec.msgpack.encode(Seq(n=1)), msgspec.msgpack.encode(Seq(n=2))]
            assert tells[2] == (msgspec.msgpack.encode(Seq(n=3)), ("ctx-3",))

    async def test_with_a_small_hwm_every_tell_stays_one_frame(self) -> None:
        async with ActorSystem(hwm=10, shutdown_timeout=0.3) as system:
            sock = system.station.ctx.socket(zmq.PULL)
            path = os.path.join(system.ipc_dir, "tight")
            sock.bind(f"ipc://{path}")
            ref: ActorRef[Seq] = ActorRef("tight", f"ipc://{path}", 1, system.station.reply_address)
            try:
                for n in range(3):
                    await ref.tell(Seq(n=n))
                frames = [await anyio.to_thread.run_sync(sock.recv_multipart) for _ in range(3)]
            finally:
                sock.close(0)
            decode = msgspec.msgpack.Decoder(Seq).decode
            got = [[decode(f) for f in parts] for parts in frames]
            assert got == [[Seq(n=n)] for n in range(3)]

    async def test_a_bad_bundle_is_one_rejection_and_a_bad_tell_in_one_is_one_more(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Recorder, name="recorder", process=True)
            head = TellHeaders("peer", system.station.cookie)
            good = [msgspec.msgpack.encode(Seq(n=n)) for n in range(3)]
            push = system.station.ctx.socket(zmq.PUSH)
            push.connect(ref.address)
            try:
                push.send_multipart([head.bundle, b"\xc1garbage"])
                push.send_multipart([head.bundle, msgspec.msgpack.encode([good[0], b"\xc1"])])
                push.send_multipart([head.bundle, msgspec.msgpack.encode([[good[1], [1]]])])
                # Counted neither received nor rejected, before.
                push.send_multipart([head.bundle, msgspec.msgpack.encode([])])
                push.send_multipart([head.bundle, msgspec.msgpack.encode([good[2]])])
                with anyio.fail_after(10):
                    while len((got := await ref.ask(GetSeen())).seen) < 2:
                        await anyio.lowlevel.checkpoint()
            finally:
                push.close(0)
            assert got.seen == [(0, ()), (2, ())]
            stats = await system.statistics(ref)
            assert (stats.rejected, stats.failed, stats.queued) == (4, 0, 0)

    def test_a_traced_tells_header_is_the_header_encoded_with_its_context(self) -> None:
        head = TellHeaders("me", b"k" * 16)
        trace = ("00-ab-cd-01", "")
        full = encode_header(Header(Kind.TELL, sender="me", cookie=b"k" * 16, trace=trace))
        assert head.traced(trace) == bytes(full)
        assert decode_header(head.bundle).kind is Kind.TELLS

    @pytest.mark.parametrize("corr", [0, 1, 127, 128, 65_535, 2**32 - 1, 2**32, 2**63 - 1])
    @pytest.mark.parametrize("body_type", ["", "tests.unit.test_transport:Seen"])
    def test_a_header_template_gives_the_bytes_the_header_encodes_to(
        self, corr: int, body_type: str
    ) -> None:
        for kind in (Kind.ASK, Kind.REPLY, Kind.STOP):
            template = HeaderTemplate(kind, "ipc:///x/r1", "me", b"k" * 16, body_type)
            full = Header(kind, corr, "ipc:///x/r1", "me", body_type, cookie=b"k" * 16)
            assert template.encode(corr) == bytes(encode_header(full))
            assert decode_header(template.encode(corr)) == full

    def test_a_mailbox_takes_a_bundle_apart_into_frames_and_traced_tells_of_the_same_bytes(
        self,
    ) -> None:
        plain, traced = msgspec.msgpack.encode(Seq(n=1)), msgspec.msgpack.encode(Seq(n=2))
        body = msgspec.msgpack.encode([plain, (traced, ("ctx", ""))])
        assert bundle_decoder.decode(body) == [plain, (traced, ("ctx", ""))]
        items, held = TellsDecoder().bundle(body)
        assert items == [plain, Traced(traced, ("ctx", ""))]
        # What each counts for in the mailbox's byte budget: its message's bytes.
        assert list(map(len, items)) == [len(plain), len(traced)]
        assert held == len(plain) + len(traced)

    def test_traced_tells_with_the_contexts_of_the_one_before_share_them_decoded_once(
        self,
    ) -> None:
        a, b = ("00-aa-01", "", "00-bb-01"), ("00-cc-01",)
        msgs = [msgspec.msgpack.encode(Seq(n=n)) for n in range(6)]
        tells = TellsDecoder()
        body = msgspec.msgpack.encode(
            [(msgs[0], a), (msgs[1], a), msgs[2], (msgs[3], b), (msgs[4], a)]
        )
        items, held = tells.bundle(body)
        assert held == sum(map(len, msgs[:5]))
        assert items == [
            Traced(msgs[0], a),
            Traced(msgs[1], a),
            msgs[2],
            Traced(msgs[3], b),
            Traced(msgs[4], a),
        ]
        first, second, other, again = _traces(items)
        assert second is first  # the same bytes: not decoded again
        assert other is not first
        assert again is not first  # a decoder remembers the last contexts only
        # From one bundle to the next as well: a stream's tells share them; and the
        # bundles' header, the same for each from one sender, is decoded once.
        head = TellHeaders("me", b"k" * 16).bundle
        assert tells.header(head) is tells.header(head) == decode_header(head)
        assert _traces(tells.bundle(msgspec.msgpack.encode([(msgs[5], a)]))[0]) == [again]
        assert _traces(tells.bundle(msgspec.msgpack.encode([(msgs[5], a)]))[0])[0] is again

    @pytest.mark.parametrize(
        "bad",
        [[1], "00-aa-01", [["00-aa-01"]], ["x" * (MAX_TRACE_CHARS + 1)], [""] * (MAX_TRACE + 1)],
    )
    def test_a_bad_context_after_good_ones_refuses_the_bundle_and_is_not_remembered(
        self, bad: object
    ) -> None:
        good = ("00-aa-01",)
        msg = msgspec.msgpack.encode(Seq(n=1))
        tells = TellsDecoder()
        (kept,) = _traces(tells.bundle(msgspec.msgpack.encode([(msg, good)]))[0])
        with pytest.raises(msgspec.DecodeError):
            tells.bundle(msgspec.msgpack.encode([(msg, good), (msg, bad)]))
        with pytest.raises(msgspec.DecodeError):  # the bad contexts again: refused again
            tells.bundle(msgspec.msgpack.encode([(msg, bad)]))
        (after,) = _traces(tells.bundle(msgspec.msgpack.encode([(msg, good)]))[0])
        assert after is kept

    def test_contexts_too_long_to_remember_are_not_kept_once_their_tells_are_gone(
        self,
    ) -> None:
        """Before, the decoder kept the last contexts it decoded whatever their length (here
        1 MB, up to a message's 16 MiB), after the tells that carried them were handled."""
        msg = msgspec.msgpack.encode(Seq(n=1))
        tells = TellsDecoder()
        long = tuple(f"{n:0500}" for n in range(2_000))  # 1 MB, over REMEMBERED_BYTES
        assert len(msgspec.msgpack.encode(long)) > REMEMBERED_BYTES
        body = msgspec.msgpack.encode([(msg, long)])
        tracemalloc.start()
        try:
            items, _ = tells.bundle(body)
            assert _traces(items) == [long]
            held = tracemalloc.get_traced_memory()[0]
            del items
            kept = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert held > 1_000_000
        assert kept < REMEMBERED_BYTES, f"{kept} bytes kept of contexts never given again"

    def test_many_short_contexts_are_not_remembered_however_few_their_bytes(self) -> None:
        # 300 contexts of two characters: 900 bytes on the wire, some 17 kB as strings.
        many = tuple(f"{n % 100:02}" for n in range(REMEMBERED_CONTEXTS + 44))
        few = many[:REMEMBERED_CONTEXTS]
        msg = msgspec.msgpack.encode(Seq(n=1))
        tells = TellsDecoder()
        for trace, remembered in ((few, True), (many, False)):
            body = msgspec.msgpack.encode([(msg, trace)])
            first, again = (_traces(tells.bundle(body)[0])[0] for _ in range(2))
            assert first == again == trace
            assert (again is first) is remembered
            head = TellHeaders("me", b"k" * 16).traced(trace)
            assert (tells.header(head) is tells.header(head)) is remembered

    async def test_a_traced_handler_that_raises_leaves_no_context_to_the_tells_after_it(
        self,
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Recorder, process=False)
            for _ in range(2):  # the turn's first traced tell alone, then in a bundle
                await ref.tell(Seq(n=-1), trace=("ctx",))
                await ref.tell(Seq(n=1))
            got = await ref.ask(GetSeen())
            assert got.seen == [(-1, ("ctx",)), (1, ())] * 2
            assert (await ref.ask(GetSeen(), trace=("asked",))).seen == got.seen
            stats = await system.statistics(ref)
            assert (stats.failed, stats.rejected) == (2, 0)


class TestTraceBounds:
    @pytest.mark.parametrize(
        "trace",
        [
            ("a" * 100,) * 10,  # more than MAX_TRACE_CHARS together, each within it
            ("x" * MAX_TRACE_CHARS,),
            ("",) * 3,
        ],
    )
    def test_contexts_each_within_the_bound_pass_with_their_characters_counted(
        self, trace: tuple[str, ...]
    ) -> None:
        assert trace_chars(trace) == sum(map(len, trace))
        assert checked_trace(list(trace)) == trace

    def test_one_long_context_among_short_ones_is_refused(self) -> None:
        trace = ("a" * 55,) * 40 + ("x" * (MAX_TRACE_CHARS + 1),)
        with pytest.raises(ProtocolError, match="513 characters"):
            trace_chars(trace)


class TestRequestsInADrain:
    async def test_a_request_is_answered_before_the_tells_queued_behind_it_are_handled(
        self,
    ) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Recorder, process=False)
            async with anyio.create_task_group() as tg:
                # One turn: a tell alone, the ask, then a tell in a bundle; all queued at
                # once on the pipe, and a drain stops at the ask.
                await ref.tell(Seq(n=1))
                answers: list[Seen] = []

                async def ask() -> None:
                    answers.append(await ref.ask(GetSeen()))

                tg.start_soon(ask)
                await anyio.lowlevel.checkpoint()
                await ref.tell(Seq(n=2))
                await ref.tell(Seq(n=3))
            assert answers[0].seen == [(1, ())]
            assert (await ref.ask(GetSeen())).seen == [(n, ()) for n in (1, 2, 3)]

    async def test_replies_arriving_together_each_resolve_their_ask(self) -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Recorder, process=False)
            for n in range(50):
                await ref.tell(Seq(n=n))
            results: list[int] = []

            async def ask() -> None:
                results.append(len((await ref.ask(GetSeen())).seen))

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for _ in range(20):
                        tg.start_soon(ask)
            assert results == [50] * 20


@contextlib.contextmanager
def inproc_mailbox(name: str) -> Iterator[tuple[Mailbox, zmq.Socket[bytes], bytes]]:
    """A `Mailbox` of `Ping` on an inproc PULL socket (a send is queued on it at once),
    the PUSH that feeds it and the cookie; all closed on the way out."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    cookie = b"k" * 16
    address = f"inproc://{name}"
    pull.bind(address)
    push.connect(address)
    mailbox = Mailbox(
        pull,
        address,
        MailboxDecoder([Ping]),
        name,
        cookie,
        lambda _: True,
        1 << 20,
        logging.getLogger("tests.mailbox"),
    )
    try:
        yield mailbox, push, cookie
    finally:
        mailbox.close()
        push.close(0)
        ctx.term()


class TestHeadersThatRepeat:
    async def test_a_tells_header_that_repeats_is_decoded_once_and_checked_every_time(
        self,
    ) -> None:
        with inproc_mailbox("repeats") as (mailbox, push, cookie):
            body = msgspec.msgpack.encode(Ping(n=1))
            good = TellHeaders("peer", cookie).traced(("00-aa-01", ""))
            forged = TellHeaders("peer", b"x" * 16).traced(("00-aa-01", ""))
            for head in (good, good, forged, forged, good):
                push.send_multipart([head, body])
            push.send_multipart([good, body, body])  # the same header, a frame too many
            push.send(body)  # after them all
            items: list[Item] = []
            with anyio.fail_after(5):
                while body not in items:
                    items += await mailbox.receive()
            assert items == [Traced(body, ("00-aa-01", ""))] * 3 + [body]
            first, second, _ = _traces(items)
            assert second is first  # decoded once
            assert mailbox.statistics().rejected == 3  # the forged ones, and the extra frame
            # Bundles from one sender: the same header, and here the same contexts.
            bundle = TellHeaders("peer", cookie).bundle
            for n in (2, 3):
                push.send_multipart([bundle, msgspec.msgpack.encode([(body, ("00-bb-01",))] * n)])
            items = []
            with anyio.fail_after(5):
                while len(items) < 5:
                    items += await mailbox.receive()
            assert items == [Traced(body, ("00-bb-01",))] * 5
            assert len({id(trace) for trace in _traces(items)}) == 1
            assert mailbox.statistics().rejected == 3


class TestReceiveAfterAnAsk:
    """A drain stops at an ask, to answer it first; the next receive asks the socket whether
    more came instead of reading (a failed read costs twice as much)."""

    @staticmethod
    def ask(push: zmq.Socket[bytes], cookie: bytes) -> None:
        header = Header(Kind.ASK, corr=7, reply_to="inproc://asker", cookie=cookie)
        push.send_multipart([encode_header(header), msgspec.msgpack.encode(Ping(n=0))])

    async def test_a_tell_queued_behind_an_ask_is_read_with_nothing_more_arriving(
        self,
    ) -> None:
        with inproc_mailbox("behind-ask") as (mailbox, push, cookie):
            self.ask(push, cookie)
            push.send(msgspec.msgpack.encode(Ping(n=1)))
            with anyio.fail_after(5):
                (asked,) = await mailbox.receive()
                assert isinstance(asked, Envelope)
                assert asked.header.corr == 7
                # Both were queued before the first read: the fd fires for neither again.
                assert await mailbox.receive() == [msgspec.msgpack.encode(Ping(n=1))]

    async def test_after_an_ask_alone_the_next_receive_waits_for_what_comes_later(
        self,
    ) -> None:
        with inproc_mailbox("ask-alone") as (mailbox, push, cookie):
            self.ask(push, cookie)
            with anyio.fail_after(5):
                (asked,) = await mailbox.receive()
                assert isinstance(asked, Envelope)
                async with anyio.create_task_group() as tg:
                    received: list[list[Item]] = []

                    async def receive() -> None:
                        received.append(await mailbox.receive())

                    tg.start_soon(receive)
                    while not mailbox._waiter.waiting:  # asleep on the fd, not spinning
                        await anyio.lowlevel.checkpoint()
                    push.send(msgspec.msgpack.encode(Ping(n=2)))
            assert received == [[msgspec.msgpack.encode(Ping(n=2))]]
