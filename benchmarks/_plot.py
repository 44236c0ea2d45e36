"""``python -m benchmarks plot results.json [--out DIR]``: PNG charts from a results file.

Without ``--out`` the charts go to ``<name>-charts/`` next to the results file
(``bench-results/results.json`` -> ``bench-results/results-charts/``), so the charts of two
results files never overwrite each other, and ``docs/img`` changes only when asked to.

Charts are described by the suites themselves (``Chart`` in the results), so this module
draws any suite's charts without knowing the suite: one panel per payload, one row of bars
per variant, one bar per metric, baselines in grey, the subject in colour. A ``ROUNDS``
chart draws each figure's rounds as a line instead (a timeline of every kill); a
``STACKED`` chart, one bar per variant made of one segment per metric (the parts of a
whole).

Every chart is drawn for the docs' page: `WIDTH` inches at `DPI`, panels one above the
other, variants down the side where their names have room, and every series and axis
named for people (`METRIC_LABELS`, `UNIT_LABELS`) rather than by the results' keys.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit needed
import matplotlib.pyplot as plt
from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator, NullFormatter
from matplotlib.transforms import offset_copy

from ._console import format_value
from ._results import BASELINE, INFO, ROUNDS, STACKED, SUBJECT

if TYPE_CHECKING:
    from ._results import Chart, Figure, Results, SuiteResult

#: Inches: the PNG is WIDTH * DPI = 1200 pixels wide, which the docs' content column
#: (about 750 pixels) shows at 0.6: a FONT-point label reads at about 12 pixels.
WIDTH = 8.0
DPI = 150
FONT = 10
#: Inches per bar, and around each panel's bars (title, axis, legend).
BAR_HEIGHT = 0.26
PANEL_MARGIN = 1.5

#: What each metric of the suites is, for a legend. A metric not listed is shown as it is,
#: so it must read as words (a test checks every chart of every committed results file).
METRIC_LABELS = {
    "throughput": "throughput",
    "p50": "median (p50)",
    "p90": "p90",
    "p99": "p99",
    "max": "worst (max)",
    "wall": "wall time",
    "rss": "resident (RSS)",
    "pss": "proportional share (PSS)",
    "uss": "its own (USS)",
    "requests_per_s": "measured",
    "projected_rps": "projected, with a core per process",
    "cpu_server_us": "HTTP server process",
    "cpu_worker_us": "tokenizer workers",
    "cpu_detokenizer_us": "detokenizers",
    "cpu_router_us": "router",
    "cpu_scheduler_us": "engine stand-in (scheduler)",
    "cpu_owner_us": "owner, supervisor",
    "cpu_http_us": "llama.cpp HTTP threads",
    "cpu_api_server_us": "vLLM API servers",
    "cpu_engine_client_us": "scheduler (vLLM's keeper, or its client)",
    "cpu_engine_us": "engine",
    "ttft_p50": "first token, p50",
    "ttft_p99": "first token, p99",
    "e2e_p50": "whole request, p50",
    "e2e_p99": "whole request, p99",
    "tpot_p50": "per output token, p50",
}
#: Each unit as a value axis says it: the quantity and its unit.
UNIT_LABELS = {
    "msg/s": "messages per second",
    "req/s": "requests per second",
    "tok/s": "tokens per second",
    "us": "microseconds (µs)",
    "ns": "nanoseconds (ns)",
    "ms": "milliseconds (ms)",
    "s": "seconds (s)",
    "MiB": "memory (MiB)",
    "us/req": "CPU time per request (µs)",
}

# One colour per role when a chart has one metric; one per metric otherwise.
_ROLE_COLOURS = {SUBJECT: "#1f77b4", BASELINE: "#8c8c8c", INFO: "#d0d0d0"}
_ROLE_NAMES = {SUBJECT: "tokenyard", BASELINE: "baseline", INFO: "for context"}
_METRIC_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
_STACK_COLOURS = (
    "#d62728",
    "#c7c7c7",
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
)


def metric_label(metric: str) -> str:
    """A metric as a legend names it."""
    return METRIC_LABELS.get(metric, metric)


def axis_label(unit: str) -> str:
    """A unit as a value axis names it."""
    return UNIT_LABELS.get(unit, unit)


def _short_unit(unit: str) -> str:
    return unit.replace("us", "µs")


def _linear_formatter(top: float) -> Any:
    """Ticks as plain numbers (``0.5``, ``1,500``); with k and M from 10,000 up (``1.5M``),
    where a count's digits would crowd: a millisecond axis never reads ``500m``."""
    if top >= 1e4:
        return EngFormatter(sep="")
    return FuncFormatter(lambda v, _: f"{v:,g}")


