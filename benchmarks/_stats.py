"""The one quantile rule every benchmark reports with.

A p50, a p99 or a median in a table, a chart or the JSON of ``python -m benchmarks`` is
``nearest_rank_quantile`` of the samples: always a value that was measured, never an
interpolation between two.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

#: The rule in words, for the notes a suite prints and writes next to its figures.
RULE = (
    "Percentiles and medians are nearest-rank: the smallest sample with at least q·n of the"
    " n samples at or below it (p99 of 1..100 is 99, p50 of 1, 2, 3, 4 is 2)."
)


def nearest_rank_quantile(samples: Iterable[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``samples``.

    That is the smallest sample ``x`` such that at least ``q * n`` of the ``n`` samples are
    ``<= x``: with the samples sorted ascending, ``sorted[ceil(q * n) - 1]``. So for the
    samples 1..100, p50 (``q=0.5``) is 50, p99 is 99 and p100 (``q=1.0``, the max) is 100;
    for 20 samples p99 is the max; for 1, 2, 3, 4 the median (p50) is 2.

    ``q`` is read as the decimal it prints as (``0.07`` is 7/100, not the binary float just
    above it), so p7 of 1..100 is 7.

    Args:
        samples: The measurements, in any order (ints or floats, no NaN).
        q: The quantile, 0 < q <= 1 (0.99 for p99).

    Returns:
        One of ``samples``.

    Raises:
        ValueError: ``samples`` is empty or holds a NaN, or ``q`` is outside (0, 1].
    """
    if not 0 < q <= 1:  # also refuses NaN
        raise ValueError(f"a quantile must be in (0, 1] (0.99 for p99), got q={q!r}")
    ordered = sorted(samples)
    if not ordered:
        raise ValueError(f"the q={q!r} quantile of no samples: nothing was measured")
    if any(math.isnan(x) for x in ordered):
        raise ValueError("a quantile of samples holding a NaN (they have no order)")
    rank = math.ceil(Fraction(str(q)) * len(ordered))
    return ordered[rank - 1]
