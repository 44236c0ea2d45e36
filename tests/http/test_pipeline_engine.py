"""PipelineEngine over a real Pipeline: whole and streamed generations agree, an early close
abandons the request at its worker, failures become the protocol's errors.

Also `Pipeline.stream_outputs`, which the engine's stream is built on.
"""

from __future__ import annotations

import json
import shutil
from contextlib import aclosing
from typing import TYPE_CHECKING

import anyio
import pytest

from actors import Pipeline
from actors._tokenizer import DEFAULT_TOKENIZER_PATH
from actors.http import Chunk, EngineUnavailableError, PipelineEngine
from actors.http._pipeline_engine import BUNDLED_MODEL_ID, model_id_of
from actors.messages import GetWorkerStatistics, SamplingParams, WorkerStatistics

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

PROMPT = "Bonjour à tous 😀"
#: Seconds per engine step: a stream of 24 tokens arrives in several chunks.
STEP_TIME = 0.005


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[PipelineEngine]:
    """One engine over a one-worker pipeline for the module's tests."""
    async with PipelineEngine.open(workers=1, step_time=STEP_TIME) as e:
        await e.generate(e.encode("warm up"), SamplingParams(max_new_tokens=2))
        yield e


async def worker_stats(engine: PipelineEngine) -> WorkerStatistics:
    ref = engine.pipeline.worker_ref(0)
    assert ref is not None
    stats = await ref.ask(GetWorkerStatistics(), timeout=10)
    assert isinstance(stats, WorkerStatistics)
    return stats


class TestGenerations:
    async def test_a_stream_joins_to_the_whole_completion_with_its_counts_last(
        self, engine: PipelineEngine
    ) -> None:
        ids = engine.encode(PROMPT)
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        whole = await engine.generate(ids, params)
        async with aclosing(engine.stream(ids, params)) as stream:
            chunks = [chunk async for chunk in stream]
        assert "".join(c.text for c in chunks) == whole.text
        assert len(chunks) > 1
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1] == Chunk(
            text=chunks[-1].text,
            finish_reason="length",
            prompt_tokens=len(ids),
            completion_tokens=24,
        )
        assert (whole.finish_reason, whole.prompt_tokens, whole.completion_tokens) == (
            "length",
            len(ids),
            24,
        )
        assert engine.decode(whole.output_ids) == whole.text

    async def test_text_prompts_and_their_ids_generate_the_same(
        self, engine: PipelineEngine
    ) -> None:
        params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=11)
        by_text = await engine.generate(PROMPT, params)
        by_ids = await engine.generate(engine.encode(PROMPT), params)
        assert by_text == by_ids

    async def test_closing_a_stream_early_lets_the_request_go_at_its_worker(
        self, engine: PipelineEngine
    ) -> None:
        before = await worker_stats(engine)
        params = SamplingParams(max_new_tokens=2000, ignore_eos=True)
        async with aclosing(engine.stream(engine.encode(PROMPT), params)) as stream:
            async for _ in stream:
                break
        after = await worker_stats(engine)
        assert after.released == before.released + 1
        assert after.requests == 0

    async def test_cancelling_a_generation_lets_the_request_go_at_its_worker(
        self, engine: PipelineEngine
    ) -> None:
        before = await worker_stats(engine)
        params = SamplingParams(max_new_tokens=2000, ignore_eos=True)
        with anyio.move_on_after(0.05):
            await engine.generate(engine.encode(PROMPT), params)
        after = await worker_stats(engine)
        assert after.released == before.released + 1
        assert after.requests == 0


class TestStreamOutputs:
    async def test_outputs_left_unread_coalesce_and_join_to_the_whole_generation(
        self, engine: PipelineEngine
    ) -> None:
        pipeline = engine.pipeline
        params = SamplingParams(max_new_tokens=48, ignore_eos=True)
        async with aclosing(pipeline.stream_outputs(PROMPT, params)) as stream:
            first = await anext(stream)
            # The same request, sent after the stream's: once it is answered, the stream's
            # request has finished too, and everything it decoded since `first` is waiting.
            whole = await pipeline.generate(PROMPT, max_new_tokens=48, ignore_eos=True)
            rest = [out async for out in stream]
        assert len(rest) == 1
        outputs = [first, *rest]
        assert "".join(o.text for o in outputs) == whole.text
        assert [i for o in outputs for i in o.output_ids] == whole.output_ids
        assert first.finish_reason is None
        assert (rest[0].finish_reason, rest[0].completion_tokens) == ("length", 48)


class TestFailures:
    async def test_a_closed_pipeline_is_unavailable_for_generations_and_streams(self) -> None:
        async with PipelineEngine.open(workers=1) as engine:
            pass
        ids = engine.encode(PROMPT)
        with pytest.raises(EngineUnavailableError, match="closed") as caught:
            await engine.generate(ids, SamplingParams())
        assert caught.value.retry_after == 5
        async with aclosing(engine.stream(ids, SamplingParams())) as stream:
            with pytest.raises(EngineUnavailableError, match="closed"):
                await anext(stream)


class TestTokenizerAndNames:
    def test_the_bundled_tokenizer_has_the_bundled_id(self) -> None:
        engine = PipelineEngine(Pipeline(workers=1))
        assert engine.model == BUNDLED_MODEL_ID
        assert model_id_of(DEFAULT_TOKENIZER_PATH) == BUNDLED_MODEL_ID
        assert engine.vocab_size == 4096
        assert engine.context_length == 8192

    def test_a_model_directory_names_the_model_and_brings_its_template(
        self, tmp_path: Path
    ) -> None:
        model = tmp_path / "Tiny-Chat-1B"
        model.mkdir()
        shutil.copy(DEFAULT_TOKENIZER_PATH, model / "tokenizer.json")
        template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
        (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        engine = PipelineEngine(Pipeline(workers=1, tokenizer=model / "tokenizer.json"))
        assert engine.model == "Tiny-Chat-1B" == model_id_of(model)
        assert engine.chat_template.render([{"role": "user", "content": "hi"}]) == "[user] hi"
        named = PipelineEngine(Pipeline(workers=1, tokenizer=model), model="mine")
        assert named.model == "mine"

    def test_a_context_too_small_to_generate_in_is_refused(self) -> None:
        with pytest.raises(ValueError, match="context_length=1"):
            PipelineEngine(Pipeline(workers=1), context_length=1)
