"""Series of your own, gathered with the runtime's: counters, gauges and histograms in this
process's registry, collected by the system's `runtime.MetricsCollector` from every process
and summed across them (series with the same label values add up).

Asking twice for one name gives the same family, so an actor restarted in the same process
counts on. Label a series by what tells processes apart (a worker's index) when the sum
would hide it.

Example:
    >>> from runtime import metrics
    >>> served = metrics.counter("myapp_requests_total", "Requests served.", ["route"])
    >>> served.labels("/v1/completions").inc()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._metrics import ENABLED as ENABLED
from ._metrics import REGISTRY
from ._metrics import Counter as Counter
from ._metrics import Family as Family
from ._metrics import FamilySnapshot as FamilySnapshot
from ._metrics import Gauge as Gauge
from ._metrics import Histogram as Histogram
from ._metrics import HistogramSnapshot as HistogramSnapshot
from ._metrics import SeriesSnapshot as SeriesSnapshot

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = (
    "ENABLED",
    "Counter",
    "Family",
    "FamilySnapshot",
    "Gauge",
    "Histogram",
    "HistogramSnapshot",
    "SeriesSnapshot",
    "counter",
    "gauge",
    "histogram",
)


def counter(name: str, help: str, labelnames: Sequence[str] = ()) -> Family:
    """The counter family ``name`` of this process (made on first use)."""
    return REGISTRY.counter(name, help, labelnames)


def gauge(name: str, help: str, labelnames: Sequence[str] = ()) -> Family:
    """The gauge family ``name`` of this process (made on first use)."""
    return REGISTRY.gauge(name, help, labelnames)


def histogram(
    name: str, help: str, bounds: Sequence[float], labelnames: Sequence[str] = ()
) -> Family:
    """The histogram family ``name`` over ``bounds`` of this process (made on first use)."""
    return REGISTRY.histogram(name, help, bounds, labelnames)
