"""The stop signals (SIGINT, SIGTERM, SIGHUP) of ``python -m actors``, held from its first
import until its command watches for them itself.

``python -m actors serve`` and the main job stop cleanly on a signal once their signal
receivers are open (`open_stop_signals`). Before that, Python imports for a few tenths of a
second: a Ctrl-C there was a ``KeyboardInterrupt`` traceback from some import, and a
SIGTERM killed the process with no word. Nothing has started by then, so such a signal is
held instead (`hold`, the first thing the package does when it is the program) and given to
the receivers once they are open, where it stops the start the way a later one does (the
same signal sent again before then acts at once, as if nothing held it). A
command that watches for no signal of its own (``load``, ``make-model``) gets Python's
behaviour back at once (`release`), a signal held meanwhile included.

Only the program ``python -m actors`` holds: a process that imports the package (an
application, a test, an actor's process) keeps its signals as they are.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Sequence
    from types import FrameType

__all__ = ("STOP_SIGNALS", "hold", "open_stop_signals", "release")

#: The signals that stop ``serve`` (a drain, once it serves) and the main job.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: Signals received while held, in order.
_held: list[int] = []
#: What each held signal's handler was before (only those `hold` replaced).
_before: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}


def _record(signum: int, frame: FrameType | None) -> None:
    if signum in _held:
        # Sent again: the start has not got as far as its receivers (a check that hangs,
        # a slow disk), and whoever sends it wants it now: Python's behaviour, at once.
        release()
        return
    _held.append(signum)


def _is_the_program() -> bool:
    """Whether this import is Python locating ``python -m actors``'s ``__main__``: it sets
    ``sys.argv[0]`` to ``"-m"`` meanwhile, and the item of the original command line just
    before the program's arguments names the module (``actors``, or ``-mactors``)."""
    if sys.argv[:1] != ["-m"] or len(sys.orig_argv) < len(sys.argv):
        return False
    return sys.orig_argv[-len(sys.argv)].removeprefix("-m") == "actors"


def hold() -> None:
    """Hold the stop signals when this process is ``python -m actors`` (else do nothing).

    A signal this process ignores (``nohup``, a shell's background job) stays ignored.
    """
    if _before or not _is_the_program():
        return
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
            _before[signum] = signal.signal(signum, _record)


def release() -> None:
    """Give the held signals their handlers back, then raise again each one held
    meanwhile, which acts as it would have then (Ctrl-C: ``KeyboardInterrupt``)."""
    for signum, before in _before.items():
        signal.signal(signum, before)
    _before.clear()
    _raise_held()


@contextlib.contextmanager
def open_stop_signals() -> Iterator[AsyncIterator[int]]:
    """`anyio.open_signal_receiver` for the `STOP_SIGNALS` this process does not ignore
    (`watched`), which first receives those held since `hold` (raised again once it is
    open: they arrive as if sent then).

    Yields:
        The receiver.
    """
    import anyio  # here: this module is imported before any other, to hold at once

    with anyio.open_signal_receiver(*watched()) as signals:
        _before.clear()  # the receiver's handlers replaced `_record`; its end restores Python's
        _raise_held()
        yield signals


def watched(signals: Sequence[signal.Signals] = STOP_SIGNALS) -> tuple[signal.Signals, ...]:
    """Those of ``signals`` this process does not ignore: one it was started ignoring
    (SIGHUP under ``nohup``, SIGINT in a shell's background job) stays ignored, as `hold`
    leaves it."""
    return tuple(s for s in signals if signal.getsignal(s) != signal.SIG_IGN)


def _raise_held() -> None:
    held = list(_held)
    _held.clear()
    for signum in held:
        signal.raise_signal(signum)


# Imported first by the package: the signals are held before the imports that take time.
hold()
