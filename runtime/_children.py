"""The children of one actor system: their records, their names, their deaths, and how a
stop escalates.

A graceful stop travels in-band (after every tell this process sent), then escalates:
a bounded wait, SIGTERM, a short grace, SIGKILL. A death is recorded once, whoever sees it
first (the monitor task, or a stop waiting on the process itself).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from ._errors import SpawnError, TokenyardError
from ._exit import reason_for_status
from ._protocol import Cause, Down, Kind, RemoteKill, body_encoder
from ._transport import ipc_path, remove_sockets_of

if TYPE_CHECKING:
    from ._cell import Cell
    from ._protocol import SpawnOptions
    from ._ref import ActorRef
    from ._spawn import ChildProcess
    from ._station import Station

logger = logging.getLogger("tokenyard.system")

#: The ``Down`` reason of an in-process actor cancelled with the task that opened its system.
CANCELLED_WITH_SYSTEM = "cancelled with its system's task"
#: The ``Down`` reason of an in-process actor whose spawn its caller gave up (cancelled, or
#: past its ``spawn_timeout``, which the caller is told).
SPAWN_GIVEN_UP = "cancelled: its spawn was given up"

#: Liveness probes in one ``stall_timeout``: each waits this share of it for its answer, and
#: as many in a row must find none before the child is killed.
_PROBES_PER_BOUND = 4

#: Seconds between SIGTERM and SIGKILL.
TERM_GRACE = 2.0


def _under(parent: str) -> str:
    """Whose children the name is among, as an error says it."""
    return "among the system's own children" if not parent else f"among those of {parent}"


def _exited(child: Child) -> bool:
    """Whether ``child``'s process has exited (perhaps not reaped yet), asked of the kernel
    without waiting or reaping."""
    process = child.process
    assert process is not None
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # not a child of this process: its monitor will say
        return False


class RemoteProcess:
    """An actor process that a node runs for this system, as `runtime._children` sees it.

    Its death comes from the node (a ``Down`` with the exit status and signal) or from the
    heartbeat (`Cause.NOCONNECTION`); signals go to the node, which sends them on.
    """

    def __init__(self, station: Station, node_address: str, node_name: str, pid: int, address: str):
        self.station = station
        self.node_address = node_address
        self.node_name = node_name
        self.pid = pid
        self.address = address
        self.down: asyncio.Future[Down] = asyncio.get_running_loop().create_future()

    def deliver(self, down: Down) -> None:
        """The actor's death, however it became known."""
        if not self.down.done():
            self.down.set_result(down)

    def signal(self, signum: int, reason: str = "") -> None:
        """Ask its node to signal it (from a loop callback: never waits)."""
        if not self.down.done() and not self.station.closed:
            body = body_encoder.encode(RemoteKill(self.address, int(signum), reason))
            self.station.notify(self.node_address, Kind.KILL, body)


@dataclass(eq=False)
class Child:
    """One child actor: in its own process (``process``), in a process a node on another
    host runs for it (``remote``), or in-process (``cell``).

    Attributes:
        how: The options it was started with, every default filled in (its
            ``shutdown_timeout``; its ``stall_timeout``, past which its process is killed as
            unresponsive, ``None``: never probed).
        parent: Address of the in-process actor that started it ('' for the system): when
            that actor ends, this child is stopped.
        unresponsive: Set when it was killed for not answering: the ``Down``'s reason.
        lost: Set when its node ended it for its requester's silence (`runtime._nodes`).
        escalated: Set when a stop past its ``shutdown_timeout`` cancelled it (in-process).
    """

    ref: ActorRef[Any]
    how: SpawnOptions
    process: ChildProcess | None = None
    token: int = 0
    station_address: str = ""
    oom_before: int | None = None
    cell: Cell | None = None
    scope: anyio.CancelScope | None = None
    down: Down | None = None
    parent: str = ""
    unresponsive: str = ""
    lost: str = ""
    escalated: bool = False
    remote: RemoteProcess | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def shutdown_timeout(self) -> float:
        """Seconds it gets to stop gracefully before SIGTERM."""
        assert self.how.shutdown_timeout is not None  # filled in from the system's
        return self.how.shutdown_timeout


