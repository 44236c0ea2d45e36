"""``ServeConfig``: every limit the HTTP layer enforces, as one value."""

from __future__ import annotations

import math

import msgspec

from actors._limits import RequestLimits
from actors.messages import LARGEST_INT

from ._auth import ApiKey
from ._cors import check_origins

__all__ = ("ServeConfig",)

_MIB = 1 << 20


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The HTTP layer's limits and names; every default is sized for a real host.

    A request over a limit gets an OpenAI-shaped 4xx error naming the limit, never a 500.

    Attributes:
        model_id: The model's id in ``/v1/models`` and in every response; a request naming
            another model gets 404 (``model_not_found``). ``None``: the engine's own id.
        context_length: Prompt plus completion tokens a request may use (``max_model_len``
            in ``/tokenize``). ``None``: the engine's; it may narrow the engine's, never
            widen it.
        max_body_bytes: Largest request body read, 4 MiB. Reading stops as soon as a body
            passes it (413), so no body is ever buffered beyond it.
        max_prompt_bytes: Largest prompt in UTF-8 bytes, 1 MiB: the completion's prompt
            text, or the chat prompt once rendered by the chat template.
        max_prompt_tokens: Most prompt tokens. ``None``: the context length less one, so
            that at least one token can be generated.
        max_tokens_limit: Upper bound on a request's ``max_tokens`` (and chat's
            ``max_completion_tokens``), 4096.
        default_max_tokens: Tokens generated when a request names no ``max_tokens``, 256,
            or fewer when the context has less room left after the prompt.
        max_stop: Most stop strings in a request's ``stop``, 16.
        max_stop_bytes: Longest stop string in UTF-8 bytes, 256.
        max_stop_token_ids: Most ids in a request's ``stop_token_ids``, 64.
        max_messages: Most messages in a chat request, 1024.
        max_header_bytes: Most bytes of a request's line and headers together, 64 KiB;
            past it the request gets 431 and its connection closes. What is fed to the
            parser is cut at the limit, so the cost of a head is linear in its size.
        max_headers: Most header fields in a request, 100 (431 past it).
        header_timeout: Seconds from a request's first byte until its headers have all
            arrived, 10; past it the request gets 408 and its connection closes (a client
            sending its headers a byte at a time holds a connection no longer).
        body_timeout: Seconds a request body may go without a byte while the server waits
            for it, 30; past it the request gets 408 (a Content-Length or chunk size that
            lies, a client that stalls).
        idle_timeout: Seconds a connection may stay open with no request: before its first
            one, and between requests on a kept-alive connection, 5.
        send_timeout: Seconds an answer's bytes may wait for a client that takes none of
            them, 60; past it the connection is closed (its request, if still running, is
            abandoned). A client that reads, however slowly, is never cut by it.
        max_connections: Most connections one worker process serves at once, 2048; the
            port's owner gives a worker no more, and keeps the rest waiting. A server
            lowers it to what the open-file limit leaves, and says so at start.
        max_waiting: Most accepted connections the port's owner keeps waiting for a
            worker to take them, 1024; past it a new connection is answered 503 with
            ``Retry-After`` at once instead of waiting unseen in the listen backlog.
        take_timeout: Seconds a worker may leave connections handed to it untaken, 10;
            past it the worker counts as stuck: it is killed and restarted, and what it
            had not taken goes to the others.
        drain_timeout: Seconds in-flight requests get to finish after SIGTERM, 30; the
            requests still running then are ended (a stream with an error event and
            ``data: [DONE]``, any other answer with 503).
        api_key: The key every route but ``/health`` asks for, as ``Authorization: Bearer
            <key>`` (401 without it). ``None``: no key is asked for.
        cors_origins: Origins (``scheme://host[:port]``, or ``*`` for any) whose web pages
            may call the server: preflights are answered and answers carry
            ``Access-Control-Allow-Origin``. Empty: CORS is off (``OPTIONS`` gets 405).
        max_request_id_length: Longest ``X-Request-Id`` echoed, 128 visible ASCII
            characters; a longer or other one is replaced by a new id.
    """

    model_id: str | None = None
    context_length: int | None = None
    max_body_bytes: int = 4 * _MIB
    max_prompt_bytes: int = _MIB
    max_prompt_tokens: int | None = None
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    max_stop: int = 16
    max_stop_bytes: int = 256
    max_stop_token_ids: int = 64
    max_messages: int = 1024
    # -- connections
    max_header_bytes: int = 64 << 10
    max_headers: int = 100
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 5.0
    send_timeout: float = 60.0
    max_connections: int = 2048
    max_waiting: int = 1024
    take_timeout: float = 10.0
    drain_timeout: float = 30.0
    # Access: who may call, from which web pages, and how an answer names its request.
    api_key: ApiKey | None = None
    cors_origins: tuple[str, ...] = ()
    max_request_id_length: int = 128

    def __post_init__(self) -> None:
        positive = {
            "max_body_bytes": self.max_body_bytes,
            "max_prompt_bytes": self.max_prompt_bytes,
            "max_tokens_limit": self.max_tokens_limit,
            "default_max_tokens": self.default_max_tokens,
            "max_stop_bytes": self.max_stop_bytes,
            "max_messages": self.max_messages,
            "max_header_bytes": self.max_header_bytes,
            "max_headers": self.max_headers,
            "max_connections": self.max_connections,
        }
        # One prompt token and one generated token is the smallest useful context.
        if self.context_length is not None and not 2 <= self.context_length <= LARGEST_INT:
            raise ValueError(
                f"ServeConfig.context_length={self.context_length}: it must be at least 2 "
                f"and at most {LARGEST_INT}"
            )
        if self.max_prompt_tokens is not None:
            positive["max_prompt_tokens"] = self.max_prompt_tokens
        for name, value in positive.items():
            if not 1 <= value <= LARGEST_INT:
                raise ValueError(
                    f"ServeConfig.{name}={value}: it must be at least 1 and at most {LARGEST_INT}"
                )
        for name, seconds in {
            "header_timeout": self.header_timeout,
            "body_timeout": self.body_timeout,
            "idle_timeout": self.idle_timeout,
            "send_timeout": self.send_timeout,
            "take_timeout": self.take_timeout,
        }.items():
            # Finite: an infinite timeout is the bound switched off, NaN none at all.
            if not 0 < seconds < math.inf:
                raise ValueError(
                    f"ServeConfig.{name}={seconds}: it must be positive and finite (seconds)"
                )
        if not 0 <= self.drain_timeout < math.inf:
            raise ValueError(
                f"ServeConfig.drain_timeout={self.drain_timeout}: it must be at least 0 and "
                "finite (seconds)"
            )
        for name, value in {
            "max_stop": self.max_stop,
            "max_stop_token_ids": self.max_stop_token_ids,
            "max_waiting": self.max_waiting,
        }.items():
            if not 0 <= value <= LARGEST_INT:
                raise ValueError(
                    f"ServeConfig.{name}={value}: it must be at least 0 and at most {LARGEST_INT}"
                )
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"ServeConfig.default_max_tokens={self.default_max_tokens} is above "
                f"max_tokens_limit={self.max_tokens_limit}: lower the default or raise the limit"
            )
        if self.model_id is not None and not self.model_id:
            raise ValueError("ServeConfig.model_id is empty: name the model, or pass None")
        self._check_access()

    def limits(self, engine_context: int) -> RequestLimits:
        """The limits an HTTP request is held to in front of an engine whose context holds
        ``engine_context`` tokens: checked once, by the HTTP layer, before its worker
        takes its ids.

        Raises:
            ValueError: ``context_length`` or ``max_prompt_tokens`` do not fit the engine's
                context; the message names the setting.
        """
        context = engine_context if self.context_length is None else self.context_length
        if context > engine_context:
            raise ValueError(
                f"ServeConfig.context_length={context} is above the engine's context length "
                f"({engine_context}): lower it, or leave it None to use the engine's"
            )
        prompt = context - 1 if self.max_prompt_tokens is None else self.max_prompt_tokens
        if prompt >= context:
            raise ValueError(
                f"ServeConfig.max_prompt_tokens={prompt} leaves no room to generate in a "
                f"context of {context} tokens: make it at most {context - 1}"
            )
        return RequestLimits(
            max_prompt_bytes=self.max_prompt_bytes,
            max_prompt_tokens=prompt,
            max_new_tokens=self.max_tokens_limit,
            context_length=context,
            settings=(
                "ServeConfig.max_prompt_bytes",
                "ServeConfig.max_prompt_tokens",
                "ServeConfig.max_tokens_limit",
            ),
        )

    def _check_access(self) -> None:
        if not 1 <= self.max_request_id_length <= LARGEST_INT:
            raise ValueError(
                f"ServeConfig.max_request_id_length={self.max_request_id_length}: it must be "
                f"at least 1 and at most {LARGEST_INT}"
            )
        check_origins(self.cors_origins)
