"""``Pipeline``: the LLM front end as one async context manager, embeddable in any loop.

The caller's side of the pipeline lives in the caller's process: an in-process inbox actor
receives every output and every ``WorkerUp`` / ``WorkerDown``, and resolves each request:
a request whose worker (or detokenizer, or scheduler) died before any output reached the
caller is resubmitted to a live worker (what had arrived unread goes with the lost attempt);
a stream that had yielded output fails with ``WorkerDiedError``.

Each attempt of a request travels under its own rid (the request's id, then ``<id>-1``,
``<id>-2``, ... for resubmissions): output still on its way for an abandoned attempt is
told apart and dropped, and the abandoned attempt is let go at the worker still holding it
(``AbortRequest``) without touching the new one.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import signal
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import msgspec

from runtime import (
    Actor,
    ActorDeadError,
    ActorRef,
    ActorSystem,
    Down,
    GetMetrics,
    Message,
    MetricsCollector,
    TokenyardError,
    handler,
)

from . import _metrics
from ._errors import (
    InvalidRequestError,
    PipelineBusyError,
    PipelineClosedError,
    RequestFailedError,
    SlowReaderError,
    WorkerDiedError,
    resubmittable,
)
from .messages import (
    LARGEST_INT,
    AbortRequest,
    CallerMessage,
    Generate,
    Member,
    Origin,
    RequestOutput,
    RequestOutputs,
    SamplingParams,
    WorkerDown,
    WorkerMessage,
    WorkerUp,
)
from .pipeline_supervisor import PipelineConfig, PipelineSupervisor, WorkerChannels, worker_name

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Mapping, Sequence
    from types import TracebackType

logger = logging.getLogger("tokenyard.pipeline")


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


class _Signal:
    """Wakes every task waiting for "something changed" (a condition without a lock: the
    waiters and the notifiers share one event loop)."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass(eq=False)
class _Request:
    rid: str
    #: The current attempt; its rid is the attempt's own.
    request: Generate
    stream: bool
    #: The worker incarnation holding the current attempt; None until it took it.
    origin: Origin | None = None
    #: Output reached the caller (a stream yielded): the request can no longer be started
    #: again behind its back.
    delivered: bool = False
    resubmits: int = 0
    #: Text not yet read: every piece of a stream, the whole text of a generate.
    pieces: collections.deque[str] = field(default_factory=collections.deque)
    #: Ids not yet read (all of a generate's).
    ids: list[int] = field(default_factory=list)
    #: Bytes of text and ids held unread, bounded for a stream by max_stream_buffer.
    unread: int = 0
    last: RequestOutput | None = None
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    changed: _Signal = field(default_factory=_Signal)


def _stops(stop: str | Sequence[str]) -> tuple[str, ...]:
    """``stop`` as a tuple: one string is one stop, not one per character."""
    return (stop,) if isinstance(stop, str) else tuple(stop)


#: An integer as the wire carries it (a signed 64-bit one).
_WireInt = Annotated[int, msgspec.Meta(ge=-LARGEST_INT - 1, le=LARGEST_INT)]


def _typed(
    sampling: SamplingParams, text: str | list[int]
) -> tuple[SamplingParams, str | list[int]]:
    """``sampling`` and ``text`` checked to hold the types they name (a struct built in
    Python checks none): a wrong one would make the worker refuse the message unanswered.

    Raises:
        InvalidRequestError: A value of the wrong type, an integer the wire cannot carry, or
            text with a lone surrogate.
    """
    try:
        sampling = msgspec.convert(msgspec.structs.asdict(sampling), SamplingParams)
        if sampling.seed is not None:
            msgspec.convert(sampling.seed, _WireInt)
        if not isinstance(text, str):
            text = msgspec.convert(text, list[_WireInt])
        # A lone surrogate is no Unicode that UTF-8, and so msgpack, can carry (an ASCII
        # string, which CPython marks as one, has none: no prompt is encoded twice for it).
        for piece in (*sampling.stop, *((text,) if isinstance(text, str) else ())):
            if not piece.isascii():
                piece.encode()
    except msgspec.ValidationError as err:
        raise InvalidRequestError(f"a value of the wrong type or size: {err}") from None
    except UnicodeEncodeError as err:
        raise InvalidRequestError(f"text that is not valid Unicode: {err}") from None
    return sampling, text


