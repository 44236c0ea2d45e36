"""The scheduler: the pipeline's engine, behind the real engine's message contract.

What generates the ids is a generator (`actors.engines`: the stand-in's fake model, or a
real engine); the scheduler keeps the contract whatever it is:

- **Continuous batching.** ``TokenizedGenerate`` requests wait in a FIFO and are admitted
  while fewer than ``max_batch_size`` (and the generator's capacity) run. Each step takes
  what every running request produced and tells each detokenizer ONE ``BatchTokenIDOutput``
  for the step, holding the requests that stream through it (each request names its
  detokenizer); requests join and leave the running batch at every step.
- **Finishing.** ``"length"`` at ``max_new_tokens``; ``"stop"`` on a ``stop_token_ids`` id or
  on eos (unless ``ignore_eos``), the id included and nothing after it; or the generator's
  own end. Stop strings are the detokenizer's business: they only travel along.
- **Aborts, control and bounds.** ``Abort`` by rid reports the request once more with the
  abort's reason; ``Abort`` of an origin drops silently (that worker incarnation is dead:
  nobody is listening); ``AbortAll`` drops everything and reports it, per worker, so no
  request vanishes whoever sent it. Load and flush replies, and notices of requests
  refused on arrival (queue full, malformed) or dropped, go to the router, which passes
  them to the worker that owns them;
  they are delivered at least once (`actors.router.RouterLink`): a router that dies holding
  them, or before it got them, costs no caller its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

import anyio

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
from ._limits import context_refusal, sampling_refusal, vocabulary_refusal
from ._tokenizer import model_id_of
from .engines import EngineSpec, StandIn, open_generator
from .messages import (
    Abort,
    AbortAll,
    AbortNotice,
    BatchTokenIDOutput,
    DetokenizerMessage,
    EngineState,
    FlushCache,
    FlushReply,
    GetLoad,
    GetSchedulerStatistics,
    LoadReply,
    Origin,
    RouterMessage,
    SamplingParams,
    SchedulerMessage,
    SchedulerStatistics,
    TokenizedGenerate,
    Topology,
)
from .router import RouterLink

if TYPE_CHECKING:
    from collections.abc import Callable

    from .engines import Generator, Produced

__all__ = ("Scheduler",)

logger = logging.getLogger("tokenyard.scheduler")

_Key = tuple[Origin, str]


class _Request:
    """One request's progress in the engine."""

    __slots__ = (
        "abort_reason",
        "cached",
        "completion",
        "msg",
        "queued_at",
        "span",
        "stop_ids",
        "trace",
    )

    def __init__(
        self, msg: TokenizedGenerate, stop_ids: frozenset[int], parent: str | None
    ) -> None:
        self.msg = msg
        self.queued_at = time.monotonic()
        #: Its span here, when its worker traces it: the child of the context its tell
        #: came with (`actors._tracing`).
        self.span = _tracing.start_child("tokenyard.scheduler", parent, rid=msg.rid)
        #: What its entries' trace context is ("": untraced): its span's, or, with tracing
        #: off here, the one it came with, passed on untouched.
        self.trace = parent or "" if self.span is None else self.span.traceparent or ""
        self.stop_ids = stop_ids
        self.completion = 0  # ids generated, all of them sent
        self.cached = 0
        self.abort_reason = ""

    def end_span(self, reason: str) -> None:
        if self.span is not None:
            self.span.end(finish_reason=reason, completion_tokens=self.completion)


class _Share(NamedTuple):
    """One detokenizer's share of a step: the batch, and the trace contexts of its requests
    in its order (empty when none is traced), told in the frame header."""

    batch: BatchTokenIDOutput
    trace: tuple[str, ...]


