"""Sending one stream: an engine's chunks as server-sent events, one ``send`` at a time."""

from __future__ import annotations

from contextlib import aclosing
from typing import TYPE_CHECKING

from ._engine import EngineError
from ._errors import engine_failure
from ._sse import ChunkFormat

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable

    from ._asgi import Send
    from ._engine import Chunk

__all__ = ("send_stream",)

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Proxies such as nginx buffer responses unless told not to: a stream must flow.
    (b"x-accel-buffering", b"no"),
]


async def send_stream(
    send: Send,
    chunks: AsyncGenerator[Chunk, None],
    fmt: ChunkFormat,
    started: Callable[[], None],
) -> EngineError | None:
    """Send ``chunks`` as a stream's events, closing ``chunks`` however it ends.

    The status waits for the first chunk, so that a failure before any output is still an
    HTTP error, not a broken stream. Each chunk is sent before the next is taken: while a
    client does not read, ``send`` waits and the engine's stream is not read (push-back).

    Args:
        send: The ASGI send callable.
        chunks: The engine's stream.
        fmt: The request's chunk format.
        started: Called just before the status is sent.

    Returns:
        The failure that ended the stream after it began (its last event said so, before
        ``[DONE]``), or ``None`` when it ended well.

    Raises:
        HTTPError: The engine failed before the first chunk (503 or 500).
    """
    async with aclosing(chunks):
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            raise engine_failure(EngineError("the engine's stream ended empty")) from None
        except EngineError as err:
            raise engine_failure(err) from err
        started()
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        chunk = first
        head = fmt.start()
        try:
            while chunk.finish_reason is None:
                body = head + fmt.piece(chunk.text)
                head = b""
                await send({"type": "http.response.body", "body": body, "more_body": True})
                chunk = await anext(chunks)
        except StopAsyncIteration:
            failure = EngineError("the engine's stream ended unfinished")
        except EngineError as err:
            failure = err
        else:
            body = head + fmt.end(
                chunk.text, chunk.finish_reason, chunk.prompt_tokens, chunk.completion_tokens
            )
            await send({"type": "http.response.body", "body": body})
            return None
        body = ChunkFormat.error(engine_failure(failure).body())
        await send({"type": "http.response.body", "body": body})
        return failure
