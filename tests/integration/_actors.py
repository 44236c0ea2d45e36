"""Actors the integration tests spawn in child processes (importable by the children)."""

from __future__ import annotations

import os
import resource
import signal
import time
from typing import TYPE_CHECKING

import anyio

from runtime import Actor, ActorRef, Message, Request, current_trace, handler, metrics

if TYPE_CHECKING:
    from decimal import Decimal


class Ping(Request["Pong"]):
    n: int


class Pong(Message):
    n: int


class Tick(Message, array_like=True):
    n: int


class Fail(Request[None]):
    text: str


class Slow(Request[Pong]):
    seconds: float


class GetCount(Request["Count"]):
    pass


class Count(Message):
    n: int
    name: str = ""


class Forward(Request[Pong]):
    """Ask ``target`` for ``n`` from inside a handler and return its answer."""

    target: ActorRef[Ping]
    n: int


class TellTo(Message):
    """Tell ``target`` a Ping (a ref travelling inside a message)."""

    target: ActorRef[Ping]
    n: int


class Blob(Message):
    """Bytes to hold (a flood of these tests the byte bounds)."""

    data: bytes


class Echo(Actor[Ping | Tick | Fail | Slow | GetCount | Forward | TellTo | Blob]):
    """Answers pings, counts ticks, fails on demand; reports its count when it stops."""

    def __init__(self, factor: int = 1, report_to: ActorRef[Count] | None = None) -> None:
        self.factor = factor
        self.report_to = report_to
        self.ticks = 0

    @handler
    async def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n * self.factor)

    @handler
    def tick(self, msg: Tick) -> None:
        self.ticks += 1

    @handler
    def blob(self, msg: Blob) -> None:
        self.ticks += 1

    @handler
    def fail(self, msg: Fail) -> None:
        raise ValueError(msg.text)

    @handler
    async def slow(self, msg: Slow) -> Pong:
        await anyio.sleep(msg.seconds)  # sync-ok: a deliberately slow handler under test
        return Pong(n=0)

    @handler
    def get_count(self, msg: GetCount) -> Count:
        return Count(n=self.ticks, name=self.ref.name)

    @handler
    async def forward(self, msg: Forward) -> Pong:
        reply: Pong = await msg.target.ask(Ping(n=msg.n))
        return reply

    @handler
    async def tell_to(self, msg: TellTo) -> None:
        await msg.target.tell(Ping(n=msg.n))

    async def on_stop(self) -> None:
        if self.report_to is not None:
            await self.report_to.tell(Count(n=self.ticks, name=self.ref.name))


class FdLimitedEcho(Echo):
    """An `Echo` whose process may open at most ``nofile`` file descriptors (the soft
    ``RLIMIT_NOFILE``, lowered in `on_start`), as on a host left at the common 1,024."""

    def __init__(self, nofile: int) -> None:
        super().__init__()
        self.nofile = nofile

    async def on_start(self) -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, hard))


class GetNofile(Request["Nofile"]):
    pass


class Nofile(Message):
    soft: int
    hard: int


class NofileReporter(Actor[GetNofile]):
    """Says its process's ``RLIMIT_NOFILE``."""

    @handler
    def nofile(self, msg: GetNofile) -> Nofile:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return Nofile(soft=soft, hard=hard)


class Gathered:
    """What a Collector received; shared with the test because the Collector runs in-process."""

    def __init__(self) -> None:
        self.counts: list[Count] = []
        self.pings: list[int] = []
        self._changed = anyio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, n_counts: int = 0, n_pings: int = 0) -> None:
        """Wait (on the change event, not a timer) until enough arrived."""
        while len(self.counts) < n_counts or len(self.pings) < n_pings:
            await self._changed.wait()


class Collector(Actor[Count | Ping]):
    """Runs in the test process (process=False): gathers Counts and Pings it is told."""

    def __init__(self, gathered: Gathered) -> None:
        self.gathered = gathered

    @handler
    def count(self, msg: Count) -> None:
        self.gathered.counts.append(msg)
        self.gathered.notify()

    @handler
    def ping(self, msg: Ping) -> Pong:
        self.gathered.pings.append(msg.n)
        self.gathered.notify()
        return Pong(n=msg.n)


class BadStart(Actor[Ping]):
    """Its on_start raises: spawning it must fail with SpawnError."""

    @handler
    def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n)

    async def on_start(self) -> None:
        raise RuntimeError("on_start refuses")


class GetPid(Request["Pid"]):
    pass


class Pid(Message):
    pid: int


class Quit(Message):
    """Stop yourself normally (a clean exit)."""


class Crash(Message):
    """Fail the whole actor (not just this message)."""

    text: str = "crashed on purpose"


class Started(Message):
    """Reported by a Worker when it starts (or stops, with ``stopped=True``).

    ``at`` is when, on the machine-wide monotonic clock: reports from different processes
    travel on different sockets and may arrive out of order, so tests sort by it.
    """

    name: str
    incarnation: int
    stopped: bool = False
    at: float = 0.0
    pid: int = 0


