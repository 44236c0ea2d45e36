"""The picture of ``python -m runtime top`` in the docs: ``python -m benchmarks._screenshot
--out docs/img/top.png``.

It serves a two-worker pipeline on 127.0.0.1, loads it with the lean HTTP client, SIGKILLs
a worker halfway, waits for its successor, gathers twice one second apart under the load,
renders the view `top` shows for those two gatherings (`runtime.top.render_frame`) with
rich, and draws rich's styled cells with matplotlib: each cell at its column, in its
colour, on a dark terminal background.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING, Any

import anyio

from actors.http import open_server
from actors.http.load import LoadSpec, run_load
from runtime import GetMetrics
from runtime.top import Frame, render_frame

if TYPE_CHECKING:
    from runtime import SystemMetrics

WIDTH = 160
BACKGROUND = "#1e1e1e"
FOREGROUND = "#d4d4d4"


async def gather_frames() -> Frame:
    """Two gatherings of a loaded server that lost a worker to SIGKILL."""
    async with open_server(workers=2, port=0) as server:
        stop = asyncio.Event()
        spec = LoadSpec(url=server.url, concurrency=8, duration=30.0, requests=None)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_load, spec, stop)
            await anyio.sleep(1.0)
            collector: Any = server.pipeline.collector
            await collector.ask(GetMetrics(max_age=0))  # the worker is seen alive
            killed = server.pipeline.kill_worker(1)
            await server.pipeline.wait_worker(1, after=killed.incarnation)
            await anyio.sleep(1.0)
            before: SystemMetrics = await collector.ask(GetMetrics(max_age=0))
            await anyio.sleep(1.0)
            now: SystemMetrics = await collector.ask(GetMetrics(max_age=0))
            stop.set()
    return Frame(now, before)


def draw(frame: Frame, out: str) -> None:
    """Render ``frame`` as top does and draw it into a PNG at ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.segment import Segment
    from rich.terminal_theme import MONOKAI

    console = Console(width=WIDTH, color_system="truecolor", force_terminal=True)
    lines = console.render_lines(render_frame(frame), console.options, pad=False)
    rows = len(lines)
    # A cell is one advance of DejaVu Sans Mono (0.602 em): the font size follows from it.
    cell_w, cell_h = 0.0625, 0.15
    size = cell_w * 72 / 0.602
    fig = plt.figure(figsize=(WIDTH * cell_w + 0.4, rows * cell_h + 0.4), dpi=130)
    fig.patch.set_facecolor(BACKGROUND)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-2, WIDTH + 2)
    ax.set_ylim(rows + 1, -1)
    ax.axis("off")
    for y, line in enumerate(lines):
        x = 0
        for segment in Segment.simplify(line):
            text, style = segment.text, segment.style
            color = FOREGROUND
            weight = "normal"
            if style is not None:
                if style.color is not None:
                    color = style.color.get_truecolor(MONOKAI).hex
                if style.dim:
                    color = "#808080"
                if style.bold:
                    weight = "bold"
            if text.strip():
                ax.text(
                    x,
                    y,
                    text,
                    family="DejaVu Sans Mono",
                    fontsize=size,
                    color=color,
                    weight=weight,
                    va="top",
                    ha="left",
                )
            x += segment.cell_length
    fig.savefig(out, facecolor=BACKGROUND)


def main() -> None:
    """Draw the screenshot."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._screenshot")
    parser.add_argument("--out", default="docs/img/top.png", help="the PNG to write")
    args = parser.parse_args()
    frame = anyio.run(gather_frames)
    draw(frame, args.out)


if __name__ == "__main__":
    main()
