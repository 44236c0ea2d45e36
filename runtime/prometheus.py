"""A system's statistics as Prometheus text: the ``metrics`` extra
(``pip install 'tokenyard[metrics]'``, on ``prometheus_client``).

One `SystemMetrics` (what a `runtime.MetricsCollector` answers) becomes one exposition:
no multiprocess mode, no scratch directory. Series:

- per actor incarnation (labels ``actor``, ``incarnation``, ``pid``): ``tokenyard_actor_up``,
  its mailbox counters and gauges, ``tokenyard_actor_handler_seconds``; a dead incarnation
  kept by the collector reads ``tokenyard_actor_up 0`` with its last values;
- per process (labels ``process``, ``pid``): ``process_cpu_seconds_total``,
  ``process_resident_memory_bytes``, ``process_virtual_memory_bytes``,
  ``process_open_fds``, ``process_max_fds``, ``process_start_time_seconds``, and
  ``tokenyard_ask_duration_seconds`` by the actor asked (label ``target``);
- per supervised child (labels ``supervisor``, ``child``, ``cause``):
  ``tokenyard_restarts_total`` and ``tokenyard_child_deaths_total``;
- every family added with `runtime.metrics`, summed over processes.

Example:
    >>> text = render(await collector.ask(GetMetrics()))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.utils import floatToGoString
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError(
        "runtime.prometheus renders metrics with prometheus_client, which is not installed: "
        "pip install 'tokenyard[metrics]'"
    ) from err

from ._metrics import COUNTER, GAUGE, HistogramSnapshot

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ._stats import ActorMetrics, SystemMetrics

__all__ = ("CONTENT_TYPE", "render")

#: The exposition's content type (``text/plain; version=0.0.4``).
CONTENT_TYPE: str = CONTENT_TYPE_LATEST

_ACTOR = ("actor", "incarnation", "pid")
_PROCESS = ("process", "pid")
_CHILD = ("supervisor", "child", "cause")


def render(metrics: SystemMetrics) -> bytes:
    """The Prometheus text exposition of ``metrics`` (the same bytes for the same value)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    return generate_latest(registry)


def _buckets(h: HistogramSnapshot) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    seen = 0
    for bound, n in zip(h.bounds, h.counts, strict=False):
        seen += n
        out.append((floatToGoString(bound), seen))  # type: ignore[no-untyped-call]
    out.append(("+Inf", h.count))
    return out