def _panels(chart: Chart, figures: list[Figure]) -> list[str]:
    if not chart.panel_by:
        return [""]
    if chart.payloads:
        return list(chart.payloads)
    seen: dict[str, None] = {}
    for fig in figures:
        seen.setdefault(fig.payload, None)
    return list(seen)


def _wrap(label: str, width: int = 26) -> str:
    """Break a long variant name over lines at spaces."""
    return "\n".join(textwrap.wrap(label, width)) or label


def _goal_line(ax: Any, chart: Chart, panel: str, *, across: bool = False) -> float | None:
    """Draw the panel's goal, if it has one (a vertical line, or across the panel for a
    chart of rounds); its value."""
    limit = chart.limits.get(panel)
    if limit is not None:
        (ax.axhline if across else ax.axvline)(
            limit,
            color="#d62728",
            linestyle=":",
            linewidth=1.2,
            label=f"goal: {limit:g} {_short_unit(chart.unit)}",
        )
    return limit


def _variant_axis(ax: Any, variants: list[str], figures: list[Figure]) -> None:
    """Variants down the side, first at the top; tokenyard's own in bold."""
    ax.set_yticks(range(len(variants)))
    ax.set_yticklabels([_wrap(v) for v in variants], fontsize=FONT - 1)
    for tick, variant in zip(ax.get_yticklabels(), variants, strict=True):
        if any(f.role == SUBJECT for f in figures if f.variant == variant):
            tick.set_fontweight("bold")
    ax.set_ylim(len(variants) - 0.5, -0.5)
    ax.tick_params(axis="y", length=0)


def _legend_below(ax: Any, entries: int) -> None:
    """The legend under the value axis's label, whatever the panel's height."""
    if entries:
        below = offset_copy(ax.transAxes, fig=ax.figure, y=-0.5, units="inches")
        ax.legend(
            fontsize=FONT - 1,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            bbox_transform=below,
            ncol=min(entries, 4),
            frameon=False,
        )


