"""What the runtime measures about itself, and the series any code may add: fixed-bucket
histograms, counter, gauge and histogram families in a per-process registry, and the typed
snapshots of them that travel in replies.

Nothing here depends on a metrics library: the snapshots are msgspec structs, and turning
them into Prometheus text is `runtime.prometheus`'s business (the ``metrics`` extra).

Cost on the hot path: a mailbox's counters are plain integer adds, and a handler's time is
one ``perf_counter_ns`` per message (the end of one handler is the start of the next), put
in a power-of-two bucket with an integer ``bit_length``; no lock, no bisect, no dict. Set
``TOKENYARD_METRICS=off`` in the environment to leave the clock out (processes inherit it).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import re
from typing import TYPE_CHECKING, Any

import msgspec

from ._throttle import Throttle

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

#: A series whose function fails, logged at most once per few seconds a process.
_failed_functions = Throttle(logging.getLogger("tokenyard.metrics"))

#: Whether handler times and ask round trips are measured (``TOKENYARD_METRICS=off``: not).
ENABLED = os.environ.get("TOKENYARD_METRICS", "on").strip().lower() not in {
    "0",
    "off",
    "false",
    "no",
}

#: Handler-time buckets: bucket ``k`` holds durations of less than ``2**k`` microseconds
#: (bucket 0: under 1 us), so the index is ``(ns // 1000).bit_length()``; 25 finite bounds
#: reach 16.8 s, and every longer duration counts in +Inf.
POW2_BOUNDS: tuple[float, ...] = tuple(2**k * 1e-6 for k in range(25))
#: Slots of a power-of-two histogram: any 64-bit duration's index fits, so recording needs
#: no bound check; slots past the last bound fold into +Inf when snapshotted.
POW2_SLOTS = 64


class HistogramSnapshot(msgspec.Struct, array_like=True, frozen=True):
    """A histogram's counts at one moment.

    Attributes:
        bounds: The finite upper bounds (inclusive), ascending.
        counts: Observations per bucket, not cumulative: one per bound, then +Inf.
        sum: The sum of all observations.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0

    @property
    def count(self) -> int:
        """How many observations."""
        return sum(self.counts)

    def quantile(self, q: float) -> float:
        """An estimate of the ``q`` quantile (0 <= q <= 1), interpolated within its bucket
        as Prometheus's ``histogram_quantile`` does; ``nan`` with no observations."""
        total = self.count
        if not total:
            return math.nan
        rank = q * total
        seen = 0
        for i, n in enumerate(self.counts):
            if seen + n >= rank and n:
                if i >= len(self.bounds):
                    return self.bounds[-1] if self.bounds else math.nan
                low = self.bounds[i - 1] if i else 0.0
                return low + (self.bounds[i] - low) * (rank - seen) / n
            seen += n
        return self.bounds[-1] if self.bounds else math.nan

    def plus(self, other: HistogramSnapshot) -> HistogramSnapshot:
        """This histogram and ``other`` (same bounds) added up."""
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return HistogramSnapshot(self.bounds, counts, self.sum + other.sum)


def pow2_snapshot(slots: Sequence[int], total_ns: int) -> HistogramSnapshot:
    """The snapshot of a power-of-two nanosecond histogram (`POW2_SLOTS` slots)."""
    finite = len(POW2_BOUNDS)
    counts = (*slots[:finite], sum(slots[finite:]))
    return HistogramSnapshot(POW2_BOUNDS, counts, total_ns / 1e9)


