"""What an ask costs its asker: `runtime._deadlines.Deadlines`, the asks' timeouts on one loop
timer, and `runtime._protocol.new_corr`, their ids."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import random
import struct
import weakref

import anyio
import pytest

from runtime import Actor, ActorSystem, AskTimeoutError, Message, handler
from runtime._deadlines import SLACK, Deadlines
from runtime._protocol import new_corr

from ._messages import Ping, Pong

pytestmark = pytest.mark.timeout(30)


class Hold(Message):
    """Keep the mailbox waiting until the test opens the gate."""


class Gate(Actor[Hold | Ping]):
    """Answers pings, except while a hold keeps its handler waiting (in-process)."""

    held = anyio.Event()
    opened = anyio.Event()

    @handler
    async def hold(self, msg: Hold) -> None:
        Gate.held.set()
        await Gate.opened.wait()

    @handler
    def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n + 1)


class Requests:
    """Pending requests as a station keeps them: each a future to fail past its deadline,
    with the deadline it got."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[asyncio.Future[None], float]] = {}
        self.expired: list[int] = []
        loop = asyncio.get_running_loop()
        self.deadlines = Deadlines(loop, self.pending, self.live, self.expire)

    def add(self, key: int, timeout: float) -> asyncio.Future[None]:
        future = asyncio.get_running_loop().create_future()
        self.pending[key] = (future, self.deadlines.add(key, timeout))
        return future

    def live(self, key: int, when: float) -> bool:
        entry = self.pending.get(key)
        return entry is not None and entry[1] == when

    def expire(self, key: int) -> None:
        future, _ = self.pending.pop(key)
        self.expired.append(key)
        future.set_exception(TimeoutError(key))


async def test_requests_expire_in_deadline_order_and_an_answered_one_never() -> None:
    requests = Requests()
    late = requests.add(1, 0.2)
    answered = requests.add(2, 0.01)
    never = requests.add(3, math.inf)
    early = requests.add(4, 0.05)
    del requests.pending[2]  # answered before its deadline
    answered.set_result(None)
    again = requests.add(2, 60)  # its key used again: the old deadline is not its own
    with anyio.fail_after(5):
        with pytest.raises(TimeoutError):
            await late
    assert requests.expired == [4, 1]
    assert early.done()
    assert not never.done()
    assert not again.done()
    requests.deadlines.close()
    assert len(requests.deadlines) == 0


async def test_an_answered_request_is_not_kept_alive_by_its_deadline() -> None:
    # Its reply with it: a heap of answered asks holding their futures held every reply
    # until its deadline.
    requests = Requests()
    future = requests.add(1, 60)
    answer = weakref.ref(future)
    del requests.pending[1]
    future.set_result(None)
    del future
    gc.collect()
    assert answer() is None
    assert len(requests.deadlines) == 1  # the entry is still there, its request gone
    requests.deadlines.close()


async def test_answered_requests_do_not_pile_up() -> None:
    # Their entries are left where they are: the heap is rebuilt once it holds twice the
    # pending requests and SLACK more, so it stays bounded however many are answered.
    requests = Requests()
    kept = requests.add(0, 60)
    for key in range(1, 20 * SLACK):
        requests.add(key, 60)
        assert len(requests.deadlines) <= 2 * len(requests.pending) + SLACK
        del requests.pending[key]
    assert not kept.done()
    requests.deadlines.close()


async def test_an_expiry_that_raises_leaves_the_later_deadlines_armed() -> None:
    requests = Requests()
    first = requests.add(1, 0.01)
    second = requests.add(2, 0.05)
    expire = requests.expire

    def expire_once_broken(key: int) -> None:
        expire(key)
        if key == 1:
            raise RuntimeError("a broken expiry")

    requests.deadlines._expire = expire_once_broken
    loop = asyncio.get_running_loop()
    errors: list[object] = []
    loop.set_exception_handler(lambda _, context: errors.append(context.get("exception")))
    try:
        with anyio.fail_after(5):
            with pytest.raises(TimeoutError):
                await second
    finally:
        loop.set_exception_handler(None)
    assert first.done()
    assert requests.expired == [1, 2]
    assert [str(e) for e in errors] == ["a broken expiry"]


