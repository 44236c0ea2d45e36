"""`RequestLimits`: the one checker of what a request may ask for, at either door."""

from __future__ import annotations

import math

import pytest

from actors import PipelineConfig
from actors._limits import RequestLimits, context_refusal, sampling_refusal
from actors.http import ServeConfig
from actors.messages import SamplingParams


class TestRefusals:
    def test_each_refusal_names_the_setting_of_the_config_that_set_it(self) -> None:
        pipeline = PipelineConfig(max_prompt_bytes=8, max_prompt_tokens=3, max_new_tokens=5)
        assert pipeline.limits.refusal("x" * 9, None, 1) == (
            "the prompt is 9 bytes, longer than 8 bytes (PipelineConfig.max_prompt_bytes)"
        )
        assert "(3, PipelineConfig.max_prompt_tokens)" in str(
            pipeline.limits.refusal(None, [1, 2, 3, 4], 1)
        )
        assert pipeline.limits.refusal("x", [1], 6) == (
            "max_new_tokens must be within [0, 5] (PipelineConfig.max_new_tokens), got 6"
        )
        served = ServeConfig(max_prompt_bytes=8, max_tokens_limit=5, default_max_tokens=5)
        limits = served.limits(64)
        assert "(ServeConfig.max_prompt_bytes)" in str(limits.text_refusal("x" * 9, "prompt"))
        assert "(63, ServeConfig.max_prompt_tokens; the context holds 64)" in str(
            limits.tokens_refusal(64)
        )
        assert limits.new_tokens_refusal(0, "max_tokens", least=1) == (
            "max_tokens must be within [1, 5] (ServeConfig.max_tokens_limit), got 0"
        )

    @pytest.mark.parametrize("count", [0, 32_768])
    def test_within_every_limit_there_is_no_refusal(self, count: int) -> None:
        limits = RequestLimits()
        assert limits.refusal("a prompt", [1] * 32_768, count) is None
        assert limits.refusal("x" * (1 << 20), None, count) is None  # at the byte limit

    def test_a_text_is_measured_in_utf8_bytes_lone_surrogates_included(self) -> None:
        limits = RequestLimits(max_prompt_bytes=8)
        assert limits.text_refusal("日本") is None  # 6 bytes
        assert "is 9 bytes" in str(limits.text_refusal("日本語"))
        # A lone surrogate (JSON's "\ud800") is measured, not an encoding error.
        assert "is 9 bytes" in str(limits.text_refusal("\ud800\ud800\ud800"))

    def test_a_negative_max_new_tokens_is_refused(self) -> None:
        assert "within [0, " in str(RequestLimits().refusal(None, None, -1))


class TestWhatNoEngineRuns:
    @pytest.mark.parametrize(
        ("temperature", "max_new_tokens", "refused"),
        [
            (0.0, 0, False),
            (-0.0, 1, False),
            (2.5, 64, False),
            (-0.001, 1, True),
            (float("nan"), 1, True),
            (float("inf"), 1, True),
            (0.0, -1, True),
        ],
    )
    def test_sampling_an_engine_takes_passes_and_the_rest_is_refused(
        self, temperature: float, max_new_tokens: int, refused: bool
    ) -> None:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        assert (sampling_refusal(sampling) is not None) == refused

    def test_a_prompt_must_leave_one_id_of_room_in_a_known_context(self) -> None:
        assert context_refusal(63, 64) is None
        assert context_refusal(64, 64) == (
            "the prompt is 64 tokens: the engine's context holds 64 (prompt and completion), "
            "no room is left to generate"
        )
        assert context_refusal(10**6, None) is None  # not known: the engine bounds it
        assert context_refusal(10**6, 0) is None


class TestTheRestartIntensity:
    @pytest.mark.parametrize(
        ("settings", "message"),
        [
            ({"max_restarts": -1}, "max_restarts=-1 is below 0"),
            ({"period": 0.0}, "period=0.0 must be finite and above 0"),
            ({"period": math.nan}, "period=nan must be finite and above 0"),
            ({"period": math.inf}, "period=inf must be finite and above 0"),
        ],
    )
    def test_a_setting_it_cannot_count_by_is_refused(
        self, settings: dict[str, float], message: str
    ) -> None:
        with pytest.raises(ValueError, match=message):
            PipelineConfig(**settings)  # type: ignore[arg-type]
