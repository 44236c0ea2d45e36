"""The pipeline end to end: real processes, real ZeroMQ, the bundled tokenizer (and one a
test builds)."""

from __future__ import annotations

import inspect
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from actors import Member, Pipeline, WorkerDiedError
from actors._tokenizer import load_tokenizer
from actors.messages import (
    CheckFlush,
    CheckLoad,
    DetokenizerStatistics,
    GetDetokenizerStatistics,
    GetRouterStatistics,
    GetSchedulerStatistics,
    GetWorkerStatistics,
    Origin,
    RegisterWorker,
    RouterStatistics,
    SchedulerStatistics,
    WorkerStatistics,
)
from runtime import ActorRef, TokenyardError

from ._actors import Replies, ReplyInbox

if TYPE_CHECKING:
    from collections.abc import Callable

TOKENIZER = load_tokenizer()
PROMPTS = ["Hello there", "你好, 世界", "Bonjour à tous 😀", "def f(x): return x", "🇯🇵 東京"]


class TestGenerate:
    @pytest.mark.parametrize("workers", [1, 4])
    async def test_generate_and_stream_agree_through_n_workers(self, workers: int) -> None:
        # Engine steps 5 ms apart: a stream's pieces arrive apart however busy the machine
        # (at zero step time a reader that wakes late finds every token in one piece).
        async with Pipeline(workers=workers, step_time=0.005) as p:
            results = []
            async with anyio.create_task_group() as tg:

                async def one(prompt: str) -> None:
                    results.append(await p.generate(prompt, max_new_tokens=24))

                for prompt in PROMPTS * 2:
                    tg.start_soon(one, prompt)
            assert len(results) == 10
            assert {r.worker for r in results} <= set(range(workers))
            if workers == 4:
                assert len({r.worker for r in results}) > 1
            for r in results:
                assert r.completion_tokens == len(r.output_ids) <= 24
                assert r.finish_reason in ("length", "stop")
                assert r.text == TOKENIZER.decode(r.output_ids)
            pieces = [piece async for piece in p.stream(PROMPTS[2], max_new_tokens=24)]
            same = await p.generate(PROMPTS[2], max_new_tokens=24)
            assert "".join(pieces) == same.text
            assert len(pieces) > 1

    async def test_stop_strings_trim_the_text(self) -> None:
        async with Pipeline(workers=1) as p:
            plain = await p.generate(PROMPTS[0], max_new_tokens=32)
            assert len(plain.text) > 6
            stop = plain.text[3:6]
            cut = await p.generate(PROMPTS[0], max_new_tokens=32, stop=[stop])
            assert cut.finish_reason == "stop"
            assert cut.text == plain.text[: plain.text.index(stop)]
            pieces = [x async for x in p.stream(PROMPTS[0], max_new_tokens=32, stop=[stop])]
            assert "".join(pieces) == cut.text


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


CJK = "你好世界潮汐钟日本語の港한국어"
EMOJI = ["🚢", "😀", "👍🏽", "🌊", "🎉", "❤️"]
MIXED = [*"abcxyz ,.!?é", *CJK, *EMOJI]


def _prompts() -> st.SearchStrategy[list[str]]:
    """A CJK prompt, an emoji prompt and a few mixed ones, every example."""
    cjk = st.text(st.sampled_from(list(CJK)), min_size=1, max_size=12)
    emoji = st.lists(st.sampled_from(EMOJI), min_size=1, max_size=6).map("".join)
    mixed = st.lists(
        st.lists(st.sampled_from(MIXED), min_size=1, max_size=16).map("".join), max_size=3
    )
    return st.tuples(cjk, emoji, mixed).map(lambda t: [t[0], t[1], *t[2]])


