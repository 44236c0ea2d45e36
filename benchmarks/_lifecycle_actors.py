"""The actor the supervision and spawn suites start, kill and restart.

Deliberately small: this module imports ``runtime`` and nothing else, so what a fresh actor
process costs here is what the runtime costs, not what a benchmark's helpers cost. The
suites time ``python -c "import benchmarks._lifecycle_actors"`` as the import part of a
restart.

Its process notes two moments on ``time.monotonic()`` (``CLOCK_MONOTONIC`` on Linux, one
clock for every process of the machine), which a ``Pong`` carries back: when this module
had been imported (the interpreter has started and imported ``runtime``), and when
``on_start`` ran (the runtime has opened its sockets and event loop in the child). The
driver that spawned or killed the process splits its own timings at these moments.
"""

from __future__ import annotations

import os
import time

from runtime import Actor, Message, Request, handler

#: When this module had been imported in this process (after ``runtime``: it is above).
IMPORTED_AT = time.monotonic()


class Ping(Request["Pong"]):
    """Are you there? Answered with ``Pong``."""


class Pong(Message):
    """The answer: which process and incarnation answered, and when it started.

    Attributes:
        pid: The actor's process id (how a driver finds the process to kill).
        incarnation: The incarnation that answered (a restarted actor's is higher).
        imported_at: ``time.monotonic()`` when the actor's module had been imported.
        started_at: ``time.monotonic()`` when ``on_start`` ran.
    """

    pid: int
    incarnation: int
    imported_at: float
    started_at: float


class Pinger(Actor[Ping]):
    """Answers ``Ping`` with its pid, incarnation and start times; otherwise idle."""

    def __init__(self) -> None:
        self.started_at = 0.0

    async def on_start(self) -> None:
        """Note when the runtime got this far in the child."""
        self.started_at = time.monotonic()

    @handler
    def ping(self, msg: Ping) -> Pong:
        """Say which process and incarnation this is, and when it started."""
        return Pong(
            pid=os.getpid(),
            incarnation=self.ref.incarnation,
            imported_at=IMPORTED_AT,
            started_at=self.started_at,
        )