class Histogram:
    """A histogram over fixed bounds (``le`` semantics: a value equal to a bound counts in
    that bound's bucket).

    Args:
        bounds: The finite upper bounds, ascending.
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must ascend without repeats: {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        """The counts now."""
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total)


# -- families: series any code adds ---------------------------------------------------------

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"


class SeriesSnapshot(msgspec.Struct, array_like=True, frozen=True):
    """One series of a family: its label values and its value (or histogram)."""

    labels: tuple[str, ...]
    value: float = 0.0
    histogram: HistogramSnapshot | None = None


class FamilySnapshot(msgspec.Struct, array_like=True, frozen=True):
    """A family of series at one moment.

    Attributes:
        name: The metric name (``tokenyard:time_to_first_token_seconds``).
        kind: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        help: What it measures, for people.
        labelnames: The names of its labels, in the order of each series' values.
        series: Its series.
    """

    name: str
    kind: str
    help: str
    labelnames: tuple[str, ...]
    series: tuple[SeriesSnapshot, ...]


class Counter:
    """A monotonic count (one series of a counter family), or one read from a function
    when snapshotted."""

    __slots__ = ("function", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.function: Callable[[], float] | None = None

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount``.

        Raises:
            ValueError: ``amount`` is negative or NaN (a counter never goes down).
        """
        if not amount >= 0:  # NaN included: it would be the counter's value for good
            raise ValueError(f"a counter only goes up by a number: inc({amount})")
        self.value += amount

    def set_function(self, function: Callable[[], float]) -> None:
        """Read the value from ``function`` at each snapshot instead (a count kept
        elsewhere, which only goes up; costs nothing meanwhile). A snapshot in which it
        raises, or returns what is not a number, leaves the series out (logged)."""
        self.function = function

    def read(self) -> float:
        """The value now."""
        return self.value if self.function is None else float(self.function())