class _Columns:
    """The per-request lists of one step's `BatchTokenIDOutput`, filled request by request."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.origins: list[Origin] = []
        self.reasons: list[str | None] = []
        self.ids: list[list[int]] = []
        self.offsets: list[int] = []
        self.skip_special: list[bool] = []
        self.no_stop_trim: list[bool] = []
        self.stop: list[tuple[str, ...]] = []
        self.prompt: list[int] = []
        self.completion: list[int] = []
        self.cached: list[int] = []
        #: Each request's trace context ("": untraced), made once a traced one is added.
        self.traces: list[str] | None = None

    def add(self, req: _Request, ids: list[int], reason: str | None) -> None:
        """Add ``req``'s entry: ``ids`` are new since its previous entry (counted already)."""
        msg, sampling = req.msg, req.msg.sampling
        self.rids.append(msg.rid)
        self.origins.append(msg.origin)
        self.reasons.append(reason)
        self.ids.append(ids)
        self.offsets.append(req.completion - len(ids))
        self.skip_special.append(sampling.skip_special_tokens)
        self.no_stop_trim.append(sampling.no_stop_trim)
        self.stop.append(sampling.stop)
        self.prompt.append(len(msg.input_ids))
        self.completion.append(req.completion)
        self.cached.append(req.cached)
        if req.trace and self.traces is None:
            self.traces = [""] * (len(self.rids) - 1)
        if self.traces is not None:
            self.traces.append(req.trace)

    def batch(self, step: int) -> _Share:
        """The step's message, and its requests' trace contexts."""
        batch = BatchTokenIDOutput(
            rids=self.rids,
            origins=self.origins,
            finished_reasons=self.reasons,
            decode_ids=self.ids,
            read_offsets=self.offsets,
            skip_special_tokens=self.skip_special,
            spaces_between_special_tokens=[True] * len(self.rids),
            no_stop_trim=self.no_stop_trim,
            stop=self.stop,
            prompt_tokens=self.prompt,
            completion_tokens=self.completion,
            cached_tokens=self.cached,
            step=step,
        )
        return _Share(batch, () if self.traces is None else tuple(self.traces))


