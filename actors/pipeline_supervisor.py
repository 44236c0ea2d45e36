"""The pipeline's supervisor: starts every member, keeps the registry, publishes routes,
restarts the dead and makes sure no request waits on a dead member."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from runtime import ActorDeadError, ActorRef, ChildSpec, Down, Supervisor, TokenyardError, handler

from .detokenizer import Detokenizer
from .messages import (
    Abort,
    AbortAll,
    Origin,
    Registered,
    RegisterWorker,
    RouteUpdate,
    Topology,
    WorkerDown,
    WorkerUp,
)
from .router import Router
from .scheduler import Scheduler
from .tokenizer_worker import TokenizerWorker

logger = logging.getLogger("tokenyard.pipeline")

SHARED = ("detokenizer", "router", "scheduler")


def worker_name(k: int) -> str:
    """The name (and process title) of worker ``k``."""
    return f"tokenizer_worker:{k}"


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to build the pipeline (travels to the supervisor as one value).

    Attributes:
        workers: Number of tokenizer workers.
        tokenizer: Path of a ``tokenizer.json`` (None: the bundled one).
        step_time: Seconds per engine step of the stand-in scheduler.
        max_batch_size: Most requests running at once in the scheduler.
        max_states: Cap on live detokenization states.
        register_timeout: Seconds a worker has to get registered; the detokenizer and the
            router each have a quarter of it to take a worker's route, so a registration
            the supervisor cannot complete is failed by the supervisor, with its reason,
            before the worker would give up on its own.
        max_restarts: Restart intensity: restarts allowed within ``period``.
        period: Restart intensity window, in seconds.
    """

    workers: int = 4
    tokenizer: str | None = None
    step_time: float = 0.0
    max_batch_size: int = 256
    max_states: int = 65_536
    register_timeout: float = 10.0
    max_restarts: int = 20
    period: float = 30.0


