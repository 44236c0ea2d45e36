"""How one system starts its children: in this process, in a process of their own, or on a
node of the system on another host.

A spawn is a `SpawnTarget` (what: the class, its name and incarnation, its encoded
arguments) and `SpawnOptions` (how), both declared once in `runtime._protocol`; the
`Spawner` resolves the options against its system's defaults and takes one of three paths.
Every child it starts is recorded in its `ChildTable`, where its death, its stop and its
liveness probes are handled. The spawner sees its system through `SpawnerSystem`, a narrow
protocol, so that this module imports nothing of `runtime._system`.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import msgspec

from ._actor import Actor
from ._cell import Cell
from ._children import CANCELLED_WITH_SYSTEM, SPAWN_GIVEN_UP, Child, ChildTable, RemoteProcess
from ._errors import SpawnError, TokenyardError, sole_error, to_its_end
from ._exit import oom_kills
from ._launcher import check_start
from ._message import Message
from ._nodes import NodeSystem, find_node, spawn_on
from ._protocol import (
    Cause,
    Down,
    Kind,
    RemoteKill,
    RemoteSpawn,
    RemoteSpawned,
    SpawnTarget,
    body_encoder,
)
from ._ref import ActorRef
from ._spawn import (
    SpawnSpec,
    actor_path,
    child_env,
    encode_arguments,
    main_reference,
    start_process,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ._auth import Keys
    from ._cell import Ending
    from ._launcher import Launcher
    from ._protocol import SpawnOptions
    from ._transport import TransportOptions

logger = logging.getLogger("tokenyard.system")

M = TypeVar("M", bound=Message)

#: The in-process actor whose code is running (its mailbox address): what it spawns is its
#: own, and stopped when it ends.
_spawning_parent: contextvars.ContextVar[str] = contextvars.ContextVar("tokenyard_parent")


def enter_parent(address: str) -> None:
    """Make the in-process actor at ``address`` the parent of what the running code spawns."""
    _spawning_parent.set(address)


class SpawnerSystem(NodeSystem, Protocol):
    """What the spawner needs of the system it spawns for (an open ``ActorSystem``)."""

    ipc_dir: str
    root_pid: int

    @property
    def keys(self) -> Keys | None:
        """The system's CURVE keys (tcp only)."""
        ...

    @property
    def nodes_root(self) -> str:
        """The root's reply inbox when the system has nodes, else ''."""
        ...

    def make_cell(
        self,
        actor: type[Actor[Any]],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str,
        incarnation: int,
    ) -> Cell:
        """An actor built in this process, its mailbox bound (``on_start`` not run yet)."""
        ...

    async def live(self, cell: Cell, on_ready: Callable[[], Awaitable[None]]) -> Ending:
        """Live the actor's life in ``cell`` as the system's member."""
        ...


