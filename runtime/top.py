"""``python -m runtime top``: a live view of a running system, from its collector.

It attaches to the system with the credentials file the system wrote (``serve
--credentials PATH``, or `ActorSystem.credentials` with the collector's ref, saved with
`Credentials.save`): a file owned by this user and readable by nobody else, never someone
else's. Each refresh asks the collector for a gathering and shows, process by process,
every actor: its mailbox depth and bytes, its rates since the last refresh, its handler
p50 and p99 (over the interval when it handled anything, else over its life), its
process's CPU and memory, and, for a supervised child, its restarts and the last reason;
dead incarnations the collector keeps are shown below the live ones. The table fits the
terminal: a column that does not fit whole is left out, the least useful first (`COLUMNS`).
``q`` quits, from a terminal (read in cbreak mode, restored however the view ends).

Needs ``rich`` (the ``bench`` and ``dev`` extras).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import termios
import tty
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import anyio
import msgspec

from ._collector import GetMetrics
from ._credentials import Credentials
from ._errors import TokenyardError
from ._metrics import HistogramSnapshot
from ._options import seconds

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.table import Table
    from rich.text import Text

    from ._stats import ActorMetrics, ChildRecord, SystemMetrics

__all__ = ("COLUMNS", "Frame", "View", "main", "render_frame")

#: The shortest ``--interval``, in seconds: each refresh asks every process of the system
#: for its statistics, and a shorter interval would load the system it watches.
MIN_INTERVAL = 0.1
#: The narrowest the last reason is shown (it takes whatever width is left beyond).
LAST_REASON_MIN = 16
#: The most width the last reason claims before a column of lower rank is shown.
LAST_REASON_MAX = 24


@dataclass(frozen=True)
class Frame:
    """Two gatherings to show: the latest, and the one before it (for rates)."""

    now: SystemMetrics
    before: SystemMetrics | None = None


def _delta(now: HistogramSnapshot, before: HistogramSnapshot | None) -> HistogramSnapshot:
    if before is None or before.bounds != now.bounds:
        return now
    counts = tuple(a - b for a, b in zip(now.counts, before.counts, strict=True))
    if sum(counts) <= 0:
        return now  # nothing handled meanwhile: its life's distribution says more than none
    return HistogramSnapshot(now.bounds, counts, now.sum - before.sum)


def _time(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f}ms"
    return f"{seconds:.2f}s"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


def _rate(now: float, before: float | None, seconds: float) -> str:
    if before is None or seconds <= 0:
        return "-"
    return f"{max(now - before, 0) / seconds:,.0f}"


@dataclass(frozen=True)
class _Column:
    """A column of the view: its header, and how much it matters when space is short."""

    title: str
    right: bool = True
    #: The width its values usually take (so a column does not come and go as they grow).
    width: int = 0
    #: Lower is dropped sooner when the terminal is narrow; ``None`` is never dropped.
    keep: int | None = None


#: Left to right. The actor is always shown; then, as room allows: queued, done/s, p99,
#: restarts, the last reason and cpu% (80 columns show these), pid, inc, in/s, failed, rss,
#: p50 and bytes.
COLUMNS = (
    _Column("pid", width=7, keep=7),
    _Column("actor", right=False),
    _Column("inc", width=3, keep=8),
    _Column("queued", width=6, keep=1),
    _Column("bytes", width=8, keep=13),
    _Column("in/s", width=7, keep=9),
    _Column("done/s", width=7, keep=2),
    _Column("failed", width=6, keep=10),
    _Column("p50", width=6, keep=12),
    _Column("p99", width=6, keep=3),
    _Column("cpu%", width=4, keep=6),
    _Column("rss", width=8, keep=11),
    _Column("restarts", width=8, keep=4),
    _Column("last reason", right=False, width=LAST_REASON_MIN, keep=5),
)
#: Spaces between two columns (rich's divider and one of padding).
GAP = 2


class View:
    """The view of one refresh, laid out for the console's width when it is drawn: a column
    that does not fit whole is left out (the least useful first, `COLUMNS`), so a number is
    never cut; only the last reason is shortened, with an ellipsis.

    Attributes:
        header: The line above the table.
        live: The rows of the live actors, each with a cell per column of `COLUMNS`.
        dead: The rows of the dead incarnations kept, below them.
    """

    def __init__(self, header: Text, live: list[list[Text]], dead: list[list[Text]]) -> None:
        self.header = header
        self.live = live
        self.dead = dead

    def columns(self, width: int) -> list[int]:
        """The indices of the columns shown at ``width`` cells, left to right."""
        rows = [*self.live, *self.dead]
        natural = [
            max(column.width, len(column.title), *(row[i].cell_len for row in rows))
            for i, column in enumerate(COLUMNS)
        ]
        # The restarts' reasons, as far as they are short; a dead row's is shortened.
        reasons = max((row[-1].cell_len for row in self.live), default=0)
        natural[-1] = min(max(reasons, LAST_REASON_MIN), LAST_REASON_MAX)
        shown = {i for i, column in enumerate(COLUMNS) if column.keep is None}
        used = sum(natural[i] for i in shown) + GAP * (len(shown) - 1)
        ranked = sorted((c.keep, i) for i, c in enumerate(COLUMNS) if c.keep is not None)
        for _, i in ranked:
            if used + GAP + natural[i] <= width:
                shown.add(i)
                used += GAP + natural[i]
        return sorted(shown)

    def table(self, width: int) -> Table:
        """The table, with the columns that fit in ``width`` cells."""
        from rich import box
        from rich.table import Table

        shown = self.columns(width)
        table = Table(
            expand=True,
            header_style="bold",
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=(0, 1, 0, 0),
        )
        for i in shown:
            column = COLUMNS[i]
            flexible = column.title == "last reason"
            table.add_column(
                column.title,
                justify="right" if column.right else "left",
                no_wrap=True,
                overflow="ellipsis" if flexible else "fold",
                min_width=LAST_REASON_MIN if flexible else None,
                ratio=1 if flexible else None,
            )
        for row in (*self.live, *self.dead):
            table.add_row(*(row[i] for i in shown))
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """Draw the header, the table at the console's width, and what it leaves out."""
        from rich.text import Text

        shown = self.columns(options.max_width)
        yield self.header
        yield self.table(options.max_width)
        hidden = [c.title for i, c in enumerate(COLUMNS) if i not in shown]
        if hidden:
            yield Text(f"not shown at this width: {', '.join(hidden)}", style="dim")


