"""The pipeline's whole wire vocabulary, on one screen.

Data flow (docs/design.md §The pipeline's data flow)::

    caller --Generate, AbortRequest--> TokenizerWorker[k] --TokenizedGenerate--> Scheduler
    Scheduler --BatchTokenIDOutput--> Detokenizer --BatchStrOutput (worker k's only)--> worker k
    worker k --RequestOutputs--> caller
    worker k --GetLoad, FlushCache (origin)--> Scheduler
    Scheduler --LoadReply, FlushReply, AbortNotice--> Router --> worker k
    worker k --RegisterWorker--> PipelineSupervisor --RouteUpdate--> Detokenizer, Router
    PipelineSupervisor --Registered--> worker k; --Topology--> every member
    PipelineSupervisor --WorkerUp, WorkerDown--> caller; --Abort, AbortAll--> Scheduler
    the server's owner --Drain--> every HTTP worker (on SIGTERM)

Identity is typed: every request carries its caller's ``rid`` untouched and its ``origin``
(worker id and incarnation) as fields, never a prefix parsed out of a string. Batch outputs
carry rids and origins index-aligned, so the detokenizer can group a batch by origin with the
generic `runtime.Batch` splitter. Per-request field names follow SGLang 0.5.3's io_struct.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import msgspec

from runtime import ActorRef, Batch, Down, Message, Request, SupervisorMessage

LARGEST_INT = (1 << 63) - 1
"""The largest integer a message carries (msgpack's signed 64-bit integers): a seed, an
id, or a limit past it cannot be sent."""


class Member(enum.Enum):
    """A role in the pipeline: who served a request, who died, who is stuck."""

    WORKER = "worker"
    DETOKENIZER = "detokenizer"
    SCHEDULER = "scheduler"
    ROUTER = "router"
    SUPERVISOR = "pipeline-supervisor"
    INBOX = "pipeline-inbox"


class Origin(msgspec.Struct, frozen=True, array_like=True):
    """Which worker incarnation owns a request.

    Attributes:
        worker: The worker's index (0..N-1).
        incarnation: Which start of that worker; output for an old one is dropped.
    """

    worker: int
    incarnation: int

    def __str__(self) -> str:
        """``worker 3 (incarnation 1)``, for log lines and error messages (``repr`` stays
        the struct's own, ``Origin(worker=3, incarnation=1)``, for debugging)."""
        return f"worker {self.worker} (incarnation {self.incarnation})"


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """What to generate; the stand-in engine honours all of it deterministically.

    Attributes:
        max_new_tokens: Upper bound on generated tokens.
        stop: Stop strings (trimmed from the text unless ``no_stop_trim``).
        stop_token_ids: Token ids that finish the request (on top of the tokenizer's eos).
        temperature: 0 is greedy; above 0 draws from the seeded stand-in distribution.
        seed: Seed of the stand-in engine's draws (default: derived from the prompt).
        skip_special_tokens: Leave special tokens out of the text.
        no_stop_trim: Keep the matched stop string in the text.
        ignore_eos: Do not finish on the eos token.
    """

    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    ignore_eos: bool = False


# -- caller <-> worker ----------------------------------------------------------------------


class Generate(Message):
    """A generation request from a caller to a tokenizer worker.

    Attributes:
        rid: The caller's request id, carried untouched to the end.
        reply_to: The caller's inbox; every ``RequestOutput`` for this rid goes there.
        text: The prompt text (or give ``input_ids``).
        input_ids: An already tokenized prompt.
        sampling: What to generate.
        stream: Send each new piece as it is decoded (else one final output).
    """

    rid: str
    reply_to: ActorRef[RequestOutputs]
    text: str | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = SamplingParams()
    stream: bool = False


class AbortRequest(Message):
    """A caller gives up on a request (cancelled, disconnected)."""

    rid: str


class RequestOutput(Message, array_like=True):
    """Output for one request, from its worker to its caller.

    Attributes:
        rid: The request.
        worker: The worker that served it.
        text: The newly decoded piece (streaming) or the whole text (final, not streaming).
        output_ids: The newly generated ids (streaming) or all of them.
        prompt_tokens: Prompt length in tokens.
        completion_tokens: Tokens generated so far.
        finish_reason: ``None`` while running; ``"stop"``, ``"length"`` or ``"abort"`` at the end.
        error: Why the request failed, if it did.
        lost_to: The member whose death or stall cost the request its output (the caller
            may resubmit it if none had reached it yet); ``None`` for any other failure.
        invalid: The engine refused the request as it is (an OpenAI error code:
            ``context_length_exceeded``, ``invalid_value``): trying it again cannot help.
    """

    rid: str
    worker: int
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    lost_to: Member | None = None
    invalid: str | None = None


class RequestOutputs(Message, array_like=True):
    """Several requests' outputs for one caller, sent as one message."""

    outputs: list[RequestOutput]


# -- worker -> scheduler --------------------------------------------------------------------


class TokenizedGenerate(Message, array_like=True):
    """A tokenized request, from its worker to the scheduler.

    Attributes:
        rid: The request (the attempt's rid).
        origin: The worker incarnation that owns it.
        input_ids: The prompt.
        sampling: What to generate.
        detokenizer: Which detokenizer its output goes through for its whole life (the
            worker spreads its requests over them).

    A traced request's context travels in the tell's frame header (`actors._tracing`).
    """

    rid: str
    origin: Origin
    input_ids: list[int]
    sampling: SamplingParams
    detokenizer: int = 0


class Abort(Message):
    """Abort requests at the scheduler: one rid of an origin, or every request of an origin.

    Attributes:
        origin: Whose requests.
        rid: One request; ``None`` aborts all of that origin's requests.
        reason: Recorded in the aborted requests' finish reason.
    """

    origin: Origin
    rid: str | None = None
    reason: str = "abort"


class AbortAll(Message):
    """Abort every request the scheduler holds (the detokenizer it streams to died); each
    is reported to its worker, which tells its caller.

    Attributes:
        reason: Why, for the callers.
        lost_to: The member whose death caused it, if one did (its callers may resubmit).
        detokenizer: Only the requests streaming through this detokenizer (``None``: all).
    """

    reason: str = "abort"
    lost_to: Member | None = None
    detokenizer: int | None = None


# -- engine output batches ------------------------------------------------------------------


class BatchTokenIDOutput(Batch, array_like=True, gc=False):
    """One engine step's new token ids for every running request (SGLang's field names).

    ``rids`` and ``origins`` are index-aligned with every other list; ``decode_ids`` holds
    only ids new since the previous message for that request (incremental sending) and
    ``read_offsets`` how many of the request's ids had been sent before.

    Every field but ``step`` is per-request. A per-request field that defaults to ``None`` is
    one the engine carries only when some request asked for it (logprobs, hidden states) or
    only in some modes; ``None`` means "not carried by this batch" and costs one byte on the
    wire. Fields added since the first release follow ``step``: an array-like message only
    grows at its end (msgspec's schema evolution rule), so older peers still decode it.

    Attributes:
        rids: The callers' request ids, untouched.
        origins: The worker incarnation that owns each request.
        finished_reasons: ``None`` while running, else why the request finished.
        decode_ids: Ids generated since the previous message for the request.
        read_offsets: How many of the request's output ids had been sent before this message.
        skip_special_tokens: Leave special tokens out of the request's text.
        spaces_between_special_tokens: Put spaces between special tokens in the text.
        no_stop_trim: Keep a matched stop string in the text.
        stop: The request's stop strings, matched by the detokenizer.
        prompt_tokens: Prompt length in tokens.
        completion_tokens: Tokens generated so far.
        cached_tokens: Prompt tokens served from the prefix cache.
        input_token_logprobs_val: Log probability of each prompt token.
        input_token_logprobs_idx: The prompt token ids those values belong to.
        output_token_logprobs_val: Log probability of each new output token.
        output_token_logprobs_idx: The output token ids those values belong to.
        input_top_logprobs_val: Per prompt position, the top-k log probabilities.
        input_top_logprobs_idx: Per prompt position, the top-k token ids.
        output_top_logprobs_val: Per new output position, the top-k log probabilities.
        output_top_logprobs_idx: Per new output position, the top-k token ids.
        input_token_ids_logprobs_val: Log probabilities of the token ids the request named,
            over the prompt.
        input_token_ids_logprobs_idx: The token ids those values belong to.
        output_token_ids_logprobs_val: Log probabilities of the token ids the request named,
            over the new output.
        output_token_ids_logprobs_idx: The token ids those values belong to.
        output_hidden_states: The request's last hidden state, when it asked for it.
        step: The engine step that produced the batch (batch-wide).
        decoded_texts: Text the engine already decoded for the request, which the
            detokenizer continues from (SGLang's incremental-decoding prefix); ``None``
            when the detokenizer does all the decoding, as with the stand-in engine.
        output_ids: All of the request's output ids so far (SGLang sends them only when
            tokenizer initialization is skipped); ``None`` normally, ``decode_ids``
            carrying the new ones.
        spec_verify_ct: Speculative-decoding verification passes run for the request.
        placeholder_tokens_idx: Per request, the prompt positions of placeholder tokens
            (e.g. an image token) after expansion, or ``None`` for a request without any.
        placeholder_tokens_val: Per request, how many padded tokens each placeholder
            expanded to, index-aligned with ``placeholder_tokens_idx``.

    Its requests' trace contexts travel in the tell's frame header, one per request in
    ``rids`` order (`actors._tracing`).
    """

    shared_fields: ClassVar[tuple[str, ...]] = ("step",)

    rids: list[str]
    origins: list[Origin]
    finished_reasons: list[str | None]
    decode_ids: list[list[int]]
    read_offsets: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop: list[tuple[str, ...]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    input_token_logprobs_val: list[list[float]] | None = None
    input_token_logprobs_idx: list[list[int]] | None = None
    output_token_logprobs_val: list[list[float]] | None = None
    output_token_logprobs_idx: list[list[int]] | None = None
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None
    output_top_logprobs_val: list[list[list[float]]] | None = None
    output_top_logprobs_idx: list[list[list[int]]] | None = None
    input_token_ids_logprobs_val: list[list[float]] | None = None
    input_token_ids_logprobs_idx: list[list[int]] | None = None
    output_token_ids_logprobs_val: list[list[float]] | None = None
    output_token_ids_logprobs_idx: list[list[int]] | None = None
    output_hidden_states: list[list[float]] | None = None
    step: int = 0
    decoded_texts: list[str] | None = None
    output_ids: list[list[int]] | None = None
    spec_verify_ct: list[int] | None = None
    placeholder_tokens_idx: list[list[int] | None] | None = None
    placeholder_tokens_val: list[list[int] | None] | None = None


class BatchStrOutput(Batch, array_like=True, gc=False):
    """Decoded text pieces for the requests of one worker (one sub-batch per worker).

    Every field but ``step`` is per-request; ``None`` means "not carried by this batch" and
    costs one byte on the wire. The detokenizer computes the text, ids, finish reasons and
    errors, and carries every other field that `BatchTokenIDOutput` has under the same name
    as it is. Fields added since the first release follow ``step`` and ``errors``, in the
    order they were added (array-like messages only grow at their end).

    Attributes:
        rids: The callers' request ids, untouched.
        origins: The worker incarnation that owns each request (one worker per sub-batch).
        finished_reasons: ``None`` while running, else why the request finished.
        output_strs: The text decoded since the previous message for the request.
        output_ids: The ids generated since the previous message for the request.
        prompt_tokens: Prompt length in tokens.
        completion_tokens: Tokens generated so far.
        cached_tokens: Prompt tokens served from the prefix cache.
        input_token_logprobs_val: Log probability of each prompt token.
        input_token_logprobs_idx: The prompt token ids those values belong to.
        output_token_logprobs_val: Log probability of each new output token.
        output_token_logprobs_idx: The output token ids those values belong to.
        output_hidden_states: The request's last hidden state, when it asked for it.
        step: The engine step that produced the batch (batch-wide).
        errors: Why a request failed at the detokenizer (e.g. the cap on live states);
            ``None`` when no request of the batch failed, which is every healthy step.
        spec_verify_ct: Speculative-decoding verification passes run for the request.
        input_top_logprobs_val: Per prompt position, the top-k log probabilities.
        input_top_logprobs_idx: Per prompt position, the top-k token ids.
        output_top_logprobs_val: Per new output position, the top-k log probabilities.
        output_top_logprobs_idx: Per new output position, the top-k token ids.
        input_token_ids_logprobs_val: Log probabilities of the token ids the request named,
            over the prompt.
        input_token_ids_logprobs_idx: The token ids those values belong to.
        output_token_ids_logprobs_val: Log probabilities of the token ids the request named,
            over the new output.
        output_token_ids_logprobs_idx: The token ids those values belong to.

    Its requests' trace contexts travel in the tell's frame header, as for
    `BatchTokenIDOutput`.
    """

    shared_fields: ClassVar[tuple[str, ...]] = ("step",)

    rids: list[str]
    origins: list[Origin]
    finished_reasons: list[str | None]
    output_strs: list[str]
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    input_token_logprobs_val: list[list[float]] | None = None
    input_token_logprobs_idx: list[list[int]] | None = None
    output_token_logprobs_val: list[list[float]] | None = None
    output_token_logprobs_idx: list[list[int]] | None = None
    output_hidden_states: list[list[float]] | None = None
    step: int = 0
    errors: list[str | None] | None = None
    spec_verify_ct: list[int] | None = None
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None
    output_top_logprobs_val: list[list[list[float]]] | None = None
    output_top_logprobs_idx: list[list[list[int]]] | None = None
    input_token_ids_logprobs_val: list[list[float]] | None = None
    input_token_ids_logprobs_idx: list[list[int]] | None = None
    output_token_ids_logprobs_val: list[list[float]] | None = None
    output_token_ids_logprobs_idx: list[list[int]] | None = None


class BatchEmbeddingOutput(Batch, array_like=True):
    """Embeddings for finished embedding requests (kept for the contract; not generated by
    the stand-in engine)."""

    rids: list[str]
    origins: list[Origin]
    finished_reasons: list[str | None]
    embeddings: list[list[float]]
    prompt_tokens: list[int]
    cached_tokens: list[int]


class BatchMultimodalOutput(Batch, array_like=True):
    """Multimodal outputs (kept for the contract; not generated by the stand-in engine)."""

    rids: list[str]
    origins: list[Origin]
    finished_reasons: list[str | None]
    outputs: list[bytes]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]


# -- control requests whose replies go to the asking worker only ----------------------------


class GetLoad(Message):
    """Ask the scheduler how loaded it is; the reply goes to ``origin`` through the router."""

    origin: Origin
    request_id: int


class FlushCache(Message):
    """Ask the scheduler to flush its (stand-in) cache; the reply goes to ``origin``."""

    origin: Origin
    request_id: int


class LoadReply(Request[None]):
    """The scheduler's load, for the worker that asked."""

    origin: Origin
    request_id: int
    running: int
    waiting: int
    step: int


class FlushReply(Request[None]):
    """Whether the flush happened, for the worker that asked."""

    origin: Origin
    request_id: int
    success: bool


class AbortNotice(Request[None]):
    """The scheduler aborted or dropped requests of one worker on its own (refused on
    arrival, or dropped by an ``AbortAll``); the router passes it to that worker, which fails
    them to their callers.

    Attributes:
        origin: The worker incarnation the requests belong to.
        rids: The requests.
        reason: Why.
        lost_to: The member whose death caused it, if one did (callers may resubmit).
        invalid: The engine cannot take the requests as they are (`RequestOutput.invalid`).
    """

    origin: Origin
    rids: list[str]
    reason: str
    lost_to: Member | None = None
    invalid: str | None = None


# -- registration and routes ----------------------------------------------------------------


class Registered(Message):
    """The supervisor's acknowledgement: the worker may serve."""

    worker_id: int
    incarnation: int


class RegisterWorker(Request[Registered]):
    """A starting worker asks to be routed to; acknowledged once every router holds it."""

    worker_id: int
    incarnation: int
    address: ActorRef[WorkerMessage]


class RouteAck(Message):
    """A router's acknowledgement of a route update."""

    origin: Origin


class RouteUpdate(Request[RouteAck]):
    """Add (``ref`` set) or drop (``ref`` None) the route of one worker incarnation."""

    origin: Origin
    ref: ActorRef[WorkerMessage] | None


class WorkerDown(Message):
    """Told to callers: a worker incarnation died; the requests it held must be resolved.

    Attributes:
        origin: The dead worker incarnation.
        reason: The death's reason.
    """

    origin: Origin
    reason: str


class WorkerUp(Message):
    """Told to callers: a worker incarnation is registered and serves."""

    worker_id: int
    ref: ActorRef[WorkerMessage]


class MemberStuck(Message):
    """Told to the supervisor: a worker incarnation has not taken its output for too long;
    it is killed, so that stuck ends as dead does (its requests resolved, it restarted)."""

    origin: Origin
    reason: str


class EngineState(Message):
    """Told by the scheduler to its supervisor when its engine becomes ready to generate, or
    stops being ready (an engine that has not connected yet, or was lost).

    Attributes:
        scheduler: The scheduler it is about (a late word of a dead one is ignored).
        ready: Whether the engine takes requests now.
        context_length: The engine's bound on prompt plus generated ids of one request
            (0: none known).
    """

    scheduler: ActorRef[SchedulerMessage]
    ready: bool
    context_length: int = 0


class Topology(Message):
    """Told by the supervisor to every member: the live refs of the shared members (None
    while one restarts). Members address each other only through the latest topology.

    Attributes:
        scheduler: The scheduler.
        detokenizers: Each detokenizer, by index (a request keeps its index for life).
        router: The router.
        engine_ready: Whether the scheduler's engine takes requests now (``False`` too
            while no scheduler is up): what a worker's ``/health`` answers.
        engine_context_length: The engine's bound on prompt plus generated ids of one
            request (0: none known): a worker that is the engine's client itself refuses a
            prompt that leaves no room.
    """

    scheduler: ActorRef[SchedulerMessage] | None
    detokenizers: list[ActorRef[DetokenizerMessage] | None]
    router: ActorRef[RouterMessage] | None
    engine_ready: bool = False
    engine_context_length: int = 0


class CheckLoad(Message):
    """Ask a worker to ask the scheduler for its load; the ``LoadReply`` comes back to this
    worker through the router and is passed on to ``reply_to``."""

    reply_to: ActorRef[LoadReply]


class CheckFlush(Message):
    """Ask a worker to ask the scheduler to flush its cache; the ``FlushReply`` comes back to
    this worker through the router and is passed on to ``reply_to``."""

    reply_to: ActorRef[FlushReply]


# Each member's counters, and the request for them. Their tags keep the names the classes had
# before they were called *Statistics, as the runtime's are: the wire did not change.


class RouterStatistics(Message, tag="RouterStats"):
    """A router's counters."""

    forwarded: int
    dropped_unknown_origin: int
    routes: int


class GetRouterStatistics(Request[RouterStatistics], tag="GetRouterStats"):
    """Ask a router for its counters."""


# -- detokenizer statistics -----------------------------------------------------------------


class DetokenizerStatistics(Message, tag="DetokenizerStats"):
    """The detokenizer's counters since it started.

    Attributes:
        batches: ``BatchTokenIDOutput`` messages handled.
        requests: Per-request entries in them, whatever became of each.
        dropped_unknown_origin: Entries dropped because their origin had no route (an
            unknown or dead worker incarnation).
        live_states: Requests with a live incremental detokenizer state right now.
        stopped_by_string: Requests finished by a stop string found in their text.
        rejected_over_cap: Requests aborted because the cap on live states was reached.
        undeliverable: Sub-batches that could not be told to their worker (it died, or
            its mailbox stayed full).
        backlog: Sub-batches waiting right now for a worker whose mailbox is full.
    """

    batches: int
    requests: int
    dropped_unknown_origin: int
    live_states: int
    stopped_by_string: int
    rejected_over_cap: int
    undeliverable: int = 0
    backlog: int = 0


class GetDetokenizerStatistics(Request[DetokenizerStatistics], tag="GetDetokenizerStats"):
    """Ask the detokenizer for its counters; the reply is a `DetokenizerStatistics`."""


# -- scheduler statistics -------------------------------------------------------------------


class SchedulerStatistics(Message, tag="SchedulerStats"):
    """The scheduler's counters since it started.

    Every request received ends up in exactly one of ``finished``, ``aborted``,
    ``dropped_for_dead_origin``, ``dropped_for_abort_all``, ``rejected``, ``running`` or
    ``waiting``: they add up to ``received``.

    Attributes:
        received: ``TokenizedGenerate`` messages handled.
        finished: Requests finished by the engine (``"stop"`` or ``"length"``).
        aborted: Requests ended by an ``Abort`` of their rid (each reported once more).
        dropped_for_dead_origin: Requests dropped silently by an ``Abort`` of their origin.
        dropped_for_abort_all: Requests dropped silently by an ``AbortAll``.
        rejected: Requests refused on arrival (queue full, malformed, duplicate rid).
        steps: Engine steps run (one ``BatchTokenIDOutput`` each).
        running: Requests in the running batch right now.
        waiting: Requests waiting to be admitted right now.
        generated_tokens: Token ids generated, over all requests.
        engine_ready: Whether the engine takes requests now (one that has not connected
            yet does not).
        engine_context_length: The engine's bound on prompt plus generated ids of one
            request (0: none known).
    """

    received: int = 0
    finished: int = 0
    aborted: int = 0
    dropped_for_dead_origin: int = 0
    dropped_for_abort_all: int = 0
    rejected: int = 0
    steps: int = 0
    running: int = 0
    waiting: int = 0
    generated_tokens: int = 0
    engine_ready: bool = True
    engine_context_length: int = 0


class GetSchedulerStatistics(Request[SchedulerStatistics], tag="GetSchedulerStats"):
    """Ask the scheduler for its counters; the reply is a `SchedulerStatistics`."""


# -- tokenizer worker statistics ------------------------------------------------------------


class WorkerStatistics(Message, tag="WorkerStats"):
    """A tokenizer worker's counters since it started.

    Every request received ends up in exactly one of ``finished``, ``failed``, ``released``
    or ``requests``: they add up to ``received``.

    Attributes:
        origin: The worker incarnation that answers.
        received: ``Generate`` requests handled.
        finished: Requests answered with their last output.
        failed: Requests answered with an error (refused here or by the scheduler).
        released: Requests let go at their caller's word (``AbortRequest``): the caller
            gave up, or resolved them elsewhere after a pipeline member died.
        requests: Requests the worker holds right now: waiting for output, or their
            prompt for its tokenizing.
        control_pending: Control requests (load, flush) waiting for their reply right now.
        cut: Requests a drain ended at its deadline (an HTTP worker's; counted in
            ``failed`` too).
        engine_strays: Requests that vLLM's engine ran for this worker without its
            knowing them (an earlier incarnation's, whose outputs reached this one), aborted
            there (a worker that is the engine's client itself).
        engine_rejected: Frames on the worker's own socket from vLLM's engine that did not
            decode, or outputs it could not take (a worker that is the engine's client).
        tokenizing: Of ``requests``, those whose long prompt is being tokenized off the
            event loop right now (at most `actors.tokenizer_worker.MAX_TOKENIZING`).
    """

    origin: Origin
    received: int = 0
    finished: int = 0
    failed: int = 0
    released: int = 0
    requests: int = 0
    control_pending: int = 0
    cut: int = 0
    engine_strays: int = 0
    engine_rejected: int = 0
    tokenizing: int = 0


class GetWorkerStatistics(Request[WorkerStatistics], tag="GetWorkerStats"):
    """Ask a tokenizer worker for its counters; the reply is a `WorkerStatistics`."""


class Draining(Message):
    """A worker's answer to `Drain`: what it still serves as it begins to drain.

    Attributes:
        connections: HTTP connections open.
        requests: Requests in flight.
    """

    connections: int
    requests: int


class Drain(Request[Draining]):
    """Told to every serving worker on SIGTERM: take no new request on a connection, let
    the ones in flight finish, and end those still running after ``timeout`` seconds (a
    stream with an error event and ``data: [DONE]``, other answers with 503). A second
    `Drain` can only bring that moment forward. A worker that serves no HTTP answers at
    once.

    Attributes:
        timeout: Seconds from now until the requests still running are ended.
        reason: Why they are ended, as their answers say (empty: the server is shutting
            down and they did not finish within the drain timeout). A later `Drain` that
            brings the moment forward gives its own.
    """

    timeout: float
    reason: str = ""


# -- what each member accepts ---------------------------------------------------------------

CallerMessage = RequestOutputs | WorkerUp | WorkerDown | Down
"""What a caller's inbox accepts."""

WorkerMessage = (
    Generate
    | AbortRequest
    | BatchStrOutput
    | AbortNotice
    | CheckLoad
    | CheckFlush
    | LoadReply
    | FlushReply
    | Topology
    | GetWorkerStatistics
    | Drain
)
"""What a tokenizer worker accepts."""

SchedulerMessage = (
    TokenizedGenerate | Abort | AbortAll | Topology | GetLoad | FlushCache | GetSchedulerStatistics
)
"""What the scheduler accepts."""

DetokenizerMessage = (
    BatchTokenIDOutput | RouteUpdate | Topology | AbortAll | GetDetokenizerStatistics
)
"""What a detokenizer accepts."""

RouterMessage = RouteUpdate | LoadReply | FlushReply | AbortNotice | GetRouterStatistics
"""What the router accepts."""

PipelineSupervisorMessage = SupervisorMessage | RegisterWorker | MemberStuck | EngineState
"""What the pipeline supervisor accepts."""
