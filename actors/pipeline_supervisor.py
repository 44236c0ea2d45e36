"""The pipeline's supervisor: starts every member, keeps the registry, publishes routes,
restarts the dead, kills the stuck, and makes sure no request waits on a dead member."""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec

from runtime import (
    ActorDeadError,
    ActorRef,
    ChildSpec,
    Down,
    GetMetrics,
    Supervisor,
    TokenyardError,
    handler,
)

from . import _metrics
from ._tokenizer import model_id_of
from .detokenizer import Detokenizer
from .engines import EngineSpec, StandIn, Vllm
from .messages import (
    Abort,
    AbortAll,
    CallerMessage,
    Drain,
    EngineState,
    GetSchedulerStatistics,
    Member,
    MemberStuck,
    Origin,
    Registered,
    RegisterWorker,
    RouteUpdate,
    Topology,
    WorkerDown,
    WorkerMessage,
    WorkerUp,
)
from .router import Router

if TYPE_CHECKING:
    from collections.abc import Callable
from ._limits import RequestLimits
from .scheduler import Scheduler
from .tokenizer_worker import TokenizerWorker

logger = logging.getLogger("tokenyard.pipeline")


class EngineStartError(TokenyardError):
    """The engine never became ready in ``PipelineConfig.engine_start_tries`` starts in a
    row: the pipeline fails rather than start it again (its message has the last reason)."""


#: The members every worker talks to that there is one of, by the name of their spec.
SHARED = {Member.ROUTER.value: Member.ROUTER, Member.SCHEDULER.value: Member.SCHEDULER}
#: Where workers serving HTTP come from (imported only by the processes that serve).
HTTP_WORKER = "actors.http._worker:HttpWorker"


#: Seconds a worker has to say it drains when the pipeline gives up.
_DRAIN_ASK_TIMEOUT = 2.0


def worker_name(k: int) -> str:
    """The name (and process title) of worker ``k``."""
    return f"tokenizer_worker:{k}"


def detokenizer_name(j: int) -> str:
    """The name (and process title) of detokenizer ``j``."""
    return f"detokenizer:{j}"


