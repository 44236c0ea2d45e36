"""Which station sends for the running code, and for which trace: the bottom of the runtime,
importing none of it.

Refs find the station of their process here, so ``_ref`` needs nothing above it. A station makes
itself current when its system opens; code running in tasks the system did not start (a
web framework's request handlers) falls back to the most recently opened station.

The trace context of the message being handled lives here too: the cell sets it around a
traced message's handler, and `current_trace` reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from typing import TYPE_CHECKING, Any, Protocol

from ._errors import MailboxClosedError, ProtocolError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._message import Message

#: A tell as it goes on the wire: one frame, or a header and the body when it is traced.
Frames = bytes | tuple[bytes | bytearray, bytes]


class RefLike(Protocol):
    """What a station needs of a ref to send through it."""

    @property
    def name(self) -> str:
        """The actor's name."""
        ...

    @property
    def address(self) -> str:
        """Where its mailbox listens."""
        ...

    @property
    def incarnation(self) -> int:
        """Which start of that name."""
        ...

    @property
    def owner(self) -> str:
        """The reply address of the station that watches it."""
        ...


class Sender(Protocol):
    """The part of a station that refs send through."""

    @property
    def closed(self) -> bool:
        """Whether the station's system has closed."""
        ...

    @property
    def thread(self) -> int:
        """The thread whose event loop the station runs in (`threading.get_ident`)."""
        ...

    @property
    def name(self) -> str:
        """Its system's name."""
        ...

    @property
    def reply_address(self) -> str:
        """Its reply inbox: the owner of the actors its system starts in this process."""
        ...

    @property
    def cookie(self) -> bytes:
        """Its system's cookie, the same in every member of that system."""
        ...

    def try_tell(self, ref: RefLike, msg: Message, trace: Sequence[str] = ()) -> Frames | None:
        """Send a tell if the mailbox has room now; else return its encoded frames."""
        ...

    async def tell_when_room(self, ref: RefLike, frames: Frames, timeout: float | None) -> None:
        """Send an encoded tell, waiting while the mailbox is full."""
        ...

    async def ask(
        self, ref: RefLike, msg: Message, timeout: float, trace: Sequence[str] = ()
    ) -> Any:
        """Ask and wait for the reply."""
        ...

    async def send_stop(self, ref: RefLike) -> None:
        """Ask ``ref`` to stop gracefully."""
        ...

    def abandon(self) -> None:
        """In a process forked from the one that opened it: count as closed here, touching
        nothing (its sockets and their threads are the parent's)."""
        ...


_current: contextvars.ContextVar[Sender] = contextvars.ContextVar("tokenyard_station")
_thread = threading.get_ident
_open: list[Sender] = []
#: Whether this process was forked from one with a system open (then still open there).
_forked_open = False


def _after_fork_in_child() -> None:
    """A forked process inherits the open systems as copies, without libzmq's threads: a
    send through one hung on its first socket call (or failed on a future of the parent's
    loop). They are the parent's: here each counts as closed, and refs say why."""
    global _forked_open
    _forked_open = bool(_open)
    for station in _open:
        station.abandon()
    _open.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)

#: Address of the mailbox whose handler is running in this task, to refuse a self-ask.
handling_address: contextvars.ContextVar[str] = contextvars.ContextVar("tokenyard_handling")


class TraceSlot:
    """The trace context of the message a cell is handling now, read by `current_trace`.

    Each cell makes its own slot current once, in the task that runs its handlers, and
    writes a traced message's context into it around the handler (``()`` after): two
    attribute stores per traced message, where a context variable set and reset around
    every one cost a traced tell a sixth of its receiving time, measured.

    Attributes:
        trace: The contexts (``()``: none).
    """

    __slots__ = ("trace",)

    def __init__(self) -> None:
        self.trace: tuple[str, ...] = ()


#: Current outside any cell, and in the tasks an actor starts (never written).
_NO_TRACE = TraceSlot()
_trace: contextvars.ContextVar[TraceSlot] = contextvars.ContextVar(
    "tokenyard_trace", default=_NO_TRACE
)


