"""Server-sent events in OpenAI's chunk format, assembled from per-request templates.

A stream's chunks differ only in their text and finish reason, so each request builds the
constant bytes around them once and every chunk costs one JSON string encoding and a
concatenation (the hot path of streaming). The bytes decode to the chunk structs of
`actors.http._openai` (``CompletionResponse``, ``ChatCompletionChunk``), which the tests
check.
"""

from __future__ import annotations

import msgspec

from ._openai import Usage

__all__ = ("DONE", "ChunkFormat")

DONE = b"data: [DONE]\n\n"
"""The event that ends every stream that ended well."""

_ENCODE = msgspec.json.Encoder().encode
_OPEN = b',"logprobs":null,"finish_reason":null}]'


class ChunkFormat:
    """The bytes of one request's stream.

    Args:
        chat: ``chat.completion.chunk`` objects (else ``text_completion`` ones).
        rid: The response's id.
        created: Its creation time, Unix seconds.
        model: The model id.
        include_usage: Every chunk carries ``"usage": null`` and the stream ends with a
            usage chunk (``stream_options.include_usage``).
    """

    def __init__(
        self, *, chat: bool, rid: str, created: int, model: str, include_usage: bool
    ) -> None:
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        self._prefix = (
            b'data: {"id":'
            + _ENCODE(rid)
            + b',"object":"'
            + obj
            + b'","created":'
            + str(created).encode()
            + b',"model":'
            + _ENCODE(model)
            + b',"choices":['
        )
        self._head = self._prefix + (b'{"index":0,"delta":' if chat else b'{"index":0,"text":')
        self._tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        self.chat = chat
        self.include_usage = include_usage

    def start(self) -> bytes:
        """What precedes the first piece: the chat chunk naming the role (nothing for
        completions)."""
        if not self.chat:
            return b""
        return self._head + b'{"role":"assistant","content":""}' + _OPEN + self._tail

    def piece(self, text: str) -> bytes:
        """A chunk adding ``text``."""
        if self.chat:
            return self._head + b'{"content":' + _ENCODE(text) + b"}" + _OPEN + self._tail
        return self._head + _ENCODE(text) + _OPEN + self._tail

    def end(
        self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> bytes:
        """The last chunks: the last piece with the finish reason (chat: the piece, then an
        empty delta with it), the usage chunk if asked for, then ``[DONE]``."""
        reason = b',"logprobs":null,"finish_reason":' + _ENCODE(finish_reason) + b"}]"
        if self.chat:
            last = self.piece(text) if text else b""
            last += self._head + b"{}" + reason + self._tail
        else:
            last = self._head + _ENCODE(text) + reason + self._tail
        if self.include_usage:
            usage = Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            )
            last += self._prefix + b'],"usage":' + _ENCODE(usage) + b"}\n\n"
        return last + DONE

    @staticmethod
    def error(body: bytes) -> bytes:
        """An error event (``body`` an OpenAI error object), then ``[DONE]``: how a stream
        that fails after it began ends (as vLLM's do). A client learns of the failure from
        the error object; one that waits only for ``[DONE]`` is not left waiting."""
        return b"data: " + body + b"\n\n" + DONE
