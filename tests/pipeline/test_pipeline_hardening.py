"""The pipeline under the hardening review's findings: stalled members, forged aborts, slow
readers, oversized requests, dead in-process members, log floods. Real processes throughout."""

from __future__ import annotations

import functools
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest

from actors import (
    InvalidRequestError,
    Member,
    Pipeline,
    PipelineBusyError,
    PipelineClosedError,
    RequestFailedError,
    SlowReaderError,
    WorkerDiedError,
)
from actors._tokenizer import load_tokenizer
from actors.build_tokenizer import DEFAULT_CORPUS_PATH
from actors.detokenizer import Detokenizer
from actors.messages import (
    AbortAll,
    AbortRequest,
    BatchStrOutput,
    BatchTokenIDOutput,
    CheckLoad,
    Generate,
    GetDetokenizerStatistics,
    GetRouterStatistics,
    GetSchedulerStatistics,
    GetWorkerStatistics,
    LoadReply,
    MemberStuck,
    Origin,
    Registered,
    RegisterWorker,
    RequestOutputs,
    RouteUpdate,
    SamplingParams,
    Topology,
)
from actors.pipeline import _CallerState, _Request, _stops
from actors.pipeline_supervisor import PipelineConfig
from actors.router import Router
from actors.tokenizer_worker import MAX_PENDING_CONTROL, MAX_TOKENIZING, TokenizerWorker
from runtime import Actor, ActorRef, ActorSystem, TokenyardError, handler

from ._actors import EventInbox, Events

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

PROMPTS = ["Hello there", "你好, 世界", "Bonjour à tous 😀", "def f(x): return x"]


async def load(
    p: Pipeline, n: int, during: Callable[[], Awaitable[None]], *, deadline: float = 60
) -> tuple[int, int, int]:
    """``n`` concurrent requests with ``during`` run once 10 have finished; every request
    must end within ``deadline``: (completed, died, failed otherwise)."""
    done = died = failed = 0
    busy = anyio.Event()

    async def one(i: int) -> None:
        nonlocal done, died, failed
        try:
            await p.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=24)
            done += 1
        except WorkerDiedError:
            died += 1
        except TokenyardError:
            failed += 1
        if done >= 10:
            busy.set()

    with anyio.fail_after(deadline):
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
            await busy.wait()
            await during()
    return done, died, failed


def pid_of(p: Pipeline, ref: ActorRef[Any] | None) -> int:
    assert ref is not None
    pid = p.system.pid_of(ref)
    assert pid is not None
    return pid


async def successor(p: Pipeline, name: str, dead: ActorRef[Any]) -> ActorRef[Any]:
    with anyio.fail_after(30):
        while (ref := await p.system.lookup(name, missing_ok=True)) in (None, dead):
            await anyio.lowlevel.checkpoint()
    assert ref is not None
    return ref