class ChildTable:
    """The live children of one system, in start order.

    Args:
        station: The system's station, where deaths are published.
    """

    def __init__(self, station: Station) -> None:
        self.live: dict[str, Child] = {}
        self.station = station
        #: The names spawns of this system took, by the parent they were spawned under
        #: (the in-process actor that spawned, ``""`` for the system): the live child
        #: holding each, ``None`` while its spawn is under way (`claim`).
        self._names: dict[tuple[str, str], Child | None] = {}

    async def claim(self, parent: str, name: str) -> None:
        """Take ``name`` among the children of ``parent`` for a spawn, until the spawn fails
        (`settle`) or the child it started dies (`died`): a name is one live actor's among
        its parent's children, as a supervisor's child names are in Erlang/OTP, so that
        `ActorSystem.lookup` has one answer for a name used once in the tree. ``parent``
        is the in-process actor that spawns (``""``: the system itself); an actor process
        has a system of its own, whose spawns are its actor's children, so an in-process
        supervisor and one in a process scope their children's names alike.

        A holder this process knows to be dead frees it even before its record goes (a
        ``Down`` from its node reaches watchers first), and so does one whose process has
        exited, once reaped and recorded (a moment: it waits for nothing): whoever saw the
        death first may start the name again.

        Raises:
            SpawnError: A live child of ``parent``, or a spawn under way, has the name.
        """
        key = (parent, name)
        if key in self._names:
            holder = self._names[key]
            if holder is None:
                raise SpawnError(
                    f"cannot spawn actor {name!r}: another spawn of that name is under way "
                    f"{_under(parent)}; a name is one live actor's: wait for that spawn to "
                    "end, or choose another name"
                )
            if holder.process is not None and _exited(holder):
                await self.await_exit(holder)  # `died` frees the name
                return await self.claim(parent, name)  # as it is now: another may have it
            if not self.station.deaths.is_dead(holder.ref.address):
                raise SpawnError(
                    f"cannot spawn actor {name!r}: incarnation {holder.ref.incarnation} of "
                    f"it is alive ({holder.ref.address}) {_under(parent)}; a name is one "
                    "live actor's: stop it first (await system.stop(ref)), or choose another "
                    "name"
                )
        self._names[key] = None

    def holds(self, parent: str, name: str) -> bool:
        """Whether a live child of ``parent``, or a spawn under way, has ``name``."""
        return (parent, name) in self._names

    def settle(self, parent: str, name: str, ref: ActorRef[Any] | None) -> None:
        """The spawn that claimed ``name`` under ``parent`` ended: the child at ``ref`` holds
        it now, until it dies; nobody does when that child is dead already. A spawn that
        failed or was given up (``None``) leaves it to its child if that one still lives:
        an in-process actor whose ``on_start`` holds out against its cancellation past the
        spawn's wait is still ending, and the name is its until it has."""
        key = (parent, name)
        if ref is not None:
            child = self.live.get(ref.address)
        else:
            child = next(
                (
                    c
                    for c in self.live.values()
                    if c.ref.name == name and c.parent == parent and not c.exited.is_set()
                ),
                None,
            )
        if child is None:
            self._names.pop(key, None)
        else:
            self._names[key] = child

    def add(self, child: Child) -> None:
        """Record a started child."""
        self.live[child.ref.address] = child

    def get(self, address: str) -> Child | None:
        """The live child at ``address``."""
        return self.live.get(address)

    async def await_exit(self, child: Child) -> None:
        """Return once ``child`` is dead and recorded. For a process, this waits on the
        process itself rather than on the monitor task, which a cancelled caller's scope may
        have taken down with it (shutdown must still finish then)."""
        if child.remote is not None:
            # Its node says how it died (a kill's reason travels with the kill).
            # Shielded: a waiter that gives up (a stop's bounded wait) must not cancel
            # the one future every waiter shares.
            down = await asyncio.shield(child.remote.down)
            if not child.exited.is_set():
                self.died(child, down)
            return
        if child.process is None:
            await child.exited.wait()
            return
        code = await child.process.wait()
        path = ipc_path(child.ref.address)
        if path is not None:  # what a process killed by a signal could not remove
            remove_sockets_of(os.path.dirname(path), child.process.pid)
        if child.exited.is_set():
            return
        child.process.close()
        words = None
        if not self.station.closed:
            self.station.read_replies()
            words = self.station.deaths.take_last_words(child.token)
        cause, reason, signum = reason_for_status(code, words, child.oom_before)
        if child.unresponsive and cause is Cause.SIGNAL:
            cause, reason = Cause.UNRESPONSIVE, child.unresponsive
        if child.lost and cause is Cause.SIGNAL:
            cause, reason = Cause.NOCONNECTION, child.lost
        down = Down(ref=child.ref, cause=cause, reason=reason, exitcode=code, signal=signum)
        self.died(child, down)

    async def probe(self, child: Child) -> None:
        """Kill ``child``'s process when it leaves liveness probes unanswered for its
        ``stall_timeout`` (stopped, or its event loop blocked): stuck ends as dead does.

        A probe goes every quarter of the bound and waits a quarter for its answer; only a
        whole bound without any answer kills, so one probe or answer lost on a full queue
        never does, and only once `_PROBES_PER_BOUND` probes in a row had their whole wait
        in vain: when this process, or the whole machine, stood still past the bound (a
        virtual machine not scheduled for seconds), the probe that was waiting finds no
        answer, though the child had no time to give one; the next probes ask it again.
        """
        station, limit = self.station, child.how.stall_timeout
        assert limit is not None
        assert child.process is not None
        wait = limit / _PROBES_PER_BOUND
        missed = 0
        while not child.exited.is_set():
            sent = time.monotonic()
            if await station.ping(child.station_address, wait):
                missed, resume = 0, time.monotonic() + wait
            elif child.exited.is_set():
                return
            elif (missed := missed + 1) < _PROBES_PER_BOUND:
                resume = sent + wait  # a probe that failed at once waits out its quarter
            else:  # each probe took a quarter at least: a whole bound without an answer
                child.unresponsive = f"unresponsive for {limit:g} s (killed)"
                logger.warning("actor %s %s", child.ref.name, child.unresponsive)
                child.process.kill()
                return
            with anyio.move_on_after(resume - time.monotonic()):
                await child.exited.wait()

    def died(self, child: Child, down: Down) -> None:
        """Record a death: the ``Down``, the station's dead set, its watchers, a log line."""
        child.down = down
        child.exited.set()
        self.live.pop(child.ref.address, None)
        key = (child.parent, child.ref.name)
        if self._names.get(key) is child:
            del self._names[key]
        station = self.station
        if not station.closed:
            station.deaths.mark_dead(down)
            if child.station_address:
                station.deaths.owner_died(child.station_address, child.ref.name)
        if down.reason in (CANCELLED_WITH_SYSTEM, SPAWN_GIVEN_UP):
            # The host's own doing (its task cancelled: a Ctrl-C, a timeout), or its
            # caller's (which knows why it gave up), not a fault.
            logger.info("actor %s ended: %s", child.ref.name, down.reason)
        elif not down.normal:
            logger.warning("actor %s died: %s", child.ref.name, down.reason)

    async def stop(self, child: Child, timeout: float) -> Down:
        """Stop ``child``: in-band stop request, bounded wait, SIGTERM, SIGKILL."""
        if child.exited.is_set():  # dead already (an in-process one cancelled with its host)
            assert child.down is not None
            return child.down
        station = self.station
        deadline = time.monotonic() + timeout
        corr, acked = station.new_request(child.ref.address)
        try:
            with anyio.move_on_after(timeout):
                await station.send_control(child.ref.address, Kind.STOP, corr, timeout=timeout)
                await self._acked_or_exited(child, acked)
        except TokenyardError:
            logger.debug("stop request to %s failed", child.ref.name, exc_info=True)
        finally:
            station.drop_request(corr)
        remaining = max(deadline - time.monotonic(), 0.1)
        with anyio.move_on_after(remaining):
            await self.await_exit(child)
        if not child.exited.is_set():
            self._escalate(child, signal.SIGTERM)
            with anyio.move_on_after(TERM_GRACE):
                await self.await_exit(child)
        if not child.exited.is_set():
            self._escalate(child, signal.SIGKILL)
            await self.await_exit(child)
        assert child.down is not None
        return child.down

    async def _acked_or_exited(self, child: Child, acked: asyncio.Future[Any]) -> None:
        """Until ``child`` acknowledged its stop (raising why it could not), or exited
        first. A child can end without acknowledging (it crashed as it stopped); when the
        host's scope was cancelled (a Ctrl-C while a pipeline starts), no task watched for
        its death meanwhile, and its stop waited out the whole of its bound."""
        exiting = asyncio.ensure_future(self.await_exit(child))
        try:
            await asyncio.wait((acked, exiting), return_when=asyncio.FIRST_COMPLETED)
        finally:
            exiting.cancel()
        if exiting.done() and not exiting.cancelled():
            exiting.result()
            if acked.done() and not acked.cancelled():
                acked.exception()  # its death failed the request: no failure of the stop
            return
        acked.result()

    def _escalate(self, child: Child, signum: int) -> None:
        in_process = child.process is None and child.remote is None
        if in_process and child.escalated:
            return  # cancelled already: the cancellation is all there is to send it
        if in_process:
            child.escalated = True
        logger.warning(
            "actor %s did not stop in %g s: %s",
            child.ref.name,
            child.shutdown_timeout,
            "cancelling it" if in_process else f"sending {signal.Signals(signum).name}",
        )
        if child.process is not None:
            child.process.signal(signum)
        elif child.remote is not None:
            child.remote.signal(signum)
        elif child.scope is not None:
            child.scope.cancel()

    async def stop_all(self, parent: str | None = None) -> None:
        """Stop every child (of the in-process actor at ``parent`` only, when given), in
        reverse start order."""
        for child in reversed(list(self.live.values())):
            if parent is None or child.parent == parent:
                await self.stop(child, child.shutdown_timeout)
