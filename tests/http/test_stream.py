"""send_stream: an engine's chunks as a stream's events, its failures before and after the
status, and the engine's stream closed however the sending ends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

from actors.http import Chunk, EngineError, EngineUnavailableError
from actors.http._errors import HTTPError
from actors.http._sse import ChunkFormat
from actors.http._stream import send_stream

from ._server import sse_events

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, MutableMapping

LAST = Chunk(text="!", finish_reason="length", prompt_tokens=2, completion_tokens=3)


class Source:
    """An engine stream of given chunks (or a failure in their place), which records
    whether it was closed."""

    def __init__(self, *items: Chunk | Exception) -> None:
        self.items = items
        self.closed = False

    async def chunks(self) -> AsyncGenerator[Chunk, None]:
        try:
            for item in self.items:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True


class Sent:
    """An ASGI send callable keeping what it was sent, and counting ``started`` calls."""

    def __init__(self) -> None:
        self.messages: list[MutableMapping[str, Any]] = []
        self.started_before: list[int] = []

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        self.messages.append(message)

    def started(self) -> None:
        self.started_before.append(len(self.messages))

    def events(self) -> list[Any]:
        return sse_events(b"".join(m.get("body", b"") for m in self.messages[1:]))


def fmt(chat: bool = False) -> ChunkFormat:
    return ChunkFormat(chat=chat, rid="r", created=1, model="m", include_usage=True)


async def test_a_stream_that_ends_well_sends_its_pieces_usage_and_done() -> None:
    source, sent = Source(Chunk(text="Hel"), Chunk(text="lo"), LAST), Sent()
    assert await send_stream(sent, source.chunks(), fmt(chat=True), sent.started) is None
    start = sent.messages[0]
    assert (start["type"], start["status"]) == ("http.response.start", 200)
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert sent.started_before == [0]
    events = sent.events()
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts = [e["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert texts == ["Hel", "lo", "!", None]
    assert events[-2]["usage"]["total_tokens"] == 5
    assert [m.get("more_body", False) for m in sent.messages[1:]] == [True, True, False]
    assert source.closed


@pytest.mark.parametrize(
    ("failure", "status"),
    [(EngineUnavailableError("no worker", retry_after=2), 503), (EngineError("broken"), 500)],
)
async def test_a_failure_before_the_first_chunk_is_an_http_error_and_nothing_is_sent(
    failure: Exception, status: int
) -> None:
    source, sent = Source(failure), Sent()
    with pytest.raises(HTTPError) as caught:
        await send_stream(sent, source.chunks(), fmt(), sent.started)
    assert caught.value.status == status
    assert (sent.messages, sent.started_before) == ([], [])
    assert source.closed
    if status == 503:
        assert (b"retry-after", b"2") in caught.value.headers


async def test_an_empty_stream_is_a_server_fault() -> None:
    with pytest.raises(HTTPError, match="ended empty") as caught:
        await send_stream(Sent(), Source().chunks(), fmt(), lambda: None)
    assert caught.value.status == 500


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ((Chunk(text="a"), EngineUnavailableError("lost its worker")), "lost its worker"),
        ((Chunk(text="a"), Chunk(text="b")), "ended unfinished"),
    ],
)
async def test_a_failure_after_the_status_is_an_error_event_then_done(
    items: tuple[Chunk | Exception, ...], message: str
) -> None:
    source, sent = Source(*items), Sent()
    failure = await send_stream(sent, source.chunks(), fmt(), sent.started)
    assert failure is not None
    assert message in str(failure)
    events = sent.events()
    assert events[-1] == "[DONE]"
    assert message in events[-2]["error"]["message"]
    assert events[0]["choices"][0]["text"] == "a"
    assert sent.messages[-1].get("more_body", False) is False
    assert source.closed


async def test_a_cancelled_send_closes_the_engines_stream() -> None:
    source = Source(Chunk(text="a"), Chunk(text="b"), LAST)

    async def never(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await anyio.sleep_forever()  # sync-ok: a client that never reads

    with anyio.move_on_after(0.05):
        await send_stream(never, source.chunks(), fmt(), lambda: None)
    assert source.closed
