"""Request validation: what becomes token ids and sampling parameters, and every refusal.

The engine is a real `PipelineEngine` over a pipeline that is never opened: validation only
uses its tokenizer, vocabulary and chat template.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from actors import Pipeline
from actors._tokenizer import BOS_TOKEN
from actors.http import PipelineEngine, ServeConfig
from actors.http._errors import HTTPError
from actors.http._openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from actors.http._validate import MAX_SEED, Prepared, Validator
from actors.messages import SamplingParams

from ._tokenizer import write_bos_tokenizer

if TYPE_CHECKING:
    from pathlib import Path

ENGINE = PipelineEngine(Pipeline(workers=1), context_length=256)
MODEL = ENGINE.model
HELLO = ENGINE.encode("Hello there")
#: The code of a value OpenAI's API takes and this server refuses on purpose.
UNSERVED = "unsupported_value"


def validator(**config: Any) -> Validator:
    config.setdefault("context_length", 64)
    cfg = ServeConfig(**config)
    return Validator(ENGINE, cfg, cfg.limits(ENGINE.context_length), MODEL)


async def completion(**body: Any) -> Prepared:
    body.setdefault("prompt", "Hello there")
    return await validator().completion(msgspec.convert(body, CompletionRequest))


async def chat(**body: Any) -> Prepared:
    body.setdefault("messages", [{"role": "user", "content": "Hello"}])
    return await validator().chat(msgspec.convert(body, ChatCompletionRequest))


async def refused(make: Any, **body: Any) -> HTTPError:
    with pytest.raises(HTTPError) as caught:
        await make(**body)
    return caught.value


class TestCompletions:
    async def test_a_text_prompt_becomes_its_ids_with_openais_defaults(self) -> None:
        prepared = await completion()
        assert prepared.prompt_ids == HELLO
        assert prepared.params == SamplingParams(max_new_tokens=64 - len(HELLO), temperature=1.0)
        assert (prepared.stream, prepared.include_usage) == (False, False)

    @pytest.mark.parametrize("prompt", [HELLO, [HELLO], ["Hello there"]])
    async def test_ids_and_single_item_lists_are_one_prompt(self, prompt: Any) -> None:
        assert (await completion(prompt=prompt)).prompt_ids == HELLO

    async def test_every_served_parameter_reaches_the_sampling_params(self) -> None:
        prepared = await completion(
            max_tokens=9,
            stop="x",
            temperature=0,
            seed=MAX_SEED,
            ignore_eos=True,
            stop_token_ids=[5],
            skip_special_tokens=False,
            include_stop_str_in_output=True,
            stream=True,
            stream_options={"include_usage": True},
            n=1,
            best_of=1,
            user="someone",
            top_p=1,
            presence_penalty=0,
            frequency_penalty=0,
            logit_bias={},
            suffix="",
            echo=False,
        )
        assert prepared.params == SamplingParams(
            max_new_tokens=9,
            stop=("x",),
            stop_token_ids=(5,),
            temperature=0.0,
            seed=MAX_SEED,
            skip_special_tokens=False,
            no_stop_trim=True,
            ignore_eos=True,
        )
        assert (prepared.stream, prepared.include_usage) == (True, True)

    async def test_the_default_max_tokens_shrinks_to_the_room_left_in_the_context(self) -> None:
        v = validator(default_max_tokens=256)
        prepared = await v.completion(CompletionRequest(prompt=list(range(10, 60))))
        assert prepared.params.max_new_tokens == 64 - 50

    @pytest.mark.parametrize(
        ("body", "param", "code"),
        [
            ({"prompt": ""}, "prompt", None),
            ({"prompt": []}, "prompt", None),
            ({"prompt": [[]]}, "prompt", None),
            ({"prompt": ["a", "b"]}, "prompt", UNSERVED),
            ({"prompt": [1, "a"]}, "prompt", None),
            ({"prompt": [1, 99_999]}, "prompt[1]", None),
            ({"prompt": [-1]}, "prompt[0]", None),
            ({"max_tokens": 0}, "max_tokens", None),
            ({"max_tokens": 4097}, "max_tokens", None),
            ({"temperature": -0.1}, "temperature", None),
            ({"temperature": 2.5}, "temperature", None),
            ({"seed": -1}, "seed", None),
            ({"seed": MAX_SEED + 1}, "seed", None),
            ({"n": 0}, "n", None),
            ({"n": 2}, "n", UNSERVED),
            ({"best_of": 2}, "best_of", UNSERVED),
            ({"best_of": 0}, "best_of", None),
            ({"logprobs": 0}, "logprobs", UNSERVED),
            ({"echo": True}, "echo", UNSERVED),
            ({"suffix": "end"}, "suffix", UNSERVED),
            ({"top_p": 0.9}, "top_p", UNSERVED),
            ({"presence_penalty": 0.5}, "presence_penalty", UNSERVED),
            ({"frequency_penalty": -1}, "frequency_penalty", UNSERVED),
            ({"logit_bias": {"5": 1.0}}, "logit_bias", UNSERVED),
            ({"stop": ""}, "stop", None),
            ({"stop": ["x"] * 17}, "stop", None),
            ({"stop": "y" * 257}, "stop", None),
            ({"stop_token_ids": [4096]}, "stop_token_ids[0]", None),
            ({"stop_token_ids": list(range(65))}, "stop_token_ids", None),
            ({"stream_options": {"include_usage": True}}, "stream_options", None),
        ],
    )
    async def test_a_bad_value_is_a_400_naming_its_field(
        self, body: dict[str, Any], param: str, code: str | None
    ) -> None:
        err = await refused(completion, **body)
        assert (err.status, err.param, err.code) == (400, param, code)

    async def test_another_model_is_not_found(self) -> None:
        err = await refused(completion, model="gpt-4")
        assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
        assert (await completion(model=MODEL)).prompt_ids == HELLO

    async def test_a_prompt_beyond_the_context_is_refused_in_tokens(self) -> None:
        err = await refused(completion, prompt=list(range(10, 74)))
        assert (err.status, err.code) == (400, "context_length_exceeded")
        assert "64 tokens long, more than this server takes (63" in err.message

    async def test_max_tokens_beyond_the_room_left_is_refused(self) -> None:
        err = await refused(completion, prompt=list(range(10, 60)), max_tokens=15)
        assert (err.code, err.param) == ("context_length_exceeded", "max_tokens")
        prepared = await completion(prompt=list(range(10, 60)), max_tokens=14)
        assert prepared.params.max_new_tokens == 14

    async def test_a_prompt_over_the_byte_limit_is_refused_before_it_is_tokenized(self) -> None:
        v = validator(max_prompt_bytes=10)
        with pytest.raises(HTTPError, match="longer than 10 bytes") as caught:
            await v.completion(CompletionRequest(prompt="日本語だ"))  # 4 characters, 12 bytes
        assert caught.value.code == "context_length_exceeded"
        assert (await v.completion(CompletionRequest(prompt="日本語"))).prompt_ids


class TestChat:
    async def test_messages_are_rendered_by_the_template_then_tokenized(self) -> None:
        messages = [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "ok", "name": "bot"},
            {"role": "user", "content": "Hello"},
        ]
        text = ENGINE.chat_template.render(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "a\nb"},
                {"role": "assistant", "content": "ok", "name": "bot"},
                {"role": "user", "content": "Hello"},
            ]
        )
        v = validator(context_length=256)
        prepared = await v.chat(msgspec.convert({"messages": messages}, ChatCompletionRequest))
        assert prepared.prompt_ids == ENGINE.encode(text)

    async def test_max_completion_tokens_wins_over_max_tokens(self) -> None:
        assert (await chat(max_tokens=3, max_completion_tokens=5)).params.max_new_tokens == 5
        assert (await chat(max_tokens=3)).params.max_new_tokens == 3
        err = await refused(chat, max_completion_tokens=0)
        assert err.param == "max_completion_tokens"

    async def test_neutral_values_of_unserved_options_are_accepted(self) -> None:
        prepared = await chat(
            response_format={"type": "text"},
            tools=[],
            tool_choice="none",
            function_call="none",
            parallel_tool_calls=True,
            logprobs=False,
            top_logprobs=0,
        )
        assert prepared.params.max_new_tokens > 0

    @pytest.mark.parametrize(
        ("body", "param", "code"),
        [
            ({"messages": []}, "messages", None),
            ({"messages": [{"role": "user"}]}, "messages[0].content", None),
            ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
            ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", UNSERVED),
            (
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                "messages[0].content[0]",
                UNSERVED,
            ),
            (
                {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                "messages[0].content[0]",
                None,
            ),
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", UNSERVED),
            ({"tool_choice": "auto"}, "tool_choice", UNSERVED),
            ({"tool_choice": {"type": "function"}}, "tool_choice", UNSERVED),
            ({"functions": [{"name": "f"}]}, "functions", UNSERVED),
            ({"function_call": "auto"}, "function_call", UNSERVED),
            ({"logprobs": True}, "logprobs", UNSERVED),
            ({"top_logprobs": 2}, "top_logprobs", UNSERVED),
            ({"response_format": {"type": "json_object"}}, "response_format", UNSERVED),
            ({"n": 3}, "n", UNSERVED),
            ({"top_p": 0.5}, "top_p", UNSERVED),
        ],
    )
    async def test_a_bad_or_unserved_value_is_a_400_naming_its_field(
        self, body: dict[str, Any], param: str, code: str | None
    ) -> None:
        err = await refused(chat, **body)
        assert (err.status, err.param, err.code) == (400, param, code)

    async def test_too_many_messages_are_refused(self) -> None:
        v = validator(max_messages=2)
        body = {"messages": [{"role": "user", "content": "x"}] * 3}
        with pytest.raises(HTTPError, match=r"ServeConfig\.max_messages"):
            await v.chat(msgspec.convert(body, ChatCompletionRequest))

    async def test_a_rendered_prompt_beyond_the_context_is_refused(self) -> None:
        err = await refused(chat, messages=[{"role": "user", "content": "word " * 80}])
        assert (err.code, err.param) == ("context_length_exceeded", "messages")


class TestTokenize:
    async def test_a_prompt_is_tokenized_without_a_token_limit(self) -> None:
        v = validator()
        long = "word " * 200
        assert await v.tokenize(TokenizeRequest(prompt=long)) == ENGINE.encode(long)
        assert await v.tokenize(TokenizeRequest(prompt="")) == []

    async def test_messages_are_tokenized_as_the_chat_renders_them(self) -> None:
        messages = [{"role": "user", "content": "Hello"}]
        req = msgspec.convert({"messages": messages}, TokenizeRequest)
        assert await validator().tokenize(req) == ENGINE.encode(
            ENGINE.chat_template.render(messages)
        )

    async def test_special_tokens_are_added_to_a_prompt_unless_refused_and_to_messages_if_asked(
        self, tmp_path: Path
    ) -> None:
        engine = PipelineEngine(Pipeline(workers=1, tokenizer=write_bos_tokenizer(tmp_path)))
        cfg = ServeConfig()
        v = Validator(engine, cfg, cfg.limits(engine.context_length), engine.model)
        messages = [{"role": "user", "content": "Hello"}]
        chat = engine.encode(engine.chat_template.render(messages))
        hello = engine.encode("Hello there")
        bos = engine.encode(BOS_TOKEN)

        async def tokenize(**body: Any) -> list[int]:
            return await v.tokenize(msgspec.convert(body, TokenizeRequest))

        assert await tokenize(prompt="Hello there") == bos + hello
        assert await tokenize(prompt="Hello there", add_special_tokens=False) == hello
        assert await tokenize(messages=messages) == chat
        assert await tokenize(messages=messages, add_special_tokens=True) == bos + chat
        # A long prompt, tokenized off the event loop, gets them the same way.
        long = "Hello there " * 400
        assert await tokenize(prompt=long) == bos + engine.encode(long)
        assert engine.encode("Hello there", add_special_tokens=True) == bos + hello

    @pytest.mark.parametrize("body", [{}, {"prompt": "x", "messages": []}])
    async def test_it_takes_exactly_one_of_prompt_and_messages(self, body: dict[str, Any]) -> None:
        with pytest.raises(HTTPError, match="either `prompt` or `messages`"):
            await validator().tokenize(msgspec.convert(body, TokenizeRequest))

    def test_detokenize_checks_ids_against_the_vocabulary(self) -> None:
        assert validator().detokenize(DetokenizeRequest(tokens=HELLO)) == HELLO
        with pytest.raises(HTTPError) as caught:
            validator().detokenize(DetokenizeRequest(tokens=[1, 5000]))
        assert caught.value.param == "tokens[1]"
        with pytest.raises(HTTPError):
            validator().detokenize(DetokenizeRequest(tokens=[1], model="other"))
