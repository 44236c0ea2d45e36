"""The detokenizer actor: per-worker sub-batches, streamed text, stop strings, routes, the cap.

Every actor runs in the test's event loop (``process=False``). Fake workers and a fake
scheduler record what they receive and signal an event; a test waits for the event, never
for time. A step sent after another reaches each worker after it (one sender, one mailbox:
first in, first out), so "nothing else arrived" is checked by waiting for a later step.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from actors._tokenizer import load_tokenizer
from actors.detokenizer import Detokenizer
from actors.messages import (
    Abort,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerStatistics,
    GetDetokenizerStatistics,
    Origin,
    RouteAck,
    RouteUpdate,
    Topology,
)
from runtime import Actor, ActorRef, ActorSystem, current_trace, handler

from ._inbox import Inbox

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

#: A caller's context (W3C's example).
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TOKENIZER = load_tokenizer()

# Prompts whose tokens split multi-byte characters: CJK, combining marks, ZWJ emoji, flags.
TEXTS = [
    "你好世界。今天的天气很好",
    "日本語のテキスト 👩‍👩‍👧‍👦 と 🇯🇵 の旗",
    "naïve café — e\u0301 🎉🚀 done",
    "한국어 문장 👋🏽 그리고 中文 混合",
]


class FakeWorker(Actor[BatchStrOutput]):
    """Records every text sub-batch the detokenizer tells it, and its trace context."""

    def __init__(
        self, inbox: Inbox[BatchStrOutput], traces: list[tuple[int, tuple[str, ...]]]
    ) -> None:
        self.inbox = inbox
        self.traces = traces

    @handler
    def output(self, msg: BatchStrOutput) -> None:
        self.traces.append((msg.step, current_trace()))
        self.inbox.put(msg)


class FakeScheduler(Actor[Abort]):
    """Records the aborts the detokenizer sends."""

    def __init__(self, inbox: Inbox[Abort]) -> None:
        self.inbox = inbox

    @handler
    def abort(self, msg: Abort) -> None:
        self.inbox.put(msg)


@dataclass
class Entry:
    """One request's part of an engine step."""

    origin: Origin
    rid: str
    ids: list[int]
    finished: str | None = None
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False


def engine_step(entries: Sequence[Entry], step: int) -> BatchTokenIDOutput:
    n = len(entries)
    return BatchTokenIDOutput(
        rids=[e.rid for e in entries],
        origins=[e.origin for e in entries],
        finished_reasons=[e.finished for e in entries],
        decode_ids=[e.ids for e in entries],
        read_offsets=[0] * n,
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[e.no_stop_trim for e in entries],
        stop=[e.stop for e in entries],
        prompt_tokens=[100 + i for i in range(n)],
        completion_tokens=[len(e.ids) for e in entries],
        cached_tokens=[len(e.rid) for e in entries],
        output_token_logprobs_val=[[-0.5] * len(e.ids) for e in entries],
        step=step,
    )


def chunks(ids: list[int], sizes: Sequence[int]) -> list[list[int]]:
    """Cut ``ids`` into pieces of the given sizes, cycling; the last piece takes the rest."""
    out: list[list[int]] = []
    pos = 0
    while pos < len(ids):
        size = sizes[len(out) % len(sizes)]
        out.append(ids[pos : pos + size])
        pos += size
    return out


@dataclass
class Harness:
    system: ActorSystem
    detokenizer: ActorRef[Any]
    workers: dict[Origin, ActorRef[Any]]
    inboxes: dict[Origin, Inbox[BatchStrOutput]]
    aborts: Inbox[Abort]
    #: By worker: each sub-batch's step and the trace context it came with.
    traces: dict[Origin, list[tuple[int, tuple[str, ...]]]]

    async def send(self, *entries: Entry, step: int, trace: tuple[str, ...] = ()) -> None:
        await self.detokenizer.tell(engine_step(entries, step), trace=trace)

    async def stats(self) -> DetokenizerStatistics:
        # Asked after the tells: the reply proves every step told before was handled.
        stats = await self.detokenizer.ask(GetDetokenizerStatistics(), timeout=5)
        assert isinstance(stats, DetokenizerStatistics)
        return stats

    async def received(self, origin: Origin, step: int) -> list[BatchStrOutput]:
        """Everything ``origin``'s worker got, once step ``step`` has reached it."""
        return await self.inboxes[origin].wait_until(lambda got: any(b.step == step for b in got))

    def stream(self, origin: Origin, rid: str) -> tuple[str, list[int], list[str | None]]:
        """A request's joined text, joined ids and finish reasons, as its worker saw them."""
        text, ids, reasons = [], [], []
        for batch in self.inboxes[origin].items:
            for i, r in enumerate(batch.rids):
                if r == rid:
                    text.append(batch.output_strs[i])
                    ids += batch.output_ids[i]
                    reasons.append(batch.finished_reasons[i])
        return "".join(text), ids, reasons


