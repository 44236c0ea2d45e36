"""The error tree: one root, each subclass also the builtin a caller would expect."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable

_T = TypeVar("_T")


class TokenyardError(Exception):
    """Root of every error tokenyard raises on purpose."""


class AskTimeoutError(TokenyardError, TimeoutError):
    """An ``ask`` got no reply within its timeout."""


class MailboxFullError(TokenyardError, TimeoutError):
    """A ``tell`` could not enqueue: the mailbox stayed at its high-water mark too long."""


class ActorDeadError(TokenyardError):
    """The actor (this incarnation of it) is dead; nothing sent to it will be handled.

    Attributes:
        reason: Why it died, as the ``Down`` notification said, when known.
    """

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class RemoteActorError(TokenyardError):
    """A handler raised: the remote exception, carried back as data (never pickled).

    Attributes:
        type_name: Qualified name of the remote exception's class.
        remote_message: ``str()`` of the remote exception.
        remote_traceback: The formatted remote traceback.
    """

    def __init__(self, type_name: str, remote_message: str, remote_traceback: str) -> None:
        super().__init__(f"{type_name}: {remote_message}")
        self.type_name = type_name
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        return f"{self.type_name}: {self.remote_message}\n--- remote traceback ---\n" + (
            self.remote_traceback
        )


class ActorNotFoundError(TokenyardError, LookupError):
    """No live actor has the name that was looked up."""


class SpawnError(TokenyardError):
    """An actor could not be started (bad arguments, import failure, ``on_start`` raised)."""


class ProtocolError(TokenyardError):
    """A message broke the wire or batch contract (undecodable, wrong type, bad lengths)."""


class MailboxClosedError(TokenyardError):
    """The mailbox (or the system owning it) is closed."""


def sole_error(err: BaseException) -> BaseException:
    """The one error inside nested single-member exception groups (task groups wrap what
    they raise), or ``err`` itself: what a reason or a SpawnError should name."""
    while isinstance(err, BaseExceptionGroup):
        distinct = {id(e): e for e in err.exceptions}  # one error raised twice is one
        if len(distinct) != 1:
            break
        err = next(iter(distinct.values()))
    return err


async def run_to_its_end(task: asyncio.Future[Any]) -> bool:
    """Wait until ``task`` is done, however the caller is cancelled meanwhile; whether it
    was (the caller raises its cancellation once it has dealt with what ``task`` did).

    A shielded cancel scope holds off anyio's cancellation only: asyncio's own
    (``Task.cancel``, as ``asyncio.timeout`` and ``wait_for`` do it) passes it, and what
    the scope guarded was left half done.
    """
    cancelled = False
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.wait((task,))
            except asyncio.CancelledError:
                cancelled = True
    return cancelled


async def to_its_end(awaitable: Awaitable[_T]) -> _T:
    """Await ``awaitable`` in a task of its own, to its end however the caller is
    cancelled meanwhile (`run_to_its_end`), and return its result; or raise the caller's
    cancellation once it is done (what it raised comes first)."""
    task = asyncio.ensure_future(awaitable)
    cancelled = await run_to_its_end(task)
    result = task.result()
    if cancelled:
        raise asyncio.CancelledError
    return result