class Worker(Actor[GetPid | Quit | Crash | Tick | GetCount | Slow]):
    """A supervised child: reports its starts and stops, quits or crashes on demand."""

    def __init__(self, report_to: ActorRef[Started] | None = None) -> None:
        self.report_to = report_to
        self.ticks = 0

    async def on_start(self) -> None:
        if self.report_to is not None:
            await self.report_to.tell(
                Started(name=self.ref.name, incarnation=self.ref.incarnation, at=time.monotonic())
            )

    async def on_stop(self) -> None:
        if self.report_to is not None:
            await self.report_to.tell(
                Started(
                    name=self.ref.name,
                    incarnation=self.ref.incarnation,
                    stopped=True,
                    at=time.monotonic(),
                )
            )

    @handler
    def pid(self, msg: GetPid) -> Pid:
        return Pid(pid=os.getpid())

    @handler
    async def quit(self, msg: Quit) -> None:
        await self.stop()

    @handler
    def crash_now(self, msg: Crash) -> None:
        self.crash(RuntimeError(msg.text))

    @handler
    def tick(self, msg: Tick) -> None:
        self.ticks += 1

    @handler
    def get_count(self, msg: GetCount) -> Count:
        return Count(n=self.ticks, name=self.ref.name)

    @handler
    async def slow(self, msg: Slow) -> Pong:
        await anyio.sleep(msg.seconds)  # sync-ok: a deliberately slow handler under test
        return Pong(n=0)


class Stubborn(Actor[GetPid]):
    """Never finishes stopping: its ``on_stop`` waits forever. With ``ignore_sigterm`` (in
    its own process only) it also ignores SIGTERM, so only SIGKILL ends it."""

    def __init__(self, ignore_sigterm: bool = False) -> None:
        self.ignore_sigterm = ignore_sigterm

    async def on_start(self) -> None:
        if self.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    async def on_stop(self) -> None:
        await anyio.sleep_forever()  # sync-ok: a stop that never ends is what is under test

    @handler
    def pid(self, msg: GetPid) -> Pid:
        return Pid(pid=os.getpid())


class ReportsItsStop(Actor[GetPid]):
    """Reports to ``report_to`` (``stopped=True``) when its ``on_stop`` begins, which then
    never returns: a stop under way until an escalation (SIGTERM) ends it."""

    def __init__(self, report_to: ActorRef[Started]) -> None:
        self.report_to = report_to

    async def on_stop(self) -> None:
        stopping = Started(name=self.ref.name, incarnation=self.ref.incarnation, stopped=True)
        await self.report_to.tell(stopping)
        await anyio.sleep_forever()  # sync-ok: a stop that never ends is what is under test

    @handler
    def pid(self, msg: GetPid) -> Pid:
        return Pid(pid=os.getpid())


class Journal:
    """What a Recorder saw, in order; shared with the test (the Recorder runs in-process)."""

    def __init__(self) -> None:
        self.events: list[Started] = []
        self._changed = anyio.Event()

    def add(self, event: Started) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, count: int) -> list[Started]:
        while len(self.events) < count:
            await self._changed.wait()
        return self.events


class Recorder(Actor[Started]):
    """Collects Started reports into a Journal."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    @handler
    def started(self, msg: Started) -> None:
        self.journal.add(msg)


class Failure(Message):
    """An actor's report from its ``on_failure`` hook."""

    name: str
    error: str


class Fragile(Actor[Crash]):
    """Crashes on demand and reports the failure from its ``on_failure`` hook."""

    def __init__(self, report_to: ActorRef[Failure]) -> None:
        self.report_to = report_to

    @handler
    def crash_now(self, msg: Crash) -> None:
        self.crash(RuntimeError(msg.text))

    async def on_failure(self, error: BaseException) -> None:
        await self.report_to.tell(Failure(name=self.ref.name, error=repr(error)))


class Failures(Actor[Failure]):
    """Runs in the test process: gathers what ``on_failure`` hooks report."""

    def __init__(self, journal: list[Failure], arrived: anyio.Event) -> None:
        self.journal = journal
        self.arrived = arrived

    @handler
    def failure(self, msg: Failure) -> None:
        self.journal.append(msg)
        self.arrived.set()


class Write(Request[None]):
    """Write ``data`` to the descriptor the actor inherited."""

    data: bytes


class FdWriter(Actor[Write]):
    """Writes what it is asked to a file descriptor it inherited from its parent."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @handler
    def write(self, msg: Write) -> None:
        os.write(self.fd, msg.data)


class Traced(Message):
    """A tell whose handler records the trace context it came with."""

    n: int


class Traces(Message):
    """What a TraceRecorder saw: each `Traced` with its context, and the asking ask's own."""

    seen: list[tuple[int, tuple[str, ...]]]
    asked: tuple[str, ...]