@asynccontextmanager
async def open_detokenizer(workers: int = 2, **kwargs: Any) -> AsyncIterator[Harness]:
    """A detokenizer with a fake scheduler and ``workers`` routed fake workers."""
    async with ActorSystem() as system:
        aborts: Inbox[Abort] = Inbox()
        scheduler = await system.spawn(FakeScheduler, aborts, name="scheduler", process=False)
        detokenizer = await system.spawn(
            Detokenizer, name="detokenizer", process=False, scheduler=scheduler, **kwargs
        )
        harness = Harness(system, detokenizer, {}, {}, aborts, {})
        for k in range(workers):
            await add_worker(harness, Origin(k, 1))
        yield harness


async def add_worker(harness: Harness, origin: Origin) -> None:
    inbox: Inbox[BatchStrOutput] = Inbox()
    traces = harness.traces[origin] = []
    # A fake takes only what the detokenizer sends a worker: typed as any worker.
    ref: ActorRef[Any] = await harness.system.spawn(
        FakeWorker,
        inbox,
        traces,
        name=f"worker-{origin.worker}-{origin.incarnation}",
        process=False,
    )
    ack = await harness.detokenizer.ask(RouteUpdate(origin=origin, ref=ref), timeout=5)
    assert ack == RouteAck(origin=origin)
    harness.workers[origin] = ref
    harness.inboxes[origin] = inbox


W0, W1, W2 = Origin(0, 1), Origin(1, 1), Origin(2, 1)


class TestDispatch:
    async def test_each_worker_gets_only_its_own_requests_in_one_sub_batch_per_step(
        self,
    ) -> None:
        async with open_detokenizer(workers=3) as h:
            owners = [W0, W1, W2, W1, W0, W0, W2, W1, W0]
            ids = TOKENIZER.encode(TEXTS[0]).ids
            for step in (1, 2):
                await h.send(
                    *(Entry(o, f"r{i}", ids[step : step + 1]) for i, o in enumerate(owners)),
                    step=step,
                )
            for origin in (W0, W1, W2):
                got = await h.received(origin, step=2)
                assert [b.step for b in got] == [1, 2]
                mine = [f"r{i}" for i, o in enumerate(owners) if o == origin]
                for batch in got:
                    assert batch.rids == mine
                    assert set(batch.origins) == {origin}
                    assert batch.output_ids == [ids[batch.step : batch.step + 1]] * len(mine)
                    # Per-request fields the detokenizer does not compute are carried over.
                    assert batch.cached_tokens == [len(r) for r in mine]
                    assert batch.prompt_tokens == [
                        100 + i for i, o in enumerate(owners) if o == origin
                    ]
                    assert batch.output_token_logprobs_val == [[-0.5]] * len(mine)
                    assert batch.errors is None

    async def test_each_sub_batch_tells_the_trace_contexts_of_its_own_requests(self) -> None:
        def parent(i: int) -> str:
            return f"00-{i + 1:032x}-00f067aa0ba902b7-01"

        async with open_detokenizer(workers=3) as h:
            owners = [W0, W1, W2, W1, W0, W0, W2]
            contexts = tuple("" if i in (1, 5) else parent(i) for i in range(len(owners)))
            ids = TOKENIZER.encode(TEXTS[0]).ids
            entries = [Entry(o, f"r{i}", ids[:1]) for i, o in enumerate(owners)]
            await h.send(*entries, step=1, trace=contexts)
            await h.send(*entries, step=2)  # no request traced: no context
            # A context count that does not match the batch is ignored, not trusted.
            await h.send(*entries, step=3, trace=contexts[:2])
            for origin in (W0, W1, W2):
                await h.received(origin, step=3)
                mine = [i for i, o in enumerate(owners) if o == origin]
                (step1, first), (step2, second), (step3, third) = h.traces[origin]
                assert (step1, step2, step3) == (1, 2, 3)
                # Each entry's trace id is its request's: the context as it came in, or the
                # detokenizer's span in that trace when this process records spans.
                assert [c.split("-")[1] if c else "" for c in first] == [
                    contexts[i].split("-")[1] if contexts[i] else "" for i in mine
                ]
                assert second == third == ()

    async def test_a_step_without_output_for_a_worker_sends_it_nothing(self) -> None:
        async with open_detokenizer(workers=2) as h:
            await h.send(Entry(W1, "only-w1", [5]), step=1)
            await h.send(Entry(W0, "a", [5]), Entry(W1, "only-w1", [6]), step=2)
            assert [b.step for b in await h.received(W0, step=2)] == [2]
            assert [b.step for b in await h.received(W1, step=2)] == [1, 2]


