"""``ActorSystem``: owns the zmq context, the private ipc directory and every child actor."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio

from ._actor import Actor, Cell
from ._children import Child, Children, Watch
from ._codec import DownBody, Kind
from ._errors import (
    ActorDeadError,
    ActorNotFoundError,
    SpawnError,
    TokenyardError,
    sole_error,
)
from ._mailbox import Mailbox, MailboxStatistics
from ._node import Node
from ._ref import ActorRef
from ._spawn import (
    SpawnSpec,
    actor_path,
    decode_arguments,
    encode_arguments,
    main_reference,
    start_process,
)
from ._transport import TransportOptions, bind_pull, ipc_path
from ._watch import Down, LookupQuery, LookupReply, oom_kills

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType


logger = logging.getLogger("tokenyard.system")

A = TypeVar("A", bound=Actor)


class ActorSystem:
    """Owns a zmq context, a private ipc directory and every actor spawned through it.

    Use it as an async context manager; leaving it stops every child in reverse start order
    (stop request, bounded wait, SIGTERM, SIGKILL) and removes the directory.

    Args:
        name: Name used in logs and socket names.
        transport: ``"ipc"`` (default) or ``"tcp"``.
        tcp_host: Interface ``tcp`` mailboxes bind to.
        hwm: High-water mark of every queue, in messages.
        max_message_size: Largest message accepted, in bytes.
        send_timeout: Default seconds a ``tell`` waits on a full mailbox.
        spawn_timeout: Seconds a spawned actor has to become ready.
        shutdown_timeout: Default seconds a stopping actor has before SIGTERM.

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
        hwm: int = 10_000,
        max_message_size: int = 64 * 1024 * 1024,
        send_timeout: float = 10.0,
        spawn_timeout: float = 30.0,
        shutdown_timeout: float = 5.0,
    ) -> None:
        self.name = name
        self.options = TransportOptions(
            hwm=hwm,
            max_message_size=max_message_size,
            send_timeout=send_timeout,
            transport=transport,
            tcp_host=tcp_host,
        )
        self.spawn_timeout = spawn_timeout
        self.shutdown_timeout = shutdown_timeout
        self.ipc_dir = ""
        self.root_pid = os.getpid()
        self._owns_dir = True
        self._cookie = os.urandom(16)
        #: An actor process's system: it reports to a parent and lingers on close.
        self._in_child = False
        self._node: Node | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._children = Children()
        self._cells: dict[str, Cell] = {}
        self._incarnations: dict[str, int] = {}
        self._names = itertools.count(1)
        self.closing = False

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
        system._in_child = True
        return system

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

    async def __aenter__(self) -> ActorSystem:
        if self._owns_dir:
            # Created 0700; the pid in the name tells whose it is.
            self.ipc_dir = tempfile.mkdtemp(prefix=f"tokenyard-{os.getpid()}-")
        self._node = Node(self.ipc_dir, self.options, self.name, self._cookie)
        self._node.open()
        self._children.node = self._node
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
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
        finally:
            assert self._tg is not None
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            node = self.node
            if self._in_child:
                node.outbox.close()
            node.close()
            if self._owns_dir:
                shutil.rmtree(self.ipc_dir, ignore_errors=True)

    # -- spawning -------------------------------------------------------------------------

    async def spawn(
        self,
        actor: type[A],
        *args: Any,
        name: str | None = None,
        process: bool = True,
        spawn_timeout: float | None = None,
        shutdown_timeout: float | None = None,
        **kwargs: Any,
    ) -> ActorRef[Any]:
        """Start an actor and return its ref once its ``on_start`` has finished.

        Args:
            actor: The Actor subclass.
            *args: Positional arguments of its constructor (msgspec-encodable if
                ``process``).
            name: The actor's name (default: class name and a counter).
            process: Run it in its own OS process (default) or as a task in this loop.
            spawn_timeout: Seconds it has to become ready (default: the system's).
            shutdown_timeout: Seconds it gets to stop before SIGTERM (default: the system's).
            **kwargs: Keyword arguments of its constructor.

        Raises:
            SpawnError: Arguments not encodable, import failure, ``on_start`` raised, the
                process died or did not become ready in time.
        """
        name = name or f"{actor.__name__}-{next(self._names)}"
        incarnation = self._incarnations.get(name, 0) + 1
        self._incarnations[name] = incarnation
        stop_after = self.shutdown_timeout if shutdown_timeout is None else shutdown_timeout
        if not process:
            return await self._spawn_local(actor, args, kwargs, name, incarnation, stop_after)
        return await self._spawn_process(
            actor,
            args,
            kwargs,
            name,
            incarnation,
            stop_after,
            self.spawn_timeout if spawn_timeout is None else spawn_timeout,
        )

    @property
    def _task_group(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise TokenyardError("the actor system is not open: use `async with ActorSystem()`")
        return self._tg

    async def _spawn_process(
        self,
        actor: type[Actor],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str,
        incarnation: int,
        stop_after: float,
        timeout: float,
    ) -> ActorRef[Any]:
        Cell.decoder_for(actor)  # a class without handlers fails here, not in the child
        enc_args, enc_kwargs = encode_arguments(actor, args, kwargs)
        path, main = actor_path(actor), main_reference(actor)
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
            options=self.options,
            parent_reply=node.reply_address,
            token=token,
            root_pid=self.root_pid,
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            log_level=logging.getLogger().getEffectiveLevel(),
            spawn_timeout=self.spawn_timeout,
            shutdown_timeout=self.shutdown_timeout,
            cookie=node.cookie,
        )
        oom_before = oom_kills()
        try:
            proc, started = await start_process(spec, ready, timeout)
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
        )
        self._children.add(child)
        self._task_group.start_soon(self._monitor, child)
        return ref

    def _make_cell(
        self,
        actor: type[Actor],
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
        sock, address = bind_pull(node.ctx, self.ipc_dir, node.new_stem("a"), self.options)
        mailbox = Mailbox(sock, address, decoder, name, node.cookie)
        instance.ref = ActorRef(name, address, incarnation, owner or node.reply_address)
        instance.system = self
        cell = Cell(instance, mailbox, node)
        self._cells[address] = cell
        return cell

    def _drop_cell(self, cell: Cell) -> None:
        self._cells.pop(cell.mailbox.address, None)
        cell.mailbox.close()

    async def _spawn_local(
        self,
        actor: type[Actor],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str,
        incarnation: int,
        stop_after: float,
    ) -> ActorRef[Any]:
        cell = self._make_cell(actor, args, kwargs, name, incarnation, encoded=False)
        child = Child(cell.actor.ref, stop_after, cell=cell)
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._children.add(child)
        self._task_group.start_soon(self._run_local, child, ready)
        try:
            await ready
        except BaseException:
            self._children.live.pop(child.ref.address, None)
            raise
        return child.ref

    async def _run_local(self, child: Child, ready: asyncio.Future[None]) -> None:
        cell = child.cell
        assert cell is not None

        async def on_ready() -> None:
            ready.set_result(None)

        reason = "normal"
        try:
            with anyio.CancelScope() as child.scope:
                stop = await cell.run(on_ready)
                self._drop_cell(cell)
                if stop is not None:
                    await self.node.reply(stop, None)
            if child.scope.cancelled_caught:
                reason = "cancelled: it did not stop in time"
        except Exception as err:
            if not ready.done():
                ready.set_exception(
                    SpawnError(f"actor {child.ref.name!r} failed in on_start: {err!r}")
                )
                return
            cause = sole_error(err)
            reason = f"exception: {type(cause).__module__}.{type(cause).__qualname__}: {cause}"
            logger.exception("in-process actor %s crashed", child.ref.name)
        finally:
            self._drop_cell(cell)
            if not ready.done():
                ready.cancel()
            elif ready.exception() is None:
                self._children.died(child, Down(ref=child.ref, reason=reason))

    async def _monitor(self, child: Child) -> None:
        """Wait for a process child's death (its pidfd) and report it."""
        await self._children.await_exit(child)

    # -- watching and stopping ------------------------------------------------------------

    def watch(self, ref: ActorRef[Any], *, notify: ActorRef[Any] | None = None) -> Watch:
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

        def deliver(body: DownBody) -> None:
            if fut.done():
                return
            down = Down(ref=ref, reason=body.reason, exitcode=body.exitcode, signal=body.signal)
            fut.set_result(down)
            if notify is not None and self._tg is not None:
                self._tg.start_soon(self._tell_down, notify, down)

        node.on_death(ref.address, deliver)
        node.subscribe(ref)
        return Watch(fut)

    async def _tell_down(self, notify: ActorRef[Any], down: Down) -> None:
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

    async def _close_children(self) -> None:
        await self._children.stop_all()

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
            if child.process is None:
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
        """The process id of a child of this system (None if it runs in-process or died)."""
        child = self._children.get(ref.address)
        if child is None or child.process is None:
            return None
        return child.process.pid

    async def statistics(self, ref: ActorRef[Any], timeout: float = 5.0) -> MailboxStatistics:
        """The mailbox counters of an actor, in this process or another."""
        cell = self._cells.get(ref.address)
        if cell is not None:
            return cell.mailbox.statistics()
        result = await self.node.ask_control(ref, Kind.STATS, timeout)
        assert isinstance(result, MailboxStatistics)
        return result