def _draw_panel(ax: Any, chart: Chart, figures: list[Figure], panel: str) -> None:
    variants = list(dict.fromkeys(f.variant for f in figures))
    by_cell = {(f.variant, f.metric): f for f in figures}
    height = 0.8 / len(chart.metrics)
    top, bottom = 0.0, float("inf")
    entries = 0
    for j, metric in enumerate(chart.metrics):
        ys, widths, colours, labels = [], [], [], []
        for i, variant in enumerate(variants):
            fig = by_cell.get((variant, metric))
            if fig is None:
                continue
            ys.append(i + (j - (len(chart.metrics) - 1) / 2) * height)
            widths.append(fig.value)
            top, bottom = max(top, fig.value), min(bottom, fig.value)
            if len(chart.metrics) == 1:
                colours.append(_ROLE_COLOURS.get(fig.role, "#8c8c8c"))
            else:
                colours.append(_METRIC_COLOURS[j % len(_METRIC_COLOURS)])
            text = format_value(fig.value, fig.unit).replace(f" {fig.unit}", "")
            if fig.ratios and j == 0:  # the first ratio is the one the figure is read against
                text += f"  ({fig.ratios[0].value:.2f}x {fig.ratios[0].label})"
            labels.append(text)
        bars = ax.barh(
            ys,
            widths,
            height * 0.9,
            color=colours,
            label=metric_label(metric) if len(chart.metrics) > 1 else None,
            edgecolor="black",
            linewidth=0.4,
        )
        entries += len(chart.metrics) > 1
        ax.bar_label(bars, labels=labels, fontsize=FONT - 2, padding=3)
    if chart.reference:
        ref = by_cell.get((chart.reference, chart.metrics[0]))
        if ref is not None:
            ax.axvline(
                ref.value, color="black", linestyle="--", linewidth=0.8, label=chart.reference
            )
            entries += 1
    limit = _goal_line(ax, chart, panel)
    entries += limit is not None
    _variant_axis(ax, variants, figures)
    ax.set_xlabel(axis_label(chart.unit), fontsize=FONT)
    if panel:
        ax.set_title(chart.panel_titles.get(panel, panel), fontsize=FONT + 1)
    if chart.log:
        ax.set_xscale("log")
        # Whole decades, so bar lengths compare honestly; room on the right for the labels.
        ax.set_xlim(10 ** math.floor(math.log10(bottom or 1)), (top or 1) * 12)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_xlim(0, max(top, limit or 0.0) * 1.45 or 1)
        ax.xaxis.set_major_formatter(_linear_formatter(top))
    ax.tick_params(axis="x", labelsize=FONT - 1)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if len(chart.metrics) == 1:
        # Colour means role here: say so, for the roles this panel shows.
        shown = dict.fromkeys(f.role for f in figures)
        for role in (SUBJECT, BASELINE, INFO):
            if role in shown:
                ax.barh([0], [0], height=0, color=_ROLE_COLOURS[role], label=_ROLE_NAMES[role])
                entries += 1
    _legend_below(ax, entries)


def _draw_rounds_panel(ax: Any, chart: Chart, figures: list[Figure], panel: str) -> None:
    """One line per figure: its rounds against their index; baselines grey and dashed."""
    subjects = 0
    positive = [v for fig in figures for v in fig.rounds if v > 0]
    entries = 0
    for fig in figures:
        if not fig.rounds:
            continue
        xs = range(1, len(fig.rounds) + 1)
        if fig.role == SUBJECT:
            colour, style = _METRIC_COLOURS[subjects % len(_METRIC_COLOURS)], "-"
            subjects += 1
        else:
            colour, style = _ROLE_COLOURS.get(fig.role, "#8c8c8c"), "--"
            if fig.role == INFO:
                colour = "#a0a0a0"
        label = (
            fig.variant
            if len(chart.metrics) == 1
            else f"{fig.variant} ({metric_label(fig.metric)})"
        )
        ax.plot(xs, fig.rounds, style, color=colour, marker="o", markersize=3, label=label)
        entries += 1
    limit = _goal_line(ax, chart, panel, across=True)
    entries += limit is not None
    ax.set_xlabel(chart.x_label or "round", fontsize=FONT)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(axis_label(chart.unit), fontsize=FONT)
    if panel:
        ax.set_title(chart.panel_titles.get(panel, panel), fontsize=FONT + 1)
    if chart.log:
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:,g}")
        ax.yaxis.set_major_formatter(plain)
        # Within one decade only the minor ticks are labelled: keep them plain numbers.
        narrow = bool(positive) and max(positive) < 10 * min(positive)
        ax.yaxis.set_minor_formatter(plain if narrow else NullFormatter())
    else:
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(_linear_formatter(max(positive, default=0.0)))
    ax.tick_params(labelsize=FONT - 1)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    if entries:
        ax.legend(
            fontsize=FONT - 2,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            frameon=False,
        )


