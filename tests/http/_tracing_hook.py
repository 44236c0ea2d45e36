"""A tracing setup for the tests (``TOKENYARD_TRACING=tests.http._tracing_hook:install``):
each process keeps its finished spans in OpenTelemetry's in-memory exporter and appends
each, as one JSON line, to a file of its own in ``TOKENYARD_TEST_SPANS``, where the test
reads every process's spans back."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from setproctitle import getproctitle

if TYPE_CHECKING:
    from collections.abc import Sequence

    from opentelemetry.sdk.trace import ReadableSpan

SPANS_ENV = "TOKENYARD_TEST_SPANS"


class _Recorder(InMemorySpanExporter):
    """In memory, and on disk for the test process to read."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.path = os.path.join(directory, f"spans-{os.getpid()}.jsonl")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as f:
            for span in spans:
                context = span.get_span_context()
                assert context is not None
                record = {
                    "name": span.name,
                    "trace_id": f"{context.trace_id:032x}",
                    "span_id": f"{context.span_id:016x}",
                    "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
                    "pid": os.getpid(),
                    "attributes": dict(span.attributes or {}),
                }
                f.write(json.dumps(record) + "\n")
        return super().export(spans)


def install() -> None:
    """Install a tracer provider recording every span of this process."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_Recorder(os.environ[SPANS_ENV])))
    trace.set_tracer_provider(provider)


def install_except_in_workers() -> None:
    """`install`, except in a tokenizer worker's process: tracing is off there only."""
    if "worker" not in getproctitle():
        install()
