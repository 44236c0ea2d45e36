"""``ActorSystem``: owns the zmq context, the private ipc directory and every child actor."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import shutil
import signal
import subprocess
import tempfile
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio
import anyio.abc
import msgspec

from ._auth import Keys, cookie_of
from ._cell import Cell, Ending, live
from ._credentials import Credentials, file_identity
from ._errors import (
    ActorDeadError,
    ActorNotFoundError,
    AskTimeoutError,
    ProtocolError,
    RemoteActorError,
    TokenyardError,
    sole_error,
    to_its_end,
)
from ._launcher import DEFAULT_START, FORK_SERVER, Launcher, check_start
from ._mailbox import Mailbox, MailboxStatistics
from ._message import Message
from ._metrics import REGISTRY
from ._nodes import NodeTable, list_nodes
from ._protocol import (
    DEFAULT_GATHER_TIMEOUT,
    DEFAULT_LOOKUP_TIMEOUT,
    NESTED_GATHER_SHARE,
    Down,
    ErrorBody,
    Header,
    Kind,
    LookupQuery,
    LookupReply,
    MetricsQuery,
    NodeInfo,
    ReadyBody,
    RemoteSpawn,
    SpawnOptions,
    StartMethod,
    body_encoder,
    lookup_decoder,
    lookup_reply_decoder,
    new_cookie,
)
from ._ref import ActorRef
from ._role import Role
from ._spawn import SpawnSpec, decode_arguments
from ._spawner import Spawner, enter_parent
from ._station import Station
from ._stats import ProcessMetrics, ProcessResources, SystemMetrics, now
from ._transport import TransportOptions, bind_pull, check_ipc_dir, ipc_path, raise_fd_limit
from ._watch import Watch

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Sequence
    from types import TracebackType

    from ._actor import Actor
    from ._children import Child


logger = logging.getLogger("tokenyard.system")

M = TypeVar("M", bound=Message)


class ActorSystem:
    """Owns a zmq context, a private ipc directory and every actor spawned through it.

    Use it as an async context manager; leaving it stops every child in reverse start order
    (stop request, bounded wait, SIGTERM, SIGKILL) and removes the directory. A small
    guardian process removes the directory too if this process is killed outright.

    Args:
        name: Name used in logs and socket names.
        transport: ``"ipc"`` (default) or ``"tcp"`` (encrypted and authenticated with
            CURVE: see ``keys``).
        tcp_host: Interface ``tcp`` mailboxes bind to.
        hwm: High-water mark of every send queue, in messages.
        rcvhwm: High-water mark of every mailbox's receive queue, in messages.
        max_message_size: Largest message accepted, in bytes.
        mailbox_bytes: Byte budget of each mailbox (read but not yet handled).
        send_timeout: Default seconds a ``tell`` waits on a full mailbox.
        spawn_timeout: Seconds a spawned actor has to become ready.
        shutdown_timeout: Default seconds a stopping actor has before SIGTERM.
        max_peers: Most outgoing sockets a process keeps open (fewer where its
            file-descriptor limit allows fewer: `runtime._transport.peer_limit`).
        peer_idle: Seconds an unused outgoing socket stays open.
        keys: The system's CURVE keys for tcp: a ``Keys``, or a directory holding (or
            receiving, mode 0600) a file named system.key; ``None`` generates a pair for
            this system.
        curve: Use CURVE on tcp (the default; off only to measure its cost).
        attach: Join the running system these credentials describe (`credentials`), as a
            member that owns nothing of it, instead of starting a system of its own; the
            transport settings above are then the system's.
        start: How actor processes start: ``"fork-server"`` (the default on Linux x86-64
            and arm64) forks each from a server process that imported the runtime, the
            ``preload`` modules and each actor's module once; ``"spawn"`` starts each in a
            fresh interpreter, for actors that need one. ``spawn(start=...)`` overrides it.
        preload: Modules the fork server imports before it forks anything: their
            module-level code runs once, there, and every actor process gets a copy of
            their globals. A module that starts a thread when imported is refused.
        eager_fork_server: Start the fork server (and its preloads) when the system opens,
            rather than on the first process spawn.
        port: Over tcp, the port of this process's reply inbox (`address`), where the
            system's nodes join; 0 (the default) takes any free one.
        heartbeat: Over tcp, seconds a process holding refs owned by another process (a
            node on another host) waits for any answer from it before its actors count as
            ``Down`` with `Cause.NOCONNECTION` (see docs/guides/multi-host.md); above 0,
            at most a day.
        root: The address of the system this one is a node of (``python -m runtime node``
            passes it); empty for a system of its own.

    Example:
        >>> async with ActorSystem() as system:
        ...     echo = await system.spawn(Echo, name="echo")
        ...     reply = await echo.ask(Ping(n=1))
    """

    def __init__(
        self,
        *,
        name: str = "system",
        transport: str = "ipc",
        tcp_host: str = "127.0.0.1",
        hwm: int = 1_000,
        rcvhwm: int = 64,
        max_message_size: int = 16 * 1024 * 1024,
        mailbox_bytes: int = 64 * 1024 * 1024,
        send_timeout: float = 10.0,
        spawn_timeout: float = 30.0,
        shutdown_timeout: float = 5.0,
        max_peers: int = 512,
        peer_idle: float = 60.0,
        keys: Keys | str | os.PathLike[str] | None = None,
        curve: bool = True,
        attach: Credentials | None = None,
        start: StartMethod = DEFAULT_START,
        preload: Sequence[str] = (),
        eager_fork_server: bool = False,
        port: int = 0,
        heartbeat: float = 5.0,
        root: str = "",
    ) -> None:
        if attach is not None:
            role = Role.attached_to(attach)
        elif root:
            role = Role.node_of(root, keys)
        else:
            role = Role.new_root(keys)
        self._setup(
            role,
            name,
            TransportOptions(
                hwm=hwm,
                rcvhwm=rcvhwm,
                max_message_size=max_message_size,
                mailbox_bytes=mailbox_bytes,
                send_timeout=send_timeout,
                transport=transport,
                tcp_host=tcp_host,
                max_peers=max_peers,
                peer_idle=peer_idle,
                curve=curve,
                heartbeat=heartbeat,
            ),
            SpawnOptions(
                spawn_timeout=spawn_timeout,
                shutdown_timeout=shutdown_timeout,
                start=check_start(start, "ActorSystem("),
            ),
            preload,
        )
        self._port = port
        self._eager_fork_server = eager_fork_server

    def _setup(
        self,
        role: Role,
        name: str,
        options: TransportOptions,
        defaults: SpawnOptions,
        preload: Sequence[str],
    ) -> None:
        """What every constructor does: the settings of ``role`` over this system's own."""
        self.name = name
        #: Which member of its system this is.
        self.role = role
        self.options: TransportOptions = role.transport or options
        self._port = 0
        self._eager_fork_server = False
        #: The root's list of the system's nodes (a tcp system's root only).
        self.node_table: NodeTable | None = None
        #: What a spawn that names no options takes.
        self.defaults = defaults
        assert defaults.spawn_timeout is not None
        assert defaults.shutdown_timeout is not None
        assert defaults.start is not None
        self.spawn_timeout: float = defaults.spawn_timeout
        self.shutdown_timeout: float = defaults.shutdown_timeout
        #: How this system starts actor processes, and its fork server (``.server``).
        self.launcher = Launcher(name, defaults.start, preload)
        self.ipc_dir = role.ipc_dir
        self.root_pid = role.root_pid or os.getpid()
        self._cookie = role.cookie or new_cookie()
        self._keys: Keys | None = None
        self._station: Station | None = None
        self._spawner: Spawner | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        #: The task that opened it: the one that may close it (`_check_closer`).
        self._opener: asyncio.Task[Any] | None = None
        self._cells: dict[str, Cell] = {}
        #: Lookups this process answers for those that ask it, searching or waiting to
        #: (`_answer_lookup`), and what lets `_LOOKUPS_AT_ONCE` search (made as it opens).
        self._lookups = 0
        self._lookup_slots: anyio.Semaphore | None = None
        #: The write end of the guardian's pipe (-1: none).
        self._guardian = -1
        #: Files `save_credentials` wrote, each with its guardian's pipe and its identity.
        self._saved: dict[str, tuple[int, str]] = {}
        self.closing = False

    @classmethod
    def _of_actor_process(cls, spec: SpawnSpec) -> ActorSystem:
        """The system of an actor process: it shares its root's directory, never owns it."""
        system = cls.__new__(cls)
        assert spec.defaults.start is not None
        system._setup(
            Role.actor_process(spec),
            spec.target.name,
            spec.options,
            msgspec.structs.replace(
                spec.defaults, start=check_start(spec.defaults.start, "SpawnSpec(")
            ),
            spec.preload,
        )
        return system

    @property
    def address(self) -> str:
        """This process's reply inbox: over tcp, where the system's nodes join its root."""
        return self.station.reply_address

    @property
    def root_address(self) -> str:
        """The reply inbox of the system's root (this process's own when it is the root)."""
        return self.role.root or self.station.reply_address

    @property
    def nodes_root(self) -> str:
        """The root's reply inbox when the system has nodes, where an actor's own
        ``spawn(node=...)`` resolves names; '' otherwise."""
        return self.role.root or (self.station.reply_address if self.node_table else "")

    @property
    def keys(self) -> Keys | None:
        """The system's CURVE keys (tcp only; ``None`` until it opens)."""
        return self._keys

    @property
    def spawner(self) -> Spawner:
        """How this system starts its children, and their records."""
        if self._spawner is None:
            raise TokenyardError("the actor system is not open: use `async with ActorSystem()`")
        return self._spawner

    @property
    def station(self) -> Station:
        """The per-process sockets of this system."""
        if self._station is None:
            raise TokenyardError("the actor system is not open: use `async with ActorSystem()`")
        return self._station

    def bound_paths(self) -> list[str]:
        """The ipc socket files this process bound for this system."""
        addresses = [self.station.reply_address, *self._cells]
        return [p for p in map(ipc_path, addresses) if p is not None]

    def credentials(self, collector: ActorRef[Any] | None = None) -> Credentials:
        """What another process of this user needs to join this system
        (``ActorSystem(attach=...)``); `Credentials.save` writes them to a 0600 file.

        Args:
            collector: The system's `MetricsCollector`, for a client that watches it
                (``python -m runtime top``).

        Raises:
            TokenyardError: The system is not open.
        """
        station = self.station
        return Credentials(
            ipc_dir=self.ipc_dir,
            cookie=station.cookie,
            options=self.options,
            root_pid=self.root_pid,
            keys=station.keys,
            collector=collector,
            issuer=station.reply_address,
        )

    def save_credentials(
        self, path: str | os.PathLike[str], collector: ActorRef[Any] | None = None
    ) -> None:
        """Write `credentials` to ``path`` (mode 0600) for as long as this system lives: the
        file is removed when the system closes, or when its process dies, however it dies
        (a guardian process waits on this one, as for the ipc directory).

        Raises:
            TokenyardError: The system is not open.
            OSError: The file could not be written.
        """
        path = os.path.abspath(os.fspath(path))
        identity = self.credentials(collector).save(path)
        guardian = _start_guardian(path, directory=False, identity=identity)
        old = self._saved.pop(path, None)
        if old is not None:
            os.close(old[0])
        self._saved[path] = (guardian, identity)

    def _resolve_keys(self) -> Keys | None:
        if self.options.transport != "tcp" or not self.options.curve:
            return None
        source = self.role.keys
        if isinstance(source, Keys):
            return source
        if source is None:
            return Keys.new()
        return Keys.load(source)

    async def __aenter__(self) -> ActorSystem:
        if self._station is not None and not self._station.closed:
            # Opened again, it made a second directory and station over the first, which
            # nothing could close any more: the first directory outlived the system.
            raise TokenyardError(
                f"ActorSystem {self.name!r} is open already: enter it once (`async with`), "
                "and use the system it gave; a second system is a new ActorSystem()"
            )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            # Under anyio's trio backend, say so before anything is made (it failed in the
            # middle, leaving the directory, the sockets and libzmq's threads behind).
            raise TokenyardError(
                "an ActorSystem runs on an asyncio event loop, and none runs here: anyio's "
                "trio backend is not supported (run anyio on asyncio, its default)"
            ) from None
        role = self.role
        # Each child process, and each process that asks or tells this one, connects to its
        # reply inbox: a descriptor each, and libzmq aborts a process whose listener cannot
        # accept one (a root at the common soft limit of 1,024 did at about 330 children).
        raise_fd_limit()
        if role.owns_dir:
            # Created 0700; the pid in the name tells whose it is.
            self.ipc_dir = tempfile.mkdtemp(prefix=f"tokenyard-{os.getpid()}-")
            self._guardian = _start_guardian(self.ipc_dir)
        try:
            if self.options.transport == "ipc":
                check_ipc_dir(self.ipc_dir)
            self._keys = self._resolve_keys()
            if self._keys is not None and role.owns_dir:
                self._cookie = cookie_of(self._keys)  # the same on every node
            self._station = Station(
                self.ipc_dir, self.options, self.name, self._cookie, self._keys, self._port
            )
        except BaseException:
            self._remove_dir()
            raise
        try:
            self._station.open()
            self._station.on_lookup = self._answer_lookup
            self._lookup_slots = anyio.Semaphore(self._LOOKUPS_AT_ONCE)  # this loop's
            self._spawner = Spawner(self, self.launcher, self.defaults)
            if self._keys is not None and role.keeps_nodes:
                self.node_table = NodeTable(self._station)
                self._station.on_node_frame = self.node_table.on_frame
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            self._opener = asyncio.current_task()
        except BaseException:
            self._station.close()
            self._remove_dir()
            raise
        if self._eager_fork_server and self.launcher.start == FORK_SERVER:
            self.launcher.open_server()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._station is not None and self._station.inherited:
            # A process forked inside `async with`, leaving it (a sys.exit): everything of
            # the system is its parent's, its station abandoned (`runtime._context`).
            return
        self._check_closer()
        self.closing = True
        try:
            # In a task of its own, to its end: a cancellation (asyncio's own passes a
            # shielded scope) must not leave children running and unreaped; it is raised
            # once everything below is done too.
            await to_its_end(self._stop_everything(graceful=exc_type is None))
        finally:
            assert self._tg is not None
            self._tg.cancel_scope.cancel()
            try:
                # It waits for every task it ends, then raises anyio's cancellation as the
                # host's own once asyncio's reached this task (a `Task.cancel`, however
                # long ago): the system must close all the same.
                await self._tg.__aexit__(None, None, None)
            finally:
                station = self.station
                station.close(self.options.linger_ms if self.role.in_actor_process else 0)
                self._remove_dir()

    async def _stop_everything(self, *, graceful: bool) -> None:
        """A close's stops: tells delivered (``graceful``), children stopped, the fork
        server reaped."""
        if graceful and not self.role.in_actor_process:
            await self.deliver_tells()
        if self._spawner is not None:
            await self._spawner.children.stop_all()
        await self.launcher.aclose()

    def _check_closer(self) -> None:
        """Refuse to close from any task but the one that opened the system, touching nothing.

        Its task group can only be left by the task that entered it: closed from another
        loop (a second ``asyncio.run``), cancelling its tasks spun for ever, as their loop
        does not run; from another task, it failed half way, its sockets open and its
        directory left.

        Raises:
            TokenyardError: This is not the task that opened it (it stays open).
        """
        opener = self._opener
        if opener is None or opener is asyncio.current_task():
            return
        loop = opener.get_loop()
        if opener.done() and not loop.is_closed():
            where = (
                "by a task that has ended since, and only that task could close it: its "
                "processes and its directory go when this process exits; open a system in "
                "the task that will close it (async with)"
            )
        elif loop.is_closed():
            where = (
                "in an event loop that has closed since (an asyncio.run that ended?), its "
                "in-process actors with it; its processes and its directory go when this "
                "process exits"
            )
        elif loop is not asyncio.get_running_loop():
            where = "in another event loop; close it there, from that task"
        else:
            where = "by another task; close it from that one"
        raise TokenyardError(
            f"cannot close ActorSystem {self.name!r} here: it was opened {where} "
            "(a system is closed by the task that opened it, as `async with` does)"
        )

    def _remove_dir(self) -> None:
        for path, (guardian, identity) in self._saved.items():
            if file_identity(path) == identity:  # not another system's, written over it
                with contextlib.suppress(OSError):
                    os.unlink(path)
            os.close(guardian)
        self._saved.clear()
        if not self.role.owns_dir:
            return
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        guardian, self._guardian = self._guardian, -1
        if guardian >= 0:
            os.close(guardian)

    # -- spawning -------------------------------------------------------------------------

    async def spawn(
        self, actor: type[Actor[M]], *args: Any, name: str | None = None, **kwargs: Any
    ) -> ActorRef[M]:
        """Start an actor and return its ref once its ``on_start`` has finished.

        Args:
            actor: The Actor subclass.
            *args: Positional arguments of its constructor (msgspec-encodable if it runs in
                a process).
            name: The actor's name (default: class name and a counter), one live actor's
                among the children of the one spawning (the system's own, from outside
                any actor): stop the actor holding it (`stop` returns once it is free)
                before starting the name again.
            **kwargs: How to start it, each a field of `SpawnOptions` (``process``,
                ``spawn_timeout``, ``shutdown_timeout``, ``stall_timeout``, ``inherit``,
                ``start``, ``node``; ``None`` or left out: the system's), and the keyword
                arguments of its constructor (every other keyword). With ``node``, its class
                must import on that node's host; it is still this system's child (`stop`,
                `kill`, `watch`, and its death ends as a local child's does).

        Raises:
            SpawnError: A live child of the same parent (or a spawn under way) has ``name``,
                arguments not encodable, import failure, ``on_start`` raised, the process
                died or did not become ready in time; for ``node``: no such node, or it did
                not answer.
            TypeError: ``actor`` is not an Actor subclass.
            ValueError: Options that rule each other out, or an unknown start method.
            MailboxClosedError: The system is closed, or runs in another event loop.
        """
        how, kwargs = SpawnOptions.take(kwargs)
        self.station.check_loop()
        return await self.spawner.spawn(actor, args, kwargs, name, how)

    async def start_remote_child(self, request: RemoteSpawn, options: TransportOptions) -> Child:
        """A node's half of ``spawn(node=...)`` (`Spawner.start_for_node`)."""
        return await self.spawner.start_for_node(request, options)

    def start_task(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``func(*args)`` in this system's task group (ended when the system closes)."""
        if self._tg is None:
            raise TokenyardError("the actor system is not open: use `async with ActorSystem()`")
        self._tg.start_soon(func, *args)

    def child_at(self, address: str) -> Child | None:
        """The live child whose mailbox is ``address``."""
        return self.spawner.children.get(address)

    async def wait_nodes(self, names: Sequence[str], timeout: float) -> None:
        """Return once every node in ``names`` has joined this system (its root only).

        Raises:
            TimeoutError: Some had not joined within ``timeout``.
            TokenyardError: This process is not the root of a tcp system with CURVE keys.
        """
        table = self.node_table
        if table is None:
            raise TokenyardError("only the root of a tcp system with keys keeps its nodes")
        wanted = {name for name in names if name}
        try:
            with anyio.fail_after(timeout):
                while not wanted <= table.nodes.keys():
                    await table.joined.wait()
        except TimeoutError:
            missing = sorted(wanted - table.nodes.keys())
            raise TimeoutError(f"nodes {missing} did not join in {timeout:g} s") from None

    async def nodes(self, timeout: float = 5.0) -> list[NodeInfo]:
        """The system's nodes now, as its root knows them (tcp with CURVE keys).

        Raises:
            SpawnError: The root did not answer.
        """
        return (await list_nodes(self, timeout)).nodes

    def make_cell(
        self,
        actor: type[Actor[Any]],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str,
        incarnation: int,
        owner: str = "",
    ) -> Cell:
        """Build an actor in this process and bind its mailbox (``on_start`` not run yet).

        ``owner`` is the reply address of the station that started it, where its death is
        known (default: this process's station, for an in-process actor); its own ``self.ref``
        then equals the ref its parent holds, and whoever gets it learns of its death.
        """
        decoder = Cell.decoder_for(actor)
        instance = actor(*args, **kwargs)
        station = self.station
        options = self.options
        sock, address = bind_pull(
            station.ctx, self.ipc_dir, station.new_stem("a"), options, station.keys
        )
        mailbox = Mailbox(
            sock,
            address,
            decoder,
            name,
            station.cookie,
            station.outbox.allows,
            options.mailbox_bytes,
            logging.getLogger("tokenyard.mailbox"),
        )
        instance.ref = ActorRef(name, address, incarnation, owner or station.reply_address)
        instance.system = self
        cell = Cell(instance, mailbox, station)
        self._cells[address] = cell
        return cell

    async def live(self, cell: Cell, on_ready: Callable[[], Awaitable[None]]) -> Ending:
        """Live the actor's life in ``cell`` (`runtime._cell.live`) as this system's member:
        what it spawns is its own, and stopped when it ends."""
        address = cell.mailbox.address
        enter_parent(address)
        children = self.spawner.children
        try:
            return await live(cell, on_ready, lambda: children.stop_all(parent=address))
        finally:
            self._cells.pop(address, None)

    # -- watching and stopping ------------------------------------------------------------

    def is_dead(self, ref: ActorRef[Any]) -> bool:
        """Whether this process has learned of ``ref``'s death (a watcher's ``Down`` may
        still be on its way to it)."""
        return self.station.deaths.is_dead(ref.address)

    def watch(self, ref: ActorRef[Any], *, notify: ActorRef[Down] | None = None) -> Watch:
        """Register interest in ``ref``'s death; ``await`` the result for its ``Down``.

        Works for any actor whose ref names its owner: a child of this system, or one
        started elsewhere (the station owning it reports the death here). Registration happens at
        once, so a death right after this call is not missed.

        Args:
            ref: The incarnation to watch.
            notify: Also tell this actor the ``Down`` as a message (how an actor watches:
                ``self.system.watch(ref, notify=self.ref)`` plus a ``Down`` handler).

        Raises:
            TokenyardError: ``ref`` names no owner and is not a child of this system.
            ProtocolError: ``ref`` is not of this system (another system's, or one that
                has closed): no death of it could ever be reported here.
            MailboxClosedError: The system is closed, or runs in another event loop.
        """
        station = self.station
        foreign = [a for a in (ref.address, ref.owner) if a and not station.policy.allows(a)]
        if foreign:
            # Its WATCH could not be sent, and the watch waited for a Down for ever.
            raise ProtocolError(
                f"cannot watch actor {ref.name!r}: {foreign[0]!r} is not an address of this "
                "actor system (the ref is another system's, or of one that has closed); "
                "watch it through the system that started it"
            )
        fut: asyncio.Future[Down] = station.check_loop().create_future()
        if (
            ref.address not in self.spawner.children.live
            and not ref.owner
            and not station.deaths.is_dead(ref.address)
        ):
            raise TokenyardError(
                f"cannot watch actor {ref.name!r}: its ref names no owner and it is not a "
                "child of this system"
            )

        def deliver(down: Down) -> None:
            if fut.done():
                return
            if down.ref != ref:
                down = Down(
                    ref=ref,
                    cause=down.cause,
                    reason=down.reason,
                    exitcode=down.exitcode,
                    signal=down.signal,
                )
            fut.set_result(down)
            if notify is not None and self._tg is not None:
                self._tg.start_soon(self._tell_down, notify, down)

        station.deaths.on_death(ref.address, deliver)
        station.deaths.subscribe(ref)
        return Watch(fut, functools.partial(station.deaths.forget, ref.address, deliver))

    async def _tell_down(self, notify: ActorRef[Down], down: Down) -> None:
        try:
            await notify.tell(down)
        except TokenyardError as err:
            logger.debug("could not tell %s of %s's death: %s", notify.name, down.ref.name, err)

    async def stop(self, ref: ActorRef[Any], timeout: float | None = None) -> Down:
        """Stop an actor gracefully, escalating to SIGTERM and SIGKILL if it does not stop.

        Everything this process told the actor before ``stop`` is handled first.

        Returns:
            The actor's ``Down``.

        Raises:
            ActorDeadError: It was already dead.
            MailboxClosedError: The system is closed, or runs in another event loop.
        """
        self.station.check_loop()
        child = self.spawner.children.get(ref.address)
        if child is None:
            if self.station.deaths.is_dead(ref.address):
                raise ActorDeadError(f"actor {ref.name!r} is already dead")
            raise ActorDeadError(
                f"actor {ref.name!r} is not a child of this system: stop it through the "
                "system or supervisor that started it"
            )
        return await self.spawner.children.stop(
            child, child.shutdown_timeout if timeout is None else timeout
        )

    async def kill(self, ref: ActorRef[Any], reason: str) -> Down:
        """End a child at once, without a graceful stop: SIGKILL its process (or cancel an
        in-process one). For a process, the ``Down`` has `Cause.UNRESPONSIVE` and ``reason``:
        this is how a supervisor ends a child that is alive but stuck.

        Raises:
            ActorDeadError: It is dead already, or not a child of this system.
            MailboxClosedError: The system is closed, or runs in another event loop.
        """
        self.station.check_loop()
        child = self.spawner.children.get(ref.address)
        if child is None:
            raise ActorDeadError(f"actor {ref.name!r} is not a live child of this system")
        if child.process is not None:
            child.unresponsive = reason
            child.process.kill()
        elif child.remote is not None:
            child.remote.signal(signal.SIGKILL, reason)  # its node makes it UNRESPONSIVE
        elif child.scope is not None:
            child.unresponsive = reason
            child.scope.cancel()
        await self.spawner.children.await_exit(child)
        assert child.down is not None
        return child.down

    async def deliver_tells(self, skip: Sequence[str] = ()) -> None:
        """Wait, up to ``shutdown_timeout``, until every actor this process told has handled
        what it was told; children are skipped (their in-band stop does the same).

        A graceful exit does this, so that no accepted ``tell`` is lost with the process.
        """
        late = await self.station.flush(self.shutdown_timeout, {*skip, *self.spawner.children.live})
        for address in late:
            logger.warning(
                "%s: the mailbox at %s did not take its tells within shutdown_timeout=%g s; "
                "what it had not taken is lost",
                self.name,
                address,
                self.shutdown_timeout,
            )

    # -- introspection --------------------------------------------------------------------

    @overload
    async def lookup(
        self, name: str, *, timeout: float = ..., missing_ok: Literal[False] = ...
    ) -> ActorRef[Any]: ...

    @overload
    async def lookup(
        self, name: str, *, timeout: float = ..., missing_ok: bool
    ) -> ActorRef[Any] | None: ...

    async def lookup(
        self, name: str, *, timeout: float = DEFAULT_LOOKUP_TIMEOUT, missing_ok: bool = False
    ) -> ActorRef[Any] | None:
        """The ref of the live incarnation named ``name``, anywhere under this system.

        Children of this system answer first; then each child process is asked about its
        own children (a supervisor's), depth first. After a restart the name resolves to the
        new incarnation. A system attached to another (``attach=``) then asks the one whose
        credentials it joined with, which looks under itself the same way.

        Raises:
            ActorNotFoundError: Nobody live has that name (unless ``missing_ok``): every
                process asked answered.
            AskTimeoutError: Nobody that answered has that name, and some process under
                this system (or the system it is attached to) did not answer in time, was
                too busy, or failed to search: the actor may be there. Raised whatever
                ``missing_ok`` says, which is about a name that is missing.
        """
        deadline = anyio.current_time() + timeout
        children = list(self.spawner.children.live.values())
        for child in reversed(children):  # the newest incarnation of a name wins
            if child.ref.name == name:
                return child.ref
        asked = [c for c in children if c.process is not None or c.remote is not None]
        answers: list[ActorRef[Any] | None] = [None] * len(asked)
        answered = [False] * len(asked)
        #: The processes asked that did not search, each with why.
        unsearched: list[str] = []
        live = self._still_live

        def settled() -> bool:
            """Whether the answer is known: every child before the first that named a ref
            has answered (or every child has, naming none)."""
            for done, ref in zip(answered, answers, strict=True):
                if not done:
                    return False
                if ref is not None:
                    return True
            return True

        async def ask(i: int, child: Child, scope: anyio.CancelScope) -> None:
            try:
                answers[i] = await self._lookup_in(child, name, timeout)
            except ActorDeadError:  # dead or dying: no live answer there
                pass
            except TokenyardError as err:  # no answer in time, too busy, or failed
                if live(child):  # one that died meanwhile had no live actor to give
                    unsearched.append(f"{child.ref.name}: {_why(err)}")
            answered[i] = True
            if settled():
                scope.cancel()

        # Every child process at once, each answering from its reply inbox (not behind
        # what its actors are busy with); the first in start order that knows wins.
        with anyio.move_on_after(timeout) as scope:
            async with anyio.create_task_group() as tg:
                for i, child in enumerate(asked):
                    tg.start_soon(ask, i, child, scope)
        found = next((ref for ref in answers if ref is not None), None)
        if found is None:
            unsearched += [
                f"{child.ref.name}: no answer in {timeout:.3g} s"
                for child, done in zip(asked, answered, strict=True)
                if not done and live(child)
            ]
        issuer = self.role.issuer
        if found is None and issuer:
            left = deadline - anyio.current_time()
            try:
                if left <= 0:
                    raise AskTimeoutError(f"no time left of {timeout:.3g} s")
                found = await self._lookup_at(issuer, name, left)
            except TokenyardError as err:  # gone, too busy or too slow: not searched
                unsearched.append(f"the system it is attached to: {_why(err)}")
        if found is not None:
            return found
        if unsearched:
            raise AskTimeoutError(
                f"no actor named {name!r} where system {self.name!r} could look, and "
                f"{len(unsearched)} did not search ({'; '.join(unsearched[:3])}"
                f"{'; ...' if len(unsearched) > 3 else ''}): it may be there"
            )
        if missing_ok:
            return None
        where = f"system {self.name!r}" + (" nor in the system it is attached to" if issuer else "")
        raise ActorNotFoundError(f"no live actor named {name!r} under {where}")

    def _still_live(self, child: Child) -> bool:
        """Whether ``child`` is still this incarnation of a live child of this system."""
        return self.spawner.children.live.get(child.ref.address) is child

    async def _lookup_in(self, child: Child, name: str, timeout: float) -> ActorRef[Any] | None:
        """Ask a child process (its system) for the live actor named ``name`` under it."""
        if child.station_address:
            return await self._lookup_at(child.station_address, name, timeout)
        # On another node: its process's inbox is not known here, its mailbox is.
        query = LookupQuery(name=name, timeout=timeout * NESTED_GATHER_SHARE)
        reply = await self.station.ask_control(child.ref, Kind.LOOKUP, timeout, query)
        return reply.ref if isinstance(reply, LookupReply) else None

    async def _lookup_at(self, inbox: str, name: str, timeout: float) -> ActorRef[Any] | None:
        """Ask the system whose reply inbox is ``inbox`` for the live actor named ``name``
        under it."""
        body = body_encoder.encode(LookupQuery(name=name, timeout=timeout * NESTED_GATHER_SHARE))
        answer = await self.station.request(inbox, Kind.LOOKUP, body, timeout)
        return lookup_reply_decoder.decode(answer).ref

    #: Lookups this process runs at once for the systems that ask it (its parent, attached
    #: clients), and how many more wait for one of them to end, each within its own time;
    #: past both, the next is refused.
    _LOOKUPS_AT_ONCE = 64
    _LOOKUPS_WAITING = 1_024

    def _answer_lookup(self, header: Header, body: bytes) -> None:
        """A LOOKUP on this process's reply inbox: the live actor named in it, under this
        system, answered from a task of its own (never behind an actor's handler)."""
        slots = self._lookup_slots  # made with the task group, as the system opens
        if (
            self._tg is None
            or slots is None
            or self._lookups >= self._LOOKUPS_AT_ONCE + self._LOOKUPS_WAITING
        ):
            busy = (
                f"too many lookups at once ({self._LOOKUPS_AT_ONCE} searching and "
                f"{self._LOOKUPS_WAITING} waiting)"
            )
            self.station.answer_error(header, TokenyardError(busy))
            return
        try:
            query = lookup_decoder.decode(body)
        except msgspec.DecodeError as err:
            self.station.answer_error(header, err)
            return
        self._lookups += 1
        self._tg.start_soon(self._lookup_for, header, query.name, query.search_time(), slots)

    async def _lookup_for(
        self, header: Header, name: str, timeout: float, slots: anyio.Semaphore
    ) -> None:
        deadline = anyio.current_time() + timeout
        try:  # counted until it ends, however it ends (the system's close included)
            try:
                with anyio.fail_after(timeout):
                    await slots.acquire()
            except TimeoutError:
                busy = f"no search began in {timeout:.3g} s: {self._LOOKUPS_AT_ONCE} others ran"
                self.station.answer_error(header, AskTimeoutError(busy))
                return
            try:
                left = max(deadline - anyio.current_time(), 0.0)
                found = await self.lookup(name, timeout=left, missing_ok=True)
            except AskTimeoutError as err:  # the asker's search is incomplete too
                self.station.answer_error(header, err)
                return
            finally:
                slots.release()
        finally:
            self._lookups -= 1
        self.station.answer(header, body_encoder.encode(LookupReply(ref=found)))

    def child_pids(self) -> list[int]:
        """The process ids of this system's live child actor processes."""
        return [c.process.pid for c in self.spawner.children.live.values() if c.process is not None]

    def pid_of(self, ref: ActorRef[Any]) -> int | None:
        """The process id of a child of this system (None if it runs in-process or died);
        for one on another node, its pid there (see `node_of`)."""
        child = self.spawner.children.get(ref.address)
        if child is None:
            return None
        if child.remote is not None:
            return child.remote.pid
        return None if child.process is None else child.process.pid

    def node_of(self, ref: ActorRef[Any]) -> str | None:
        """The name of the node a live child runs on (None: this host, or not a child)."""
        child = self.spawner.children.get(ref.address)
        return None if child is None or child.remote is None else child.remote.node_name

    async def statistics(self, ref: ActorRef[Any], timeout: float = 5.0) -> MailboxStatistics:
        """The mailbox counters of an actor, in this process or another."""
        cell = self._cells.get(ref.address)
        if cell is not None:
            return cell.mailbox.statistics()
        result = await self.station.ask_control(ref, Kind.STATS, timeout)
        assert isinstance(result, MailboxStatistics)
        return result

    # -- metrics (a hook of its own: nothing of the spawn path) ---------------------------

    def process_metrics(self) -> ProcessMetrics:
        """What this process measured: its resources, its actors of this system, its asks
        and the series its code added (`runtime.metrics`)."""
        station = self.station
        return ProcessMetrics(
            name=self.name,
            station=station.reply_address,
            process=ProcessResources.read(),
            actors=[cell.metrics() for cell in list(self._cells.values())],
            asks=station.ask_statistics(),
            families=REGISTRY.snapshot(),
            gathered_at=now(),
        )

    async def gather_metrics(self, timeout: float | None = None) -> SystemMetrics:
        """The statistics of this process and of every actor process under this system,
        theirs included (each is asked, all at once; one that does not answer in
        ``timeout`` seconds, 5 by default, is left out, and gives the processes under it
        three quarters of that).

        Raises:
            ValueError: ``timeout`` is not a finite number of seconds above 0.

        Returns:
            This process first, then the others, depth first.
        """
        if timeout is None:
            timeout = DEFAULT_GATHER_TIMEOUT
        elif not 0 < timeout < math.inf:  # NaN included
            raise ValueError(f"timeout={timeout}: need a finite number of seconds above 0")
        query = MetricsQuery(timeout=timeout * NESTED_GATHER_SHARE)
        started = now()
        children = [
            c
            for c in self.spawner.children.live.values()
            if c.process is not None or c.remote is not None
        ]
        answers: list[list[ProcessMetrics]] = [[] for _ in children]

        async def ask(i: int, child: Child) -> None:
            try:
                reply = await self.station.ask_control(child.ref, Kind.METRICS, timeout, query)
            except TokenyardError:
                return  # it died or is busy dying: nothing to report of it
            if isinstance(reply, SystemMetrics):
                answers[i] = reply.processes

        async with anyio.create_task_group() as tg:
            for i, child in enumerate(children):
                tg.start_soon(ask, i, child)
        processes = [self.process_metrics()]
        for found in answers:
            processes += found
        return SystemMetrics(processes=processes, gathered_at=started)


async def run_actor_process(
    spec: SpawnSpec, cls: type | BaseException, on_bound: Callable[[ActorSystem], None]
) -> int:
    """The life of an actor process's system, the one entry `runtime._child` has: open it,
    build the actor ``spec`` asks for (``cls``, or why it could not be imported), report it
    ready to the parent, serve until it ends, and say how (last words before exiting 1).

    Args:
        spec: What the parent asked for.
        cls: The actor class, or the error its import raised (reported as a failed spawn).
        on_bound: Called with the system once it is open and again once the actor's
            mailbox is bound (the process removes those files if a signal ends it).

    Returns:
        The process's exit status: 0 after a graceful stop, 1 after a failure.
    """
    from ._actor import Actor

    system = ActorSystem._of_actor_process(spec)
    target = spec.target

    async def report_failure(err: BaseException) -> None:
        body = body_encoder.encode(ErrorBody.of(err))
        await system.station.send_control(spec.parent_reply, Kind.FAILED, spec.token, body)

    async with system:
        on_bound(system)
        try:
            if isinstance(cls, BaseException):
                raise cls
            if not issubclass(cls, Actor):
                raise TypeError(f"{target.actor} is not an Actor class")
            args, kwargs = decode_arguments(cls, target.args, target.kwargs)
            cell = system.make_cell(
                cls, args, kwargs, target.name, target.incarnation, owner=spec.parent_reply
            )
        except Exception as err:  # noqa: BLE001 - reported to the parent as a SpawnError
            await report_failure(err)
            return 1
        on_bound(system)

        async def on_ready() -> None:
            ready = ReadyBody(cell.mailbox.address, os.getpid(), system.station.reply_address)
            await system.station.send_control(
                spec.parent_reply, Kind.READY, spec.token, body_encoder.encode(ready)
            )

        ending = await system.live(cell, on_ready)
        if ending.error is not None:  # the actor crashed: say why, then exit 1
            cause = sole_error(ending.error)
            logging.getLogger("tokenyard.child").error(
                "actor %s %s",
                target.name,
                "crashed" if ending.started else "failed to start",
                exc_info=cause,
            )
            # Before ready, this fails the spawn; after, these are the actor's last words,
            # which its parent puts in the Down reason.
            await report_failure(cause)
            return 1
        system.closing = True
        await system.deliver_tells(skip=[cell.mailbox.address])
        if ending.stop is not None:
            await system.station.reply(ending.stop, None)
    return 0


def _start_guardian(path: str, *, directory: bool = True, identity: str = "") -> int:
    """Start a tiny process that removes ``path`` once this one is gone, however it goes.

    It waits for EOF on a pipe only this process holds the write end of, which the kernel
    closes when this process ends; then it removes the directory or file (already gone
    after a clean exit); a file with an ``identity`` (`file_identity`) only if it is still
    that file. It is detached (the shell that starts it exits at once and is
    reaped here), so it is nobody's child and in a process group of its own: a terminal's
    Ctrl-C does not end it early, and it never shows among this process's children.

    Returns:
        The write end of the pipe: close it to let the guardian go.
    """
    read, write = os.pipe()
    try:
        shell = subprocess.Popen(
            [
                "/bin/sh",
                "-c",
                # The pipe arrives as stdin and moves to fd 3: a POSIX shell redirects only
                # single-digit descriptors, and gives a background job /dev/null for stdin.
                "exec 3<&0 </dev/null; "
                "(cat <&3 >/dev/null; "
                + (
                    'if [ "$(stat -c %d:%i -- "$1" 2>/dev/null)" = "$2" ]; then rm -f -- "$1"; fi'
                    if identity
                    else f'rm -{"rf" if directory else "f"} -- "$1"'
                )
                + ") &",
                "guardian",
                path,
                identity,
            ],
            stdin=read,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            process_group=0,
        )
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    shell.wait()
    return write


def _why(err: TokenyardError) -> str:
    """Why a process did not search, on one line: a remote failure's own message (a nested
    search's), without the traceback its text carries."""
    return err.remote_message if isinstance(err, RemoteActorError) else str(err)