def render_frame(frame: Frame) -> View:
    """The view of one refresh, as a rich renderable (laid out at the console's width)."""
    from rich.text import Text

    now, before = frame.now, frame.before
    seconds = now.gathered_at - before.gathered_at if before is not None else 0.0
    old_actors: dict[str, ActorMetrics] = {}
    old_cpu: dict[int, float] = {}
    if before is not None:
        for p in before.processes:
            old_cpu[p.process.pid] = p.process.cpu_seconds
            for a in p.actors:
                old_actors[a.ref.address] = a
    children: dict[str, ChildRecord] = {}
    for p in now.processes:
        for a in p.actors:
            for child in a.children:
                children[child.name] = child

    rows: list[list[Text]] = []
    dead: list[list[Text]] = []
    actors = 0
    for p in sorted(now.processes, key=lambda p: (p.name != now.processes[0].name, p.name)):
        stats = p.process
        cpu_before = old_cpu.get(stats.pid)
        cpu = (
            f"{100 * (stats.cpu_seconds - cpu_before) / seconds:.0f}"
            if cpu_before is not None and seconds > 0
            else "-"
        )
        first = True
        for a in sorted(p.actors, key=lambda a: a.ref.name):
            actors += 1
            old = old_actors.get(a.ref.address)
            box = a.mailbox
            h = _delta(a.handler_seconds, old.handler_seconds if old else None)
            record = children.get(a.ref.name)
            restarts = sum(record.restarts.values()) if record else 0
            cells = [
                str(stats.pid) if first else "",
                a.ref.name,
                str(a.ref.incarnation),
                f"{box.queued:,}",
                _bytes(box.queued_bytes),
                _rate(box.received, old.mailbox.received if old else None, seconds),
                _rate(box.handled, old.mailbox.handled if old else None, seconds),
                f"{box.failed:,}",
                _time(h.quantile(0.5)),
                _time(h.quantile(0.99)),
                cpu if first else "",
                _bytes(stats.rss_bytes) if first else "",
            ]
            rows.append(
                [
                    *map(Text, cells),
                    Text(str(restarts), style="bold red" if restarts else ""),
                    Text(record.last_reason if record else "", style="red"),
                ]
            )
            first = False
    dead.extend(
        [
            Text(str(d.pid), style="dim"),
            Text(d.actor.ref.name, style="dim strike"),
            Text(str(d.actor.ref.incarnation), style="dim"),
            *[Text("") for _ in range(10)],
            Text(f"dead ({d.cause}): {d.reason}", style="dim red"),
        ]
        for d in now.dead
    )
    header = Text.assemble(
        ("tokenyard top", "bold"),
        f"  {len(now.processes)} processes, {actors} actors, {len(now.dead)} dead kept",
        f"  (every {seconds:.1f} s)" if seconds else "",
    )
    return View(header, rows, dead)


