"""The OpenAI wire format: request bodies as strict msgspec structs, responses as structs.

Request structs forbid unknown fields, so a parameter this server does not implement is
refused with a 400 naming it rather than silently ignored. Parameters that OpenAI's clients
commonly send at their neutral value (``top_p: 1``, ``presence_penalty: 0``, an empty
``logit_bias``...) are declared, and refused by validation only when they ask for something
(`actors.http._validate`). Field names follow OpenAI's API reference; ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens`` and ``include_stop_str_in_output`` are the
extensions vLLM and SGLang accept.
"""

from __future__ import annotations

from typing import Any

import msgspec

# -- requests -------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no
    choices."""

    include_usage: bool | None = None


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields both request bodies share: the model, how much to generate and how."""

    model: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Accepted at their neutral value only.
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[str | int | list[int]]
    # Accepted at their neutral value only.
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    """One part of a message's ``content`` list. Unknown fields are let through so that an
    image or audio part is refused by its ``type``, with a message that says so."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One message of a chat request (``tool_calls`` and the like are refused as unknown)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(msgspec.Struct):
    """``response_format``: only ``{"type": "text"}`` is served."""

    type: str


class ChatCompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # Accepted at their neutral value only.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered by the
    chat template first. ``add_special_tokens`` adds what the tokenizer's post-processor
    adds (a BOS, say); unset, it is true for a prompt and false for messages, whose
    template writes its own, as vLLM's ``/tokenize`` has it."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None


# -- responses ------------------------------------------------------------------------------


class Usage(msgspec.Struct):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(msgspec.Struct):
    """The one choice of a completion (or of a completion chunk)."""

    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A ``text_completion`` object (also a stream's chunks, ``usage`` then ``None``)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(msgspec.Struct):
    """The generated message of a chat completion."""

    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    """The one choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    """A ``chat.completion`` object."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(msgspec.Struct, omit_defaults=True):
    """What one chat chunk adds to the message (the first one also names the role)."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    """The one choice of a chat completion chunk."""

    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """A ``chat.completion.chunk`` object."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    """One entry of ``GET /v1/models``."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "tokenyard"


class ModelList(msgspec.Struct):
    """The body of ``GET /v1/models``."""

    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    """The body of a ``/tokenize`` answer (vLLM's and SGLang's shape)."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    """The body of a ``/detokenize`` answer."""

    prompt: str


class ErrorDetail(msgspec.Struct):
    """What went wrong, as OpenAI reports it."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """An error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail
