"""``Pipeline``: the LLM front end as one async context manager, embeddable in any loop.

The caller's side of the pipeline lives in the caller's process: an in-process inbox actor
receives every output and every ``WorkerUp`` / ``WorkerDown``, and resolves each request:
a request whose worker (or detokenizer, or scheduler) died before any output reached the
caller is resubmitted to a live worker; one that had output fails with ``WorkerDiedError``.

Each attempt of a request travels under its own rid (the request's id, then ``<id>-1``,
``<id>-2``, ... for resubmissions): output still on its way for an abandoned attempt is
told apart and dropped, and the abandoned attempt is let go at the worker still holding it
(``AbortRequest``) without touching the new one.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from runtime import Actor, ActorRef, ActorSystem, Down, TokenyardError, handler

from ._errors import PipelineClosedError, WorkerDiedError
from .messages import (
    AbortRequest,
    Generate,
    Origin,
    RequestOutput,
    RequestOutputs,
    SamplingParams,
    WorkerDown,
    WorkerUp,
)
from .pipeline_supervisor import PipelineConfig, PipelineSupervisor, worker_name

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator
    from types import TracebackType

logger = logging.getLogger("tokenyard.pipeline")

#: How many times one request may be resubmitted after losing its worker before output.
MAX_RESUBMITS = 3


class GenerateResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one ``generate``.

    Attributes:
        rid: The request id.
        text: The generated text (stop strings trimmed unless asked not to).
        output_ids: The generated token ids.
        prompt_tokens: Prompt length in tokens.
        completion_tokens: Generated tokens.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"``.
        worker: The worker that served it.
        resubmitted: How many times it was moved to another worker before any output.
    """

    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    worker: int
    resubmitted: int = 0


@dataclass(eq=False)
class _Request:
    rid: str
    #: The current attempt; its rid is the attempt's own.
    request: Generate
    stream: bool
    #: The worker incarnation holding the current attempt; None until it took it.
    origin: Origin | None = None
    got_output: bool = False
    resubmits: int = 0
    pieces: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    last: RequestOutput | None = None
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    changed: anyio.Event = field(default_factory=anyio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


class _CallerState:
    """Requests in flight and live workers, shared by the Pipeline and its inbox actor (both
    run in the caller's event loop, so no lock is needed)."""

    def __init__(self) -> None:
        #: By the rid of their current attempt.
        self.requests: dict[str, _Request] = {}
        self.workers: dict[int, ActorRef[Any]] = {}
        self.workers_changed = anyio.Event()
        self._rr = itertools.count()
        self.inbox: ActorRef[Any] | None = None
        self.closed = False
        self.resubmitted = 0
        self.failed = 0

    def workers_notify(self) -> None:
        self.workers_changed.set()
        self.workers_changed = anyio.Event()

    async def submit(self, req: _Request, wait: float = 30.0) -> None:
        """Send a request to a live worker (round robin), waiting for one if none is up."""
        assert self.inbox is not None
        with anyio.fail_after(wait):
            while True:
                if self.closed:
                    raise PipelineClosedError("the pipeline is closed")
                live = sorted(self.workers)
                if not live:
                    await self.workers_changed.wait()
                    continue
                k = live[next(self._rr) % len(live)]
                ref = self.workers[k]
                try:
                    await ref.tell(req.request)
                    req.origin = Origin(k, ref.incarnation)
                    return
                except TokenyardError:
                    # Dead but not yet reported down: forget it and try another.
                    if self.workers.get(k) == ref:
                        del self.workers[k]

    def resolve(self, req: _Request, member: str, reason: str) -> bool:
        """Decide a request's fate after ``member`` died; True when it must be resubmitted
        (under a new attempt rid, already in ``requests``)."""
        self.requests.pop(req.request.rid, None)
        req.origin = None
        if not req.got_output and req.resubmits < MAX_RESUBMITS:
            req.resubmits += 1
            self.resubmitted += 1
            attempt = f"{req.rid}-{req.resubmits}"
            req.request = msgspec.structs.replace(req.request, rid=attempt)
            self.requests[attempt] = req
            return True
        self.failed += 1
        req.error = WorkerDiedError(req.rid, member, reason)
        req.done.set()
        req.notify()
        return False


class PipelineInbox(Actor):
    """The caller's inbox (in the caller's process): outputs, worker ups and downs."""

    def __init__(self, state: _CallerState) -> None:
        self.state = state

    @handler
    def outputs(self, msg: RequestOutputs) -> None:
        """Hand each output to the request waiting for it."""
        requests = self.state.requests
        for out in msg.outputs:
            req = requests.get(out.rid)
            if req is None:
                continue  # cancelled, or already failed over
            if out.error is not None and not req.got_output and out.finish_reason == "abort":
                req.error = TokenyardError(f"request {out.rid!r} failed: {out.error}")
            req.got_output = True
            req.pieces.append(out.text)
            req.ids.extend(out.output_ids)
            req.last = out
            if out.finish_reason is not None:
                req.done.set()
                del requests[out.rid]
            req.notify()

    @handler
    def worker_up(self, msg: WorkerUp) -> None:
        """A worker serves: new requests may go to it."""
        self.state.workers[msg.worker_id] = msg.ref
        self.state.workers_notify()

    @handler
    async def worker_down(self, msg: WorkerDown) -> None:
        """A member died: resubmit or fail every request that depended on it.

        A worker's death concerns the requests it held. The detokenizer's or the
        scheduler's concerns every request a worker holds (told once the successor is up):
        those workers live on, so each is first told to let its attempt go, which frees its
        table and stops what a live scheduler may still generate for it.
        """
        state = self.state
        origin = msg.origin
        if origin is not None:
            current = state.workers.get(origin.worker)
            if current is not None and current.incarnation == origin.incarnation:
                del state.workers[origin.worker]
        hit = [
            req
            for req in state.requests.values()
            if req.origin is not None and (origin is None or req.origin == origin)
        ]
        if origin is None:
            await self._release(hit)
        reason = msg.reason
        if origin is not None:
            reason = f"{worker_name(origin.worker)} (incarnation {origin.incarnation}) {reason}"
        for req in hit:
            if state.requests.get(req.request.rid) is not req:
                continue  # finished or abandoned meanwhile
            if state.resolve(req, msg.member, reason):
                self.start_soon(self._resubmit, req)

    async def _release(self, reqs: list[_Request]) -> None:
        """Tell each request's worker to let its current attempt go."""
        workers = self.state.workers
        for req in reqs:
            origin = req.origin
            ref = workers.get(origin.worker) if origin is not None else None
            if origin is not None and ref is not None and ref.incarnation == origin.incarnation:
                with contextlib.suppress(TokenyardError):  # dead too: its own Down follows
                    await ref.tell(AbortRequest(rid=req.request.rid))

    @handler
    def supervisor_down(self, msg: Down) -> None:
        """The pipeline supervisor failed (restart intensity exceeded): nothing will be
        served any more, so every waiting request fails now rather than hang."""
        state = self.state
        state.closed = True
        for req in list(state.requests.values()):
            req.error = WorkerDiedError(req.rid, "pipeline-supervisor", msg.reason)
            req.done.set()
            req.notify()
        state.requests.clear()
        state.workers.clear()
        state.workers_notify()

    async def _resubmit(self, req: _Request) -> None:
        try:
            await self.state.submit(req)
        except (TokenyardError, TimeoutError) as err:
            req.error = WorkerDiedError(req.rid, "worker", f"no worker to resubmit to: {err}")
            req.done.set()
            req.notify()
            self.state.requests.pop(req.request.rid, None)


class Pipeline:
    """The LLM front end: N tokenizer workers, a stand-in scheduler, a detokenizer, a router
    and their supervisor, started in their own processes.

    Args:
        workers: Number of tokenizer workers.
        tokenizer: Path of a ``tokenizer.json`` (None: the bundled byte-level BPE).
        step_time: Seconds per step of the stand-in engine.
        max_batch_size: Most requests the engine runs at once.
        ready_timeout: Seconds to wait for every worker to register.
        **config: Other ``PipelineConfig`` fields.

    Example:
        >>> async with Pipeline(workers=4) as p:
        ...     result = await p.generate("Hello", max_new_tokens=16)
        ...     async for piece in p.stream("Bonjour", max_new_tokens=16):
        ...         print(piece, end="")
    """

    def __init__(
        self,
        workers: int = 4,
        tokenizer: str | os.PathLike[str] | None = None,
        *,
        step_time: float = 0.0,
        max_batch_size: int = 256,
        ready_timeout: float = 60.0,
        **config: Any,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}: a pipeline needs at least one worker")
        self.config = PipelineConfig(
            workers=workers,
            tokenizer=None if tokenizer is None else os.fspath(tokenizer),
            step_time=step_time,
            max_batch_size=max_batch_size,
            **config,
        )
        self.ready_timeout = ready_timeout
        self.system = ActorSystem(name="pipeline")
        self._state = _CallerState()
        self._supervisor: ActorRef[Any] | None = None

    async def __aenter__(self) -> Pipeline:
        await self.system.__aenter__()
        try:
            inbox = await self.system.spawn(
                PipelineInbox, self._state, name="pipeline-inbox", process=False
            )
            self._state.inbox = inbox
            self._supervisor = await self.system.spawn(
                PipelineSupervisor,
                self.config,
                inbox,
                name="pipeline-supervisor",
                process=False,
                spawn_timeout=self.ready_timeout,
            )
            self.system.watch(self._supervisor, notify=inbox)
            with anyio.fail_after(self.ready_timeout):
                while len(self._state.workers) < self.config.workers:
                    await self._state.workers_changed.wait()
        except BaseException as err:
            await self.system.__aexit__(type(err), err, err.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        state = self._state
        state.closed = True
        for req in state.requests.values():
            req.error = PipelineClosedError("the pipeline closed before the request finished")
            req.done.set()
            req.notify()
        state.requests.clear()
        await self.system.__aexit__(exc_type, exc, tb)

    # -- requests -------------------------------------------------------------------------

    def _new(self, text: str | list[int], stream: bool, sampling: SamplingParams) -> _Request:
        state = self._state
        if state.closed or state.inbox is None:
            raise PipelineClosedError("the pipeline is not open: use `async with Pipeline()`")
        rid = uuid.uuid4().hex
        if isinstance(text, str):
            msg = Generate(
                rid=rid, reply_to=state.inbox, text=text, sampling=sampling, stream=stream
            )
        else:
            msg = Generate(
                rid=rid,
                reply_to=state.inbox,
                input_ids=list(text),
                sampling=sampling,
                stream=stream,
            )
        req = _Request(rid, msg, stream)
        state.requests[rid] = req
        return req

    async def generate(
        self,
        text: str | list[int],
        *,
        max_new_tokens: int = 64,
        stop: tuple[str, ...] | list[str] = (),
        **sampling: Any,
    ) -> GenerateResult:
        """Generate a completion of ``text`` (or of a list of token ids).

        Raises:
            WorkerDiedError: Its worker died after output had reached this caller.
            PipelineClosedError: The pipeline closed meanwhile.
            TokenyardError: The request was refused (e.g. an empty prompt).
        """
        params = SamplingParams(max_new_tokens=max_new_tokens, stop=tuple(stop), **sampling)
        req = self._new(text, False, params)
        try:
            await self._state.submit(req)
            await req.done.wait()
        except BaseException:
            await self._abandon(req)
            raise
        if req.error is not None:
            raise req.error
        last = req.last
        assert last is not None
        assert last.finish_reason is not None
        return GenerateResult(
            rid=req.rid,
            text="".join(req.pieces),
            output_ids=req.ids,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            finish_reason=last.finish_reason,
            worker=last.worker,
            resubmitted=req.resubmits,
        )

    async def stream(
        self,
        text: str | list[int],
        *,
        max_new_tokens: int = 64,
        stop: tuple[str, ...] | list[str] = (),
        **sampling: Any,
    ) -> AsyncGenerator[str, None]:
        """Yield the text of a completion piece by piece as it is decoded.

        Raises:
            WorkerDiedError: Its worker died after pieces had been yielded.
        """
        params = SamplingParams(max_new_tokens=max_new_tokens, stop=tuple(stop), **sampling)
        req = self._new(text, True, params)
        sent = 0
        try:
            await self._state.submit(req)
            while True:
                while sent < len(req.pieces):
                    piece = req.pieces[sent]
                    sent += 1
                    if piece:
                        yield piece
                if req.error is not None:
                    raise req.error
                if req.done.is_set():
                    return
                await req.changed.wait()
        finally:
            if not req.done.is_set():
                await self._abandon(req)

    async def stream_outputs(
        self, text: str | list[int], sampling: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """Like `stream`, but yield the outputs themselves, for callers that need the finish
        reason and the token counts (the HTTP layer).

        Each output's ``text`` and ``output_ids`` hold everything decoded since the previous
        one yielded (a slow reader gets fewer, longer outputs); its other fields are the
        latest. The last output carries the finish reason.

        Raises:
            WorkerDiedError: Its worker died after outputs had been yielded.
        """
        req = self._new(text, True, sampling)
        pieces = ids = 0
        try:
            await self._state.submit(req)
            while True:
                if pieces < len(req.pieces) and req.last is not None:
                    out = msgspec.structs.replace(
                        req.last, text="".join(req.pieces[pieces:]), output_ids=req.ids[ids:]
                    )
                    pieces, ids = len(req.pieces), len(req.ids)
                    yield out
                    continue
                if req.error is not None:
                    raise req.error
                if req.done.is_set():
                    return
                await req.changed.wait()
        finally:
            if not req.done.is_set():
                await self._abandon(req)

    async def _abandon(self, req: _Request) -> None:
        """The caller gave up (cancelled, or stopped iterating): abort it at its worker."""
        state = self._state
        state.requests.pop(req.request.rid, None)
        origin = req.origin
        ref = state.workers.get(origin.worker) if origin is not None else None
        if origin is not None and ref is not None and ref.incarnation == origin.incarnation:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(TokenyardError):
                    await ref.tell(AbortRequest(rid=req.request.rid))

    # -- operations -----------------------------------------------------------------------

    def worker_ref(self, k: int) -> ActorRef[Any] | None:
        """The live incarnation of worker ``k`` (None while it restarts)."""
        return self._state.workers.get(k)

    async def wait_worker(self, k: int, after: int = 0, timeout: float = 60.0) -> ActorRef[Any]:
        """Wait until worker ``k`` serves with an incarnation newer than ``after``."""
        state = self._state
        with anyio.fail_after(timeout):
            while True:
                ref = state.workers.get(k)
                if ref is not None and ref.incarnation > after:
                    return ref
                await state.workers_changed.wait()

    def kill_worker(self, k: int, signum: int = signal.SIGKILL) -> ActorRef[Any]:
        """Kill worker ``k``'s process (for tests and benchmarks); returns the killed ref.

        Raises:
            LookupError: Worker ``k`` is not running now.
        """
        ref = self._state.workers.get(k)
        pid = None if ref is None else self.system.pid_of(ref)
        if ref is None or pid is None:
            raise LookupError(f"worker {k} is not running now")
        os.kill(pid, signum)
        return ref

    @property
    def supervisor(self) -> ActorRef[Any]:
        """The pipeline supervisor's ref."""
        if self._supervisor is None:
            raise PipelineClosedError("the pipeline is not open")
        return self._supervisor

    @property
    def resubmitted(self) -> int:
        """Requests moved to another worker after losing theirs before any output."""
        return self._state.resubmitted

    @property
    def failed(self) -> int:
        """Requests failed with ``WorkerDiedError``."""
        return self._state.failed
