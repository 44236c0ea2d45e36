"""The cell that runs one actor, and `live`, the one life every actor lives.

An actor in its own process and one in the caller's event loop live the same life, in
`live`: ``on_start``, the ready report, the mailbox loop until a stop request or a crash,
then ``on_stop`` (graceful) or ``on_failure`` (crash), the children it started stopped, its
mailbox closed. Only the ready report and what becomes of the ending differ: the in-process
runner (`runtime._spawner`) turns it into a ``Down``, the actor process (`runtime._child`)
into its exit status and last words.
"""

from __future__ import annotations

import asyncio
import logging
import time
from asyncio import CancelledError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ._actor import handler_table, reply_classes
from ._codec import MailboxDecoder
from ._context import TraceSlot, handling_address, open_trace_slot
from ._errors import AskTimeoutError, ProtocolError, TokenyardError, sole_error
from ._mailbox import Envelope
from ._message import type_path
from ._metrics import ENABLED, POW2_SLOTS, pow2_snapshot
from ._protocol import (
    DEFAULT_GATHER_TIMEOUT,
    HANDLED_KINDS,
    NESTED_GATHER_SHARE,
    ErrorBody,
    Header,
    Kind,
    LookupQuery,
    LookupReply,
    MetricsQuery,
    Traced,
)
from ._stats import ActorMetrics
from ._throttle import Throttle

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ._actor import Actor
    from ._mailbox import Item, Mailbox
    from ._message import Message
    from ._station import Station

logger = logging.getLogger("tokenyard.actor")

#: Longest a peer may ask a gathering to wait for the processes under it (past it, or not a
#: number: the default).
_MOST_GATHER_TIMEOUT = 3600.0

#: One drained run in this many has its handlers timed.
_SAMPLED_RUNS = 16

_Handlers = dict[type["Message"], tuple["Callable[[Any], Any]", bool]]


def _own_cancellation(err: BaseException) -> bool:
    """Whether ``err``, raised by a handler, is its actor's cancellation: a
    ``CancelledError`` while its task is being cancelled (by its scope, its system).
    Another is one the handler met (it awaited a task or future cancelled by someone else),
    an error like any other: it fails its message only. Taken for a cancellation, it ended
    the actor, as "cancelled with its system's task"."""
    if not isinstance(err, CancelledError):
        return False
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


#: No run of messages (what an idle actor's cell holds as its batch).
_NO_ITEMS: tuple[Item, ...] = ()


def _holds_stop(items: Sequence[Item]) -> bool:
    """Whether a stop request is among ``items``."""
    return any(type(item) is Envelope and item.header.kind is Kind.STOP for item in items)


#: Each actor class's mailbox decoder (`Cell.decoder_for`), as `handler_table` keeps its
#: handlers: one per class for the life of the process.
_decoders: dict[type, MailboxDecoder] = {}


@dataclass(frozen=True, slots=True)
class Ending:
    """How an actor's life ended.

    Attributes:
        started: Whether it got as far as its ready report.
        stop: The stop request to acknowledge, after a graceful stop by one.
        error: What it died of; ``None`` for a graceful stop.
    """

    started: bool
    stop: Header | None = None
    error: BaseException | None = None


