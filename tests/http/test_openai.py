"""The wire structs: what decodes, what is refused, and the names responses encode."""

from __future__ import annotations

import msgspec
import pytest

from actors.http._openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    StreamOptions,
    TokenizeRequest,
    Usage,
)


class TestRequests:
    def test_a_completion_request_decodes_every_declared_parameter(self) -> None:
        body = (
            b'{"model": "m", "prompt": [1, 2], "max_tokens": 5, "stop": ["x"], '
            b'"temperature": 0, "seed": 7, "stream": true, '
            b'"stream_options": {"include_usage": true}, "n": 1, "user": "u", '
            b'"ignore_eos": true, "stop_token_ids": [3], "skip_special_tokens": false, '
            b'"include_stop_str_in_output": true, "top_p": 1, "frequency_penalty": 0, '
            b'"presence_penalty": 0, "logit_bias": {}, "logprobs": null, "echo": false, '
            b'"best_of": 1, "suffix": null}'
        )
        req = msgspec.json.decode(body, type=CompletionRequest)
        assert (req.prompt, req.max_tokens, req.stop, req.seed) == ([1, 2], 5, ["x"], 7)
        assert req.stream_options == StreamOptions(include_usage=True)
        assert req.temperature == 0.0

    def test_a_prompt_may_be_text_ids_or_a_list_of_either(self) -> None:
        for prompt in ('"hi"', "[1, 2]", '["hi"]', "[[1, 2]]"):
            body = f'{{"prompt": {prompt}}}'.encode()
            assert msgspec.json.decode(body, type=CompletionRequest).prompt == (
                msgspec.json.decode(prompt)
            )

    def test_a_content_part_of_another_type_decodes_so_that_it_can_be_refused_by_name(
        self,
    ) -> None:
        body = (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
            b'"image_url": {"url": "data:,"}}]}]}'
        )
        req = msgspec.json.decode(body, type=ChatCompletionRequest)
        content = req.messages[0].content
        assert isinstance(content, list)
        assert (content[0].type, content[0].text) == ("image_url", None)

    @pytest.mark.parametrize(
        "body",
        [
            b'{"prompt": "x", "stream": "yes"}',
            b'{"prompt": "x", "seed": 1.5}',
            b'{"prompt": "x", "stream_options": {"continuous_usage_stats": true}}',
            b'{"prompt": true}',
        ],
    )
    def test_wrong_types_and_unknown_options_are_refused(self, body: bytes) -> None:
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(body, type=CompletionRequest)

    def test_tokenize_takes_a_prompt_or_messages(self) -> None:
        req = msgspec.json.decode(b'{"prompt": "x", "model": "m"}', type=TokenizeRequest)
        assert (req.prompt, req.messages, req.add_generation_prompt) == ("x", None, True)


class TestResponses:
    def test_a_completion_encodes_openais_field_names(self) -> None:
        response = CompletionResponse(
            id="cmpl-1", created=1, model="m", choices=[], usage=Usage(1, 2, 3)
        )
        assert msgspec.json.decode(msgspec.json.encode(response)) == {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }

    def test_a_chat_completion_is_a_chat_completion_object(self) -> None:
        response = ChatCompletionResponse(
            id="c", created=1, model="m", choices=[], usage=Usage(1, 2, 3)
        )
        assert msgspec.json.decode(msgspec.json.encode(response))["object"] == "chat.completion"
