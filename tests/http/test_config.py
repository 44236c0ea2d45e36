"""ServeConfig: documented defaults, refused settings, and the limits it resolves."""

from __future__ import annotations

from typing import Any

import pytest

from actors.http import ServeConfig


class TestDefaults:
    def test_the_defaults_are_the_documented_ones(self) -> None:
        config = ServeConfig()
        assert config.max_body_bytes == 4 << 20
        assert config.max_prompt_bytes == 1 << 20
        assert (config.max_tokens_limit, config.default_max_tokens) == (4096, 256)
        assert (config.model_id, config.context_length, config.max_prompt_tokens) == (
            None,
            None,
            None,
        )
        assert (config.api_key, config.cors_origins, config.max_request_id_length) == (
            None,
            (),
            128,
        )

    def test_the_engines_context_is_used_when_none_is_configured(self) -> None:
        limits = ServeConfig().limits(8192)
        assert (limits.context_length, limits.max_prompt_tokens) == (8192, 8191)

    def test_a_configured_context_narrows_the_engines(self) -> None:
        limits = ServeConfig(context_length=1024, max_prompt_tokens=1000).limits(8192)
        assert (limits.context_length, limits.max_prompt_tokens) == (1024, 1000)


class TestRefusals:
    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("max_body_bytes", 0),
            ("max_prompt_bytes", -1),
            ("max_tokens_limit", 0),
            ("default_max_tokens", 0),
            ("max_prompt_tokens", 0),
            ("max_messages", 0),
            ("max_stop", -1),
            ("context_length", 1),
            ("max_request_id_length", 0),
        ],
    )
    def test_a_limit_out_of_range_is_refused_by_name(self, field: str, value: int) -> None:
        settings: dict[str, Any] = {field: value}
        with pytest.raises(ValueError, match=rf"ServeConfig\.{field}={value}"):
            ServeConfig(**settings)

    def test_a_default_above_the_limit_is_refused(self) -> None:
        with pytest.raises(ValueError, match="default_max_tokens=300 is above max_tokens_limit"):
            ServeConfig(default_max_tokens=300, max_tokens_limit=200)

    def test_an_empty_model_id_is_refused(self) -> None:
        with pytest.raises(ValueError, match="model_id is empty"):
            ServeConfig(model_id="")

    def test_a_context_wider_than_the_engines_is_refused(self) -> None:
        with pytest.raises(ValueError, match="above the engine's context length"):
            ServeConfig(context_length=10_000).limits(8192)

    def test_a_prompt_limit_that_leaves_no_room_is_refused(self) -> None:
        with pytest.raises(ValueError, match="leaves no room to generate"):
            ServeConfig(max_prompt_tokens=8192).limits(8192)
