"""``GET /metrics`` on a real ``serve``: every worker answers with the whole system's
series, which parse with prometheus_client's parser, add up to what the load saw, are the
same whichever worker answers, and show a SIGKILLed worker's restart and its dead
incarnation."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import aiohttp
import anyio
from prometheus_client.parser import text_string_to_metric_families

from actors.http import open_server
from actors.http._worker import WORKER_HEADER
from actors.http.load import LoadSpec, run_load

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

MODEL = "tokenyard-bundled-bpe"
PIPELINE_NAMES = (
    "tokenyard:time_to_first_token_seconds",
    "tokenyard:inter_token_latency_seconds",
    "tokenyard:e2e_request_latency_seconds",
    "tokenyard:request_queue_time_seconds",
    "tokenyard:num_requests_running",
    "tokenyard:num_requests_waiting",
    "tokenyard:prompt_tokens",
    "tokenyard:generation_tokens",
    "tokenyard:request_success",
    "tokenyard:worker_requests",
    "tokenyard:detokenizer_live_states",
    "tokenyard:member_restarts",
    "tokenyard:resubmissions",
    "tokenyard:worker_died_errors",
    "tokenyard:http_requests",
    "tokenyard:http_requests_active",
    "tokenyard:http_streams",
    "tokenyard:http_errors",
    "tokenyard:http_disconnects",
)


async def scrape(url: str) -> tuple[int, str]:
    """One ``GET /metrics`` on a new connection: the worker that answered, and the text."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
        session.get(f"{url}/metrics") as response,
    ):
        assert response.status == 200, await response.text()
        assert response.headers["content-type"].startswith("text/plain")
        return int(response.headers[WORKER_HEADER.decode()]), await response.text()


async def unknown_model(url: str) -> int:
    """A completion for a model not served (404): the worker that refused it."""
    body = {"model": "no-such-model", "prompt": "hi", "max_tokens": 1}
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
        session.post(f"{url}/v1/completions", json=body) as response,
    ):
        assert response.status == 404, await response.text()
        return int(response.headers[WORKER_HEADER.decode()])


