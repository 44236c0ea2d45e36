"""How many HTTP connections the open-file limit lets the server's processes hold.

Every connection is a descriptor in the process that holds it: a worker's, once it took
the connection, and the port owner's while it waits there, is handed and not yet taken, or
lingers after a 503. Out of descriptors, libzmq aborts the whole process (SIGABRT, ``Too
many open files``) when it cannot get one it needs (a member's new connection to its
mailbox, say), and a worker loses the connections handed to it; so neither may ever hold
more connections than its limit leaves after what its own sockets take. The bounds are
decided once, at start, from the limit every process of the server shares (each takes its
hard limit as its soft one; `runtime.raise_fd_limit`).
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

import msgspec

from ._dispatch import MAX_UNTAKEN
from ._refuse import LINGERING

if TYPE_CHECKING:
    from ._config import ServeConfig

__all__ = ("ConnectionBounds", "connection_bounds", "server_processes")

#: Descriptors a worker's own sockets take, besides one per detokenizer (each sends to
#: it). Measured: 22 idle; 25 with 1 detokenizer and 26 with 2 while streaming (their
#: connections to it, a socket to the scheduler made on first use). The rest is room for
#: a vLLM client's sockets, an import's files, and a peer's restart (its new connection
#: may come before its old one is closed).
WORKER_FDS = 40
WORKER_FDS_PER_DETOKENIZER = 2
#: Descriptors the port's owner takes besides the connections it holds, and those each
#: process of the pipeline costs it. Measured at rest: 55 with 1 worker and 1 detokenizer
#: (5 processes with the router, the scheduler and the fork server), 89 with 4 and 2 (9):
#: about 13, and 9 a process. The rest is room for a member's restart (its pidfd, stdin,
#: channel and connections while the old ones close).
OWNER_FDS = 24
OWNER_FDS_PER_PROCESS = 10


class ConnectionBounds(msgspec.Struct, frozen=True, kw_only=True):
    """What the open-file limit lets each process of the server hold.

    Attributes:
        limit: The open-file limit the bounds were taken from (``None``: unlimited).
        max_connections: Most connections one worker serves at once:
            ``ServeConfig.max_connections``, or fewer when the limit leaves less.
        hold: Most connections the port's owner holds at once, the one it just accepted
            included (waiting, handed and not taken, lingering after a 503), or ``None``
            when the limit sets no bound.
        worker_reserve: Descriptors kept for a worker's own sockets.
        owner_reserve: Descriptors kept for the owner's own sockets.
    """

    limit: int | None
    max_connections: int
    hold: int | None
    worker_reserve: int
    owner_reserve: int

    def lowered(self, config: ServeConfig, workers: int) -> str | None:
        """The warning that the limit bounds the connections below what ``config`` asks
        (one line naming the limit, the bounds used and how to raise it), or ``None``."""
        if self.limit is None or self.hold is None:
            return None
        # What the owner holds at most as configured: the queue, what each worker is
        # handed and has not taken, the refusals lingering, and the one just accepted.
        # Only the queue is a setting: fewer of the others is fewer 503s lingering and
        # more answered at once, not a lower bound than asked for.
        asked = config.max_waiting + workers * MAX_UNTAKEN + LINGERING + 1
        parts = []
        if self.max_connections < config.max_connections:
            parts.append(
                f"each worker serves at most {self.max_connections} connections at once, "
                f"not --max-connections {config.max_connections}"
            )
        if self.hold - 1 < config.max_waiting:
            parts.append(
                f"the port's owner keeps at most {self.hold - 1} connections waiting, not "
                f"--max-waiting {config.max_waiting}"
            )
        if not parts:
            return None
        needed = max(config.max_connections + self.worker_reserve, asked + self.owner_reserve)
        return (
            f"the open-file limit (RLIMIT_NOFILE) is {self.limit}: "
            + " and ".join(parts)
            + "; past that a connection waits or is answered 503. Raise the limit to "
            f"{needed} (ulimit -n {needed}, or LimitNOFILE= under systemd), or lower "
            "--max-connections and --max-waiting to what it allows"
        )


def server_processes(workers: int, detokenizers: int) -> int:
    """The processes of a server of ``workers`` workers and ``detokenizers`` detokenizers:
    the members, the router, the scheduler and the fork server."""
    return workers + detokenizers + 3


def connection_bounds(
    config: ServeConfig, workers: int, detokenizers: int, *, limit: int | None = None
) -> ConnectionBounds:
    """The connections each process of a server of ``workers`` workers and
    ``detokenizers`` detokenizers may hold under the open-file limit ``limit`` (``None``:
    this process's soft ``RLIMIT_NOFILE``, which every process of the server shares).

    A worker's bound is never below 1, the owner's never below 2: a limit too low for the
    processes themselves is refused before anything starts (``check_fd_limit``).
    """
    if limit is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = None if soft == resource.RLIM_INFINITY else soft
    processes = server_processes(workers, detokenizers)
    worker_reserve = WORKER_FDS + WORKER_FDS_PER_DETOKENIZER * detokenizers
    owner_reserve = OWNER_FDS + OWNER_FDS_PER_PROCESS * processes
    if limit is None:
        return ConnectionBounds(
            limit=None,
            max_connections=config.max_connections,
            hold=None,
            worker_reserve=worker_reserve,
            owner_reserve=owner_reserve,
        )
    return ConnectionBounds(
        limit=limit,
        max_connections=max(1, min(config.max_connections, limit - worker_reserve)),
        hold=max(2, limit - owner_reserve),
        worker_reserve=worker_reserve,
        owner_reserve=owner_reserve,
    )
