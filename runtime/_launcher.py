"""How a system starts its actor processes: a fresh interpreter, or its fork server.

``start="fork-server"`` (the default where `runtime._clone` can fork siblings: Linux on
x86-64 and arm64) forks each actor process from a server that imported the runtime, the
system's ``preload`` modules and each actor's module once. ``start="spawn"`` starts a fresh
``python -m runtime._child`` for each, as every actor process started before fork servers
existed. The system picks one per spawn (``spawn(start=...)``, else its own).

The server is supervised here: started lazily on the first fork (or when the system opens,
with ``eager_fork_server``), replaced when it dies (a spawn whose child it had not forked
yet is retried once on the new one), reaped when the system closes. An import that started
a thread in it is handled by module: for a ``preload`` module the spawn fails (the user
asked for something that cannot work); for an actor's own module, that actor and every later
one of its module start in a fresh interpreter, with one warning naming the module.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import anyio

from ._clone import SUPPORTED
from ._errors import SpawnError
from ._forking import ForkRefused, ForkServer, ForkServerGone
from ._spawn import ChildProcess, spec_payload

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ._protocol import StartMethod
    from ._spawn import SpawnSpec

logger = logging.getLogger("tokenyard.system")

SPAWN: StartMethod = "spawn"
FORK_SERVER: StartMethod = "fork-server"
START_METHODS = (SPAWN, FORK_SERVER)
#: The start method of a system that names none.
DEFAULT_START: StartMethod = FORK_SERVER if SUPPORTED else SPAWN


def check_start(start: str, where: str) -> StartMethod:
    """``start`` if it is a start method this platform has.

    Raises:
        ValueError: It is not one, naming ``where`` (the knob) and the choices.
    """
    if start not in START_METHODS:
        raise ValueError(f"{where}start={start!r}: choose 'fork-server' or 'spawn'")
    if start == FORK_SERVER and not SUPPORTED:
        raise ValueError(
            f"{where}start='fork-server' needs Linux on x86-64 or arm64 (it forks with "
            "clone(CLONE_PARENT)); use start='spawn' here"
        )
    return FORK_SERVER if start == FORK_SERVER else SPAWN


class Launcher:
    """Starts the actor processes of one system, and owns its fork server.

    Args:
        name: The system's name.
        start: The system's start method.
        preload: Modules its fork server imports before serving.
    """

    def __init__(self, name: str, start: StartMethod, preload: Sequence[str]) -> None:
        self.name = name
        self.start = start
        self.preload = tuple(preload)
        self.server: ForkServer | None = None
        #: Actor modules whose import started a thread in a fork server.
        self.unforkable: set[str] = set()
        self._lock: asyncio.Lock | None = None
        self._preload_refusal = ""

    def fork_for(self, spec: SpawnSpec) -> Callable[[float], Awaitable[ChildProcess]] | None:
        """The fork that starts ``spec``'s process, given the seconds it may take; ``None``
        when it starts in a fresh interpreter (``spec.how.start``, else the system's)."""
        method = spec.how.start or self.start
        if method == SPAWN or _module(spec) in self.unforkable:
            return None

        async def fork(timeout: float) -> ChildProcess:
            return await self._fork(spec, timeout)

        return fork

    def open_server(self) -> ForkServer:
        """Start the fork server now if none runs (it preloads in the background)."""
        if self.server is None:  # a dead one is replaced (and reaped) by `_server`
            self.server = ForkServer(self.name, self.preload)
            self.server.start()
        return self.server

    async def _server(self) -> ForkServer:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.server is not None and self.server.gone:
                dead, self.server = self.server, None
                await dead.aclose()
            return self.open_server()

    async def _fork(self, spec: SpawnSpec, timeout: float) -> ChildProcess:
        if self._preload_refusal:
            raise SpawnError(self._preload_refusal)
        payload = spec_payload(spec)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for attempt in range(2):
            server = await self._server()
            try:
                # Only the server a spawn began on is killed for not getting ready in its
                # time: a retry (its first server died) has what is left, which may be too
                # little for any new server to start, and fails alone.
                await self._ready(server, spec, deadline - loop.time(), judge=attempt == 0)
                return await server.fork(spec, payload, max(deadline - loop.time(), 0.01))
            except ForkServerGone:
                continue  # nothing was forked: once more, on a new server
            except ForkRefused as refusal:
                server.kill()  # it says it exits; make sure
                return self._refused(spec, refusal)
        if server.stuck:  # killed here, for a request that outlasted its timeout
            raise SpawnError(
                f"the fork server was killed twice while starting actor {spec.target.name!r}, "
                f"the second time stuck past a spawn's timeout (importing {_module(spec)!r} "
                "hangs?); a slow import needs a larger spawn(spawn_timeout=...), or start='spawn'"
            )
        raise SpawnError(
            f"the fork server died twice while starting actor {spec.target.name!r} (importing "
            f"{_module(spec)!r} kills it?); spawn it with start='spawn'"
        )

    async def _ready(
        self, server: ForkServer, spec: SpawnSpec, timeout: float, *, judge: bool
    ) -> None:
        with anyio.move_on_after(max(timeout, 0.01)) as scope:
            await server.ready()
        if scope.cancelled_caught:
            if not judge:
                raise SpawnError(
                    f"the fork server died while starting actor {spec.target.name!r}, and "
                    f"the one that replaced it was not ready within the {timeout:.3g} s left "
                    "of its spawn_timeout; a larger spawn(spawn_timeout=...), or start='spawn'"
                )
            server.kill()
            raise SpawnError(
                f"the fork server did not finish importing preload={list(self.preload)} "
                f"within the {timeout:.3g} s left of the spawn_timeout, so actor "
                f"{spec.target.name!r} could not start; a slow "
                "import needs a larger spawn_timeout, or start='spawn'"
            )

    def _refused(self, spec: SpawnSpec, refusal: ForkRefused) -> ChildProcess:
        if refusal.module in self.preload:
            self._preload_refusal = (
                f"ActorSystem(preload=...): importing {refusal.module!r} in the fork server "
                f"started a thread ({refusal.threads} threads), and a process with threads "
                "cannot be forked safely; take it out of preload=, or start actors in fresh "
                "interpreters with ActorSystem(start='spawn')"
            )
            raise SpawnError(self._preload_refusal)
        module = _module(spec)
        self.unforkable.add(module)
        logger.warning(
            "importing %r in the fork server started a thread (%d threads), and a process "
            "with threads cannot be forked safely: actors of %r start in a fresh interpreter "
            "instead (spawn them with start='spawn' to say so and silence this)",
            refusal.module,
            refusal.threads,
            module,
        )
        return ChildProcess.start(spec)

    async def aclose(self) -> None:
        """Stop and reap the fork server."""
        server, self.server = self.server, None
        if server is not None:
            await server.aclose()


def _module(spec: SpawnSpec) -> str:
    """The module a fork server imports for ``spec`` (the script, for ``__main__``)."""
    if spec.target.main:
        return spec.target.main.partition(":")[2]
    return spec.target.actor.partition(":")[0]
