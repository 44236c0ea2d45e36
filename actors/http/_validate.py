"""Request validation: a decoded OpenAI body becomes token ids and `SamplingParams`, or a
4xx `HTTPError` that names the field at fault.

Everything an engine could refuse is checked here first (empty prompts, ids outside the
vocabulary, prompts beyond the context, out-of-range sampling values), so that what the
engine still refuses is a server fault, not the caller's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from actors._tokenizer import INLINE_CHARS, TOKENIZER_THREADS
from actors.messages import LARGEST_INT, SamplingParams

from ._chat import ChatTemplateError
from ._errors import HTTPError

if TYPE_CHECKING:
    from actors._limits import RequestLimits

    from ._config import ServeConfig
    from ._engine import Engine
    from ._openai import (
        ChatCompletionRequest,
        ChatMessage,
        CompletionRequest,
        DetokenizeRequest,
        TokenizeRequest,
    )

__all__ = ("INLINE_CHARS", "INLINE_IDS", "TOKENIZER_THREADS", "Prepared", "Validator")

INLINE_IDS = 4096
"""Token ids up to this many are decoded on the event loop; more in a thread."""

MAX_SEED = LARGEST_INT
"""Largest seed accepted (seeds are 64-bit signed integers, negative ones refused)."""
# OpenAI's temperature range.
_TEMPERATURE = (0.0, 2.0)
# Without an explicit temperature OpenAI samples at 1.
_DEFAULT_TEMPERATURE = 1.0
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


#: Characters of a client's model name that an error quotes back (the name may be as long
#: as a body is: the answer stays small).
_ECHOED = 256


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated generation request.

    Attributes:
        prompt_ids: The prompt's token ids (never empty, all within the vocabulary).
        params: What to generate.
        stream: Answer with server-sent events.
        include_usage: End the stream with a usage chunk.
    """

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


def _bad(message: str, param: str | None, code: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param, code=code)


def _unsupported(message: str, param: str) -> HTTPError:
    """A 400 for a value this server refuses on purpose (OpenAI's ``unsupported_value``):
    valid in OpenAI's API, not implemented here, so a client can tell it from a mistake."""
    return _bad(message, param, "unsupported_value")