class TestStalls:
    async def test_a_detokenizer_stopped_past_the_bound_is_killed_and_the_pipeline_serves_again(
        self,
    ) -> None:
        async with Pipeline(workers=2, step_time=0.002, stall_timeout=2.0) as p:
            victim = await p.system.lookup("detokenizer:0")
            pid = pid_of(p, victim)

            async def stall() -> None:
                os.kill(pid, signal.SIGSTOP)  # the finding held it for 20 s; the bound is 2

            done, died, failed = await load(p, 200, stall)
            assert done + died == 200
            assert failed == 0
            back = await successor(p, "detokenizer:0", victim)
            assert back.incarnation == victim.incarnation + 1
            for i in range(5):  # the finding: 0 of 5 new calls were answered
                assert (await p.generate(f"after {i}", max_new_tokens=6)).completion_tokens == 6

    async def test_a_detokenizer_stopped_for_less_than_the_bound_costs_nothing_once_it_resumes(
        self,
    ) -> None:
        async with Pipeline(workers=2, step_time=0.002, stall_timeout=30.0) as p:
            victim = await p.system.lookup("detokenizer:0")
            pid = pid_of(p, victim)

            async def stall() -> None:
                os.kill(pid, signal.SIGSTOP)
                await anyio.sleep(1.5)  # sync-ok: the length of the stall under test
                os.kill(pid, signal.SIGCONT)

            # The scheduler's held step is offered again every half second: once the
            # detokenizer resumes, everything flows within that.
            done, died, failed = await load(p, 200, stall, deadline=30)
            assert (done, died, failed) == (200, 0, 0)
            assert await p.system.lookup("detokenizer:0") == victim  # nothing died

    async def test_a_stopped_worker_does_not_hold_up_the_other_and_is_killed_past_the_bound(
        self,
    ) -> None:
        async with Pipeline(workers=2, step_time=0.002, stall_timeout=3.0) as p:
            frozen = p.worker_ref(1)
            assert frozen is not None
            pid = pid_of(p, frozen)
            os.kill(pid, signal.SIGSTOP)
            served: list[int] = []
            enough = anyio.Event()

            async def one(i: int) -> None:
                served.append((await p.generate(f"w{i}", max_new_tokens=4)).worker)
                if served.count(0) >= 4:
                    enough.set()

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for i in range(8):
                        tg.start_soon(one, i)
                    # Worker 0 serves while worker 1 is stopped: nothing waits behind it.
                    await enough.wait()
                    assert p.system.pid_of(frozen) == pid  # still stopped, not yet killed
                # Past the bound, worker 1 was killed; its calls went to worker 0 or to its
                # successor, and all of them ended.
                back = await p.wait_worker(1, after=frozen.incarnation)
            assert back.incarnation > frozen.incarnation
            assert len(served) == 8


class Blocked:
    """Holds a fake worker's handler until the test lets it go."""

    def __init__(self) -> None:
        self.release = anyio.Event()


class BlockedWorker(Actor[BatchStrOutput]):
    """A worker that takes one sub-batch and then never returns from its handler."""

    def __init__(self, blocked: Blocked) -> None:
        self.blocked = blocked

    @handler
    async def output(self, msg: BatchStrOutput) -> None:
        await self.blocked.release.wait()


class Steps:
    """The steps of the sub-batches a `SubBatches` got, and a wait for their number."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self._changed = anyio.Event()

    def add(self, step: int) -> None:
        self.got.append(step)
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, n: int) -> None:
        while len(self.got) < n:
            await self._changed.wait()


class SubBatches(Actor[BatchStrOutput]):
    """A healthy worker stand-in: records the sub-batches it gets."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps

    @handler
    def output(self, msg: BatchStrOutput) -> None:
        self.steps.add(msg.step)


class StuckReports:
    def __init__(self) -> None:
        self.items: list[MemberStuck] = []
        self.arrived = anyio.Event()


class FakeSupervisor(Actor[MemberStuck]):
    def __init__(self, reports: StuckReports) -> None:
        self.reports = reports

    @handler
    def stuck(self, msg: MemberStuck) -> None:
        self.reports.items.append(msg)
        self.reports.arrived.set()


class TestStuckWorkers:
    async def test_a_worker_that_takes_no_output_is_reported_stuck_and_the_others_are_served(
        self,
    ) -> None:
        async with ActorSystem(hwm=2, rcvhwm=2, send_timeout=0.2) as system:
            reports = StuckReports()
            supervisor: ActorRef[Any] = await system.spawn(FakeSupervisor, reports, process=False)
            detokenizer = await system.spawn(
                Detokenizer, supervisor=supervisor, deliver_timeout=0.5, process=False
            )
            blocked = Blocked()
            steps = Steps()
            stuck: ActorRef[Any] = await system.spawn(BlockedWorker, blocked, process=False)
            healthy: ActorRef[Any] = await system.spawn(SubBatches, steps, process=False)
            for origin, ref in ((Origin(0, 1), stuck), (Origin(1, 1), healthy)):
                await detokenizer.ask(RouteUpdate(origin=origin, ref=ref))
            try:
                with anyio.fail_after(20):
                    step = 0
                    while not reports.items:  # until the stuck worker's queues are full
                        await detokenizer.tell(step_of(step, [Origin(0, 1), Origin(1, 1)]))
                        step += 1
                        if step % 100 == 0:
                            await detokenizer.ask(GetDetokenizerStatistics())  # let it keep up
                assert reports.items[0].origin == Origin(0, 1)
                # The healthy worker was sent a sub-batch for every step, in order, while
                # the other took none (the last ones may still be on their way to it).
                await steps.wait_for(step - 2)
                assert steps.got == list(range(len(steps.got)))
            finally:
                blocked.release.set()


