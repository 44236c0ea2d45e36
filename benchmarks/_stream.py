"""Drivers that report progress while they run, for suites whose steps are slow (a kill, a
spawn of 16 processes).

A driver writes one ``STEP`` line to stdout when a step ends (``step()``) and, last, its
``Report`` as one JSON line. ``run_reporting_driver`` reads both pipes as they fill, so the
suite's progress bar moves per step and a chatty stderr (the runtime logs every death)
never blocks the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import anyio
import msgspec

from ._proc import BenchmarkError, reap

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable, Sequence

    from ._suite import Progress

#: Prefix of a progress line; a ``Report`` is JSON and never starts with it.
STEP = "step "


class Report(msgspec.Struct, kw_only=True):
    """What a reporting driver prints last (one JSON line).

    Attributes:
        samples: Series of measurements, each in the order taken (``"down"``: one value
            per kill), in milliseconds, or in kB for memory.
        values: Single numbers (a resident set size in kB, a count).
    """

    samples: dict[str, list[float]] = msgspec.field(default_factory=dict)
    values: dict[str, float] = msgspec.field(default_factory=dict)


def step(label: str) -> None:
    """Driver side: say that a step just ended (the suite advances its bar)."""
    sys.stdout.write(f"{STEP}{label}\n")
    sys.stdout.flush()


def emit(report: Report) -> None:
    """Driver side: print the report, the last line the suite reads."""
    sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    sys.stdout.flush()


def run_role(
    role: Callable[[argparse.Namespace], Awaitable[Report]], opts: argparse.Namespace
) -> int:
    """Driver side: run an async role and print its report; return the exit status.

    SIGTERM (the suite reaping the driver: Ctrl-C, a timeout) cancels the role, so every
    ``async with ActorSystem()`` in it stops its actors and removes its directory before
    the process exits, instead of dying with them in place.
    """

    async def until_sigterm() -> Report:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await role(opts)

    try:
        emit(anyio.run(until_sigterm))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    return 0


def advancing(progress: Progress, phase: str) -> Callable[[str], None]:
    """Start ``phase`` on the bar; return an ``on_step`` that advances it per driver step."""
    progress.step(phase)

    def on_step(label: str) -> None:
        progress.advance()
        progress.step(f"{phase}: {label}")

    return on_step


def _pump(
    proc: subprocess.Popen[bytes], timeout: float, on_step: Callable[[str], None]
) -> tuple[list[str], bytes]:
    """Read stdout lines and stderr until both close; call ``on_step`` per progress line."""
    assert proc.stdout is not None
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    pending = b""
    err = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.fileobj is proc.stderr:
                    err += chunk
                else:
                    pending += chunk
                    *done, pending = pending.split(b"\n")
                    for raw in done:
                        line = raw.decode(errors="replace")
                        if line.startswith(STEP):
                            on_step(line[len(STEP) :])
                        elif line.strip():
                            lines.append(line)
    if pending.strip():
        lines.append(pending.decode(errors="replace"))
    return lines, bytes(err)


def run_reporting_driver(
    cmd: Sequence[str], timeout: float, on_step: Callable[[str], None], env: dict[str, str]
) -> Report:
    """Run a reporting driver to completion, calling ``on_step`` as its steps end.

    The driver leads a session of its own, so whatever it leaves behind is killed with it
    (``benchmarks._proc.reap``), even on Ctrl-C.

    Raises:
        BenchmarkError: It exited with an error, ran past ``timeout`` seconds, or printed
            no report.
    """
    what = " ".join(cmd[2:])
    proc = subprocess.Popen(
        list(cmd),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        lines, err = _pump(proc, timeout, on_step)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    except subprocess.TimeoutExpired:
        raise BenchmarkError(
            f"{what} did not finish within {timeout:g} s; pass smaller sizes or check "
            "that the machine is not overloaded"
        ) from None
    finally:
        reap(proc, group=True)
    text = err.decode(errors="replace").strip()
    if proc.returncode != 0:
        raise BenchmarkError(f"{what} exited with status {proc.returncode}:\n{text[-3000:]}")
    if not lines:
        raise BenchmarkError(f"{what} printed no report:\n{text[-3000:]}")
    return msgspec.json.decode(lines[-1], type=Report)
