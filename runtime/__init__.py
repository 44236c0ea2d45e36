"""tokenyard's actor runtime: typed msgspec mailboxes over ZeroMQ, refs, processes.

Import everything from here: ``from runtime import Actor, ActorSystem, Message, handler``.
"""

from __future__ import annotations

from ._actor import Actor as Actor
from ._actor import handler as handler
from ._batch import Batch as Batch
from ._errors import ActorDeadError as ActorDeadError
from ._errors import AskTimeoutError as AskTimeoutError
from ._errors import MailboxClosedError as MailboxClosedError
from ._errors import MailboxFullError as MailboxFullError
from ._errors import ProtocolError as ProtocolError
from ._errors import RemoteActorError as RemoteActorError
from ._errors import SpawnError as SpawnError
from ._errors import TokenyardError as TokenyardError
from ._mailbox import MailboxStatistics as MailboxStatistics
from ._message import Message as Message
from ._message import publish as _publish
from ._ref import ActorRef as ActorRef
from ._system import ActorSystem as ActorSystem
from ._system import Watch as Watch
from ._watch import Down as Down

__all__ = (
    "Actor",
    "ActorDeadError",
    "ActorRef",
    "ActorSystem",
    "AskTimeoutError",
    "Batch",
    "Down",
    "MailboxClosedError",
    "MailboxFullError",
    "MailboxStatistics",
    "Message",
    "ProtocolError",
    "RemoteActorError",
    "SpawnError",
    "TokenyardError",
    "Watch",
    "handler",
)

_publish(__name__, globals(), __all__)
