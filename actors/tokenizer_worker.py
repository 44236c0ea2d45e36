"""A tokenizer worker: tokenizes its callers' requests and answers them with their output.

One of N. It stamps each request with its ``origin`` (worker id and incarnation), forwards it
to the scheduler, receives from the detokenizer a sub-batch holding only its own requests,
and sends every caller its pieces — one message per caller per sub-batch.

A request leaves the worker's table when it finishes, fails, or when its caller lets it go
(``AbortRequest``): the caller does so when it gives up, and when a pipeline member died
and it resolved the request elsewhere (resubmitted under a new rid, or failed), so nothing
stays in the table for a request nobody serves.

When the scheduler dies, the requests forwarded to it are lost with it: the worker fails
each to its caller (``lost_to`` the scheduler, so a caller that had no output yet resubmits
it), and keeps the ones that arrive meanwhile until a `Topology` names the successor. When
the detokenizer dies, so are the requests forwarded while it lived (their output, finished
or not, may have died inside it): the worker fails them the same way, ``lost_to`` the
detokenizer, once a `Topology` says it is gone.

A prompt is bounded before it costs anything: its bytes before tokenizing, its tokens after,
and ``max_new_tokens`` against an upper bound; a request past one is refused with an error
naming the limit. A long prompt (over `INLINE_CHARS`) is tokenized in a thread while the
worker goes on with its other messages (a prompt at ``max_prompt_bytes`` takes about a
second); at most `MAX_TOKENIZING` at once, past which the next one waits in the mailbox.

**A client of vLLM's engine itself** (``engine_client``: `actors.engines.Vllm.direct`), the
worker sends each tokenized request to the engine, takes its outputs from the engine and
detokenizes them (stop strings too) in this process: no scheduler and no detokenizer on the
way. The scheduler still owns the engine: its death is the engine's loss (the same
`Topology` fails the requests it cost), and a request waits while the engine is not ready.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.to_thread
import msgspec

from runtime import (
    Actor,
    ActorDeadError,
    ActorRef,
    Throttle,
    TokenyardError,
    current_trace,
    handler,
)

from . import _metrics, _tracing
from ._detokenize import IncrementalDetokenizer
from ._limits import RequestLimits, context_refusal, sampling_refusal, vocabulary_refusal
from ._tokenizer import (
    INLINE_CHARS,
    TOKENIZER_THREADS,
    encode_ids,
    eos_token_id,
    load_tokenizer,
    model_id_of,
    outside_vocabulary,
    vocab_size,
)
from ._vllm_protocol import FinishReason, finish_reason_text
from .engines import EngineClient  # noqa: TC001 -- a spawn argument's type (run time)
from .messages import (
    Abort,
    AbortNotice,
    AbortRequest,
    BatchStrOutput,
    CheckFlush,
    CheckLoad,
    Drain,
    Draining,
    FlushCache,
    FlushReply,
    Generate,
    GetLoad,
    GetWorkerStatistics,
    LoadReply,
    Member,
    Origin,
    PipelineSupervisorMessage,
    RegisterWorker,
    RequestOutput,
    RequestOutputs,
    SamplingParams,
    SchedulerMessage,
    TokenizedGenerate,
    Topology,
    WorkerMessage,
    WorkerStatistics,
)

if TYPE_CHECKING:
    from ._vllm_client import VllmClient
    from ._vllm_protocol import EngineCoreOutput

logger = logging.getLogger("tokenyard.worker")
#: Most control requests (load, flush) a worker keeps waiting for their answer; past it the
#: oldest is forgotten, so that callers asking while no scheduler answers cannot grow it.
MAX_PENDING_CONTROL = 1_024

#: Most long prompts a worker holds for tokenizing at once (`TOKENIZER_THREADS` of them in
#: threads, the others waiting for one); past it, the next waits in the mailbox, so what
#: the worker holds is bounded by this many prompts of ``max_prompt_bytes``.
MAX_TOKENIZING = 4


#: Where a request served in this process (by its HTTP server) gets its outputs.
LocalSink = Callable[[RequestOutput], None]


class Caller(Protocol):
    """Whoever waits for a request's outputs, as the worker hands them over: one call per
    step with the caller's outputs of that step. Callers that are equal get one call
    together (the requests of one remote inbox)."""

    async def send(self, outputs: list[RequestOutput]) -> None:
        """Hand over outputs; a caller that is gone drops them (nobody waits for them)."""
        ...


@dataclass(frozen=True, slots=True)
class RemoteCaller:
    """A caller's inbox in another process (a `Generate`'s ``reply_to``): one
    `RequestOutputs` message per step, whatever the number of its requests."""

    ref: ActorRef[RequestOutputs]

    async def send(self, outputs: list[RequestOutput]) -> None:
        try:
            await self.ref.tell(RequestOutputs(outputs=outputs))
        except TokenyardError as err:
            # The caller is gone: nobody waits for these; drop them.
            logger.debug("caller %s unreachable: %s", self.ref.name, err)


@dataclass(frozen=True, slots=True, eq=False)
class LocalCaller:
    """A request of this process's HTTP server (`TokenizerWorker.submit_local`): its sink
    is called with each output, in this event loop."""

    sink: LocalSink

    async def send(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.sink(out)


@dataclass(slots=True)
class _Request:
    #: Whoever waits for its outputs.
    caller: Caller
    stream: bool
    prompt_tokens: int
    #: The tokenized request, until it is forwarded to a scheduler (held while none is up).
    tokenized: TokenizedGenerate | None
    #: The scheduler holding it (None: not forwarded yet).
    scheduler: ActorRef[SchedulerMessage] | None = None
    #: The detokenizer its output goes through (the one live when it was forwarded).
    detokenizer: ActorRef[Any] | None = None
    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    #: When it was admitted, and when its latest output came (0: none yet), monotonic.
    admitted: float = 0.0
    last_output: float = 0.0
    #: Its span here, while it is traced (`actors._tracing`).
    span: _tracing.Span | None = None
    #: The trace context its tell to the scheduler carries (empty: untraced).
    trace: tuple[str, ...] = ()
    #: Sent to vLLM's engine directly: its id there, its text so far, its ids so far.
    engine_rid: str | None = None
    detokenizer_state: IncrementalDetokenizer | None = None
    completion_tokens: int = 0

    def end_span(self, reason: str, completion_tokens: int = 0) -> None:
        if self.span is not None:
            self.span.end(finish_reason=reason, completion_tokens=completion_tokens)


@dataclass(slots=True)
class _Control:
    #: Who asked: an ``ActorRef[LoadReply]`` for a `GetLoad`, ``[FlushReply]`` for a flush.
    reply_to: ActorRef[Any]
    request: GetLoad | FlushCache


class TokenizerWorker(Actor[WorkerMessage]):
    """Tokenizes requests, forwards them, streams their output back to their callers.

    Handles `Generate`, `AbortRequest`, `BatchStrOutput`, `AbortNotice`, `CheckLoad`,
    `CheckFlush`, `LoadReply`, `FlushReply` and `Topology` (tells) and `GetWorkerStatistics`
    (ask, answered with `WorkerStatistics`).

    While the scheduler is dead (or restarting) a request is kept but not forwarded: once
    the successor is up the pipeline resolves every request that was in flight, and lets
    this worker know. A control request still unanswered when a `Topology` names a new
    scheduler or a new router is asked again (the old one may have taken it, or its reply,
    with it); a reply that then comes twice is dropped.

    Args:
        worker_id: Its index among the workers.
        supervisor: Where it registers; it serves only once registered.
        tokenizer: Path of a ``tokenizer.json`` (None: the bundled one).
        register_timeout: Seconds to get registered before it gives up (and dies, so its
            supervisor restarts it).
        limits: What one request may ask for.
        model_name: The ``model_name`` label of its metrics (``None``: from the tokenizer).
        engine_client: Its own addresses as a client of vLLM's engine (``None``: its
            requests go through the scheduler).
    """

    def __init__(
        self,
        worker_id: int,
        supervisor: ActorRef[PipelineSupervisorMessage],
        tokenizer: str | None = None,
        register_timeout: float = 10.0,
        limits: RequestLimits | None = None,
        model_name: str | None = None,
        engine_client: EngineClient | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.supervisor = supervisor
        self.limits = limits or RequestLimits()
        self.tokenizer_path = tokenizer
        self.register_timeout = register_timeout
        self.tokenizer: Any = None
        self.origin = Origin(worker_id, 0)
        self.scheduler: ActorRef[SchedulerMessage] | None = None
        #: Whether the scheduler's engine takes requests, as the latest `Topology` says.
        self.engine_ready = False
        #: The engine's bound on prompt plus generated ids (0: none known).
        self.engine_context_length = 0
        self._engine_client = engine_client
        #: The connection to vLLM's engine, when this worker is its client.
        self.direct: VllmClient | None = None
        #: This worker's request ids by their ids at the engine (direct requests).
        self._by_engine_rid: dict[str, str] = {}
        self._engine_rids = itertools.count()
        #: This incarnation's prefix of its ids at the engine (not guessable from outside).
        self._rid_prefix = ""
        self._bad_outputs = Throttle(logger)
        self._vocab_size = 0
        self.detokenizers: list[ActorRef[Any] | None] = []
        self._spread = itertools.count()
        self.router: ActorRef[Any] | None = None
        self.requests: dict[str, _Request] = {}
        #: Callers of the long prompts being tokenized off the event loop, by rid: the rid
        #: is taken (a duplicate is refused), and a release drops the request once tokenized.
        self._tokenizing: dict[str, Caller] = {}
        self._tokenizing_slots = anyio.Semaphore(MAX_TOKENIZING)
        self._threads = anyio.CapacityLimiter(TOKENIZER_THREADS)
        self.registered = anyio.Event()
        self.control: dict[int, _Control] = {}
        self._control_ids = itertools.count(1)
        self._control_waits = Throttle(logger)
        self._misrouted = Throttle(logger)
        self.received = 0
        self.finished = 0
        self.failed = 0
        self.released = 0
        self.engine_strays = 0
        model = model_name or model_id_of(tokenizer)
        self._ttft = _metrics.TIME_TO_FIRST_TOKEN.labels(model)
        self._itl = _metrics.INTER_TOKEN_LATENCY.labels(model)
        self._e2e = _metrics.E2E_LATENCY.labels(model)
        self._prompt_tokens = _metrics.PROMPT_TOKENS.labels(model)
        self._generation_tokens = _metrics.GENERATION_TOKENS.labels(model)
        self._served = _metrics.WORKER_REQUESTS.labels(model, worker_id)
        self._model = model

    async def on_start(self) -> None:
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.origin = Origin(self.worker_id, self.ref.incarnation)
        if self._engine_client is not None:
            from ._vllm_client import VllmClient

            self._vocab_size = vocab_size(self.tokenizer)
            self._rid_prefix = f"{self.worker_id}.{self.ref.incarnation}.{secrets.token_hex(6)}."
            self.direct = VllmClient(
                self._engine_client,
                eos=eos_token_id(self.tokenizer),
                on_outputs=self._engine_outputs,
                on_unreachable=self._engine_unreachable,
            )
            self.start_soon(self.direct.run)
        self.start_soon(self._register)

    async def _register(self) -> None:
        msg = RegisterWorker(
            worker_id=self.worker_id, incarnation=self.ref.incarnation, address=self.ref
        )
        # An ask timing out, or refused (the supervisor could not publish the route), raises:
        # the worker dies unregistered, and its supervisor restarts it to register again.
        await self.supervisor.ask(msg, timeout=self.register_timeout)
        self.registered.set()

    @handler
    async def topology(self, msg: Topology) -> None:
        """The supervisor says where the scheduler and the router are now.

        Requests forwarded to a scheduler that is gone are failed to their callers (lost to
        the scheduler); requests held while none was up go to the new one.
        """
        old, old_detokenizers = self.scheduler, self.detokenizers
        moved = (msg.scheduler is not None and msg.scheduler != old) or (
            msg.router is not None and msg.router != self.router
        )
        self.scheduler, self.detokenizers, self.router = (
            msg.scheduler,
            list(msg.detokenizers),
            msg.router,
        )
        self.engine_ready = msg.engine_ready
        self.engine_context_length = msg.engine_context_length
        if old is not None and msg.scheduler != old:
            if self.direct is not None:
                # The engine went with its scheduler: what it held or queued is gone.
                self.direct.forget()
                self._by_engine_rid.clear()
            await self._lose(
                lambda r: r.scheduler == old, Member.SCHEDULER, "the scheduler died with it"
            )
        gone = {
            ref
            for j, ref in enumerate(old_detokenizers)
            if ref is not None and (j >= len(msg.detokenizers) or msg.detokenizers[j] != ref)
        }
        if gone:
            await self._lose(
                lambda r: r.detokenizer in gone,
                Member.DETOKENIZER,
                "the detokenizer died with its output",
            )
        if msg.scheduler is not None and (self.direct is None or self.engine_ready):
            for request in list(self.requests.values()):
                if request.tokenized is not None:
                    await self._forward(request)
        if moved:
            for pending in list(self.control.values()):
                await self._send_control(pending.request)

    # -- requests from callers ------------------------------------------------------------

    @handler
    async def admit(self, msg: Generate) -> None:
        """Tokenize a request and hand it to the scheduler."""
        await self._admit(
            msg.rid, RemoteCaller(msg.reply_to), msg.text, msg.input_ids, msg.sampling, msg.stream
        )

    async def submit_local(
        self,
        rid: str,
        sink: LocalSink,
        input_ids: list[int],
        *,
        sampling: SamplingParams,
        stream: bool,
        traceparent: str | None = None,
    ) -> None:
        """Serve a request of this process's own HTTP server: as `admit` does, with its
        outputs handed to ``sink`` in this process (no message to any other process).

        ``input_ids`` and ``sampling`` are taken as they are: the HTTP layer admitted them
        against its own limits (`actors.http.ServeConfig.limits`), the one check an HTTP
        request gets. Call it from this actor's event loop; `release_local` lets the
        request go. ``traceparent`` is the HTTP request's trace context, the parent of its
        spans.
        """
        await self._admit(
            rid, LocalCaller(sink), None, input_ids, sampling, stream, traceparent, checked=True
        )

    def release_local(self, rid: str) -> None:
        """Let a request of `submit_local` go (its client left): forget it, and stop the
        engine generating for it."""
        self._release(rid)

    async def _admit(
        self,
        rid: str,
        caller: Caller,
        text: str | None,
        input_ids: list[int] | None,
        sampling: SamplingParams,
        stream: bool,
        traceparent: str | None = None,
        *,
        checked: bool = False,
    ) -> None:
        """Take a request in: tokenize it and hold it to this worker's `limits` (unless
        its caller did, ``checked``), or refuse it; then forward it."""
        await self.registered.wait()
        self.received += 1
        if rid in self.requests or rid in self._tokenizing:
            # Replacing it would leave the first caller waiting for ever.
            await self._fail(
                caller,
                rid,
                0,
                f"duplicate rid {rid!r}: worker {self.worker_id} already serves a request "
                "with that rid; give each request its own rid",
            )
            return
        max_new = sampling.max_new_tokens
        limits = None if checked else self.limits
        refusal = None if limits is None else limits.refusal(text, None, max_new)
        if refusal is not None:
            await self._fail(caller, rid, 0, refusal)
            return
        if input_ids is not None:
            ids = list(input_ids)
        elif text is None:
            await self._fail(caller, rid, 0, "a request needs text or input_ids")
            return
        elif len(text) <= INLINE_CHARS:
            ids = encode_ids(self.tokenizer, text)
        else:
            # Tokenized in a thread, by a task of its own; the rid is taken now, so that
            # what this mailbox takes next (its release, a duplicate) finds it.
            await self._tokenizing_slots.acquire()
            self._tokenizing[rid] = caller
            self.start_soon(self._tokenize, rid, caller, text, sampling, stream, limits)
            return
        await self._take(rid, caller, ids, sampling, stream, limits, traceparent)

    async def _tokenize(
        self,
        rid: str,
        caller: Caller,
        text: str,
        sampling: SamplingParams,
        stream: bool,
        limits: RequestLimits | None,
    ) -> None:
        """`_admit` a long prompt: tokenize it in a thread, then take the request in,
        unless its caller let it go meanwhile. An error fails this request alone."""
        try:
            ids = await anyio.to_thread.run_sync(
                encode_ids, self.tokenizer, text, limiter=self._threads, abandon_on_cancel=True
            )
            if self._untake(rid, caller):
                await self._take(rid, caller, ids, sampling, stream, limits)
        except Exception as err:  # as a handler's error: this request only
            logger.exception("%s: tokenizing %r failed", self.ref.name, rid)
            if self._untake(rid, caller):
                await self._fail(caller, rid, 0, f"the prompt could not be tokenized: {err}")
        finally:
            self._tokenizing_slots.release()

    def _untake(self, rid: str, caller: Caller) -> bool:
        """End ``caller``'s hold on ``rid`` for its tokenizing; ``False``: it was let go
        meanwhile (and the rid may be another request's now)."""
        if self._tokenizing.get(rid) is not caller:
            return False
        del self._tokenizing[rid]
        return True

    async def _take(
        self,
        rid: str,
        caller: Caller,
        ids: list[int],
        sampling: SamplingParams,
        stream: bool,
        limits: RequestLimits | None,
        traceparent: str | None = None,
    ) -> None:
        """Hold a tokenized request to ``limits``, or refuse it; then forward it."""
        if not ids:
            await self._fail(caller, rid, 0, "the prompt tokenizes to nothing")
            return
        refusal = None if limits is None else limits.tokens_refusal(len(ids))
        if refusal is not None:
            await self._fail(caller, rid, len(ids), refusal)
            return
        span = _tracing.start(
            "tokenyard.worker", traceparent, rid=rid, worker=self.worker_id, prompt_tokens=len(ids)
        )
        tokenized = TokenizedGenerate(rid=rid, origin=self.origin, input_ids=ids, sampling=sampling)
        # Untraced here (no provider in this process), a caller's context goes no further:
        # with tracing off the pipeline's frames carry nothing for it, whatever the client
        # sent.
        context = None if span is None else span.traceparent
        request = self.requests[rid] = _Request(
            caller,
            stream,
            len(ids),
            tokenized,
            admitted=time.monotonic(),
            span=span,
            trace=(context,) if context else (),
        )
        await self._forward(request)

    def _pick_detokenizer(self) -> int:
        """The detokenizer of a new request: the next live one in turn (every worker
        spreads its requests over all of them, so none is idle while others are busy)."""
        count = len(self.detokenizers)
        if count <= 1:
            return 0
        start = next(self._spread)
        for i in range(count):
            index = (start + i) % count
            if self.detokenizers[index] is not None:
                return index
        return start % count

    async def _lose(self, which: Any, member: Member, why: str) -> None:
        """Fail to their callers the requests ``which`` selects, lost to ``member``."""
        for rid in [rid for rid, r in self.requests.items() if which(r)]:
            request = self.requests.pop(rid)
            request.end_span("abort")
            await self._fail(request.caller, rid, request.prompt_tokens, why, lost_to=member)

    async def _forward(self, request: _Request) -> None:
        """Send a request to the scheduler, or keep it until one is up.

        A dead scheduler takes its requests with it: the next `Topology` fails them (or
        hands this one to the successor, when it never got there). A live scheduler whose
        mailbox stayed full is an overloaded pipeline: the request fails rather than wait
        without bound.
        """
        scheduler, tokenized = self.scheduler, request.tokenized
        if scheduler is None or tokenized is None:
            return
        if self.direct is not None:
            await self._send_to_engine(request, scheduler, tokenized, self.direct)
            return
        index = self._pick_detokenizer()
        tokenized = msgspec.structs.replace(tokenized, detokenizer=index)
        request.tokenized, request.scheduler = None, scheduler
        request.detokenizer = self.detokenizers[index] if self.detokenizers else None
        try:
            await scheduler.tell(tokenized, trace=request.trace)
        except ActorDeadError as err:
            request.tokenized, request.scheduler = tokenized, None
            logger.debug(
                "%s: %r waits for the scheduler's successor: %s", self.ref.name, tokenized.rid, err
            )
        except TokenyardError as err:
            if self.requests.pop(tokenized.rid, None) is not None:
                request.end_span("abort")
                await self._fail(
                    request.caller,
                    tokenized.rid,
                    request.prompt_tokens,
                    f"the scheduler did not take the request: {err}",
                )

    async def _send_to_engine(
        self,
        request: _Request,
        scheduler: ActorRef[SchedulerMessage],
        tokenized: TokenizedGenerate,
        direct: VllmClient,
    ) -> None:
        """Send a request to vLLM's engine (`engine_client`), or keep it while the engine is
        not ready; refuse what the engine must not see (it trusts its clients)."""
        if not self.engine_ready:
            return
        rid, ids, sampling = tokenized.rid, tokenized.input_ids, tokenized.sampling
        if sampling.max_new_tokens == 0:  # as the scheduler does: nothing to generate
            await self._finish_unsent(request, rid)
            return
        refusal, invalid = direct.unreachable, None
        if refusal is None and (found := self._engine_refusal(ids, sampling)) is not None:
            refusal, invalid = found
        state = None
        if refusal is None:
            try:
                state = IncrementalDetokenizer(
                    self.tokenizer,
                    stop=sampling.stop,
                    no_stop_trim=sampling.no_stop_trim,
                    skip_special_tokens=sampling.skip_special_tokens,
                )
            except ValueError as err:  # an empty stop string
                refusal, invalid = str(err), "invalid_value"
        engine_rid = f"{self._rid_prefix}{next(self._engine_rids):x}"
        if refusal is None and not direct.add(engine_rid, ids, sampling):
            refusal = "the engine takes no requests now (it is not connected to this worker)"
        if refusal is not None:
            if self.requests.pop(rid, None) is not None:
                request.end_span("abort")
                await self._fail(
                    request.caller, rid, request.prompt_tokens, refusal, invalid=invalid
                )
            return
        request.tokenized, request.scheduler = None, scheduler
        request.engine_rid, request.detokenizer_state = engine_rid, state
        self._by_engine_rid[engine_rid] = rid

    async def _finish_unsent(self, request: _Request, rid: str) -> None:
        """End a request that asks for no token with ``length``, the engine never asked."""
        await self.output(
            BatchStrOutput(
                rids=[rid],
                origins=[self.origin],
                finished_reasons=["length"],
                output_strs=[""],
                output_ids=[[]],
                prompt_tokens=[request.prompt_tokens],
                completion_tokens=[0],
                cached_tokens=[0],
            )
        )

    def _engine_refusal(self, ids: list[int], sampling: SamplingParams) -> tuple[str, str] | None:
        """Why the engine must not see a request, and its `RequestOutput.invalid` code: an
        id outside the vocabulary (`vocabulary_refusal`), no room left in its
        context (`context_refusal`), sampling parameters it dies of (`sampling_refusal`):
        what the scheduler refuses on its path."""
        refusal = vocabulary_refusal(ids, self._vocab_size)
        if refusal is not None:
            return refusal, "invalid_value"
        refusal = context_refusal(len(ids), self.engine_context_length)
        if refusal is not None:
            return refusal, "context_length_exceeded"
        refusal = sampling_refusal(sampling)
        return None if refusal is None else (refusal, "invalid_value")

    async def _engine_unreachable(self, reason: str, dropped: list[str]) -> None:
        """The engine stayed unreachable from this worker: what waited for it fails."""
        for engine_rid in dropped:
            rid = self._by_engine_rid.pop(engine_rid, None)
            request = None if rid is None else self.requests.pop(rid, None)
            if rid is not None and request is not None:
                request.end_span("abort")
                await self._fail(request.caller, rid, request.prompt_tokens, reason)

    async def _engine_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """One message of vLLM's engine: detokenize each of this worker's requests in it
        and hand the step to `output`, as a detokenizer would have; abort what this
        worker does not know (an earlier incarnation's), and stop what a stop string ended."""
        direct = self.direct
        assert direct is not None
        rids: list[str] = []
        reasons: list[str | None] = []
        pieces: list[str] = []
        new_ids: list[list[int]] = []
        completion: list[int] = []
        prompt: list[int] = []
        errors: list[str | None] = []
        for out in outputs:
            engine_rid, finish = out.request_id, out.finish_reason
            rid = self._by_engine_rid.get(engine_rid)
            request = None if rid is None else self.requests.get(rid)
            state = None if request is None else request.detokenizer_state
            if rid is None or request is None or state is None or request.engine_rid != engine_rid:
                self._by_engine_rid.pop(engine_rid, None)
                # One of this incarnation's that ended here (a stop string, its caller
                # gone): its abort is on its way. Another's: the engine runs it for nobody.
                stray = not engine_rid.startswith(self._rid_prefix) and finish is None
                if stray and direct.abort_stray(engine_rid):
                    self.engine_strays += 1
                continue
            ids = out.new_token_ids
            request.completion_tokens += len(ids)
            reason = None if finish is None else finish_reason_text(finish)
            error = None
            piece = ""
            if reason == "abort":
                error = (
                    "the engine failed the request (its log says why)"
                    if finish == FinishReason.ERROR
                    else "the engine aborted the request"
                )
            elif outside_vocabulary(ids, self._vocab_size) is not None:
                self._bad_outputs.warning("vLLM sent ids outside the vocabulary: %s", ids[:8])
                error = "the engine sent ids outside the vocabulary"
                if reason is None:
                    direct.abort(engine_rid)
                reason = "abort"
            else:
                piece = state.push(ids, finished=reason is not None)
                if state.stopped:
                    if reason is None:
                        direct.abort(engine_rid)
                    reason = "stop"
            if reason is not None:
                del self._by_engine_rid[engine_rid]
                direct.ended(engine_rid)
            rids.append(rid)
            reasons.append(reason)
            pieces.append(piece)
            new_ids.append(ids)
            completion.append(request.completion_tokens)
            prompt.append(request.prompt_tokens)
            errors.append(error)
        if rids:
            await self.output(
                BatchStrOutput(
                    rids=rids,
                    origins=[self.origin] * len(rids),
                    finished_reasons=reasons,
                    output_strs=pieces,
                    output_ids=new_ids,
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    cached_tokens=[0] * len(rids),
                    errors=errors if any(e is not None for e in errors) else None,
                )
            )

    @handler
    def abort_request(self, msg: AbortRequest) -> None:
        """A caller let a request go (gave up, or resolved it elsewhere): forget it here and
        stop generating for it. Its remaining output, if any, is dropped on arrival."""
        self._release(msg.rid)

    def _release(self, rid: str) -> None:
        if self._tokenizing.pop(rid, None) is not None:
            self.released += 1  # `_tokenize` drops it once tokenized
            return
        request = self.requests.pop(rid, None)
        if request is None:
            return
        request.end_span("released")
        self.released += 1
        if request.engine_rid is not None:
            self._by_engine_rid.pop(request.engine_rid, None)
            if self.direct is not None:
                self.direct.abort(request.engine_rid)
        elif self.scheduler is not None and request.scheduler is not None:
            # Never waits: a full scheduler mailbox loses only the early stop of this
            # request's generation (its output is dropped on arrival either way).
            with contextlib.suppress(TokenyardError):
                self.scheduler.try_tell(Abort(origin=self.origin, rid=rid, reason="abort"))

    # -- output from the detokenizer ------------------------------------------------------

    @handler
    async def output(self, msg: BatchStrOutput) -> None:
        """This worker's share of one step: answer each caller with one message."""
        by_caller: dict[Caller, list[RequestOutput]] = {}
        errors = msg.errors
        now = time.monotonic()
        traces = current_trace()  # one per entry when the step has a traced request
        if len(traces) != len(msg.rids):
            traces = ()
        for i, rid in enumerate(msg.rids):
            request = self.requests.get(rid)
            if request is None:
                continue  # aborted meanwhile, or output for a request this incarnation lacks
            if request.last_output:
                self._itl.observe(now - request.last_output)
            else:
                self._ttft.observe(now - request.admitted)
            request.last_output = now
            if errors is not None and errors[i] is not None:
                # The detokenizer refused it (its cap on live states, a malformed stop):
                # the caller hears why, as for any refusal.
                del self.requests[rid]
                request.end_span("abort")
                self.failed += 1
                by_caller.setdefault(request.caller, []).append(
                    RequestOutput(
                        rid=rid,
                        worker=self.worker_id,
                        text="",
                        output_ids=[],
                        prompt_tokens=request.prompt_tokens,
                        completion_tokens=0,
                        finish_reason="abort",
                        error=errors[i],
                    )
                )
                continue
            finish = msg.finished_reasons[i]
            piece, ids = msg.output_strs[i], msg.output_ids[i]
            if request.stream:
                out = RequestOutput(
                    rid=rid,
                    worker=self.worker_id,
                    text=piece,
                    output_ids=ids,
                    prompt_tokens=request.prompt_tokens,
                    completion_tokens=msg.completion_tokens[i],
                    finish_reason=finish,
                )
            else:
                request.text.append(piece)
                request.output_ids.extend(ids)
                if finish is None:
                    continue
                out = RequestOutput(
                    rid=rid,
                    worker=self.worker_id,
                    text="".join(request.text),
                    output_ids=request.output_ids,
                    prompt_tokens=request.prompt_tokens,
                    completion_tokens=msg.completion_tokens[i],
                    finish_reason=finish,
                )
            if finish is not None:
                del self.requests[rid]
                self.finished += 1
                self._finished(request, finish, msg.completion_tokens[i], now)
                if traces:
                    # Back where it started: the last hop's span, child of the detokenizer's.
                    back = _tracing.start_child("tokenyard.worker.respond", traces[i])
                    if back is not None:
                        back.end()
                request.end_span(finish, msg.completion_tokens[i])
            by_caller.setdefault(request.caller, []).append(out)
        for caller, outputs in by_caller.items():
            await caller.send(outputs)

    @handler
    async def aborted(self, msg: AbortNotice) -> None:
        """The scheduler refused or dropped requests on its own: tell their callers."""
        for rid in msg.rids:
            request = self.requests.pop(rid, None)
            if request is not None:  # else a second copy of the notice (the router resends)
                request.end_span("abort")
                await self._fail(
                    request.caller,
                    rid,
                    request.prompt_tokens,
                    msg.reason,
                    lost_to=msg.lost_to,
                    invalid=msg.invalid,
                )

    # -- control requests whose replies come back through the router ----------------------

    @handler
    async def check_load(self, msg: CheckLoad) -> None:
        """Ask the scheduler for its load; the reply returns via the router."""
        await self._control(msg.reply_to, lambda rid: GetLoad(origin=self.origin, request_id=rid))

    @handler
    async def check_flush(self, msg: CheckFlush) -> None:
        """Ask the scheduler to flush; the reply returns via the router."""
        await self._control(
            msg.reply_to, lambda rid: FlushCache(origin=self.origin, request_id=rid)
        )

    async def _control(
        self, reply_to: ActorRef[LoadReply] | ActorRef[FlushReply], make: Any
    ) -> None:
        await self.registered.wait()
        request_id = next(self._control_ids)
        request = make(request_id)
        if len(self.control) >= MAX_PENDING_CONTROL:
            oldest = next(iter(self.control))
            del self.control[oldest]
            self._control_waits.warning(
                "%s: %d control requests wait for a scheduler: the oldest (%d) is dropped",
                self.ref.name,
                MAX_PENDING_CONTROL,
                oldest,
            )
        self.control[request_id] = _Control(reply_to, request)
        await self._send_control(request)

    async def _send_control(self, request: GetLoad | FlushCache) -> None:
        """Ask the scheduler; kept until answered, and asked again of a successor."""
        if self.scheduler is None:
            return
        try:
            await self.scheduler.tell(request)
        except TokenyardError as err:
            self._control_waits.warning(
                "%s: control request %d waits for the next scheduler: %s",
                self.ref.name,
                request.request_id,
                err,
            )

    @handler
    async def load_reply(self, msg: LoadReply) -> None:
        """The router brought back the scheduler's load."""
        await self._control_reply(msg)

    @handler
    async def flush_reply(self, msg: FlushReply) -> None:
        """The router brought back the flush result."""
        await self._control_reply(msg)

    async def _control_reply(self, msg: LoadReply | FlushReply) -> None:
        if msg.origin != self.origin:
            self._misrouted.error("%s got a control reply for %s", self.ref.name, msg.origin)
            return
        pending = self.control.pop(msg.request_id, None)
        if pending is not None:  # else a second reply to a request asked again
            with contextlib.suppress(TokenyardError):  # the caller may have left
                await pending.reply_to.tell(msg)

    @handler
    async def drain(self, msg: Drain) -> Draining:
        """Nothing to drain: a worker that serves no HTTP answers for its requests to its
        callers, who decide when to stop (an HTTP worker overrides this)."""
        return Draining(connections=0, requests=self._held())

    @handler
    def statistics(self, msg: GetWorkerStatistics) -> WorkerStatistics:
        """The worker's counters."""
        return WorkerStatistics(
            origin=self.origin,
            received=self.received,
            finished=self.finished,
            failed=self.failed,
            released=self.released,
            requests=self._held(),
            control_pending=len(self.control),
            engine_strays=self.engine_strays,
            engine_rejected=0 if self.direct is None else self.direct.rejected_frames,
            tokenizing=len(self._tokenizing),
        )

    # -- helpers --------------------------------------------------------------------------

    def _held(self) -> int:
        """Requests held now: in the table, or their prompt being tokenized."""
        return len(self.requests) + len(self._tokenizing)

    def _finished(self, request: _Request, reason: str, completion_tokens: int, now: float) -> None:
        """Count a request served to its end."""
        self._e2e.observe(now - request.admitted)
        self._prompt_tokens.inc(request.prompt_tokens)
        self._generation_tokens.inc(completion_tokens)
        _metrics.REQUEST_SUCCESS.labels(self._model, reason).inc()
        self._served.inc()

    async def _fail(
        self,
        caller: Caller,
        rid: str,
        prompt_tokens: int,
        error: str,
        lost_to: Member | None = None,
        invalid: str | None = None,
    ) -> None:
        self.failed += 1
        out = RequestOutput(
            rid=rid,
            worker=self.worker_id,
            text="",
            output_ids=[],
            prompt_tokens=prompt_tokens,
            completion_tokens=0,
            finish_reason="abort",
            error=error,
            lost_to=lost_to,
            invalid=invalid,
        )
        await caller.send([out])
