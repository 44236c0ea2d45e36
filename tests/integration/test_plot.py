"""``benchmarks._plot``: charts that read at the docs' page width, in words, drawn from the
committed results files (no benchmark runs here)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from benchmarks import engines
from benchmarks._plot import (
    DPI,
    METRIC_LABELS,
    UNIT_LABELS,
    WIDTH,
    axis_label,
    metric_label,
    plot_results,
)
from benchmarks._results import Results, SuiteResult, read_results

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.json"))
#: The PNGs of docs/img that are not benchmark charts.
NOT_CHARTS = {"top.png"}


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, from its header."""
    header = path.read_bytes()[:24]
    assert header.startswith(b"\x89PNG\r\n\x1a\n"), path
    width, height = struct.unpack(">II", header[16:24])
    return width, height


@pytest.mark.parametrize("results", RESULTS, ids=lambda p: p.name)
def test_every_chart_names_its_series_and_its_axis_in_words(results: Path) -> None:
    for suite in read_results(str(results)).suites:
        for chart in suite.charts:
            assert chart.unit in UNIT_LABELS, (chart.name, chart.unit)
            for metric in chart.metrics:
                assert "_" not in metric_label(metric), (chart.name, metric)


def test_the_words_name_the_unit_too() -> None:
    for unit in UNIT_LABELS:
        shown = axis_label(unit)
        assert shown != unit
        assert shown.endswith(")") or "per" in shown, shown
    assert "µs" in axis_label("us/req")
    assert metric_label("requests_per_s") == METRIC_LABELS["requests_per_s"] == "measured"


def test_the_docs_charts_are_as_wide_as_the_page_shows_them() -> None:
    charts = [p for p in sorted((ROOT / "docs" / "img").glob("*.png")) if p.name not in NOT_CHARTS]
    assert charts
    widths = {p.name: png_size(p)[0] for p in charts}
    assert set(widths.values()) == {int(WIDTH * DPI)}, widths


@pytest.mark.timeout(120)
def test_every_chart_of_the_committed_results_is_drawn_at_page_width(tmp_path: Path) -> None:
    (results,) = (p for p in RESULTS if p.name == "bench-2026-12-04-all.json")
    paths = plot_results(read_results(str(results)), str(tmp_path))
    assert len(paths) == 16
    for path in paths:
        width, height = png_size(path)
        assert width == int(WIDTH * DPI), path.name
        assert height <= 3 * width, path.name  # the tallest, 3 panels of 4 bars a row, is 2.5


def test_a_suite_that_measured_nothing_draws_no_chart_and_stops_no_other(
    tmp_path: Path,
) -> None:
    # The engines suite where neither llama.cpp nor vLLM is installed: its charts, no figures.
    (results,) = (p for p in RESULTS if p.name == "bench-2026-12-04-all.json")
    every = read_results(str(results))
    dispatch = next(s for s in every.suites if s.suite == "dispatch")
    nothing = SuiteResult(
        suite="engines", duration_s=0.1, params={}, figures=[], charts=list(engines.CHARTS)
    )
    two = Results(started=every.started, argv=[], machine=every.machine, suites=[nothing, dispatch])
    paths = plot_results(two, str(tmp_path))
    assert [p.name for p in paths] == [f"{c.name}.png" for c in dispatch.charts]
