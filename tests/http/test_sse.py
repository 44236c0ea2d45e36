"""Stream chunks assembled from templates decode to OpenAI's chunk objects."""

from __future__ import annotations

import msgspec
import pytest

from actors.http._openai import ChatCompletionChunk, CompletionResponse, Usage
from actors.http._sse import DONE, ChunkFormat

from ._server import sse_events

TEXT = 'a "quoted" piece\nwith 日本語 and 😀'


def fmt(chat: bool, include_usage: bool = False) -> ChunkFormat:
    return ChunkFormat(
        chat=chat, rid="id-1", created=1700, model='m "x"', include_usage=include_usage
    )


def one(data: bytes) -> bytes:
    assert data.startswith(b"data: ")
    assert data.endswith(b"\n\n")
    assert data.count(b"\n\n") == 1
    return data.removeprefix(b"data: ").removesuffix(b"\n\n")


class TestCompletionChunks:
    def test_a_piece_is_a_text_completion_chunk(self) -> None:
        chunk = msgspec.json.decode(one(fmt(False).piece(TEXT)), type=CompletionResponse)
        assert (chunk.id, chunk.object, chunk.created, chunk.model) == (
            "id-1",
            "text_completion",
            1700,
            'm "x"',
        )
        assert [(c.index, c.text, c.finish_reason) for c in chunk.choices] == [(0, TEXT, None)]
        assert "usage" not in msgspec.json.decode(one(fmt(False).piece(TEXT)))

    def test_the_end_carries_the_last_piece_its_reason_and_then_done(self) -> None:
        events = sse_events(fmt(False).end("last", "length", 3, 4))
        assert events[-1] == "[DONE]"
        (last,) = events[:-1]
        assert last["choices"] == [
            {"index": 0, "text": "last", "logprobs": None, "finish_reason": "length"}
        ]

    def test_completions_have_no_start_chunk(self) -> None:
        assert fmt(False).start() == b""


class TestChatChunks:
    def test_the_start_names_the_assistant_role(self) -> None:
        chunk = msgspec.json.decode(one(fmt(True).start()), type=ChatCompletionChunk)
        assert chunk.object == "chat.completion.chunk"
        assert chunk.choices[0].delta.role == "assistant"
        assert chunk.choices[0].delta.content == ""

    def test_a_piece_is_a_content_delta(self) -> None:
        chunk = msgspec.json.decode(one(fmt(True).piece(TEXT)), type=ChatCompletionChunk)
        assert (chunk.choices[0].delta.role, chunk.choices[0].delta.content) == (None, TEXT)

    @pytest.mark.parametrize("text", ["", "tail"])
    def test_the_end_is_the_last_piece_then_an_empty_delta_with_the_reason(self, text: str) -> None:
        events = sse_events(fmt(True).end(text, "stop", 3, 4))
        assert events[-1] == "[DONE]"
        pieces = [e["choices"][0]["delta"].get("content") for e in events[:-1]]
        assert pieces == ([text] if text else []) + [None]
        assert events[-2]["choices"][0]["delta"] == {}
        assert events[-2]["choices"][0]["finish_reason"] == "stop"


class TestUsage:
    @pytest.mark.parametrize("chat", [False, True])
    def test_with_include_usage_every_chunk_has_null_usage_and_a_usage_chunk_ends(
        self, chat: bool
    ) -> None:
        f = fmt(chat, include_usage=True)
        assert msgspec.json.decode(one(f.piece("x")))["usage"] is None
        events = sse_events(f.end("y", "length", 3, 4))
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == []
        assert msgspec.convert(usage["usage"], Usage) == Usage(3, 4, 7)
        assert all(e["usage"] is None for e in events[:-2])

    def test_without_include_usage_no_usage_chunk_is_sent(self) -> None:
        events = sse_events(fmt(False).end("y", "length", 3, 4))
        assert all("usage" not in e for e in events[:-1])


def test_an_error_event_is_the_error_object_and_done_follows() -> None:
    data = ChunkFormat.error(b'{"error":{"message":"x"}}')
    assert sse_events(data) == [{"error": {"message": "x"}}, "[DONE]"]
    assert data.endswith(DONE)
