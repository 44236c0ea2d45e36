"""``Refuser``: answers a connection 503 on the port owner's behalf, without a worker.

When every worker is full and the owner's own queue of waiting connections is too, a new
connection is answered at once (503, ``Retry-After`` and, as every answer, an
``X-Request-Id``: a new one each time) rather than left in the listen backlog, where its
client would wait unseen until it gave up. The answer is written and the sending side
shut; what the client had sent, or still sends, is read and dropped until it closes or
`LINGER` seconds pass, so that closing with unread bytes does not reset the connection
before the client has read the answer (nginx's lingering close, for the same reason). At
most ``limit`` connections linger, and none when the owner needs its descriptors; past
that one is closed right after its answer (and what its client had sent already).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._errors import HTTPError

__all__ = ("LINGER", "LINGERING", "Refuser")

#: Seconds a refused connection is read from before it is closed.
LINGER = 2.0
#: Most refused connections lingering at once, by default.
LINGERING = 256


class Refuser:
    """Answers connections with one refusal and closes them, lingering (see the module).

    Args:
        error: The refusal, written to each connection with a new ``X-Request-Id``.
        limit: Most connections lingering at once.
    """

    def __init__(self, error: HTTPError, *, limit: int = LINGERING) -> None:
        self.error = error
        self.limit = limit
        #: Connections answered.
        self.refused = 0
        self._lingering: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def lingering(self) -> int:
        """Connections answered and not yet closed."""
        return len(self._lingering)

    def refuse(self, conn: socket.socket, *, linger: bool = True) -> None:
        """Answer ``conn`` and close it (now, or once its client closes or `LINGER` passes).

        Call it from the event loop that owns the connections.

        Args:
            conn: The connection.
            linger: Whether it may linger (``False``: its descriptor is needed now).
        """
        self.refused += 1
        try:
            conn.send(self.error.response())  # small: a fresh socket's buffer takes it
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        if not linger or len(self._lingering) >= self.limit:
            # What the client sent already (a request's head, at most a few reads of it)
            # is read first: closed with bytes unread, the connection would be reset.
            with contextlib.suppress(OSError):
                conn.setblocking(False)
                for _ in range(4):
                    if not conn.recv(65536):
                        break
            conn.close()
            return
        loop = self._loop = self._loop or asyncio.get_running_loop()
        fd = conn.fileno()
        timer = loop.call_later(LINGER, self._close, fd)
        self._lingering[fd] = (conn, timer)
        loop.add_reader(fd, self._read, fd)

    def _read(self, fd: int) -> None:
        entry = self._lingering.get(fd)
        if entry is None:
            return
        try:
            data = entry[0].recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(fd)

    def _close(self, fd: int) -> None:
        entry = self._lingering.pop(fd, None)
        if entry is None:
            return
        conn, timer = entry
        timer.cancel()
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(fd)
        conn.close()

    def close(self) -> None:
        """Close every lingering connection now."""
        for fd in list(self._lingering):
            self._close(fd)