class Gauge:
    """A value that goes up and down, or is read from a function when snapshotted."""

    __slots__ = ("function", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.function: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        """Set the value."""
        self.value = value

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount``."""
        self.value += amount

    def set_function(self, function: Callable[[], float]) -> None:
        """Read the value from ``function`` at each snapshot (costs nothing meanwhile). A
        snapshot in which it raises, or returns what is not a number, leaves the series out
        (logged)."""
        self.function = function

    def read(self) -> float:
        """The value now."""
        return self.value if self.function is None else float(self.function())


class Family:
    """Series of one metric name, one per combination of label values.

    Made by `Registry.counter`, `Registry.gauge` and `Registry.histogram`; get a series
    with `labels`.
    """

    def __init__(
        self,
        name: str,
        kind: str,
        help: str,
        labelnames: Sequence[str],
        bounds: Sequence[float] = (),
    ) -> None:
        self.name = name
        self.kind = kind
        self.help = help
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(bounds)
        self._series: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: object) -> Any:
        """The series for these label values (made on first use)."""
        key = tuple(map(str, values))
        found = self._series.get(key)
        if found is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name} has labels {self.labelnames}, got values {key}")
            found = self._series[key] = self._new()
        return found

    def remove(self, *values: object) -> None:
        """Forget the series of these label values."""
        self._series.pop(tuple(map(str, values)), None)

    def _new(self) -> Any:
        if self.kind == COUNTER:
            return Counter()
        if self.kind == GAUGE:
            return Gauge()
        return Histogram(self.bounds)

    def snapshot(self) -> FamilySnapshot:
        """Every series now."""
        series = []
        for key, child in sorted(self._series.items()):
            if isinstance(child, Histogram):
                series.append(SeriesSnapshot(key, child.total, child.snapshot()))
            elif child.function is None:
                series.append(SeriesSnapshot(key, child.value))
            else:
                try:
                    value = child.read()
                except Exception as err:  # noqa: BLE001 - code of any kind: the series is left out
                    _failed_functions.error(
                        "%s %s%s left out: its function raised",
                        self.kind,
                        self.name,
                        key,
                        exc_info=err,
                    )
                    continue
                series.append(SeriesSnapshot(key, value))
        return FamilySnapshot(self.name, self.kind, self.help, self.labelnames, tuple(series))


#: What Prometheus's text format allows as a metric name, and as a label name.
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _check(name: str, kind: str, labelnames: Sequence[str], bounds: Sequence[float]) -> None:
    """Refuse a family Prometheus's text format cannot carry as given.

    Raises:
        ValueError: A name or a label name it does not allow (``__`` begins the names it
            reserves; a histogram's ``le`` labels its buckets), a label named twice, or
            histogram bounds that are not finite and ascending.
    """
    if not _METRIC_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a metric name: [a-zA-Z_:][a-zA-Z0-9_:]*")
    for label in labelnames:
        if not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
            raise ValueError(f"{label!r} is not a label name: [a-zA-Z_][a-zA-Z0-9_]*, no __")
        if label == "le" and kind == HISTOGRAM:
            raise ValueError(f"histogram {name!r}: 'le' labels its buckets")
    if len(set(labelnames)) != len(labelnames):
        raise ValueError(f"{name!r}: a label named twice in {tuple(labelnames)}")
    if kind == HISTOGRAM:
        if not all(map(math.isfinite, bounds)):
            raise ValueError(f"histogram {name!r}: bounds {tuple(bounds)} are not all finite")
        Histogram(bounds)  # they ascend


class Registry:
    """The families of one process, by name; asking twice for a name gives the same family
    (an actor restarted in the same process keeps counting where its predecessor stopped).
    """

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}

    def _get(
        self, name: str, kind: str, help: str, labelnames: Sequence[str], bounds: Sequence[float]
    ) -> Family:
        family = self._families.get(name)
        if family is None:
            _check(name, kind, labelnames, bounds)
            family = self._families[name] = Family(name, kind, help, labelnames, bounds)
        elif (
            family.kind != kind
            or family.labelnames != tuple(labelnames)
            or family.bounds != tuple(bounds)
        ):
            raise ValueError(
                f"metric {name!r} is already a {family.kind} with labels {family.labelnames}"
                + (f" and bounds {family.bounds}" if family.bounds else "")
            )
        return family

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Family:
        """The counter family ``name``."""
        return self._get(name, COUNTER, help, labelnames, ())

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Family:
        """The gauge family ``name``."""
        return self._get(name, GAUGE, help, labelnames, ())

    def histogram(
        self, name: str, help: str, bounds: Sequence[float], labelnames: Sequence[str] = ()
    ) -> Family:
        """The histogram family ``name`` over ``bounds``."""
        return self._get(name, HISTOGRAM, help, labelnames, bounds)

    def snapshot(self) -> list[FamilySnapshot]:
        """Every family now."""
        return [f.snapshot() for f in self._families.values()]


#: This process's families.
REGISTRY = Registry()


def merge(groups: Sequence[Sequence[FamilySnapshot]]) -> list[FamilySnapshot]:
    """Families of several processes as one: the series of a name with the same label
    values are added up (histograms bucket by bucket), sorted by name and labels.

    A family whose kind, labels or bounds differ from the first one of its name seen is
    left out (two processes disagreeing on a name is a bug, not a reason to fail a scrape).
    """
    heads: dict[str, FamilySnapshot] = {}
    values: dict[str, dict[tuple[str, ...], SeriesSnapshot]] = {}
    for group in groups:
        for family in group:
            head = heads.setdefault(family.name, family)
            if head.kind != family.kind or head.labelnames != family.labelnames:
                continue
            into = values.setdefault(family.name, {})
            for series in family.series:
                known = into.get(series.labels)
                into[series.labels] = series if known is None else _add(known, series)
    return [
        FamilySnapshot(
            head.name,
            head.kind,
            head.help,
            head.labelnames,
            tuple(values.get(name, {})[k] for k in sorted(values.get(name, {}))),
        )
        for name, head in sorted(heads.items())
    ]


def _add(a: SeriesSnapshot, b: SeriesSnapshot) -> SeriesSnapshot:
    if a.histogram is not None and b.histogram is not None:
        if a.histogram.bounds != b.histogram.bounds:
            return a
        return SeriesSnapshot(a.labels, a.value + b.value, a.histogram.plus(b.histogram))
    return SeriesSnapshot(a.labels, a.value + b.value)
