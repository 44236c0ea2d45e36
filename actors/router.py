"""The router: carries control replies and aborts from the scheduler to the worker that asked."""

from __future__ import annotations

import logging
from typing import Any

from runtime import Actor, ActorRef, TokenyardError, handler

from .messages import (
    AbortNotice,
    FlushReply,
    GetRouterStats,
    LoadReply,
    Origin,
    RouteAck,
    RouterStats,
    RouteUpdate,
)

logger = logging.getLogger("tokenyard.router")


class Router(Actor):
    """Forwards each control reply to the worker incarnation named by its ``origin``.

    A reply for an origin without a route (a dead or unknown incarnation) is dropped and
    counted, never queued.
    """

    def __init__(self) -> None:
        self.routes: dict[Origin, ActorRef[Any]] = {}
        self.forwarded = 0
        self.dropped = 0

    @handler
    def route(self, msg: RouteUpdate) -> RouteAck:
        """Add or drop a worker incarnation's route; acknowledged once the table changed."""
        if msg.ref is None:
            self.routes.pop(msg.origin, None)
        else:
            self.routes[msg.origin] = msg.ref
        return RouteAck(origin=msg.origin)

    async def _forward(self, origin: Origin, msg: LoadReply | FlushReply | AbortNotice) -> None:
        ref = self.routes.get(origin)
        if ref is None:
            self.dropped += 1
            return
        try:
            await ref.tell(msg)
        except TokenyardError as err:
            self.dropped += 1
            logger.debug("router: reply for %s dropped: %s", origin, err)
            return
        self.forwarded += 1

    @handler
    async def load(self, msg: LoadReply) -> None:
        """Pass a load reply to the worker that asked."""
        await self._forward(msg.origin, msg)

    @handler
    async def flush(self, msg: FlushReply) -> None:
        """Pass a flush reply to the worker that asked."""
        await self._forward(msg.origin, msg)

    @handler
    async def abort(self, msg: AbortNotice) -> None:
        """Pass the scheduler's abort of a request to the request's worker."""
        await self._forward(msg.origin, msg)

    @handler
    def stats(self, msg: GetRouterStats) -> RouterStats:
        """The router's counters."""
        return RouterStats(
            forwarded=self.forwarded, dropped_unknown_origin=self.dropped, routes=len(self.routes)
        )
