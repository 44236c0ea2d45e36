"""The router: carries control replies and aborts from the scheduler to the worker that asked.

Also its sender's side, `RouterLink`: how the scheduler delivers to the live router so that
a router's death loses none of what it was given.
"""

from __future__ import annotations

import logging

import anyio

from runtime import (
    Actor,
    ActorDeadError,
    ActorRef,
    RemoteActorError,
    Throttle,
    TokenyardError,
    handler,
)

from ._routes import Routes
from .messages import (
    AbortNotice,
    FlushReply,
    GetRouterStatistics,
    LoadReply,
    RouteAck,
    RouterMessage,
    RouterStatistics,
    RouteUpdate,
)

__all__ = ("Router", "RouterLink")

logger = logging.getLogger("tokenyard.router")

#: What travels through the router: each names the worker incarnation it is for.
Routed = LoadReply | FlushReply | AbortNotice


class Router(Actor[RouterMessage]):
    """Forwards each control reply to the worker incarnation named by its ``origin``.

    A reply for an origin without a route (a dead or unknown incarnation) is dropped and
    counted, never queued. Each message is passed on as an ``ask`` of its worker, so it
    counts as forwarded only once the worker has handled it; messages are handled one at a
    time, in arrival order. So the reply to an ``ask`` of one of them proves that everything
    its sender told before had reached its worker, even if this router dies the next
    moment (`RouterLink` relies on it: a tell the router had merely queued for its worker
    would die with the router).

    Args:
        forward_timeout: Seconds a worker has to take a message before it is dropped and
            counted (it is stuck, or died unnoticed; its supervisor resolves its requests).
    """

    def __init__(self, *, forward_timeout: float = 10.0) -> None:
        self.routes = Routes()
        self.forward_timeout = forward_timeout
        self.forwarded = 0
        self.dropped = 0
        self._failing = Throttle(logger)

    @handler
    def route(self, msg: RouteUpdate) -> RouteAck:
        """Add or drop a worker incarnation's route; acknowledged once the table changed
        (a route for a new incarnation drops the worker's older ones)."""
        self.routes.update(msg.origin, msg.ref)
        return RouteAck(origin=msg.origin)

    @handler
    async def forward(self, msg: LoadReply | FlushReply | AbortNotice) -> None:
        """Pass a control reply or an abort notice to the worker incarnation it is for."""
        ref = self.routes.get(msg.origin)
        if ref is None:
            self.dropped += 1
            return
        try:
            await ref.ask(msg, timeout=self.forward_timeout)
        except RemoteActorError as err:
            self._failing.warning(
                "router: %s failed on %s: %s", msg.origin, type(msg).__name__, err
            )
        except TokenyardError as err:
            self.dropped += 1
            logger.debug("router: reply for %s dropped: %s", msg.origin, err)
            return
        self.forwarded += 1

    @handler
    def statistics(self, msg: GetRouterStatistics) -> RouterStatistics:
        """The router's counters."""
        return RouterStatistics(
            forwarded=self.forwarded, dropped_unknown_origin=self.dropped, routes=len(self.routes)
        )


class RouterLink:
    """At-least-once delivery to the live router, in order, for the actor that feeds it.

    A control reply or an abort notice lost with a dead router would leave a caller waiting
    forever, and a tell cannot tell delivered from lost: it succeeds into a router that died
    a moment ago, and the router may die with messages still in its mailbox. So the messages
    wait here, in order; `run` tells them to the router and asks the last one of each run,
    whose reply proves the whole run reached its workers (the `Router` hands each on as an
    ask of its worker, one at a time). A run that is not confirmed (the
    router died, or stayed stuck past ``confirm_timeout``) is sent again: to the successor
    named by `retarget` after a death, to the same router after ``retry_after`` seconds
    otherwise. A worker may thus get a message twice; it ignores the second.

    Args:
        router: Where to deliver.
        confirm_timeout: Seconds the router has to confirm a run.
        retry_after: Seconds before a run a live router did not confirm is sent again.
    """

    def __init__(
        self,
        router: ActorRef[RouterMessage],
        *,
        confirm_timeout: float = 60.0,
        retry_after: float = 1.0,
    ) -> None:
        self._router = router
        self._confirm_timeout = confirm_timeout
        self._retry_after = retry_after
        self._queue: list[Routed] = []
        self._pending = anyio.Event()
        self._changed = anyio.Event()

    @property
    def router(self) -> ActorRef[RouterMessage]:
        """The router delivered to now."""
        return self._router

    @property
    def waiting(self) -> int:
        """Messages not yet confirmed as delivered."""
        return len(self._queue)

    def put(self, msg: Routed) -> None:
        """Queue ``msg`` for the router (never waits)."""
        self._queue.append(msg)
        self._pending.set()

    def retarget(self, router: ActorRef[RouterMessage]) -> None:
        """Deliver to ``router`` from now on (the supervisor published a successor)."""
        if router != self._router:
            self._router = router
            self._changed.set()

    async def run(self) -> None:
        """Deliver queued messages for ever (the owner's background task)."""
        while True:
            if not self._queue:
                self._pending = anyio.Event()
                await self._pending.wait()
                continue
            router = self._router
            batch, self._queue = self._queue, []
            try:
                for msg in batch[:-1]:
                    await router.tell(msg)
                await router.ask(batch[-1], timeout=self._confirm_timeout)
            except RemoteActorError:
                pass  # its handler failed, but it was reached, after everything before it
            except TokenyardError as err:
                self._queue[:0] = batch
                logger.warning(
                    "%d message(s) for the workers wait for the router %s: %s",
                    len(batch),
                    router.name,
                    err,
                )
                await self._wait_for_successor(router, dead=isinstance(err, ActorDeadError))

    async def _wait_for_successor(self, router: ActorRef[RouterMessage], *, dead: bool) -> None:
        if self._router != router:
            return  # already retargeted
        changed = self._changed = anyio.Event()
        if dead:
            await changed.wait()  # a dead router never answers: only its successor will
            return
        with anyio.move_on_after(self._retry_after):
            await changed.wait()
