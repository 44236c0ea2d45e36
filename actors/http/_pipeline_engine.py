"""``PipelineEngine``: the `Engine` protocol over an in-process `actors.Pipeline`."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import msgspec

from actors._errors import PipelineClosedError, WorkerDiedError
from actors._tokenizer import BUNDLED_MODEL_ID, load_tokenizer, model_id_of
from actors.pipeline import Pipeline
from runtime import TokenyardError

from ._chat import ChatTemplate
from ._engine import Chunk, Completion, EngineError, EngineUnavailableError, TokenizerFacts

if TYPE_CHECKING:
    import os
    from collections.abc import AsyncGenerator, AsyncIterator

    from actors.messages import SamplingParams

__all__ = ("BUNDLED_MODEL_ID", "DEFAULT_CONTEXT_LENGTH", "PipelineEngine", "model_id_of")

DEFAULT_CONTEXT_LENGTH = 8192
"""The context length a `PipelineEngine` reports unless told: the stand-in engine has no
limit of its own, so this is a real model's size, not the engine's."""


class PipelineEngine(TokenizerFacts):
    """An `Engine` over an open `actors.Pipeline` in this process.

    It tokenizes with its own copy of the pipeline's tokenizer (for ``/tokenize``, prompt
    limits and chat prompts) and sends the pipeline token ids, so a prompt is tokenized
    once. Pipeline failures become the protocol's errors: a worker death that the pipeline
    could not resubmit, a closed pipeline, no worker within the pipeline's wait, or a
    request the pipeline refused (its queues and caps are full) is
    `EngineUnavailableError`; a request the engine aborted is `EngineError`.

    Args:
        pipeline: An open pipeline.
        model: The model id. ``None``: derived from the tokenizer (`model_id_of`).
        context_length: The context length reported (`DEFAULT_CONTEXT_LENGTH`).

    Example:
        >>> async with Pipeline(workers=2) as pipeline:
        ...     app = OpenAIApp(PipelineEngine(pipeline))
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        model: str | None = None,
        context_length: int = DEFAULT_CONTEXT_LENGTH,
    ) -> None:
        path = pipeline.config.tokenizer
        super().__init__(
            load_tokenizer(path),
            model=model or model_id_of(path),
            context_length=context_length,
            chat_template=ChatTemplate.from_tokenizer(path),
        )
        self.pipeline = pipeline

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        workers: int = 4,
        tokenizer: str | os.PathLike[str] | None = None,
        *,
        model: str | None = None,
        context_length: int = DEFAULT_CONTEXT_LENGTH,
        **pipeline: Any,
    ) -> AsyncIterator[PipelineEngine]:
        """Open a `Pipeline` and yield the engine over it (an `OpenAIApp` lifespan).

        Args:
            workers: Tokenizer workers of the pipeline.
            tokenizer: Its ``tokenizer.json`` (None: the bundled one).
            model: The model id (None: derived from the tokenizer).
            context_length: The context length reported.
            **pipeline: Other `Pipeline` arguments (``step_time``, ...).
        """
        async with Pipeline(workers, tokenizer, **pipeline) as p:
            yield cls(p, model=model, context_length=context_length)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> Completion:
        """Generate a whole completion (cancelling the call abandons the request).

        ``traceparent`` is not used: a `Pipeline`'s requests carry no caller's trace.
        """
        try:
            result = await self.pipeline.generate(prompt, **msgspec.structs.asdict(params))
        except (TokenyardError, TimeoutError) as err:
            raise _unavailable(err) from err
        if result.finish_reason == "abort":
            raise EngineError(f"the engine aborted request {result.rid!r}")
        return Completion(
            text=result.text,
            output_ids=result.output_ids,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            finish_reason=result.finish_reason,
        )

    async def stream(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> AsyncGenerator[Chunk, None]:
        """Stream a completion (closing the generator early abandons the request; no use
        of ``traceparent``, as in `generate`)."""
        outputs = self.pipeline.stream_outputs(prompt, params)
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    reason = out.finish_reason
                    if reason is None:
                        if out.text:
                            yield Chunk(text=out.text)
                        continue
                    if reason == "abort":
                        raise EngineUnavailableError(
                            f"the pipeline refused request {out.rid!r}: {out.error}"
                            if out.error
                            else f"the engine aborted request {out.rid!r}"
                        )
                    yield Chunk(
                        text=out.text,
                        finish_reason=reason,
                        prompt_tokens=out.prompt_tokens,
                        completion_tokens=out.completion_tokens,
                    )
                    return
            except (TokenyardError, TimeoutError) as err:
                if isinstance(err, EngineError):
                    raise
                raise _unavailable(err) from err
        raise EngineError("the pipeline's stream ended without a finish reason")


def _unavailable(err: TokenyardError | TimeoutError) -> EngineUnavailableError:
    if isinstance(err, WorkerDiedError):
        return EngineUnavailableError(f"the request lost its worker: {err}")
    if isinstance(err, PipelineClosedError):
        return EngineUnavailableError(f"the pipeline is closed: {err}", retry_after=5)
    if isinstance(err, TimeoutError):
        return EngineUnavailableError(f"no pipeline worker took the request in time: {err}")
    # A valid request refused: the pipeline's bounds (queue, live states) are full.
    return EngineUnavailableError(f"the pipeline refused the request: {err}")
