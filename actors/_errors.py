"""Errors the pipeline raises to its callers, and the one rule that decides when a request
a member's death cost is started again instead (`resubmittable`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime import TokenyardError

if TYPE_CHECKING:
    from .messages import Member

#: How many times one request is started again after a member's death cost it its output.
MAX_RESUBMITS = 3


def resubmittable(lost_to: Member | None, delivered: bool, resubmits: int) -> bool:
    """Whether a request whose attempt failed is started again rather than failed: the rule
    of every door into the pipeline (`actors.Pipeline`'s callers, an HTTP worker's engine).

    It is when the attempt was lost to a member's death (``lost_to``: a refusal is final),
    nothing of it reached the caller (``delivered``: text once sent cannot be taken back),
    and it was started again fewer than `MAX_RESUBMITS` times (``resubmits``).
    """
    return lost_to is not None and not delivered and resubmits < MAX_RESUBMITS


class WorkerDiedError(TokenyardError):
    """The pipeline member serving a request died (or was killed as stuck) after output had
    reached the caller, so the request could not be resubmitted transparently.

    Attributes:
        rid: The request.
        member: Which member died.
        reason: The death's reason.
    """

    def __init__(self, rid: str, member: Member, reason: str) -> None:
        super().__init__(f"request {rid!r} lost its {member.value}: {reason}")
        self.rid = rid
        self.member = member
        self.reason = reason


class RequestFailedError(TokenyardError):
    """The pipeline refused or failed a request (an empty prompt, a limit, an overloaded
    scheduler, ...): the message says why.

    Attributes:
        rid: The request.
        reason: Why.
    """

    def __init__(self, rid: str, reason: str) -> None:
        super().__init__(f"request {rid!r} failed: {reason}")
        self.rid = rid
        self.reason = reason


class InvalidRequestError(TokenyardError, ValueError):
    """A request breaks a limit of the pipeline; refused before it was sent."""


class SlowReaderError(TokenyardError):
    """A stream's reader fell further behind than ``max_stream_buffer`` bytes: the request
    was aborted (the engine stopped generating for it) rather than buffered without bound."""


class PipelineBusyError(TokenyardError, TimeoutError):
    """No worker took a request in time: every live worker's mailbox stayed full."""


class PipelineClosedError(TokenyardError):
    """The pipeline was closed (or is closing) while a request waited."""
