"""CORS: which web pages' scripts may call the server, answered as the Fetch standard asks.

Off unless origins are configured (`ServeConfig.cors_origins`). With origins:

- A **preflight** (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is
  answered before any API key is asked for, since browsers send none with it: 204 with the
  route's methods and the headers asked for, or 403 for an origin not configured or a
  method the route does not take.
- **Every other answer** says ``Vary: Origin``; to a configured origin it also says
  ``Access-Control-Allow-Origin`` and exposes ``X-Request-Id`` and ``Retry-After`` to the
  page's script.

Credentials (cookies, TLS client certificates) are never allowed: the server's only
credential is the API key, which a script sends as ``Authorization: Bearer <key>``, and that
needs no ``Access-Control-Allow-Credentials``. So ``*`` is answered as ``*``, never as the
caller's origin.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ._asgi import header
from ._errors import HTTPError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._asgi import Scope

__all__ = ("MAX_AGE", "CorsPolicy", "check_origins", "is_preflight")

MAX_AGE = 600
"""Seconds a browser may keep a preflight's answer (``Access-Control-Max-Age``)."""

# scheme://host[:port], as a browser serializes an origin: no path, no user, nothing after.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^\s/?#@\\]+")
# Header names (RFC 9110 tokens), comma-separated.
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_TOKEN_LIST = re.compile(_TOKEN + rb"(?:[ \t]*,[ \t]*" + _TOKEN + rb")*")
_MAX_REQUEST_HEADERS = 2048
_VARY = (b"vary", b"origin")
_EXPOSE = (b"access-control-expose-headers", b"x-request-id, retry-after")


def check_origins(origins: Iterable[str]) -> None:
    """Refuse anything but ``*`` and ``scheme://host[:port]``.

    Raises:
        ValueError: One is not an origin (the message names it and the setting).
    """
    for origin in origins:
        if origin == "*":
            continue
        if origin == "null" or not _ORIGIN.fullmatch(origin.lower()):
            raise ValueError(
                f"ServeConfig.cors_origins: {origin!r} is not an origin: give "
                "scheme://host[:port] with no path or trailing slash "
                "(https://app.example.com), or '*' for any"
            )


def is_preflight(scope: Scope) -> bool:
    """Whether a request is a CORS preflight: ``OPTIONS`` naming an origin and a method."""
    return (
        scope["method"] == "OPTIONS"
        and header(scope, b"origin") is not None
        and header(scope, b"access-control-request-method") is not None
    )


class CorsPolicy:
    """The answers for a set of allowed origins.

    Args:
        origins: Origins whose pages may call the server (``*``: any).
    """

    __slots__ = ("_any", "_origins")

    def __init__(self, origins: Iterable[str]) -> None:
        origins = tuple(origins)
        check_origins(origins)
        self._any = "*" in origins
        # Browsers send scheme and host in lower case.
        self._origins = frozenset(o.lower().encode() for o in origins if o != "*")

    def allowed(self, origin: bytes | None) -> bytes | None:
        """The ``Access-Control-Allow-Origin`` for ``origin``, or ``None`` if it is not
        allowed."""
        if origin is None:
            return None
        if self._any:
            return b"*"
        return origin if origin in self._origins else None

    def headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The headers every answer to a request that is not a preflight carries."""
        allowed = self.allowed(header(scope, b"origin"))
        if allowed is None:
            return [_VARY]
        return [_VARY, (b"access-control-allow-origin", allowed), _EXPOSE]

    def preflight(self, scope: Scope, methods: frozenset[str]) -> list[tuple[bytes, bytes]]:
        """The headers of a preflight's 204 for a route taking ``methods``.

        Raises:
            HTTPError: 403: the origin is not allowed, the route does not take the method
                asked for, or the headers asked for are not a list of header names.
        """
        allowed = self.allowed(header(scope, b"origin"))
        if allowed is None:
            raise _forbidden(
                "this origin may not call this server (ServeConfig.cors_origins, --cors-origin)"
            )
        method = header(scope, b"access-control-request-method") or b""
        if method.decode("latin-1") not in methods:
            raise _forbidden(
                f"{scope['path']} does not take the method the preflight asks for; it takes "
                f"{', '.join(sorted(methods))}"
            )
        answer = [
            _VARY,
            (b"access-control-allow-origin", allowed),
            (b"access-control-allow-methods", ", ".join(sorted(methods)).encode()),
            (b"access-control-max-age", str(MAX_AGE).encode()),
        ]
        asked = header(scope, b"access-control-request-headers")
        if asked is not None and asked.strip():
            asked = asked.strip()
            if len(asked) > _MAX_REQUEST_HEADERS or not _TOKEN_LIST.fullmatch(asked):
                raise _forbidden(
                    "Access-Control-Request-Headers is not a list of header names of at "
                    f"most {_MAX_REQUEST_HEADERS} bytes"
                )
            # Any header may be sent: the origin and the API key are what is checked.
            answer.append((b"access-control-allow-headers", asked.lower()))
        return answer


def _forbidden(message: str) -> HTTPError:
    return HTTPError(403, message, code="cors_forbidden", headers=(_VARY,))
