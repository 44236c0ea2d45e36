"""``Watch``: a registered interest in one incarnation's death."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

    from ._protocol import Down


class Watch(Awaitable["Down"]):
    """A registered interest in one incarnation's death; ``await`` it for the ``Down``."""

    def __init__(self, future: asyncio.Future[Down], forget: Callable[[], None]) -> None:
        self._future = future
        self._forget = forget

    def __await__(self) -> Generator[Any, None, Down]:
        return self._future.__await__()

    def cancel(self) -> None:
        """Stop watching (nothing of the watch is kept)."""
        self._future.cancel()
        self._forget()

    def on_down(self, callback: Callable[[Down], object]) -> None:
        """Call ``callback`` with the ``Down`` when it comes (from the event loop; at once
        if it came already). Nothing is called once the watch is cancelled."""

        def done(future: asyncio.Future[Down]) -> None:
            if not future.cancelled():
                callback(future.result())

        self._future.add_done_callback(done)
