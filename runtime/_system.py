"""``ActorSystem``: owns the zmq context, the private ipc directory and every child actor."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio
import anyio.abc
import msgspec

from ._auth import Keys, cookie_of
from ._cell import Cell, Ending, host
from ._children import Child, Children, RemoteProcess
from ._credentials import Credentials
from ._errors import (
    ActorDeadError,
    ActorNotFoundError,
    SpawnError,
    TokenyardError,
)
from ._exit import oom_kills
from ._launcher import DEFAULT_START, FORK_SERVER, Launcher, StartMethod, check_start
from ._mailbox import Mailbox, MailboxStatistics
from ._message import Message
from ._metrics import REGISTRY
from ._node import Node
from ._nodes import NodeTable, find_node, list_nodes, spawn_on
from ._protocol import (
    Cause,
    Down,
    Kind,
    LookupQuery,
    LookupReply,
    NodeInfo,
    RemoteSpawn,
    body_encoder,
    new_cookie,
)
from ._ref import ActorRef
from ._spawn import (
    SpawnSpec,
    actor_path,
    child_env,
    decode_arguments,
    encode_arguments,
    main_reference,
    start_process,
)
from ._stats import ProcessMetrics, ProcessStats, SystemMetrics, now
from ._transport import TransportOptions, bind_pull, ipc_path
from ._watch import Watch

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Sequence
    from types import TracebackType

    from ._actor import Actor


logger = logging.getLogger("tokenyard.system")

M = TypeVar("M", bound=Message)

#: The in-process actor whose code is running (its mailbox address): what it spawns is its
#: own, and stopped when it ends.
_spawning_parent: contextvars.ContextVar[str] = contextvars.ContextVar("tokenyard_parent")


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
            ``Down`` with `Cause.NOCONNECTION` (see docs/guides/multi-host.md).
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
        self.name = name
        self.options: TransportOptions = TransportOptions(
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
        )
        self._port = port
        self._root = root
        #: The root's list of the system's nodes (a tcp system's root only).
        self.node_table: NodeTable | None = None
        self.spawn_timeout = spawn_timeout
        self.shutdown_timeout = shutdown_timeout
        #: How this system starts actor processes, and its fork server (``.server``).
        self.launcher = Launcher(name, check_start(start, "ActorSystem("), preload)
        self._eager_fork_server = eager_fork_server
        self.ipc_dir = ""
        self.root_pid = os.getpid()
        self._owns_dir = True
        self._cookie = new_cookie()
        self._keys_source = keys
        self._keys: Keys | None = None
        #: An actor process's system: it reports to a parent and lingers on close.
        self._in_child = False
        self._node: Node | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._children = Children()
        self._cells: dict[str, Cell] = {}
        self._incarnations: dict[str, int] = {}
        self._names = itertools.count(1)
        #: The write end of the guardian's pipe (-1: none).
        self._guardian = -1
        #: Files `save_credentials` wrote, each with its guardian's pipe.
        self._saved: dict[str, int] = {}
        self.closing = False
        if attach is not None:
            self.options = attach.options
            self.ipc_dir = attach.ipc_dir
            self.root_pid = attach.root_pid
            self._owns_dir = False
            self._cookie = attach.cookie
            self._keys_source = attach.keys

    @classmethod
    def _for_child(cls, spec: SpawnSpec) -> ActorSystem:
        """The system of an actor process: it shares its root's directory, never owns it."""
        system = cls(
            name=spec.name,
            spawn_timeout=spec.spawn_timeout,
            shutdown_timeout=spec.shutdown_timeout,
        )
        system.options = spec.options
        system.ipc_dir = spec.ipc_dir
        system.root_pid = spec.root_pid
        system._owns_dir = False
        system._cookie = spec.cookie
        system._keys_source = spec.keys
        system._in_child = True
        system._root = spec.root
        system.launcher = Launcher(spec.name, check_start(spec.start, "SpawnSpec("), spec.preload)
        return system

    @property
    def address(self) -> str:
        """This process's reply inbox: over tcp, where the system's nodes join its root."""
        return self.node.reply_address

    @property
    def root_address(self) -> str:
        """The reply inbox of the system's root (this process's own when it is the root)."""
        return self._root or self.node.reply_address

    @property
    def node(self) -> Node:
        """The per-process sockets of this system."""
        if self._node is None:
            raise TokenyardError("the actor system is not open: use `async with ActorSystem()`")
        return self._node

    def bound_paths(self) -> list[str]:
        """The ipc socket files this process bound for this system."""
        addresses = [self.node.reply_address, *self._cells]
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
        node = self.node
        return Credentials(
            ipc_dir=self.ipc_dir,
            cookie=node.cookie,
            options=self.options,
            root_pid=self.root_pid,
            keys=node.keys,
            collector=collector,
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
        self.credentials(collector).save(path)
        guardian = _start_guardian(path, directory=False)
        old = self._saved.pop(path, None)
        if old is not None:
            os.close(old)
        self._saved[path] = guardian

    def _resolve_keys(self) -> Keys | None:
        if self.options.transport != "tcp" or not self.options.curve:
            return None
        source = self._keys_source
        if isinstance(source, Keys):
            return source
        if source is None:
            return Keys.generate()
        return Keys.load(source)

    async def __aenter__(self) -> ActorSystem:
        if self._owns_dir:
            # Created 0700; the pid in the name tells whose it is.
            self.ipc_dir = tempfile.mkdtemp(prefix=f"tokenyard-{os.getpid()}-")
            self._guardian = _start_guardian(self.ipc_dir)
        try:
            self._keys = self._resolve_keys()
            if self._keys is not None and not self._in_child and self._owns_dir:
                self._cookie = cookie_of(self._keys)  # the same on every node
            self._node = Node(
                self.ipc_dir, self.options, self.name, self._cookie, self._keys, self._port
            )
        except BaseException:
            self._remove_dir()
            raise
        self._node.open()
        self._children.node = self._node
        if self._keys is not None and not self._in_child and not self._root:
            self.node_table = NodeTable(self._node)
            self._node.on_node_frame = self.node_table.on_frame
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self._eager_fork_server and self.launcher.start == FORK_SERVER:
            self.launcher.open_server()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.closing = True
        try:
            with anyio.CancelScope(shield=True):
                if exc_type is None and not self._in_child:
                    await self.deliver_tells()
                await self._children.stop_all()
                await self.launcher.aclose()
        finally:
            assert self._tg is not None
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            node = self.node
            node.close(self.options.linger_ms if self._in_child else 0)
            self._remove_dir()

    def _remove_dir(self) -> None:
        for path, guardian in self._saved.items():
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(guardian)
        self._saved.clear()
        if not self._owns_dir:
            return
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        guardian, self._guardian = self._guardian, -1
        if guardian >= 0:
            os.close(guardian)

    # -- spawning -------------------------------------------------------------------------

    async def spawn(
        self,
        actor: type[Actor[M]],
        *args: Any,
        name: str | None = None,
        process: bool = True,
        spawn_timeout: float | None = None,
        shutdown_timeout: float | None = None,
        stall_timeout: float | None = None,
        inherit: Sequence[int] = (),
        start: StartMethod | None = None,
        node: str | None = None,
        **kwargs: Any,
    ) -> ActorRef[M]:
        """Start an actor and return its ref once its ``on_start`` has finished.

        Args:
            actor: The Actor subclass.
            *args: Positional arguments of its constructor (msgspec-encodable if
                ``process``).
            name: The actor's name (default: class name and a counter).
            process: Run it in its own OS process (default) or as a task in this loop.
            spawn_timeout: Seconds it has to become ready (default: the system's).
            shutdown_timeout: Seconds it gets to stop before SIGTERM (default: the system's).
            stall_timeout: For a process: seconds its event loop may leave liveness probes
                unanswered (stopped, or blocked) before it is killed and reported ``Down``
                with `Cause.UNRESPONSIVE`; ``None`` (default) never probes.
            inherit: File descriptors its process inherits, under the same numbers (pass
                them to it as arguments too): a listening socket, one end of a socket pair.
                Nothing else crosses: every other descriptor of this process is closed in
                the child. (An in-process actor shares this process's descriptors anyway.)
            start: For a process: ``"spawn"`` (a fresh interpreter) or ``"fork-server"``;
                default: the system's ``start``.
            node: Start it on the system's node of that name (on another host, over CURVE
                tcp: docs/guides/multi-host.md) rather than as this process's child. Its
                class must import there; it is still this system's child (`stop`, `kill`,
                `watch`, and its death ends as a local child's does).
            **kwargs: Keyword arguments of its constructor.

        Raises:
            SpawnError: Arguments not encodable, import failure, ``on_start`` raised, the
                process died or did not become ready in time; for ``node``: no such node,
                or it did not answer.
        """
        name = name or f"{actor.__name__}-{next(self._names)}"
        incarnation = self._incarnations.get(name, 0) + 1
        self._incarnations[name] = incarnation
        stop_after = self.shutdown_timeout if shutdown_timeout is None else shutdown_timeout
        if stall_timeout is not None and stall_timeout <= 0:
            raise ValueError(f"stall_timeout={stall_timeout} must be positive (or None)")
        if stall_timeout is not None and not process:
            raise ValueError(
                "stall_timeout is for actor processes: an in-process actor shares this "
                "process's event loop, so nothing could probe it (pass process=True)"
            )
        if not process:
            if node is not None:
                raise ValueError("node= starts a process on another host: pass process=True")
            return await self._spawn_local(actor, args, kwargs, name, incarnation, stop_after)
        if start is not None:
            check_start(start, "spawn(")
        if node is not None and inherit:
            raise ValueError("inherit= cannot cross to another host (node=...)")
        Cell.decoder_for(actor)  # a class without handlers fails here, not in the child
        enc_args, enc_kwargs = encode_arguments(actor, args, kwargs)
        timeout = self.spawn_timeout if spawn_timeout is None else spawn_timeout
        if node is not None:
            request = RemoteSpawn(
                actor=actor_path(actor),
                main=main_reference(actor),
                name=name,
                incarnation=incarnation,
                args=enc_args,
                kwargs=enc_kwargs,
                spawn_timeout=timeout,
                shutdown_timeout=stop_after,
                stall_timeout=stall_timeout,
                options=msgspec.Raw(body_encoder.encode(self.options)),
                root=self.root_address,
                start=start,
            )
            return await self._spawn_remote(request, node)
        child = await self._start_process(
            actor_path(actor),
            main_reference(actor),
            enc_args,
            enc_kwargs,
            name,
            incarnation,
            stop_after,
            timeout,
            stall_timeout,
            inherit,
            start,
            self.options,
        )
        return child.ref

    @property
    def _task_group(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise TokenyardError("the actor system is not open: use `async with ActorSystem()`")
        return self._tg

    async def _start_process(
        self,
        path: str,
        main: str,
        enc_args: list[msgspec.Raw],
        enc_kwargs: dict[str, msgspec.Raw],
        name: str,
        incarnation: int,
        stop_after: float,
        timeout: float,
        stall_timeout: float | None,
        inherit: Sequence[int],
        start: StartMethod | None,
        options: TransportOptions,
        root: str = "",
    ) -> Child:
        """Start an actor process from its encoded pieces and record it as a child."""
        node = self.node
        token, ready = node.new_request(f"spawn:{name}")
        spec = SpawnSpec(
            actor=path,
            main=main,
            name=name,
            incarnation=incarnation,
            args=enc_args,
            kwargs=enc_kwargs,
            ipc_dir=self.ipc_dir,
            options=options,
            parent_reply=node.reply_address,
            token=token,
            root_pid=self.root_pid,
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            log_level=logging.getLogger().getEffectiveLevel(),
            spawn_timeout=self.spawn_timeout,
            shutdown_timeout=self.shutdown_timeout,
            cookie=node.cookie,
            keys=self._keys,
            inherit=list(inherit),
            start=self.launcher.start,
            preload=list(self.launcher.preload),
            root=root or self._root or (node.reply_address if self.node_table else ""),
        )
        launch = self.launcher.launcher(spec, start)
        if launch is not None:
            spec.env = child_env()
        oom_before = oom_kills()
        node.expect_last_words(token)
        try:
            proc, started = await start_process(spec, ready, timeout, launch)
        except BaseException:
            node.take_last_words(token)
            raise
        finally:
            node.drop_request(token)
        ref: ActorRef[Any] = ActorRef(name, started.address, incarnation, node.reply_address)
        child = Child(
            ref,
            stop_after,
            process=proc,
            token=token,
            node_address=started.node,
            oom_before=oom_before,
            parent=_spawning_parent.get(""),
            stall_timeout=stall_timeout,
        )
        self._children.add(child)
        self._task_group.start_soon(self._children.await_exit, child)
        if stall_timeout is not None:
            self._task_group.start_soon(self._children.probe, child)
        return child

    async def _spawn_remote(self, request: RemoteSpawn, node_name: str) -> ActorRef[Any]:
        if self.options.transport != "tcp" or self._keys is None:
            raise SpawnError(
                "spawn(node=...) needs a system over tcp with CURVE keys "
                "(ActorSystem(transport='tcp', keys=...)): docs/guides/multi-host.md"
            )
        answer_within = request.spawn_timeout + self.options.heartbeat
        info = await find_node(self, node_name, answer_within)
        spawned = await spawn_on(self, info, request, answer_within)
        node = self.node
        ref: ActorRef[Any] = ActorRef(
            request.name, spawned.address, request.incarnation, info.address
        )
        remote = RemoteProcess(node, info.address, info.name, spawned.pid, spawned.address)
        child = Child(
            ref,
            request.shutdown_timeout,
            parent=_spawning_parent.get(""),
            remote=remote,
        )
        node.on_death(ref.address, remote.deliver)
        node.subscribe(ref)
        self._children.add(child)
        self._task_group.start_soon(self._children.await_exit, child)
        return ref

    async def start_remote_child(self, request: RemoteSpawn, options: TransportOptions) -> Child:
        """A node's half of ``spawn(node=...)``: start the actor asked for as this process's
        own child, under the requester's transport settings (`runtime._nodes`)."""
        return await self._start_process(
            request.actor,
            request.main,
            request.args,
            request.kwargs,
            request.name,
            request.incarnation,
            request.shutdown_timeout,
            request.spawn_timeout,
            request.stall_timeout,
            (),
            check_start(request.start, "RemoteSpawn(") if request.start else None,
            options,
            request.root,
        )

    def start_task(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``func(*args)`` in this system's task group (ended when the system closes)."""
        self._task_group.start_soon(func, *args)

    def child_at(self, address: str) -> Child | None:
        """The live child whose mailbox is ``address``."""
        return self._children.get(address)

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

    def _make_cell(
        self,
        actor: type[Actor[Any]],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str,
        incarnation: int,
        *,
        encoded: bool = True,
        owner: str = "",
    ) -> Cell:
        """Build an actor in this process and bind its mailbox (``on_start`` not run yet).

        ``owner`` is the reply address of the node that started it, where its death is
        known (default: this process's node, for an in-process actor); its own ``self.ref``
        then equals the ref its parent holds, and whoever gets it learns of its death.
        """
        decoder = Cell.decoder_for(actor)
        if encoded:
            args, kwargs = decode_arguments(actor, args, kwargs)
        instance = actor(*args, **kwargs)
        node = self.node
        options = self.options
        sock, address = bind_pull(node.ctx, self.ipc_dir, node.new_stem("a"), options, node.keys)
        mailbox = Mailbox(
            sock,
            address,
            decoder,
            name,
            node.cookie,
            node.outbox.allows,
            options.mailbox_bytes,
            logging.getLogger("tokenyard.mailbox"),
        )
        instance.ref = ActorRef(name, address, incarnation, owner or node.reply_address)
        instance.system = self
        cell = Cell(instance, mailbox, node)
        self._cells[address] = cell
        return cell

    async def _host(self, cell: Cell, on_ready: Any) -> Ending:
        """Live the actor's life in ``cell`` (`runtime._cell.host`) as this system's member:
        what it spawns is its own, and stopped when it ends."""
        address = cell.mailbox.address
        _spawning_parent.set(address)
        try:
            return await host(cell, on_ready, lambda: self._children.stop_all(parent=address))
        finally:
            self._cells.pop(address, None)

    async def _spawn_local(
        self,
        actor: type[Actor[M]],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str,
        incarnation: int,
        stop_after: float,
    ) -> ActorRef[M]:
        cell = self._make_cell(actor, args, kwargs, name, incarnation, encoded=False)
        ref: ActorRef[M] = ActorRef(
            name, cell.mailbox.address, incarnation, self.node.reply_address
        )
        child = Child(ref, stop_after, cell=cell, parent=_spawning_parent.get(""))
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._children.add(child)
        self._task_group.start_soon(self._run_local, child, ready)
        try:
            await ready
        except BaseException:
            self._children.live.pop(child.ref.address, None)
            raise
        return ref

    async def _run_local(self, child: Child, ready: asyncio.Future[None]) -> None:
        cell = child.cell
        assert cell is not None

        async def on_ready() -> None:
            ready.set_result(None)

        ending: Ending | None = None
        try:
            with anyio.CancelScope() as child.scope:
                ending = await self._host(cell, on_ready)
                if ending.stop is not None:
                    with anyio.CancelScope(shield=True):
                        try:
                            await self.node.reply(ending.stop, None)
                        except TokenyardError as err:
                            logger.debug("stop of %s not acknowledged: %s", child.ref.name, err)
        finally:
            if not ready.done():
                if ending is not None and ending.error is not None:
                    ready.set_exception(
                        SpawnError(f"actor {child.ref.name!r} failed in on_start: {ending.error!r}")
                    )
                else:
                    ready.cancel()
            elif ready.exception() is None:
                self._children.died(child, _local_down(child, ending))

    # -- watching and stopping ------------------------------------------------------------

    def watch(self, ref: ActorRef[Any], *, notify: ActorRef[Down] | None = None) -> Watch:
        """Register interest in ``ref``'s death; ``await`` the result for its ``Down``.

        Works for any actor whose ref names its owner: a child of this system, or one
        started elsewhere (its owning node reports the death here). Registration happens at
        once, so a death right after this call is not missed.

        Args:
            ref: The incarnation to watch.
            notify: Also tell this actor the ``Down`` as a message (how an actor watches:
                ``self.system.watch(ref, notify=self.ref)`` plus a ``Down`` handler).

        Raises:
            TokenyardError: ``ref`` names no owner and is not a child of this system.
        """
        node = self.node
        fut: asyncio.Future[Down] = asyncio.get_running_loop().create_future()
        if (
            ref.address not in self._children.live
            and not ref.owner
            and not node.is_dead(ref.address)
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

        node.on_death(ref.address, deliver)
        node.subscribe(ref)
        return Watch(fut)

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
        """
        child = self._children.get(ref.address)
        if child is None:
            if self.node.is_dead(ref.address):
                raise ActorDeadError(f"actor {ref.name!r} is already dead")
            raise ActorDeadError(
                f"actor {ref.name!r} is not a child of this system: stop it through the "
                "system or supervisor that started it"
            )
        return await self._children.stop(
            child, child.shutdown_timeout if timeout is None else timeout
        )

    async def kill(self, ref: ActorRef[Any], reason: str) -> Down:
        """End a child at once, without a graceful stop: SIGKILL its process (or cancel an
        in-process one). For a process, the ``Down`` has `Cause.UNRESPONSIVE` and ``reason``:
        this is how a supervisor ends a child that is alive but stuck.

        Raises:
            ActorDeadError: It is dead already, or not a child of this system.
        """
        child = self._children.get(ref.address)
        if child is None:
            raise ActorDeadError(f"actor {ref.name!r} is not a live child of this system")
        if child.process is not None:
            child.unresponsive = reason
            child.process.kill()
        elif child.remote is not None:
            child.remote.signal(signal.SIGKILL, reason)  # its node makes it UNRESPONSIVE
        elif child.scope is not None:
            child.scope.cancel()
        await self._children.await_exit(child)
        assert child.down is not None
        return child.down

    async def deliver_tells(self, skip: Sequence[str] = ()) -> None:
        """Wait, up to ``shutdown_timeout``, until every actor this process told has handled
        what it was told; children are skipped (their in-band stop does the same).

        A graceful exit does this, so that no accepted ``tell`` is lost with the process.
        """
        late = await self.node.flush(self.shutdown_timeout, {*skip, *self._children.live})
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
        self, name: str, *, timeout: float = 5.0, missing_ok: bool = False
    ) -> ActorRef[Any] | None:
        """The ref of the live incarnation named ``name``, anywhere under this system.

        Children of this system answer first; then each child process is asked about its
        own children (a supervisor's), depth first. After a restart the name resolves to the
        new incarnation.

        Raises:
            ActorNotFoundError: Nobody live has that name (unless ``missing_ok``).
        """
        children = list(self._children.live.values())
        for child in reversed(children):  # the newest incarnation of a name wins
            if child.ref.name == name:
                return child.ref
        for child in children:
            if child.process is None and child.remote is None:
                continue
            try:
                reply = await self.node.ask_control(
                    child.ref, Kind.LOOKUP, timeout, LookupQuery(name=name)
                )
            except TokenyardError:
                continue  # it died or is busy dying: its subtree has no live answer
            if isinstance(reply, LookupReply) and reply.ref is not None:
                return reply.ref
        if missing_ok:
            return None
        raise ActorNotFoundError(f"no live actor named {name!r} under system {self.name!r}")

    def child_pids(self) -> list[int]:
        """The process ids of this system's live child actor processes."""
        return [c.process.pid for c in self._children.live.values() if c.process is not None]

    def pid_of(self, ref: ActorRef[Any]) -> int | None:
        """The process id of a child of this system (None if it runs in-process or died);
        for one on another node, its pid there (see `node_of`)."""
        child = self._children.get(ref.address)
        if child is None:
            return None
        if child.remote is not None:
            return child.remote.pid
        return None if child.process is None else child.process.pid

    def node_of(self, ref: ActorRef[Any]) -> str | None:
        """The name of the node a live child runs on (None: this host, or not a child)."""
        child = self._children.get(ref.address)
        return None if child is None or child.remote is None else child.remote.node_name

    async def statistics(self, ref: ActorRef[Any], timeout: float = 5.0) -> MailboxStatistics:
        """The mailbox counters of an actor, in this process or another."""
        cell = self._cells.get(ref.address)
        if cell is not None:
            return cell.mailbox.statistics()
        result = await self.node.ask_control(ref, Kind.STATS, timeout)
        assert isinstance(result, MailboxStatistics)
        return result

    # -- metrics (a hook of its own: nothing of the spawn path) ---------------------------

    def process_metrics(self) -> ProcessMetrics:
        """What this process measured: its resources, its actors of this system, its asks
        and the series its code added (`runtime.metrics`)."""
        node = self.node
        return ProcessMetrics(
            name=self.name,
            node=node.reply_address,
            process=ProcessStats.read(),
            actors=[cell.metrics() for cell in list(self._cells.values())],
            asks=node.ask_statistics(),
            families=REGISTRY.snapshot(),
            gathered_at=now(),
        )

    async def gather_metrics(self, timeout: float = 5.0) -> SystemMetrics:
        """The statistics of this process and of every actor process under this system,
        theirs included (each is asked, all at once; one that does not answer in
        ``timeout`` is left out).

        Returns:
            This process first, then the others, depth first.
        """
        started = now()
        children = [
            c for c in self._children.live.values() if c.process is not None or c.remote is not None
        ]
        answers: list[list[ProcessMetrics]] = [[] for _ in children]

        async def ask(i: int, child: Child) -> None:
            try:
                reply = await self.node.ask_control(child.ref, Kind.METRICS, timeout)
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


def _local_down(child: Child, ending: Ending | None) -> Down:
    """The ``Down`` of an in-process actor that had started, from how it ended."""
    ref = child.ref
    if ending is None:  # cancelled by the stop's escalation
        return Down(ref=ref, cause=Cause.CANCELLED, reason="cancelled: it did not stop in time")
    if ending.error is None:
        return Down(ref=ref, cause=Cause.NORMAL, reason="normal")
    err = ending.error
    logger.error("in-process actor %s crashed", ref.name, exc_info=err)
    return Down(
        ref=ref,
        cause=Cause.EXCEPTION,
        reason=f"exception: {type(err).__module__}.{type(err).__qualname__}: {err}",
    )


def _start_guardian(path: str, *, directory: bool = True) -> int:
    """Start a tiny process that removes ``path`` once this one is gone, however it goes.

    It waits for EOF on a pipe only this process holds the write end of, which the kernel
    closes when this process ends; then it removes the directory or file (already gone
    after a clean exit). It is detached (the shell that starts it exits at once and is
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
                f'(cat <&3 >/dev/null; rm -{"rf" if directory else "f"} -- "$1") &',
                "guardian",
                path,
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
