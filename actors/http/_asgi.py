"""ASGI plumbing: bounded body reading and JSON responses, with no framework in between."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from ._errors import HTTPError, new_request_id

if TYPE_CHECKING:
    from anyio import CancelScope

__all__ = (
    "ClientGoneError",
    "Receive",
    "Scope",
    "Send",
    "header",
    "read_body",
    "request_id",
    "send_error",
    "send_json",
    "until_disconnect",
)

Scope = MutableMapping[str, Any]
"""An ASGI connection scope."""
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
"""An ASGI ``receive`` callable."""
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
"""An ASGI ``send`` callable."""

_T = TypeVar("_T")
_JSON = b"application/json"
_CLOSE = ((b"connection", b"close"),)
# What may be echoed in a response header as it came: visible ASCII, nothing else.
_VISIBLE = re.compile(rb"[\x21-\x7e]+")


class ClientGoneError(Exception):
    """The client disconnected before its request was answered: nobody is left to answer."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of the request header ``name`` (lower case), or ``None``."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def request_id(scope: Scope, limit: int) -> bytes:
    """The request's ``X-Request-Id`` when it is 1 to ``limit`` visible ASCII characters;
    otherwise (none, too long, a space, a control or non-ASCII byte) a new one, a uuid4's
    32 hex digits."""
    given = header(scope, b"x-request-id")
    if given is not None and len(given) <= limit and _VISIBLE.fullmatch(given):
        return given
    return new_request_id()


def _check_body_headers(scope: Scope) -> None:
    """A body must be JSON, uncompressed; a request naming no content type is read as JSON
    (curl users). A compressed body was read as it came, and refused as JSON that is not."""
    content_type = header(scope, b"content-type")
    media = b"" if content_type is None else content_type.split(b";", 1)[0].strip().lower()
    if media and media != _JSON:
        shown = media.decode("latin-1")
        raise _unsupported_media(
            f"the request body must be JSON (Content-Type: application/json), not {shown!r}"
        )
    encoding = header(scope, b"content-encoding")
    if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
        shown = encoding.decode("latin-1")
        raise _unsupported_media(
            f"the request body must not be encoded (Content-Encoding: {shown!r}): send it as "
            "plain JSON"
        )
    transfer = header(scope, b"transfer-encoding")
    if transfer is not None:
        codings = [c.strip().lower() for c in transfer.split(b",")]
        if any(c != b"chunked" for c in codings):
            shown = transfer.decode("latin-1")
            raise HTTPError(
                501,
                f"the only transfer coding served is chunked, not {shown!r}",
                code="not_implemented",
                close=True,
            )


def _unsupported_media(message: str) -> HTTPError:
    return HTTPError(415, message, code="unsupported_media_type", close=True)


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request's JSON body, read up to ``limit`` bytes.

    Raises:
        HTTPError: 415 for a body that is not JSON or is compressed (Content-Encoding); 501
            for a transfer coding other than chunked; 413 as soon as the body passes
            ``limit`` (by its Content-Length, before anything is read, or while it is
            read): the rest is never read, and the connection closes after the answer.
        ClientGoneError: The client disconnected meanwhile.
    """
    _check_body_headers(scope)
    declared = header(scope, b"content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise HTTPError(400, "the Content-Length header is not a number", close=True) from None
        if length > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGoneError
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> HTTPError:
    return HTTPError(
        413,
        f"the request body is larger than {limit} bytes (ServeConfig.max_body_bytes)",
        code="request_too_large",
        close=True,
    )


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Answer with one JSON body."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", _JSON),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, err: HTTPError) -> None:
    """Answer with an OpenAI-shaped error body."""
    headers = err.headers + _CLOSE if err.close else err.headers
    await send_json(send, err.status, err.body(), headers)


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``work`` until it ends or the client disconnects, whichever comes first.

    Raises:
        ClientGoneError: The client disconnected; ``work`` was cancelled.
    """
    outcome: list[_T] = []
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch_disconnect, receive, tg.cancel_scope)
        try:
            outcome.append(await work())
        # Re-raised below: raised inside the task group it would come out wrapped in an
        # exception group.
        except Exception as err:  # noqa: BLE001
            failure = err
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if not outcome:
        raise ClientGoneError
    return outcome[0]


async def _watch_disconnect(receive: Receive, scope: CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
