"""`Deadlines`: the timeouts of a station's pending requests, on one event-loop timer.

A timer of the loop's own per ask (``call_later``, then ``cancel`` when the reply came) cost
the asker 1.6 to 2.8 us an ask here, its removal from the loop's heap included: a timer
handle, pushed onto a heap ordered by a Python ``__lt__``. Here an ask's deadline is a
``(deadline, key)`` pair on a heap of its own, ordered in C, and one loop timer is armed for
the earliest: 0.5 to 0.85 us an ask, the heap's rebuilding included. An answered request's
entry is not looked for: it is dropped when it reaches the head, or when the heap is rebuilt
with the live entries only, which happens as soon as it holds more than twice as many
entries as there are requests pending (and `SLACK` more). So it never holds more than twice
the most requests ever pending at once, and `SLACK` more, however many asks are answered
before their deadlines; and an entry holds no reference to its request, nor to the reply it
got.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Sized

#: Entries over twice the pending requests a heap may hold before it is rebuilt.
SLACK = 1024


class Deadlines:
    """Expires pending requests past their deadlines.

    Args:
        loop: The loop whose timer fires, and whose clock the deadlines are on.
        pending: The pending requests (only their number is read, to bound the heap).
        live: Whether the request under a key is still pending with that deadline (the
            deadline `add` returned for it, which its owner keeps with it).
        expire: Called with the key of each live entry past its deadline.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pending: Sized,
        live: Callable[[int, float], bool],
        expire: Callable[[int], None],
    ) -> None:
        self._loop = loop
        self._pending = pending
        self._live = live
        self._expire = expire
        self._heap: list[tuple[float, int]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf

    def __len__(self) -> int:
        """Entries held, the answered ones not yet dropped included."""
        return len(self._heap)

    def add(self, key: int, timeout: float) -> float:
        """Expire the request pending under ``key`` ``timeout`` seconds from now, unless it
        is answered first (an infinite timeout: never); its deadline, on the loop's clock."""
        when = self._loop.time() + timeout
        if len(self._heap) >= 2 * len(self._pending) + SLACK:
            live = self._live
            self._heap = [entry for entry in self._heap if live(entry[1], entry[0])]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (when, key))
        if when < self._armed_at:
            self._arm(when)
        return when

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

    def _fire(self) -> None:
        # Whatever was due when the timer was armed is due now (the loop may run a timer a
        # clock tick early).
        limit = max(self._armed_at, self._loop.time())
        self._timer, self._armed_at = None, math.inf
        heap, live = self._heap, self._live
        try:
            while heap:
                when, key = heap[0]
                if not live(key, when):  # answered, dropped or given up
                    heapq.heappop(heap)
                elif when <= limit:
                    heapq.heappop(heap)
                    self._expire(key)
                else:
                    break
        finally:  # the next deadline keeps its timer, whatever ``expire`` raised
            if heap and self._timer is None:
                self._arm(heap[0][0])
