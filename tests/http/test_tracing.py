"""Trace context through the pipeline of a real ``serve``: a request's ``traceparent`` comes
back as one connected trace whose spans were recorded by the worker, the scheduler and the
detokenizer, each in its own process: with a setup function of the test's, and with
OpenTelemetry's own configuration (its variables, or ``opentelemetry-instrument``),
exported over OTLP to a collector the test runs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import aiohttp.web
import anyio
import anyio.to_thread
import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from actors import _tracing
from actors.http import open_server
from actors.messages import BatchStrOutput, BatchTokenIDOutput, TokenizedGenerate
from tests.conftest import free_port

from ._server import running_serve
from ._tracing_hook import SPANS_ENV

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
ROOT = Path(__file__).resolve().parents[2]
HOPS = [
    "tokenyard.detokenizer",
    "tokenyard.scheduler",
    "tokenyard.worker",
    "tokenyard.worker.respond",
]


def spans_in(directory: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(directory.glob("spans-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


CALLER = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}


async def serve_requests(
    setup: str, spans: Path, monkeypatch: pytest.MonkeyPatch, *requests: dict[str, str]
) -> None:
    """Run a real serve whose processes take the tracing ``setup`` of `_tracing_hook` (and
    keep their spans in ``spans``), and stream one request to the end per headers given."""
    monkeypatch.setenv(_tracing.SETUP_ENV, f"tests.http._tracing_hook:{setup}")
    monkeypatch.setenv(SPANS_ENV, str(spans))
    body = {"prompt": "Hello there", "max_tokens": 6, "stream": True}
    async with (
        open_server(workers=2, port=0) as server,
        aiohttp.ClientSession() as session,
    ):
        for headers in requests:
            async with session.post(
                f"{server.url}/v1/completions", json=body, headers=headers
            ) as response:
                assert response.status == 200
                assert b"[DONE]" in await response.read()


class TestTracing:
    async def test_a_traced_request_is_one_trace_through_worker_scheduler_and_detokenizer(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # An untraced request records a trace of its own, not the caller's; so does one
        # whose traceparent is malformed (version 00 takes no further fields).
        malformed = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01-{'x' * 4000}"}
        await serve_requests("install", tmp_path, monkeypatch, CALLER, {}, malformed)
        spans = [s for s in spans_in(tmp_path) if s["trace_id"] == TRACE_ID]
        by_name = {s["name"]: s for s in spans}
        assert_one_trace(spans)
        worker = by_name["tokenyard.worker"]
        assert worker["attributes"]["tokenyard.finish_reason"] == "length"
        assert worker["attributes"]["tokenyard.completion_tokens"] == 6
        others = {s["trace_id"] for s in spans_in(tmp_path)} - {TRACE_ID}
        assert len(others) == 2

    async def test_a_worker_not_tracing_carries_no_callers_context_to_the_others(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Tracing is on in the scheduler and the detokenizer, off in the workers. They would
        # record a span as soon as a context reached them, and none does: a worker that
        # records nothing sends nothing for tracing, whatever the client sent.
        await serve_requests("install_except_in_workers", tmp_path, monkeypatch, CALLER)
        assert spans_in(tmp_path) == []


def assert_one_trace(spans: list[dict[str, Any]]) -> None:
    """The four hops of one request: each the child of the one before, in three processes."""
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == HOPS, spans
    assert len(spans) == 4
    worker, scheduler = by_name["tokenyard.worker"], by_name["tokenyard.scheduler"]
    detokenizer, back = by_name["tokenyard.detokenizer"], by_name["tokenyard.worker.respond"]
    # Connected: each hop is the child of the one before it.
    assert worker["parent_id"] == CALLER_SPAN
    assert scheduler["parent_id"] == worker["span_id"]
    assert detokenizer["parent_id"] == scheduler["span_id"]
    assert back["parent_id"] == detokenizer["span_id"]
    # Across processes: the worker's, the scheduler's and the detokenizer's.
    assert len({worker["pid"], scheduler["pid"], detokenizer["pid"]}) == 3
    assert back["pid"] == worker["pid"]


class Collector:
    """An OTLP/HTTP trace collector on 127.0.0.1: every span it is sent, as a record."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.changed = anyio.Event()
        self.url = ""

    async def _export(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans += [
                    {
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_id": span.parent_span_id.hex() or None,
                        "pid": resource["process.pid"].int_value,
                    }
                    for span in scope_spans.spans
                ]
        self.changed.set()
        self.changed = anyio.Event()
        return aiohttp.web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def wait_for(self, trace_id: str, count: int) -> list[dict[str, Any]]:
        """The spans of ``trace_id`` once there are ``count`` of them."""
        with anyio.fail_after(20):
            while len(spans := [s for s in self.spans if s["trace_id"] == trace_id]) < count:
                await self.changed.wait()
        return spans

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls) -> AsyncIterator[Collector]:
        collector = cls()
        app = aiohttp.web.Application()
        app.router.add_post("/v1/traces", collector._export)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        collector.url = f"http://127.0.0.1:{port}/v1/traces"
        try:
            yield collector
        finally:
            await runner.cleanup()


