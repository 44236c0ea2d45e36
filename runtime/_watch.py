"""``Watch``: a registered interest in one incarnation's death."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

    from ._protocol import Down


class Watch(Awaitable["Down"]):
    """A registered interest in one incarnation's death; ``await`` it for the ``Down``."""

    def __init__(self, future: asyncio.Future[Down]) -> None:
        self._future = future

    def __await__(self) -> Generator[Any, None, Down]:
        return self._future.__await__()

    def cancel(self) -> None:
        """Stop watching."""
        self._future.cancel()

    def on_down(self, callback: Callable[[Down], object]) -> None:
        """Call ``callback`` with the ``Down`` when it comes (from the event loop; at once
        if it came already). Nothing is called once the watch is cancelled."""

        def done(future: asyncio.Future[Down]) -> None:
            if not future.cancelled():
                callback(future.result())

        self._future.add_done_callback(done)