class _CallerState:
    """Requests in flight and live workers, shared by the Pipeline and its inbox actor (both
    run in the caller's event loop, so no lock is needed)."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        #: By the rid of their current attempt.
        self.requests: dict[str, _Request] = {}
        self.workers: dict[int, ActorRef[WorkerMessage]] = {}
        self.workers_changed = _Signal()
        self._rr = itertools.count()
        self.inbox: ActorRef[CallerMessage] | None = None
        #: The pipeline's own system: what it sends goes through its sockets, whichever
        #: system is current where it is called (another Pipeline's, say).
        self.system: ActorSystem | None = None
        self.closed = False
        #: Set with the reason when the pipeline supervisor failed (`Pipeline.until_failed`).
        self.supervisor_failed = anyio.Event()
        self.failure = ""
        self.resubmitted = 0
        self.failed = 0
        self._resubmissions = _metrics.RESUBMISSIONS.labels(config.model_name)

    async def submit(self, req: _Request) -> None:
        """Send a request to a live worker (round robin), skipping a worker whose mailbox
        is full and waiting for one if none is up.

        Raises:
            PipelineBusyError: No worker took it within the config's ``submit_timeout``.
            PipelineClosedError: The pipeline closed meanwhile.
        """
        wait = self.config.submit_timeout
        try:
            with anyio.fail_after(wait):
                while True:
                    if self.closed:
                        raise PipelineClosedError("the pipeline is closed")
                    if self.requests.get(req.request.rid) is not req:
                        return  # let go meanwhile (its caller gave up): nobody waits for it
                    live = sorted(self.workers)
                    if not live:
                        await self.workers_changed.wait()
                        continue
                    start = next(self._rr)
                    for i in range(len(live)):
                        k = live[(start + i) % len(live)]
                        if self._offer(req, k, self.workers[k]):
                            return
                    # Every live worker is full: wait for room at one of them.
                    k = live[start % len(live)]
                    ref = self.workers.get(k)
                    if ref is not None:
                        with contextlib.suppress(TokenyardError):
                            await self._tell(ref, req.request, 1.0)
                            self._sent(req, Origin(k, ref.incarnation))
                            return
        except TimeoutError as err:
            raise PipelineBusyError(
                f"no worker took request {req.rid!r} within {wait:g} s: every worker's "
                "mailbox stayed full (the pipeline is overloaded)"
            ) from err

    def _offer(self, req: _Request, k: int, ref: ActorRef[WorkerMessage]) -> bool:
        try:
            if self._try_tell(ref, req.request):
                self._sent(req, Origin(k, ref.incarnation))
                return True
        except ActorDeadError:
            # Dead but not yet reported down: forget it (its WorkerUp brings it back).
            if self.workers.get(k) == ref:
                del self.workers[k]
        return False

    def fail(self, req: _Request, error: BaseException) -> None:
        """End ``req`` with ``error``."""
        self.requests.pop(req.request.rid, None)
        req.error = error
        req.done.set()
        req.changed.notify()

    def resolve(self, req: _Request, member: Member, reason: str) -> bool:
        """Decide a request's fate after it was lost to ``member``; True when it must be
        resubmitted (under a new attempt rid, already in ``requests``)."""
        self.requests.pop(req.request.rid, None)
        req.origin = None
        if resubmittable(member, req.delivered, req.resubmits):
            # What the lost attempt sent and nobody read goes with it: the next starts over.
            req.pieces.clear()
            req.ids, req.unread, req.last = [], 0, None
            req.resubmits += 1
            self.resubmitted += 1
            self._resubmissions.inc()
            attempt = f"{req.rid}-{req.resubmits}"
            req.request = msgspec.structs.replace(req.request, rid=attempt)
            self.requests[attempt] = req
            return True
        self.failed += 1
        _metrics.WORKER_DIED_ERRORS.labels(self.config.model_name, member.value).inc()
        self.fail(req, WorkerDiedError(req.rid, member, reason))
        return False

    def release(self, req: _Request) -> None:
        """Let the request's current attempt go at the worker holding it (if it lives)."""
        self.requests.pop(req.request.rid, None)
        origin, req.origin = req.origin, None
        ref = self.workers.get(origin.worker) if origin is not None else None
        if origin is not None and ref is not None and ref.incarnation == origin.incarnation:
            with contextlib.suppress(TokenyardError):  # dead or full: its own end frees it
                self._try_tell(ref, AbortRequest(rid=req.request.rid))

    def _sent(self, req: _Request, origin: Origin) -> None:
        """``req`` went to the worker at ``origin``; if its caller let it go while it was
        sent (a wait for room), the worker is told to let it go too."""
        req.origin = origin
        if self.requests.get(req.request.rid) is not req:
            self.release(req)

    def _try_tell(self, ref: ActorRef[Any], msg: Message) -> bool:
        assert self.system is not None
        return self.system.station.try_tell(ref, msg) is None

    async def _tell(self, ref: ActorRef[Any], msg: Message, timeout: float) -> None:
        assert self.system is not None
        station = self.system.station
        frames = station.try_tell(ref, msg)
        if frames is not None:
            await station.tell_when_room(ref, frames, timeout)

    def close(self, error: BaseException) -> None:
        """Nothing will be served any more: every waiting request fails now."""
        self.closed = True
        for req in list(self.requests.values()):
            self.fail(req, error)
        self.requests.clear()
        self.workers.clear()
        self.workers_changed.notify()


