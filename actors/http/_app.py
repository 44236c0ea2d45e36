"""``OpenAIApp``: the OpenAI-compatible ASGI 3 application, written against `Engine`.

No framework sits in between: a dict routes the path, msgspec decodes the body into a
strict struct and encodes the answer, and a stream's chunks are assembled from bytes built
once per request (`actors.http._sse`).

- **Errors.** Every refusal is an OpenAI-shaped JSON error with a 4xx status; a request
  reaches the engine only once validated (`actors.http._validate`), so what the engine
  still fails is a server fault: 503 with ``Retry-After`` when it cannot serve now, 500
  otherwise. Once a stream has begun, a failure is its last event (an error object), and
  ``[DONE]`` follows it, as after vLLM's.
- **Disconnects.** While a request's prompt is tokenized and while it is generated, one
  task waits on ``receive`` for the client's disconnect; when it comes, the work is
  cancelled: a prompt waiting for a tokenizer thread is dropped, a generation abandoned
  at the engine.
- **Access.** Every answer carries the request's ``X-Request-Id`` (or a new one). With
  `ServeConfig.cors_origins`, CORS preflights are answered first (`actors.http._cors`);
  with `ServeConfig.api_key`, every other request but ``/health`` must then present the
  key (`actors.http._auth`).
- **Push-back.** A stream's chunks are sent one ``await send(...)`` at a time: the server
  holds ``send`` while a client does not read, and the engine's stream is not read
  meanwhile (the pipeline keeps a stream's undelivered text, bounded by its
  ``max_tokens``). Nothing is spawned per chunk.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from actors import _tracing
from runtime import TokenyardError

from ._asgi import (
    ClientGoneError,
    Receive,
    Scope,
    Send,
    read_body,
    request_id,
    send_error,
    send_json,
    until_disconnect,
)
from ._auth import BearerCheck
from ._config import ServeConfig
from ._cors import CorsPolicy, is_preflight
from ._engine import Engine, EngineError
from ._errors import HTTPError, engine_failure, from_validation_error
from ._openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)
from ._sse import ChunkFormat
from ._stream import send_stream
from ._validate import Prepared, Validator

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, MutableMapping
    from contextlib import AbstractAsyncContextManager

    from ._engine import Chunk, Completion

__all__ = ("HTTPStatistics", "OpenAIApp")

logger = logging.getLogger("tokenyard.http")

_T = TypeVar("_T")
_ENCODE = msgspec.json.Encoder().encode
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t)
    for t in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
}
_MODELS_PREFIX = "/v1/models/"
_MODEL_ROUTE = frozenset({"GET", "HEAD"})
_HEALTH = "/health"


class HTTPStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """An `OpenAIApp`'s counters since it was made.

    Attributes:
        requests: HTTP requests received.
        active: Requests being answered now.
        streams: Streamed answers begun (status 200 sent).
        client_errors: Answers with a 4xx status.
        server_errors: Answers with a 5xx status, and streams ended by an error event.
        disconnects: Requests abandoned because their client disconnected.
    """

    requests: int
    active: int
    streams: int
    client_errors: int
    server_errors: int
    disconnects: int


class _Bound:
    """What the app derives from its engine (limits, names, the validator): once, and
    again when the engine's context changes (`current`)."""

    __slots__ = ("config", "context_length", "engine", "limits", "model", "validator")

    def __init__(self, engine: Engine, config: ServeConfig, *, narrow: bool = False) -> None:
        self.engine = engine
        self.config = config
        self.context_length = context = engine.context_length
        if narrow:  # the settings that no longer fit the engine's context are lowered
            if config.context_length is not None and config.context_length > context:
                config = msgspec.structs.replace(config, context_length=context)
            if config.max_prompt_tokens is not None and config.max_prompt_tokens >= context:
                config = msgspec.structs.replace(config, max_prompt_tokens=context - 1)
        self.limits = config.limits(context)
        self.model = config.model_id or engine.model
        self.validator = Validator(engine, config, self.limits, self.model)

    def current(self) -> _Bound:
        """This, or a new one when the engine's context is no longer the one bound (an
        engine that reports its own once it is ready)."""
        if self.engine.context_length == self.context_length:
            return self
        return _Bound(self.engine, self.config, narrow=True)


