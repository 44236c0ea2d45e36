"""Tests for `benchmarks._stats`: the one nearest-rank quantile rule every figure uses."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks._stats import nearest_rank_quantile

PROPERTY = settings(max_examples=200, deadline=None)
ONE_TO_100 = list(range(1, 101))

samples = st.lists(
    st.floats(allow_nan=False) | st.integers(-(10**6), 10**6).map(float), min_size=1, max_size=60
)
#: A quantile as people write one: k / 10**d, exactly, with the float that prints as it.
decimal_quantiles = st.integers(0, 4).flatmap(
    lambda d: st.integers(1, 10**d).map(lambda k: Fraction(k, 10**d))
)


def by_definition(values: list[float], q: Fraction) -> float:
    """The smallest sample with at least q·n samples at or below it, by brute force."""
    n = len(values)
    return min(x for x in values if sum(v <= x for v in values) >= q * n)


class TestWorkedExamples:
    """The figures people check by hand."""

    @pytest.mark.parametrize(
        ("q", "expected"),
        [(0.5, 50), (0.9, 90), (0.99, 99), (1.0, 100), (0.01, 1), (0.001, 1), (0.07, 7)],
        ids=["p50", "p90", "p99", "p100", "p1", "p0.1", "p7"],
    )
    def test_of_one_to_100_it_is_the_sample_of_rank_q_times_100(
        self, q: float, expected: int
    ) -> None:
        assert nearest_rank_quantile(ONE_TO_100, q) == expected

    def test_the_order_of_the_samples_does_not_matter(self) -> None:
        shuffled = ONE_TO_100[::-1][50:] + ONE_TO_100[::-1][:50]
        assert nearest_rank_quantile(shuffled, 0.99) == 99

    def test_the_median_of_an_even_count_is_the_lower_middle_sample_not_a_mean(self) -> None:
        assert nearest_rank_quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0

    def test_with_fewer_than_100_samples_p99_is_the_max(self) -> None:
        twenty = [float(x) for x in range(20)]
        assert nearest_rank_quantile(twenty, 0.99) == nearest_rank_quantile(twenty, 1.0) == 19.0

    def test_of_one_sample_every_quantile_is_that_sample(self) -> None:
        assert {nearest_rank_quantile([7.5], q) for q in (1e-9, 0.5, 1.0)} == {7.5}

    def test_of_1000_round_trips_p50_and_p99_are_the_500th_and_990th(self) -> None:
        round_trips = list(range(1, 1001))
        assert nearest_rank_quantile(round_trips, 0.5) == 500
        assert nearest_rank_quantile(round_trips, 0.99) == 990


class TestTheDefinition:
    """For any samples: the smallest sample with at least q·n samples at or below it."""

    @PROPERTY
    @given(values=samples, q=decimal_quantiles)
    def test_it_is_the_smallest_sample_with_q_of_them_at_or_below_it(
        self, values: list[float], q: Fraction
    ) -> None:
        assert nearest_rank_quantile(values, float(q)) == by_definition(values, q)

    @PROPERTY
    @given(values=samples, q=st.floats(0, 1, exclude_min=True))
    def test_it_is_one_of_the_samples_for_any_q(self, values: list[float], q: float) -> None:
        assert nearest_rank_quantile(values, q) in values

    @PROPERTY
    @given(values=samples, qs=st.lists(st.floats(0, 1, exclude_min=True), min_size=2))
    def test_a_higher_q_never_gives_a_lower_sample(
        self, values: list[float], qs: list[float]
    ) -> None:
        results = [nearest_rank_quantile(values, q) for q in sorted(qs)]
        assert results == sorted(results)

    @PROPERTY
    @given(values=samples)
    def test_p100_is_the_max(self, values: list[float]) -> None:
        assert nearest_rank_quantile(values, 1.0) == max(values)


class TestWhatItRefuses:
    """Errors say what was wrong, with the value."""

    def test_no_samples(self) -> None:
        with pytest.raises(ValueError, match=r"q=0\.99 quantile of no samples"):
            nearest_rank_quantile([], 0.99)

    @pytest.mark.parametrize("q", [0.0, -0.5, 1.01, 99.0, math.nan, math.inf])
    def test_a_q_outside_zero_to_one(self, q: float) -> None:
        with pytest.raises(ValueError, match=r"in \(0, 1\] \(0\.99 for p99\), got q="):
            nearest_rank_quantile(ONE_TO_100, q)

    def test_a_nan_sample(self) -> None:
        with pytest.raises(ValueError, match="NaN"):
            nearest_rank_quantile([1.0, math.nan, 2.0], 0.5)


@given(values=samples, q=st.sampled_from([0.5, 0.99]))
def test_the_main_jobs_p50_and_p99_use_the_same_rule(values: list[float], q: float) -> None:
    from actors._main_job import percentile  # it ships; it may not import benchmarks

    assert percentile(values, q) == nearest_rank_quantile(values, q)