class PipelineInbox(Actor[CallerMessage]):
    """The caller's inbox (in the caller's process): outputs, worker ups and downs."""

    def __init__(self, state: _CallerState) -> None:
        self.state = state

    @handler
    def outputs(self, msg: RequestOutputs) -> None:
        """Hand each output to the request waiting for it."""
        state = self.state
        requests = state.requests
        limit = state.config.max_stream_buffer
        for out in msg.outputs:
            req = requests.get(out.rid)
            if req is None:
                continue  # cancelled, or already failed over
            if out.error is not None and out.finish_reason == "abort":
                self._failed(req, out)
                continue
            if out.text:
                req.pieces.append(out.text)
            req.ids.extend(out.output_ids)
            req.unread += len(out.text) + len(out.output_ids)
            req.last = out
            if out.finish_reason is not None:
                req.done.set()
                del requests[out.rid]
            elif req.stream and req.unread > limit:
                state.release(req)
                state.fail(
                    req,
                    SlowReaderError(
                        f"request {req.rid!r}: its reader fell {req.unread} characters and "
                        f"ids behind, past max_stream_buffer={limit}; the request was aborted"
                    ),
                )
            req.changed.notify()

    def _failed(self, req: _Request, out: RequestOutput) -> None:
        state = self.state
        reason = out.error or "aborted"
        if out.lost_to is None:
            state.fail(req, RequestFailedError(req.rid, reason))
        elif state.resolve(req, out.lost_to, reason):
            self.start_soon(self._resubmit, req)

    @handler
    def worker_up(self, msg: WorkerUp) -> None:
        """A worker serves: new requests may go to it."""
        self.state.workers[msg.worker_id] = msg.ref
        self.state.workers_changed.notify()

    @handler
    def worker_down(self, msg: WorkerDown) -> None:
        """A worker died: resubmit or fail every request it held."""
        state = self.state
        origin = msg.origin
        current = state.workers.get(origin.worker)
        if current is not None and current.incarnation == origin.incarnation:
            del state.workers[origin.worker]
        hit = [req for req in state.requests.values() if req.origin == origin]
        reason = f"{worker_name(origin.worker)} (incarnation {origin.incarnation}) {msg.reason}"
        for req in hit:
            if state.resolve(req, Member.WORKER, reason):
                self.start_soon(self._resubmit, req)

    @handler
    def supervisor_down(self, msg: Down) -> None:
        """The pipeline supervisor failed (restart intensity exceeded): nothing will be
        served any more, so every waiting request fails now rather than hang."""
        self.state.close(WorkerDiedError("*", Member.SUPERVISOR, msg.reason))
        self.state.failure = msg.reason
        self.state.supervisor_failed.set()

    async def _resubmit(self, req: _Request) -> None:
        try:
            await self.state.submit(req)
        except TokenyardError as err:
            self.state.fail(
                req, WorkerDiedError(req.rid, Member.WORKER, f"no worker to resubmit to: {err}")
            )