class _Exchange:
    """One request: its ASGI callables, its id, and whether its answer has begun."""

    __slots__ = ("receive", "request_id", "scope", "send", "started", "traceparent")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.request_id = ""
        self.started = False
        #: The caller's trace context, handed to the engine with the request.
        self.traceparent: str | None = None


_Handler = Callable[["OpenAIApp", _Exchange, _Bound], Awaitable[None]]


class OpenAIApp:
    """The OpenAI-compatible HTTP API over an `Engine`, as an ASGI 3 application.

    Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or
    server-sent events with ``"stream": true``), ``GET /v1/models`` and
    ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``
    and ``GET /health``.

    Give either an open ``engine``, or ``open_engine``, an async context manager factory
    that the ASGI lifespan enters at startup and leaves at shutdown (in one task, as a
    `Pipeline` needs). Until an engine is bound, requests get 503.

    With ``metrics``, ``GET /metrics`` answers with what it returns (the Prometheus text
    of the whole system, in ``python -m actors serve``).

    Args:
        engine: The engine to serve.
        config: Limits and names (`ServeConfig`'s defaults when ``None``).
        open_engine: Opens the engine for the server's lifetime instead.
        metrics: Returns the body and content type of ``GET /metrics``.
        created: The model's ``created`` in ``/v1/models``, Unix seconds: when the server
            started (``None``: when the app was made).

    Raises:
        ValueError: Both or neither of ``engine`` and ``open_engine`` were given, or the
            config does not fit the engine.

    Example:
        >>> async with Pipeline(workers=2) as pipeline:
        ...     app = OpenAIApp(PipelineEngine(pipeline))
        ...     await uvicorn.Server(uvicorn.Config(app, port=8000)).serve()
    """

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        config: ServeConfig | None = None,
        open_engine: Callable[[], AbstractAsyncContextManager[Engine]] | None = None,
        metrics: Callable[[], Awaitable[tuple[bytes, str]]] | None = None,
        created: int | None = None,
    ) -> None:
        if (engine is None) == (open_engine is None):
            raise ValueError("OpenAIApp needs exactly one of `engine` and `open_engine`")
        self.config = config or ServeConfig()
        self._open_engine = open_engine
        self._bound = None if engine is None else _Bound(engine, self.config)
        self._created = int(time.time()) if created is None else created
        key = self.config.api_key
        self._auth = None if key is None else BearerCheck(key)
        origins = self.config.cors_origins
        self._cors = CorsPolicy(origins) if origins else None
        self._routes: dict[str, tuple[frozenset[str], _Handler]] = {
            "/v1/completions": (frozenset({"POST"}), OpenAIApp._completions),
            "/v1/chat/completions": (frozenset({"POST"}), OpenAIApp._chat),
            "/v1/models": (frozenset({"GET", "HEAD"}), OpenAIApp._models),
            "/tokenize": (frozenset({"POST"}), OpenAIApp._tokenize),
            "/detokenize": (frozenset({"POST"}), OpenAIApp._detokenize),
            "/version": (frozenset({"GET", "HEAD"}), OpenAIApp._version),
            _HEALTH: (frozenset({"GET", "HEAD"}), OpenAIApp._health),
        }
        self._metrics = metrics
        if metrics is not None:
            self._routes["/metrics"] = (frozenset({"GET"}), OpenAIApp._serve_metrics)
        self._requests = 0
        self._active = 0
        self._streams = 0
        self._client_errors = 0
        self._server_errors = 0
        self._disconnects = 0
        self._idle: anyio.Event | None = None

    @property
    def engine(self) -> Engine | None:
        """The engine served now (``None`` before the lifespan opened it)."""
        return None if self._bound is None else self._bound.engine

    @property
    def created(self) -> int:
        """The model's ``created`` in ``/v1/models``: when the server started, Unix seconds."""
        return self._created

    def statistics(self) -> HTTPStatistics:
        """The app's counters."""
        return HTTPStatistics(
            requests=self._requests,
            active=self._active,
            streams=self._streams,
            client_errors=self._client_errors,
            server_errors=self._server_errors,
            disconnects=self._disconnects,
        )

    async def wait_idle(self) -> None:
        """Wait until no request is being answered."""
        while self._active:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    # -- ASGI -----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI 3 entry point: HTTP requests and the lifespan."""
        kind = scope["type"]
        if kind == "http":
            await self._http(_Exchange(scope, receive, send))
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        # Other scopes (websockets) are declined by returning: the server refuses them.

    async def _http(self, ex: _Exchange) -> None:
        self._requests += 1
        self._active += 1
        # The caller's trace: the pipeline's spans of this request are its children. A
        # malformed one is ignored, as W3C Trace Context asks. It belongs to the exchange,
        # so that a server calling the app in one task for many requests (an in-process
        # test client) never lends one request's context to the next.
        for name, value in ex.scope["headers"]:
            if name == b"traceparent":
                ex.traceparent = _tracing.parse_traceparent(value.decode("latin-1"))
                break
        rid = request_id(ex.scope, self.config.max_request_id_length)
        ex.request_id = rid.decode("ascii")
        extra = [(b"x-request-id", rid)]
        preflight = self._cors is not None and is_preflight(ex.scope)
        if self._cors is not None and not preflight:
            extra += self._cors.headers(ex.scope)
        ex.send = _adding_headers(ex.send, extra)
        try:
            if preflight:
                await self._preflight(ex)
            else:
                await self._route(ex)
        except HTTPError as err:
            await self._refuse(ex, err)
        except ClientGoneError:
            self._disconnects += 1
        # The last line of defence: a bug answers 500 (and is logged) instead of
        # leaving the request unanswered or killing the server.
        except Exception:
            logger.exception("%s %s (request %s) failed", *_what(ex))
            await self._refuse(ex, HTTPError(500, "internal server error", code="internal_error"))
        finally:
            self._active -= 1
            if not self._active and self._idle is not None:
                self._idle.set()
                self._idle = None

    def _lookup(self, path: str, method: str) -> tuple[frozenset[str], _Handler]:
        route = self._routes.get(path)
        if route is None and path.startswith(_MODELS_PREFIX):
            route = (_MODEL_ROUTE, OpenAIApp._model)
        if route is None:
            raise HTTPError(404, f"no such endpoint: {method} {path}", code="not_found", close=True)
        return route

    async def _preflight(self, ex: _Exchange) -> None:
        """A CORS preflight: answered without the API key, which browsers do not send."""
        assert self._cors is not None
        methods, _ = self._lookup(ex.scope["path"], ex.scope["method"])
        headers = self._cors.preflight(ex.scope, methods)
        await ex.send({"type": "http.response.start", "status": 204, "headers": headers})
        await ex.send({"type": "http.response.body", "body": b""})

    async def _route(self, ex: _Exchange) -> None:
        path: str = ex.scope["path"]
        method: str = ex.scope["method"]
        # Before the route is looked up: without the key, not even which paths exist.
        if self._auth is not None and path != _HEALTH:
            self._auth.check(ex.scope)
        methods, handler = self._lookup(path, method)
        if method not in methods:
            allow = ", ".join(sorted(methods)).encode()
            raise HTTPError(
                405,
                f"{path} does not take {method}; use {' or '.join(sorted(methods))}",
                code="method_not_allowed",
                headers=((b"allow", allow),),
                close=True,
            )
        bound = self._bound
        if bound is not None:
            bound = self._bound = bound.current()
        if bound is None:
            raise HTTPError(
                503,
                "the server is starting or stopping: no engine is open",
                code="service_unavailable",
                headers=((b"retry-after", b"1"),),
                close=True,
            )
        await handler(self, ex, bound)

    async def _refuse(self, ex: _Exchange, err: HTTPError) -> None:
        if err.status >= 500:
            self._server_errors += 1
        else:
            self._client_errors += 1
        if ex.started:
            # Nothing more can be said once an answer began; the server closes the
            # connection of an unfinished answer.
            logger.error(
                "%s %s (request %s) failed after its answer began: %s", *_what(ex), err.message
            )
            return
        await send_error(ex.send, err)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        if self._open_engine is None:
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await send({"type": "lifespan.shutdown.complete"})
            return
        started = False
        try:
            async with self._open_engine() as engine:
                self._bound = _Bound(engine, self.config)
                await send({"type": "lifespan.startup.complete"})
                started = True
                await receive()  # lifespan.shutdown
                self._bound = None
        # The server reports the failure and exits; the traceback goes to the log.
        except Exception as err:
            self._bound = None
            logger.exception("the engine failed to %s", "stop" if started else "start")
            phase = "shutdown" if started else "startup"
            await send({"type": f"lifespan.{phase}.failed", "message": repr(err)})
            return
        await send({"type": "lifespan.shutdown.complete"})

    # -- endpoints ------------------------------------------------------------------------

    async def _completions(self, ex: _Exchange, bound: _Bound) -> None:
        req = await self._body(ex, CompletionRequest)
        # One watch for the client's leaving, from its prompt's tokenizing (which may wait
        # for a tokenizer thread) to its answer: a watch is a task, 55 us of CPU here.
        await until_disconnect(ex.receive, lambda: self._answer_completion(ex, bound, req))

    async def _answer_completion(
        self, ex: _Exchange, bound: _Bound, req: CompletionRequest
    ) -> None:
        prepared = await bound.validator.completion(req)
        if prepared.stream:
            await self._stream(ex, bound, prepared, chat=False)
            return
        done = await self._generate(ex, bound, prepared)
        response = CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=bound.model,
            choices=[CompletionChoice(index=0, text=done.text, finish_reason=done.finish_reason)],
            usage=_usage(done.prompt_tokens, done.completion_tokens),
        )
        await send_json(ex.send, 200, _ENCODE(response))

    async def _chat(self, ex: _Exchange, bound: _Bound) -> None:
        req = await self._body(ex, ChatCompletionRequest)
        await until_disconnect(ex.receive, lambda: self._answer_chat(ex, bound, req))

    async def _answer_chat(self, ex: _Exchange, bound: _Bound, req: ChatCompletionRequest) -> None:
        prepared = await bound.validator.chat(req)
        if prepared.stream:
            await self._stream(ex, bound, prepared, chat=True)
            return
        done = await self._generate(ex, bound, prepared)
        response = ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=bound.model,
            choices=[
                ChatChoice(
                    index=0,
                    message=AssistantMessage(content=done.text),
                    finish_reason=done.finish_reason,
                )
            ],
            usage=_usage(done.prompt_tokens, done.completion_tokens),
        )
        await send_json(ex.send, 200, _ENCODE(response))

    async def _models(self, ex: _Exchange, bound: _Bound) -> None:
        await send_json(ex.send, 200, _ENCODE(ModelList(data=[self._card(bound)])))

    async def _model(self, ex: _Exchange, bound: _Bound) -> None:
        bound.validator.check_model(ex.scope["path"][len(_MODELS_PREFIX) :])
        await send_json(ex.send, 200, _ENCODE(self._card(bound)))

    async def _tokenize(self, ex: _Exchange, bound: _Bound) -> None:
        req = await self._body(ex, TokenizeRequest)
        ids = await until_disconnect(ex.receive, lambda: bound.validator.tokenize(req))
        response = TokenizeResponse(
            tokens=ids, count=len(ids), max_model_len=bound.limits.context_length
        )
        await send_json(ex.send, 200, _ENCODE(response))

    async def _detokenize(self, ex: _Exchange, bound: _Bound) -> None:
        ids = bound.validator.detokenize(await self._body(ex, DetokenizeRequest))
        text = await until_disconnect(ex.receive, lambda: bound.validator.decode(ids))
        await send_json(ex.send, 200, _ENCODE(DetokenizeResponse(prompt=text)))

    async def _serve_metrics(self, ex: _Exchange, bound: _Bound) -> None:
        assert self._metrics is not None
        try:
            body, content_type = await self._metrics()
        except ImportError as err:
            raise HTTPError(501, str(err), code="not_implemented") from err
        except TokenyardError as err:
            raise HTTPError(
                503,
                f"the metrics could not be gathered: {err}",
                code="service_unavailable",
                headers=((b"retry-after", b"1"),),
            ) from err
        await ex.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await ex.send({"type": "http.response.body", "body": body})

    async def _version(self, ex: _Exchange, bound: _Bound) -> None:
        await send_json(ex.send, 200, _version_body())

    async def _health(self, ex: _Exchange, bound: _Bound) -> None:
        """200 when the engine generates; 503 with the reason while it cannot (starting,
        restarting), so that a load balancer sends requests elsewhere meanwhile."""
        why = bound.engine.not_ready()
        if why is not None:
            raise HTTPError(503, why, code="service_unavailable", headers=((b"retry-after", b"1"),))
        # With its length: an answer without one goes chunked, which HTTP/1.0 has not.
        await ex.send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]}
        )
        await ex.send({"type": "http.response.body", "body": b""})

    # -- helpers --------------------------------------------------------------------------

    async def _body(self, ex: _Exchange, kind: type[_T]) -> _T:
        body = await read_body(ex.scope, ex.receive, self.config.max_body_bytes)
        decoder: msgspec.json.Decoder[_T] = _DECODERS[kind]
        try:
            return decoder.decode(body)
        except msgspec.ValidationError as err:
            raise from_validation_error(err) from None
        except msgspec.DecodeError as err:
            raise HTTPError(400, f"the request body is not valid JSON: {err}") from None
        except RecursionError:
            raise HTTPError(400, "the request body's JSON nests too deeply") from None

    def _card(self, bound: _Bound) -> ModelCard:
        return ModelCard(id=bound.model, created=self._created)

    async def _generate(self, ex: _Exchange, bound: _Bound, prepared: Prepared) -> Completion:
        try:
            return await bound.engine.generate(
                prepared.prompt_ids, prepared.params, traceparent=ex.traceparent
            )
        except EngineError as err:
            raise engine_failure(err) from err

    async def _stream(self, ex: _Exchange, bound: _Bound, prepared: Prepared, chat: bool) -> None:
        if ex.scope.get("http_version") == "1.0":
            # A stream's length is known only at its end: HTTP/1.1 sends it in chunks, which
            # HTTP/1.0 has not (uvicorn would send them anyway, into the event stream).
            raise HTTPError(
                505,
                "a streamed answer needs HTTP/1.1 (its chunked transfer encoding): send the "
                "request over HTTP/1.1, or without stream",
                code="http_version_not_supported",
            )
        fmt = ChunkFormat(
            chat=chat,
            rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=bound.model,
            include_usage=prepared.include_usage,
        )
        chunks = bound.engine.stream(
            prepared.prompt_ids, prepared.params, traceparent=ex.traceparent
        )
        await self._pump(ex, chunks, fmt)

    async def _pump(
        self, ex: _Exchange, chunks: AsyncGenerator[Chunk, None], fmt: ChunkFormat
    ) -> None:
        def started() -> None:
            ex.started = True
            self._streams += 1

        failure = await send_stream(ex.send, chunks, fmt, started)
        if failure is not None:
            self._server_errors += 1
            logger.warning("%s %s (request %s): the stream failed: %s", *_what(ex), failure)


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _what(ex: _Exchange) -> tuple[str, str, str]:
    return ex.scope["method"], ex.scope["path"], ex.request_id


def _adding_headers(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    """``send``, with ``headers`` added to the response's start."""

    async def adding(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return adding


@functools.cache
def _version_body() -> bytes:
    """``{"version": ...}``: the installed tokenyard's version, read once."""
    try:
        version = importlib.metadata.version("tokenyard")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"  # run from a source tree that was never installed
    return _ENCODE({"version": version})
