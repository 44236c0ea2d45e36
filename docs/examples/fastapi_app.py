"""A FastAPI app serving a `Pipeline`: JSON generation and a server-sent-events stream.

The app's lifespan opens the pipeline (its processes start before the first request is
accepted and stop when the server shuts down); request handlers use it from their own tasks.

Run it with ``python docs/examples/fastapi_app.py --port 8000`` or
``python -m uvicorn docs.examples.fastapi_app:app``, then::

    curl -s localhost:8000/generate -H 'content-type: application/json' \\
        -d '{"prompt": "Hello", "max_new_tokens": 16}'
    curl -sN localhost:8000/generate/stream -H 'content-type: application/json' \\
        -d '{"prompt": "Hello", "max_new_tokens": 16}'

Environment: ``TOKENYARD_WORKERS`` (tokenizer workers, default 2) and
``TOKENYARD_STEP_TIME`` (seconds per step of the stand-in engine, default 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from actors import Pipeline, PipelineClosedError, WorkerDiedError
from runtime import TokenyardError

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator

    from starlette.types import Receive, Scope, Send


class GenerateRequest(BaseModel):
    """The body of both endpoints. An empty prompt is refused with 422; ``ignore_eos``
    generates all ``max_new_tokens`` even past the end-of-sequence token."""

    prompt: str = Field(min_length=1)
    max_new_tokens: int = Field(default=64, ge=1, le=4096)
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False


class GenerateResponse(BaseModel):
    """What ``POST /generate`` returns."""

    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    worker: int


class Health(BaseModel):
    """What ``GET /health`` returns (also the readiness probe)."""

    status: str
    workers: int
    streams_open: int
    streams_finished: int
    streams_aborted: int


@dataclass
class StreamCounts:
    """Streams by fate; the aborted count shows that a client's disconnect reached the
    pipeline (its stream generator was closed, which aborts the request at its worker)."""

    open: int = 0
    finished: int = 0
    aborted: int = 0


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the pipeline for the app's lifetime. Uvicorn enters and leaves this in one task,
    which is what the pipeline's task group needs."""
    workers = int(os.environ.get("TOKENYARD_WORKERS", "2"))
    step_time = float(os.environ.get("TOKENYARD_STEP_TIME", "0"))
    async with Pipeline(workers=workers, step_time=step_time) as pipeline:
        app.state.pipeline = pipeline
        app.state.streams = StreamCounts()
        yield
    # Leaving the block stopped every pipeline process and removed its ipc directory.


app = FastAPI(title="tokenyard", lifespan=lifespan)


def get_pipeline(request: Request) -> Pipeline:
    """The pipeline the lifespan opened."""
    pipeline: Pipeline = request.app.state.pipeline
    return pipeline


PipelineDep = Annotated[Pipeline, Depends(get_pipeline)]


def unavailable(err: TokenyardError) -> HTTPException:
    """A pipeline failure as an HTTP error: 503 when the service side failed, else 400."""
    if isinstance(err, WorkerDiedError):
        return HTTPException(503, detail={"error": "worker_died", "message": str(err)})
    if isinstance(err, PipelineClosedError):
        return HTTPException(503, detail={"error": "shutting_down", "message": str(err)})
    return HTTPException(400, detail={"error": "refused", "message": str(err)})


@app.get("/health")
async def health(request: Request) -> Health:
    """Liveness and stream counters."""
    pipeline: Pipeline = request.app.state.pipeline
    streams: StreamCounts = request.app.state.streams
    return Health(
        status="ok",
        workers=pipeline.config.workers,
        streams_open=streams.open,
        streams_finished=streams.finished,
        streams_aborted=streams.aborted,
    )


@app.post("/generate")
async def generate(body: GenerateRequest, pipeline: PipelineDep) -> GenerateResponse:
    """Generate a completion and return it whole."""
    try:
        result = await pipeline.generate(
            body.prompt,
            max_new_tokens=body.max_new_tokens,
            stop=body.stop,
            ignore_eos=body.ignore_eos,
        )
    except TokenyardError as err:
        raise unavailable(err) from err
    return GenerateResponse(
        text=result.text,
        output_ids=result.output_ids,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        finish_reason=result.finish_reason,
        worker=result.worker,
    )


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event whose data is ``data`` as JSON (one line: JSON escapes
    newlines, so a piece holding one cannot break the event)."""
    head = "" if event is None else f"event: {event}\n"
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def events(
    pipeline: Pipeline, body: GenerateRequest, streams: StreamCounts
) -> AsyncGenerator[str, None]:
    """The SSE body: one ``data:`` event per piece, then ``event: done`` (or ``error``)."""
    streams.open += 1
    finished = False
    try:
        pieces = pipeline.stream(
            body.prompt,
            max_new_tokens=body.max_new_tokens,
            stop=body.stop,
            ignore_eos=body.ignore_eos,
        )
        count = 0
        # aclosing: however this generator ends (a disconnect included), the pipeline's
        # stream is closed now, which aborts the request at its worker.
        async with contextlib.aclosing(pieces):
            try:
                async for piece in pieces:
                    count += 1
                    yield sse(piece)
            except TokenyardError as err:
                # The status line is gone already: the failure becomes the last event.
                finished = True
                yield sse({"detail": unavailable(err).detail}, event="error")
                return
        finished = True
        yield sse({"pieces": count}, event="done")
    finally:
        streams.open -= 1
        if finished:
            streams.finished += 1
        else:
            streams.aborted += 1


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that closes its generator however the response
    ends: Starlette cancels the sending task when the client disconnects, which may leave
    the generator suspended at a ``yield`` rather than finished."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[str, None]) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._body.aclose()


@app.post("/generate/stream")
async def generate_stream(
    body: GenerateRequest, request: Request, pipeline: PipelineDep
) -> EventStreamResponse:
    """Stream a completion as server-sent events."""
    return EventStreamResponse(events(pipeline, body, request.app.state.streams))


def main() -> None:
    """Serve the app with uvicorn (SIGINT or SIGTERM shuts it down, pipeline included)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main()
