"""One log format for every process of a system: `configure_logging`.

A line reads ``2026-12-05 14:03:07.412 WARNING [tokenizer_worker:1] tokenyard.system: ...``:
the local time to the millisecond, the level, the process (an actor process's actor, or the
command: ``serve``, ``node b``) and the logger. Actor processes (`runtime._child`), the
node command and ``python -m actors`` (serve and the main job) all log this way, uvicorn in
the workers included, so the lines of every process interleave readably on one terminal.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import sys
import threading

__all__ = (
    "DATE_FORMAT",
    "LOG_BACKLOG",
    "LOG_FLUSH_TIMEOUT",
    "StandardErrorHandler",
    "configure_logging",
    "log_format",
    "log_formatter",
)

LOG_BACKLOG = 10_000
"""Lines a process keeps while its standard error takes none (a pipe nobody reads): the
lines past them are dropped, and counted."""

LOG_FLUSH_TIMEOUT = 2.0
"""Seconds a flush (the one at the process's exit included) waits for the lines kept to be
written; what is left then is dropped."""

DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
"""The date and time of a line; the milliseconds follow it."""


def log_format(process: str) -> str:
    """The format of a line logged in ``process`` (a ``logging`` ``%`` format)."""
    name = process.replace("%", "%%")
    return f"%(asctime)s.%(msecs)03d %(levelname)s [{name}] %(name)s: %(message)s"


def log_formatter(process: str) -> logging.Formatter:
    """The formatter of the lines logged in ``process``."""
    return logging.Formatter(log_format(process), DATE_FORMAT)


class StandardErrorHandler(logging.Handler):
    """Writes each line to standard error from a thread of its own, so that logging never
    waits for whoever reads it.

    A line written to a pipe nobody reads (``serve 2>&1 | a-reader-that-stalled``, a
    supervisor's log collector that hangs) waits once the pipe's 64 KiB are full; written
    where it is logged, it would hold that process's event loop, and every process of a
    system shares the pipe: the whole server would stop serving, and stopping, until
    someone read. Here a line is queued and the thread writes it; past `LOG_BACKLOG` lines
    queued, lines are dropped, and once the pipe takes lines again one says how many.

    Args:
        fd: The descriptor written to (standard error's).
        encoding: How lines are encoded (standard error's).
    """

    def __init__(self, fd: int, encoding: str) -> None:
        super().__init__()
        self.fd = fd
        self.encoding = encoding
        self._start()
        os.register_at_fork(after_in_child=self._start)

    def _start(self) -> None:
        """No line queued, and no writer yet (in a forked child: none of its parent's)."""
        # Reentrant, as `logging.Handler`'s own lock: a line logged by a signal handler
        # that interrupted this thread's `emit` must not wait for itself.
        self._ready = threading.Condition(threading.RLock())
        self._lines: collections.deque[str] = collections.deque()
        self._dropped = 0
        self._writing = False
        self._writer: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:
        """Queue the record's line for the writer thread (drop it if the queue is full)."""
        try:
            line = self.format(record) + "\n"
        except Exception:  # noqa: BLE001 - logging's own way: reported, never raised
            self.handleError(record)
            return
        with self._ready:
            if len(self._lines) >= LOG_BACKLOG:
                self._dropped += 1
                return
            self._lines.append(line)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_lines, name="tokenyard-log-writer", daemon=True
                )
                self._writer.start()
            self._ready.notify_all()

    def _write_lines(self) -> None:
        while True:
            with self._ready:
                while not self._lines:
                    self._writing = False
                    self._ready.notify_all()
                    self._ready.wait()
                lines, dropped = list(self._lines), self._dropped
                self._lines.clear()
                self._dropped = 0
                self._writing = True
            if dropped:
                lines.insert(0, f"[{dropped} log lines dropped: standard error took none]\n")
            data = "".join(lines).encode(self.encoding, "backslashreplace")
            # A standard error that is gone (closed, a pipe whose reader left) takes nothing.
            with contextlib.suppress(OSError):
                while data:
                    data = data[os.write(self.fd, data) :]

    def flush(self) -> None:
        """Wait until the lines queued are written, for at most `LOG_FLUSH_TIMEOUT` s."""
        with self._ready:
            self._ready.wait_for(
                lambda: not self._lines and not self._writing, timeout=LOG_FLUSH_TIMEOUT
            )


def standard_error_handler() -> logging.Handler:
    """A `StandardErrorHandler` on this process's standard error; a `logging.StreamHandler`
    when standard error is no file of the system (a test's in-memory stream in its place)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # None, closed, in memory
        return logging.StreamHandler()
    return StandardErrorHandler(fd, sys.stderr.encoding or "utf-8")


def configure_logging(
    level: int | str, process: str, *, handler: logging.Handler | None = None
) -> None:
    """Have the root logger write the system's format at ``level``, as `logging.basicConfig`
    does (nothing changes when the root logger has a handler already).

    Args:
        level: The root logger's level.
        process: What the lines say the process is: its actor, or its command.
        handler: Where the lines go (default: standard error, written by a thread of
            this process: a `StandardErrorHandler`).
    """
    out = standard_error_handler() if handler is None else handler
    out.setFormatter(log_formatter(process))
    logging.basicConfig(level=level, handlers=[out])