def open_trace_slot() -> TraceSlot:
    """Make a new, empty slot current in this task (a cell's, before it handles anything)."""
    slot = TraceSlot()
    _trace.set(slot)
    return slot


def leave_traces() -> None:
    """Make no trace context current in this task again (a task an actor starts: it would
    otherwise share its starter's slot, and report whichever message is handled then)."""
    _trace.set(_NO_TRACE)


def current_trace() -> tuple[str, ...]:
    """The trace context the message being handled came with, from its frame header.

    What a sender passed as ``trace=`` to ``tell`` or ``ask``: one W3C ``traceparent`` for
    a message about one request, one per request for a batch, in the order the batch lists
    them (``""`` for an untraced one). The runtime carries it and never reads it.

    Returns:
        The contexts; empty when the message came with none, or outside a handler (a
        task an actor starts with ``start_soon`` from a handler included). A task
        started some other way from a handler, and still running once the handler has
        returned, reads the context of whatever message its actor is handling then.
    """
    return _trace.get().trace


def current_station() -> Sender:
    """The station that sends on behalf of the running code.

    Raises:
        MailboxClosedError: No actor system is open in this process, or none in this thread
            (a system's sockets are its event loop's alone).
    """
    station = _current.get(None)
    thread = _thread()
    if station is not None and not station.closed and station.thread == thread:
        return station
    if not _open:
        if _forked_open:
            raise MailboxClosedError(
                "no ActorSystem is open in this process: it was forked from a process with "
                "one open, whose sockets are that process's alone; send from there, or open "
                "an ActorSystem in this one"
            )
        raise MailboxClosedError(
            "no ActorSystem is open in this process: use `async with ActorSystem()`"
        )
    for station in reversed(_open):
        if station.thread == thread:
            return station
    # Its sockets are its event loop's alone (zmq sockets are not thread-safe); a thread
    # started from its loop (``to_thread``) has its context, so its station, but not its loop.
    raise MailboxClosedError(
        "no ActorSystem is open in this thread: the open one runs in another thread's event "
        "loop; send from that loop (asyncio.run_coroutine_threadsafe, anyio.from_thread)"
    )


def refuse_another_systems(ref: RefLike, through: str) -> None:
    """Refuse to send to ``ref`` through the station at ``through`` when another system
    open in this process owns it: no frame of one system reaches another's actors (over
    ipc its directory is not this one's; over tcp its mailbox refuses this system's keys),
    so a tell was lost, an ask timed out, and the owner logged a stranger's keys. A member
    of the same system (attached, or a node) shares its cookie, and sends.

    Asked once per address, where a process first subscribes to a death (its first tell or
    ask to it), never on the hot path.

    Raises:
        ProtocolError: It is another open system's.
    """
    stations = {station.reply_address: station for station in _open}
    owner, sender = stations.get(ref.owner), stations.get(through)
    if owner is None or sender is None or owner.cookie == sender.cookie:
        return
    raise ProtocolError(
        f"actor {ref.name!r} is of ActorSystem {owner.name!r}, not of {sender.name!r}, "
        "which this task sends through (a task sends through the system it opened last, "
        "or else the one opened last in the process); a system reaches only its own "
        f"actors: send to it from a task where {owner.name!r} is current (one of its "
        f"actors, or a task started before {sender.name!r} opened)"
    )


def enter(station: Sender) -> contextvars.Token[Sender]:
    """Make ``node`` current in this context and the fallback for others."""
    _open.append(station)
    return _current.set(station)


def leave(station: Sender, token: contextvars.Token[Sender] | None) -> None:
    """Undo `enter` (from any context: a closed station is skipped anyway)."""
    if station in _open:
        _open.remove(station)
    if token is not None:
        # Closed from another context than the opening one, reset fails: current_station()
        # skips a closed station anyway.
        with contextlib.suppress(ValueError):
            _current.reset(token)
