"""``HTTPError``: a refusal on its way to the client as an OpenAI-shaped JSON error."""

from __future__ import annotations

import http
import re
import uuid

import msgspec

from ._engine import EngineError, EngineRefusedError, EngineUnavailableError
from ._openai import ErrorDetail, ErrorResponse

__all__ = ("HTTPError", "engine_failure", "from_validation_error", "new_request_id")

_ENCODE = msgspec.json.Encoder().encode
# msgspec ends a validation message with the path of the value it rejected.
_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`")


def new_request_id() -> bytes:
    """A new ``X-Request-Id``: a uuid4's 32 hex digits."""
    return uuid.uuid4().hex.encode()


class HTTPError(Exception):
    """A request refused (4xx) or failed (5xx), answered with an OpenAI error body.

    Args:
        status: The HTTP status.
        message: What failed, with which value, and what to do instead.
        kind: OpenAI's error ``type``: ``invalid_request_error`` for a 4xx, ``server_error``
            for a 5xx unless given.
        param: The request field at fault, if one is.
        code: A machine-readable code (``model_not_found``, ``context_length_exceeded``...).
        headers: Extra response headers (``allow``, ``retry-after``).
        close: Close the connection after the answer (the body was left unread).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers
        self.close = close

    def body(self) -> bytes:
        """The JSON error body."""
        detail = ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.code)
        return _ENCODE(ErrorResponse(error=detail))

    def response(self, request_id: bytes | None = None) -> bytes:
        """The whole HTTP/1.1 answer, closing the connection: for a refusal written where no
        application runs (the port's owner, the connection's own parser).

        Args:
            request_id: Its ``X-Request-Id`` (``None``: a new one), which every answer
                carries, these included.
        """
        body = self.body()
        try:
            reason = http.HTTPStatus(self.status).phrase
        except ValueError:
            reason = ""
        lines = [
            f"HTTP/1.1 {self.status} {reason}".encode("latin-1"),
            b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(),
            *(name + b": " + value for name, value in self.headers),
            b"x-request-id: " + (request_id or new_request_id()),
            b"connection: close",
        ]
        return b"\r\n".join(lines) + b"\r\n\r\n" + body


def from_validation_error(err: msgspec.ValidationError) -> HTTPError:
    """A 400 for a body msgspec refused, naming the field it refused.

    A field this server does not know is reported as unsupported: OpenAI's API has many
    parameters, and the ones not served here are refused rather than ignored.
    """
    text = str(err)
    at = _AT.search(text)
    path = at.group("path") if at else ""
    head = text[: at.start()] if at else text
    unknown = _UNKNOWN.match(head)
    if unknown is not None:
        param = _join(path, unknown.group("field"))
        return HTTPError(
            400,
            f"`{param}` is not supported by this server; leave it out",
            param=param,
            code="unsupported_parameter",
        )
    missing = _MISSING.match(head)
    if missing is not None:
        param = _join(path, missing.group("field"))
        return HTTPError(
            400, f"`{param}` is required", param=param, code="missing_required_parameter"
        )
    where = f" at `{path}`" if path else ""
    return HTTPError(400, f"invalid request body{where}: {head}", param=path or None)


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def engine_failure(err: EngineError) -> HTTPError:
    """The answer to a request the engine failed: 400 when it refused it as it is, 503
    with ``Retry-After`` when it cannot serve now, else 500."""
    if isinstance(err, EngineRefusedError):
        return HTTPError(400, f"the engine refused the request: {err}", code=err.code)
    if isinstance(err, EngineUnavailableError):
        return HTTPError(
            503,
            f"the engine cannot serve the request now: {err}",
            code="service_unavailable",
            headers=((b"retry-after", str(err.retry_after).encode()),),
        )
    return HTTPError(500, f"the engine failed the request: {err}", code="engine_error")
