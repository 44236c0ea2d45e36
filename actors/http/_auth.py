"""API keys: a server that answers only clients presenting ``Authorization: Bearer KEY``.

The key is compared in constant time: both sides are hashed with SHA-256 first and the
digests compared with `hmac.compare_digest`, so neither the key's bytes nor its length
shows in the time a refusal takes. The key never appears in an answer, a log line or a
repr.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from typing import TYPE_CHECKING, Any

import msgspec

from ._asgi import header
from ._errors import HTTPError

if TYPE_CHECKING:
    from ._asgi import Scope

__all__ = ("API_KEY_ENV", "ApiKey", "BearerCheck", "key_given", "usable_key")

API_KEY_ENV = "TOKENYARD_API_KEY"
"""The environment variable ``python -m actors serve`` reads its key from without
``--api-key`` (as vLLM reads ``VLLM_API_KEY``)."""

# What a client can send in a header and have compared byte for byte: visible ASCII.
_VISIBLE = re.compile(r"[\x21-\x7e]+")
_BEARER = b"bearer"


def usable_key(key: str) -> bool:
    """Whether ``key`` can be sent in a header and matched byte for byte: one or more
    visible ASCII characters."""
    return _VISIBLE.fullmatch(key) is not None


def key_given(flag: str | None, without: str) -> str | None:
    """The API key of a command: its ``--api-key`` flag, else `API_KEY_ENV` (``None``:
    neither is set).

    Raises:
        ValueError: The variable is set but empty (``without``: what unsetting it does).
    """
    if flag is not None:
        return flag
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key:
        raise ValueError(f"{API_KEY_ENV} is set but empty: unset it to {without}, or set a key")
    return key


class ApiKey(msgspec.Struct, frozen=True):
    """A key clients must present, as ``Authorization: Bearer <key>``.

    An ordinary msgspec value, so it travels with a `ServeConfig` to every worker process;
    its repr is ``ApiKey(***)``, so a config printed, logged or shown in a traceback never
    shows it.

    Attributes:
        value: The key: visible ASCII characters (no space, no control character, nothing
            beyond ASCII), since clients send it in a header.

    Raises:
        ValueError: The key is empty or has another character (the message does not
            show the key).
    """

    value: str

    def __post_init__(self) -> None:
        if not self.value:
            raise ValueError("the API key is empty: give a key, or none to serve without one")
        if not usable_key(self.value):
            raise ValueError(
                "the API key has a character other than visible ASCII (a space, a control "
                "character or a non-ASCII one): clients send it in a header, where it could "
                "not be matched; choose another key"
            )

    def __repr__(self) -> str:
        return "ApiKey(***)"

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        """What rich prints: not the key."""
        return [("value", "***")]


class BearerCheck:
    """Checks each request's ``Authorization: Bearer`` header against one key.

    Args:
        key: The key clients must present.
    """

    __slots__ = ("_digest",)

    def __init__(self, key: ApiKey) -> None:
        self._digest = hashlib.sha256(key.value.encode("ascii")).digest()

    def check(self, scope: Scope) -> None:
        """Let a request through if it presents the key.

        Raises:
            HTTPError: 401 with ``WWW-Authenticate: Bearer``: the header is missing, is not
                a bearer token, or the token is not the key. Only the header counts: a key
                in the query string or the body is not looked at.
        """
        value = header(scope, b"authorization")
        if value is None:
            raise _refusal(
                "this server needs an API key: send it as `Authorization: Bearer <key>`",
                b"Bearer",
            )
        scheme, _, token = value.strip(b" \t").partition(b" ")
        presented = hashlib.sha256(token.strip(b" \t")).digest()
        # Compared whatever the scheme said, so a wrong scheme costs the time a wrong key does.
        matches = hmac.compare_digest(presented, self._digest)
        if scheme.lower() != _BEARER or not matches:
            raise _refusal(
                "the API key is not valid: send this server's key as `Authorization: Bearer <key>`",
                b'Bearer error="invalid_token"',
            )


def _refusal(message: str, challenge: bytes) -> HTTPError:
    # The body is left unread: the connection closes after the answer.
    return HTTPError(
        401,
        message,
        code="invalid_api_key",
        headers=((b"www-authenticate", challenge),),
        close=True,
    )
