"""``python -m benchmarks plot results.json [--out DIR]``: PNG charts from a results file.

Without ``--out`` the charts go to ``<name>-charts/`` next to the results file
(``bench-results/results.json`` -> ``bench-results/results-charts/``), so the charts of two
results files never overwrite each other, and ``docs/img`` changes only when asked to.

Charts are described by the suites themselves (``Chart`` in the results), so this module
draws any suite's charts without knowing the suite: one panel per payload, one group of
bars per variant, one bar per metric, baselines in grey, the subject in colour. A
``ROUNDS`` chart draws each figure's rounds as a line instead (a timeline of every kill); a
``STACKED`` chart, one bar per variant made of one segment per metric (the parts of a
whole).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit needed
import matplotlib.pyplot as plt
from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator, NullFormatter

from ._console import format_value
from ._results import BASELINE, INFO, ROUNDS, STACKED, SUBJECT

if TYPE_CHECKING:
    from ._results import Chart, Figure, Results, SuiteResult

# One colour per role when a chart has one metric; one per metric otherwise.
_ROLE_COLOURS = {SUBJECT: "#1f77b4", BASELINE: "#8c8c8c", INFO: "#d0d0d0"}
_ROLE_NAMES = {SUBJECT: "tokenyard", BASELINE: "baseline", INFO: "context"}
_METRIC_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
_STACK_COLOURS = ("#d62728", "#c7c7c7", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")


def _panels(chart: Chart, figures: list[Figure]) -> list[str]:
    if not chart.panel_by:
        return [""]
    if chart.payloads:
        return list(chart.payloads)
    seen: dict[str, None] = {}
    for fig in figures:
        seen.setdefault(fig.payload, None)
    return list(seen)


def _wrap(label: str, width: int = 14) -> str:
    """Break a long variant name over lines at spaces so tick labels do not collide."""
    lines: list[str] = []
    for word in label.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines)


def _draw_panel(ax: Any, chart: Chart, figures: list[Figure], panel: str) -> None:
    variants = list(dict.fromkeys(f.variant for f in figures))
    by_cell = {(f.variant, f.metric): f for f in figures}
    width = 0.8 / len(chart.metrics)
    top, bottom = 0.0, float("inf")
    for j, metric in enumerate(chart.metrics):
        xs, heights, colours, labels = [], [], [], []
        for i, variant in enumerate(variants):
            fig = by_cell.get((variant, metric))
            if fig is None:
                continue
            xs.append(i + (j - (len(chart.metrics) - 1) / 2) * width)
            heights.append(fig.value)
            top, bottom = max(top, fig.value), min(bottom, fig.value)
            if len(chart.metrics) == 1:
                colours.append(_ROLE_COLOURS.get(fig.role, "#8c8c8c"))
            else:
                colours.append(_METRIC_COLOURS[j % len(_METRIC_COLOURS)])
            text = format_value(fig.value, fig.unit).replace(f" {fig.unit}", "")
            if fig.ratios and j == 0:  # the first ratio is the one the figure is read against
                text += f"\n{fig.ratios[0].value:.2f}x {fig.ratios[0].label}"
            labels.append(text)
        bars = ax.bar(
            xs,
            heights,
            width * 0.95,
            color=colours,
            label=metric if len(chart.metrics) > 1 else None,
            edgecolor="black",
            linewidth=0.4,
        )
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    legend = len(chart.metrics) > 1
    if chart.reference:
        ref = by_cell.get((chart.reference, chart.metrics[0]))
        if ref is not None:
            # In the legend, not next to the line: a label there collides with bar labels.
            ax.axhline(
                ref.value, color="black", linestyle="--", linewidth=0.8, label=chart.reference
            )
            legend = True
    limit = chart.limits.get(panel)
    if limit is not None:
        ax.axhline(limit, color="#d62728", linestyle=":", linewidth=1.2, label=f"goal {limit:g}")
        legend = True
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels([_wrap(v) for v in variants], fontsize=8)
    for tick, variant in zip(ax.get_xticklabels(), variants, strict=True):
        if any(f.role == SUBJECT for f in figures if f.variant == variant):
            tick.set_fontweight("bold")
    ax.set_ylabel(chart.unit)
    ax.set_title(chart.panel_titles.get(panel, panel), fontsize=10)
    if chart.log:
        ax.set_yscale("log")
        # Whole decades, so bar heights compare honestly; room above for the labels.
        ax.set_ylim(10 ** math.floor(math.log10(bottom or 1)), (top or 1) * 4)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    else:
        ax.set_ylim(0, top * 1.3 or 1)  # room for the value labels
        ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if len(chart.metrics) == 1:
        # Colour means role here: say so, for the roles this panel shows.
        shown = dict.fromkeys(f.role for f in figures)
        for role in (SUBJECT, BASELINE, INFO):
            if role in shown:
                ax.bar([0], [0], width=0, color=_ROLE_COLOURS[role], label=_ROLE_NAMES[role])
        legend = True
    if legend:
        ax.legend(fontsize=8, loc="upper right", framealpha=0.9)


def _draw_rounds_panel(ax: Any, chart: Chart, figures: list[Figure], panel: str) -> None:
    """One line per figure: its rounds against their index; baselines grey and dashed."""
    subjects = 0
    positive = [v for fig in figures for v in fig.rounds if v > 0]
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
        label = fig.variant if len(chart.metrics) == 1 else f"{fig.variant} ({fig.metric})"
        ax.plot(xs, fig.rounds, style, color=colour, marker="o", markersize=3, label=label)
    limit = chart.limits.get(panel)
    if limit is not None:
        ax.axhline(limit, color="#d62728", linestyle=":", linewidth=1.2, label=f"goal {limit:g}")
    ax.set_xlabel(chart.x_label or "round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(chart.unit)
    ax.set_title(chart.panel_titles.get(panel, panel), fontsize=10)
    if chart.log:
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        # Within one decade only the minor ticks are labelled: keep them plain numbers.
        narrow = bool(positive) and max(positive) < 10 * min(positive)
        ax.yaxis.set_minor_formatter(plain if narrow else NullFormatter())
    else:
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=8, loc="best", framealpha=0.9)


def _draw_stacked_panel(ax: Any, chart: Chart, figures: list[Figure], panel: str) -> None:
    """One bar per variant, one segment per metric stacked in ``chart.metrics`` order."""
    variants = list(dict.fromkeys(f.variant for f in figures))
    by_cell = {(f.variant, f.metric): f for f in figures}
    bottoms = [0.0] * len(variants)
    for j, metric in enumerate(chart.metrics):
        heights = [by_cell[(v, metric)].value if (v, metric) in by_cell else 0.0 for v in variants]
        colour = _STACK_COLOURS[j % len(_STACK_COLOURS)]
        bars = ax.bar(
            range(len(variants)),
            heights,
            0.6,
            bottom=bottoms,
            color=colour,
            label=metric,
            edgecolor="black",
            linewidth=0.4,
        )
        # A segment too thin for its number is still in the legend and the table.
        labels = [f"{h:,.0f}" if h >= 0.06 * max(bottoms + heights) else "" for h in heights]
        ax.bar_label(bars, labels=labels, label_type="center", fontsize=7)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for i, total in enumerate(bottoms):
        ax.text(i, total, f"{total:,.0f}", ha="center", va="bottom", fontsize=8)
    limit = chart.limits.get(panel)
    if limit is not None:
        ax.axhline(limit, color="#d62728", linestyle=":", linewidth=1.2, label=f"goal {limit:g}")
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels([_wrap(v, 18) for v in variants], fontsize=8)
    for tick, variant in zip(ax.get_xticklabels(), variants, strict=True):
        if any(f.role == SUBJECT for f in figures if f.variant == variant):
            tick.set_fontweight("bold")
    ax.set_ylabel(chart.unit)
    ax.set_ylim(0, max([*bottoms, limit or 0.0]) * 1.15 or 1)
    ax.set_title(chart.panel_titles.get(panel, panel), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=8, loc="upper left", framealpha=0.9)


def draw_chart(result: SuiteResult, chart: Chart, out: Path) -> Path:
    """Draw one chart of a suite into ``out`` and return the file written."""
    figures = [
        f
        for f in result.figures
        if f.metric in chart.metrics and (not chart.payloads or f.payload in chart.payloads)
    ]
    panels = _panels(chart, figures)
    if chart.kind == ROUNDS:
        width, draw = 6.5, _draw_rounds_panel
    elif chart.kind == STACKED:
        width, draw = max(5.5, 1.5 + 1.6 * len({f.variant for f in figures})), _draw_stacked_panel
    else:
        bars = len({f.variant for f in figures}) * len(chart.metrics)
        width, draw = max(5.5, 1.0 + 0.8 * bars), _draw_panel  # room for every value label
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.8), squeeze=False)
    try:
        for ax, panel in zip(axes[0], panels, strict=True):
            members = [f for f in figures if not chart.panel_by or f.payload == panel]
            draw(ax, chart, members, panel)
        fig.suptitle(chart.title, fontsize=11)
        fig.tight_layout()
        path = out / f"{chart.name}.png"
        fig.savefig(path, dpi=130)
    finally:
        plt.close(fig)
    return path


def default_out(results_path: str) -> str:
    """Where ``plot`` draws without ``--out``: ``<name>-charts/`` beside the results file."""
    path = Path(results_path)
    return str(path.with_name(f"{path.stem}-charts"))


def plot_results(results: Results, out: str) -> list[Path]:
    """Draw every chart of every suite in ``results`` into the directory ``out``."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    return [
        draw_chart(result, chart, directory) for result in results.suites for chart in result.charts
    ]
