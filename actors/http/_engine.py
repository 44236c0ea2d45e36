"""The narrow interface the HTTP layer needs from whatever generates: `Engine`.

The app is written against this protocol only. Today `PipelineEngine` implements it over an
in-process `actors.Pipeline`; inside a tokenizer-worker process another implementation will
reach the worker living in the same process. Neither the app nor its tests know which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from actors._tokenizer import decode_ids, encode_ids, vocab_size
from runtime import TokenyardError

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from actors.messages import SamplingParams

    from ._chat import ChatTemplate

__all__ = (
    "Chunk",
    "Completion",
    "Engine",
    "EngineError",
    "EngineRefusedError",
    "EngineUnavailableError",
    "TokenizerFacts",
)


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A whole generation, as `Engine.generate` returns it.

    Attributes:
        text: The generated text, stop strings trimmed.
        output_ids: The generated token ids.
        prompt_tokens: Prompt length in tokens.
        completion_tokens: Generated tokens.
        finish_reason: ``"stop"`` (eos, a stop token or a stop string) or ``"length"``
            (``max_new_tokens`` reached).
    """

    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


class Chunk(msgspec.Struct, frozen=True, kw_only=True):
    """One step of a streamed generation, as `Engine.stream` yields it.

    Attributes:
        text: The text decoded since the previous chunk (may be empty in the last one).
        finish_reason: ``None`` until the last chunk; then ``"stop"`` or ``"length"``.
        prompt_tokens: Prompt length in tokens (set in the last chunk).
        completion_tokens: Generated tokens (set in the last chunk).
    """

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class EngineError(TokenyardError):
    """The engine failed a request that was valid: a server fault (HTTP 500, or an error
    event once a stream has begun)."""


class EngineRefusedError(EngineError):
    """The engine refused the request as it is (a prompt its context cannot hold, sampling
    parameters it does not take): HTTP 400, the same request would be refused again. It
    is raised when the engine's bounds are learnt after the app checked the request (an
    engine that reports a shorter context once it is ready).

    Attributes:
        code: The OpenAI error code (``context_length_exceeded``, ``invalid_value``).
    """

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


class EngineUnavailableError(EngineError):
    """The engine cannot serve the request now but may soon (a worker died and no other
    took the request, the pipeline is closing, a queue is full): HTTP 503 with a
    ``Retry-After`` hint.

    Attributes:
        retry_after: Seconds after which a retry may succeed.
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Engine(Protocol):
    """What the HTTP layer needs from an engine.

    The app validates every request before it reaches the engine: prompts are non-empty
    token ids within ``vocab_size`` and within the context, sampling parameters are within
    their ranges. An engine raises `EngineUnavailableError` when it cannot serve now,
    `EngineRefusedError` when it can never serve the request as it is (a bound it learnt
    since, or one the app cannot know), and `EngineError` for any other failure of a valid
    request; nothing else.

    Attributes:
        model: The model's id (``/v1/models``, the ``model`` of every response).
        context_length: Most prompt plus completion tokens of one request.
        vocab_size: Token ids are ``0..vocab_size-1``.
        chat_template: How chat messages become a prompt for this engine's tokenizer.
    """

    @property
    def model(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def chat_template(self) -> ChatTemplate: ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; by default without the special tokens the tokenizer's
        post-processor would add (a chat template writes its own), with them when
        ``add_special_tokens`` (``/tokenize`` asks for them)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included."""
        ...

    def not_ready(self) -> str | None:
        """Why the engine cannot generate now (an engine still starting, or restarting),
        or ``None`` when it can: ``/health`` answers 503 with it, 200 without."""
        ...

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> Completion:
        """Generate a whole completion of ``prompt`` (text or token ids).

        ``traceparent`` is the caller's trace context (the HTTP request's, a W3C
        ``traceparent`` already checked), the parent of the engine's spans; ``None``: the
        caller sent none. It is a parameter, not ambient state: an engine reads it where it
        admits the request, and one that traces nothing ignores it.

        Cancelling the call abandons the request: the engine stops generating for it.
        """
        ...

    def stream(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> AsyncGenerator[Chunk, None]:
        """Stream a completion of ``prompt``: chunks of new text, the last one carrying the
        finish reason and the token counts (``traceparent`` as for `generate`).

        Closing the generator (or cancelling the task iterating it) before its end abandons
        the request: the engine stops generating for it.
        """
        ...


class TokenizerFacts:
    """What an engine says about its model and tokenizer: the part of `Engine` both of
    tokenyard's engines share (they differ in how they generate).

    Args:
        tokenizer: The ``tokenizers.Tokenizer`` the pipeline's workers use.
        model: The model id.
        context_length: Most prompt plus completion tokens of one request.
        chat_template: How chat messages become prompts.

    Raises:
        ValueError: ``context_length`` is below 2.
    """

    def __init__(
        self, tokenizer: Any, *, model: str, context_length: int, chat_template: ChatTemplate
    ) -> None:
        if context_length < 2:
            raise ValueError(f"context_length={context_length}: it must be at least 2")
        self._tokenizer = tokenizer
        self._model = model
        self._context_length = context_length
        self._chat_template = chat_template
        self._vocab_size = vocab_size(tokenizer)  # as the scheduler counts it

    @property
    def model(self) -> str:
        """The model id."""
        return self._model

    @property
    def context_length(self) -> int:
        """Most prompt plus completion tokens of one request."""
        return self._context_length

    @property
    def vocab_size(self) -> int:
        """Token ids are ``0..vocab_size-1``."""
        return self._vocab_size

    @property
    def chat_template(self) -> ChatTemplate:
        """The chat template beside the tokenizer (or the default)."""
        return self._chat_template

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``: by default no special tokens added (as the workers
        encode), else those the tokenizer's post-processor adds (a BOS, say). A long text
        lets go of the GIL while it is tokenized (`actors._tokenizer.encode_ids`).
        """
        return encode_ids(self._tokenizer, text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included (many let go of the GIL while they
        are decoded: `actors._tokenizer.decode_ids`)."""
        return decode_ids(self._tokenizer, ids, skip_special_tokens=False)

    def not_ready(self) -> str | None:
        """Ready whenever asked: the pipeline's worker engine says otherwise while the
        scheduler or its engine is not up."""
        return None