class TestText:
    async def test_the_streamed_pieces_joined_equal_the_one_shot_decode(self) -> None:
        async with open_detokenizer(workers=2) as h:
            requests = {
                (W0 if k % 2 == 0 else W1, f"req-{k}"): TOKENIZER.encode(text).ids
                for k, text in enumerate(TEXTS)
            }
            # Different chunkings per request, so requests finish in different steps.
            cut = {
                key: chunks(ids, sizes)
                for (key, ids), sizes in zip(
                    requests.items(), [(1,), (2, 1), (3, 1, 2), (1, 4)], strict=True
                )
            }
            steps = max(len(c) for c in cut.values())
            for step in range(steps):
                entries = [
                    Entry(origin, rid, c[step], "length" if step == len(c) - 1 else None)
                    for (origin, rid), c in cut.items()
                    if step < len(c)
                ]
                await h.send(*entries, step=step)
            # A last step for both workers: everything before it has arrived too.
            await h.send(
                Entry(W0, "tail", [1], "length"), Entry(W1, "tail", [1], "length"), step=steps
            )
            await h.received(W0, steps)
            await h.received(W1, steps)
            for (origin, rid), ids in requests.items():
                text, got_ids, reasons = h.stream(origin, rid)
                assert text == TOKENIZER.decode(ids)
                assert got_ids == ids
                assert reasons[-1] == "length"
                assert all(r is None for r in reasons[:-1])
            stats = await h.stats()
            assert stats.live_states == 0
            assert stats.requests == sum(len(c) for c in cut.values()) + 2

    async def test_a_stop_string_trims_the_text_and_ends_the_request(self) -> None:
        async with open_detokenizer(workers=1) as h:
            ids = TOKENIZER.encode(TEXTS[0]).ids  # 你好世界。今天的天气很好
            pieces = chunks(ids, (1,))
            step = 0
            for step, piece in enumerate(pieces):
                await h.send(Entry(W0, "s", piece, stop=("世界",)), step=step)
            # The scheduler has not learnt of the stop yet: its last output is ignored.
            await h.send(
                Entry(W0, "s", [], "length"), Entry(W0, "end", [], "length"), step=step + 1
            )
            await h.received(W0, step + 1)
            text, _, reasons = h.stream(W0, "s")
            assert text == "你好"
            assert reasons[-1] == "stop"
            assert reasons.count("stop") == 1
            assert await h.aborts.wait_until(bool) == [Abort(origin=W0, rid="s", reason="stop")]
            stats = await h.stats()
            assert (stats.stopped_by_string, stats.live_states) == (1, 0)

    async def test_no_stop_trim_keeps_the_stop_string(self) -> None:
        async with open_detokenizer(workers=1) as h:
            ids = TOKENIZER.encode(TEXTS[0]).ids
            await h.send(Entry(W0, "s", ids, stop=("世界",), no_stop_trim=True), step=0)
            await h.received(W0, 0)
            text, _, reasons = h.stream(W0, "s")
            assert (text, reasons) == ("你好世界", ["stop"])

    async def test_a_state_is_freed_when_its_request_finishes(self) -> None:
        async with open_detokenizer(workers=2) as h:
            ids = TOKENIZER.encode(TEXTS[1]).ids
            await h.send(Entry(W0, "a", ids[:3]), Entry(W1, "b", ids[:3]), step=0)
            assert (await h.stats()).live_states == 2
            await h.send(Entry(W0, "a", ids[3:], "length"), Entry(W1, "b", ids[3:5]), step=1)
            assert (await h.stats()).live_states == 1
            await h.send(Entry(W1, "b", ids[5:], "abort"), step=2)
            assert (await h.stats()).live_states == 0
            await h.received(W1, 2)
            assert h.stream(W1, "b")[0] == TOKENIZER.decode(ids)