def step_of(step: int, origins: list[Origin]) -> BatchTokenIDOutput:
    n = len(origins)
    return BatchTokenIDOutput(
        rids=[f"r{o.worker}" for o in origins],
        origins=origins,
        finished_reasons=[None] * n,
        decode_ids=[[5]] * n,
        read_offsets=[step] * n,
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        stop=[()] * n,
        prompt_tokens=[3] * n,
        completion_tokens=[step + 1] * n,
        cached_tokens=[0] * n,
        step=step,
    )


class TestNothingVanishes:
    async def test_a_forged_abort_all_fails_every_call_it_dropped_to_its_caller(self) -> None:
        async with Pipeline(workers=2, step_time=0.005) as p:
            scheduler = await p.system.lookup("scheduler")

            async def forge() -> None:
                await scheduler.tell(AbortAll(reason="forged"))

            done, died, failed = await load(p, 60, forge, deadline=30)
            # The finding: 60 of 60 calls left unanswered. Now each ends, most refused.
            assert done + died + failed == 60
            assert failed > 0

    async def test_a_worker_with_a_full_mailbox_is_skipped_not_dropped(self) -> None:
        config = PipelineConfig(workers=2, submit_timeout=1.0)
        async with ActorSystem(hwm=1, rcvhwm=1) as system:
            blocked = Blocked()
            workers: list[ActorRef[Any]] = [
                await system.spawn(Sink, blocked, process=False) for _ in range(2)
            ]
            state = _CallerState(config)
            state.system = system
            events = Events()
            inbox: ActorRef[Any] = await system.spawn(EventInbox, events, process=False)
            state.inbox = inbox
            for k, ref in enumerate(workers):
                state.workers[k] = ref

            async def flood() -> None:
                for i in range(1000):
                    msg = Generate(rid=f"r{i}", reply_to=inbox, text="x")
                    req = state.requests[msg.rid] = _Request(msg.rid, msg, False)
                    await state.submit(req)

            try:
                with pytest.raises(PipelineBusyError, match="overloaded"):
                    await flood()
                assert sorted(state.workers) == [0, 1]  # still both there
            finally:
                blocked.release.set()


class Sink(Actor[Generate]):
    """A worker stand-in whose mailbox fills: its handler never returns."""

    def __init__(self, blocked: Blocked) -> None:
        self.blocked = blocked

    @handler
    async def generate(self, msg: Generate) -> None:
        await self.blocked.release.wait()


