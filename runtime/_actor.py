"""``Actor``, the ``@handler`` marker, and the cell that runs one actor's mailbox loop."""

from __future__ import annotations

import inspect
import logging
import typing
from collections.abc import Awaitable, Callable, Coroutine
from types import FunctionType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc
import msgspec

from ._codec import ErrorBody, Header, Kind, MailboxDecoder
from ._errors import ProtocolError, TokenyardError, sole_error
from ._message import Message
from ._node import Node, handling_address
from ._watch import LookupQuery, LookupReply

if TYPE_CHECKING:
    from ._mailbox import Item, Mailbox
    from ._ref import ActorRef
    from ._system import ActorSystem

logger = logging.getLogger("tokenyard.actor")

F = TypeVar("F", bound=Callable[..., Any])

_marked: set[Callable[..., Any]] = set()
_tables: dict[type[Actor], dict[type[Message], tuple[str, bool]]] = {}


def handler(fn: F) -> F:
    """Mark a method as the handler of the message type its parameter is annotated with.

    The handler may be ``async def`` or plain ``def``; its return value (a ``Message`` or
    ``None``) is the reply to an ``ask``.

    Example:
        >>> class Echo(Actor):
        ...     @handler
        ...     async def echo(self, msg: Ping) -> Pong:
        ...         return Pong(n=msg.n)
    """
    _marked.add(fn)
    return fn


def handler_table(cls: type[Actor]) -> dict[type[Message], tuple[str, bool]]:
    """Map each accepted message type to (method name, is coroutine), built once per class.

    Raises:
        TypeError: A handler's parameter is not annotated with a Message subclass, or two
            handlers claim the same type.
    """
    table = _tables.get(cls)
    if table is not None:
        return table
    table = {}
    for klass in reversed(cls.__mro__):
        for attr, fn in vars(klass).items():
            if not isinstance(fn, FunctionType) or fn not in _marked:
                continue
            msg_type = _message_type(klass, attr, fn)
            for known, (other, _) in list(table.items()):
                if known is msg_type and other != attr:
                    raise TypeError(
                        f"{cls.__qualname__}: handlers {other!r} and {attr!r} both take "
                        f"{msg_type.__qualname__}; one message type has one handler"
                    )
            table[msg_type] = (attr, inspect.iscoroutinefunction(fn))
    _tables[cls] = table
    return table


def _message_type(klass: type, attr: str, fn: Callable[..., Any]) -> type[Message]:
    params = list(inspect.signature(fn).parameters.values())[1:]
    if len(params) != 1:
        raise TypeError(f"{klass.__qualname__}.{attr}: a handler takes exactly one message")
    hints = typing.get_type_hints(fn, vars(inspect.getmodule(fn) or klass))
    msg_type = hints.get(params[0].name)
    if not (isinstance(msg_type, type) and issubclass(msg_type, Message)):
        raise TypeError(
            f"{klass.__qualname__}.{attr}: annotate the parameter {params[0].name!r} with the "
            f"Message subclass it handles (got {msg_type!r})"
        )
    return msg_type