class TestOpenTelemetrysOwnSetup:
    @pytest.mark.parametrize("how", ["variables", "opentelemetry-instrument"])
    async def test_a_served_request_is_one_trace_exported_over_otlp(
        self, how: str, tmp_path: Path
    ) -> None:
        port = free_port()
        async with Collector.open() as collector:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TOKENYARD_"))}
            env |= {
                "PYTHONPATH": str(ROOT),
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url,
                "OTEL_BSP_SCHEDULE_DELAY": "100",
                "OTEL_METRICS_EXPORTER": "none",
                "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "process",
            }
            command = [sys.executable, "-m", "actors", "serve", "--workers", "2"]
            if how == "opentelemetry-instrument":
                wrapper = shutil.which("opentelemetry-instrument", path=Path(sys.executable).parent)
                assert wrapper is not None
                command.insert(0, wrapper)
            errors = tmp_path / "stderr"
            with errors.open("wb") as stderr:
                proc = await anyio.open_process(
                    [*command, "--port", str(port)], stderr=stderr, env=env, cwd=ROOT
                )
            async with proc:
                try:
                    assert proc.stdout is not None
                    first = b""
                    with anyio.fail_after(30):
                        while b"\n" not in first:
                            first += await proc.stdout.receive()
                    assert b"serving http://127.0.0.1" in first, errors.read_text()
                    async with (
                        aiohttp.ClientSession() as session,
                        session.post(
                            f"http://127.0.0.1:{port}/v1/completions",
                            json={"prompt": "Hello there", "max_tokens": 6},
                            headers=CALLER,
                        ) as response,
                    ):
                        assert response.status == 200
                        await response.read()
                    assert_one_trace(await collector.wait_for(TRACE_ID, 4))
                    proc.send_signal(signal.SIGTERM)
                    with anyio.fail_after(30):
                        assert await proc.wait() == 0  # a clean drain
                finally:
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
            if how == "variables":
                # Configured at each process's first span, after the fork: the fork server
                # never held an exporter's thread and still forks the actors.
                assert "cannot be forked safely" not in errors.read_text()


class TestACollectorNobodyReaches:
    def test_a_drain_ends_promptly_and_stops_every_member_cleanly(self) -> None:
        """OpenTelemetry's exit handler retried the export for about 10 s in each process,
        past the 5 s a stopping member has: each was SIGTERMed, and the drain took 11 s."""
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{free_port()}/v1/traces",
            "OTEL_BSP_SCHEDULE_DELAY": "600000",  # every span still waits at the exit
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
        }
        with running_serve(workers=1, env=env, stderr=True) as run:
            request = urllib.request.Request(
                f"http://127.0.0.1:{run.port}/v1/completions",
                data=json.dumps({"prompt": "Hello", "max_tokens": 4}).encode(),
                headers={"content-type": "application/json", **CALLER},
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                assert answer.status == 200
            run.proc.send_signal(signal.SIGTERM)
            _, err = run.proc.communicate(timeout=60)
        assert run.proc.returncode == 0, err
        assert "did not stop" not in err
        assert "killed by" not in err
        assert "spans not exported within 1 s of this process's exit were dropped" in err


VALID = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


class TestTheCallersContext:
    @pytest.mark.parametrize(
        "value",
        [VALID, f" {VALID}\t", f"00-{TRACE_ID}-{CALLER_SPAN}-00"],
    )
    def test_a_well_formed_traceparent_is_kept(self, value: str) -> None:
        assert _tracing.parse_traceparent(value) == value.strip()

    def test_a_later_version_is_read_as_version_00_without_its_extra_fields(self) -> None:
        later = f"cc-{TRACE_ID}-{CALLER_SPAN}-01-what-comes-next"
        assert _tracing.parse_traceparent(later) == VALID

    @pytest.mark.parametrize(
        "value",
        [
            "",
            "garbage",
            f"ff-{TRACE_ID}-{CALLER_SPAN}-01",  # the forbidden version
            f"00-{'0' * 32}-{CALLER_SPAN}-01",  # all-zero trace id
            f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
            f"00-{TRACE_ID.upper()}-{CALLER_SPAN}-01",  # upper-case hex
            f"00-{TRACE_ID}-{CALLER_SPAN}-01-extra",  # version 00 has four fields
            f"00-{TRACE_ID}-{CALLER_SPAN}-01" + "x" * 100_000,
            f"00-{TRACE_ID[:-1]}-{CALLER_SPAN}-01",
        ],
    )
    def test_a_malformed_traceparent_is_ignored(self, value: str) -> None:
        assert _tracing.parse_traceparent(value) is None

    @given(st.text(max_size=200))
    def test_whatever_a_peer_sends_is_ignored_or_kept_as_55_characters(self, value: str) -> None:
        parsed = _tracing.parse_traceparent(value)
        assert parsed is None or (len(parsed) == 55 and parsed.startswith("00-"))


class TestUntracedMessages:
    def test_the_pipeline_messages_carry_no_trace_field(self) -> None:
        # The context travels in the frame header: the messages stay as they are untraced.
        for cls in (TokenizedGenerate, BatchTokenIDOutput, BatchStrOutput):
            assert not [f for f in cls.__struct_fields__ if "trace" in f], cls
