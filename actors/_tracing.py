"""Trace context through the pipeline: a request's W3C ``traceparent`` rides in the frame
header of the tells that carry the request, and each hop records a span with the
OpenTelemetry API.

Where the context travels: in the runtime's frame header (``trace=`` on ``tell``, read by
the handler with `runtime.current_trace`), so the pipeline's messages carry no tracing
field. The worker's `TokenizedGenerate` carries one context; a step's `BatchTokenIDOutput`
and each worker's `BatchStrOutput` carry one per request, in the batch's ``rids`` order
(``""`` for an untraced request), since one batch holds many requests, each of its own
trace. A step with no traced request sends no context: its tells are one frame, as they
are with tracing off.

The hops: the worker (``tokenyard.worker``, from admission to the request's end, child of
the HTTP request's ``traceparent`` header when it has one), the scheduler
(``tokenyard.scheduler``, queued to finished), the detokenizer (``tokenyard.detokenizer``,
first output to last) and back at the worker (``tokenyard.worker.respond``, when the last
output arrives), each the child of the one before: one request, one trace, across four
processes.

Off unless a tracer provider is set in the process: with ``opentelemetry-api`` installed
(the ``tracing`` extra), name a setup function in ``TOKENYARD_TRACING=module:function``; each
process of the pipeline calls it once, before its first span, to install its provider and
exporter (processes inherit the variable). Without it, or without the API, nothing is
recorded and no context is made: a ``traceparent`` header that comes in is passed along
untouched, and that is all.
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import os
from typing import Any

__all__ = ("SETUP_ENV", "Span", "enabled", "incoming", "start", "start_child")

logger = logging.getLogger("tokenyard.tracing")

#: The environment variable naming each process's setup function (``module:function``).
SETUP_ENV = "TOKENYARD_TRACING"

#: The ``traceparent`` of the HTTP request being served (set by the app, read by the
#: worker engine, in the task that serves the request).
incoming: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tokenyard_traceparent", default=None
)

_state: dict[str, Any] = {}


def _tracer() -> Any:
    """This process's tracer, or ``None`` when tracing is off (decided once)."""
    if "tracer" in _state:
        return _state["tracer"]
    _state["tracer"] = None
    try:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return None
    setup = os.environ.get(SETUP_ENV, "")
    if setup:
        module, _, name = setup.partition(":")
        try:
            getattr(importlib.import_module(module), name)()
        except Exception:
            logger.exception("%s=%s failed: tracing stays off", SETUP_ENV, setup)
            return None
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None  # nobody installed a provider: every span would be dropped
    _state["propagator"] = TraceContextTextMapPropagator()
    _state["trace"] = trace
    _state["tracer"] = trace.get_tracer("tokenyard")
    return _state["tracer"]


def enabled() -> bool:
    """Whether this process records spans."""
    return _tracer() is not None


class Span:
    """One hop's span and the ``traceparent`` its children take."""

    __slots__ = ("span", "traceparent")

    def __init__(self, span: Any, traceparent: str | None) -> None:
        self.span = span
        self.traceparent = traceparent

    def end(self, **attributes: Any) -> None:
        """End the span (once), with attributes set last (``finish_reason``, ...)."""
        span, self.span = self.span, None
        if span is not None:
            for key, value in attributes.items():
                if value is not None:
                    span.set_attribute(f"tokenyard.{key}", value)
            span.end()


def start(name: str, parent: str | None, **attributes: Any) -> Span | None:
    """Start a span as the child of ``parent`` (a ``traceparent``; ``None``: a new trace).

    Returns:
        The span, or ``None`` when tracing is off (a parent that came in is then kept by
        the caller as it is).
    """
    tracer = _tracer()
    if tracer is None:
        return None
    propagator = _state["propagator"]
    context = propagator.extract({"traceparent": parent}) if parent else None
    span = tracer.start_span(name, context=context)
    for key, value in attributes.items():
        span.set_attribute(f"tokenyard.{key}", value)
    carrier: dict[str, str] = {}
    propagator.inject(carrier, context=_state["trace"].set_span_in_context(span))
    return Span(span, carrier.get("traceparent"))


def start_child(name: str, parent: str | None, **attributes: Any) -> Span | None:
    """Start a span only if ``parent`` is given (a hop inside a traced request; ``""`` is
    no parent)."""
    if not parent:
        return None
    return start(name, parent, **attributes)