def families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Metric], sample: str, **labels: str) -> float:
    """The value of the one sample of that name whose labels include ``labels``."""
    family = fams[sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")]
    found = [
        s.value
        for s in family.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (sample, labels, found)
    return found[0]


def value_or_0(fams: dict[str, Metric], sample: str, **labels: str) -> float:
    """The value of the one series of ``sample`` with ``labels``, or 0 when it has none."""
    for family in fams.values():
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def total(fams: dict[str, Metric], sample: str) -> float:
    family = fams[sample.removesuffix("_total")]
    return sum(s.value for s in family.samples if s.name == sample)


async def from_both_workers(url: str, after: float = 0.0) -> dict[int, str]:
    """Scrapes until both workers answered from the same gathering, made later than
    ``after`` (which worker takes a new connection is the dispatcher's choice, and a
    gathering is served for a second)."""
    seen: dict[int, str] = {}
    with anyio.fail_after(20):
        while True:  # sync-ok: bounded by the deadline; each scrape is a real request
            worker, text = await scrape(url)
            seen[worker] = text
            stamps = {
                value(families(t), "tokenyard_metrics_gathered_timestamp_seconds")
                for t in seen.values()
            }
            if len(seen) == 2 and len(stamps) == 1 and stamps.pop() > after:
                return seen
            if len(stamps) == 1 and min(stamps) <= after:
                seen.clear()  # the gathering from before: wait for the next


class TestMetricsOfARealServer:
    async def test_metrics_under_load_parse_add_up_and_are_the_same_from_every_worker(
        self,
    ) -> None:
        async with open_server(workers=2, port=0) as server:
            # Counts are cumulative in each process, this one's included (where an
            # in-process scheduler of an earlier test may have counted): read what they say
            # before the load.
            before = families((await from_both_workers(server.url))[0])
            spec = LoadSpec(url=server.url, concurrency=6, requests=48, max_tokens=6)
            load = await run_load(spec)
            assert all(r.ok for r in load.records), [r.error for r in load.records]
            refused_by = await unknown_model(server.url)
            gathered = value(before, "tokenyard_metrics_gathered_timestamp_seconds")
            texts = await from_both_workers(server.url, after=gathered)
        assert texts[0] == texts[1]
        fams = families(texts[0])
        for name in PIPELINE_NAMES:
            assert name in fams, name
        served = len(load.records)
        model = {"model_name": MODEL}

        def added(sample: str, **labels: str) -> float:
            """What the load added to ``sample``."""
            return value(fams, sample, **labels) - value_or_0(before, sample, **labels)

        assert added("tokenyard:time_to_first_token_seconds_count", **model) == served
        assert added("tokenyard:e2e_request_latency_seconds_count", **model) == served
        assert added("tokenyard:request_queue_time_seconds_count", **model) == served
        assert total(fams, "tokenyard:worker_requests_total") == served
        assert total(fams, "tokenyard:request_success_total") == served
        per_worker: defaultdict[int, int] = defaultdict(int)
        for record in load.records:
            assert record.worker is not None
            per_worker[record.worker] += 1
        for worker, count in per_worker.items():
            counted = value(fams, "tokenyard:worker_requests_total", worker=str(worker))
            assert counted == count
        # The workers' HTTP apps: each load request a stream; the one refusal a 4xx; the
        # scrapes plain answers (each worker's requests count them too).
        for worker in (0, 1):
            labels = {"worker": str(worker), **model}
            assert added("tokenyard:http_streams_total", **labels) == per_worker[worker]
            requests = added("tokenyard:http_requests_total", **labels)
            assert requests >= per_worker[worker] + (worker == refused_by)
            client_errors = added("tokenyard:http_errors_total", status_class="4xx", **labels)
            assert client_errors == (worker == refused_by)
            assert added("tokenyard:http_errors_total", status_class="5xx", **labels) == 0
            assert added("tokenyard:http_disconnects_total", **labels) == 0
        generated = sum(r.output_tokens for r in load.records)
        assert added("tokenyard:generation_tokens_total", **model) == generated
        assert value(fams, "tokenyard:num_requests_running", **model) == 0
        assert value(fams, "tokenyard:prompt_tokens_total", **model) > served
        ttft = value(fams, "tokenyard:time_to_first_token_seconds_sum", **model)
        assert 0 < ttft / served < 5
        # Every process of the system, with its resources read from /proc.
        titles = {s.labels["process"] for s in fams["process_cpu_seconds"].samples}
        assert {"pipeline", "scheduler", "router", "detokenizer:0"} <= titles
        assert {"tokenizer_worker:0", "tokenizer_worker:1"} <= titles
        assert all(s.value > 0 for s in fams["process_resident_memory_bytes"].samples)
        up = {s.labels["actor"]: s.value for s in fams["tokenyard_actor_up"].samples}
        assert up["tokenizer_worker:0"] == up["scheduler"] == up["metrics"] == 1
        handled = value(
            fams, "tokenyard_actor_messages_handled_total", actor="scheduler", incarnation="1"
        )
        assert handled >= served

    async def test_a_sigkilled_worker_shows_its_restart_and_its_dead_incarnation(self) -> None:
        async with open_server(workers=2, port=0) as server:
            load = await run_load(LoadSpec(url=server.url, concurrency=4, requests=16))
            assert all(r.ok for r in load.records)
            _, before = await scrape(server.url)  # the collector has seen worker 1 alive
            served_by_1 = value(families(before), "tokenyard:worker_requests_total", worker="1")
            killed = server.pipeline.kill_worker(1)
            back = await server.pipeline.wait_worker(1, after=killed.incarnation)
            with anyio.fail_after(20):
                while True:  # sync-ok: a gathering is served for up to a second
                    _, text = await scrape(server.url)
                    fams = families(text)
                    ups = {
                        s.labels["incarnation"]: s.value
                        for s in fams["tokenyard_actor_up"].samples
                        if s.labels["actor"] == "tokenizer_worker:1"
                    }
                    if str(back.incarnation) in ups:
                        break
        assert ups == {str(killed.incarnation): 0.0, str(back.incarnation): 1.0}
        child = {"supervisor": "pipeline-supervisor", "child": "tokenizer_worker:1"}
        was = families(before)

        def added(sample: str, **labels: str) -> float:
            """What the kill added (counts live as long as their process: an earlier test's
            supervisor in this process counted its own restarts)."""
            return value(fams, sample, **labels) - value_or_0(was, sample, **labels)

        assert added("tokenyard_restarts_total", cause="signal", **child) == 1
        assert added("tokenyard_child_deaths_total", cause="signal", **child) == 1
        member = {"member": "tokenizer_worker:1", "cause": "signal"}
        assert added("tokenyard:member_restarts_total", **member) == 1
        # What the dead worker counted stays counted: the sum never goes backwards.
        assert value(fams, "tokenyard:worker_requests_total", worker="1") == served_by_1
        assert total(fams, "tokenyard:worker_requests_total") == len(load.records)
