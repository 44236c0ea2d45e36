"""tokenyard's actor runtime: typed msgspec mailboxes over ZeroMQ, refs, processes.

Import everything from here: ``from runtime import Actor, ActorSystem, Message, handler``.
"""

from __future__ import annotations

from ._actor import Actor as Actor
from ._actor import SystemHandle as SystemHandle
from ._actor import handler as handler
from ._auth import Keys as Keys
from ._batch import Batch as Batch
from ._collector import CollectorMessage as CollectorMessage
from ._collector import GetMetrics as GetMetrics
from ._collector import MetricsCollector as MetricsCollector
from ._context import current_trace as current_trace
from ._credentials import Credentials as Credentials
from ._errors import ActorDeadError as ActorDeadError
from ._errors import ActorNotFoundError as ActorNotFoundError
from ._errors import AskTimeoutError as AskTimeoutError
from ._errors import MailboxClosedError as MailboxClosedError
from ._errors import MailboxFullError as MailboxFullError
from ._errors import ProtocolError as ProtocolError
from ._errors import RemoteActorError as RemoteActorError
from ._errors import SpawnError as SpawnError
from ._errors import TokenyardError as TokenyardError
from ._logging import configure_logging as configure_logging
from ._mailbox import MailboxStatistics as MailboxStatistics
from ._message import Message as Message
from ._message import Request as Request
from ._message import publish as publish
from ._protocol import Cause as Cause
from ._protocol import Down as Down
from ._protocol import StartMethod as StartMethod
from ._ref import ActorRef as ActorRef
from ._stats import ActorMetrics as ActorMetrics
from ._stats import ChildRecord as ChildRecord
from ._stats import DeadIncarnation as DeadIncarnation
from ._stats import ProcessMetrics as ProcessMetrics
from ._stats import ProcessResources as ProcessResources
from ._stats import SystemMetrics as SystemMetrics
from ._supervisor import Children as Children
from ._supervisor import ChildSpec as ChildSpec
from ._supervisor import GetSupervisorStatistics as GetSupervisorStatistics
from ._supervisor import Restart as Restart
from ._supervisor import RestartIntensityError as RestartIntensityError
from ._supervisor import Strategy as Strategy
from ._supervisor import Supervisor as Supervisor
from ._supervisor import SupervisorMessage as SupervisorMessage
from ._supervisor import SupervisorStatistics as SupervisorStatistics
from ._supervisor import WhichChildren as WhichChildren
from ._system import ActorSystem as ActorSystem
from ._throttle import Throttle as Throttle
from ._transport import raise_fd_limit as raise_fd_limit
from ._watch import Watch as Watch

__all__ = (
    "Actor",
    "ActorDeadError",
    "ActorMetrics",
    "ActorNotFoundError",
    "ActorRef",
    "ActorSystem",
    "AskTimeoutError",
    "Batch",
    "Cause",
    "ChildRecord",
    "ChildSpec",
    "Children",
    "CollectorMessage",
    "Credentials",
    "DeadIncarnation",
    "Down",
    "GetMetrics",
    "GetSupervisorStatistics",
    "Keys",
    "MailboxClosedError",
    "MailboxFullError",
    "MailboxStatistics",
    "Message",
    "MetricsCollector",
    "ProcessMetrics",
    "ProcessResources",
    "ProtocolError",
    "RemoteActorError",
    "Request",
    "Restart",
    "RestartIntensityError",
    "SpawnError",
    "StartMethod",
    "Strategy",
    "Supervisor",
    "SupervisorMessage",
    "SupervisorStatistics",
    "SystemHandle",
    "SystemMetrics",
    "Throttle",
    "TokenyardError",
    "Watch",
    "WhichChildren",
    "configure_logging",
    "current_trace",
    "handler",
    "publish",
    "raise_fd_limit",
)

publish(__name__, globals(), __all__)