class Scheduler(Actor[SchedulerMessage]):
    """The pipeline's engine: continuous batching over a generator (`actors.engines`).

    Handles `TokenizedGenerate`, `Abort`, `AbortAll`, `GetLoad` and `FlushCache` (tells) and
    `GetSchedulerStatistics` (ask, answered with `SchedulerStatistics`). Tells the detokenizer one
    `BatchTokenIDOutput` per step, and the router `LoadReply`, `FlushReply` and
    `AbortNotice`, for the worker named by their origin.

    A request ends in exactly one way: finished (``"stop"``/``"length"``, in a batch),
    aborted by rid (reported once more in the next batch, finish reason the abort's
    ``reason``, no new ids, waiting or running alike), dropped silently with its (dead)
    origin, dropped by ``AbortAll`` and reported in an `AbortNotice` to its worker, or
    refused on arrival with an `AbortNotice` (queue full, a rid its origin already has
    scheduled, a prompt id outside the vocabulary).

    A step whose batch a detokenizer cannot take is held, and steps pause, until it is
    taken: tried again every ``retry_after`` seconds while that detokenizer lives (so a
    stalled one that resumes is served again within that), and sent to its successor as
    soon as a `Topology` names one.
    What goes to the router waits in order until the router confirms it (`RouterLink`):
    after the router's death it goes to the successor a `Topology` names.

    Args:
        detokenizers: Where each step's batches go, by the index a request names.
        router: Where control replies and abort notices go.
        engine: What generates (`actors.engines`); the stand-in by default.
        tokenizer: Path of a ``tokenizer.json`` (or a directory holding one), ``None`` for
            the bundled default: the stand-in's vocabulary and eos.
        max_batch_size: Most requests running at once; the rest wait, first in first out.
        max_waiting: Most requests waiting; one more is refused.
        retry_after: Seconds a held step waits before it is offered again.
        model_name: The ``model_name`` label of its metrics (``None``: from the tokenizer).
        supervisor: Told when the engine becomes ready to generate or stops being ready
            (`EngineState`); ``None``: nobody is.

    Raises:
        ValueError: A setting is out of range; the message names it.
    """

    def __init__(
        self,
        detokenizers: list[ActorRef[DetokenizerMessage]],
        router: ActorRef[RouterMessage],
        *,
        engine: EngineSpec | None = None,
        tokenizer: str | None = None,
        max_batch_size: int = 256,
        max_waiting: int = 100_000,
        retry_after: float = 0.5,
        model_name: str | None = None,
        supervisor: ActorRef[EngineState] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        if retry_after <= 0:
            raise ValueError(f"retry_after must be positive, got {retry_after}")
        if not detokenizers:
            raise ValueError("detokenizers is empty: a scheduler needs at least one")
        self._detokenizers: list[ActorRef[DetokenizerMessage] | None] = list(detokenizers)
        self._retry_after = retry_after
        #: The step's batches not yet taken, by detokenizer; steps pause until all are.
        self._held: dict[int, _Share] = {}
        #: Set when a Topology names another detokenizer, or AbortAll drops the held step.
        self._retarget = anyio.Event()
        self._holding = Throttle(logger)
        self._router = RouterLink(router)
        self._engine = StandIn() if engine is None else engine
        self._tokenizer_path = tokenizer
        self._max_batch_size = max_batch_size
        self._max_waiting = max_waiting
        #: What generates; ``None`` until on_start opens it (every prompt is refused then).
        self._generator: Generator[_Key] | None = None
        self._supervisor = supervisor
        #: Whether the engine took requests when the supervisor was last told.
        self._told_ready = False
        self._waiting: OrderedDict[_Key, _Request] = OrderedDict()
        self._running: dict[_Key, _Request] = {}
        # Requests aborted by rid, to report once in the next batch.
        self._reports: list[_Request] = []
        # Requests that asked for no tokens: they end in the next batch, never generated.
        self._empty: list[_Request] = []
        # Set when work or output arrives; the loop waits on it instead of polling.
        self._wake = anyio.Event()
        self._received = 0
        self._finished = 0
        self._aborted = 0
        self._dropped_for_dead_origin = 0
        self._dropped_for_abort_all = 0
        self._rejected = 0
        self._steps = 0
        self._generated = 0
        model = model_name or model_id_of(tokenizer)
        self._queue_time = _metrics.QUEUE_TIME.labels(model)
        # Read when the metrics are gathered: nothing is spent on them between gatherings.
        _metrics.NUM_REQUESTS_RUNNING.labels(model).set_function(lambda: len(self._running))
        _metrics.NUM_REQUESTS_WAITING.labels(model).set_function(lambda: len(self._waiting))

    async def on_start(self) -> None:
        """Open the generator and start the step loop.

        Opened on the event loop: in its own process the scheduler has nothing else to do
        until it is ready.
        """
        loop = asyncio.get_running_loop()

        def notify() -> None:  # from the generator's threads too
            loop.call_soon_threadsafe(self._poke)

        self._generator = await open_generator(self._engine, self._tokenizer_path, notify)
        self._told_ready = self.engine_ready
        self.start_soon(self._run)
        self.start_soon(self._router.run)

    async def on_stop(self) -> None:
        if self._generator is not None:
            await self._generator.aclose()

    def _poke(self) -> None:
        self._wake.set()

    @property
    def engine_ready(self) -> bool:
        """Whether the engine takes requests now (its capacity is not 0)."""
        return self._generator is not None and self._generator.capacity != 0

    @property
    def engine_context_length(self) -> int:
        """The engine's bound on prompt plus generated ids (0: none, or not known yet)."""
        return (self._generator.context_length if self._generator is not None else None) or 0

    async def _tell_engine_state(self) -> None:
        """Tell the supervisor when the engine's readiness changed since it was last told
        (it asks for the state at the start: `SchedulerStatistics.engine_ready`)."""
        ready = self.engine_ready
        if ready == self._told_ready:
            return
        self._told_ready = ready
        logger.info("scheduler: the engine is %s", "ready" if ready else "not ready")
        if self._supervisor is not None:
            with contextlib.suppress(TokenyardError):  # a dead supervisor: ours dies too
                await self._supervisor.tell(
                    EngineState(
                        scheduler=self.ref,
                        ready=ready,
                        context_length=self.engine_context_length,
                    )
                )

    # -- handlers -------------------------------------------------------------------------

    @handler
    def enqueue(self, msg: TokenizedGenerate) -> None:
        """Queue a request, or refuse it with an `AbortNotice` to the router."""
        self._received += 1
        key = (msg.origin, msg.rid)
        refusal = self._refusal(msg, key)
        if refusal is not None:
            self._refuse(msg, *refusal)
            return
        trace = current_trace()
        parent = trace[0] if trace else None
        self._waiting[key] = _Request(msg, self._stop_ids(msg.sampling), parent)
        self._wake.set()

    @handler
    def abort(self, msg: Abort) -> None:
        """Abort one request (reported once more) or every request of an origin (silently)."""
        if msg.rid is None:
            self._drop_origin(msg.origin)
            return
        key = (msg.origin, msg.rid)
        req = self._waiting.pop(key, None) or self._end(key)
        if req is None:
            return  # finished already (its last output is on its way), or never seen
        req.abort_reason = msg.reason
        self._reports.append(req)
        self._aborted += 1
        self._wake.set()

    @handler
    def topology(self, msg: Topology) -> None:
        """Follow a restarted detokenizer or router (the supervisor publishes their refs)."""
        if msg.detokenizers != self._detokenizers:
            self._detokenizers = list(msg.detokenizers)
            self._retarget.set()
        if msg.router is not None:
            self._router.retarget(msg.router)

    @handler
    def abort_all(self, msg: AbortAll) -> None:
        """Drop every request (the detokenizer they streamed to is gone, say) and report
        them, per worker, so that each caller hears of its request."""
        which = msg.detokenizer

        def hit(req: _Request) -> bool:
            return which is None or req.msg.detokenizer == which

        dropped: dict[Origin, list[str]] = {}
        keys = self._drop(hit)
        self._dropped_for_abort_all += len(keys)
        for key in keys:
            dropped.setdefault(key[0], []).append(key[1])
        for req in self._drop_reports(hit):
            dropped.setdefault(req.msg.origin, []).append(req.msg.rid)
        for index in [j for j in self._held if which is None or j == which]:
            held = self._held.pop(index).batch
            for origin, rid, reason in zip(
                held.origins, held.rids, held.finished_reasons, strict=True
            ):
                if reason is not None:  # finished in the held step: its end is lost too
                    dropped.setdefault(origin, []).append(rid)
        self._retarget.set()
        for origin, rids in dropped.items():
            self._router.put(
                AbortNotice(origin=origin, rids=rids, reason=msg.reason, lost_to=msg.lost_to)
            )
        self._wake.set()

    @handler
    def get_load(self, msg: GetLoad) -> None:
        """Tell the router the load, for the worker that asked."""
        reply = LoadReply(
            origin=msg.origin,
            request_id=msg.request_id,
            running=len(self._running),
            waiting=len(self._waiting),
            step=self._steps,
        )
        self._router.put(reply)

    @handler
    def flush_cache(self, msg: FlushCache) -> None:
        """Forget the cached prefixes if nothing is running; tell the router whether it did."""
        success = not self._running and self._generator is not None and self._generator.flush()
        reply = FlushReply(origin=msg.origin, request_id=msg.request_id, success=success)
        self._router.put(reply)

    @handler
    def statistics(self, msg: GetSchedulerStatistics) -> SchedulerStatistics:
        """Reply with the counters."""
        return SchedulerStatistics(
            received=self._received,
            finished=self._finished,
            aborted=self._aborted,
            dropped_for_dead_origin=self._dropped_for_dead_origin,
            dropped_for_abort_all=self._dropped_for_abort_all,
            rejected=self._rejected,
            steps=self._steps,
            running=len(self._running),
            waiting=len(self._waiting),
            generated_tokens=self._generated,
            engine_ready=self.engine_ready,
            engine_context_length=self.engine_context_length,
        )

    # -- requests -------------------------------------------------------------------------

    def _refusal(self, msg: TokenizedGenerate, key: _Key) -> tuple[str, str | None] | None:
        """Why ``msg`` cannot be queued, and whether it never can (`AbortNotice.invalid`),
        or ``None``."""
        if len(self._waiting) >= self._max_waiting:
            return f"scheduler queue full (max_waiting={self._max_waiting})", None
        if not 0 <= msg.detokenizer < len(self._detokenizers):
            return (
                f"detokenizer {msg.detokenizer} does not exist (there are "
                f"{len(self._detokenizers)})"
            ), None
        if key in self._waiting or key in self._running:
            return (
                f"duplicate rid {msg.rid!r}: {msg.origin} already has a request with that rid "
                "at the scheduler; give each request of a worker its own rid"
            ), None
        size = 0 if self._generator is None else self._generator.vocab_size
        refusal = vocabulary_refusal(msg.input_ids, size)
        if refusal is not None:
            return refusal, None if self._generator is None else "invalid_value"
        refusal = sampling_refusal(msg.sampling)
        return None if refusal is None else (refusal, "invalid_value")

    def _refuse(self, msg: TokenizedGenerate, refusal: str, invalid: str | None = None) -> None:
        """Refuse a request: its worker fails it with ``refusal`` (an `AbortNotice`;
        ``invalid``: the engine can never take it as it is)."""
        self._rejected += 1
        logger.debug("refused %r of %s: %s", msg.rid, msg.origin, refusal)
        self._router.put(
            AbortNotice(origin=msg.origin, rids=[msg.rid], reason=refusal, invalid=invalid)
        )

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        eos = None if self._generator is None else self._generator.eos
        if eos is None or sampling.ignore_eos:
            return frozenset(sampling.stop_token_ids)
        return frozenset((*sampling.stop_token_ids, eos))

    def _drop_origin(self, origin: Origin) -> None:
        """Drop every request of a dead worker incarnation: nobody would read their output."""
        self._dropped_for_dead_origin += len(self._drop(lambda req: req.msg.origin == origin))
        self._drop_reports(lambda req: req.msg.origin == origin)

    def _drop(self, hit: Callable[[_Request], bool]) -> list[_Key]:
        """Drop the waiting and running requests ``hit`` selects (their spans end); their
        keys."""
        gone = [key for key, req in self._waiting.items() if hit(req)]
        for key in gone:
            self._waiting.pop(key).end_span("abort")
        running = [key for key, req in self._running.items() if hit(req)]
        for key in running:
            req = self._end(key)
            assert req is not None
            req.end_span("abort")
        return gone + running

    def _end(self, key: _Key) -> _Request | None:
        """Take a running request out of the batch, and out of the generator."""
        req = self._running.pop(key, None)
        if req is not None and self._generator is not None:
            self._generator.cancel(key)
        return req

    def _drop_reports(self, hit: Callable[[_Request], bool]) -> list[_Request]:
        """Drop the aborts waiting for the next step's report that ``hit`` selects (their
        spans end here, as no report will end them); return them."""
        dropped = [req for req in self._reports if hit(req)]
        for req in dropped:
            req.end_span(req.abort_reason)
        self._reports = [req for req in self._reports if not hit(req)]
        return dropped

    # -- the engine -----------------------------------------------------------------------

    async def _run(self) -> None:
        """Run steps while the generator has output (or aborts wait to be reported); wait
        for work or output otherwise."""
        generator = self._generator
        assert generator is not None
        while True:
            await self._tell_engine_state()
            self._admit(generator)
            if self._held or not (self._reports or self._empty or generator.ready()):
                self._wake = anyio.Event()
                await self._wake.wait()
                continue  # the work may have been dropped again before this task resumed
            self._held = self._step(generator.take())
            await self._deliver()
            # New requests and aborts are handled here, between steps.
            await anyio.sleep(generator.pace)

    async def _deliver(self) -> None:
        """Tell the held step to the detokenizer, waiting while it cannot take it.

        A full mailbox (the detokenizer is busy, or stalled) is tried again every
        ``retry_after`` seconds; a dead detokenizer waits for the `Topology` that names its
        successor. Its supervisor, meanwhile, tells this scheduler to drop what it had
        streamed (`AbortAll`, which ends the wait): nothing runs, so no output goes nowhere.
        """
        while self._held:
            self._retarget = anyio.Event()
            waiting_for_successor = False
            for index, share in list(self._held.items()):
                batch, trace = share
                detokenizer = self._detokenizers[index] if index < len(self._detokenizers) else None
                try:
                    if detokenizer is None:
                        raise ActorDeadError(f"detokenizer {index} is restarting")
                    if not detokenizer.try_tell(batch, trace=trace):
                        await detokenizer.tell(batch, timeout=self._retry_after, trace=trace)
                except ActorDeadError as err:
                    waiting_for_successor = True
                    self._holding.warning(
                        "step %d held: detokenizer %d died: %s", batch.step, index, err
                    )
                    continue
                except TokenyardError as err:
                    self._holding.warning(
                        "step %d held: detokenizer %d does not take it: %s", batch.step, index, err
                    )
                    continue
                if self._held.get(index) is share:
                    del self._held[index]
            if not self._held:
                return
            if waiting_for_successor:
                await self._retarget.wait()
            else:
                with anyio.move_on_after(self._retry_after):
                    await self._retarget.wait()

    def _admit(self, generator: Generator[_Key]) -> None:
        """Move waiting requests into the batch while it has room; one that asks for no
        tokens at all finishes at once (``"length"``), never reaching the generator, and
        one whose prompt leaves no room in the generator's context is refused (an engine
        says how long its context is once it is connected, which may be after the request
        arrived)."""
        capacity = generator.capacity  # 0: none for now (an engine not connected yet)
        room = self._max_batch_size if capacity is None else min(self._max_batch_size, capacity)
        context_length = generator.context_length
        now = time.monotonic()
        while self._waiting and len(self._running) < room:
            key, req = self._waiting.popitem(last=False)
            self._queue_time.observe(now - req.queued_at)
            msg = req.msg
            if msg.sampling.max_new_tokens == 0:
                self._empty.append(req)
            elif refusal := context_refusal(len(msg.input_ids), context_length):
                req.end_span("abort")
                self._refuse(msg, refusal, "context_length_exceeded")
            else:
                self._running[key] = req
                req.cached = generator.admit(key, msg.input_ids, msg.sampling)

    def _step(self, produced: dict[_Key, Produced]) -> dict[int, _Share]:
        """Build one step's batches from what the running requests produced, one per
        detokenizer that has a request in it; end the requests that finished.

        Runs without awaiting: the handlers see the state before or after a step, never
        in between.
        """
        self._steps += 1
        columns: dict[int, _Columns] = {}

        def out_for(req: _Request) -> _Columns:
            index = req.msg.detokenizer
            found = columns.get(index)
            if found is None:
                found = columns[index] = _Columns()
            return found

        for req in self._reports:
            out_for(req).add(req, [], req.abort_reason)
            req.end_span(req.abort_reason)
        self._reports.clear()
        for req in self._empty:
            out_for(req).add(req, [], "length")
            req.end_span("finished")
        self._finished += len(self._empty)
        self._empty.clear()
        done: list[_Key] = []
        generated = 0
        for key, (ids, finished) in produced.items():
            running = self._running.get(key)
            if running is None:
                continue  # aborted or dropped since it produced
            ids, reason = self._finish(running, ids, finished)
            running.completion += len(ids)
            generated += len(ids)
            out_for(running).add(running, ids, reason)
            if reason is not None:
                done.append(key)
        for key in done:
            ended = self._end(key)
            assert ended is not None
            ended.end_span("finished")
        self._finished += len(done)
        self._generated += generated
        return {index: out.batch(self._steps) for index, out in columns.items()}

    @staticmethod
    def _finish(
        req: _Request, ids: list[int], finished: str | None
    ) -> tuple[list[int], str | None]:
        """``ids`` cut where the request ends, and why it ends (``None``: it goes on): at a
        stop id (kept), at ``max_new_tokens``, or where the generator ended it."""
        room = req.msg.sampling.max_new_tokens - req.completion
        for n, token in enumerate(ids[:room], 1):
            if token in req.stop_ids:
                return ids[:n], "stop"
        if len(ids) >= room:
            return ids[:room], "length"
        return ids, finished
