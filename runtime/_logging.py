"""One log format for every process of a system: `configure_logging`.

A line reads ``2026-12-05 14:03:07.412 WARNING [tokenizer_worker:1] tokenyard.system: ...``:
the local time to the millisecond, the level, the process (an actor process's actor, or the
command: ``serve``, ``node b``) and the logger. Actor processes (`runtime._child`), the
node command and ``python -m actors`` (serve and the main job) all log this way, uvicorn in
the workers included, so the lines of every process interleave readably on one terminal.
"""

from __future__ import annotations

import logging

__all__ = ("DATE_FORMAT", "configure_logging", "log_format", "log_formatter")

DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
"""The date and time of a line; the milliseconds follow it."""


def log_format(process: str) -> str:
    """The format of a line logged in ``process`` (a ``logging`` ``%`` format)."""
    name = process.replace("%", "%%")
    return f"%(asctime)s.%(msecs)03d %(levelname)s [{name}] %(name)s: %(message)s"


def log_formatter(process: str) -> logging.Formatter:
    """The formatter of the lines logged in ``process``."""
    return logging.Formatter(log_format(process), DATE_FORMAT)


def configure_logging(
    level: int | str, process: str, *, handler: logging.Handler | None = None
) -> None:
    """Have the root logger write the system's format at ``level``, as `logging.basicConfig`
    does (nothing changes when the root logger has a handler already).

    Args:
        level: The root logger's level.
        process: What the lines say the process is: its actor, or its command.
        handler: Where the lines go (default: standard error).
    """
    out = logging.StreamHandler() if handler is None else handler
    out.setFormatter(log_formatter(process))
    logging.basicConfig(level=level, handlers=[out])
