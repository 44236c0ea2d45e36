"""Trace context through the pipeline of a real ``serve``: a request's ``traceparent`` comes
back as one connected trace whose spans were recorded by the worker, the scheduler and the
detokenizer, each in its own process."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import aiohttp

from actors import _tracing
from actors.http import open_server
from actors.messages import BatchStrOutput, BatchTokenIDOutput, TokenizedGenerate

from ._tracing_hook import SPANS_ENV

if TYPE_CHECKING:
    from pathlib import Path

    import pytest

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def spans_in(directory: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(directory.glob("spans-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


class TestTracing:
    async def test_a_traced_request_is_one_trace_through_worker_scheduler_and_detokenizer(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(_tracing.SETUP_ENV, "tests.http._tracing_hook:install")
        monkeypatch.setenv(SPANS_ENV, str(tmp_path))
        async with (
            open_server(workers=2, port=0) as server,
            aiohttp.ClientSession() as session,
        ):
            body = {"prompt": "Hello there", "max_tokens": 6, "stream": True}
            headers = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}
            async with session.post(
                f"{server.url}/v1/completions", json=body, headers=headers
            ) as response:
                assert response.status == 200
                assert b"[DONE]" in await response.read()
            # An untraced request records a trace of its own: not the caller's.
            async with session.post(f"{server.url}/v1/completions", json=body) as response:
                assert response.status == 200
                await response.read()
        spans = [s for s in spans_in(tmp_path) if s["trace_id"] == TRACE_ID]
        by_name = {s["name"]: s for s in spans}
        assert sorted(by_name) == [
            "tokenyard.detokenizer",
            "tokenyard.scheduler",
            "tokenyard.worker",
            "tokenyard.worker.respond",
        ], spans
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
        assert worker["attributes"]["tokenyard.finish_reason"] == "length"
        assert worker["attributes"]["tokenyard.completion_tokens"] == 6
        others = {s["trace_id"] for s in spans_in(tmp_path)} - {TRACE_ID}
        assert len(others) == 1


class TestUntracedMessages:
    def test_the_pipeline_messages_carry_no_trace_field(self) -> None:
        # The context travels in the frame header: the messages stay as they are untraced.
        for cls in (TokenizedGenerate, BatchTokenIDOutput, BatchStrOutput):
            assert not [f for f in cls.__struct_fields__ if "trace" in f], cls
