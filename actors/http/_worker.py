"""``HttpWorker``: a tokenizer worker that serves the OpenAI-compatible API itself.

One of N in ``python -m actors serve``. The process that owns the port accepts each
connection and hands it to a worker (`actors.http._dispatch`); the worker's HTTP server
parses the request, its tokenizer tokenizes it, the worker forwards it to the scheduler,
and its output, detokenized, comes back to this same process and out on the same
connection: the CPU work of HTTP, tokenization and streaming is spread over the workers.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from actors import _metrics
from actors._limits import RequestLimits  # noqa: TC001 -- a spawn argument's type
from actors.engines import EngineClient  # noqa: TC001 -- a spawn argument's type

# Resolved at run time: the spawn arguments are decoded with __init__'s annotations.
from actors.messages import (
    Drain,
    Draining,
    GetWorkerStatistics,
    PipelineSupervisorMessage,
    WorkerStatistics,
)
from actors.tokenizer_worker import TokenizerWorker
from runtime import ActorRef, GetMetrics, handler

from ._app import OpenAIApp
from ._chat import ChatTemplate
from ._config import ServeConfig
from ._connections import ConnectionServer
from ._pipeline_engine import DEFAULT_CONTEXT_LENGTH, model_id_of
from ._worker_engine import WorkerEngine

if TYPE_CHECKING:
    from collections.abc import MutableMapping

    from ._asgi import Receive, Scope, Send

__all__ = ("WORKER_HEADER", "HttpSettings", "HttpWorker")

logger = logging.getLogger("tokenyard.http")


class HttpSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker needs to serve HTTP (travels to its process as one value).

    Attributes:
        channel: Its inherited end of the connection channel.
        config: The HTTP layer's limits.
        model: The model id (``None``: derived from the tokenizer).
        context_length: Most prompt plus completion tokens of one request.
        max_stream_buffer: Most bytes of a stream held for a client that does not read.
        log_level: uvicorn's log level.
        created: When the server started, Unix seconds: the model's ``created`` in
            ``/v1/models``, the same from every worker and every incarnation (``None``:
            when the worker started).
    """

    channel: int
    config: ServeConfig = ServeConfig()
    model: str | None = None
    context_length: int = DEFAULT_CONTEXT_LENGTH
    max_stream_buffer: int = 4 << 20
    log_level: str = "warning"
    created: int | None = None