async def _watch(
    path: str, credentials: Credentials, interval: float, once: bool, timeout: float
) -> int:
    from rich.console import Console
    from rich.live import Live

    from ._system import ActorSystem

    if credentials.collector is None:
        sys.stderr.write(
            f"{path} names no metrics collector: the system must save its credentials with "
            "ActorSystem.credentials(collector=...) (serve does, with --credentials)\n"
        )
        return 2
    console = Console()
    problem: TokenyardError | None = None
    async with ActorSystem(name="top", attach=credentials):
        collector: Any = credentials.collector
        ask = GetMetrics(max_age=interval / 2)
        try:
            now = await collector.ask(ask, timeout=timeout)
        except TokenyardError as err:
            problem = err
        else:
            if once:
                console.print(render_frame(Frame(now)))
                return 0
            with (
                _keys(sys.stdin) as keys,
                Live(render_frame(Frame(now)), console=console, screen=False) as live,
                anyio.CancelScope() as view,
            ):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_until_stopped, keys, view)
                    try:
                        while True:
                            await anyio.sleep(interval)
                            before, now = now, await collector.ask(ask, timeout=timeout)
                            live.update(render_frame(Frame(now, before)))
                    except TokenyardError as err:
                        problem = err
                        view.cancel()
    if problem is not None:
        sys.stderr.write(f"the system does not answer: {problem}\n")
        return 1
    return 0


@contextlib.contextmanager
def _keys(stdin: TextIO) -> Iterator[int | None]:
    """Standard input's descriptor in cbreak mode (each key as it is typed, not echoed),
    its terminal's mode restored on the way out, whatever ends the view; ``None`` when it
    is not a terminal."""
    try:
        fd = stdin.fileno()
    except (OSError, ValueError):  # closed, or not a file
        yield None
        return
    if not os.isatty(fd):
        yield None
        return
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd, termios.TCSANOW)
    try:
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _until_stopped(keys: int | None, scope: anyio.CancelScope) -> None:
    """End the view on ``q`` (from a terminal), SIGINT, SIGTERM or SIGHUP.

    SIGINT is received here too, not left to asyncio's KeyboardInterrupt: that one cancels
    the main task natively, and a native cancel that lands while an anyio scope is itself
    cancelling (an ask's timeout) can be absorbed, leaving the view running."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                async for _ in signals:
                    scope.cancel()

            tg.start_soon(on_signal)
            while keys is not None:
                await anyio.wait_readable(keys)
                typed = os.read(keys, 64)
                if not typed:
                    break  # the terminal is gone: only a signal ends the view now
                if b"q" in typed.lower():
                    scope.cancel()


def _load(path: str) -> Credentials:
    """The credentials in ``path``.

    Raises:
        OSError: It cannot be read, or belongs to another user, or others can read it.
        msgspec.DecodeError: It is not a credentials file (`msgspec.ValidationError`, a
            subclass, when it is JSON of another shape).
    """
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"{path} belongs to another user: top attaches only to a system of its own user"
        )
    return Credentials.load(path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runtime top", description="a live view of a running tokenyard system"
    )
    parser.add_argument(
        "--credentials",
        required=True,
        metavar="PATH",
        help="the system's credentials file (serve --credentials PATH writes it)",
    )
    parser.add_argument(
        "--interval",
        type=_interval,
        default=1.0,
        metavar="S",
        help=f"seconds between refreshes, at least {MIN_INTERVAL:g} (%(default)s)",
    )
    parser.add_argument("--once", action="store_true", help="print one view and exit")
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=10.0,
        metavar="S",
        help="seconds to wait for an answer, above 0 (%(default)s)",
    )
    return parser


def _interval(text: str) -> float:
    """``--interval``: seconds, at least `MIN_INTERVAL`.

    Raises:
        argparse.ArgumentTypeError: It is not.
    """
    value = seconds(text)
    if value < MIN_INTERVAL:
        raise argparse.ArgumentTypeError(
            f"{text}: give at least {MIN_INTERVAL:g} seconds (each refresh asks every "
            "process of the system for its statistics)"
        )
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m runtime top``: watch a running system until interrupted."""
    args = _parser().parse_args(argv)
    try:
        import rich  # noqa: F401
    except ImportError:
        sys.stderr.write("top draws with rich, which is not installed: pip install rich\n")
        return 2
    try:
        credentials = _load(args.credentials)
    except msgspec.DecodeError as err:  # msgspec.ValidationError among them
        sys.stderr.write(f"cannot attach: {args.credentials} is not a credentials file: {err}\n")
        return 1
    except OSError as err:  # PermissionError among them
        sys.stderr.write(f"cannot attach: {err}\n")
        return 1
    try:
        return anyio.run(
            _watch, args.credentials, credentials, args.interval, args.once, args.timeout
        )
    except KeyboardInterrupt:
        return 0
    except OSError as err:
        sys.stderr.write(f"cannot attach: {err}\n")
        return 1
