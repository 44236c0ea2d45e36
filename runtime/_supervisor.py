"""``Supervisor``: restarts children on death by strategy, within a restart intensity.

A supervisor is an actor like any other. It starts its children in order in ``on_start``,
watches each one (deaths arrive as ``Down`` messages in its own mailbox, so restarts are
handled one at a time, in order), restarts according to the child's ``Restart`` type and the
``Strategy``, backs off exponentially (with jitter) between restarts of the same child, and,
when more than ``max_restarts`` restarts happen within ``period`` seconds, stops its children
and fails: its own supervisor sees that ``Down``. A stop request that arrives while it
restarts cuts the restart short (`Actor._unless_stopped`): it stops at once, normally.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

from ._actor import Actor, handler
from ._errors import SpawnError, TokenyardError
from ._message import Message, Request
from ._protocol import Cause, Down, SpawnOptions
from ._ref import ActorRef
from ._spawn import actor_path, main_reference, resolve_class
from ._stats import ChildRecord

logger = logging.getLogger("tokenyard.supervisor")

#: The messages a supervisor subclass handles besides a supervisor's own.
E = TypeVar("E", bound=Message)


class Strategy(enum.Enum):
    """Which children restart when one dies."""

    ONE_FOR_ONE = "one_for_one"
    """Only the dead child."""
    ONE_FOR_ALL = "one_for_all"
    """Every child: the others are stopped (reverse start order), then all start again."""
    REST_FOR_ONE = "rest_for_one"
    """The dead child and every child started after it."""


class Restart(enum.Enum):
    """When a dead child is restarted."""

    PERMANENT = "permanent"
    """Always."""
    TRANSIENT = "transient"
    """Only after an abnormal exit (not after a clean stop or a zero exit status)."""
    TEMPORARY = "temporary"
    """Never."""


class ChildSpec(SpawnOptions, frozen=True, kw_only=False):
    """How to start (and restart) one child: what, its restart type, and the `SpawnOptions`
    (each a keyword here, as in ``ActorSystem.spawn``).

    Args:
        actor: The Actor class (or its ``module:QualName``).
        args: Positional constructor arguments (msgspec-encodable).
        kwargs: Keyword constructor arguments (msgspec-encodable).
        name: The child's name, unique under its supervisor (default: the class name).
        restart: When to restart it.
        main: How a process re-imports ``__main__`` for a class defined there (filled in
            from ``actor``).

    The options are those of `SpawnOptions`; for a child: ``stall_timeout`` kills a process
    child that stops answering (and restarts it like any dead child); a supervisor filling in
    ``inherit`` at each start does it in ``spec_for``; ``node`` may name several nodes, tried
    in order (``""`` is the supervisor's host): a child whose node was lost
    (`Cause.NOCONNECTION`) starts again on the first other one that takes it, and on the lost
    one only when none does (docs/guides/multi-host.md).

    Example:
        >>> ChildSpec(Echo, name="echo", restart=Restart.TRANSIENT)
    """

    actor: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}  # noqa: RUF012 - a msgspec field, copied per instance
    name: str = ""
    restart: Restart = Restart.PERMANENT
    main: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.actor, type):
            cls = self.actor
            msgspec.structs.force_setattr(self, "main", main_reference(cls))
            msgspec.structs.force_setattr(self, "actor", actor_path(cls))
            msgspec.structs.force_setattr(self, "name", self.name or cls.__name__)
        elif not isinstance(self.actor, str) or ":" not in self.actor:
            raise TypeError(f"ChildSpec.actor must be an Actor class, got {self.actor!r}")
        if not self.name:
            msgspec.structs.force_setattr(self, "name", str(self.actor).rpartition(":")[2])
        # A restart type given by its value ("transient") is that type, as it is once the
        # spec has travelled to a supervisor's process; compared by identity, the string
        # would have read as PERMANENT in this one.
        msgspec.structs.force_setattr(
            self, "restart", _enum(Restart, self.restart, f"ChildSpec {self.name!r}")
        )
        self.check(f"ChildSpec {self.name!r}: ")


class SupervisorStatistics(Message):
    """A supervisor's counters.

    Attributes:
        started: Child starts (first starts and restarts).
        died: Child deaths seen (deliberate stops for a restart excluded).
        restarted: Children restarted, each counted: a restart of three children under
            ``ONE_FOR_ALL`` counts 3 (the restart intensity counts it once).
        intensity_exceeded: Times the restart intensity was exceeded (then it failed).
        last_restart_ms: How long the last restart took, death seen to child ready.
        children: Names of the children, in start order.
    """

    started: int
    died: int
    restarted: int
    intensity_exceeded: int
    last_restart_ms: float | None
    children: list[str]


class GetSupervisorStatistics(Request[SupervisorStatistics]):
    """Ask a supervisor for its counters."""


class Children(Message):
    """The refs of a supervisor's live children, in start order (None: not running)."""

    refs: dict[str, ActorRef[Any] | None]


class WhichChildren(Request[Children]):
    """Ask a supervisor for the live incarnation of each child."""


SupervisorMessage = Down | GetSupervisorStatistics | WhichChildren
"""The messages every supervisor accepts: its ref is an ``ActorRef[SupervisorMessage]``."""


class RestartIntensityError(TokenyardError):
    """More restarts than ``max_restarts`` happened within ``period``: the supervisor fails."""


@dataclass(eq=False)
class _Entry:
    spec: ChildSpec
    ref: ActorRef[Any] | None = None
    restarts: deque[float] = field(default_factory=deque)
    #: Restarts done, by the cause of the death that led to each.
    restarted: dict[str, int] = field(default_factory=dict)
    #: Deaths seen, by cause.
    deaths: dict[str, int] = field(default_factory=dict)
    last_reason: str = ""
    last_death: float = 0.0
    #: The node it runs on (``""``: the supervisor's host), and one it was lost with.
    node: str = ""
    lost_node: str | None = None

    def places(self) -> list[str]:
        """Where to start it, in order: its spec's nodes, the lost one last."""
        wanted = self.spec.node
        names = [wanted] if isinstance(wanted, str) else list(wanted or ("",))
        if self.lost_node in names and len(names) > 1:
            names.remove(self.lost_node)
            names.append(self.lost_node)
        return names

    def record(self) -> ChildRecord:
        return ChildRecord(
            name=self.spec.name,
            incarnation=0 if self.ref is None else self.ref.incarnation,
            restarts=dict(self.restarted),
            deaths=dict(self.deaths),
            last_reason=self.last_reason,
            last_death=self.last_death,
        )


class Supervisor(Actor[SupervisorMessage | E], Generic[E]):
    """Starts children, watches them, restarts them by strategy within a restart intensity.

    Generic in the messages a subclass handles on top of a supervisor's own
    (``class Registry(Supervisor[Register])``); a plain supervisor is spawned as is.

    Args:
        children: The child specs, in start order.
        strategy: Which children restart when one dies.
        max_restarts: Restarts allowed within ``period`` before the supervisor fails.
        period: The intensity window, in seconds.
        backoff: Base delay before the second and later restarts of one child within the
            window (doubled each time, with jitter of +/-50%); the first is immediate.
        backoff_max: Cap of that delay.

    Raises:
        ValueError: Two children share a name, a strategy that is none, or a number out of
            its bounds (NaN included).
        TypeError: ``max_restarts`` is not a whole number.

    Example:
        >>> sup = await system.spawn(
        ...     Supervisor,
        ...     children=[ChildSpec(Echo, name="echo")],
        ...     strategy=Strategy.ONE_FOR_ONE, max_restarts=3, period=5.0, name="sup")
    """

    def __init__(
        self,
        children: list[ChildSpec],
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        max_restarts: int = 3,
        period: float = 5.0,
        backoff: float = 0.05,
        backoff_max: float = 2.0,
    ) -> None:
        names = [c.name for c in children]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique under a supervisor: {names}")
        # Each bound is written so that NaN, which fails every comparison, is refused too: a
        # NaN backoff had the second restart of a child wait for ever, its supervisor's
        # mailbox with it.
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int):
            raise TypeError(f"max_restarts={max_restarts!r}: give a whole number of restarts")
        if max_restarts < 0 or not period > 0:
            raise ValueError(f"max_restarts={max_restarts}, period={period}: need >= 0 and > 0")
        if not backoff >= 0 or not backoff_max >= 0:
            raise ValueError(f"backoff={backoff}, backoff_max={backoff_max}: need >= 0 seconds")
        self.entries = [_Entry(spec) for spec in children]
        # By its value too ("one_for_all"), as in a supervisor's own process; compared by
        # identity, a string read as REST_FOR_ONE in this one.
        self.strategy = _enum(Strategy, strategy, "strategy")
        self.max_restarts = max_restarts
        self.period = period
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.intensity: deque[float] = deque()
        self.stopping = False
        self.started = 0
        self.died = 0
        self.restarted = 0
        self.intensity_exceeded = 0
        self.last_restart_ms: float | None = None
        self._rng = random.Random()
        #: In `on_start`, and what a hook that gave up there failed the start with.
        self._starting = False
        self._start_failure: Exception | None = None

    # -- life ---------------------------------------------------------------------------

    async def on_start(self) -> None:
        self._starting = True
        try:
            for entry in self.entries:
                await self._start(entry)
                if self._start_failure is not None:  # a hook gave up (`give_up`)
                    raise self._start_failure
        except BaseException:
            await self._stop_children(self.entries)
            raise
        finally:
            self._starting = False

    async def on_stop(self) -> None:
        self.stopping = True
        await self._stop_children(self.entries)

    async def _start(self, entry: _Entry) -> None:
        spec = self.spec_for(entry.spec)
        cls = resolve_class(spec.actor, spec.main)
        if not issubclass(cls, Actor):
            raise SpawnError(f"{spec.actor} is not an Actor class")
        failures: list[str] = []
        places = entry.places()
        options = msgspec.structs.asdict(spec.options())
        for place in places:
            try:
                ref = await self.system.spawn(
                    cls,
                    *spec.args,
                    name=spec.name,
                    **{**options, "node": place or None},
                    **spec.kwargs,
                )
            except SpawnError as err:
                if len(places) == 1:
                    raise
                failures.append(f"{place or 'here'}: {err}")
                continue
            entry.node = place
            break
        else:
            raise SpawnError(f"{spec.name!r} started nowhere: " + "; ".join(failures))
        entry.ref = ref
        self.started += 1
        self.system.watch(ref, notify=self.ref)
        _event("child_started", self.ref.name, spec.name, incarnation=ref.incarnation)
        try:
            await self.on_child_started(spec.name, ref)
        except Exception as err:
            # A start is whole or it is not: the child goes, and the start failed.
            entry.ref = None
            with contextlib.suppress(TokenyardError):
                await self.system.stop(ref, spec.shutdown_timeout)
            raise SpawnError(f"{spec.name!r}: on_child_started raised {err!r}") from err

    async def _stop_children(self, entries: list[_Entry]) -> None:
        for entry in reversed(entries):
            ref, entry.ref = entry.ref, None
            if ref is not None:
                # It may have died on its own meanwhile: its Down will then be stale.
                with contextlib.suppress(TokenyardError):
                    await self.system.stop(ref, entry.spec.shutdown_timeout)

    # -- hooks for subclasses -------------------------------------------------------------

    def spec_for(self, spec: ChildSpec) -> ChildSpec:
        """The spec to start a child with now (override to fill in arguments known only at
        start time, such as the refs of siblings started before it)."""
        return spec

    async def on_child_started(self, name: str, ref: ActorRef[Any]) -> None:
        """Called after each start or restart of a child (override to publish its ref)."""

    async def on_child_died(self, name: str, down: Down) -> None:
        """Called when a child died, before any restart (override to clean up after it)."""

    async def on_restart_failed(self, name: str, error: Exception) -> None:
        """Called when an attempt to restart a child failed (its ``on_start`` raised, its
        process could not start, ...), before the next attempt; override to count such
        failures and `give_up` when another attempt cannot help."""

    def child(self, name: str) -> ActorRef[Any] | None:
        """The live incarnation of the child ``name`` (None while it is down).

        Raises:
            KeyError: This supervisor has no child of that name.
        """
        for entry in self.entries:
            if entry.spec.name == name:
                return entry.ref
        raise KeyError(f"supervisor {self.ref.name!r} has no child named {name!r}")

    # -- deaths ---------------------------------------------------------------------------

    @handler
    async def down(self, msg: Down) -> None:
        """A child died: restart what the strategy says, or fail past the intensity.

        A hook that raises here (``on_child_died``, ``on_restart_failed``) makes the
        supervisor give up with its error: a handler's error fails only its message, and this
        message is a death, so the child would otherwise stay down, unsupervised, under a
        supervisor that looks healthy.
        """
        try:
            await self._handle_down(msg)
        except Exception as err:
            if not self.stopping:
                logger.exception("%s: handling the death of %s raised", self.ref.name, msg.ref)
                await self.give_up(err)

    async def _handle_down(self, msg: Down) -> None:
        index = next(
            (i for i, e in enumerate(self.entries) if e.ref is not None and e.ref == msg.ref),
            None,
        )
        if index is None or self.stopping or self.system.closing:
            return  # a child stopped on purpose, an older incarnation, or the end of it all
        seen = time.monotonic()
        entry = self.entries[index]
        entry.ref = None
        self.died += 1
        cause = msg.cause.value
        entry.deaths[cause] = entry.deaths.get(cause, 0) + 1
        entry.last_reason, entry.last_death = msg.reason, time.time()
        entry.lost_node = entry.node if msg.cause is Cause.NOCONNECTION else None
        _event("child_died", self.ref.name, entry.spec.name, reason=msg.reason)
        await self.on_child_died(entry.spec.name, msg)
        if self._stopping_now():
            return  # the hook gave up (`give_up`)
        restart = entry.spec.restart
        if restart is Restart.TEMPORARY or (restart is Restart.TRANSIENT and msg.normal):
            return
        if self.strategy is Strategy.ONE_FOR_ONE:
            group = [entry]
        elif self.strategy is Strategy.ONE_FOR_ALL:
            group = list(self.entries)
        else:
            group = self.entries[index:]
        await self._stop_children([e for e in group if e is not entry])
        try:
            # A stop request that arrives before or during the restart cuts it short (its
            # backoff, a start that hangs or keeps failing): the supervisor stops, and
            # `on_stop` stops what was started; only a finished restart is recorded below.
            restarted = await self._unless_stopped(
                functools.partial(self._restart_group, entry, group)
            )
        except RestartIntensityError as err:
            await self.give_up(err)
            return
        if not restarted or self._stopping_now():
            return  # stopped meanwhile, or on_restart_failed gave up
        entry.restarted[cause] = entry.restarted.get(cause, 0) + 1
        self.last_restart_ms = (time.monotonic() - seen) * 1000
        _event("restarted", self.ref.name, entry.spec.name, ms=round(self.last_restart_ms, 1))

    async def _restart_group(self, entry: _Entry, group: list[_Entry]) -> None:
        """Restart ``group`` after the death of ``entry``, in start order."""
        # One incident, however many children it restarts (OTP). A temporary sibling
        # stopped with the group is not started again: temporary is never.
        self._count_restart(entry.spec.name)
        for member in group:
            if member.spec.restart is not Restart.TEMPORARY:
                await self._restart(member)
                if self._stopping_now():
                    return  # on_restart_failed gave up

    def _stopping_now(self) -> bool:
        """``stopping``, read again after a hook ran (it may have given up)."""
        return self.stopping

    async def give_up(self, error: Exception) -> None:
        """Restart nothing more: stop what still runs, then fail with ``error``, so that this
        supervisor's own supervisor (or its owner) decides. Past the restart intensity, or
        when a subclass's ``on_child_died`` sees that restarting cannot help. Called while
        the supervisor starts (from ``on_child_started``), its start fails with ``error``,
        and no child after that one is started."""
        self.stopping = True
        await self._stop_children(self.entries)
        if self._starting:
            # Failing as its own start (`on_start` raises it): as a crash, the children
            # after this one were started or not depending on how long each took.
            self._start_failure = error
        else:
            self.crash(error)

    async def _restart(self, entry: _Entry) -> None:
        first = True
        while True:
            if not first:
                self._count_restart(entry.spec.name)  # a failed attempt is another restart
            first = False
            delay = self._backoff(entry)
            if delay:
                await _sleep(delay)
            try:
                await self._start(entry)
            except Exception as err:  # noqa: BLE001 - any failed start is retried (counted)
                _event("restart_failed", self.ref.name, entry.spec.name, error=str(err))
                await self.on_restart_failed(entry.spec.name, err)
                if self._stopping_now():
                    return  # the hook gave up (`give_up`)
                continue
            self.restarted += 1
            return

    def _count_restart(self, child: str) -> None:
        """Count one restart (caused by ``child``); past the intensity, fail."""
        if _count_in_window(self.intensity, self.period) > self.max_restarts:
            self.intensity_exceeded += 1
            text = (
                f"supervisor {self.ref.name!r}: more than {self.max_restarts} restarts in "
                f"{self.period:g} s"
            )
            _event("intensity_exceeded", self.ref.name, child, error=text)
            raise RestartIntensityError(text)

    def _backoff(self, entry: _Entry) -> float:
        attempt = _count_in_window(entry.restarts, self.period)
        return restart_delay(attempt, self.backoff, self.backoff_max, self._rng)

    # -- introspection --------------------------------------------------------------------

    def _supervision(self) -> list[ChildRecord]:
        return [entry.record() for entry in self.entries]

    @handler
    def statistics(self, msg: GetSupervisorStatistics) -> SupervisorStatistics:
        """The supervisor's counters."""
        return SupervisorStatistics(
            started=self.started,
            died=self.died,
            restarted=self.restarted,
            intensity_exceeded=self.intensity_exceeded,
            last_restart_ms=self.last_restart_ms,
            children=[e.spec.name for e in self.entries],
        )

    @handler
    def which_children(self, msg: WhichChildren) -> Children:
        """The live incarnation of each child."""
        return Children(refs={e.spec.name: e.ref for e in self.entries})