class HttpWorker(TokenizerWorker):
    """A `TokenizerWorker` that also serves HTTP on the connections handed to it.

    Args:
        worker_id: Its index among the workers.
        supervisor: Where it registers.
        tokenizer: Path of a ``tokenizer.json`` (None: the bundled one).
        register_timeout: Seconds to get registered before it gives up.
        limits: What one request may ask for.
        http: How to serve (its channel, limits, model).
        model_name: The ``model_name`` label of its metrics (``None``: from the tokenizer).
        collector: The system's metrics collector, which ``GET /metrics`` asks.
        engine_client: Its own addresses as a client of vLLM's engine (``None``: its
            requests go through the scheduler).

    Raises:
        ValueError: ``http`` is missing.
    """

    def __init__(
        self,
        worker_id: int,
        supervisor: ActorRef[PipelineSupervisorMessage],
        tokenizer: str | None = None,
        register_timeout: float = 10.0,
        limits: RequestLimits | None = None,
        http: HttpSettings | None = None,
        model_name: str | None = None,
        collector: ActorRef[GetMetrics] | None = None,
        engine_client: EngineClient | None = None,
    ) -> None:
        super().__init__(
            worker_id,
            supervisor,
            tokenizer,
            register_timeout,
            limits,
            model_name,
            engine_client=engine_client,
        )
        self.collector = collector
        #: The last gathering rendered: its ``gathered_at``, and its text.
        self._rendered: tuple[float, bytes] | None = None
        if http is None:
            raise ValueError("an HttpWorker needs its http settings (its connection channel)")
        self.http = http
        self.server: ConnectionServer | None = None
        self.engine: WorkerEngine | None = None
        #: When the requests still running are ended (``None``: not draining).
        self._cut_at: float | None = None
        #: Set when a later `Drain` brings the deadline forward.
        self._cut_moved: anyio.Event | None = None
        self._cut = 0  # requests its drain ended at the deadline
        #: Why the requests still running at the deadline are ended (`Drain.reason`).
        self._cut_reason = ""
        #: Set once the drain's cut is done and its answers went out (or had their grace).
        self._cut_done = anyio.Event()

    async def on_start(self) -> None:
        await super().on_start()
        http = self.http
        self.engine = WorkerEngine(
            self,
            model=http.model or model_id_of(self.tokenizer_path),
            context_length=http.context_length,
            chat_template=ChatTemplate.from_tokenizer(self.tokenizer_path),
            max_stream_buffer=http.max_stream_buffer,
        )
        metrics = None if self.collector is None else self._metrics
        openai = OpenAIApp(self.engine, config=http.config, metrics=metrics, created=http.created)
        _count_http(openai, self.engine.model, self.worker_id)
        app = _Labelled(openai, self.worker_id)
        self.server = ConnectionServer(
            app, http.channel, limits=http.config, log_level=http.log_level
        )
        self.start_soon(self.server.run)

    async def on_stop(self) -> None:
        due = None if self._cut_at is None else self._cut_at - time.monotonic()
        if due is not None and due <= 1.0:
            # Stopped as its drain ends what runs (the pipeline gave up: `Drain.reason`):
            # their answers go out first, within their grace.
            with anyio.move_on_after(max(due, 0.0) + CUT_GRACE):
                await self._cut_done.wait()
        if self.server is not None:
            self.server.close()
        await super().on_stop()

    @handler
    async def drain(self, msg: Drain) -> Draining:
        """Begin to drain (see `Drain`): answered at once, the drain goes on meanwhile."""
        assert self.server is not None
        assert self.engine is not None
        cut_at = time.monotonic() + max(msg.timeout, 0.0)
        if self._cut_at is None:
            self._cut_at = cut_at
            self._cut_reason = msg.reason
            self.server.drain()
            self.start_soon(self._cut_when_due)
        elif cut_at < self._cut_at:
            self._cut_at = cut_at
            self._cut_reason = msg.reason or self._cut_reason
            if self._cut_moved is not None:
                self._cut_moved.set()
        return Draining(connections=self.server.open, requests=self.engine.in_flight)

    @handler
    def statistics(self, msg: GetWorkerStatistics) -> WorkerStatistics:
        """The worker's counters, with the requests its drain ended."""
        return msgspec.structs.replace(super().statistics(msg), cut=self._cut)

    async def _cut_when_due(self) -> None:
        """At the drain's deadline, end what still runs, then close what is still open."""
        assert self.server is not None
        assert self.engine is not None
        while self._cut_at is not None:
            moved = self._cut_moved = anyio.Event()
            with anyio.move_on_after(self._cut_at - time.monotonic()):
                await moved.wait()
                continue
            break
        cut = self.engine.cut(
            self._cut_reason
            or "the server is shutting down: the request did not finish within its drain "
            "timeout (ServeConfig.drain_timeout, serve --drain-timeout)"
        )
        self._cut += cut
        if cut:
            logger.warning(
                "worker %d ended %d request(s) still running at shutdown", self.worker_id, cut
            )
        # Their last answers go out (a client that does not read them has CUT_GRACE).
        with anyio.move_on_after(CUT_GRACE):
            await self.server.wait_closed()
        self.server.close()
        self._cut_done.set()

    async def _metrics(self) -> tuple[bytes, str]:
        """The whole system's metrics, as the collector gathered them for every worker."""
        from runtime.prometheus import CONTENT_TYPE, render

        assert self.collector is not None
        gathered = await self.collector.ask(GetMetrics(), timeout=METRICS_TIMEOUT)
        # The collector serves one gathering for a second (a death or an expiry makes a new
        # one): rendered once, however many scrapes come meanwhile (each render holds this
        # worker's loop, its streams with it, for milliseconds: more with dead incarnations).
        rendered = self._rendered
        if rendered is None or rendered[0] != gathered.gathered_at:
            rendered = self._rendered = (gathered.gathered_at, render(gathered))
        return rendered[1], CONTENT_TYPE


def _count_http(app: OpenAIApp, model: str, worker: int) -> None:
    """The app's counters as this process's series (`actors._metrics`), read when gathered:
    nothing is added to a request's path."""
    read = app.statistics
    _metrics.HTTP_REQUESTS.labels(model, worker).set_function(lambda: read().requests)
    _metrics.HTTP_REQUESTS_ACTIVE.labels(model, worker).set_function(lambda: read().active)
    _metrics.HTTP_STREAMS.labels(model, worker).set_function(lambda: read().streams)
    _metrics.HTTP_DISCONNECTS.labels(model, worker).set_function(lambda: read().disconnects)
    errors = _metrics.HTTP_ERRORS
    errors.labels(model, worker, "4xx").set_function(lambda: read().client_errors)
    errors.labels(model, worker, "5xx").set_function(lambda: read().server_errors)


#: Seconds the answers of requests ended at a drain's deadline get to go out.
CUT_GRACE = 2.0

#: Seconds ``GET /metrics`` waits for the collector (each process has 2 s to answer it).
METRICS_TIMEOUT = 10.0

#: The response header naming the worker that served a request.
WORKER_HEADER = b"x-tokenyard-worker"


class _Labelled:
    """The app, with every response saying which worker served it (`WORKER_HEADER`)."""

    def __init__(self, app: OpenAIApp, worker: int) -> None:
        self.app = app
        self.header = (WORKER_HEADER, str(worker).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        header = self.header

        async def labelled(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, labelled)