class _Collector:
    def __init__(self, metrics: SystemMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        yield from self._actors()
        yield from self._processes()
        yield from self._children()
        for family in m.families:
            yield _family(family.name, family.kind, family.help, family.labelnames, family.series)
        gathered = GaugeMetricFamily(
            "tokenyard_metrics_gathered_timestamp_seconds",
            "When these statistics were gathered (seconds since the epoch).",
        )
        gathered.add_metric([], m.gathered_at)
        yield gathered

    def _actors(self) -> Iterator[Metric]:
        rows: list[tuple[ActorMetrics, int, float]] = []
        for process in self.metrics.processes:
            rows += [(a, process.process.pid, 1.0) for a in process.actors]
        rows += [(d.actor, d.pid, 0.0) for d in self.metrics.dead]
        rows.sort(key=lambda r: (r[0].ref.name, r[0].ref.incarnation, r[1]))
        up = GaugeMetricFamily(
            "tokenyard_actor_up",
            "1 for a live actor incarnation, 0 for a dead one kept.",
            labels=_ACTOR,
        )
        counters = {
            "received": "Messages read off the mailbox's socket (control frames included).",
            "handled": "Messages whose handler returned.",
            "failed": "Messages whose handler raised.",
            "rejected": "Frames refused: undecodable, of a type not accepted, or untrusted.",
        }
        fams: dict[str, Any] = {
            key: CounterMetricFamily(f"tokenyard_actor_messages_{key}_total", text, labels=_ACTOR)
            for key, text in counters.items()
        }
        received_bytes = CounterMetricFamily(
            "tokenyard_actor_received_bytes_total",
            "Bytes of the messages read off the mailbox's socket.",
            labels=_ACTOR,
        )
        queued = GaugeMetricFamily(
            "tokenyard_actor_queued_messages", "Messages read and not yet handled.", labels=_ACTOR
        )
        queued_bytes = GaugeMetricFamily(
            "tokenyard_actor_queued_bytes", "Bytes of those messages.", labels=_ACTOR
        )
        handler = HistogramMetricFamily(
            "tokenyard_actor_handler_seconds",
            "Time from taking a message off the queue to its handler's return (a sample: the "
            "messages of one drained run in 16).",
            labels=_ACTOR,
        )
        seen: set[tuple[str, ...]] = set()
        for actor, pid, alive in rows:
            labels = (actor.ref.name, str(actor.ref.incarnation), str(pid))
            if labels in seen:
                continue  # two systems of one process naming an actor alike: keep one
            seen.add(labels)
            box = actor.mailbox
            up.add_metric(labels, alive)
            for key in counters:
                fams[key].add_metric(labels, getattr(box, key))
            received_bytes.add_metric(labels, box.received_bytes)
            queued.add_metric(labels, box.queued)
            queued_bytes.add_metric(labels, box.queued_bytes)
            h = actor.handler_seconds
            handler.add_metric(labels, _buckets(h), h.sum)
        yield up
        yield from fams.values()
        yield from (received_bytes, queued, queued_bytes, handler)

    def _processes(self) -> Iterator[Metric]:
        rows = [(p.name, p.process, p.asks) for p in self.metrics.processes]
        rows += [
            (d.actor.ref.name, d.process, {}) for d in self.metrics.dead if d.process is not None
        ]
        rows.sort(key=lambda r: (r[0], r[1].pid if r[1] else 0))
        cpu = CounterMetricFamily(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            labels=_PROCESS,
        )
        gauges = {
            "rss_bytes": GaugeMetricFamily(
                "process_resident_memory_bytes", "Resident memory size in bytes.", labels=_PROCESS
            ),
            "vms_bytes": GaugeMetricFamily(
                "process_virtual_memory_bytes", "Virtual memory size in bytes.", labels=_PROCESS
            ),
            "open_fds": GaugeMetricFamily(
                "process_open_fds", "Number of open file descriptors.", labels=_PROCESS
            ),
            "max_fds": GaugeMetricFamily(
                "process_max_fds", "Maximum number of open file descriptors.", labels=_PROCESS
            ),
            "start_time": GaugeMetricFamily(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                labels=_PROCESS,
            ),
        }
        asks = HistogramMetricFamily(
            "tokenyard_ask_duration_seconds",
            "Round trips of the asks a process sent, by the actor asked.",
            labels=(*_PROCESS, "target"),
        )
        seen: set[int] = set()
        for name, stats, asked in rows:
            if stats is None or stats.pid in seen:
                continue  # several systems in one process: its resources once
            seen.add(stats.pid)
            labels = (name, str(stats.pid))
            cpu.add_metric(labels, stats.cpu_seconds)
            for key, fam in gauges.items():
                fam.add_metric(labels, getattr(stats, key))
            for target, h in sorted(asked.items()):
                asks.add_metric((*labels, target), _buckets(h), h.sum)
        yield cpu
        yield from gauges.values()
        yield asks

    def _children(self) -> Iterator[Metric]:
        restarts = CounterMetricFamily(
            "tokenyard_restarts_total",
            "Restarts of a supervised child, by the cause of the death that led to each.",
            labels=_CHILD,
        )
        deaths = CounterMetricFamily(
            "tokenyard_child_deaths_total",
            "Deaths of a supervised child seen by its supervisor, by cause.",
            labels=_CHILD,
        )
        for process in sorted(self.metrics.processes, key=lambda p: p.name):
            for actor in sorted(process.actors, key=lambda a: a.ref.name):
                for child in actor.children:
                    for cause, n in sorted(child.restarts.items()):
                        restarts.add_metric((actor.ref.name, child.name, cause), n)
                    for cause, n in sorted(child.deaths.items()):
                        deaths.add_metric((actor.ref.name, child.name, cause), n)
        yield restarts
        yield deaths


def _family(name: str, kind: str, help: str, labelnames: tuple[str, ...], series: Any) -> Metric:
    fam: Any
    if kind == COUNTER:
        fam = CounterMetricFamily(name, help, labels=labelnames)
    elif kind == GAUGE:
        fam = GaugeMetricFamily(name, help, labels=labelnames)
    else:
        fam = HistogramMetricFamily(name, help, labels=labelnames)
    for s in series:
        if s.histogram is not None:
            fam.add_metric(s.labels, _buckets(s.histogram), s.histogram.sum)
        else:
            fam.add_metric(s.labels, s.value)
    result: Metric = fam
    return result
