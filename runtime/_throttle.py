"""Rate-limited logging: a line a peer can cause once per frame is written once per interval.

Anything a peer sends can be sent a million times a second; a warning per frame would let it
fill a disk. Every such line goes through a `Throttle`, which writes the first at once and
then at most one line per interval, saying how many it held back.
"""

from __future__ import annotations

import logging
import time

#: Seconds between two lines of one throttle.
LOG_EVERY = 5.0


class Throttle:
    """At most one log line per ``every`` seconds, counting the ones held back.

    Args:
        logger: Where lines go.
        every: Seconds between two lines.
    """

    __slots__ = ("_every", "_held", "_last", "_logger")

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY) -> None:
        self._logger = logger
        self._every = every
        self._last = -every
        self._held = 0

    def log(
        self, level: int, msg: str, *args: object, exc_info: BaseException | None = None
    ) -> None:
        """Log ``msg % args`` now if the interval has passed, else count it."""
        now = time.monotonic()
        if now - self._last < self._every:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
        if held:
            msg += " (%d more like it in the last %g s)"
            args = (*args, held, self._every)
        self._logger.log(level, msg, *args, exc_info=exc_info)

    def warning(self, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """`log` at WARNING."""
        self.log(logging.WARNING, msg, *args, exc_info=exc_info)

    def error(self, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """`log` at ERROR."""
        self.log(logging.ERROR, msg, *args, exc_info=exc_info)