def _draw_stacked_panel(ax: Any, chart: Chart, figures: list[Figure], panel: str) -> None:
    """One bar per variant, one segment per metric stacked in ``chart.metrics`` order."""
    variants = list(dict.fromkeys(f.variant for f in figures))
    by_cell = {(f.variant, f.metric): f for f in figures}
    lefts = [0.0] * len(variants)
    totals = [
        sum(by_cell[(v, m)].value for m in chart.metrics if (v, m) in by_cell) for v in variants
    ]
    widest = max(totals, default=0.0)
    for j, metric in enumerate(chart.metrics):
        widths = [by_cell[(v, metric)].value if (v, metric) in by_cell else 0.0 for v in variants]
        colour = _STACK_COLOURS[j % len(_STACK_COLOURS)]
        bars = ax.barh(
            range(len(variants)),
            widths,
            0.6,
            left=lefts,
            color=colour,
            label=metric_label(metric),
            edgecolor="black",
            linewidth=0.4,
        )
        # A segment too thin for its number is still in the legend and the table.
        labels = [f"{w:,.0f}" if w >= 0.09 * widest else "" for w in widths]
        ax.bar_label(bars, labels=labels, label_type="center", fontsize=FONT - 2)
        lefts = [a + w for a, w in zip(lefts, widths, strict=True)]
    for i, total in enumerate(lefts):
        ax.text(total, i, f"  {total:,.0f}", ha="left", va="center", fontsize=FONT - 1)
    entries = len(chart.metrics)
    limit = _goal_line(ax, chart, panel)
    entries += limit is not None
    _variant_axis(ax, variants, figures)
    ax.set_xlabel(axis_label(chart.unit), fontsize=FONT)
    ax.set_xlim(0, max([*lefts, limit or 0.0]) * 1.2 or 1)
    ax.xaxis.set_major_formatter(_linear_formatter(max(lefts, default=0.0)))
    ax.tick_params(axis="x", labelsize=FONT - 1)
    if panel:
        ax.set_title(chart.panel_titles.get(panel, panel), fontsize=FONT + 1)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    _legend_below(ax, entries)


def _panel_height(chart: Chart, figures: list[Figure]) -> float:
    """Inches for one panel: its bars, and the title, axis and legend around them."""
    if chart.kind == ROUNDS:
        return 3.6
    variants = len({f.variant for f in figures})
    bars = variants if chart.kind == STACKED else variants * len(chart.metrics)
    rows = max(bars * BAR_HEIGHT, variants * 0.42)  # a wrapped variant name needs two lines
    legend = 0.25 * math.ceil(len(chart.metrics) / 3) if len(chart.metrics) > 1 else 0.25
    return PANEL_MARGIN + rows + legend


def chart_figures(result: SuiteResult, chart: Chart) -> list[Figure]:
    """The figures of ``result`` that ``chart`` draws."""
    return [
        f
        for f in result.figures
        if f.metric in chart.metrics and (not chart.payloads or f.payload in chart.payloads)
    ]


def draw_chart(result: SuiteResult, chart: Chart, out: Path) -> Path:
    """Draw one chart of a suite into ``out`` and return the file written."""
    figures = chart_figures(result, chart)
    panels = _panels(chart, figures)
    members = {
        panel: [f for f in figures if not chart.panel_by or f.payload == panel] for panel in panels
    }
    draw = {ROUNDS: _draw_rounds_panel, STACKED: _draw_stacked_panel}.get(chart.kind, _draw_panel)
    heights = [_panel_height(chart, members[panel]) for panel in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(WIDTH, sum(heights) + 0.5),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
        layout="constrained",
    )
    try:
        for ax, panel in zip(axes[:, 0], panels, strict=True):
            draw(ax, chart, members[panel], panel)
        fig.suptitle("\n".join(textwrap.wrap(chart.title, 80)), fontsize=FONT + 2)
        path = out / f"{chart.name}.png"
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return path


def default_out(results_path: str) -> str:
    """Where ``plot`` draws without ``--out``: ``<name>-charts/`` beside the results file."""
    path = Path(results_path)
    return str(path.with_name(f"{path.stem}-charts"))


def plot_results(results: Results, out: str) -> list[Path]:
    """Draw every chart of every suite in ``results`` into the directory ``out``, but a
    chart with no figure to draw (the engines suite's, when neither engine was there)."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    return [
        draw_chart(result, chart, directory)
        for result in results.suites
        for chart in result.charts
        if chart_figures(result, chart)
    ]
