"""``MetricsCollector``: the actor that gathers a whole system's statistics, and keeps what
it knew of the incarnations that died.

Pulled, not pushed: a gathering asks every process for a snapshot (`Kind.METRICS`) when
somebody asks the collector, at most once per ``max_age`` (so every HTTP worker serving
``/metrics`` in one window gives the same answer, and nothing is spent while nobody looks).

What becomes of a dead incarnation's series (the rule, tied to the ``Down`` the collector
gets of every actor it has seen):

- its per-actor and ``process_*`` series are kept, frozen at the values last gathered and
  marked down (``tokenyard_actor_up 0``), for ``retention`` seconds after the ``Down``, then
  ended; at most ``max_dead`` are kept (the oldest end first);
- the counters and histograms its code added (`runtime.metrics`, summed over processes)
  keep its last gathered values for good once its process is gone (the last actor seen of
  it died), so a summed counter never goes backwards when a worker dies and its successor
  starts from zero; its gauges end at once (a dead process holds nothing);
- what it counted after the last gathering before it died is lost, as with any scrape.

A live process that does not answer a gathering in time (a handler holding its loop, a
stop under way, a process under it that holds it up) is shown as it was last gathered, so
that no summed counter goes backwards for a scrape.

Supervisors' restart counts (`ChildRecord`) live in the supervisor, which outlives its
children, so the restart history survives every one of them.
"""

from __future__ import annotations

import math
import time

from ._actor import Actor, handler
from ._message import Request
from ._metrics import GAUGE, FamilySnapshot, merge
from ._protocol import Down
from ._stats import ActorMetrics, DeadIncarnation, ProcessMetrics, SystemMetrics, now


class GetMetrics(Request[SystemMetrics]):
    """Ask a `MetricsCollector` for the system's statistics.

    Attributes:
        max_age: Seconds a gathering may be old to be served again (0: gather now).
    """

    max_age: float = 1.0


CollectorMessage = GetMetrics | Down
"""What a `MetricsCollector` accepts."""


class MetricsCollector(Actor[CollectorMessage]):
    """Gathers the statistics of every actor of every process under its system.

    Spawn it in the root process (``process=False``): it gathers through its own system,
    which reaches every process below it. Ask it with `GetMetrics` from outside a handler
    of an actor it gathers from (that actor's mailbox would answer only after the handler).

    Args:
        retention: Seconds a dead incarnation's series are kept after its ``Down``
            (finite, 0 or more).
        max_dead: Most dead incarnations kept.
        timeout: Seconds each process has to answer a gathering (finite, above 0).

    Raises:
        ValueError: An argument is out of its range, or NaN or infinite.

    Example:
        >>> collector = await system.spawn(MetricsCollector, name="metrics", process=False)
        >>> metrics = await collector.ask(GetMetrics())
    """

    def __init__(self, retention: float = 300.0, max_dead: int = 256, timeout: float = 2.0):
        # Each check says what is allowed: NaN fails every comparison, so it is refused
        # too (checks of what is refused, such as `timeout <= 0`, let it through).
        if not 0 <= retention < math.inf:
            raise ValueError(
                f"retention={retention}: seconds a dead incarnation is kept, a finite number "
                "of 0 or more"
            )
        if isinstance(max_dead, bool) or not isinstance(max_dead, int):
            raise TypeError(f"max_dead={max_dead!r}: a whole number of dead incarnations kept")
        if max_dead < 0:
            raise ValueError(f"max_dead={max_dead}: dead incarnations kept, 0 or more")
        if not 0 < timeout < math.inf:
            raise ValueError(
                f"timeout={timeout}: seconds each process has to answer a gathering, a "
                "finite number above 0"
            )
        self.retention = retention
        self.max_dead = max_dead
        self.timeout = timeout
        self._last: SystemMetrics | None = None
        self._last_at = 0.0
        #: Live actors seen, by address: their last statistics and their process's.
        self._seen: dict[str, tuple[ActorMetrics, ProcessMetrics]] = {}
        self._dead: dict[str, DeadIncarnation] = {}
        #: What dead processes counted, kept for good (counters and histograms only).
        self._retired: dict[str, FamilySnapshot] = {}

    @handler
    async def get(self, msg: GetMetrics) -> SystemMetrics:
        """The system's statistics, gathered now or at most ``max_age`` ago."""
        last = self._last
        if last is not None and time.monotonic() - self._last_at <= msg.max_age:
            return last
        gathered = await self.system.gather_metrics(self.timeout)
        self._learn(gathered.processes)
        self._expire()
        processes = gathered.processes + self._unanswered(gathered.processes)
        result = SystemMetrics(
            processes=processes,
            dead=list(self._dead.values()),
            families=merge([*(p.families for p in processes), list(self._retired.values())]),
            gathered_at=gathered.gathered_at,
        )
        self._last, self._last_at = result, time.monotonic()
        return result

    def _learn(self, processes: list[ProcessMetrics]) -> None:
        for process in processes:
            for actor in process.actors:
                address = actor.ref.address
                if address in self._dead:
                    continue
                if address not in self._seen and actor.ref.owner:
                    self.system.watch(actor.ref, notify=self.ref)
                self._seen[address] = (actor, process)

    def _unanswered(self, answered: list[ProcessMetrics]) -> list[ProcessMetrics]:
        """The processes with a live actor seen that did not answer this gathering (busy
        past the timeout, stopping, or under one that did not answer), as last gathered:
        left out, their counters would drop out of the sums for a scrape and come back at
        the next, which reads as a reset."""
        stations = {p.station for p in answered}
        missing: dict[str, ProcessMetrics] = {}
        for actor, process in self._seen.values():
            # One known dead (stopped just now: its Down on its way here) is no longer shown.
            if process.station not in stations and not self.system.is_dead(actor.ref):
                missing.setdefault(process.station, process)
        return list(missing.values())

    @handler
    def down(self, msg: Down) -> None:
        """An actor seen alive died: keep its last statistics by the rule."""
        seen = self._seen.pop(msg.ref.address, None)
        if seen is None:
            return
        actor, process = seen
        station = process.station
        # An actor process of its own (not one of several in this process, the root):
        # the process died with it.
        own = len(process.actors) == 1 and station != self.ref.owner
        if station != self.ref.owner and all(p.station != station for _, p in self._seen.values()):
            # The last actor seen of a process other than this one: the process is gone
            # (its actors die with it), and what it counted is kept.
            self._retire(process.families)
        self._dead[msg.ref.address] = DeadIncarnation(
            actor=actor,
            pid=process.process.pid,
            process=process.process if own else None,
            cause=msg.cause.value,
            reason=msg.reason,
            died_at=now(),
        )
        while len(self._dead) > self.max_dead:
            del self._dead[next(iter(self._dead))]
        self._last = None  # the next ask sees the death

    def _retire(self, families: list[FamilySnapshot]) -> None:
        kept = [f for f in families if f.kind != GAUGE]
        merged = merge([list(self._retired.values()), kept])
        self._retired = {f.name: f for f in merged}

    def _expire(self) -> None:
        limit = now() - self.retention
        for address in [a for a, d in self._dead.items() if d.died_at < limit]:
            del self._dead[address]
