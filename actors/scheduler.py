"""The scheduler: a stand-in for the model engine, with the real engine's message contract.

- **Continuous batching.** ``TokenizedGenerate`` requests wait in a FIFO. Each step admits
  waiting requests up to ``max_batch_size`` running, generates one token for every running
  request and tells each detokenizer ONE ``BatchTokenIDOutput`` for the step, holding the
  requests that stream through it (each request names its detokenizer); requests join and
  leave the running batch at every step.
- **Deterministic tokens.** A request's ids are a seeded function of its prompt ids, its
  sampling seed (only when ``temperature > 0``) and the position, drawn from the tokenizer's
  ordinary (non-special) vocabulary and biased towards non-ASCII text, including characters
  spelled over several tokens, so the detokenizer's multi-byte handling is exercised. The
  seed is a BLAKE2 digest, never ``hash()`` (salted per process): a prompt gives the same
  ids on every run and in every process.
- **Finishing.** ``"length"`` at ``max_new_tokens``; ``"stop"`` on a ``stop_token_ids`` id
  or on eos, which the stand-in draws now and then after a few tokens (unless
  ``ignore_eos``). Stop strings are the detokenizer's business: they only travel along.
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

import hashlib
import logging
import random
import time
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

import anyio

from runtime import Actor, ActorDeadError, ActorRef, TokenyardError, current_trace, handler
from runtime._throttle import Throttle

from . import _metrics, _tracing
from ._fake_model import MIN_TOKENS_BEFORE_EOS, SPLIT_SHARE, WIDE_SHARE, PrefixCache, Vocabulary
from ._tokenizer import load_tokenizer, model_id_of
from .messages import (
    Abort,
    AbortAll,
    AbortNotice,
    BatchTokenIDOutput,
    DetokenizerMessage,
    FlushCache,
    FlushReply,
    GetLoad,
    GetSchedulerStats,
    LoadReply,
    Origin,
    RouterMessage,
    SamplingParams,
    SchedulerMessage,
    SchedulerStats,
    TokenizedGenerate,
    Topology,
)
from .router import RouterLink

if TYPE_CHECKING:
    from collections.abc import Callable

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
        "pending",
        "queued_at",
        "rng",
        "span",
        "stop_ids",
        "trace",
    )

    def __init__(
        self,
        msg: TokenizedGenerate,
        rng: random.Random,
        stop_ids: frozenset[int],
        parent: str | None,
    ) -> None:
        self.msg = msg
        self.queued_at = time.monotonic()
        #: Its span here, when its worker traces it: the child of the context its tell
        #: came with (`actors._tracing`).
        self.span = _tracing.start_child("tokenyard.scheduler", parent, rid=msg.rid)
        #: What its entries' trace context is ("": untraced): its span's, or, with tracing
        #: off here, the one it came with, passed on untouched.
        self.trace = parent or "" if self.span is None else self.span.traceparent or ""
        self.rng = rng
        self.stop_ids = stop_ids
        self.completion = 0  # ids generated, all of them sent: one per step
        self.cached = 0
        self.pending: list[int] = []  # the rest of a character being spelled, reversed
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
    """The stand-in model engine: continuous batching of deterministic fake tokens.

    Handles `TokenizedGenerate`, `Abort`, `AbortAll`, `GetLoad` and `FlushCache` (tells) and
    `GetSchedulerStats` (ask, answered with `SchedulerStats`). Tells the detokenizer one
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
        tokenizer: Path of a ``tokenizer.json`` (or a directory holding one) giving the
            vocabulary and eos; ``None`` is the bundled default. Loaded in `on_start`.
        step_time: Seconds between two steps; with 0 the loop still yields once per step,
            so handlers run between steps.
        max_batch_size: Most requests running at once; the rest wait, first in first out.
        max_waiting: Most requests waiting; one more is refused.
        seed: Mixed into every request's draws (same seed, same outputs).
        eos_probability: Chance per token, after a few tokens, that eos is drawn (0: never).
        retry_after: Seconds a held step waits before it is offered again.
        model_name: The ``model_name`` label of its metrics (``None``: from the tokenizer).

    Raises:
        ValueError: A setting is out of range; the message names it.
    """

    def __init__(
        self,
        detokenizers: list[ActorRef[DetokenizerMessage]],
        router: ActorRef[RouterMessage],
        *,
        tokenizer: str | None = None,
        step_time: float = 0.0,
        max_batch_size: int = 256,
        max_waiting: int = 100_000,
        seed: int = 0,
        eos_probability: float = 0.02,
        retry_after: float = 0.5,
        model_name: str | None = None,
    ) -> None:
        if step_time < 0:
            raise ValueError(f"step_time must be at least 0 seconds, got {step_time}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        if not 0 <= eos_probability <= 1:
            raise ValueError(f"eos_probability must be within [0, 1], got {eos_probability}")
        if retry_after <= 0:
            raise ValueError(f"retry_after must be positive, got {retry_after}")
        if not detokenizers:
            raise ValueError("detokenizers is empty: a scheduler needs at least one")
        self._detokenizers: list[ActorRef[DetokenizerMessage] | None] = list(detokenizers)
        self._undelivered = 0
        self._retry_after = retry_after
        #: The step's batches not yet taken, by detokenizer; steps pause until all are.
        self._held: dict[int, _Share] = {}
        #: Set when a Topology names another detokenizer, or AbortAll drops the held step.
        self._retarget = anyio.Event()
        self._holding = Throttle(logger)
        self._router = RouterLink(router)
        self._tokenizer_path = tokenizer
        self._step_time = step_time
        self._max_batch_size = max_batch_size
        self._max_waiting = max_waiting
        self._seed = seed
        self._eos_probability = eos_probability
        # Empty until on_start loads the tokenizer: refuses every prompt id meanwhile.
        self._vocab = Vocabulary(0, None, (), (), ())
        self._cache = PrefixCache()
        self._waiting: OrderedDict[_Key, _Request] = OrderedDict()
        self._running: dict[_Key, _Request] = {}
        # Requests aborted by rid, to report once in the next batch.
        self._reports: list[_Request] = []
        # Set when work arrives; the loop waits on it when idle instead of polling.
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
        """Load the tokenizer, sort its vocabulary, and start the step loop.

        Loaded on the event loop: in its own process the scheduler has nothing else to do
        until it is ready.
        """
        self._vocab = Vocabulary.from_tokenizer(load_tokenizer(self._tokenizer_path))
        vocab = self._vocab
        logger.debug(
            "vocabulary of %d ids: %d plain, %d non-ASCII, %d split characters, eos %s",
            vocab.size,
            len(vocab.plain),
            len(vocab.wide),
            len(vocab.split),
            vocab.eos,
        )
        self.start_soon(self._run)
        self.start_soon(self._router.run)

    # -- handlers -------------------------------------------------------------------------

    @handler
    def on_tokenized(self, msg: TokenizedGenerate) -> None:
        """Queue a request, or refuse it with an `AbortNotice` to the router."""
        self._received += 1
        key = (msg.origin, msg.rid)
        refusal = self._refusal(msg, key)
        if refusal is not None:
            self._rejected += 1
            logger.debug("refused %r of %s: %s", msg.rid, msg.origin, refusal)
            self._router.put(AbortNotice(origin=msg.origin, rids=[msg.rid], reason=refusal))
            return
        trace = current_trace()
        self._waiting[key] = _Request(
            msg, self._rng(msg), self._stop_ids(msg.sampling), trace[0] if trace else None
        )
        self._wake.set()

    @handler
    def on_abort(self, msg: Abort) -> None:
        """Abort one request (reported once more) or every request of an origin (silently)."""
        if msg.rid is None:
            self._drop_origin(msg.origin)
            return
        key = (msg.origin, msg.rid)
        req = self._waiting.pop(key, None) or self._running.pop(key, None)
        if req is None:
            return  # finished already (its last output is on its way), or never seen
        req.abort_reason = msg.reason
        self._reports.append(req)
        self._aborted += 1
        self._wake.set()

    @handler
    def on_topology(self, msg: Topology) -> None:
        """Follow a restarted detokenizer or router (the supervisor publishes their refs)."""
        if msg.detokenizers != self._detokenizers:
            self._detokenizers = list(msg.detokenizers)
            self._retarget.set()
        if msg.router is not None:
            self._router.retarget(msg.router)

    @handler
    def on_abort_all(self, msg: AbortAll) -> None:
        """Drop every request (the detokenizer they streamed to is gone, say) and report
        them, per worker, so that each caller hears of its request."""
        which = msg.detokenizer

        def hit(req: _Request) -> bool:
            return which is None or req.msg.detokenizer == which

        dropped: dict[Origin, list[str]] = {}
        for queue in (self._waiting, self._running):
            gone = [key for key, req in queue.items() if hit(req)]
            for key in gone:
                queue.pop(key).end_span("abort")
                dropped.setdefault(key[0], []).append(key[1])
            self._dropped_for_abort_all += len(gone)
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
    def on_get_load(self, msg: GetLoad) -> None:
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
    def on_flush_cache(self, msg: FlushCache) -> None:
        """Forget the cached prefixes if nothing is running; tell the router whether it did."""
        success = not self._running
        if success:
            self._cache.clear()
        reply = FlushReply(origin=msg.origin, request_id=msg.request_id, success=success)
        self._router.put(reply)

    @handler
    def on_get_stats(self, msg: GetSchedulerStats) -> SchedulerStats:
        """Reply with the counters."""
        return SchedulerStats(
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
        )

    # -- requests -------------------------------------------------------------------------

    def _refusal(self, msg: TokenizedGenerate, key: _Key) -> str | None:
        """Why ``msg`` cannot be queued, or ``None``."""
        if len(self._waiting) >= self._max_waiting:
            return f"scheduler queue full (max_waiting={self._max_waiting})"
        if not 0 <= msg.detokenizer < len(self._detokenizers):
            return (
                f"detokenizer {msg.detokenizer} does not exist (there are "
                f"{len(self._detokenizers)})"
            )
        if key in self._waiting or key in self._running:
            return (
                f"duplicate rid {msg.rid!r}: {msg.origin} already has a request with that rid "
                "at the scheduler; give each request of a worker its own rid"
            )
        size = self._vocab.size
        outside = [i for i in msg.input_ids if not 0 <= i < size]
        if outside:
            return (
                f"prompt id {outside[0]} is outside the scheduler's vocabulary (0..{size - 1}); "
                "tokenize with the tokenizer the scheduler was given"
            )
        return None

    def _rng(self, msg: TokenizedGenerate) -> random.Random:
        """The request's draws: a function of the prompt, and of its seed when sampling."""
        sampling = msg.sampling
        seed = sampling.seed if sampling.temperature > 0 else None
        digest = hashlib.blake2b(repr((self._seed, seed)).encode(), digest_size=16)
        digest.update(array("q", msg.input_ids).tobytes())
        return random.Random(int.from_bytes(digest.digest(), "little"))

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        eos = self._vocab.eos
        if eos is None or sampling.ignore_eos:
            return frozenset(sampling.stop_token_ids)
        return frozenset((*sampling.stop_token_ids, eos))

    def _drop_origin(self, origin: Origin) -> None:
        """Drop every request of a dead worker incarnation: nobody would read their output."""
        for queue in (self._waiting, self._running):
            keys = [key for key in queue if key[0] == origin]
            for key in keys:
                queue.pop(key).end_span("abort")
            self._dropped_for_dead_origin += len(keys)
        self._drop_reports(lambda req: req.msg.origin == origin)

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
        """Run steps while there is work; wait for work otherwise."""
        while True:
            idle = not (self._waiting or self._running or self._reports)
            if idle or self._held:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue  # the work may have been dropped again before this task resumed
            self._held = self._step()
            await self._deliver()
            # New requests and aborts are handled here, between steps.
            await anyio.sleep(self._step_time)

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
                    self._undelivered += 1
                    waiting_for_successor = True
                    self._holding.warning(
                        "step %d held: detokenizer %d died: %s", batch.step, index, err
                    )
                    continue
                except TokenyardError as err:
                    self._undelivered += 1
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

    def _step(self) -> dict[int, _Share]:
        """Admit, generate one token per running request, and build the step's batches,
        one per detokenizer that has a request in it.

        Runs without awaiting: the handlers see the state before or after a step, never
        in between.
        """
        if self._waiting and len(self._running) < self._max_batch_size:
            now = time.monotonic()
            while self._waiting and len(self._running) < self._max_batch_size:
                key, req = self._waiting.popitem(last=False)
                req.cached = self._cache.match(req.msg.input_ids)
                self._running[key] = req
                self._queue_time.observe(now - req.queued_at)
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
        done: list[_Key] = []
        generated = 0
        for key, req in self._running.items():
            max_new_tokens = req.msg.sampling.max_new_tokens
            if req.completion >= max_new_tokens:  # asked for no tokens at all
                out_for(req).add(req, [], "length")
                done.append(key)
                continue
            token = self._draw(req)
            req.completion += 1
            generated += 1
            reason: str | None = None
            if token in req.stop_ids:
                reason = "stop"
            elif req.completion >= max_new_tokens:
                reason = "length"
            out_for(req).add(req, [token], reason)
            if reason is not None:
                done.append(key)
        for key in done:
            self._running.pop(key).end_span("finished")
        self._finished += len(done)
        self._generated += generated
        return {index: out.batch(self._steps) for index, out in columns.items()}

    def _draw(self, req: _Request) -> int:
        """The request's next id: a function of its draws so far, so of its position."""
        rng = req.rng
        # One eos roll at every position, whatever follows: requests that differ only in
        # ignore_eos, stop_token_ids or max_new_tokens draw the same ids until they end.
        eos_roll = rng.random()
        if req.pending:
            return req.pending.pop()  # finish spelling the character; eos never splits one
        vocab = self._vocab
        pick = rng.random()
        if pick < WIDE_SHARE and vocab.wide:
            token = rng.choice(vocab.wide)
        elif pick < WIDE_SHARE + SPLIT_SHARE and vocab.split:
            token, *rest = rng.choice(vocab.split)
            req.pending = rest[::-1]
        else:
            token = rng.choice(vocab.plain)
        if (
            eos_roll < self._eos_probability
            and req.completion >= MIN_TOKENS_BEFORE_EOS
            and vocab.eos is not None
            and not req.msg.sampling.ignore_eos
        ):
            return vocab.eos
        return token