class Validator:
    """Checks requests against the limits in force in front of one engine.

    Args:
        engine: The engine the requests go to (its tokenizer, vocabulary and template).
        config: The HTTP layer's limits.
        limits: The limits `ServeConfig.limits` resolved for the engine: the only check
            of a request's prompt and ``max_tokens`` (its worker takes the ids as they are).
        model: The model id requests may name.
    """

    def __init__(
        self, engine: Engine, config: ServeConfig, limits: RequestLimits, model: str
    ) -> None:
        self.engine = engine
        self.config = config
        self.limits = limits
        self.model = model
        self.vocab_size = engine.vocab_size
        self._threads: anyio.CapacityLimiter | None = None

    async def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``text``'s token ids; a long text is tokenized off the event loop."""
        if len(text) <= INLINE_CHARS:
            return self.engine.encode(text, add_special_tokens=add_special_tokens)
        encode = functools.partial(self.engine.encode, add_special_tokens=add_special_tokens)
        return await anyio.to_thread.run_sync(encode, text, limiter=self._limiter())

    async def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; many are decoded off the event loop."""
        if len(ids) <= INLINE_IDS:
            return self.engine.decode(ids)
        return await anyio.to_thread.run_sync(self.engine.decode, ids, limiter=self._limiter())

    def _limiter(self) -> anyio.CapacityLimiter:
        if self._threads is None:  # made in the event loop that uses it
            self._threads = anyio.CapacityLimiter(TOKENIZER_THREADS)
        return self._threads

    # -- whole requests -------------------------------------------------------------------

    async def completion(self, req: CompletionRequest) -> Prepared:
        """Validate a ``/v1/completions`` body."""
        self.check_model(req.model)
        _neutral(req.top_p, req.frequency_penalty, req.presence_penalty, req.logit_bias)
        if req.logprobs is not None:
            raise _unsupported("logprobs are not supported by this server", "logprobs")
        if req.echo:
            raise _unsupported("echo is not supported by this server", "echo")
        if req.best_of is not None and req.best_of != 1:
            if req.best_of < 1:
                raise _bad(f"best_of must be at least 1, got {req.best_of}", "best_of")
            raise _unsupported(f"best_of={req.best_of}: only 1 is supported", "best_of")
        if req.suffix:
            raise _unsupported("suffix is not supported by this server", "suffix")
        ids = await self._completion_prompt(req.prompt)
        return self._prepare(ids, req, req.max_tokens, "max_tokens")

    async def chat(self, req: ChatCompletionRequest) -> Prepared:
        """Validate a ``/v1/chat/completions`` body."""
        self.check_model(req.model)
        _neutral(req.top_p, req.frequency_penalty, req.presence_penalty, req.logit_bias)
        if req.logprobs or req.top_logprobs:
            param = "logprobs" if req.logprobs else "top_logprobs"
            raise _unsupported("logprobs are not supported by this server", param)
        if req.response_format is not None and req.response_format.type != "text":
            raise _unsupported(
                f"response_format {req.response_format.type!r} is not supported: only 'text'",
                "response_format",
            )
        for param, value in (("tools", req.tools), ("functions", req.functions)):
            if value:
                raise _unsupported(
                    f"{param} are not supported: this server generates text only", param
                )
        for param, choice in (
            ("tool_choice", req.tool_choice),
            ("function_call", req.function_call),
        ):
            if choice is not None and choice != "none":
                raise _unsupported(
                    f"{param} is not supported: this server generates text only", param
                )
        ids = await self._chat_prompt(req.messages, add_generation_prompt=True)
        if req.max_completion_tokens is not None:
            return self._prepare(ids, req, req.max_completion_tokens, "max_completion_tokens")
        return self._prepare(ids, req, req.max_tokens, "max_tokens")

    async def tokenize(self, req: TokenizeRequest) -> list[int]:
        """The token ids of a ``/tokenize`` body (no token limit: counting is its point)."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise _bad("give either `prompt` or `messages`", "prompt")
        if req.messages is not None:
            text = self._render(req.messages, req.add_generation_prompt)
            self._check_bytes(text, "messages")
        else:
            assert req.prompt is not None
            text = req.prompt
            self._check_bytes(text, "prompt")
        special = req.add_special_tokens
        if special is None:
            special = req.messages is None
        return await self.encode(text, add_special_tokens=special)

    def detokenize(self, req: DetokenizeRequest) -> list[int]:
        """The token ids of a ``/detokenize`` body, checked against the vocabulary."""
        self.check_model(req.model)
        self._check_ids(req.tokens, "tokens")
        return req.tokens

    def check_model(self, model: str | None) -> None:
        """A request may name the served model, or none."""
        if model is not None and model != self.model:
            named = model if len(model) <= _ECHOED else model[:_ECHOED] + "..."
            raise HTTPError(
                404,
                f"the model {named!r} does not exist: this server serves {self.model!r}",
                param="model",
                code="model_not_found",
            )

    # -- prompts --------------------------------------------------------------------------

    async def _completion_prompt(self, prompt: str | list[str | int | list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return await self._text_prompt(prompt, "prompt")
        if not prompt:
            raise _bad("prompt is empty", "prompt")
        ints = [x for x in prompt if type(x) is int]
        if len(ints) == len(prompt):
            return self._id_prompt(ints, "prompt")
        if len(prompt) == 1:
            (only,) = prompt
            if isinstance(only, str):
                return await self._text_prompt(only, "prompt")
            if isinstance(only, list):
                return self._id_prompt(only, "prompt")
        if all(isinstance(x, str) for x in prompt) or all(isinstance(x, list) for x in prompt):
            raise _unsupported(
                "several prompts in one request are not supported: send one prompt (a string "
                "or a list of token ids) per request",
                "prompt",
            )
        raise _bad(
            "prompt is a string, a list of token ids, or a list of either; not a mix", "prompt"
        )

    async def _text_prompt(self, text: str, param: str) -> list[int]:
        if not text:
            raise _bad(f"{param} is empty", param)
        self._check_bytes(text, param)
        ids = await self.encode(text)
        if not ids:
            raise _bad(f"{param} tokenizes to no tokens", param)
        self._check_length(len(ids), param)
        return ids

    def _id_prompt(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise _bad(f"{param} is empty", param)
        self._check_length(len(ids), param)
        self._check_ids(ids, param)
        return ids

    async def _chat_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool
    ) -> list[int]:
        text = self._render(messages, add_generation_prompt)
        self._check_bytes(text, "messages")
        ids = await self.encode(text) if text else []
        if not ids:
            raise _bad("the chat template rendered these messages to no tokens", "messages")
        self._check_length(len(ids), "messages")
        return ids

    def _render(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        if not messages:
            raise _bad("messages is empty: a chat request needs at least one message", "messages")
        if len(messages) > self.config.max_messages:
            raise _bad(
                f"{len(messages)} messages are more than this server takes "
                f"({self.config.max_messages}, ServeConfig.max_messages)",
                "messages",
            )
        plain = [_message(i, m) for i, m in enumerate(messages)]
        try:
            return self.engine.chat_template.render(
                plain, add_generation_prompt=add_generation_prompt
            )
        except ChatTemplateError as err:
            raise _bad(str(err), "messages") from err

    def _check_bytes(self, text: str, param: str) -> None:
        refusal = self.limits.text_refusal(text, param)
        if refusal is not None:
            raise _bad(refusal, param, "context_length_exceeded")

    def _check_length(self, count: int, param: str) -> None:
        refusal = self.limits.tokens_refusal(count)
        if refusal is not None:
            raise _bad(refusal, param, "context_length_exceeded")

    def _check_ids(self, ids: list[int], param: str) -> None:
        size = self.vocab_size
        for i, token in enumerate(ids):
            if not 0 <= token < size:
                raise _bad(
                    f"{param}[{i}] = {token} is not a token id: ids are 0..{size - 1}",
                    f"{param}[{i}]",
                )

    # -- sampling -------------------------------------------------------------------------

    def _prepare(
        self,
        ids: list[int],
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        max_param: str,
    ) -> Prepared:
        if req.n is not None and req.n != 1:
            if req.n < 1:
                raise _bad(f"n must be at least 1, got {req.n}", "n")
            raise _unsupported(f"n={req.n}: only one choice per request is supported", "n")
        temperature = _DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
        low, high = _TEMPERATURE
        if not low <= temperature <= high:
            raise _bad(
                f"temperature must be within [{low:g}, {high:g}], got {temperature}", "temperature"
            )
        if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
            raise _bad(f"seed must be within [0, 2**63 - 1], got {req.seed}", "seed")
        stream = bool(req.stream)
        if req.stream_options is not None and not stream:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        stop_token_ids = tuple(req.stop_token_ids or ())
        if len(stop_token_ids) > self.config.max_stop_token_ids:
            raise _bad(
                f"{len(stop_token_ids)} stop_token_ids are more than this server takes "
                f"({self.config.max_stop_token_ids}, ServeConfig.max_stop_token_ids)",
                "stop_token_ids",
            )
        self._check_ids(list(stop_token_ids), "stop_token_ids")
        return Prepared(
            prompt_ids=ids,
            params=SamplingParams(
                max_new_tokens=self._max_tokens(len(ids), max_tokens, max_param),
                stop=self._stop(req.stop),
                stop_token_ids=stop_token_ids,
                temperature=temperature,
                seed=req.seed,
                skip_special_tokens=req.skip_special_tokens is not False,
                no_stop_trim=bool(req.include_stop_str_in_output),
                ignore_eos=bool(req.ignore_eos),
            ),
            stream=stream,
            include_usage=include_usage,
        )

    def _max_tokens(self, prompt_tokens: int, asked: int | None, param: str) -> int:
        room = self.limits.context_length - prompt_tokens
        if asked is None:
            return min(self.config.default_max_tokens, room)
        refusal = self.limits.new_tokens_refusal(asked, param, least=1)
        if refusal is not None:
            raise _bad(refusal, param)
        if asked > room:
            raise _bad(
                f"the context holds {self.limits.context_length} tokens, but {prompt_tokens} "
                f"prompt tokens and {param}={asked} ask for {prompt_tokens + asked}: lower "
                f"{param} or shorten the prompt",
                param,
                "context_length_exceeded",
            )
        return asked

    def _stop(self, stop: str | list[str] | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if len(stops) > self.config.max_stop:
            raise _bad(
                f"{len(stops)} stop strings are more than this server takes "
                f"({self.config.max_stop}, ServeConfig.max_stop)",
                "stop",
            )
        limit = self.config.max_stop_bytes
        for s in stops:
            if not s:
                raise _bad("a stop string is empty", "stop")
            if len(s.encode("utf-8", "surrogatepass")) > limit:
                raise _bad(
                    f"a stop string is longer than {limit} bytes (ServeConfig.max_stop_bytes)",
                    "stop",
                )
        return stops


def _neutral(
    top_p: float | None,
    frequency_penalty: float | None,
    presence_penalty: float | None,
    logit_bias: dict[str, float] | None,
) -> None:
    """Refuse the sampling knobs the engine does not implement, unless neutral."""
    if top_p is not None and top_p != 1:
        raise _unsupported(
            f"top_p={top_p} is not supported: only 1 (no nucleus truncation)", "top_p"
        )
    for param, value in (
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
    ):
        if value is not None and value != 0:
            raise _unsupported(f"{param}={value} is not supported: only 0 (no penalty)", param)
    if logit_bias:
        raise _unsupported("logit_bias is not supported by this server", "logit_bias")


def _message(i: int, message: ChatMessage) -> dict[str, Any]:
    """A message as the template sees it: a known role, its content as one string."""
    role = _ROLES.get(message.role)
    if role is None:
        if message.role in ("tool", "function"):
            raise _unsupported(
                f"messages[{i}]: {message.role!r} messages are not supported: this server "
                "generates text only",
                f"messages[{i}].role",
            )
        raise _bad(
            f"messages[{i}].role {message.role!r} is not one of system, developer, user, assistant",
            f"messages[{i}].role",
        )
    content = message.content
    if content is None:
        raise _bad(f"messages[{i}].content is required", f"messages[{i}].content")
    if not isinstance(content, str):
        texts: list[str] = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise _unsupported(
                    f"messages[{i}].content[{j}]: type {part.type!r} is not supported: only "
                    '{"type": "text", "text": ...} parts',
                    f"messages[{i}].content[{j}]",
                )
            if part.text is None:
                raise _bad(
                    f"messages[{i}].content[{j}]: a text part needs its text",
                    f"messages[{i}].content[{j}]",
                )
            texts.append(part.text)
        # Text parts read as paragraphs of one message.
        content = "\n".join(texts)
    plain: dict[str, Any] = {"role": role, "content": content}
    if message.name is not None:
        plain["name"] = message.name
    return plain
