"""Fixtures of the in-process tests."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from actors import _tracing


@pytest.fixture
def span_exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """Tracing on in this process, its spans kept in memory (the global provider is left
    alone: `actors._tracing`'s tracer is swapped for the test's)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(
        _tracing,
        "_state",
        {
            "tracer": provider.get_tracer("test"),
            "propagator": TraceContextTextMapPropagator(),
            "trace": trace,
        },
    )
    return exporter
