"""``python -m runtime top``: a live view of a running system, from its collector.

It attaches to the system with the credentials file the system wrote (``serve
--credentials PATH``, or `ActorSystem.credentials` with the collector's ref, saved with
`Credentials.save`): a file owned by this user and readable by nobody else, never someone
else's. Each refresh asks the collector for a gathering and shows, process by process,
every actor: its mailbox depth and bytes, its rates since the last refresh, its handler
p50 and p99 (over the interval when it handled anything, else over its life), its
process's CPU and memory, and, for a supervised child, its restarts and the last reason;
dead incarnations the collector keeps are shown below the live ones.

Needs ``rich`` (the ``bench`` and ``dev`` extras).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ._collector import GetMetrics
from ._credentials import Credentials
from ._metrics import HistogramSnapshot

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._stats import ActorMetrics, ChildRecord, SystemMetrics

__all__ = ("Frame", "main", "render_frame")


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


def render_frame(frame: Frame) -> Any:
    """The view of one refresh, as a rich renderable."""
    from rich.console import Group
    from rich.table import Table
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

    from rich import box as boxes

    table = Table(expand=True, header_style="bold", box=boxes.SIMPLE_HEAD, pad_edge=False)
    for title, justify in (
        ("pid", "right"),
        ("actor", "left"),
        ("inc", "right"),
        ("queued", "right"),
        ("bytes", "right"),
        ("in/s", "right"),
        ("done/s", "right"),
        ("failed", "right"),
        ("p50", "right"),
        ("p99", "right"),
        ("cpu%", "right"),
        ("rss", "right"),
        ("restarts", "right"),
        ("last reason", "left"),
    ):
        table.add_column(
            title,
            justify=justify,  # type: ignore[arg-type]
            no_wrap=True,
            overflow="ellipsis",
            min_width=24 if title == "last reason" else None,
            ratio=1 if title == "last reason" else None,
        )
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
            table.add_row(
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
                Text(str(restarts), style="bold red" if restarts else ""),
                Text(record.last_reason if record else "", style="red"),
            )
            first = False
    for d in now.dead:
        table.add_row(
            Text(str(d.pid), style="dim"),
            Text(d.actor.ref.name, style="dim strike"),
            Text(str(d.actor.ref.incarnation), style="dim"),
            *[""] * 10,
            Text(f"dead ({d.cause}): {d.reason}", style="dim red"),
        )
    header = Text.assemble(
        ("tokenyard top", "bold"),
        f"  {len(now.processes)} processes, {actors} actors, {len(now.dead)} dead kept",
        f"  (every {seconds:.1f} s)" if seconds else "",
    )
    return Group(header, table)


async def _watch(path: str, interval: float, once: bool, timeout: float) -> int:
    from rich.console import Console
    from rich.live import Live

    from ._system import ActorSystem

    credentials = _load(path)
    if credentials.collector is None:
        sys.stderr.write(
            f"{path} names no metrics collector: the system must save its credentials with "
            "ActorSystem.credentials(collector=...) (serve does, with --credentials)\n"
        )
        return 2
    console = Console()
    async with ActorSystem(name="top", attach=credentials):
        collector: Any = credentials.collector
        ask = GetMetrics(max_age=interval / 2)
        before = None
        now = await collector.ask(ask, timeout=timeout)
        if once:
            console.print(render_frame(Frame(now)))
            return 0
        with Live(render_frame(Frame(now)), console=console, screen=False) as live:
            while True:
                await anyio.sleep(interval)
                before, now = now, await collector.ask(ask, timeout=timeout)
                live.update(render_frame(Frame(now, before)))


def _load(path: str) -> Credentials:
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
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one view and exit")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m runtime top``: watch a running system until interrupted."""
    args = _parser().parse_args(argv)
    try:
        import rich  # noqa: F401
    except ImportError:
        sys.stderr.write("top draws with rich, which is not installed: pip install rich\n")
        return 2
    try:
        return anyio.run(_watch, args.credentials, args.interval, args.once, args.timeout)
    except KeyboardInterrupt:
        return 0
    except (OSError, PermissionError) as err:
        sys.stderr.write(f"cannot attach: {err}\n")
        return 1
