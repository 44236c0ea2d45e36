"""``ActorRef``: the address of one incarnation of an actor, and the way to message it."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from ._message import Message
from ._node import current_node

M = TypeVar("M", bound=Message)


class ActorRef(msgspec.Struct, Generic[M], frozen=True, array_like=True):
    """A handle on one incarnation of an actor.

    A ref is itself a ``msgspec.Struct``: put it in a message and the receiver can use it.
    Sending through a ref uses the actor system running in the sending process.

    Attributes:
        name: The actor's name.
        address: Where its mailbox listens (``ipc://`` or ``tcp://``).
        incarnation: Tells restarts of the same name apart; a message sent through a ref
            never reaches another incarnation.
        owner: Reply address of the node that started it: where its death is known first
            (an asker elsewhere subscribes there, so a pending ask fails as soon as it dies).
    """

    name: str
    address: str
    incarnation: int = 0
    owner: str = ""

    async def tell(self, msg: M, *, timeout: float | None = None) -> None:
        """Send ``msg`` one-way.

        Args:
            msg: A message the actor accepts.
            timeout: Seconds to wait while the mailbox is full (default: the system's
                ``send_timeout``).

        Raises:
            MailboxFullError: The mailbox stayed full for ``timeout`` seconds.
            ActorDeadError: This incarnation is known to be dead.
        """
        node = current_node()
        frame = node.try_tell(self, msg)
        if frame is not None:  # the mailbox is full: wait for room, up to the timeout
            await node.outbox.send(self.address, frame, timeout, lambda: node.check_alive(self))

    async def ask(self, msg: M, *, timeout: float = 5.0) -> Any:
        """Send ``msg`` and wait for the handler's return value.

        Args:
            msg: A message the actor accepts.
            timeout: Seconds to wait for the reply.

        Returns:
            The handler's return value (a ``Message``, or ``None``).

        Raises:
            AskTimeoutError: No reply within ``timeout`` seconds.
            RemoteActorError: The handler raised; carries the remote type, text, traceback.
            ActorDeadError: The actor died before replying.
        """
        return await current_node().ask(self, msg, timeout)