class Spawner:
    """Starts the children of one system and keeps their records.

    Args:
        system: The open system it spawns for.
        launcher: How the system starts actor processes (and its fork server).
        defaults: The options a spawn that names none takes (the system's timeouts and start
            method).
    """

    def __init__(self, system: SpawnerSystem, launcher: Launcher, defaults: SpawnOptions):
        self.system = system
        self.launcher = launcher
        self.defaults = defaults
        self.children = ChildTable(system.station)
        self._incarnations: dict[str, int] = {}
        self._names = itertools.count(1)

    async def spawn(
        self,
        actor: type[Actor[M]],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str | None,
        how: SpawnOptions,
    ) -> ActorRef[M]:
        """Start ``actor`` as ``how`` says; its ref once it is ready (``ActorSystem.spawn``).

        Raises:
            SpawnError: As ``ActorSystem.spawn`` says.
            TypeError: ``actor`` is not an Actor subclass.
            ValueError: A start method this platform does not have.
        """
        if not (isinstance(actor, type) and issubclass(actor, Actor)):
            # An instance failed on its missing __name__, another class on its handlers.
            raise TypeError(
                f"spawn takes an Actor subclass, not {actor!r}: pass the class, and its "
                "constructor's arguments after it (spawn(Echo, 1, name='echo'))"
            )
        parent = _spawning_parent.get("")
        if not name:  # one that no live actor holds (a spawn may have been given it)
            name = f"{actor.__name__}-{next(self._names)}"
            while self.children.holds(parent, name):
                name = f"{actor.__name__}-{next(self._names)}"
        await self.children.claim(parent, name)
        ref: ActorRef[M] | None = None
        try:
            ref = await self._spawn_claimed(actor, args, kwargs, name, how)
        finally:  # to its child, or (failed, given up) to nobody
            self.children.settle(parent, name, ref)
        return ref

    async def _spawn_claimed(
        self,
        actor: type[Actor[M]],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str,
        how: SpawnOptions,
    ) -> ActorRef[M]:
        """`spawn`, once ``name`` is this spawn's (`ChildTable.claim`)."""
        incarnation = self._incarnations.get(name, 0) + 1
        self._incarnations[name] = incarnation
        if how.start is not None:
            check_start(how.start, "spawn(")
        given, how = how, how.over(self.defaults)
        if not how.process:
            return await self._in_process(actor, args, kwargs, name, incarnation, how)
        Cell.decoder_for(actor)  # a class without handlers fails here, not in the child
        enc_args, enc_kwargs = encode_arguments(actor, args, kwargs)
        target = SpawnTarget(
            actor=actor_path(actor),
            main=main_reference(actor),
            name=name,
            incarnation=incarnation,
            args=enc_args,
            kwargs=enc_kwargs,
        )
        if how.node is not None:
            if not isinstance(how.node, str):
                raise ValueError(
                    f"spawn(node={how.node!r}): name one node (a ChildSpec tries more)"
                )
            # The node starts it as it starts its own actors, unless this spawn names how.
            asked = msgspec.structs.replace(how, start=given.start, node=None)
            return await self._on_node(target, asked, how.node)
        child = await self._in_own_process(target, how, self.system.options, self.system.nodes_root)
        return child.ref

    # -- in this process --------------------------------------------------------------------

    async def _in_process(
        self,
        actor: type[Actor[M]],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str,
        incarnation: int,
        how: SpawnOptions,
    ) -> ActorRef[M]:
        """Start an actor in this event loop and return its ref once ``on_start`` returned.

        The actor runs in a task of the system, in a cancel scope of its own: a caller that
        gives up on the spawn (cancelled, or past ``spawn_timeout``) cancels the actor and
        nothing else.
        """
        system = self.system
        cell = system.make_cell(actor, args, kwargs, name, incarnation)
        ref: ActorRef[M] = ActorRef(
            name, cell.mailbox.address, incarnation, system.station.reply_address
        )
        child = Child(ref, how, cell=cell, parent=_spawning_parent.get(""))
        child.scope = anyio.CancelScope()
        start = _Start()
        self.children.add(child)
        system.start_task(self._run_in_process, child, start)
        timeout = _resolved(how.spawn_timeout)
        try:
            with anyio.fail_after(timeout):
                await start.done.wait()
        except BaseException as err:
            start.abandoned = True
            child.scope.cancel()
            # Gone before the spawn fails, as a process is reaped first: the next turn of
            # the loop ends it, unless its on_start holds out against the cancellation.
            # To its end: asyncio's cancellation (a second `Task.cancel`) passes a shielded
            # scope, and the spawn raised with its actor still running.
            await to_its_end(_exited(child, _resolved(how.shutdown_timeout)))
            if isinstance(err, TimeoutError):
                raise SpawnError(
                    f"actor {name!r} was not ready within {timeout:g} s (its on_start had not "
                    "returned); a slow on_start needs a larger spawn(spawn_timeout=...) or "
                    "ActorSystem(spawn_timeout=...)"
                ) from None
            raise
        if start.error is not None:
            raise start.error
        return ref

    async def _run_in_process(self, child: Child, start: _Start) -> None:
        cell, scope = child.cell, child.scope
        assert cell is not None
        assert scope is not None
        station = self.system.station

        async def on_ready() -> None:
            start.done.set()

        ending: Ending | None = None
        try:
            with scope:
                ending = await self.system.live(cell, on_ready)
                if ending.stop is not None:
                    with anyio.CancelScope(shield=True):
                        try:
                            await station.reply(ending.stop, None)
                        except TokenyardError as err:
                            logger.debug("stop of %s not acknowledged: %s", child.ref.name, err)
        finally:
            if not start.done.is_set():  # it never started: its spawn fails
                error = None if ending is None or ending.error is None else sole_error(ending.error)
                why = "was stopped before its on_start returned"
                if error is not None:  # its first line: a remote traceback stays in its cause
                    first = str(error).partition("\n")[0]
                    why = f"failed in on_start: {type(error).__name__}: {first}"
                cause = Cause.CANCELLED if error is None else Cause.EXCEPTION
                reason = SPAWN_GIVEN_UP if error is None and start.abandoned else why
                self.children.died(child, Down(ref=child.ref, cause=cause, reason=reason))
                start.error = SpawnError(f"actor {child.ref.name!r} {why}")
                start.error.__cause__ = error
                start.done.set()
            else:
                if not station.closed:
                    # The replies it sent this process go first: an ask it answered gets
                    # its answer, not the news of its death.
                    with anyio.CancelScope(shield=True):
                        await station.ping(station.reply_address, _REPLIES_READ_WITHIN)
                self.children.died(child, _local_down(child, ending, start.abandoned))

    # -- in a process of its own ------------------------------------------------------------

    async def _in_own_process(
        self, target: SpawnTarget, how: SpawnOptions, transport: TransportOptions, root: str
    ) -> Child:
        """Start an actor process and record it as a child, once it is ready."""
        system, station = self.system, self.system.station
        token, ready = station.new_request(f"spawn:{target.name}")
        spec = SpawnSpec(
            target=target,
            how=how,
            defaults=self.defaults,
            ipc_dir=system.ipc_dir,
            options=transport,
            parent_reply=station.reply_address,
            token=token,
            root_pid=system.root_pid,
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            log_level=logging.getLogger().getEffectiveLevel(),
            cookie=station.cookie,
            keys=system.keys,
            preload=list(self.launcher.preload),
            root=root,
        )
        fork = self.launcher.fork_for(spec)
        if fork is not None:
            spec.env = child_env()
        oom_before = oom_kills()
        station.deaths.expect_last_words(token)
        timeout = _resolved(how.spawn_timeout)
        try:
            proc, started = await start_process(spec, ready, timeout, fork)
        except BaseException:
            station.deaths.take_last_words(token)
            raise
        finally:
            station.drop_request(token)
        ref: ActorRef[Any] = ActorRef(
            target.name, started.address, target.incarnation, station.reply_address
        )
        child = Child(
            ref,
            how,
            process=proc,
            token=token,
            station_address=started.station,
            oom_before=oom_before,
            parent=_spawning_parent.get(""),
        )
        self.children.add(child)
        system.start_task(self.children.await_exit, child)
        if how.stall_timeout is not None:
            system.start_task(self.children.probe, child)
        return child

    # -- on a node of the system ------------------------------------------------------------

    async def _on_node(self, target: SpawnTarget, how: SpawnOptions, place: str) -> ActorRef[Any]:
        system = self.system
        if system.options.transport != "tcp" or system.keys is None:
            raise SpawnError(
                "spawn(node=...) needs a system over tcp with CURVE keys "
                "(ActorSystem(transport='tcp', keys=...)): docs/guides/multi-host.md"
            )
        request = RemoteSpawn(
            target=target,
            how=how,
            transport=msgspec.Raw(body_encoder.encode(system.options)),
            root=system.root_address,
        )
        answer_within = _resolved(how.spawn_timeout) + system.options.heartbeat
        info = await find_node(system, place, answer_within)
        station = system.station
        # The request outlives a caller that gives up (a cancelled spawn, a supervisor
        # stopped mid-restart): an actor the node starts for nobody is killed once its
        # address is known; left alone, this process's heartbeat with the node would hold
        # its lease, and the actor would live for ever.
        outcome: asyncio.Future[RemoteSpawned] = asyncio.get_running_loop().create_future()

        def kill(answer: RemoteSpawned) -> None:
            body = RemoteKill(answer.address, int(signal.SIGKILL), "its spawn was given up")
            station.notify(info.address, Kind.KILL, body_encoder.encode(body))

        async def ask_node() -> None:
            try:
                answer = await spawn_on(system, info, request, answer_within)
            except Exception as err:  # noqa: BLE001 - the caller's to raise
                if not outcome.done():
                    outcome.set_exception(err)
                return
            except BaseException:  # the system's task group, cancelled: it closes
                if not outcome.done():
                    outcome.set_exception(SpawnError(f"{target.name!r}: the system closed"))
                raise
            if outcome.done():  # given up
                kill(answer)
            else:
                outcome.set_result(answer)

        system.start_task(ask_node)
        try:
            spawned = await outcome
        except BaseException:
            # Given up in the very turn its answer came: nobody will take that actor.
            if outcome.done() and not outcome.cancelled() and outcome.exception() is None:
                kill(outcome.result())
            raise
        finally:
            outcome.cancel()  # a no-op once it has its answer
        ref: ActorRef[Any] = ActorRef(
            target.name, spawned.address, target.incarnation, info.address
        )
        remote = RemoteProcess(station, info.address, info.name, spawned.pid, spawned.address)
        child = Child(ref, how, parent=_spawning_parent.get(""), remote=remote)
        station.deaths.on_death(ref.address, remote.deliver)
        station.deaths.subscribe(ref)
        self.children.add(child)
        system.start_task(self.children.await_exit, child)
        return ref

    async def start_for_node(self, request: RemoteSpawn, transport: TransportOptions) -> Child:
        """A node's half of ``spawn(node=...)``: start the actor asked for as this process's
        own child, under the requester's transport settings (`runtime._nodes`)."""
        how = request.how
        if how.start is not None:
            check_start(how.start, "RemoteSpawn(")
        how = msgspec.structs.replace(how, inherit=(), node=None).over(self.defaults)
        return await self._in_own_process(request.target, how, transport, request.root)


