"""``ActorRef``: the address of one incarnation of an actor, and the way to message it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec

from ._context import current_station
from ._message import Message, Request

if TYPE_CHECKING:
    from collections.abc import Sequence

#: Contravariant: a ref that accepts ``A | B`` serves wherever one accepting ``A`` is asked for.
M = TypeVar("M", bound=Message, contravariant=True)
R = TypeVar("R")


class ActorRef(msgspec.Struct, Generic[M], frozen=True, array_like=True):
    """A handle on one incarnation of an actor, generic in the messages it accepts.

    ``ActorRef[A | B]`` takes an ``A`` or a ``B`` in ``tell``; ``spawn`` returns the ref
    typed with the union the actor class declares (``class Echo(Actor[A | B])``).
    A ref is itself a ``msgspec.Struct``: put it in a message and the receiver can use it.
    Sending through a ref uses the actor system running in the sending process.

    Attributes:
        name: The actor's name.
        address: Where its mailbox listens (``ipc://`` or ``tcp://``).
        incarnation: Tells restarts of the same name apart; a message sent through a ref
            never reaches another incarnation.
        owner: Reply address of the station that started it: where its death is known first
            (an asker elsewhere subscribes there, so a pending ask fails as soon as it dies).
    """

    name: str
    address: str
    incarnation: int = 0
    owner: str = ""

    async def tell(
        self, msg: M, *, timeout: float | None = None, trace: Sequence[str] = ()
    ) -> None:
        """Send ``msg`` one-way.

        Args:
            msg: A message the actor accepts.
            timeout: Seconds to wait while the mailbox is full (default: the system's
                ``send_timeout``).
            trace: Trace context for the frame header, read by the handler with
                `runtime.current_trace`: a W3C ``traceparent`` (a string is one context),
                or one per request of a batch, at most 65,536 of 512 characters each.
                Empty (the default): no header, the message travels as one frame.

        Raises:
            MailboxFullError: The mailbox stayed full for ``timeout`` seconds.
            ActorDeadError: This incarnation is known to be dead.
            ProtocolError: ``trace`` is over its bounds, or the message is larger than
                ``max_message_size``.
            TypeError: msgspec cannot encode ``msg`` (a field of a type it does not
                know, an int outside 64 bits).
            ValueError: ``timeout`` is NaN (refused when the tell would wait).
        """
        station = current_station()
        frames = station.try_tell(self, msg, trace)
        if frames is not None:  # the mailbox is full: wait for room, up to the timeout
            await station.tell_when_room(self, frames, timeout)

    def try_tell(self, msg: M, *, trace: Sequence[str] = ()) -> bool:
        """Send ``msg`` one-way if the mailbox has room now; never waits.

        Args:
            msg: A message the actor accepts.
            trace: Trace context for the frame header, as for `tell`.

        Returns:
            Whether it was queued (``False``: the mailbox is full; nothing was sent).

        Raises:
            ActorDeadError: This incarnation is known to be dead.
            ProtocolError: ``trace`` is over its bounds, or the message is larger than
                ``max_message_size``.
            TypeError: msgspec cannot encode ``msg`` (a field of a type it does not
                know, an int outside 64 bits).
        """
        return current_station().try_tell(self, msg, trace) is None

    async def ask(self, msg: Request[R], *, timeout: float = 5.0, trace: Sequence[str] = ()) -> R:
        """Send ``msg`` and wait for the handler's return value.

        Args:
            msg: A request the actor accepts; ``Request[R]`` names the reply type ``R``.
            timeout: Seconds to wait for the reply.
            trace: Trace context for the frame header, as for `tell`.

        Returns:
            The handler's return value, an ``R``.

        Raises:
            AskTimeoutError: No reply within ``timeout`` seconds.
            RemoteActorError: The handler raised; carries the remote type, text, traceback.
            ActorDeadError: The actor died before replying.
            ProtocolError: ``trace`` is over its bounds, or the message is larger than
                ``max_message_size``.
            TypeError: ``msg`` is not a ``Request`` (a plain ``Message`` names no reply:
                `tell` it), or msgspec cannot encode it (a field of a type it does not
                know, an int outside 64 bits).
            ValueError: ``timeout`` is NaN.
        """
        if not isinstance(msg, Request):
            # Only mypy refused it: asked, its handler's None came back as the reply.
            raise TypeError(
                f"ask({type(msg).__name__}) to actor {self.name!r}: only a Request is "
                "asked (class X(Request[Reply]) names its reply); a message with no "
                "reply is told: use tell"
            )
        reply: R = await current_station().ask(self, msg, timeout, trace)
        return reply
