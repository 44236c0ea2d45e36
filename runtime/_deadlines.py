"""`Deadlines`: the timeouts of a station's pending requests, on one event-loop timer.

A timer of the loop's own per ask (``call_later``, then ``cancel`` when the reply came) cost
the asker about 3 us an ask here: a timer handle, a push onto the loop's heap ordered by
a Python ``__lt__``, and the cancelled handle's removal later. Here an ask's deadline is a
tuple on a heap of its own, ordered in C, and one loop timer is armed for the earliest. An
answered request's entry is not looked for: it is dropped when it reaches the head, or when
the heap is rebuilt with the live entries only, which happens as soon as it holds more than
twice as many entries as there are requests pending (and `SLACK` more): its size stays
bounded by what is pending, however many asks are answered before their deadlines.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Mapping

#: Entries over twice the pending requests a heap may hold before it is rebuilt.
SLACK = 1024

T = TypeVar("T")


class Deadlines(Generic[T]):
    """Expires pending requests past their deadlines.

    Args:
        loop: The loop whose timer fires, and whose clock the deadlines are on.
        pending: The pending requests by key: an entry is live while its key maps to the
            very object it was added with.
        expire: Called with the key and the request of each live entry past its deadline;
            it must take the key out of ``pending``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pending: Mapping[int, T],
        expire: Callable[[int, T], None],
    ) -> None:
        self._loop = loop
        self._pending = pending
        self._expire = expire
        self._heap: list[tuple[float, int, int, T]] = []
        self._order = itertools.count()  # ties of deadlines never compare the requests
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf

    def __len__(self) -> int:
        """Entries held, the answered ones not yet dropped included."""
        return len(self._heap)

    def add(self, key: int, request: T, timeout: float) -> None:
        """Expire ``request`` (pending under ``key``) ``timeout`` seconds from now, unless it
        is answered first (an infinite timeout: never)."""
        when = self._loop.time() + timeout
        heap = self._heap
        heapq.heappush(heap, (when, next(self._order), key, request))
        if when < self._armed_at:
            self._arm(when)
        elif len(heap) > 2 * len(self._pending) + SLACK:
            self._compact()

    def close(self) -> None:
        """Cancel the timer and forget every entry."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_at = math.inf
        self._heap.clear()

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if when == math.inf else self._loop.call_at(when, self._fire)
        self._armed_at = when

    def _compact(self) -> None:
        pending = self._pending
        self._heap = [entry for entry in self._heap if pending.get(entry[2]) is entry[3]]
        heapq.heapify(self._heap)

    def _fire(self) -> None:
        # Whatever was due when the timer was armed is due now (the loop may run a timer a
        # clock tick early).
        limit = max(self._armed_at, self._loop.time())
        self._timer, self._armed_at = None, math.inf
        heap, pending = self._heap, self._pending
        try:
            while heap:
                when, _, key, request = heap[0]
                if pending.get(key) is not request:  # answered, dropped or given up
                    heapq.heappop(heap)
                elif when <= limit:
                    heapq.heappop(heap)
                    self._expire(key, request)
                else:
                    break
        finally:  # the next deadline keeps its timer, whatever ``expire`` raised
            if heap and self._timer is None:
                self._arm(heap[0][0])