class Cell:
    """Runs one actor: its mailbox loop and its replies.

    Args:
        actor: The actor instance.
        mailbox: Its bound mailbox.
        station: The station replies are sent from.
    """

    def __init__(self, actor: Actor[Any], mailbox: Mailbox, station: Station) -> None:
        self.actor = actor
        self.mailbox = mailbox
        self.station = station
        self.stopping = False
        table = handler_table(type(actor))
        self._handlers: _Handlers = {
            t: (getattr(actor, name), is_async) for t, (name, is_async) in table.items()
        }
        #: An ask's handler, and the classes its reply may be (`reply_classes`), checked
        #: before it is sent, so an asker of a ``Request[R]`` gets an ``R`` or an error.
        self._asks = {t: (*h, reply_classes(t)) for t, h in self._handlers.items()}
        self._errors = Throttle(logger)
        #: Handler times: a power-of-two histogram of nanoseconds (`runtime._metrics`).
        self._clock: Callable[[], int] | None = time.perf_counter_ns if ENABLED else None
        self._handler_slots = [0] * POW2_SLOTS
        self._handler_ns = 0
        self._runs = 0
        #: Where the handlers' trace context is current (`serve` makes it so in its task).
        self._trace: TraceSlot = TraceSlot()
        #: The run of messages being handled, and what was read after it while a handler
        #: ran (`unless_stopped`), handled next, in order.
        self._batch: Sequence[Item] = _NO_ITEMS
        self._ahead: list[Item] = []
        actor._stop_guard = self.unless_stopped

    def metrics(self) -> ActorMetrics:
        """This actor's statistics now."""
        actor = self.actor
        return ActorMetrics(
            ref=actor.ref,
            actor_class=type_path(type(actor)),
            mailbox=self.mailbox.statistics(),
            handler_seconds=pow2_snapshot(self._handler_slots, self._handler_ns),
            children=actor._supervision(),
        )

    @staticmethod
    def decoder_for(cls: type[Actor[Any]]) -> MailboxDecoder:
        """The mailbox decoder of an actor class, built once per class (a decoder is
        stateless: every mailbox of the class shares it, and a fork server's children
        share the one it built before forking).

        Raises:
            TypeError: The class has no handlers (or their annotations are wrong).
        """
        decoder = _decoders.get(cls)
        if decoder is None:
            types = list(handler_table(cls))
            if not types:
                raise TypeError(f"{cls.__qualname__} has no @handler methods")
            decoder = _decoders[cls] = MailboxDecoder(types)
        return decoder

    async def run(self, on_ready: Callable[[], Awaitable[None]]) -> Header | None:
        """``on_start``, ready, serve until stopped, ``on_stop``; ``on_failure`` on a crash.

        Returns:
            The stop request, to acknowledge once everything is closed.

        Raises:
            Exception: ``on_start`` failed (before ``on_ready``), or a background task of
                the actor failed (the actor crashed), as itself (not in a group).
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
                        logger.exception("%s: on_stop raised", self.mailbox.actor_name)
                finally:
                    actor._task_group = None
                tg.cancel_scope.cancel()
        except Exception as failure:
            # One failure (on_start, or a background task) is the actor's error: raise it
            # as itself so reasons and SpawnErrors read plainly.
            err = sole_error(failure)
            with anyio.CancelScope(shield=True):
                try:
                    await actor.on_failure(err)
                except Exception:
                    logger.exception("%s: on_failure raised", self.mailbox.actor_name)
            if err is not failure and isinstance(err, Exception):
                raise err from None
            raise
        return stop

    async def serve(self) -> Header | None:
        """Handle messages until a stop request; return it (after draining what is queued)."""
        handling_address.set(self.mailbox.address)
        self._trace = open_trace_slot()
        mailbox = self.mailbox
        stop: Header | None = None
        while stop is None:
            if self._ahead:  # read while a handler ran (`unless_stopped`)
                items, self._ahead = self._ahead, []
            else:
                items = await mailbox.receive()
            self._batch = items
            stop = await self._handle_items(items)
            self._batch = _NO_ITEMS  # an idle actor keeps no run of messages alive
        # Everything already queued was accepted before the stop: handle it too.
        while items := self._ahead or mailbox.drain():
            self._ahead = []
            await self._handle_items(items)
        return stop

    async def unless_stopped(self, fn: Callable[[], Awaitable[None]]) -> bool:
        """Run ``fn``, a part of the running handler, unless a stop request has reached the
        mailbox, and cancel it as soon as one does.

        While ``fn`` runs, the mailbox is read ahead: what arrives is kept, in order, and
        handled after the running handler as it would have been; a stop request among it
        only cancels ``fn`` now. The reading stops when the mailbox's byte budget is full: a
        stop request behind that is seen when the handler returns, as any message is.

        Returns:
            Whether ``fn`` ran to its end (False: a stop request had arrived, and ``fn``
            did not run, or cut it short).
        """
        if self.stopping or _holds_stop(self._batch) or _holds_stop(self._ahead):
            return False
        with anyio.CancelScope() as scope:
            reader = asyncio.ensure_future(self._read_ahead(scope))
            try:
                await fn()
            finally:
                reader.cancel()
                # Shielded: the mailbox has one reader at a time, and it is back to the
                # serve loop once this returns.
                with anyio.CancelScope(shield=True):
                    await asyncio.wait((reader,))
                failed = None if reader.cancelled() else reader.exception()
        if failed is not None:  # reading failed (a broken mailbox): the handler fails
            raise failed
        return not scope.cancelled_caught

    async def _read_ahead(self, scope: anyio.CancelScope) -> None:
        """Read the mailbox into `_ahead` until a stop request comes (then cancel ``scope``)
        or the byte budget is full."""
        mailbox = self.mailbox
        while mailbox.has_room():
            items = await mailbox.receive()
            self._ahead += items
            if _holds_stop(items):
                scope.cancel()
                return

    async def _handle_items(self, items: list[Item]) -> Header | None:
        # Handler times are a sample: one drained run in `_SAMPLED_RUNS` goes through the
        # timed loop. The other runs take the loop with no clock at all, so measuring costs
        # the hot path a sixteenth of a clock read per message, whatever the load.
        clock = self._clock
        if clock is not None:
            self._runs += 1
            if not self._runs % _SAMPLED_RUNS:
                return await self._handle_timed(items, clock)
        mailbox = self.mailbox
        actor = self.actor
        handlers = self._handlers
        open_tell = mailbox.open
        trace = self._trace
        stop: Header | None = None
        for item in items:
            if type(item) is bytes:
                msg = open_tell(item)
                context = None
            elif type(item) is Traced:  # a traced tell of a bundle: its context current
                msg = open_tell(item.body)
                context = item.trace
            else:
                assert isinstance(item, Envelope)
                stop = await self._handle_framed(item) or stop
                continue
            if msg is None:
                continue
            fn, is_async = handlers[type(msg)]
            if context is not None:
                trace.trace = context
            try:
                if is_async:
                    await fn(msg)
                else:
                    fn(msg)
            except (Exception, CancelledError) as err:  # noqa: BLE001 - fails its message
                self._handler_failed(msg, err)
            finally:
                if context is not None:
                    trace.trace = ()
            if actor._failure is not None:
                raise actor._failure  # crash() was called: nothing more is handled
        return stop

    async def _handle_timed(self, items: list[Item], clock: Callable[[], int]) -> Header | None:
        """`_handle_items`, timing each handler: one clock read per message, as a handler
        ends where the next message's time begins."""
        mailbox = self.mailbox
        actor = self.actor
        handlers = self._handlers
        open_tell = mailbox.open
        trace = self._trace
        slots = self._handler_slots
        stop: Header | None = None
        spent = 0
        started = clock()
        for item in items:
            if type(item) is bytes or type(item) is Traced:
                if isinstance(item, Traced):
                    msg = open_tell(item.body)
                    context = item.trace
                else:
                    msg = open_tell(item)
                    context = ()
                if msg is None:
                    continue
                fn, is_async = handlers[type(msg)]
                trace.trace = context
                try:
                    if is_async:
                        await fn(msg)
                    else:
                        fn(msg)
                except (Exception, CancelledError) as err:  # noqa: BLE001 - fails its message
                    self._handler_failed(msg, err)
                finally:
                    trace.trace = ()
                ended = clock()
                took = ended - started
                slots[(took // 1000).bit_length()] += 1
                spent += took
                started = ended
                if actor._failure is not None:
                    raise actor._failure
                continue
            assert isinstance(item, Envelope)
            handled = item.header.kind in HANDLED_KINDS
            stop = await self._handle_framed(item) or stop
            ended = clock()
            if handled:
                took = ended - started
                slots[(took // 1000).bit_length()] += 1
                spent += took
            started = ended
        self._handler_ns += spent
        return stop

    def _handler_failed(self, msg: Message, err: BaseException) -> None:
        """Count and log the failure of a handler (raise ``err`` on when it is the actor's
        own cancellation)."""
        if _own_cancellation(err):
            raise err
        self.mailbox.fail()
        self._errors.error(
            "%s: handler of %s raised", self.mailbox.actor_name, type(msg).__name__, exc_info=err
        )

    async def _handle_framed(self, item: Envelope) -> Header | None:
        """Handle an ask or a control message; return it if it is a stop request."""
        mailbox = self.mailbox
        actor = self.actor
        mailbox.take(item)
        header = item.header
        kind = header.kind
        if kind is Kind.TELL:
            await self._handle_traced(item)
            if actor._failure is not None:
                raise actor._failure
        elif kind is Kind.ASK:
            await self._handle_ask(item)
            if actor._failure is not None:
                raise actor._failure
        elif kind is Kind.FLUSH:
            # A sender about to exit: everything it sent before this is handled.
            await self._reply(header, None)
        elif kind is Kind.STOP:
            self.stopping = True
            return header
        elif kind is Kind.STATS:
            await self._reply(header, mailbox.statistics())
        elif kind is Kind.METRICS:
            query = item.message
            # A peer's number, kept to what a gathering may take; an empty body (a sender
            # from before `MetricsQuery`) waits the default itself: its share of it.
            timeout: float | None = DEFAULT_GATHER_TIMEOUT * NESTED_GATHER_SHARE
            if isinstance(query, MetricsQuery):
                timeout = query.timeout if 0 < query.timeout <= _MOST_GATHER_TIMEOUT else None
            try:
                gathered = await actor.system.gather_metrics(timeout)
            except Exception as err:  # noqa: BLE001 - the asker's failure, not this actor's
                await self._reply_error(header, ErrorBody.of(err))
            else:
                await self._reply(header, gathered)
        elif kind is Kind.LOOKUP and isinstance(item.message, LookupQuery):
            query = item.message
            try:
                found = await actor.system.lookup(
                    query.name, timeout=query.search_time(), missing_ok=True
                )
            except AskTimeoutError as err:  # the asker's search is incomplete too
                await self._reply_error(header, ErrorBody.of(err))
            else:
                await self._reply(header, LookupReply(ref=found))
        return None

    async def _handle_traced(self, envelope: Envelope) -> None:
        """A tell with trace context: its handler runs with the context current."""
        msg = self.mailbox.open_body(envelope)
        if isinstance(msg, ErrorBody):  # refused (counted and logged): nobody to tell
            return
        fn, is_async = self._handlers[type(msg)]
        self._trace.trace = envelope.header.trace
        try:
            if is_async:
                await fn(msg)
            else:
                fn(msg)
        except (Exception, CancelledError) as err:  # noqa: BLE001 - fails its message
            self._handler_failed(msg, err)
        finally:
            self._trace.trace = ()

    async def _handle_ask(self, envelope: Envelope) -> None:
        header = envelope.header
        msg = self.mailbox.open_body(envelope)
        if isinstance(msg, ErrorBody):  # refused (counted and logged): the asker is told
            await self._reply_error(header, msg)
            return
        fn, is_async, allowed = self._asks[type(msg)]
        self._trace.trace = header.trace
        try:
            result = await fn(msg) if is_async else fn(msg)
        except (Exception, CancelledError) as err:  # the asker gets the error as data
            if _own_cancellation(err):
                raise
            self.mailbox.fail()
            logger.debug("%s: handler of %s raised", self.mailbox.actor_name, type(msg).__name__)
            await self._reply_error(header, ErrorBody.of(err))
            return
        finally:
            self._trace.trace = ()
        if allowed is not None and not isinstance(result, allowed):
            names = " | ".join("None" if c is type(None) else c.__qualname__ for c in allowed)
            await self._refuse_reply(
                header,
                ProtocolError(
                    f"the handler of {type(msg).__qualname__} returned "
                    f"{type(result).__qualname__}, but {type(msg).__qualname__} is a request "
                    f"answered with {names}"
                ),
            )
            return
        await self._reply(header, result)

    async def _reply(self, header: Header, result: object) -> None:
        try:
            await self.station.reply(header, result)
        except ProtocolError as err:  # not a Message, unencodable, too big: say so
            await self._refuse_reply(header, err)
        except TokenyardError as err:
            self._unreachable(header, err)

    async def _refuse_reply(self, header: Header, err: ProtocolError) -> None:
        """A handler's answer that cannot go to its asker: its message failed, and the
        asker gets ``err`` instead."""
        self.mailbox.fail()
        self._errors.error("%s: %s", self.mailbox.actor_name, err)
        await self._reply_error(header, ErrorBody.of(err))

    async def _reply_error(self, header: Header, body: ErrorBody) -> None:
        try:
            await self.station.reply_error(header, body)
        except TokenyardError as err:
            self._unreachable(header, err)

    def _unreachable(self, header: Header, err: TokenyardError) -> None:
        # The asker is unreachable (gone, or its inbox stayed full): it will time out or
        # learn of the failure some other way; this actor carries on.
        self._errors.warning(
            "%s: could not reply to %s: %s", self.mailbox.actor_name, header.sender, err
        )


async def live(
    cell: Cell,
    on_ready: Callable[[], Awaitable[None]],
    stop_children: Callable[[], Awaitable[None]],
) -> Ending:
    """Live an actor's whole life in ``cell`` and say how it ended.

    Args:
        cell: The actor, its mailbox and station.
        on_ready: Reports the actor ready (after ``on_start``).
        stop_children: Stops the actors this one started, whatever its ending: a dead
            supervisor leaves no child unsupervised.

    Returns:
        The ending; the mailbox is closed and the children stopped by then.
    """
    started = False

    async def ready() -> None:
        nonlocal started
        await on_ready()
        started = True

    cancelled = anyio.get_cancelled_exc_class()
    try:
        stop = await cell.run(ready)
    except (cancelled, GeneratorExit):
        raise
    except BaseException as err:  # SystemExit too: the actor's death, not its host's
        if isinstance(err, BaseExceptionGroup) and err.split(cancelled)[1] is None:
            raise  # cancelled, in a group
        sole = sole_error(err)
        if isinstance(sole, SystemExit) and sole.code in (None, 0):
            ending = Ending(started)  # it asked to end, as a process exiting with 0 does
        else:
            ending = Ending(started, error=err)
    else:
        ending = Ending(started, stop=stop)
    finally:
        cell.mailbox.close()
        with anyio.CancelScope(shield=True):
            await stop_children()
    return ending
