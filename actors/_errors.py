"""Errors the pipeline raises to its callers."""

from __future__ import annotations

from runtime import TokenyardError


class WorkerDiedError(TokenyardError):
    """The pipeline member serving a request died after output had reached the caller, so
    the request could not be resubmitted transparently.

    Attributes:
        rid: The request.
        member: Which member died (``"worker"``, ``"detokenizer"``, ``"scheduler"``).
        reason: The death's reason.
    """

    def __init__(self, rid: str, member: str, reason: str) -> None:
        super().__init__(f"request {rid!r} lost its {member}: {reason}")
        self.rid = rid
        self.member = member
        self.reason = reason


class PipelineClosedError(TokenyardError):
    """The pipeline was closed (or is closing) while a request waited."""
