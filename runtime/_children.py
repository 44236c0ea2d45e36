"""The children of one actor system: their records, their deaths, and how a stop escalates.

A graceful stop travels in-band (after every tell this process sent), then escalates:
a bounded wait, SIGTERM, a short grace, SIGKILL. A death is recorded once, whoever sees it
first (the monitor task, or a stop waiting on the process itself).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from ._codec import DownBody, Kind
from ._errors import TokenyardError
from ._watch import Down, reason_for_status

if TYPE_CHECKING:
    from ._actor import Cell
    from ._node import Node
    from ._ref import ActorRef
    from ._spawn import ChildProcess

logger = logging.getLogger("tokenyard.system")

#: Seconds between SIGTERM and SIGKILL.
TERM_GRACE = 2.0


@dataclass(eq=False)
class Child:
    """One child actor: in its own process (``process``) or in-process (``cell``)."""

    ref: ActorRef[Any]
    shutdown_timeout: float
    process: ChildProcess | None = None
    token: int = 0
    node_address: str = ""
    oom_before: int | None = None
    cell: Cell | None = None
    scope: anyio.CancelScope | None = None
    down: Down | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)


class Watch(Awaitable[Down]):
    """A registered interest in one incarnation's death; ``await`` it for the ``Down``."""

    def __init__(self, future: asyncio.Future[Down]) -> None:
        self._future = future

    def __await__(self) -> Generator[Any, None, Down]:
        return self._future.__await__()

    def cancel(self) -> None:
        """Stop watching."""
        self._future.cancel()


class Children:
    """The live children of one system, in start order.

    Args:
        node: The system's node, where deaths are published (set when the system opens).
    """

    def __init__(self) -> None:
        self.live: dict[str, Child] = {}
        self.node: Node | None = None

    def add(self, child: Child) -> None:
        """Record a started child."""
        self.live[child.ref.address] = child

    def get(self, address: str) -> Child | None:
        """The live child at ``address``."""
        return self.live.get(address)

    async def await_exit(self, child: Child) -> None:
        """Return once ``child`` is dead and recorded. For a process, this waits on the
        process itself rather than on the monitor task, which a cancelled caller's scope may
        have taken down with it (shutdown must still finish then)."""
        if child.process is None:
            await child.exited.wait()
            return
        code = await child.process.wait()
        if child.exited.is_set():
            return
        child.process.close()
        words = None
        if self.node is not None and not self.node.closed:
            self.node.read_replies()
            words = self.node.last_words.pop(child.token, None)
        reason, signum = reason_for_status(code, words, child.oom_before)
        self.died(child, Down(ref=child.ref, reason=reason, exitcode=code, signal=signum))

    def died(self, child: Child, down: Down) -> None:
        """Record a death: the ``Down``, the node's dead set, its watchers, a log line."""
        child.down = down
        child.exited.set()
        self.live.pop(child.ref.address, None)
        node = self.node
        if node is not None and not node.closed:
            ref = child.ref
            body = DownBody(ref.address, ref.name, down.reason, down.exitcode, down.signal)
            node.mark_dead(ref.address, body)
            if child.node_address:
                node.owner_died(child.node_address, ref.name)
        if not down.normal:
            logger.warning("actor %s died: %s", child.ref.name, down.reason)

    async def stop(self, child: Child, timeout: float) -> Down:
        """Stop ``child``: in-band stop request, bounded wait, SIGTERM, SIGKILL."""
        node = self.node
        assert node is not None
        deadline = time.monotonic() + timeout
        corr, acked = node.new_request(child.ref.address)
        try:
            with anyio.move_on_after(timeout):
                await node.send_control(child.ref.address, Kind.STOP, corr, timeout=timeout)
                await acked
        except (TokenyardError, msgspec.DecodeError):
            logger.debug("stop request to %s failed", child.ref.name, exc_info=True)
        finally:
            node.drop_request(corr)
        remaining = max(deadline - time.monotonic(), 0.1)
        with anyio.move_on_after(remaining):
            await self.await_exit(child)
        if not child.exited.is_set():
            self._escalate(child, signal.SIGTERM)
            with anyio.move_on_after(TERM_GRACE):
                await self.await_exit(child)
        if not child.exited.is_set():
            self._escalate(child, signal.SIGKILL)
            await self.await_exit(child)
        assert child.down is not None
        return child.down

    def _escalate(self, child: Child, signum: int) -> None:
        logger.warning(
            "actor %s did not stop in %g s: sending %s",
            child.ref.name,
            child.shutdown_timeout,
            signal.Signals(signum).name,
        )
        if child.process is not None:
            child.process.signal(signum)
        elif child.scope is not None:
            child.scope.cancel()

    async def stop_all(self) -> None:
        """Stop every child, in reverse start order."""
        for child in reversed(list(self.live.values())):
            await self.stop(child, child.shutdown_timeout)
