"""``WorkerEngine``: the `Engine` protocol over the tokenizer worker living in this process.

In a serving worker process the HTTP app and the worker actor share one event loop: a
request is tokenized by the app, handed to the worker by a method call
(`TokenizerWorker.submit_local`), and its outputs come back through a callback, so nothing
crosses to another process but the request to the engine and the engine's output itself.

A request that a pipeline member's death cost its output before any reached the client is
resubmitted here, under a new rid, by the pipeline's one rule (`actors._errors.resubmittable`:
at most `MAX_RESUBMITS` times); one that had output fails (the stream ends with an error
event, or the request with a 503).
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from typing import TYPE_CHECKING

from actors import _metrics
from actors._errors import MAX_RESUBMITS, resubmittable
from actors.messages import RequestOutput

from ._engine import (
    Chunk,
    Completion,
    EngineError,
    EngineRefusedError,
    EngineUnavailableError,
    TokenizerFacts,
)

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable

    from actors.messages import SamplingParams
    from actors.tokenizer_worker import TokenizerWorker

    from ._chat import ChatTemplate

__all__ = ("WorkerEngine",)


class _Outputs:
    """The outputs of one attempt, as the worker hands them over (in this loop), held
    until the request's reader takes them, up to ``limit`` bytes: past it the request is
    let go at once, whether or not its reader ever comes back."""

    __slots__ = ("_release", "arrived", "items", "limit", "overflow", "rid", "unread")

    def __init__(self, rid: str, limit: int, release: Callable[[str], None]) -> None:
        self.rid = rid
        self.limit = limit
        self._release = release
        self.items: collections.deque[RequestOutput] = collections.deque()
        self.arrived = asyncio.Event()
        self.unread = 0
        self.overflow = False

    def put(self, out: RequestOutput) -> None:
        if self.overflow:
            return
        self.items.append(out)
        self.unread += len(out.text) + len(out.output_ids)
        if self.unread > self.limit and out.finish_reason is None:
            self.overflow = True
            self.items.clear()
            self._release(self.rid)
        self.arrived.set()

    async def next(self) -> RequestOutput:
        """The next output; several that arrived meanwhile come as one (their text joined,
        the latest counts), so a reader that fell behind sends fewer, longer chunks."""
        while not self.items:
            if self.overflow:
                raise EngineUnavailableError(
                    f"request {self.rid!r}: its client fell more than {self.limit} characters "
                    "and ids behind; it was let go"
                )
            self.arrived.clear()
            await self.arrived.wait()
        out = self.items.popleft()
        while self.items and out.error is None and out.finish_reason is None:
            later = self.items.popleft()
            if later.error is not None:
                self.items.appendleft(later)  # a failure is told on its own
                break
            out = RequestOutput(
                rid=later.rid,
                worker=later.worker,
                text=out.text + later.text,
                output_ids=out.output_ids + later.output_ids,
                prompt_tokens=later.prompt_tokens,
                completion_tokens=later.completion_tokens,
                finish_reason=later.finish_reason,
            )
        self.unread = sum(len(o.text) + len(o.output_ids) for o in self.items)
        return out


class WorkerEngine(TokenizerFacts):
    """An `Engine` over the `TokenizerWorker` in this process (its tokenizer loaded).

    Args:
        worker: The worker actor; its ``on_start`` has loaded its tokenizer.
        model: The model id.
        context_length: Most prompt plus completion tokens of one request.
        chat_template: How chat messages become prompts.
        max_stream_buffer: Most bytes of a stream's output held for a client that does not
            read; past it the request is let go (its stream ends with an error).
    """

    def __init__(
        self,
        worker: TokenizerWorker,
        *,
        model: str,
        context_length: int,
        chat_template: ChatTemplate,
        max_stream_buffer: int = 4 << 20,
    ) -> None:
        super().__init__(
            worker.tokenizer,
            model=model,
            context_length=context_length,
            chat_template=chat_template,
        )
        self._worker = worker
        self._max_stream_buffer = max_stream_buffer
        #: The outputs of every attempt in flight, by rid.
        self._live: dict[str, _Outputs] = {}
        self.resubmitted = 0
        self._resubmissions = _metrics.RESUBMISSIONS.labels(worker._model)

    async def _start(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool,
        traceparent: str | None,
    ) -> tuple[str, _Outputs]:
        # The HTTP layer hands token ids it admitted; a text prompt (a caller of this
        # engine's own) is tokenized here as the HTTP layer would.
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        rid = uuid.uuid4().hex
        outputs = self._live[rid] = _Outputs(rid, self._max_stream_buffer, self._release)
        try:
            await self._worker.submit_local(
                rid,
                outputs.put,
                ids,
                sampling=params,
                stream=stream,
                traceparent=traceparent,
            )
        except BaseException:
            self._live.pop(rid, None)
            raise
        return rid, outputs

    def _release(self, rid: str) -> None:
        """Let an attempt go: the worker forgets it, the engine stops generating it."""
        self._live.pop(rid, None)
        self._worker.release_local(rid)

    @property
    def context_length(self) -> int:
        """Most prompt plus completion tokens of one request: the configured length, or the
        engine's (`actors.messages.Topology.engine_context_length`) once it is known and
        shorter."""
        engine = self._worker.engine_context_length
        configured = super().context_length
        return min(configured, engine) if engine >= 2 else configured

    def not_ready(self) -> str | None:
        """Why requests cannot be generated now, as the latest `Topology` says."""
        if self._worker.scheduler is None:
            return "the scheduler is restarting: requests wait for it"
        if not self._worker.engine_ready:
            return "the engine is not ready (starting, or not connected yet): requests wait for it"
        direct = self._worker.direct
        return None if direct is None else direct.unreachable

    @property
    def in_flight(self) -> int:
        """Requests being generated now."""
        return len(self._live)

    def cut(self, reason: str) -> int:
        """End every request in flight with ``reason`` as its error (a stream's last event,
        or a 503): the server stops before they could finish. Returns how many."""
        live, self._live = self._live, {}
        for rid, outputs in live.items():
            self._worker.release_local(rid)
            outputs.put(
                RequestOutput(
                    rid=rid,
                    worker=self._worker.worker_id,
                    text="",
                    output_ids=[],
                    prompt_tokens=0,
                    completion_tokens=0,
                    error=reason,
                )
            )
        return len(live)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> Completion:
        """Generate a whole completion (cancelling the call lets the request go)."""
        for attempt in range(MAX_RESUBMITS + 1):
            rid, outputs = await self._start(prompt, params, False, traceparent)
            try:
                out = await outputs.next()
            except BaseException:
                self._release(rid)
                raise
            self._live.pop(rid, None)
            if out.error is None:
                return Completion(
                    text=out.text,
                    output_ids=out.output_ids,
                    prompt_tokens=out.prompt_tokens,
                    completion_tokens=out.completion_tokens,
                    finish_reason=out.finish_reason or "stop",
                )
            if resubmittable(out.lost_to, False, attempt):
                self.resubmitted += 1
                self._resubmissions.inc()
                continue
            raise self._failure(out)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def stream(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> AsyncGenerator[Chunk, None]:
        """Stream a completion (closing the generator early lets the request go)."""
        attempt = 0
        while True:
            rid, outputs = await self._start(prompt, params, True, traceparent)
            sent = False
            finished = False
            try:
                while True:
                    out = await outputs.next()
                    if out.error is not None:
                        finished = True
                        if resubmittable(out.lost_to, sent, attempt):
                            break  # nothing reached the client: start it again
                        raise self._failure(out)
                    if out.finish_reason is None:
                        if out.text:
                            sent = True
                            yield Chunk(text=out.text)
                        continue
                    finished = True
                    yield Chunk(
                        text=out.text,
                        finish_reason=out.finish_reason,
                        prompt_tokens=out.prompt_tokens,
                        completion_tokens=out.completion_tokens,
                    )
                    return
            finally:
                if not finished and not outputs.overflow:
                    self._release(rid)
                self._live.pop(rid, None)
            attempt += 1
            self.resubmitted += 1
            self._resubmissions.inc()

    def _failure(self, out: RequestOutput) -> EngineError:
        """What a failed output means to the HTTP layer: 400 when the engine refused the
        request as it is, 503 when trying later may help."""
        reason = out.error or "aborted"
        if out.invalid is not None:
            return EngineRefusedError(f"request {out.rid!r}: {reason}", code=out.invalid)
        if out.lost_to is not None:
            _metrics.WORKER_DIED_ERRORS.labels(self._worker._model, out.lost_to.value).inc()
            return EngineUnavailableError(
                f"request {out.rid!r} lost its {out.lost_to.value}: {reason}"
            )
        return EngineUnavailableError(f"request {out.rid!r} failed: {reason}")
