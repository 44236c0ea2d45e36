"""The Engine protocol's types and errors."""

from __future__ import annotations

from actors import Pipeline
from actors.http import (
    Chunk,
    Completion,
    Engine,
    EngineError,
    EngineUnavailableError,
    PipelineEngine,
)
from runtime import TokenyardError


def test_the_pipeline_engine_is_an_engine() -> None:
    # mypy checks the assignment against the protocol; the pipeline is never opened.
    engine: Engine = PipelineEngine(Pipeline(workers=1))
    ids = engine.encode("Hello")
    assert ids
    assert engine.decode(ids) == "Hello"


def test_engine_errors_are_tokenyard_errors_and_unavailability_says_when_to_retry() -> None:
    assert issubclass(EngineUnavailableError, EngineError)
    assert issubclass(EngineError, TokenyardError)
    assert EngineUnavailableError("busy").retry_after == 1
    assert EngineUnavailableError("closing", retry_after=5).retry_after == 5


def test_a_chunk_carries_counts_only_when_it_is_the_last() -> None:
    assert Chunk(text="a") == Chunk(text="a", finish_reason=None, prompt_tokens=0)
    done = Completion(
        text="a", output_ids=[1], prompt_tokens=2, completion_tokens=1, finish_reason="stop"
    )
    assert done.finish_reason == "stop"