async def test_asks_time_out_each_at_its_own_timeout_and_the_rest_are_answered() -> None:
    Gate.held, Gate.opened = anyio.Event(), anyio.Event()
    async with ActorSystem() as system:
        ref = await system.spawn(Gate, process=False)
        await ref.tell(Hold())
        await Gate.held.wait()
        with anyio.fail_after(10):
            with pytest.raises(AskTimeoutError, match=r"within 0\.05 s"):
                await ref.ask(Ping(n=1), timeout=0.05)
            # Queued behind the hold, long enough to be answered: a shorter ask made
            # after it expires first and leaves it be.
            async with anyio.create_task_group() as tg:
                answers: list[Pong] = []

                async def ask_long() -> None:
                    answers.append(await ref.ask(Ping(n=2), timeout=30))

                tg.start_soon(ask_long)
                with pytest.raises(AskTimeoutError, match=r"within 0\.01 s"):
                    await ref.ask(Ping(n=3), timeout=0.01)
                Gate.opened.set()
        assert answers == [Pong(n=3)]
        assert len(system.station._deadlines or ()) <= SLACK + 4


def test_correlation_ids_are_63_bit_never_0_and_a_forked_child_draws_its_own() -> None:
    # Drawn from the CSPRNG many at a time: a child forked with some drawn must not use
    # them (its asks' ids would be its parent's next ones, known to the parent).
    first = new_corr()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.close(read)
        os.write(write, struct.pack("<8Q", *(new_corr() for _ in range(8))))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = set(struct.unpack("<8Q", pipe.read()))
    assert os.waitpid(pid, 0)[1] == 0
    ours = {first} | {new_corr() for _ in range(2000)}
    assert not theirs & ours
    assert all(0 < corr < 2**63 for corr in ours | theirs)
    assert len(ours) == 2001


async def test_many_asks_at_once_each_end_as_its_timeout_says() -> None:
    # Short and long timeouts in a random order, some asks cancelled by their callers, a
    # process actor asked too: with the mailbox held, each short one expires, each long
    # one is answered once it opens, a cancelled one neither; and nothing stays pending.
    Gate.held, Gate.opened = anyio.Event(), anyio.Event()
    rng = random.Random(7)
    async with ActorSystem() as system:
        ref = await system.spawn(Gate, process=False)
        far = await system.spawn(Gate, process=True)
        await ref.tell(Hold())
        await Gate.held.wait()
        outcomes: dict[int, str] = {}
        kinds = [rng.choice(("short", "long", "cancelled")) for _ in range(300)]
        shorts = [kinds.count("short")]
        expired = anyio.Event()

        async def ask(n: int, kind: str, scope: anyio.CancelScope) -> None:
            with scope:
                try:
                    timeout = rng.uniform(0.01, 0.2) if kind == "short" else 60.0
                    target = far if n % 10 == 0 and kind == "long" else ref
                    reply = await target.ask(Ping(n=n), timeout=timeout)
                    outcomes[n] = "answered" if reply == Pong(n=n + 1) else f"wrong {reply}"
                except AskTimeoutError:
                    outcomes[n] = "expired"
                    shorts[0] -= 1
                    if not shorts[0]:
                        expired.set()
            if scope.cancel_called:
                outcomes[n] = "cancelled"

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                scopes = [anyio.CancelScope() for _ in kinds]
                for n, kind in enumerate(kinds):
                    tg.start_soon(ask, n, kind, scopes[n])
                await anyio.wait_all_tasks_blocked()
                for n, kind in enumerate(kinds):
                    if kind == "cancelled":
                        scopes[n].cancel()
                # Every short ask ends while the mailbox is held, whatever the order.
                await expired.wait()
                Gate.opened.set()
        wanted = {"short": "expired", "long": "answered", "cancelled": "cancelled"}
        assert outcomes == {n: wanted[kind] for n, kind in enumerate(kinds)}
        assert not system.station._pending