class GetTraces(Request[Traces]):
    """Ask a TraceRecorder what it saw."""


class Relay(Request[Traces]):
    """Tell ``to`` a `Traced` with the trace context this ask came with; answer what ``to``
    saw then (asked over the same pipe as the tell, so after it)."""

    n: int
    to: ActorRef[Traced | GetTraces]


class TraceRecorder(Actor[Traced | Relay | GetTraces]):
    """Records `runtime.current_trace` in each handler; passes it on through `Relay`."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, tuple[str, ...]]] = []

    @handler
    def traced(self, msg: Traced) -> None:
        self.seen.append((msg.n, current_trace()))

    @handler
    async def relay(self, msg: Relay) -> Traces:
        await msg.to.tell(Traced(n=msg.n), trace=current_trace())
        return await msg.to.ask(GetTraces())

    @handler
    def traces(self, msg: GetTraces) -> Traces:
        return Traces(seen=self.seen, asked=current_trace())


class StartsSlowly(Actor[Ping]):
    """Tells ``report_to`` its pid (as a `Count`) when its ``on_start`` begins, which then
    takes ``seconds``: a spawn under way for that long, whose process is known."""

    def __init__(self, report_to: ActorRef[Count], seconds: float) -> None:
        self.report_to = report_to
        self.seconds = seconds

    async def on_start(self) -> None:
        await self.report_to.tell(Count(n=os.getpid(), name=self.ref.name))
        await anyio.sleep(self.seconds)  # sync-ok: a start that takes this long is under test

    @handler
    def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n)


class FailsOnHost(Actor[Ping]):
    """Fails in ``on_start`` when it runs on ``host`` (its mailbox's tcp address says so)."""

    def __init__(self, host: str) -> None:
        self.host = host

    async def on_start(self) -> None:
        if self.ref.address.startswith(f"tcp://{self.host}:"):
            raise RuntimeError(f"not on {self.host}")

    @handler
    def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n)


class StartsThenWaits(Actor[Ping | GetPid]):
    """Reports its start (and pid) to ``report_to`` from ``on_start``, which then never
    returns (from incarnation ``holds_from`` on): a spawn, or a restart, that stays under way
    for as long as the test wants. With ``fails``, that ``on_start`` raises instead: a
    restart that fails, and is tried again after its backoff."""

    def __init__(
        self, report_to: ActorRef[Started], holds_from: int = 1, fails: bool = False
    ) -> None:
        self.report_to = report_to
        self.holds_from = holds_from
        self.fails = fails

    async def on_start(self) -> None:
        started = Started(name=self.ref.name, incarnation=self.ref.incarnation, pid=os.getpid())
        await self.report_to.tell(started)
        if self.ref.incarnation < self.holds_from:
            return
        if self.fails:
            raise RuntimeError(f"incarnation {self.ref.incarnation} does not start")
        await anyio.sleep_forever()  # sync-ok: an on_start that never returns is under test

    @handler
    def ping(self, msg: Ping) -> Pong:
        return Pong(n=msg.n)

    @handler
    def pid(self, msg: GetPid) -> Pid:
        return Pid(pid=os.getpid())


class Metered(Actor[Ping | Slow]):
    """Counts its pings in a series of its own (``test_pings_total``), beside a gauge that
    fails when ``failing_gauge`` (``test_broken``: its function raises)."""

    def __init__(self, failing_gauge: bool = False) -> None:
        self.failing_gauge = failing_gauge

    async def on_start(self) -> None:
        self.pings = metrics.counter("test_pings_total", "Pings handled.").labels()
        if self.failing_gauge:
            broken: dict[str, float] = {}
            metrics.gauge("test_broken", "Fails.").labels().set_function(lambda: broken["x"])

    @handler
    def ping(self, msg: Ping) -> Pong:
        self.pings.inc()
        return Pong(n=msg.n)

    @handler
    async def slow(self, msg: Slow) -> Pong:
        await anyio.sleep(msg.seconds)  # sync-ok: a handler that holds its process's loop
        return Pong(n=0)


class MeteredWithChild(Metered):
    """A `Metered` that starts an in-process `Echo` beside it: a process of two actors."""

    async def on_start(self) -> None:
        await super().on_start()
        await self.system.spawn(Echo, name=f"{self.ref.name}-child", process=False)


class Kinds(Message):
    names: list[str]


class GetKinds(Request[Kinds]):
    pass


class ArgumentKinds(Actor[GetKinds]):
    """Reports the types its constructor's arguments arrived as; ``price`` names a type
    imported for the type checker only, which the child cannot resolve."""

    def __init__(self, count: Count, pair: tuple[int, int], price: Decimal | None = None) -> None:
        self.names = [type(count).__name__, type(pair).__name__, type(price).__name__]

    @handler
    def kinds(self, msg: GetKinds) -> Kinds:
        return Kinds(names=self.names)