class Pipeline:
    """The LLM front end: N tokenizer workers, a stand-in scheduler, a detokenizer, a router
    and their supervisor, started in their own processes.

    Args:
        workers: Number of tokenizer workers.
        tokenizer: Path of a ``tokenizer.json`` (None: the bundled byte-level BPE).
        step_time: Seconds per step of the stand-in engine (a step is one token of each
            running request). 0, the default, pauses nowhere: a reply is generated at once,
            and streams arrive in one piece or a few; 0.02 paces them as a real model does.
        max_batch_size: Most requests the engine runs at once.
        ready_timeout: Seconds to wait for every worker to register.
        channels: Have the workers serve HTTP on the connections these channels bring
            (`actors.http.Dispatcher`; ``python -m actors serve``).
        system_options: Keyword arguments of the pipeline's ``ActorSystem`` (for workers
            on other hosts: ``transport="tcp"``, ``tcp_host``, ``keys``; see
            ``PipelineConfig.worker_nodes``).
        **config: Other ``PipelineConfig`` fields (limits, timeouts, ``worker_nodes``...).

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
        channels: WorkerChannels | None = None,
        system_options: Mapping[str, Any] | None = None,
        **config: Any,
    ) -> None:
        self.config = PipelineConfig(
            workers=workers,
            tokenizer=None if tokenizer is None else os.fspath(tokenizer),
            step_time=step_time,
            max_batch_size=max_batch_size,
            **config,
        )
        self.ready_timeout = ready_timeout
        self.channels = channels
        self.system = ActorSystem(
            **{"name": "pipeline", "preload": ("actors",), **(system_options or {})}
        )
        self._state = _CallerState(self.config)
        self._supervisor: ActorRef[Any] | None = None
        self._collector: ActorRef[GetMetrics] | None = None

    async def __aenter__(self) -> Pipeline:
        """Start the pipeline's processes and wait until every worker serves.

        Raises:
            PipelineClosedError: It was opened before: a Pipeline serves once (its state,
                closed, stays closed); make a new one.
        """
        state = self._state
        if state.system is not None:
            raise PipelineClosedError("this Pipeline was opened before; make a new one")
        state.system = self.system
        await self.system.__aenter__()
        try:
            inbox = await self.system.spawn(
                PipelineInbox, state, name="pipeline-inbox", process=False
            )
            state.inbox = inbox
            # The inbox and the supervisor run in this loop: if either dies anyway, every
            # request fails at once instead of waiting for what will never come.
            self.system.watch(inbox).on_down(
                lambda down: state.close(WorkerDiedError("*", Member.INBOX, down.reason))
            )
            # Every member's statistics, for `metrics` and every HTTP worker's /metrics.
            self._collector = await self.system.spawn(
                MetricsCollector, name="metrics", process=False
            )
            if self.config.worker_nodes:
                await self.system.wait_nodes(self.config.worker_nodes, self.ready_timeout)
            self._supervisor = await self.system.spawn(
                PipelineSupervisor,
                self.config,
                inbox,
                self.channels,
                self._collector,
                name="pipeline-supervisor",
                process=False,
                spawn_timeout=self.ready_timeout,
            )
            self.system.watch(self._supervisor, notify=inbox)
            with anyio.fail_after(self.ready_timeout):
                while len(state.workers) < self.config.workers:
                    await state.workers_changed.wait()
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
        self._state.close(PipelineClosedError("the pipeline closed before the request finished"))
        await self.system.__aexit__(exc_type, exc, tb)

    # -- requests -------------------------------------------------------------------------

    def _new(self, text: str | list[int], stream: bool, sampling: SamplingParams) -> _Request:
        state = self._state
        if state.closed or state.inbox is None:
            raise PipelineClosedError("the pipeline is not open: use `async with Pipeline()`")
        sampling, text = _typed(sampling, text)
        limits = self.config.limits
        refusal = limits.refusal(
            text if isinstance(text, str) else None,
            None if isinstance(text, str) else text,
            sampling.max_new_tokens,
        )
        if refusal is not None:
            raise InvalidRequestError(refusal)
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
        stop: str | Sequence[str] = (),
        **sampling: Any,
    ) -> GenerateResult:
        """Generate a completion of ``text`` (or of a list of token ids).

        Raises:
            InvalidRequestError: The request breaks a limit (``max_new_tokens``, the prompt's
                size), or holds a value of the wrong type; nothing was sent.
            WorkerDiedError: The members serving it died more times than it may be started
                again (`MAX_RESUBMITS`): nothing reaches this caller before the end, so
                each death before then starts it over.
            RequestFailedError: The pipeline refused it (e.g. an empty prompt).
            PipelineBusyError: No worker took it in time.
            PipelineClosedError: The pipeline closed meanwhile.
        """
        params = SamplingParams(max_new_tokens=max_new_tokens, stop=_stops(stop), **sampling)
        req = self._new(text, False, params)
        try:
            await self._state.submit(req)
            await req.done.wait()
        except BaseException:
            self._state.release(req)
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
        stop: str | Sequence[str] = (),
        **sampling: Any,
    ) -> AsyncGenerator[str, None]:
        """Yield the text of a completion piece by piece as it is decoded.

        Pieces that arrived while the reader was busy come joined as one. Output the reader
        has not taken yet is held up to ``max_stream_buffer`` (characters of text plus token
        ids); a reader further behind gets `SlowReaderError` after what was held, and the
        engine stops generating for it.

        Raises:
            InvalidRequestError: The request breaks a limit, or holds a value of the wrong
                type; nothing was sent.
            WorkerDiedError: Its worker died after pieces had been yielded (a death before
                the first piece starts it again; what had arrived unread goes with the
                lost attempt).
            SlowReaderError: The reader fell too far behind.
            RequestFailedError: The pipeline refused it (e.g. an empty prompt).
            PipelineBusyError: No worker took it in time.
            PipelineClosedError: The pipeline closed meanwhile.
        """
        params = SamplingParams(max_new_tokens=max_new_tokens, stop=_stops(stop), **sampling)
        outputs = self.stream_outputs(text, params)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if out.text:
                    yield out.text

    async def stream_outputs(
        self, text: str | list[int], sampling: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """Like `stream`, but yield the outputs themselves, for callers that need the finish
        reason and the token counts (the HTTP layer).

        Each output's ``text`` holds everything decoded since the previous one yielded (a
        slow reader gets fewer, longer outputs); its counts are the latest. The last output
        carries the finish reason. The same bound on unread output holds as for `stream`.

        Raises:
            InvalidRequestError: The request breaks a limit, or holds a value of the wrong
                type; nothing was sent.
            WorkerDiedError: Its worker died after outputs had been yielded.
            SlowReaderError: The reader fell too far behind.
            RequestFailedError: The pipeline refused it (e.g. an empty prompt).
            PipelineBusyError: No worker took it in time.
            PipelineClosedError: The pipeline closed meanwhile.
        """
        req = self._new(text, True, sampling)
        try:
            await self._state.submit(req)
            while True:
                last = req.last
                if last is not None and (req.pieces or (req.done.is_set() and req.error is None)):
                    # What arrived since the previous yield, as one output with the latest
                    # counts (the finish reason too, once it came: then nothing follows).
                    piece, ids = "".join(req.pieces), req.ids
                    req.pieces.clear()
                    req.ids, req.unread = [], 0
                    req.delivered = True
                    yield msgspec.structs.replace(last, text=piece, output_ids=ids)
                    if last.finish_reason is not None:
                        return
                    continue
                if req.error is not None:
                    raise req.error
                if req.done.is_set():
                    return
                await req.changed.wait()
        finally:
            if not req.done.is_set():
                self._state.release(req)

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
    def collector(self) -> ActorRef[GetMetrics]:
        """The pipeline's `runtime.MetricsCollector`: ``await p.collector.ask(GetMetrics())``
        gathers every member's statistics (what ``/metrics`` renders)."""
        if self._collector is None:
            raise PipelineClosedError("the pipeline is not open")
        return self._collector

    @property
    def supervisor(self) -> ActorRef[Any]:
        """The pipeline supervisor's ref."""
        if self._supervisor is None:
            raise PipelineClosedError("the pipeline is not open")
        return self._supervisor

    async def until_failed(self) -> str:
        """Wait until the pipeline supervisor fails (its restart intensity exceeded, or an
        engine that never starts: `PipelineConfig.engine_start_tries`): nothing is served
        after it. Its reason. Waits for ever on a pipeline that does not fail: race it
        against what else ends the caller's work (``serve`` races it against its signals)."""
        await self._state.supervisor_failed.wait()
        return self._state.failure

    @property
    def resubmitted(self) -> int:
        """Requests moved to another worker after losing theirs before any output."""
        return self._state.resubmitted

    @property
    def failed(self) -> int:
        """Requests failed with ``WorkerDiedError``."""
        return self._state.failed