class TestStreamingProperty:
    @settings(
        max_examples=4,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(prompts=_prompts(), data=st.data())
    async def test_joined_stream_pieces_equal_the_one_shot_decode_cut_at_the_stop(
        self, prompts: list[str], data: st.DataObject
    ) -> None:
        async with Pipeline(workers=2) as p:
            for prompt in prompts:
                first = await p.generate(prompt, max_new_tokens=24)
                full = TOKENIZER.decode(first.output_ids)
                pieces = [x async for x in p.stream(prompt, max_new_tokens=24)]
                assert "".join(pieces) == first.text == full
                # A stop string taken from the (deterministic) output cuts the stream just
                # before its first occurrence; the ids still decode to a text that begins
                # with what was streamed.
                starts = [i for i, ch in enumerate(full) if ch != "\ufffd"]
                if not starts:
                    continue
                i = data.draw(st.sampled_from(starts), label="stop start")
                j = data.draw(st.integers(i + 1, min(len(full), i + 3)), label="stop end")
                stop = full[i:j]
                if "\ufffd" in stop:
                    continue
                cut = full[: full.index(stop)]
                pieces = [x async for x in p.stream(prompt, max_new_tokens=24, stop=[stop])]
                stopped = await p.generate(prompt, max_new_tokens=24, stop=[stop])
                assert "".join(pieces) == stopped.text == cut
                assert stopped.finish_reason == "stop"
                assert TOKENIZER.decode(stopped.output_ids).startswith(cut)


class TestRegistrationAndControl:
    async def test_a_duplicate_registration_is_warned_about_and_ignored(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        async with Pipeline(workers=1) as p:
            worker = p.worker_ref(0)
            assert worker is not None
            dup = RegisterWorker(worker_id=0, incarnation=worker.incarnation, address=worker)
            with caplog.at_level(logging.WARNING, logger="tokenyard.pipeline"):
                await p.supervisor.ask(dup)
            assert "duplicate registration" in caplog.text
            assert p.worker_ref(0) == worker
            assert (await p.generate("still serving", max_new_tokens=4)).completion_tokens == 4

    async def test_control_replies_reach_only_the_worker_that_asked(self) -> None:
        async with Pipeline(workers=2) as p:
            inboxes = []
            for k in range(2):
                replies = Replies()
                inbox = await p.system.spawn(ReplyInbox, replies, process=False, name=f"r{k}")
                inboxes.append((replies, inbox))
            for k, (_, inbox) in enumerate(inboxes):
                worker = p.worker_ref(k)
                assert worker is not None
                await worker.tell(CheckLoad(reply_to=inbox))
            for k, (replies, _) in enumerate(inboxes):
                with anyio.fail_after(10):
                    while not replies.loads:
                        await replies.arrived.wait()
                worker = p.worker_ref(k)
                assert worker is not None
                assert [r.origin for r in replies.loads] == [Origin(k, worker.incarnation)]


async def load_with_a_kill(
    p: Pipeline, kill: Callable[[], object], n: int = 500
) -> tuple[int, int]:
    """Run ``n`` concurrent requests; once 20 finished, call ``kill`` (and await what it
    returns, if anything). Every request must end (complete or WorkerDiedError) within the
    deadline: none may hang."""
    done = failed = 0
    busy = anyio.Event()

    async def one(i: int) -> None:
        nonlocal done, failed
        try:
            await p.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=24)
            done += 1
        except WorkerDiedError:
            failed += 1
        if done == 20:
            busy.set()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
            await busy.wait()
            killing = kill()
            if inspect.isawaitable(killing):
                await killing
    return done, failed


class TestDeaths:
    async def test_a_worker_killed_under_500_requests_loses_none_and_comes_back(
        self,
    ) -> None:
        async with Pipeline(workers=4, step_time=0.002) as p:
            killed: list[int] = []
            done, failed = await load_with_a_kill(
                p, lambda: killed.append(p.kill_worker(1).incarnation)
            )
            assert done + failed == 500
            assert done > 0
            back = await p.wait_worker(1, after=killed[0])
            assert back.incarnation == killed[0] + 1
            result = await p.generate("after the restart", max_new_tokens=8)
            assert result.completion_tokens == 8

    async def test_a_detokenizer_killed_under_500_requests_loses_none_and_comes_back(
        self,
    ) -> None:
        async with Pipeline(workers=2, step_time=0.002) as p:
            detokenizer = await p.system.lookup("detokenizer:0")
            pid = p.system.pid_of(detokenizer)
            assert pid is not None
            done, failed = await load_with_a_kill(p, lambda: os.kill(pid, signal.SIGKILL))
            assert done + failed == 500
            with anyio.fail_after(60):
                while (await p.system.lookup("detokenizer:0", missing_ok=True)) in (
                    None,
                    detokenizer,
                ):
                    await anyio.lowlevel.checkpoint()
            result = await p.generate("after the restart", max_new_tokens=8)
            assert result.completion_tokens == 8


#: A prompt id outside every vocabulary here: the scheduler refuses it with an AbortNotice,
#: which reaches its caller only through the router.
OUTSIDE = [1_000_000]
REFUSED = "outside the engine's vocabulary"


async def ask_stats(ref: ActorRef[Any], msg: Any, kind: type[Any]) -> Any:
    stats = await ref.ask(msg, timeout=10)
    assert isinstance(stats, kind)
    return stats


class ControlLoops:
    """Control requests (load and flush in turn) to each worker, one at a time, until told
    to stop: each waits for its reply, so one is always in flight when a member dies."""

    def __init__(self, p: Pipeline, inbox: ActorRef[Any], replies: Replies) -> None:
        self.p = p
        self.inbox = inbox
        self.replies = replies
        self.sent: dict[int, int] = {}
        self.stop = anyio.Event()

    async def run(self, k: int) -> None:
        self.sent[k] = 0
        while not self.stop.is_set():
            await self.once(k)

    async def once(self, k: int) -> None:
        worker = self.p.worker_ref(k)
        assert worker is not None
        self.sent[k] = sent = self.sent.get(k, 0) + 1
        ask = CheckLoad if sent % 2 else CheckFlush
        await worker.tell(ask(reply_to=self.inbox))
        await self.replies.wait_until(lambda: self.replies.from_worker(k) >= sent)


async def open_control(p: Pipeline) -> ControlLoops:
    replies = Replies()
    inbox = await p.system.spawn(ReplyInbox, replies, process=False, name="control-inbox")
    return ControlLoops(p, inbox, replies)


async def refused(p: Pipeline) -> None:
    """A request the scheduler refuses: its caller must hear the refusal."""
    with pytest.raises(TokenyardError, match=REFUSED) as err:
        await p.generate(OUTSIDE, max_new_tokens=4)
    assert not isinstance(err.value, WorkerDiedError)


async def wait_for_successor(p: Pipeline, name: str, dead: ActorRef[Any]) -> ActorRef[Any]:
    """The live incarnation of ``name`` once the dead one has been replaced (called once
    requests that could only end through the successor have ended: found at once)."""
    with anyio.fail_after(30):
        while (ref := await p.system.lookup(name, missing_ok=True)) in (None, dead):
            await anyio.lowlevel.checkpoint()
    assert ref is not None
    assert ref.incarnation > dead.incarnation
    return ref


class TestSharedMemberDeaths:
    async def test_a_router_killed_under_500_requests_leaves_no_caller_waiting_and_comes_back(
        self,
    ) -> None:
        async with Pipeline(workers=2, step_time=0.002) as p:
            control = await open_control(p)
            router = await p.system.lookup("router")
            pid = p.system.pid_of(router)
            assert pid is not None
            dead = p.system.watch(router)
            refusals = 0

            async def refusing() -> None:
                nonlocal refusals
                while not control.stop.is_set():
                    await refused(p)
                    refusals += 1

            async def kill() -> None:
                os.kill(pid, signal.SIGKILL)
                await dead
                # No router runs now: these refusals can only be answered through the next.
                async with anyio.create_task_group() as burst:
                    for _ in range(50):
                        burst.start_soon(refused, p)

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for k in range(2):
                        tg.start_soon(control.run, k)
                    for _ in range(4):
                        tg.start_soon(refusing)
                    done, failed = await load_with_a_kill(p, kill)
                    control.stop.set()
            assert done + failed == 500
            assert done > 0
            assert p.failed == failed
            assert refusals > 0
            successor = await wait_for_successor(p, "router", router)
            # Every control request was answered exactly once, the ones in flight at the
            # death included; and the burst went through the successor.
            for k, sent in control.sent.items():
                assert control.replies.from_worker(k) == sent
            stats = await ask_stats(successor, GetRouterStatistics(), RouterStatistics)
            assert stats.forwarded >= 50
            assert stats.routes == 2
            for k in range(2):
                await control.once(k)
            await refused(p)
            assert (await p.generate("after the restart", max_new_tokens=8)).completion_tokens == 8

    @pytest.mark.parametrize("member", ["scheduler", "detokenizer:0"])
    async def test_a_member_killed_under_500_requests_comes_back_with_nothing_left_behind(
        self, member: str
    ) -> None:
        async with Pipeline(workers=2, step_time=0.002) as p:
            control = await open_control(p)
            victim = await p.system.lookup(member)
            pid = p.system.pid_of(victim)
            assert pid is not None

            async def kill() -> None:
                os.kill(pid, signal.SIGKILL)

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for k in range(2):
                        tg.start_soon(control.run, k)
                    done, failed = await load_with_a_kill(p, kill)
                    control.stop.set()
            assert done + failed == 500
            assert p.failed == failed
            assert p.resubmitted > 0  # the requests still waiting for their first output
            await wait_for_successor(p, member, victim)
            for k, sent in control.sent.items():
                assert control.replies.from_worker(k) == sent
            for k in range(2):
                await control.once(k)
            assert (await p.generate("after the restart", max_new_tokens=8)).completion_tokens == 8
            # Nothing is kept for a request nobody waits for: not by the workers (the
            # resubmitted and the failed were let go there), not by the scheduler, not by
            # the detokenizer.
            for k in range(2):
                worker = p.worker_ref(k)
                assert worker is not None
                w = await ask_stats(worker, GetWorkerStatistics(), WorkerStatistics)
                assert (w.requests, w.control_pending) == (0, 0)
                assert w.received == w.finished + w.failed + w.released
            scheduler = await p.system.lookup("scheduler")
            s = await ask_stats(scheduler, GetSchedulerStatistics(), SchedulerStatistics)
            assert (s.running, s.waiting) == (0, 0)
            detokenizer = await p.system.lookup("detokenizer:0")
            d = await ask_stats(detokenizer, GetDetokenizerStatistics(), DetokenizerStatistics)
            assert d.live_states == 0


class TestOutputNobodyReadYet:
    async def test_a_stream_that_has_yielded_nothing_is_started_again(self) -> None:
        """The stand-in's first token for this prompt is the first half of a character
        spelled over two ids: its output carries an id and no text, and yields nothing.
        Before, any output that had reached the pipeline made a death final
        (WorkerDiedError with nothing yielded)."""
        prompt = "prompt 3"  # first yielded: "👍", ids [275, 3870], the first held a step
        async with Pipeline(workers=2, step_time=0.5) as p:
            inbox = await p.system.lookup("pipeline-inbox")
            before = (await p.system.statistics(inbox)).handled
            pieces: list[str] = []

            async def read() -> None:
                pieces.extend([piece async for piece in p.stream(prompt, max_new_tokens=4)])

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read)
                    # The held id's output reached the pipeline (its inbox handled it): its
                    # counters, read in this process without a wait, polled.
                    for _ in range(1000):
                        if (await p.system.statistics(inbox)).handled > before:
                            break
                        await anyio.sleep(0.005)  # sync-ok: polling the inbox's counters
                    else:
                        pytest.fail("no output reached the pipeline in 5 s")
                    assert not pieces
                    scheduler = await p.system.lookup("scheduler")
                    pid = p.system.pid_of(scheduler)
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
            assert pieces == ["👍", "🏽"]
            expected = await p.generate(prompt, max_new_tokens=4)
            assert "".join(pieces) == expected.text
            assert (p.resubmitted, p.failed) == (1, 0)


