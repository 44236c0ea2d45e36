"""What a recording test actor received, and a way to wait for it (no polling)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

import anyio

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")


class Inbox(Generic[T]):
    """What one fake actor received, and a way to wait until enough has arrived."""

    def __init__(self) -> None:
        self.items: list[T] = []
        self._until: Callable[[list[T]], bool] = lambda _items: False
        self._arrived = anyio.Event()

    def put(self, item: T) -> None:
        self.items.append(item)
        if self._until(self.items):
            self._arrived.set()

    async def wait_until(self, until: Callable[[list[T]], bool], timeout: float = 10.0) -> list[T]:
        """Return the items once ``until(items)`` holds (within ``timeout`` seconds)."""
        if not until(self.items):
            self._until, self._arrived = until, anyio.Event()
            with anyio.fail_after(timeout):
                await self._arrived.wait()
        return self.items