class PipelineSupervisor(Supervisor):
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
    callers are told (``WorkerDown``) so they resubmit or fail each request; the death of the
    detokenizer or the scheduler is told to the callers the same way.

    Args:
        config: The pipeline's shape.
        client: The caller inbox told of ``WorkerUp`` / ``WorkerDown``.
    """

    def __init__(self, config: PipelineConfig, client: ActorRef[Any]) -> None:
        specs = [
            ChildSpec(Detokenizer, name="detokenizer"),
            ChildSpec(Router, name="router"),
            ChildSpec(Scheduler, name="scheduler"),
            *(ChildSpec(TokenizerWorker, name=worker_name(k)) for k in range(config.workers)),
        ]
        super().__init__(specs, max_restarts=config.max_restarts, period=config.period)
        self.config = config
        self.client = client
        self.routes: dict[Origin, ActorRef[Any]] = {}
        self.duplicate_registrations = 0
        self.failed_registrations = 0
        #: Shared members that died, told to the callers once their successor is up (so a
        #: resubmitted request never reaches a pipeline still missing them).
        self.pending_downs: dict[str, str] = {}

    # -- starting -------------------------------------------------------------------------

    def spec_for(self, spec: ChildSpec) -> ChildSpec:
        """Fill in what each member needs: the tokenizer, its siblings, this supervisor."""
        cfg = self.config
        if spec.name == "detokenizer":
            kwargs: dict[str, Any] = {"tokenizer": cfg.tokenizer, "max_states": cfg.max_states}
        elif spec.name == "router":
            kwargs = {}
        elif spec.name == "scheduler":
            kwargs = {
                "detokenizer": self.child("detokenizer"),
                "router": self.child("router"),
                "tokenizer": cfg.tokenizer,
                "step_time": cfg.step_time,
                "max_batch_size": cfg.max_batch_size,
            }
        else:
            kwargs = {
                "worker_id": int(spec.name.rpartition(":")[2]),
                "supervisor": self.ref,
                "tokenizer": cfg.tokenizer,
                "register_timeout": cfg.register_timeout,
            }
        return msgspec.structs.replace(spec, kwargs=kwargs)

    def topology(self) -> Topology:
        """The live refs of the shared members."""
        return Topology(
            scheduler=self.child("scheduler"),
            detokenizer=self.child("detokenizer"),
            router=self.child("router"),
        )

    async def on_child_started(self, name: str, ref: ActorRef[Any]) -> None:
        if name in SHARED:
            if name in ("detokenizer", "router"):
                for origin, worker in self.routes.items():
                    await self._route(ref, origin, worker)
            await self._broadcast(self.topology())
            reason = self.pending_downs.pop(name, None)
            if reason is not None:
                await self._tell(self.client, WorkerDown(member=name, origin=None, reason=reason))
        else:
            await self._tell(ref, self.topology())

    async def _broadcast(self, msg: Topology) -> None:
        # Everyone but the router addresses another member; the router only answers.
        for entry in self.entries:
            if entry.ref is not None and entry.spec.name != "router":
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
                "duplicate registration of worker %s at %s ignored: it is registered at %s",
                origin,
                msg.address.address,
                known.address,
            )
            return ack
        current = self.child(worker_name(msg.worker_id))
        if current is None or current.incarnation != msg.incarnation:
            raise TokenyardError(f"registration from a stale worker incarnation {origin}")
        await self._publish(origin, msg.address)
        self.routes[origin] = msg.address
        await self._tell(self.client, WorkerUp(worker_id=msg.worker_id, ref=msg.address))
        return ack

    async def _publish(self, origin: Origin, address: ActorRef[Any]) -> None:
        """Give a new worker's route to the detokenizer and the router, each acknowledging.

        Raises:
            TokenyardError: A live member did not take the route in time (it is taken back
                from every member asked, so no member keeps a route the registry lacks).
        """
        timeout = self.config.register_timeout / 4
        asked: list[ActorRef[Any]] = []
        for member in ("detokenizer", "router"):
            ref = self.child(member)
            if ref is None:
                continue  # restarting: its start publishes every route, this one too
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
                    f"worker {origin} not registered: the {member} did not take its route "
                    f"within {timeout:g} s, a quarter of register_timeout ({err}); the worker "
                    "restarts and registers again (raise PipelineConfig.register_timeout if "
                    "members are this slow)"
                ) from err

    async def _route(
        self, member: ActorRef[Any], origin: Origin, ref: ActorRef[Any] | None
    ) -> None:
        try:
            await member.ask(RouteUpdate(origin=origin, ref=ref), timeout=10)
        except TokenyardError as err:
            # The member died meanwhile: its restart republishes every route.
            logger.warning("route %s not published to %s: %s", origin, member.name, err)

    # -- deaths ---------------------------------------------------------------------------

    async def on_child_died(self, name: str, down: Down) -> None:
        if name.startswith("tokenizer_worker:"):
            origin = Origin(int(name.rpartition(":")[2]), down.ref.incarnation)
            if self.routes.pop(origin, None) is not None:
                for member in ("detokenizer", "router"):
                    ref = self.child(member)
                    if ref is not None:
                        await self._route(ref, origin, None)
            scheduler = self.child("scheduler")
            if scheduler is not None:
                await self._tell(scheduler, Abort(origin=origin, rid=None, reason=down.reason))
            await self._tell(
                self.client, WorkerDown(member="worker", origin=origin, reason=down.reason)
            )
            return
        if name == "detokenizer":
            scheduler = self.child("scheduler")
            if scheduler is not None:
                await self._tell(scheduler, AbortAll(reason=down.reason))
        elif name == "scheduler":
            detokenizer = self.child("detokenizer")
            if detokenizer is not None:
                await self._tell(detokenizer, AbortAll(reason=down.reason))
        if name in ("detokenizer", "scheduler"):
            self.pending_downs[name] = down.reason
        # The router's death needs no caller told: no request waits on it alone. The
        # scheduler keeps what it had for the router until the router confirms it, and the
        # workers ask their unanswered control requests again, both once the Topology that
        # on_child_started publishes names the successor, which by then holds every route.

    async def _tell(self, ref: ActorRef[Any], msg: Any) -> None:
        try:
            await ref.tell(msg)
        except TokenyardError as err:
            logger.debug("%s not told %s: %s", ref.name, type(msg).__name__, err)