class TestStreamingDeaths:
    async def test_streams_on_a_killed_worker_fail_once_they_had_output_and_the_rest_resubmit(
        self,
    ) -> None:
        # Room for every stream in the running batch: once 400 of the 500 have yielded, at
        # least 25 of them are on worker 1 (the other three hold 375). Steps slow enough
        # for this caller to keep up, so those are still running when worker 1 dies.
        async with Pipeline(workers=4, step_time=0.05, max_batch_size=512) as p:
            expected: dict[str, str] = {}

            async def reference(prompt: str) -> None:
                expected[prompt] = (await p.generate(prompt, max_new_tokens=16)).text

            async with anyio.create_task_group() as tg:
                for prompt in PROMPTS:
                    tg.start_soon(reference, prompt)
            yielding = 0
            busy = anyio.Event()
            completed: list[tuple[str, list[str]]] = []
            died: list[tuple[list[str], WorkerDiedError]] = []

            async def one(i: int) -> None:
                nonlocal yielding
                prompt = PROMPTS[i % len(PROMPTS)]
                pieces: list[str] = []
                try:
                    async for piece in p.stream(prompt, max_new_tokens=16):
                        pieces.append(piece)
                        if len(pieces) == 1:
                            yielding += 1
                            if yielding == 400:
                                busy.set()
                except WorkerDiedError as err:
                    died.append((pieces, err))
                    return
                completed.append((prompt, pieces))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for i in range(500):
                        tg.start_soon(one, i)
                    await busy.wait()
                    # Worker 1 frozen, then 100 more streams, 25 per worker (round robin):
                    # those sent to worker 1 cannot have output when it dies.
                    frozen = p.kill_worker(1, signal.SIGSTOP)
                    for i in range(100):
                        tg.start_soon(one, i)
                    # sync-ok: not a sleep, one pass of the event loop: each new task runs
                    # up to its first wait, which comes after its request was told to its
                    # worker (a tell into a mailbox with room never waits).
                    await anyio.lowlevel.checkpoint()
                    killed = p.kill_worker(1)
                    assert killed == frozen
            assert len(completed) + len(died) == 600
            # A stream that had output on the dead worker failed; none was resubmitted
            # behind its caller's back (its pieces would then repeat a prefix).
            for prompt, pieces in completed:
                assert "".join(pieces) == expected[prompt]
            # And every stream that failed had yielded: one with output not yet read was
            # started again, as one with none.
            assert died
            assert all(pieces for pieces, _ in died)
            name = f"tokenizer_worker:1 (incarnation {killed.incarnation})"
            for _, err in died:
                assert err.member is Member.WORKER
                assert name in err.reason
            assert p.failed == len(died)
            # The dead worker's requests that had no output yet went to the others, and
            # the scheduler dropped what it still held for the dead incarnation.
            assert p.resubmitted >= 25
            scheduler = await p.system.lookup("scheduler")
            stats = await ask_stats(scheduler, GetSchedulerStatistics(), SchedulerStatistics)
            assert stats.dropped_for_dead_origin > 0
            await p.wait_worker(1, after=killed.incarnation)
            served = [(await p.generate("again", max_new_tokens=4)).worker for _ in range(4)]
            assert 1 in served