class TestRoutes:
    async def test_output_for_an_unknown_origin_is_dropped_and_counted(self) -> None:
        async with open_detokenizer(workers=1) as h:
            stranger = Origin(7, 1)
            await h.send(
                Entry(stranger, "x", [5]), Entry(W0, "a", [5]), Entry(stranger, "y", [6]), step=0
            )
            got = await h.received(W0, 0)
            assert [b.rids for b in got] == [["a"]]
            stats = await h.stats()
            assert (stats.dropped_unknown_origin, stats.requests, stats.batches) == (2, 3, 1)
            assert stats.live_states == 1  # no state was created for the unknown origin

    async def test_dropping_a_route_drops_its_states_and_later_output(self) -> None:
        async with open_detokenizer(workers=2) as h:
            await h.send(Entry(W0, "a", [5]), Entry(W0, "b", [5]), Entry(W1, "c", [5]), step=0)
            assert (await h.stats()).live_states == 3
            ack = await h.detokenizer.ask(RouteUpdate(origin=W0, ref=None), timeout=5)
            assert ack == RouteAck(origin=W0)
            assert (await h.stats()).live_states == 1
            await h.send(Entry(W0, "a", [6]), Entry(W1, "c", [6]), step=1)
            assert [b.step for b in await h.received(W1, 1)] == [0, 1]
            assert (await h.stats()).dropped_unknown_origin == 1
            assert [b.step for b in h.inboxes[W0].items] == [0]

    async def test_a_new_incarnation_replaces_the_old_ones_route_and_states(self) -> None:
        async with open_detokenizer(workers=1) as h:
            await h.send(Entry(W0, "a", [5]), step=0)
            await h.received(W0, 0)
            reborn = Origin(0, 2)
            await add_worker(h, reborn)
            assert (await h.stats()).live_states == 0
            await h.send(Entry(W0, "a", [6]), Entry(reborn, "a", [7], "length"), step=1)
            got = await h.received(reborn, 1)
            assert [(b.rids, b.output_ids) for b in got] == [(["a"], [[7]])]
            assert (await h.stats()).dropped_unknown_origin == 1


class TestCap:
    async def test_a_request_over_the_cap_is_aborted_with_an_error_and_the_rest_go_on(
        self,
    ) -> None:
        async with open_detokenizer(workers=2, max_states=2) as h:
            ids = TOKENIZER.encode(TEXTS[2]).ids
            await h.send(
                Entry(W0, "a", ids[:2]), Entry(W1, "b", ids[:2]), Entry(W1, "c", ids[:2]), step=0
            )
            await h.send(
                Entry(W0, "a", ids[2:], "length"),
                Entry(W1, "b", ids[2:], "length"),
                Entry(W1, "c", ids[2:], "length"),
                step=1,
            )
            first, second = await h.received(W1, 1)
            assert first.rids == ["b", "c"]
            assert first.finished_reasons == [None, "abort"]
            assert first.output_strs[1] == ""
            assert first.errors is not None
            assert first.errors[0] is None
            assert "max_states=2" in (first.errors[1] or "")
            # The rejected request's later output is ignored; the others complete.
            assert second.rids == ["b"]
            assert h.stream(W1, "b")[0] == TOKENIZER.decode(ids)
            await h.received(W0, 1)
            assert h.stream(W0, "a")[0] == TOKENIZER.decode(ids)
            assert (await h.aborts.wait_until(bool))[0] == Abort(origin=W1, rid="c", reason="abort")
            stats = await h.stats()
            assert (stats.rejected_over_cap, stats.live_states) == (1, 0)

    async def test_aborts_follow_the_scheduler_named_by_the_latest_topology(self) -> None:
        async with open_detokenizer(workers=1, max_states=1) as h:
            aborts: Inbox[Abort] = Inbox()
            reborn: ActorRef[Any] = await h.system.spawn(FakeScheduler, aborts, process=False)
            topology = Topology(scheduler=reborn, detokenizers=[h.detokenizer], router=None)
            await h.detokenizer.tell(topology)
            await h.send(Entry(W0, "a", [5]), Entry(W0, "b", [5]), step=0)
            assert await aborts.wait_until(bool) == [Abort(origin=W0, rid="b", reason="abort")]
            assert h.aborts.items == []


class TestSpans:
    @pytest.mark.parametrize("last", [(), (PARENT, PARENT)], ids=["untraced", "miscounted"])
    async def test_a_finished_request_ends_its_span_whatever_its_last_step_came_with(
        self, span_exporter: InMemorySpanExporter, last: tuple[str, ...]
    ) -> None:
        ids = TOKENIZER.encode(TEXTS[0]).ids
        async with open_detokenizer(workers=1) as h:
            await h.send(Entry(W0, "r", ids[:1]), step=1, trace=(PARENT,))
            # Its last step's context count does not match the batch: ignored, as documented.
            await h.send(Entry(W0, "r", ids[1:2], finished="stop"), step=2, trace=last)
            assert (await h.stats()).live_states == 0  # the request's state is freed...
            # ...and its span ended, not kept until its worker's route goes.
            assert [s.name for s in span_exporter.get_finished_spans()] == ["tokenyard.detokenizer"]
