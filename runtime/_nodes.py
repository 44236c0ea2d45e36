"""Nodes: actor systems on other hosts that start actors for the system they belong to.

A system over CURVE tcp has one *root* (the process that opened it) and any number of
*nodes*: processes started on other hosts (``python -m runtime node``, or by a placement
engine) with the system's keys and the root's address. A node joins the root (JOIN),
which keeps the system's list of nodes (NODES); anyone in the system may then ask a node to
start an actor (SPAWN), and the actor runs as the node's own child: the node sees its death
from the process itself and reports it, exit status and signal included, to every watcher.

Liveness across hosts is one mechanism, the heartbeat of `runtime._heartbeat`: a process that
watches refs owned by another process pings it every eighth of ``heartbeat``, and one silent
for 0.8 of it is lost, so a loss is known within one ``heartbeat``: its actors are
``Down`` with `Cause.NOCONNECTION` and their pending asks fail. The node side holds a *lease*
for each process it started actors for: a watchdog thread (it works even while the node's
loop is stuck) kills those actors once their requester has not pinged for 0.6 of its
heartbeat, so they are dead before the requester counts them lost and restarts them
elsewhere. A node cut off from the network thus never serves a stale incarnation when it
comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec

from ._errors import AskTimeoutError, RemoteActorError, SpawnError, TokenyardError
from ._heartbeat import BEATS
from ._protocol import (
    Down,
    Header,
    Kind,
    NodeHello,
    NodeInfo,
    NodeList,
    RemoteSpawn,
    RemoteSpawned,
    body_encoder,
    hello_decoder,
    kill_decoder,
    nodes_decoder,
    spawn_decoder,
    spawned_decoder,
)
from ._throttle import Throttle
from ._transport import TransportOptions

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from ._children import Child
    from ._station import Station

logger = logging.getLogger("tokenyard.nodes")
_encode = body_encoder.encode
_options_decoder = msgspec.msgpack.Decoder(TransportOptions)
#: A lease ends when its requester has not pinged for this share of its heartbeat: its
#: actors are dead before the requester counts the node lost (after 0.8 of it), even when
#: the last ping got through and its answer did not (one ping interval, 1/8, later), with
#: the watchdog's tick (1/20) to spare.
LEASE_SHARE = 0.6
#: Most nodes one root keeps (a JOIN past it is refused).
MAX_NODES = 4_096


class NodeSystem(Protocol):
    """What this module needs of the system it serves (an open ``ActorSystem``)."""

    options: TransportOptions
    node_table: NodeTable | None

    @property
    def station(self) -> Station: ...

    @property
    def root_address(self) -> str: ...

    def start_task(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None: ...

    def child_at(self, address: str) -> Child | None: ...

    async def start_remote_child(
        self, request: RemoteSpawn, options: TransportOptions
    ) -> Child: ...


# -- the requester's side -------------------------------------------------------------------


async def find_node(system: NodeSystem, name: str, timeout: float) -> NodeInfo:
    """The node named ``name``, as the system's root knows it now.

    Raises:
        SpawnError: The root knows no such node, or did not answer.
    """
    for info in (await list_nodes(system, timeout)).nodes:
        if info.name == name:
            return info
    raise SpawnError(f"the system has no node named {name!r} (is it started and joined?)")


async def list_nodes(system: NodeSystem, timeout: float) -> NodeList:
    """The system's nodes, from its root (this process's table when it is the root)."""
    table = system.node_table
    if table is not None:
        return table.listing()
    try:
        body = await system.station.request(system.root_address, Kind.NODES, b"", timeout)
    except (AskTimeoutError, RemoteActorError) as err:
        raise SpawnError(f"the system's root did not list its nodes: {err}") from err
    return nodes_decoder.decode(body)


async def spawn_on(
    system: NodeSystem, info: NodeInfo, request: RemoteSpawn, timeout: float
) -> RemoteSpawned:
    """Ask node ``info`` to start an actor; its answer.

    Raises:
        SpawnError: The node refused, failed to start it, or did not answer in time.
    """
    station = system.station
    lost = asyncio.Event()
    on_lost = _setter(lost)
    # A heartbeat with the node while it answers: a node lost meanwhile fails the spawn
    # within the heartbeat's bound, not at the end of the spawn's whole timeout. (Plain
    # tasks, not a task group: its errors would come wrapped in an ExceptionGroup.)
    station.heartbeat.link(info.address, on_lost)
    asking = asyncio.ensure_future(
        station.request(info.address, Kind.SPAWN, _encode(request), timeout)
    )
    watching = asyncio.ensure_future(lost.wait())
    body: bytes | None = None
    try:
        await asyncio.wait((asking, watching), return_when=asyncio.FIRST_COMPLETED)
        if asking.done():
            body = asking.result()
    except AskTimeoutError as err:
        raise SpawnError(
            f"node {info.name!r} did not start {request.target.name!r}: {err}"
        ) from err
    except RemoteActorError as err:
        raise SpawnError(
            f"node {info.name!r} could not start {request.target.name!r}: {err}"
        ) from err
    finally:
        asking.cancel()
        watching.cancel()
        station.heartbeat.unlink(info.address, on_lost)
    if body is None:  # the node was lost first
        raise SpawnError(
            f"node {info.name!r} did not start {request.target.name!r}: it was lost "
            "(no answer to the heartbeat)"
        )
    return spawned_decoder.decode(body)


# -- the root's side --------------------------------------------------------------------------


class NodeTable:
    """The root's list of the system's nodes: who joined, kept while each answers.

    A name belongs to one live node: a second node asking for it is refused until the
    first is lost (a node restarted on the same host joins again once its old process is).
    """

    def __init__(self, station: Station) -> None:
        self.station = station
        self.nodes: dict[str, NodeInfo] = {}
        #: Set (and replaced) whenever a node joins.
        self.joined = asyncio.Event()

    def listing(self) -> NodeList:
        """The nodes now."""
        station = self.station
        return NodeList(
            station.reply_address, list(self.nodes.values()), station.heartbeat.heartbeat
        )

    def on_frame(self, header: Header, body: bytes) -> None:
        """JOIN and NODES (the root answers nothing else of the node protocol)."""
        station = self.station
        if header.kind is Kind.NODES:
            station.answer(header, _encode(self.listing()))
            return
        if header.kind is not Kind.JOIN:
            station.answer_error(header, TokenyardError(f"the root does no {header.kind.name}"))
            return
        hello = hello_decoder.decode(body)
        held = self.nodes.get(hello.name)
        if held is not None and held.address != hello.address:
            station.answer_error(
                header,
                TokenyardError(
                    f"a node named {hello.name!r} is already in the system at {held.address}"
                ),
            )
            return
        if held is None and len(self.nodes) >= MAX_NODES:
            station.answer_error(
                header, TokenyardError(f"the system has {MAX_NODES} nodes already")
            )
            return
        if held is None:
            self.nodes[hello.name] = NodeInfo(hello.name, hello.address, hello.host)
            station.heartbeat.link(hello.address, self._lost)
            logger.info("node %s joined from %s (pid %d)", hello.name, hello.host, hello.pid)
            self.joined.set()
            self.joined = asyncio.Event()
        station.answer(header, _encode(self.listing()))

    def _lost(self, address: str) -> None:
        for name, info in list(self.nodes.items()):
            if info.address == address:
                del self.nodes[name]
                logger.warning("node %s (%s) is lost", name, info.host)

    def drop(self, name: str) -> None:
        """Forget the node ``name`` (its placement ended it)."""
        info = self.nodes.pop(name, None)
        if info is not None:
            self.station.heartbeat.unlink(info.address)


# -- the node's side --------------------------------------------------------------------------

#: Seconds between two log lines of a node that has not joined, at the least.
_UNJOINED_EVERY = 30.0


@dataclass
class _Lease:
    """The actors started for one requester, and when it last pinged."""

    bound: float
    heard: float
    children: dict[str, Child] = field(default_factory=dict)


class NodeService:
    """What makes an open system a node: it joins the root, starts and signals actors for
    the system, and keeps each requester's lease.

    Args:
        system: The node's own system (tcp with the system's keys, open).
        name: The node's name in the system.
        root: The root's reply inbox (its ``ActorSystem.address``).
    """

    def __init__(self, system: NodeSystem, name: str, root: str) -> None:
        self.system = system
        self.name = name
        self.root = root
        #: Called each time the node has joined (again).
        self.on_joined: Callable[[], None] | None = None
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        #: Wakes the watchdog (with `_lock`): a new lease, or the end.
        self._leased = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._root_pinged = 0.0

    async def run(self) -> None:
        """Join the root, and join again whenever it is lost, until cancelled."""
        system, station = self.system, self.system.station
        station.on_node_frame = self.on_frame
        station.heartbeat.on_ping = self._pinged
        self._watchdog = threading.Thread(
            target=self._watch_leases, name="tokenyard-leases", daemon=True
        )
        self._watchdog.start()
        hello = _encode(
            NodeHello(self.name, station.reply_address, system.options.tcp_host, os.getpid())
        )
        beat = system.options.heartbeat
        # Why it has not joined, said at once and then once in a while: a node that cannot
        # join is otherwise silent, and one that keeps being refused would flood its log.
        unjoined = Throttle(logger, every=max(4 * beat, _UNJOINED_EVERY))
        try:
            while True:
                try:
                    answer = await station.request(self.root, Kind.JOIN, hello, beat)
                except AskTimeoutError:
                    # Ask again (the wait was the pacing). A wrong address, a cut network
                    # and another system's key all look like this from here.
                    unjoined.warning(
                        "node %s: no answer from the root at %s: is it running, reachable "
                        "from here, and is this the system's own system.key? Asking again",
                        self.name,
                        self.root,
                    )
                    continue
                except RemoteActorError as err:
                    unjoined.warning(
                        "node %s: the root refused it: %s; asking again",
                        self.name,
                        err.remote_message,
                    )
                    await anyio.sleep(beat / 4)  # sync-ok: the pace of asking again
                    continue
                # The root's own address, as its pings name it: the one this node was given
                # may be spelled otherwise (a host name), and would never match them.
                # And the root's heartbeat, which paces its pings: judged by this node's own,
                # a root with a longer one seemed silent between two pings (the node joined
                # again and again), and one with a shorter one dropped this node after a
                # cut that this node took up to its own heartbeat to notice.
                root_beat = beat
                with contextlib.suppress(msgspec.DecodeError):
                    listing = nodes_decoder.decode(answer)
                    self.root = listing.root or self.root
                    root_beat = listing.heartbeat or beat
                lost = asyncio.Event()
                station.heartbeat.link(self.root, _setter(lost))
                self._root_pinged = time.monotonic()
                logger.info("node %s joined the system at %s", self.name, self.root)
                if self.on_joined is not None:
                    self.on_joined()
                # The root pings its nodes; one that stopped has dropped this node (it
                # counted it lost while this side still heard it): join again.
                while not lost.is_set() and time.monotonic() - self._root_pinged < root_beat:
                    with anyio.move_on_after(root_beat / BEATS):
                        await lost.wait()
                station.heartbeat.unlink(self.root)
                logger.warning("node %s lost the root: joining again", self.name)
        finally:
            with self._lock:
                self._stopping.set()
                self._leased.notify()
            station.on_node_frame = None
            station.heartbeat.on_ping = None

    def on_frame(self, header: Header, body: bytes) -> None:
        """SPAWN and KILL (from a loop callback)."""
        station = self.system.station
        if header.kind is Kind.SPAWN:
            request = spawn_decoder.decode(body)
            self.system.start_task(self._spawn, header, request)
        elif header.kind is Kind.KILL:
            kill = kill_decoder.decode(body)
            child = self.system.child_at(kill.address)
            if child is not None and child.process is not None:
                if kill.reason:
                    child.unresponsive = kill.reason
                child.process.signal(kill.signal)
            station.answer(header, b"")
        else:
            station.answer_error(header, TokenyardError(f"a node does no {header.kind.name}"))

    async def _spawn(self, header: Header, request: RemoteSpawn) -> None:
        station, requester = self.system.station, header.reply_to
        try:
            options = _options_decoder.decode(request.transport)
            options = msgspec.structs.replace(options, tcp_host=self.system.options.tcp_host)
            child = await self.system.start_remote_child(request, options)
        except BaseException as err:  # the requester hears of every failure
            station.answer_error(header, err)
            if not isinstance(err, Exception):
                raise
            return
        assert child.process is not None
        with self._lock:
            lease = self._leases.get(requester)
            if lease is None:
                lease = self._leases[requester] = _Lease(
                    options.heartbeat * LEASE_SHARE, time.monotonic()
                )
                self._leased.notify()  # its bound may be the shortest now
            lease.children[child.ref.address] = child
        station.deaths.on_death(child.ref.address, lambda down: self._ended(requester, down))
        station.answer(header, _encode(RemoteSpawned(child.ref.address, child.process.pid)))

    def _ended(self, requester: str, down: Down) -> None:
        with self._lock:
            lease = self._leases.get(requester)
            if lease is not None:
                lease.children.pop(down.ref.address, None)
                if not lease.children:
                    del self._leases[requester]

    def _pinged(self, address: str) -> None:
        if address == self.root:
            self._root_pinged = time.monotonic()
        lease = self._leases.get(address)
        if lease is not None:
            now = time.monotonic()
            # A lease that ran out is not renewed: only the watchdog was late (this process
            # stopped, or starved), and its requester counts these actors lost. Renewed by
            # the pings that waited out the stop, or by those of the root that this node
            # then joined again, they ran on for ever as ghosts of a restarted incarnation.
            if now - lease.heard <= lease.bound:
                lease.heard = now

    def _watch_leases(self) -> None:
        """The watchdog thread: end every actor whose requester went silent. It looks every
        twentieth of the shortest lease, or of this node's heartbeat: a requester whose
        heartbeat is shorter than the node's counts its actors lost sooner, and they must
        have ended by then."""
        own = self.system.options.heartbeat
        while True:
            with self._lock:
                tick = min([own, *(lease.bound for lease in self._leases.values())]) / 20
                self._leased.wait(tick)
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                expired = [
                    (requester, lease)
                    for requester, lease in self._leases.items()
                    if now - lease.heard > lease.bound
                ]
                for requester, _ in expired:
                    del self._leases[requester]
            for requester, lease in expired:
                for child in list(lease.children.values()):
                    process = child.process
                    if process is None or child.exited.is_set():
                        continue
                    child.lost = (
                        f"no word from {requester} for {now - lease.heard:.1f} s: ended by "
                        f"node {self.name} (noconnection)"
                    )
                    logger.warning("node %s: %s: %s", self.name, child.ref.name, child.lost)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGKILL)


def _setter(event: asyncio.Event) -> Callable[[str], None]:
    def set_it(_address: str) -> None:
        event.set()

    return set_it