class TestProcesses:
    async def test_every_member_process_is_titled_with_its_name_and_pid(self) -> None:
        async with Pipeline(workers=2) as p:
            names = ["tokenizer_worker:0", "tokenizer_worker:1", "detokenizer:0", "scheduler"]
            titles = {}
            for name in [*names, "router"]:
                pid = p.system.pid_of(await p.system.lookup(name))
                assert pid is not None
                titles[name] = (pid, Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0"))
            for name, (pid, title) in titles.items():
                assert title == f"tokenyard::{name}:{pid}".encode()
            # The supervisor runs in the caller's process, which keeps its own title.
            assert p.system.pid_of(p.supervisor) is None
            own = Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
            assert not own.startswith(b"tokenyard::")
            # A restarted worker is titled with its new pid.
            killed = p.kill_worker(1)
            back = await p.wait_worker(1, after=killed.incarnation)
            pid = p.system.pid_of(back)
            assert pid is not None
            assert pid != titles["tokenizer_worker:1"][0]
            title = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0")
            assert title == f"tokenyard::tokenizer_worker:1:{pid}".encode()


CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Voix ambiguë d'un cœur qui, au zéphyr, préfère les jattes de kiwis. Ça va très bien.
敏捷的棕色狐狸跳过了懒狗。東京の空は青い。 Emoji too: 😀 🎉 👍🏽 → ✓ … €
"""


def build_small_tokenizer(tmp_path: Path) -> tuple[Any, Path]:
    """A byte-level BPE of about 300 ids, shaped unlike the bundled one (other special
    tokens, so other ids), saved as a Hugging Face ``tokenizer.json``."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS * 4, encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return tokenizer, path


class TestOwnTokenizer:
    async def test_a_pipeline_on_a_tokenizer_file_generates_and_streams_its_decode(
        self, tmp_path: Path
    ) -> None:
        tokenizer, path = build_small_tokenizer(tmp_path)
        prompt = "Bonjour, the fox 😀 東京"
        # Steps 5 ms apart: the stream arrives in pieces however busy the machine.
        async with Pipeline(workers=2, tokenizer=path, step_time=0.005) as p:
            results = [await p.generate(prompt, max_new_tokens=24) for _ in range(2)]
            pieces = [x async for x in p.stream(prompt, max_new_tokens=24)]
        assert {r.worker for r in results} == {0, 1}
        result = results[0]
        assert results[1].output_ids == result.output_ids
        # The workers tokenized with it, the scheduler drew from its vocabulary and the
        # detokenizer decoded with it.
        assert result.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False).ids)
        assert max(result.output_ids) < tokenizer.get_vocab_size()
        assert result.text == tokenizer.decode(result.output_ids)
        assert result.text != TOKENIZER.decode(result.output_ids)
        assert "".join(pieces) == result.text
        assert len(pieces) > 1
