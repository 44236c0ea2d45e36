"""The runtime's metric primitives: histograms and their quantiles, families in a registry,
and summing families over processes."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

import runtime._metrics
from runtime import Throttle
from runtime._metrics import (
    POW2_BOUNDS,
    POW2_SLOTS,
    Histogram,
    Registry,
    merge,
    pow2_snapshot,
)


class TestHistograms:
    def test_a_value_on_a_bound_counts_in_that_bounds_bucket(self) -> None:
        h = Histogram([1.0, 2.0])
        for v in (0.5, 1.0, 1.5, 2.0, 9.0):
            h.observe(v)
        snap = h.snapshot()
        assert snap.counts == (2, 2, 1)
        assert snap.count == 5
        assert snap.sum == 14.0

    def test_quantiles_interpolate_within_their_bucket_and_nan_when_empty(self) -> None:
        h = Histogram([1.0, 2.0, 4.0])
        for v in (0.5, 1.5, 1.5, 3.0):
            h.observe(v)
        snap = h.snapshot()
        assert snap.quantile(0.5) == pytest.approx(1.5)
        assert 2.0 < snap.quantile(0.99) <= 4.0
        assert math.isnan(Histogram([1.0]).snapshot().quantile(0.5))

    def test_a_power_of_two_histogram_folds_every_long_duration_into_inf(self) -> None:
        slots = [0] * POW2_SLOTS
        for ns in (500, 1_500, 3_000, 40 * 10**9):
            slots[(ns // 1000).bit_length()] += 1
        snap = pow2_snapshot(slots, 500 + 1_500 + 3_000 + 40 * 10**9)
        assert snap.bounds == POW2_BOUNDS
        assert snap.counts[:3] == (1, 1, 1)
        assert snap.counts[-1] == 1
        assert snap.count == 4

    def test_bounds_must_ascend(self) -> None:
        with pytest.raises(ValueError, match="ascend"):
            Histogram([2.0, 1.0])


class TestFamilies:
    def test_asking_twice_for_a_name_gives_the_same_family(self) -> None:
        registry = Registry()
        first = registry.counter("c_total", "help", ["k"])
        first.labels("a").inc(2)
        assert registry.counter("c_total", "help", ["k"]) is first
        with pytest.raises(ValueError, match="already a counter"):
            registry.gauge("c_total", "help", ["k"])
        with pytest.raises(ValueError, match="labels"):
            first.labels("a", "b")

    @pytest.mark.parametrize(
        ("make", "why"),
        [
            (lambda r: r.counter("my-requests_total", "h"), "not a metric name"),
            (lambda r: r.counter("c_total", "h", ["route-name"]), "not a label name"),
            (lambda r: r.counter("c_total", "h", ["__name"]), "not a label name"),
            (lambda r: r.counter("c_total", "h", ["k", "k"]), "a label named twice"),
            (lambda r: r.histogram("h_seconds", "h", [1.0], ["le"]), "'le' labels its buckets"),
            (lambda r: r.histogram("h_seconds", "h", [1.0, math.inf]), "not all finite"),
            (lambda r: r.histogram("h_seconds", "h", [2.0, 1.0]), "ascend"),
        ],
    )
    def test_a_family_the_text_format_cannot_carry_is_refused(self, make: Any, why: str) -> None:
        """Before, each was rendered wrong: a hyphen turned into an underscore (two
        families of one name), a histogram's own ``le`` label lost its buckets."""
        with pytest.raises(ValueError, match=why):
            make(Registry())

    def test_a_histogram_asked_again_with_other_bounds_is_refused(self) -> None:
        registry = Registry()
        registry.histogram("h_seconds", "h", [1.0, 2.0])
        with pytest.raises(ValueError, match="bounds"):
            registry.histogram("h_seconds", "h", [1.0, 5.0])

    def test_a_counter_never_goes_down(self) -> None:
        served = Registry().counter("served_total", "h").labels()
        with pytest.raises(ValueError, match="only goes up"):
            served.inc(-5)
        with pytest.raises(ValueError, match="only goes up"):
            served.inc(math.nan)
        served.inc(0)
        assert served.value == 0

    def test_a_gauge_with_a_function_is_read_when_snapshotted(self) -> None:
        registry = Registry()
        depth = [3]
        registry.gauge("g", "help").labels().set_function(lambda: depth[0])
        depth[0] = 7
        (family,) = registry.snapshot()
        assert family.series[0].value == 7

    def test_a_counter_with_a_function_is_read_when_snapshotted_and_left_out_when_it_fails(
        self, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The failure's log is throttled per process: another test's may have just used it.
        fresh = Throttle(logging.getLogger("tokenyard.metrics"))
        monkeypatch.setattr(runtime._metrics, "_failed_functions", fresh)
        registry = Registry()
        counts: dict[str, int] = {"kept": 4}
        family = registry.counter("c_total", "help", ["what"])
        family.labels("kept").set_function(lambda: counts["kept"])
        family.labels("broken").set_function(lambda: counts["broken"])
        family.labels("plain").inc(2)
        counts["kept"] = 9
        (snapshot,) = registry.snapshot()
        assert {s.labels: s.value for s in snapshot.series} == {("kept",): 9, ("plain",): 2}
        assert "counter c_total('broken',) left out" in caplog.text

    def test_families_of_several_processes_add_up_by_labels(self) -> None:
        one, two = Registry(), Registry()
        for registry, n in ((one, 1), (two, 2)):
            registry.counter("c_total", "help", ["worker"]).labels(n).inc(n)
            registry.counter("c_total", "help", ["worker"]).labels("all").inc(10)
            registry.histogram("h", "help", [1.0], ["m"]).labels("x").observe(n * 0.75)
        (counter, histogram) = sorted(merge([one.snapshot(), two.snapshot()]), key=lambda f: f.name)
        values = {s.labels: s.value for s in counter.series}
        assert values == {("1",): 1, ("2",): 2, ("all",): 20}
        (series,) = histogram.series
        assert series.histogram is not None
        assert series.histogram.counts == (1, 1)
        assert series.histogram.sum == pytest.approx(2.25)