class WorkerChannels(Protocol):
    """How the process that owns the HTTP port hands connections to the workers: one
    channel per worker incarnation, inherited by its process."""

    def open(self, worker: int) -> int:
        """A new channel for worker ``worker``'s next start; the descriptor its process
        inherits (it is closed here once that start registered or died)."""
        ...

    def up(self, origin: Origin) -> None:
        """A worker incarnation registered: it may be given connections."""
        ...

    def down(self, origin: Origin) -> None:
        """A worker incarnation died: give what it had not taken to the others."""
        ...

    def settings(self, fd: int) -> Any:
        """What a worker process needs to serve HTTP on the channel ``fd``."""
        ...

    def report_stuck(self, report: Callable[[Origin, str], None]) -> None:
        """Have ``report`` called with a worker incarnation that takes no connections, and
        why: it is killed, so that stuck ends as dead does."""
        ...

    def fail(self, reason: str) -> None:
        """The pipeline failed and its workers are stopped: answer every connection no
        worker took with ``reason``, and take no more."""
        ...


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to build the pipeline (travels to the supervisor as one value).

    Attributes:
        workers: Number of tokenizer workers.
        tokenizer: Path of a ``tokenizer.json`` (None: the bundled one).
        step_time: Seconds per engine step of the stand-in engine (`actors.engines.StandIn`,
            when ``engine`` is ``None``).
        max_batch_size: Most requests running at once in the scheduler.
        max_states: Cap on live detokenization states.
        register_timeout: Seconds a worker has to get registered; the detokenizer and the
            router each have a quarter of it to take a worker's route, so a registration
            the supervisor cannot complete is failed by the supervisor, with its reason,
            before the worker would give up on its own.
        max_restarts: Restart intensity: restarts allowed within ``period``.
        period: Restart intensity window, in seconds.
        stall_timeout: Seconds a member's process may leave liveness probes unanswered
            (stopped, or its loop blocked) before it is killed and restarted.
        deliver_timeout: Seconds a worker may take none of its output before it is killed.
        max_prompt_bytes: Most UTF-8 bytes of a prompt, checked before tokenizing.
        max_prompt_tokens: Most tokens of a prompt.
        max_new_tokens: Upper bound of a request's ``max_new_tokens``. These three hold
            `actors.Pipeline`'s requests; an HTTP request is held to its server's
            `actors.http.ServeConfig` instead, once, by the HTTP layer.
        detokenizers: Number of detokenizers; each request streams through one of them
            for its whole life, the workers spreading their requests over all.
        max_stream_buffer: Most of a stream's output the caller holds unread, counted in
            characters of text plus token ids; past it the request is aborted
            (``SlowReaderError``).
        submit_timeout: Seconds a request waits for a worker to take it before it fails
            with ``PipelineBusyError``.
        model: The model's name in every metric's ``model_name`` label (``None``: derived
            from the tokenizer, as the HTTP layer's model id is).
        worker_nodes: Nodes of the system the tokenizer workers run on (``""``: the
            pipeline's own host); worker k starts on the k-th (round robin) and moves to
            the next that takes it when its node is lost. Empty: every worker here. The
            system must be tcp with CURVE keys (``Pipeline(system_options=...)``), and the
            tokenizer file must be at the same path on every host.
        engine: What generates behind the scheduler (`actors.engines`); ``None``: the
            stand-in, with ``step_time``.
        engine_start_tries: Scheduler deaths or failed restarts in a row, each before its
            engine was ever ready (a launched vLLM engine that exits at start: a wrong
            argument, a model that does not load; a llama.cpp model that no longer loads
            when the scheduler restarts), after which the pipeline gives up and fails with
            the last reason instead of starting the engine again and again.
    """

    workers: int = 4
    detokenizers: int = 1
    tokenizer: str | None = None
    step_time: float = 0.0
    max_batch_size: int = 256
    max_states: int = 65_536
    register_timeout: float = 10.0
    max_restarts: int = 20
    period: float = 30.0
    stall_timeout: float = 10.0
    deliver_timeout: float = 10.0
    max_prompt_bytes: int = 1 << 20
    max_prompt_tokens: int = 32_768
    max_new_tokens: int = 32_768
    max_stream_buffer: int = 4 << 20
    submit_timeout: float = 30.0
    model: str | None = None
    worker_nodes: tuple[str, ...] = ()
    engine: EngineSpec | None = None
    engine_start_tries: int = 3

    def worker_places(self, k: int) -> str | tuple[str, ...] | None:
        """Where worker ``k`` may run, in order (``ChildSpec.node``)."""
        nodes = self.worker_nodes
        if not nodes:
            return None
        first = k % len(nodes)
        return (*nodes[first:], *nodes[:first])

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}: a pipeline needs at least one worker")
        if self.detokenizers < 1:
            raise ValueError(f"detokenizers={self.detokenizers}: a pipeline needs at least one")
        if self.max_restarts < 0:
            raise ValueError(f"PipelineConfig.max_restarts={self.max_restarts} is below 0")
        if not (math.isfinite(self.period) and self.period > 0):
            raise ValueError(f"PipelineConfig.period={self.period} must be finite and above 0")
        for name in (
            "stall_timeout",
            "deliver_timeout",
            "max_prompt_bytes",
            "max_prompt_tokens",
            "max_new_tokens",
            "max_stream_buffer",
            "submit_timeout",
            "engine_start_tries",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"PipelineConfig.{name}={getattr(self, name)} must be positive")
        engine = self.engine
        if isinstance(engine, Vllm) and engine.direct and self.worker_nodes:
            raise ValueError(
                "worker_nodes with a vLLM engine whose clients are the workers (Vllm.direct): "
                "each worker's addresses are fixed on this host at the handshake, so a worker "
                "on another node cannot bind them; give Vllm(direct=False)"
            )
        self.generator  # noqa: B018 - a stand-in's settings are checked here, not at its start
        if self.engine is not None and self.step_time:
            raise ValueError(
                f"PipelineConfig.step_time={self.step_time} is the stand-in engine's: with "
                f"engine={self.engine!r} give the engine's own settings instead"
            )

    @property
    def generator(self) -> EngineSpec:
        """The engine the scheduler drives."""
        return StandIn(step_time=self.step_time) if self.engine is None else self.engine

    @property
    def model_name(self) -> str:
        """The ``model_name`` label of the pipeline's metrics."""
        return self.model or model_id_of(self.tokenizer)

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for."""
        return RequestLimits(
            max_prompt_bytes=self.max_prompt_bytes,
            max_prompt_tokens=self.max_prompt_tokens,
            max_new_tokens=self.max_new_tokens,
        )


class PipelineSupervisor(Supervisor[RegisterWorker | MemberStuck | EngineState]):
    """Starts detokenizer, router, scheduler and N workers; one-for-one restarts.

    Registration: a worker asks ``RegisterWorker``; the route goes to the detokenizer and the
    router (each acknowledges), the caller inbox hears ``WorkerUp``, and only then is the
    worker acknowledged. A live member that does not acknowledge within a quarter of the
    config's ``register_timeout`` fails the registration: the route is taken back from
    every member asked and the worker's ``RegisterWorker`` ask fails, so the worker dies and
    is restarted, to register again (a worker that hears nothing at all gives up after
    ``register_timeout``, the same way). A member that died meanwhile gets the route from
    its successor's start. A duplicate registration (an incarnation already registered, at
    any address) is warned about, counted in ``duplicate_registrations`` and ignored: the
    routes stay as they are.

    Deaths: a worker's route is dropped, its requests are aborted at the scheduler and its
    callers are told (``WorkerDown``) so they resubmit or fail each request. The
    detokenizer's death makes the scheduler drop and report everything it held (each
    worker fails its requests to their callers, who resubmit those that had no output); the
    scheduler's makes each worker do the same for the requests it had forwarded, once the
    ``Topology`` without it arrives. A member stalled past ``stall_timeout``, or a worker
    that takes no output for ``deliver_timeout`` (``MemberStuck``), is killed: stuck ends
    as dead does.

    Args:
        config: The pipeline's shape.
        client: The caller inbox told of ``WorkerUp`` / ``WorkerDown``.
        channels: When the workers serve HTTP: how connections reach them (each worker is
            then an ``actors.http`` worker, with its channel inherited).
        collector: The system's metrics collector, which HTTP workers ask for ``/metrics``.
    """

    def __init__(
        self,
        config: PipelineConfig,
        client: ActorRef[CallerMessage],
        channels: WorkerChannels | None = None,
        collector: ActorRef[GetMetrics] | None = None,
    ) -> None:
        #: Each worker's and detokenizer's index, by the name of its spec (kept, never
        #: parsed out of the name).
        self.worker_ids = {worker_name(k): k for k in range(config.workers)}
        self.detokenizer_ids = {detokenizer_name(j): j for j in range(config.detokenizers)}
        stall = config.stall_timeout
        worker: Any = TokenizerWorker if channels is None else HTTP_WORKER
        if channels is not None and config.worker_nodes:
            raise ValueError(
                "worker_nodes: HTTP workers take their connections from this host's "
                "listening socket, so they cannot run on other nodes"
            )
        specs = [
            *(ChildSpec(Detokenizer, name=n, stall_timeout=stall) for n in self.detokenizer_ids),
            ChildSpec(Router, name=Member.ROUTER.value, stall_timeout=stall),
            ChildSpec(Scheduler, name=Member.SCHEDULER.value, stall_timeout=stall),
            *(
                ChildSpec(worker, name=n, stall_timeout=stall, node=config.worker_places(k))
                for n, k in self.worker_ids.items()
            ),
        ]
        super().__init__(specs, max_restarts=config.max_restarts, period=config.period)
        self.config = config
        self.client = client
        self.channels = channels
        #: The scheduler's engine; a vLLM engine's direct clients' addresses filled in when
        #: this supervisor starts (`on_start`).
        self.engine = config.generator
        #: Whether the live scheduler's engine takes requests (`EngineState`); false from
        #: a scheduler's death until its successor says otherwise.
        self.engine_ready = False
        #: Its engine's bound on prompt plus generated ids (0: none known).
        self.engine_context_length = 0
        #: Schedulers in a row that died before their engine was ever ready.
        self.failed_engine_starts = 0
        self.collector = collector
        self._restarts = _metrics.MEMBER_RESTARTS
        self.routes: dict[Origin, ActorRef[WorkerMessage]] = {}
        self.duplicate_registrations = 0
        self.failed_registrations = 0

    # -- starting -------------------------------------------------------------------------

    async def on_start(self) -> None:
        if isinstance(self.engine, Vllm) and self.engine.direct and not self.engine.clients:
            # The system's private directory, where its own ipc sockets are (its members
            # share it; only its owner can enter it).
            address = self.ref.address
            ipc = address.startswith("ipc://")
            directory = os.path.dirname(address.removeprefix("ipc://")) if ipc else None
            self.engine = self.engine.with_clients(self.config.workers, directory)
        if self.channels is not None:
            self.channels.report_stuck(self._takes_no_connections)
        await super().on_start()

    def _takes_no_connections(self, origin: Origin, reason: str) -> None:
        self.start_soon(self.stuck, MemberStuck(origin=origin, reason=reason))

    def spec_for(self, spec: ChildSpec) -> ChildSpec:
        """Fill in what each member needs: the tokenizer, its siblings, this supervisor."""
        cfg = self.config
        member = SHARED.get(spec.name)
        inherit: tuple[int, ...] = ()
        if spec.name in self.detokenizer_ids:
            kwargs: dict[str, Any] = {
                "tokenizer": cfg.tokenizer,
                "max_states": cfg.max_states,
                "supervisor": self.ref,
                "deliver_timeout": cfg.deliver_timeout,
                "model_name": cfg.model_name,
            }
        elif member is Member.ROUTER:
            kwargs = {}
        elif member is Member.SCHEDULER:
            kwargs = {
                "detokenizers": [self.child(n) for n in self.detokenizer_ids],
                "router": self.child(Member.ROUTER.value),
                "engine": self.engine,
                "tokenizer": cfg.tokenizer,
                "max_batch_size": cfg.max_batch_size,
                "model_name": cfg.model_name,
                "supervisor": self.ref,
            }
        else:
            k = self.worker_ids[spec.name]
            kwargs = {
                "worker_id": k,
                "supervisor": self.ref,
                "tokenizer": cfg.tokenizer,
                "register_timeout": cfg.register_timeout,
                "limits": cfg.limits,
                "model_name": cfg.model_name,
            }
            if isinstance(self.engine, Vllm) and self.engine.clients:
                kwargs["engine_client"] = self.engine.clients[k]
            if self.channels is not None:
                fd = self.channels.open(k)
                kwargs["http"] = self.channels.settings(fd)
                kwargs["collector"] = self.collector
                inherit = (fd,)
        return msgspec.structs.replace(spec, kwargs=kwargs, inherit=inherit)

    def topology(self) -> Topology:
        """The live refs of the shared members."""
        return Topology(
            scheduler=self.child(Member.SCHEDULER.value),
            detokenizers=[self.child(n) for n in self.detokenizer_ids],
            router=self.child(Member.ROUTER.value),
            engine_ready=self.engine_ready,
            engine_context_length=self.engine_context_length if self.engine_ready else 0,
        )

    def routers(self) -> list[ActorRef[Any]]:
        """The live members that hold routes: every detokenizer and the router."""
        names = [*self.detokenizer_ids, Member.ROUTER.value]
        return [ref for ref in map(self.child, names) if ref is not None]

    async def on_child_started(self, name: str, ref: ActorRef[Any]) -> None:
        if name in self.worker_ids:
            await self._tell(ref, self.topology())
            return
        if name == Member.SCHEDULER.value:
            self.engine_ready, self.engine_context_length = await self._engine_ready(ref)
            if self.engine_ready:
                self.failed_engine_starts = 0
        if name != Member.SCHEDULER.value:
            for origin, worker in self.routes.items():
                await self._route(ref, origin, worker)
        await self._broadcast(self.topology())

    async def _broadcast(self, msg: Topology) -> None:
        # Everyone but the router addresses another member; the router only answers.
        for entry in self.entries:
            if entry.ref is not None and entry.spec.name != Member.ROUTER.value:
                await self._tell(entry.ref, msg)

    # -- registration ---------------------------------------------------------------------

    @handler
    async def register(self, msg: RegisterWorker) -> Registered:
        """Publish a worker's route to the detokenizer and the router, then acknowledge."""
        origin = Origin(msg.worker_id, msg.incarnation)
        ack = Registered(worker_id=msg.worker_id, incarnation=msg.incarnation)
        known = self.routes.get(origin)
        if known is not None:
            self.duplicate_registrations += 1
            logger.warning(
                "duplicate registration of %s at %s ignored: it is registered at %s",
                origin,
                msg.address.address,
                known.address,
            )
            return ack
        current = self.child(worker_name(msg.worker_id))
        if current is None or current.incarnation != msg.incarnation:
            raise TokenyardError(f"registration from a stale incarnation: {origin}")
        await self._publish(origin, msg.address)
        self.routes[origin] = msg.address
        if self.channels is not None:
            self.channels.up(origin)
        await self._tell(self.client, WorkerUp(worker_id=msg.worker_id, ref=msg.address))
        logger.info("%s registered: it serves", origin)
        return ack

    async def _publish(self, origin: Origin, address: ActorRef[WorkerMessage]) -> None:
        """Give a new worker's route to the detokenizer and the router, each acknowledging.

        Raises:
            TokenyardError: A live member did not take the route in time (it is taken back
                from every member asked, so no member keeps a route the registry lacks).
        """
        timeout = self.config.register_timeout / 4
        asked: list[ActorRef[Any]] = []
        for ref in self.routers():  # one restarting is left out: its start publishes all
            asked.append(ref)
            try:
                await ref.ask(RouteUpdate(origin=origin, ref=address), timeout=timeout)
            except ActorDeadError:
                continue  # died meanwhile: its successor's start publishes the route
            except TokenyardError as err:
                self.failed_registrations += 1
                for other in asked:  # queued behind the update: a late one is undone too
                    await self._tell(other, RouteUpdate(origin=origin, ref=None))
                raise TokenyardError(
                    f"{origin} not registered: the {ref.name} did not take its "
                    f"route within {timeout:g} s, a quarter of register_timeout ({err}); the "
                    "worker restarts and registers again (raise "
                    "PipelineConfig.register_timeout if members are this slow)"
                ) from err

    async def _route(
        self, member: ActorRef[Any], origin: Origin, ref: ActorRef[WorkerMessage] | None
    ) -> None:
        try:
            await member.ask(RouteUpdate(origin=origin, ref=ref), timeout=10)
        except TokenyardError as err:
            # The member died meanwhile: its restart republishes every route.
            logger.warning("route %s not published to %s: %s", origin, member.name, err)

    # -- the engine's readiness ------------------------------------------------------------

    async def _engine_ready(self, scheduler: ActorRef[Any]) -> tuple[bool, int]:
        """Whether a scheduler that just started has its engine ready (one that has not
        connected yet has not: it tells `EngineState` when that changes), and the engine's
        context length."""
        try:
            stats = await scheduler.ask(GetSchedulerStatistics(), timeout=10)
        except TokenyardError as err:
            logger.warning("the scheduler did not say whether its engine is ready: %s", err)
            return False, 0
        return stats.engine_ready, stats.engine_context_length

    @handler
    async def engine_state(self, msg: EngineState) -> None:
        """The scheduler's engine became ready, or stopped being ready: every member is
        told (a worker's ``/health`` answers it)."""
        if msg.scheduler != self.child(Member.SCHEDULER.value) or msg.ready == self.engine_ready:
            return  # a word of a scheduler that is gone, or nothing new
        self.engine_ready, self.engine_context_length = msg.ready, msg.context_length
        if msg.ready:
            self.failed_engine_starts = 0
        await self._broadcast(self.topology())

    # -- deaths and stalls ----------------------------------------------------------------

    @handler
    async def stuck(self, msg: MemberStuck) -> None:
        """A worker takes none of its output: kill it, so it ends (and restarts) as dead."""
        name = worker_name(msg.origin.worker)
        ref = self.child(name) if name in self.worker_ids else None
        if ref is None or ref.incarnation != msg.origin.incarnation:
            return  # already gone
        logger.warning("killing %s: %s", msg.origin, msg.reason)
        try:
            await self.system.kill(ref, f"stuck: {msg.reason}")
        except TokenyardError as err:
            logger.debug("%s was gone before it could be killed: %s", msg.origin, err)

    async def on_child_died(self, name: str, down: Down) -> None:
        # Every member is permanent: each death is followed by its restart.
        self._restarts.labels(self.config.model_name, name, down.cause.value).inc()
        worker_id = self.worker_ids.get(name)
        if worker_id is not None:
            origin = Origin(worker_id, down.ref.incarnation)
            logger.info(
                "%s died (%s): its requests are resubmitted or failed, and it restarts",
                origin,
                down.reason,
            )
            if self.channels is not None:
                self.channels.down(origin)
            if self.routes.pop(origin, None) is not None:
                for ref in self.routers():
                    await self._route(ref, origin, None)
            scheduler = self.child(Member.SCHEDULER.value)
            if scheduler is not None:
                await self._tell(scheduler, Abort(origin=origin, rid=None, reason=down.reason))
            await self._tell(self.client, WorkerDown(origin=origin, reason=down.reason))
            return
        index = self.detokenizer_ids.get(name)
        if index is not None:
            # What the scheduler holds that streamed through the dead detokenizer: it drops
            # and reports it, and each worker fails those requests to their callers.
            scheduler = self.child(Member.SCHEDULER.value)
            if scheduler is not None:
                abort = AbortAll(
                    reason=f"{name} died: {down.reason}",
                    lost_to=Member.DETOKENIZER,
                    detokenizer=index,
                )
                await self._tell(scheduler, abort)
        elif SHARED[name] is Member.SCHEDULER:
            if not self.engine_ready and await self._engine_start_failed(down.reason):
                return
            self.engine_ready = False
            for n in self.detokenizer_ids:
                detokenizer = self.child(n)
                if detokenizer is not None:
                    abort = AbortAll(reason=down.reason, lost_to=Member.SCHEDULER)
                    await self._tell(detokenizer, abort)
        # Each worker fails what depended on the dead member (forwarded to a dead scheduler,
        # or streaming through a dead detokenizer), and keeps what arrives meanwhile.
        await self._broadcast(self.topology())
        # The router's death needs no caller told: no request waits on it alone. The
        # scheduler keeps what it had for the router until the router confirms it, and the
        # workers ask their unanswered control requests again, both once the Topology that
        # on_child_started publishes names the successor, which by then holds every route.

    async def give_up(self, error: Exception) -> None:
        """Fail (see `runtime.Supervisor.give_up`); before the members stop, the workers
        that serve HTTP end what they serve with the reason (503, or a stream's error
        event) rather than close its connection unanswered, and once they stopped, the
        port's owner answers the connections none of them took the same way."""
        reason = f"the pipeline failed, nothing more is served: {error}"
        if self.channels is not None:
            drain = Drain(timeout=0.0, reason=reason)

            async def tell_to_drain(name: str, ref: ActorRef[Any]) -> None:
                try:
                    await ref.ask(drain, timeout=_DRAIN_ASK_TIMEOUT)
                except TokenyardError as err:  # dead or stuck: its stop ends its requests
                    logger.debug("%s not told to drain: %s", name, err)

            async with anyio.create_task_group() as tg:  # at once: a stuck one holds no other
                for name in self.worker_ids:
                    if (ref := self.child(name)) is not None:
                        tg.start_soon(tell_to_drain, name, ref)
        await super().give_up(error)
        if self.channels is not None:
            # The workers are stopped: what none of them took is answered by the owner.
            self.channels.fail(reason)

    async def on_restart_failed(self, name: str, error: Exception) -> None:
        # A scheduler whose start fails (its engine does not load: llama.cpp's model is
        # loaded in its on_start) is an engine start that failed, as a death before ready is.
        if name == Member.SCHEDULER.value:
            await self._engine_start_failed(str(error))

    async def _engine_start_failed(self, reason: str) -> bool:
        """Count one start of the engine that failed; past `engine_start_tries` in a row,
        give up (and say so: ``True``)."""
        self.failed_engine_starts += 1
        tries = self.config.engine_start_tries
        if self.failed_engine_starts < tries:
            return False
        await self.give_up(
            EngineStartError(
                f"the engine was never ready in {tries} starts in a row; "
                f"the last ended with: {reason}"
            )
        )
        return True

    async def _tell(self, ref: ActorRef[Any], msg: Any) -> None:
        try:
            await ref.tell(msg)
        except TokenyardError as err:
            logger.debug("%s not told %s: %s", ref.name, type(msg).__name__, err)
