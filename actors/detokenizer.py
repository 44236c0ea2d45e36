"""The detokenizer actor: engine token ids in, one text sub-batch per worker out.

Every engine step the scheduler tells the detokenizer one `BatchTokenIDOutput` covering all
running requests of all workers. The detokenizer advances each request's incremental
detokenizer (`actors._detokenize`), builds ONE `BatchStrOutput` for the step, splits it by
origin with the generic `runtime.Batch.group` and tells each worker its own sub-batch: one
message per worker per step, whatever the number of requests (the data flow is drawn on
the design page, docs/design.md).

Routes come from the pipeline supervisor as `RouteUpdate` asks; output for an origin with no
route (unknown, or an incarnation that died) is dropped and counted, never queued.

A worker whose mailbox is full never holds up the others: its sub-batches wait in a bounded
backlog of their own, delivered in order as it takes them. A worker that takes nothing for
``deliver_timeout`` seconds, or whose backlog fills, is reported stuck to the supervisor,
which kills it: its requests are then resolved as a dead worker's are, and its waiting
output is dropped.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from runtime import (
    Actor,
    ActorRef,
    MailboxFullError,
    Throttle,
    TokenyardError,
    current_trace,
    handler,
)

from . import _metrics, _tracing
from ._detokenize import DetokenizerStates, TooManyRequestsError
from ._routes import Routes
from ._tokenizer import load_tokenizer, model_id_of
from .messages import (
    Abort,
    AbortAll,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerMessage,
    DetokenizerStatistics,
    GetDetokenizerStatistics,
    MemberStuck,
    Origin,
    PipelineSupervisorMessage,
    RouteAck,
    RouteUpdate,
    SchedulerMessage,
    Topology,
)

if TYPE_CHECKING:
    from ._detokenize import IncrementalDetokenizer

__all__ = ("Detokenizer",)

logger = logging.getLogger("tokenyard.detokenizer")

# Per-request fields that pass from the engine's batch to the text batch unchanged, found by
# name so a field added to both batch types is carried with no edit here. The rest of
# BatchStrOutput (text, ids, finish reasons, errors) is what the detokenizer computes.
_COMPUTED = frozenset({"finished_reasons", "output_strs", "output_ids", "errors"})
_CARRIED = tuple(
    field.name
    for field in msgspec.structs.fields(BatchStrOutput)
    if field.name not in _COMPUTED
    and field.name in {f.name for f in msgspec.structs.fields(BatchTokenIDOutput)}
)

STOP = "stop"
ABORT = "abort"


@dataclass(eq=False)
class _Backlog:
    """Sub-batches waiting for one worker whose mailbox was full, oldest first."""

    since: float
    #: Each sub-batch with its requests' trace contexts (the tell's header).
    queue: deque[tuple[BatchStrOutput, tuple[str, ...]]] = field(default_factory=deque)


class Detokenizer(Actor[DetokenizerMessage]):
    """Turns each engine step's token ids into text and sends each worker its own part.

    Handles `RouteUpdate` (ask; answered with `RouteAck` once the route table changed),
    `BatchTokenIDOutput` (tell, from the scheduler), `Topology` (tell, from the pipeline
    supervisor: the scheduler's live ref), `AbortAll` (tell, from the pipeline supervisor:
    the scheduler died) and `GetDetokenizerStatistics` (ask).

    A request's state lives from its first output until its last (a finish reason from the
    scheduler, or a stop string found by the detokenizer). A request ended here rather than
    by the scheduler (stop string, or rejected over the cap) is remembered, in a bounded
    record, so the output the scheduler still sends for it is dropped; the scheduler, when
    given, is told to ``Abort`` it so it stops generating.

    Adding a route for incarnation ``n`` of worker ``k`` drops the routes of ``k``'s older
    incarnations, and their states: a worker index has one live incarnation at a time.

    When the scheduler dies, every live state belongs to a request it took with it: they
    are all dropped on its `AbortAll`, and once more when a `Topology` names its successor
    (output the dead scheduler sent just before it died may be read after the `AbortAll`).
    Otherwise they would hold their places under the cap for ever.

    Args:
        tokenizer: Path of a ``tokenizer.json`` (or a directory holding one); ``None`` is
            the bundled default. Loaded in `on_start`, in the actor's own process.
        max_states: Cap on live detokenizer states; a request beyond it is aborted with an
            error in ``BatchStrOutput.errors``.
        scheduler: Where to send ``Abort(origin, rid, reason)`` for requests the
            detokenizer ended itself; ``None`` relies on the record alone. Replaced by
            each `Topology`.
        max_ended: How many requests ended here are remembered (oldest forgotten first).
        supervisor: Told of a worker that takes no output (`MemberStuck`); ``None``: such
            output is only dropped and counted.
        deliver_timeout: Seconds a worker may take none of its waiting output before it is
            reported stuck.
        max_backlog: Most sub-batches waiting for one worker before it is reported stuck.
        model_name: The ``model_name`` label of its metrics (``None``: from the tokenizer).

    Raises:
        ValueError: A bound is not positive.
    """

    def __init__(
        self,
        *,
        tokenizer: str | None = None,
        max_states: int = 65536,
        scheduler: ActorRef[SchedulerMessage] | None = None,
        max_ended: int = 65536,
        supervisor: ActorRef[PipelineSupervisorMessage] | None = None,
        deliver_timeout: float = 10.0,
        max_backlog: int = 1024,
        model_name: str | None = None,
    ) -> None:
        for name, value in (
            ("max_states", max_states),
            ("max_ended", max_ended),
            ("max_backlog", max_backlog),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if deliver_timeout <= 0:
            raise ValueError(f"deliver_timeout must be positive, got {deliver_timeout}")
        self._supervisor = supervisor
        self._deliver_timeout = deliver_timeout
        self._max_backlog = max_backlog
        self._backlogs: dict[Origin, _Backlog] = {}
        #: Workers reported stuck: their output is dropped until their route goes.
        self._stuck: set[Origin] = set()
        self._dropping = Throttle(logger)
        self._rejecting = Throttle(logger)
        self._aborting = Throttle(logger)
        self._dropping_states = Throttle(logger)
        self._tokenizer_path = tokenizer
        self._max_states = max_states
        self._scheduler = scheduler
        #: The last scheduler a Topology named: states outlive none of its successors.
        self._last_scheduler = scheduler
        self._max_ended = max_ended
        self._states: DetokenizerStates[Origin] | None = None
        self._routes = Routes()
        # (origin, rid) of requests ended here whose last scheduler output has not arrived;
        # a dict keeps insertion order, so the oldest is evicted first.
        self._ended: dict[tuple[Origin, str], None] = {}
        self._batches = 0
        self._requests = 0
        self._dropped_unknown_origin = 0
        self._stopped_by_string = 0
        self._rejected_over_cap = 0
        self._undeliverable = 0
        self._model = model_name or model_id_of(tokenizer)
        #: The spans of traced requests with a live state (`actors._tracing`).
        self._spans: dict[tuple[Origin, str], _tracing.Span] = {}

    async def on_start(self) -> None:
        """Load the tokenizer.

        Loaded on the event loop: in the actor's own process nothing else waits for it, and
        a worker thread would outlive the load by anyio's idle timeout.
        """
        tokenizer = load_tokenizer(self._tokenizer_path)
        self._states = DetokenizerStates(tokenizer, max_states=self._max_states)
        live = _metrics.DETOKENIZER_LIVE_STATES.labels(self._model, self.ref.name)
        live.set_function(lambda: len(self.states))

    @property
    def states(self) -> DetokenizerStates[Origin]:
        """The live per-request states.

        Raises:
            RuntimeError: The actor has not started (the tokenizer is not loaded).
        """
        if self._states is None:
            raise RuntimeError("the detokenizer has not started: its tokenizer is not loaded")
        return self._states

    @handler
    def route(self, msg: RouteUpdate) -> RouteAck:
        """Add or drop a worker incarnation's route; reply once the table has changed."""
        for gone in self._routes.update(msg.origin, msg.ref):
            self._drop_states(gone)
        return RouteAck(origin=msg.origin)

    def _end_spans(self, origin: Origin | None) -> None:
        for key in [k for k in self._spans if origin is None or k[0] == origin]:
            self._spans.pop(key).end(finish_reason=ABORT)

    def _drop_states(self, origin: Origin) -> None:
        self._end_spans(origin)
        dropped = self.states.drop_origin(origin)
        self._stuck.discard(origin)
        backlog = self._backlogs.pop(origin, None)
        if backlog is not None:
            self._undeliverable += len(backlog.queue)
            backlog.queue.clear()
        if dropped:
            self._dropping_states.log(
                logging.INFO, "dropped %d detokenizer states of %s", len(dropped), origin
            )

    @handler
    async def detokenize(self, msg: BatchTokenIDOutput) -> None:
        """Detokenize one engine step and tell each worker its own sub-batch."""
        self._batches += 1
        self._requests += len(msg.rids)
        kept, pieces, reasons, errors, aborts, traces = self._detokenize(msg)
        if kept:
            await self._send(msg, kept, pieces, reasons, errors, traces)
        # After the output: the workers' latency matters more than a step of wasted work.
        if aborts and self._scheduler is not None:
            await self._abort(self._scheduler, aborts)

    async def _send(
        self,
        msg: BatchTokenIDOutput,
        kept: list[int],
        pieces: list[str],
        reasons: list[str | None],
        errors: list[str | None],
        traces: list[str] | None,
    ) -> None:
        """Build the step's one text batch and tell each worker its own sub-batch (with its
        requests' trace contexts, when the step has a traced one)."""
        part = msg if len(kept) == len(msg.rids) else msg.select(kept)
        out = BatchStrOutput(
            finished_reasons=reasons,
            output_strs=pieces,
            output_ids=part.decode_ids,
            errors=errors if any(e is not None for e in errors) else None,
            **{name: getattr(part, name) for name in _CARRIED},
        )
        by_origin: dict[Origin, list[str]] = {}
        if traces is not None:
            for origin, trace in zip(out.origins, traces, strict=True):
                by_origin.setdefault(origin, []).append(trace)
        for origin, sub in out.group(out.origins).items():
            await self._deliver(origin, sub, tuple(by_origin.get(origin, ())))

    def _detokenize(
        self, msg: BatchTokenIDOutput
    ) -> tuple[
        list[int],
        list[str],
        list[str | None],
        list[str | None],
        list[Abort],
        list[str] | None,
    ]:
        """Advance every routed request's state.

        Returns:
            The indices of the entries to send, and for each its text piece, finish reason
            and error; the aborts to send to the scheduler; and each sent entry's trace
            context (``None`` when the step came with none: `runtime.current_trace`, one
            per entry; a count that does not match the entries is ignored).
        """
        states = self.states
        routes = self._routes
        ended = self._ended
        kept: list[int] = []
        pieces: list[str] = []
        reasons: list[str | None] = []
        errors: list[str | None] = []
        aborts: list[Abort] = []
        incoming = current_trace()
        if len(incoming) != len(msg.rids):
            incoming = ()
        traces: list[str] | None = [] if incoming else None
        for i, (origin, rid, reason) in enumerate(
            zip(msg.origins, msg.rids, msg.finished_reasons, strict=True)
        ):
            if origin not in routes:
                self._dropped_unknown_origin += 1
                continue
            key = (origin, rid)
            if key in ended:
                # Ended here already; the scheduler's final output closes the record.
                if reason is not None:
                    del ended[key]
                continue
            finished = reason is not None
            state = states.get(origin, rid)
            error: str | None = None
            if state is None:
                state, error = self._create(msg, i, origin, rid)
            if state is None:
                piece, reason = "", ABORT
                if not finished:
                    self._end(key)
                    aborts.append(Abort(origin=origin, rid=rid, reason=ABORT))
            else:
                piece = state.push(msg.decode_ids[i], finished=finished)
                if state.stopped:
                    self._stopped_by_string += 1
                    if not finished:
                        self._end(key)
                        aborts.append(Abort(origin=origin, rid=rid, reason=STOP))
                    reason = STOP
                if reason is not None:
                    states.pop(origin, rid)
            kept.append(i)
            pieces.append(piece)
            reasons.append(reason)
            errors.append(error)
            if traces is not None:
                traces.append(self._trace(key, incoming[i], reason))
            elif reason is not None and key in self._spans:
                # Its last step came without a usable context: its span ends all the same.
                self._spans.pop(key).end(finish_reason=reason)
        return kept, pieces, reasons, errors, aborts, traces

    def _trace(self, key: tuple[Origin, str], parent: str, reason: str | None) -> str:
        """The request's trace context here ("": untraced): its span, from its first output
        to its last."""
        span = self._spans.get(key)
        if span is None:
            span = _tracing.start_child("tokenyard.detokenizer", parent, rid=key[1])
            if span is None:
                return parent
            self._spans[key] = span
        if reason is not None:
            del self._spans[key]
            span.end(finish_reason=reason)
        return span.traceparent or ""

    def _create(
        self, msg: BatchTokenIDOutput, i: int, origin: Origin, rid: str
    ) -> tuple[IncrementalDetokenizer | None, str | None]:
        """Create the state of entry ``i``; on failure return the error text instead."""
        try:
            state = self.states.create(
                origin,
                rid,
                stop=msg.stop[i],
                no_stop_trim=msg.no_stop_trim[i],
                skip_special_tokens=msg.skip_special_tokens[i],
            )
        except TooManyRequestsError as err:
            self._rejected_over_cap += 1
            self._rejecting.warning("request %r from %s rejected: %s", rid, origin, err)
            return None, str(err)
        except ValueError as err:  # an empty stop string: the request is malformed
            return None, f"request {rid!r} rejected by the detokenizer: {err}"
        return state, None

    def _end(self, key: tuple[Origin, str]) -> None:
        ended = self._ended
        ended[key] = None
        if len(ended) > self._max_ended:
            del ended[next(iter(ended))]

    async def _abort(self, scheduler: ActorRef[SchedulerMessage], aborts: list[Abort]) -> None:
        for abort in aborts:
            try:
                await scheduler.tell(abort)
            except TokenyardError as err:
                # The record still drops its output; a dead scheduler is its supervisor's.
                self._aborting.warning("could not tell the scheduler %r: %s", abort, err)
                return

    async def _deliver(self, origin: Origin, sub: BatchStrOutput, trace: tuple[str, ...]) -> None:
        """Tell ``origin`` its sub-batch now, or queue it behind what already waits."""
        ref = self._routes.get(origin)
        if ref is None or origin in self._stuck:
            self._undeliverable += 1
            return
        backlog = self._backlogs.get(origin)
        if backlog is None:
            try:
                if ref.try_tell(sub, trace=trace):
                    return
            except TokenyardError as err:
                # A dead worker: its supervisor drops the route and resolves its requests.
                self._undeliverable += 1
                self._dropping.warning("output for %s dropped: %s", origin, err)
                return
            backlog = self._backlogs[origin] = _Backlog(time.monotonic())
            self.start_soon(self._drain, origin, ref, backlog)
        if len(backlog.queue) >= self._max_backlog:
            await self._report_stuck(
                origin, f"its output backlog reached max_backlog={self._max_backlog}"
            )
            return
        backlog.queue.append((sub, trace))

    async def _drain(
        self, origin: Origin, ref: ActorRef[BatchStrOutput], backlog: _Backlog
    ) -> None:
        """Deliver ``origin``'s backlog in order as it takes it (a task per full worker)."""
        try:
            while backlog.queue:
                sub, trace = backlog.queue[0]
                await ref.tell(sub, timeout=self._deliver_timeout, trace=trace)
                backlog.queue.popleft()
        except MailboxFullError:
            await self._report_stuck(
                origin, f"it took none of its output for {self._deliver_timeout:g} s"
            )
        except TokenyardError as err:
            self._dropping.warning("output for %s dropped: %s", origin, err)
        finally:
            if self._backlogs.get(origin) is backlog:
                del self._backlogs[origin]
            self._undeliverable += len(backlog.queue)
            backlog.queue.clear()

    async def _report_stuck(self, origin: Origin, why: str) -> None:
        """Drop ``origin``'s waiting output and have its supervisor kill it."""
        if origin in self._stuck:
            return
        self._stuck.add(origin)
        backlog = self._backlogs.pop(origin, None)
        if backlog is not None:
            self._undeliverable += len(backlog.queue)
            backlog.queue.clear()
        logger.warning("%s is stuck: %s", origin, why)
        if self._supervisor is not None:
            try:
                await self._supervisor.tell(MemberStuck(origin=origin, reason=why))
            except TokenyardError as err:
                logger.warning("could not report %s stuck: %s", origin, err)

    @handler
    def topology(self, msg: Topology) -> None:
        """Follow the scheduler's restarts: aborts go to its live incarnation (or nowhere)."""
        self._scheduler = msg.scheduler
        if msg.scheduler is None or msg.scheduler == self._last_scheduler:
            return
        if self._last_scheduler is not None:
            self._drop_all("its successor is up")
        self._last_scheduler = msg.scheduler

    @handler
    def abort_all(self, msg: AbortAll) -> None:
        """The scheduler died: no more output comes for any live state."""
        self._drop_all(f"the scheduler died: {msg.reason}")

    def _drop_all(self, why: str) -> None:
        self._end_spans(None)
        states = self.states
        dropped = sum(len(states.drop_origin(origin)) for origin in states.origins())
        self._ended.clear()
        if dropped:
            self._dropping_states.log(
                logging.INFO, "dropped %d detokenizer states: %s", dropped, why
            )

    @handler
    def statistics(self, msg: GetDetokenizerStatistics) -> DetokenizerStatistics:
        """Reply with the counters."""
        return DetokenizerStatistics(
            batches=self._batches,
            requests=self._requests,
            dropped_unknown_origin=self._dropped_unknown_origin,
            live_states=len(self.states),
            stopped_by_string=self._stopped_by_string,
            rejected_over_cap=self._rejected_over_cap,
            undeliverable=self._undeliverable,
            backlog=sum(len(b.queue) for b in self._backlogs.values()),
        )