class Actor:
    """Base class of every actor.

    Subclasses define ``@handler`` methods, one message type each, and may override the
    async lifecycle hooks ``on_start`` (runs before the actor is reported ready) and
    ``on_stop`` (runs after the last message was handled). While running, ``self.ref`` is
    the actor's own ref and ``self.system`` the system it lives in (spawn, watch, stop).
    """

    ref: ActorRef[Any]
    system: ActorSystem
    _task_group: anyio.abc.TaskGroup | None = None
    _failure: Exception | None = None

    async def on_start(self) -> None:
        """Called once before the first message; an exception here fails the spawn."""

    async def on_stop(self) -> None:
        """Called once after the last message, on a graceful stop."""

    async def stop(self) -> None:
        """Stop this actor gracefully, as if asked to: messages already queued are handled,
        ``on_stop`` runs, and the exit is normal (a transient child is not restarted)."""
        node = self.system.node
        await node.send_control(self.ref.address, Kind.STOP, 0, b"")

    def crash(self, error: Exception) -> None:
        """End this actor with ``error`` as soon as the running handler returns.

        The actor stops serving without ``on_stop``; whoever watches it (its supervisor)
        gets a ``Down`` whose reason carries the error. This is how an actor fails upward.
        """

        async def fail() -> None:
            raise error

        self._failure = error
        self.start_soon(fail)

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run a background task owned by this actor (from ``on_start`` or a handler).

        It is cancelled when the actor stops; if it raises, the actor dies with that error
        and its supervisor sees the ``Down``.

        Raises:
            RuntimeError: The actor is not running.
        """
        if self._task_group is None:
            raise RuntimeError(
                f"{type(self).__qualname__} is not running: start tasks from on_start"
            )
        self._task_group.start_soon(fn, *args)


class Cell:
    """Runs one actor: its mailbox loop, its replies and its counters.

    Args:
        actor: The actor instance.
        mailbox: Its bound mailbox.
        node: The node replies are sent from.
    """

    def __init__(self, actor: Actor, mailbox: Mailbox, node: Node) -> None:
        self.actor = actor
        self.mailbox = mailbox
        self.node = node
        self.stopping = False
        table = handler_table(type(actor))
        self._handlers: dict[type[Message], tuple[Callable[[Any], Any], bool]] = {
            t: (getattr(actor, name), is_async) for t, (name, is_async) in table.items()
        }

    @staticmethod
    def decoder_for(cls: type[Actor]) -> MailboxDecoder:
        """Build the mailbox decoder of an actor class."""
        types = list(handler_table(cls))
        if not types:
            raise TypeError(f"{cls.__qualname__} has no @handler methods")
        return MailboxDecoder(types)

    async def run(self, on_ready: Callable[[], Awaitable[None]]) -> Header | None:
        """The actor's whole life: ``on_start``, ready, serve until stopped, ``on_stop``.

        Returns:
            The stop request, to acknowledge once everything is closed.

        Raises:
            Exception: ``on_start`` failed (before ``on_ready``), or a background task of
                the actor failed (the actor crashed).
        """
        actor = self.actor
        try:
            async with anyio.create_task_group() as tg:
                actor._task_group = tg
                try:
                    await actor.on_start()
                    await on_ready()
                    stop = await self.serve()
                    try:
                        await actor.on_stop()
                    except Exception:
                        logger.exception("%s: on_stop raised", self.mailbox.owner)
                finally:
                    actor._task_group = None
                tg.cancel_scope.cancel()
        except ExceptionGroup as group:
            # One failure (on_start, or a background task) is the actor's error: raise it
            # as itself so reasons and SpawnErrors read plainly.
            err = sole_error(group)
            if err is not group and isinstance(err, Exception):
                raise err from None
            raise
        return stop

    async def serve(self) -> Header | None:
        """Handle messages until a stop request; return it (after draining what is queued)."""
        handling_address.set(self.mailbox.address)
        mailbox = self.mailbox
        handlers = self._handlers
        stop: Header | None = None
        while stop is None:
            items = await mailbox.receive()
            stop = await self._handle_items(items, handlers)
        # Everything already queued was accepted before the stop: handle it too.
        while items := mailbox.drain():
            await self._handle_items(items, handlers)
        return stop

    async def _handle_items(
        self,
        items: list[Item],
        handlers: dict[type[Message], tuple[Callable[[Any], Any], bool]],
    ) -> Header | None:
        mailbox = self.mailbox
        actor = self.actor
        decode = mailbox.decoder.decode
        stop: Header | None = None
        for header, body in items:
            if header is None:
                mailbox.queued -= 1
                try:
                    msg = decode(body)  # type: ignore[arg-type]  # a tell's body is its frame
                except (msgspec.DecodeError, msgspec.ValidationError) as err:
                    mailbox.reject(err, body)  # type: ignore[arg-type]
                    continue
                fn, is_async = handlers[type(msg)]
                try:
                    if is_async:
                        await fn(msg)
                    else:
                        fn(msg)
                except Exception:  # a handler's error fails its message only
                    mailbox.failed += 1
                    logger.exception("%s: handler of %s raised", mailbox.owner, type(msg).__name__)
                else:
                    mailbox.handled += 1
                if actor._failure is not None:
                    raise actor._failure  # crash() was called: nothing more is handled
                continue
            mailbox.queued -= 1
            decoded = body if not isinstance(body, bytes) else None
            if header.kind is Kind.ASK:
                await self._handle_ask(header, decoded)
                if self.actor._failure is not None:
                    raise self.actor._failure
            elif header.kind is Kind.FLUSH:
                # A sender about to exit: everything it sent before this is handled.
                await self.node.reply(header, None)
            elif header.kind is Kind.STOP:
                stop = header
                self.stopping = True
            elif header.kind is Kind.STATS:
                await self.node.reply(header, mailbox.statistics())
            elif header.kind is Kind.LOOKUP and isinstance(decoded, LookupQuery):
                found = await self.actor.system.lookup(decoded.name, missing_ok=True)
                await self.node.reply(header, LookupReply(ref=found))
            else:
                mailbox.rejected += 1
                logger.warning("%s: unexpected control frame %s", mailbox.owner, header.kind)
        return stop

    async def _handle_ask(self, header: Header, msg: Message | ErrorBody | None) -> None:
        mailbox = self.mailbox
        node = self.node
        try:
            if isinstance(msg, ErrorBody) or msg is None:
                await node.reply_error(header, msg or ErrorBody("runtime.ProtocolError", "", ""))
                return
            fn, is_async = self._handlers[type(msg)]
            try:
                result = await fn(msg) if is_async else fn(msg)
            except Exception as err:  # noqa: BLE001 - the asker gets the error as data
                mailbox.failed += 1
                logger.debug("%s: handler of %s raised", mailbox.owner, type(msg).__name__)
                await node.reply_error(header, err)
                return
            mailbox.handled += 1
            try:
                await node.reply(header, result)
            except ProtocolError as err:
                await node.reply_error(header, err)
        except TokenyardError as err:
            # The asker is unreachable (gone, or its inbox stayed full): it will time out or
            # learn of the failure some other way; this actor carries on.
            logger.warning("%s: could not reply to %s: %s", mailbox.owner, header.sender, err)
