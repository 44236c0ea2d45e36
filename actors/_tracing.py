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

Off unless the process has a tracer provider, which each process of the pipeline (a fresh
interpreter or a fork of the fork server) gets, before its first span, in one of three
ways, all inherited from the environment of whoever started it:

* OpenTelemetry's own variables: with ``OTEL_TRACES_EXPORTER`` set (``otlp``,
  ``console``, ...) and the ``tracing`` extra installed, the process configures the SDK
  from the ``OTEL_*`` variables, as OpenTelemetry's distro does;
* ``TOKENYARD_TRACING=module:function``: a setup function of the user's, called once, that
  installs a provider (an in-memory exporter in tests, say); it wins over the first way;
* a provider already installed when the process started (``opentelemetry-instrument``'s
  start-up hook, which every child inherits).

Without any of them, or without the API, nothing is recorded, no context is made and none
is carried: a caller's ``traceparent`` stops at the worker, so with tracing off every tell
of the pipeline is one frame, whatever the clients send.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import re
import threading
from typing import Any

__all__ = (
    "SETUP_ENV",
    "Span",
    "enabled",
    "parse_traceparent",
    "start",
    "start_child",
)

logger = logging.getLogger("tokenyard.tracing")

#: The environment variable naming each process's setup function (``module:function``).
SETUP_ENV = "TOKENYARD_TRACING"
#: OpenTelemetry's variable naming the span exporters; set, each process configures the
#: SDK from the ``OTEL_*`` variables.
EXPORTER_ENV = "OTEL_TRACES_EXPORTER"

#: The environment variable setting how long a process's exit waits for its last spans to
#: go out, in seconds (`EXIT_FLUSH_SECONDS` by default); what is left then is dropped.
#: OpenTelemetry's own exit handler waits as long as its exporter likes: with an
#: unreachable OTLP collector, about 10 s, past the 5 s a stopping actor has before it is
#: killed, and a pipeline's members stop one after the other.
EXIT_FLUSH_ENV = "TOKENYARD_TRACING_EXIT_FLUSH"
EXIT_FLUSH_SECONDS = 1.0

_state: dict[str, Any] = {}

#: A ``traceparent`` as W3C Trace Context level 1 writes it: version, trace id, parent id,
#: flags (lower-case hex); a later version may append fields after a dash.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def parse_traceparent(value: str) -> str | None:
    """The ``traceparent`` a caller sent, checked as W3C Trace Context asks.

    A peer's header is passed on through every hop of its request (in each frame header of
    the batches that carry it), so only a well-formed one is kept, and only its 55
    characters of version 00: a later version's extra fields are dropped, as the
    specification lets a version-00 reader do.

    Returns:
        The context (55 characters), or ``None`` when ``value`` is not a valid one (an
        invalid version, an all-zero id, extra fields on version 00, anything else).
    """
    found = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if found is None:
        return None
    version, trace_id, parent_id, flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return f"00-{trace_id}-{parent_id}-{flags}"


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
    else:
        _configure_from_environment()
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None  # nobody installed a provider: every span would be dropped
    _state["propagator"] = TraceContextTextMapPropagator()
    _state["trace"] = trace
    _state["tracer"] = trace.get_tracer("tokenyard")
    # Registered after the provider's own exit handler, so run before it: that one then
    # finds the provider shut down (or, when this one gave up waiting, shutting down) and
    # returns at once.
    atexit.register(_shut_down_within, trace.get_tracer_provider(), _exit_flush_seconds())
    return _state["tracer"]


def _exit_flush_seconds() -> float:
    """`EXIT_FLUSH_ENV` when it is a number of seconds from 0 to 60, else the default."""
    given = os.environ.get(EXIT_FLUSH_ENV, "")
    try:
        seconds = float(given)
    except ValueError:
        seconds = -1.0
    if given and not 0 <= seconds <= 60:  # NaN included
        logger.warning(
            "%s=%r is not a number of seconds from 0 to 60: %g s",
            EXIT_FLUSH_ENV,
            given,
            EXIT_FLUSH_SECONDS,
        )
    return seconds if 0 <= seconds <= 60 else EXIT_FLUSH_SECONDS


def _shut_down_within(provider: Any, seconds: float) -> None:
    """Shut ``provider`` down (its last spans exported), waiting ``seconds`` at most."""
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is None:
        return
    flush = threading.Thread(target=shutdown, name="tokenyard-span-flush", daemon=True)
    flush.start()
    flush.join(seconds)
    if flush.is_alive():
        logger.warning(
            "spans not exported within %g s of this process's exit were dropped (is the "
            "trace collector reachable?)",
            seconds,
        )


def _configure_from_environment() -> None:
    """Install a provider and its exporters from the ``OTEL_*`` variables, as
    ``opentelemetry-instrument`` does at start-up, but in this process only and at its
    first span: a fork server's children are forked before any exporter thread exists.
    Nothing happens when they ask for no exporter, or a provider is installed already."""
    from opentelemetry import trace

    names = os.environ.get(EXPORTER_ENV, "").strip()
    if names.lower() in ("", "none"):
        return
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    try:
        from opentelemetry.distro import OpenTelemetryConfigurator
    except ImportError:
        logger.warning(
            "%s=%s, but the OpenTelemetry SDK's configurator is not installed: tracing "
            "stays off (pip install 'tokenyard[tracing]' and the exporter's package)",
            EXPORTER_ENV,
            names,
        )
        return
    try:
        # The configurator's methods carry no annotations.
        OpenTelemetryConfigurator().configure()  # type: ignore[no-untyped-call]
    except Exception:
        logger.exception(
            "configuring OpenTelemetry from %s=%s failed: tracing stays off",
            EXPORTER_ENV,
            names,
        )


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
