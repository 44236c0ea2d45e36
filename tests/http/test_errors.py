"""HTTPError bodies, and msgspec's refusals turned into errors that name the field."""

from __future__ import annotations

import msgspec
import pytest

from actors.http import EngineError, EngineUnavailableError
from actors.http._errors import HTTPError, engine_failure, from_validation_error
from actors.http._openai import ChatCompletionRequest, CompletionRequest, ErrorResponse


def refusal(kind: type[msgspec.Struct], body: bytes) -> HTTPError:
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.json.decode(body, type=kind)
    return from_validation_error(caught.value)


class TestBody:
    def test_the_body_is_openais_error_object(self) -> None:
        err = HTTPError(404, "no such model", param="model", code="model_not_found")
        body = msgspec.json.decode(err.body(), type=ErrorResponse)
        assert body.error.message == "no such model"
        assert (body.error.type, body.error.param, body.error.code) == (
            "invalid_request_error",
            "model",
            "model_not_found",
        )
        assert set(msgspec.json.decode(err.body())["error"]) == {"message", "type", "param", "code"}

    def test_a_5xx_is_a_server_error_unless_told(self) -> None:
        assert HTTPError(503, "busy").kind == "server_error"
        assert HTTPError(500, "x", kind="engine_error").kind == "engine_error"


class TestFromValidationError:
    def test_a_wrong_type_names_the_field_and_the_types(self) -> None:
        err = refusal(CompletionRequest, b'{"prompt": "x", "max_tokens": "16"}')
        assert err.status == 400
        assert err.param == "max_tokens"
        assert "Expected `int | null`, got `str`" in err.message

    def test_a_nested_field_is_named_by_its_path(self) -> None:
        err = refusal(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": 3}]}')
        assert err.param == "messages[0].content"

    def test_an_unknown_field_is_an_unsupported_parameter(self) -> None:
        err = refusal(CompletionRequest, b'{"prompt": "x", "min_p": 0.1}')
        assert (err.param, err.code) == ("min_p", "unsupported_parameter")
        assert "`min_p` is not supported" in err.message

    def test_an_unknown_nested_field_is_named_by_its_path(self) -> None:
        body = b'{"messages": [{"role": "assistant", "content": "", "tool_calls": []}]}'
        err = refusal(ChatCompletionRequest, body)
        assert err.param == "messages[0].tool_calls"

    def test_a_missing_field_is_a_missing_parameter(self) -> None:
        err = refusal(CompletionRequest, b'{"max_tokens": 3}')
        assert (err.param, err.code) == ("prompt", "missing_required_parameter")

    def test_a_body_of_the_wrong_shape_has_no_param(self) -> None:
        err = refusal(CompletionRequest, b"[1, 2]")
        assert err.param is None
        assert "Expected `object`, got `array`" in err.message


class TestEngineFailure:
    def test_an_unavailable_engine_is_a_503_with_its_retry_hint(self) -> None:
        err = engine_failure(EngineUnavailableError("no worker", retry_after=3))
        assert (err.status, err.kind, err.code) == (503, "server_error", "service_unavailable")
        assert err.headers == ((b"retry-after", b"3"),)
        assert "no worker" in err.message

    def test_any_other_engine_failure_is_a_500(self) -> None:
        err = engine_failure(EngineError("broken"))
        assert (err.status, err.code) == (500, "engine_error")