#: Seconds a dead in-process actor's replies to this process have to be read before its
#: death is recorded (a round trip through this process's own reply inbox).
_REPLIES_READ_WITHIN = 1.0


class _Start:
    """How an in-process spawn meets its actor's task: ``done`` once ``on_start``
    returned or the actor ended first (``error`` then says why); ``abandoned`` once the
    spawner gave up waiting."""

    __slots__ = ("abandoned", "done", "error")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.error: SpawnError | None = None
        self.abandoned = False


async def _exited(child: Child, timeout: float) -> None:
    """Until ``child`` has exited, or for ``timeout`` seconds."""
    with anyio.move_on_after(timeout):
        await child.exited.wait()


def _resolved(seconds: float | None) -> float:
    """A timeout that `SpawnOptions.over` filled in from the system's defaults."""
    assert seconds is not None
    return seconds


def _local_down(child: Child, ending: Ending | None, abandoned: bool) -> Down:
    """The ``Down`` of an in-process actor that had started, from how it ended."""
    ref = child.ref
    if ending is None and abandoned:  # started as its spawner gave up: nobody has its ref
        return Down(ref=ref, cause=Cause.CANCELLED, reason=SPAWN_GIVEN_UP)
    if ending is None and child.unresponsive:  # killed (`ActorSystem.kill`)
        return Down(ref=ref, cause=Cause.CANCELLED, reason=child.unresponsive)
    if ending is None and child.escalated:  # cancelled by the stop's escalation
        return Down(ref=ref, cause=Cause.CANCELLED, reason="cancelled: it did not stop in time")
    if ending is None:  # cancelled with the task that opened its system
        return Down(ref=ref, cause=Cause.CANCELLED, reason=CANCELLED_WITH_SYSTEM)
    if ending.error is None:
        return Down(ref=ref, cause=Cause.NORMAL, reason="normal")
    err = sole_error(ending.error)
    logger.error("in-process actor %s crashed", ref.name, exc_info=err)
    return Down(
        ref=ref,
        cause=Cause.EXCEPTION,
        reason=f"exception: {type(err).__module__}.{type(err).__qualname__}: {err}",
    )