class TestLimits:
    async def test_oversized_prompts_and_generations_are_refused_before_anything_is_sent(
        self,
    ) -> None:
        async with Pipeline(workers=1, max_prompt_bytes=1000, max_new_tokens=100) as p:
            with anyio.fail_after(2):
                with pytest.raises(InvalidRequestError, match="max_prompt_bytes"):
                    await p.generate("x" * 24_000_000)
                with pytest.raises(InvalidRequestError, match="max_new_tokens"):
                    await p.generate("hi", max_new_tokens=101)
            assert (await p.generate("hi", max_new_tokens=100)).completion_tokens <= 100

    async def test_a_worker_refuses_a_prompt_over_its_limits_whoever_sends_it(self) -> None:
        async with Pipeline(workers=1, max_prompt_tokens=8) as p:
            with pytest.raises(RequestFailedError, match="max_prompt_tokens"):
                await p.generate("a much longer prompt than eight tokens " * 4)
            events = Events()
            inbox: ActorRef[Any] = await p.system.spawn(EventInbox, events, process=False)
            worker = p.worker_ref(0)
            assert worker is not None
            big = Generate(rid="big", reply_to=inbox, text="y" * (2 << 20))  # past 1 MiB
            await worker.tell(big)
            with anyio.fail_after(10):
                await events.wait_until(lambda: events.finished("big"))
            (out,) = [o for m in events.log if isinstance(m, RequestOutputs) for o in m.outputs]
            assert out.error is not None
            assert "max_prompt_bytes" in out.error

    async def test_sampling_no_engine_takes_is_refused_by_the_scheduler_whatever_the_engine(
        self,
    ) -> None:
        async with Pipeline(workers=1) as p:
            with anyio.fail_after(10):
                for temperature in (float("nan"), float("inf"), -0.5):
                    with pytest.raises(RequestFailedError, match="finite temperature >= 0"):
                        await p.generate("hi", max_new_tokens=4, temperature=temperature)
                out = await p.generate("hi", max_new_tokens=4, temperature=0.0)
            assert out.finish_reason in ("stop", "length")
            scheduler = await p.system.lookup("scheduler")
            stats = await scheduler.ask(GetSchedulerStatistics(), timeout=10)
            assert stats.rejected == 3

    async def test_a_request_the_detokenizer_refuses_fails_to_its_caller_with_the_reason(
        self,
    ) -> None:
        async with Pipeline(workers=1, step_time=0.002, max_states=1) as p:
            outcomes: list[BaseException | str] = []

            async def one(i: int) -> None:
                try:
                    outcomes.append(
                        (await p.generate(f"p{i}", max_new_tokens=200, ignore_eos=True)).text
                    )
                except RequestFailedError as err:
                    outcomes.append(err)

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for i in range(3):
                        tg.start_soon(one, i)
            refused = [o for o in outcomes if isinstance(o, RequestFailedError)]
            assert refused  # one state at a time: the others were refused, not "finished"
            assert all("max_states=1" in str(o) for o in refused), refused

    async def test_a_stream_nobody_reads_is_aborted_and_stops_generating(self) -> None:
        async with Pipeline(workers=1, step_time=0.001, max_stream_buffer=2000) as p:
            pieces = p.stream("read me", max_new_tokens=20_000, ignore_eos=True)
            first = await pieces.__anext__()
            assert first
            scheduler = await p.system.lookup("scheduler")
            with anyio.fail_after(30):
                while (await scheduler.ask(GetSchedulerStatistics())).aborted < 1:
                    pass  # each ask is itself the wait: the abort comes once 2000 B are unread
            held: list[str] = []

            async def read_on() -> None:
                async for piece in pieces:
                    held.append(piece)  # noqa: PERF401 - kept piece by piece: it ends raising

            with pytest.raises(SlowReaderError, match="max_stream_buffer=2000"):
                await read_on()
            held_bytes = sum(map(len, held))
            assert held_bytes <= 2000 + 100  # what was held, then the error: never more
            stats = await scheduler.ask(GetSchedulerStatistics())
            assert stats.generated_tokens < 20_000  # the engine stopped for it


TOKENIZER = load_tokenizer(None)


