"""The tracing set-up of the serve suite's traced variant
(``TOKENYARD_TRACING=benchmarks._tracing:install``): the OpenTelemetry SDK records every
span in every process of the server and hands them, in batches, to an exporter that counts
them and sends nothing anywhere, so the figure is the cost of recording, not of a
collector's network."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from collections.abc import Sequence

    from opentelemetry.sdk.trace import ReadableSpan

SETUP = "benchmarks._tracing:install"


class _Counting(SpanExporter):
    def __init__(self) -> None:
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


def install() -> None:
    """Record every span of this process, exported in batches to nowhere."""
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Counting()))
    trace.set_tracer_provider(provider)