_Enum = TypeVar("_Enum", bound=enum.Enum)


def _enum(kind: type[_Enum], value: object, where: str) -> _Enum:
    """``value`` as a member of ``kind``: a member, or a member's value.

    Raises:
        ValueError: It is neither, naming ``where`` and the choices.
    """
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.name for m in kind)
        raise ValueError(f"{where}: {value!r} is not a {kind.__name__} ({choices})") from None


def _count_in_window(times: deque[float], period: float) -> int:
    """Record one event now in ``times`` and return how many fall within ``period`` s."""
    now = time.monotonic()
    times.append(now)
    while times and now - times[0] > period:
        times.popleft()
    return len(times)


def restart_delay(attempt: int, backoff: float, cap: float, rng: random.Random) -> float:
    """Seconds to wait before the ``attempt``-th restart of one child within the window.

    The first is immediate; the n-th (n >= 2) waits ``backoff * 2**(n-2)`` times a random
    factor between 0.5 and 1.5 (jitter, so supervisors restarting at once do not do it in step),
    capped at ``cap``.
    """
    if attempt <= 1 or backoff <= 0:
        return 0.0
    try:
        grown = backoff * 2.0 ** (attempt - 2)
    except OverflowError:  # past ~1000 restarts in a long window: long since capped
        grown = math.inf
    return float(min(grown * rng.uniform(0.5, 1.5), cap))


async def _sleep(seconds: float) -> None:
    import anyio

    await anyio.sleep(seconds)


def _event(event: str, supervisor: str, child: str, **fields: object) -> None:
    """A structured supervision record: the message for people, ``extra`` for machines."""
    detail = " ".join(f"{k}={v}" for k, v in fields.items())
    level = logging.WARNING if event in ("child_died", "intensity_exceeded") else logging.INFO
    logger.log(
        level,
        "%s: %s %s %s",
        supervisor,
        event,
        child,
        detail,
        extra={"event": event, "supervisor": supervisor, "child": child, **fields},
    )