def document(chars: int) -> str:
    """Prose of ``chars`` characters (the tokenizer's corpus, over and over): a prompt of a
    megabyte takes the bundled tokenizer about a second."""
    corpus = DEFAULT_CORPUS_PATH.read_text()
    return (corpus * (chars // len(corpus) + 1))[:chars]


def ended(events: Events) -> list[str]:
    """The rids whose last output reached ``events``, in the order they did."""
    return [
        o.rid
        for m in events.log
        if isinstance(m, RequestOutputs)
        for o in m.outputs
        if o.finish_reason is not None
    ]


async def worker_and_inbox(p: Pipeline) -> tuple[Events, ActorRef[Any], ActorRef[Any]]:
    """An inbox in this process recording what it gets, and the pipeline's worker 0."""
    events = Events()
    inbox: ActorRef[Any] = await p.system.spawn(EventInbox, events, process=False)
    worker = p.worker_ref(0)
    assert worker is not None
    return events, inbox, worker


class TestLongPrompts:
    async def test_a_long_prompt_holds_up_no_request_that_comes_after_it(self) -> None:
        async with Pipeline(workers=1) as p:
            events, inbox, worker = await worker_and_inbox(p)
            # Just under max_prompt_bytes and far over max_prompt_tokens: refused once its
            # tokens are counted, after about half a second of tokenizing.
            text = document(780_000)
            assert len(text.encode()) <= 1 << 20
            await worker.tell(Generate(rid="long", reply_to=inbox, text=text))
            short = SamplingParams(max_new_tokens=4)
            with anyio.fail_after(30):
                # The worker answers while it tokenizes, again and again: a tokenizer that
                # held the GIL throughout would stop its event loop once it began.
                for _ in range(20):
                    assert (await worker.ask(GetWorkerStatistics())).tokenizing == 1
                await worker.tell(Generate(rid="short", reply_to=inbox, text="hi", sampling=short))
                await events.wait_until(lambda: events.finished("short"))
                stats = await worker.ask(GetWorkerStatistics())
                await events.wait_until(lambda: events.finished("long"))
            assert stats.tokenizing == 1  # served while the long one was still tokenized
            assert ended(events) == ["short", "long"]
            (out,) = [
                o
                for m in events.log
                if isinstance(m, RequestOutputs)
                for o in m.outputs
                if o.rid == "long"
            ]
            assert out.error is not None
            assert "max_prompt_tokens" in out.error

    async def test_a_long_prompt_is_served_like_a_short_one(self) -> None:
        async with Pipeline(workers=1) as p:
            text = document(20_000)
            out = await p.generate(text, max_new_tokens=4)
            assert out.prompt_tokens == len(TOKENIZER.encode(text, add_special_tokens=False).ids)
            assert out.finish_reason in ("stop", "length")

    async def test_a_long_prompt_let_go_while_it_is_tokenized_goes_no_further(self) -> None:
        async with Pipeline(workers=1, max_prompt_tokens=1_000_000) as p:
            events, inbox, worker = await worker_and_inbox(p)
            one = SamplingParams(max_new_tokens=1)
            first, second = document(300_000), document(400_000)
            await worker.tell(Generate(rid="long", reply_to=inbox, text=first, sampling=one))
            # Its rid is taken while it is tokenized: a second request with it is refused.
            await worker.tell(Generate(rid="long", reply_to=inbox, text="hi", sampling=one))
            await worker.tell(AbortRequest(rid="long"))
            # Let go, the rid is free again; the first one's tokenizing, done first, must
            # not take this one's place.
            await worker.tell(Generate(rid="long", reply_to=inbox, text=second, sampling=one))
            with anyio.fail_after(30):
                await events.wait_until(lambda: len(ended(events)) == 2)
                while (stats := await worker.ask(GetWorkerStatistics())).requests:
                    pass  # each ask is itself the wait: the first one's thread ends on its own
                # Sent after the first one would have been: once it is answered, the
                # scheduler has seen all it will see.
                await p.generate("hi", max_new_tokens=1)
            refused, served = [
                o for m in events.log if isinstance(m, RequestOutputs) for o in m.outputs
            ]
            assert refused.error is not None
            assert "duplicate rid" in refused.error
            assert served.error is None
            assert served.prompt_tokens == len(
                TOKENIZER.encode(second, add_special_tokens=False).ids
            )
            stats = await worker.ask(GetWorkerStatistics())
            assert (stats.received, stats.finished, stats.released, stats.failed) == (4, 2, 1, 1)
            scheduler = await p.system.lookup("scheduler")
            assert (await scheduler.ask(GetSchedulerStatistics())).received == 2

    async def test_long_prompts_past_the_bound_wait_in_the_mailbox(self) -> None:
        async with Pipeline(workers=1) as p:
            events, inbox, worker = await worker_and_inbox(p)
            n = 3 * MAX_TOKENIZING
            text = document(150_000)  # refused past max_prompt_tokens, once tokenized
            for i in range(n):
                await worker.tell(Generate(rid=f"long{i}", reply_to=inbox, text=text))
            # Answered once the last prompt got its place: more would be held without it.
            stats = await worker.ask(GetWorkerStatistics(), timeout=30)
            assert stats.received == n
            assert stats.tokenizing <= MAX_TOKENIZING
            with anyio.fail_after(30):
                await events.wait_until(lambda: len(ended(events)) == n)
            stats = await worker.ask(GetWorkerStatistics())
            assert (stats.failed, stats.tokenizing, stats.requests) == (n, 0, 0)


class TestInProcessMembers:
    async def test_a_dead_caller_inbox_fails_every_waiting_call_at_once(self) -> None:
        async with Pipeline(workers=1, step_time=0.01) as p:
            inbox = await p.system.lookup("pipeline-inbox")
            errors: list[BaseException] = []

            async def one() -> None:
                try:
                    await p.generate("wait for me", max_new_tokens=500, ignore_eos=True)
                except TokenyardError as err:
                    errors.append(err)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for _ in range(20):
                        tg.start_soon(one)
                    await anyio.lowlevel.checkpoint()
                    await p.system.kill(inbox, "killed by the test")
            assert len(errors) == 20
            assert all(isinstance(e, WorkerDiedError) for e in errors)
            assert all(e.member is Member.INBOX for e in errors if isinstance(e, WorkerDiedError))

    async def test_a_dead_pipeline_supervisor_leaves_no_member_running(self) -> None:
        async with Pipeline(workers=2, step_time=0.01) as p:
            assert len(p.system.child_pids()) == 5  # its members are its children
            errors: list[BaseException] = []

            async def one() -> None:
                try:
                    await p.generate("wait for me", max_new_tokens=500, ignore_eos=True)
                except TokenyardError as err:
                    errors.append(err)

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for _ in range(10):
                        tg.start_soon(one)
                    await anyio.lowlevel.checkpoint()
                    await p.system.kill(p.supervisor, "killed by the test")
            # Every member was stopped with it (and reaped), and every call failed.
            assert p.system.child_pids() == []
            assert len(errors) == 10
            assert all(
                isinstance(e, WorkerDiedError) and e.member is Member.SUPERVISOR for e in errors
            )
            with pytest.raises(PipelineClosedError):
                await p.generate("anyone?")


class FailingWorker(Actor[LoadReply]):
    """A worker stand-in whose handler fails on every control reply the router passes it."""

    @handler
    def load(self, msg: LoadReply) -> None:
        raise ValueError(f"cannot take {msg.request_id}")


class RegisteringSupervisor(Actor[RegisterWorker]):
    """Registers every worker at once, as the pipeline's supervisor would."""

    @handler
    def register(self, msg: RegisterWorker) -> Registered:
        return Registered(worker_id=msg.worker_id, incarnation=msg.incarnation)


#: Messages each flood sends, and the log lines it may cause: the first line, and one
#: more (counting the ones held back) if the flood outlasts the throttle's interval.
FLOOD = 1000
MOST_LINES = 2


def lines_of(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def load_reply(origin: Origin, request_id: int) -> LoadReply:
    return LoadReply(origin=origin, request_id=request_id, running=0, waiting=0, step=0)


async def worker_without_scheduler(system: ActorSystem) -> tuple[ActorRef[Any], ActorRef[Any]]:
    """A registered worker whose scheduler is dead, and a caller for its control replies."""
    supervisor: ActorRef[Any] = await system.spawn(RegisteringSupervisor, process=False)
    worker = await system.spawn(TokenizerWorker, 0, supervisor, process=False)
    scheduler: ActorRef[Any] = await system.spawn(Sink, Blocked(), process=False)
    await system.stop(scheduler)
    await worker.tell(Topology(scheduler=scheduler, detokenizers=[], router=None))
    caller: ActorRef[Any] = await system.spawn(EventInbox, Events(), process=False)
    return worker, caller


class TestLogsCannotBeFlooded:
    async def test_requests_over_the_detokenizers_cap_log_a_few_lines(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async with ActorSystem() as system:
            detokenizer = await system.spawn(Detokenizer, max_states=1, process=False)
            worker: ActorRef[Any] = await system.spawn(SubBatches, Steps(), process=False)
            origin = Origin(0, 1)
            await detokenizer.ask(RouteUpdate(origin=origin, ref=worker))
            with caplog.at_level(logging.WARNING, logger="tokenyard.detokenizer"):
                for step in range(FLOOD // 100):
                    batch = step_of(step, [origin] * 100)
                    batch.rids[:] = [f"r{step}-{i}" for i in range(100)]
                    await detokenizer.tell(batch)
                stats = await detokenizer.ask(GetDetokenizerStatistics())
            assert stats.rejected_over_cap == FLOOD - 1
            assert 1 <= len(lines_of(caplog, "tokenyard.detokenizer")) <= MOST_LINES

    async def test_control_replies_a_worker_fails_on_log_a_few_router_lines(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async with ActorSystem() as system:
            router = await system.spawn(Router, process=False)
            worker: ActorRef[Any] = await system.spawn(FailingWorker, process=False)
            origin = Origin(0, 1)
            await router.ask(RouteUpdate(origin=origin, ref=worker))
            with caplog.at_level(logging.WARNING, logger="tokenyard.router"):
                for i in range(FLOOD):
                    await router.tell(load_reply(origin, i))
                # One sender, one mailbox: the ask is handled after every reply told.
                stats = await router.ask(GetRouterStatistics(), timeout=30)
            assert stats.forwarded == FLOOD
            assert 1 <= len(lines_of(caplog, "tokenyard.router")) <= MOST_LINES

    async def test_control_replies_for_another_worker_log_a_few_lines(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async with ActorSystem() as system:
            supervisor: ActorRef[Any] = await system.spawn(RegisteringSupervisor, process=False)
            worker = await system.spawn(TokenizerWorker, 0, supervisor, process=False)
            with caplog.at_level(logging.WARNING, logger="tokenyard.worker"):
                for i in range(FLOOD):
                    await worker.tell(load_reply(Origin(7, 7), i))
                await worker.ask(GetWorkerStatistics())
            assert 1 <= len(lines_of(caplog, "tokenyard.worker")) <= MOST_LINES

    async def test_control_requests_while_the_scheduler_is_dead_log_a_few_lines(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async with ActorSystem() as system:
            worker, caller = await worker_without_scheduler(system)
            with caplog.at_level(logging.WARNING, logger="tokenyard.worker"):
                for _ in range(FLOOD):
                    await worker.tell(CheckLoad(reply_to=caller))
                stats = await worker.ask(GetWorkerStatistics())
            assert 1 <= len(lines_of(caplog, "tokenyard.worker")) <= MOST_LINES
            assert stats.control_pending == FLOOD

    async def test_control_requests_while_the_scheduler_is_dead_are_bounded(self) -> None:
        async with ActorSystem() as system:
            worker, caller = await worker_without_scheduler(system)
            for _ in range(MAX_PENDING_CONTROL + 500):
                await worker.tell(CheckLoad(reply_to=caller))
            stats = await worker.ask(GetWorkerStatistics())
            assert stats.control_pending == MAX_PENDING_CONTROL


class TestWhatACallerMayGetWrong:
    async def test_a_value_of_the_wrong_type_is_refused_at_once(self) -> None:
        wrong: list[dict[str, Any]] = [
            {"temperature": "0.5"},
            {"seed": 1.5},
            {"seed": 1 << 70},
            {"max_new_tokens": 4.0},
            {"max_new_tokens": True},
            {"ignore_eos": 1},
            {"stop": [1]},
            {"stop_token_ids": (2.0,)},
        ]
        async with Pipeline(workers=1) as p:
            for sampling in wrong:
                with anyio.fail_after(10), pytest.raises(InvalidRequestError, match="wrong type"):
                    await p.generate("hi", **sampling)
            for ids in ([1.0, 2.0], ["a"], [1 << 64]):
                with anyio.fail_after(10), pytest.raises(InvalidRequestError, match="wrong type"):
                    await p.generate(ids)  # type: ignore[arg-type]
            for text, stop in (("hi \ud800", ()), ("hi", ["\udfff"])):  # lone surrogates
                with anyio.fail_after(10), pytest.raises(InvalidRequestError, match="Unicode"):
                    await p.generate(text, stop=stop)
            assert (await p.generate("hi", max_new_tokens=2, seed=3)).completion_tokens >= 1

    async def test_a_pipeline_opens_once(self) -> None:
        p = Pipeline(workers=1)
        async with p:
            with anyio.fail_after(20):
                await p.generate("hi", max_new_tokens=1)
        with pytest.raises(PipelineClosedError, match="opened before"):
            async with p:
                pass  # pragma: no cover - never entered

    def test_one_stop_string_is_one_stop(self) -> None:
        assert _stops("ab") == ("ab",)
        assert _stops(["ab", "c"]) == ("ab", "c")

    async def test_two_pipelines_in_one_process_each_serve_their_own_callers(self) -> None:
        async with Pipeline(workers=1) as a, Pipeline(workers=1) as b:
            with anyio.fail_after(20):
                assert (await a.generate("hi", max_new_tokens=2)).completion_tokens >= 1
                assert (await b.generate("hi", max_new_tokens=2)).completion_tokens >= 1

    async def test_a_request_given_up_while_it_waits_to_be_resubmitted_is_never_sent(
        self,
    ) -> None:
        async with Pipeline(workers=1, step_time=0.02) as p:
            worker = p.worker_ref(0)
            assert worker is not None
            with anyio.CancelScope() as callers:
                async with anyio.create_task_group() as tg:
                    for i in range(5):
                        tg.start_soon(functools.partial(p.generate, f"p{i}", max_new_tokens=5000))
                    with anyio.fail_after(20):
                        while (await worker.ask(GetWorkerStatistics())).requests < 5:
                            pass  # each ask is itself the wait
                        os.kill(pid_of(p, worker), signal.SIGKILL)
                        while p.resubmitted < 5:  # each waits for the worker's successor
                            await anyio.lowlevel.checkpoint()  # which takes a restart to come
                    callers.cancel()  # every caller gives up
            with anyio.fail_after(30):
                # Sent after any resubmission would have been (each woke before it).
                await p.generate("hi", max_new_tokens=1)
            successor = p.worker_ref(0)
            assert successor is not None
            assert successor != worker
            stats = await successor.ask(GetWorkerStatistics())
            assert (stats.received, stats.requests) == (1, 0)


class TestAPipelineInACancelledScope:
    async def test_it_closes_without_waiting_on_members_that_died_with_the_scope(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        with anyio.CancelScope() as scope:
            async with Pipeline(workers=1) as p:
                with anyio.fail_after(20):
                    await p.generate("hi", max_new_tokens=2)
                scope.cancel()
                await anyio.lowlevel.checkpoint()
        assert scope.cancelled_caught
        assert not [r for r in caplog.records if "did not stop in time" in r.getMessage()]
