"""Serve suite: the OpenAI-compatible front end over real HTTP, ``serve`` against the shape
it replaces, with the CPU of every process from ``/proc``.

Run it with ``python -m benchmarks serve [--json PATH] [--full] [--concurrency N]
[--duration S] [--workers 1,2,4]``.

Variants, each a fresh server process (``benchmarks._serve_peer``) and its pipeline, loaded
from this process by the lean HTTP client (``actors.http.load``: C closed-loop clients
on keep-alive connections streaming ``/v1/completions`` with ``stream_options.include_usage``,
24 tokens a request, the stand-in engine at zero step time):

* **baseline k**: one uvicorn process holding an ``actors.Pipeline`` with k workers
  (``OpenAIApp`` over ``PipelineEngine``): every request is parsed, answered and streamed
  by that one process.
* **serve k**: ``python -m actors serve``'s shape with k workers: the port owned by one
  process, every worker parsing, tokenizing and streaming its own requests.
  With its default of one detokenizer per two workers (`actors.http._serve.default_detokenizers`).
* **serve 2, 2 detokenizers** and **serve 4, 1 detokenizer**: the same off that default.
* **serve 2, traced**: serve with 2 workers and tracing on (``TOKENYARD_TRACING`` names
  ``benchmarks._tracing``: the OpenTelemetry SDK records every hop's span in every
  process, batch-exported to an exporter that drops them), against **serve 2**, tracing off.
* **serve 2, 1 client** and **baseline, 2 workers, 1 client**: the same servers with one
  streaming client: a token's way through the front end with nothing queued behind other
  streams, where the inter-token latency is the path's (at the suite's concurrency a gap
  between two chunks of one stream is a share of what two CPUs deliver to all of them).
* **serve 2, context passed**: tracing off, but every request comes with a ``traceparent``
  header (which a worker that records nothing carries no further), against **serve 2**:
  what a client's context costs a server that does not trace.
* **serve 2, slow clients held**: the same load while another process holds
  `SLOW_CLIENTS` slowloris connections against the server (``benchmarks._slowloris``: each
  sends its headers a byte a second and never ends them; one the server's header timeout
  closes is opened again at once), against **serve 2**: what the normal clients' latency
  pays for a server held by slow ones.
* **serve kills**: serve with 2 workers under load (keep-alive clients, and clients opening a
  new connection for every request) while the server SIGKILLs a worker, in turn, 20 times:
  every failed request is checked against the server's record of which worker each
  connection went to. A *lost waiting connection* is a failure on a connection that no killed
  worker incarnation had taken, or a refused connection: it must be 0.

CPU: every process of the server's tree is read from ``/proc/<pid>/stat`` before and after
the timed load and grouped by its title (``tokenyard::<name>:<pid>``): the server's own
process, the workers, the detokenizer(s), the router, the scheduler (the stand-in engine,
reported apart). The load generator's CPU is this process's. **Measured**: requests/s,
latencies, CPU per request of each role. **Projected**: the ceiling when every process has a
core of its own, 1e6 / the busiest process's µs per request (the engine stand-in excluded):
on this 2-CPU machine the processes share two cores, so measured throughput cannot show it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import resource
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec

from actors._tracing import SETUP_ENV
from actors.http._serve import default_detokenizers
from actors.http.load import LoadResult, LoadSpec, run_load

from ._messages import TRACEPARENT
from ._proc import BenchmarkError, _env, reap
from ._results import BASELINE, INFO, SUBJECT, Chart, Figure, Ratio, SuiteResult, Target
from ._serve_peer import PeerReport
from ._stats import RULE, nearest_rank_quantile
from ._suite import Option, Suite, pick, positive_seconds
from ._tracing import SETUP as TRACING_SETUP
from .pipeline import WORKER_COUNTS, worker_counts

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator, Sequence

    from ._suite import Progress

MAX_TOKENS = 24
#: Slowloris connections held against the server in the slow-clients variant.
SLOW_CLIENTS = 1000
#: Worker SIGKILLs under load, unless --worker-kills says otherwise.
KILLS = 20

OPTIONS = (
    Option("--concurrency", "streaming clients (quick 32, full 64)"),
    Option(
        "--duration",
        "seconds of timed load per variant (quick 5, full 20)",
        type=positive_seconds,
        metavar="S",
    ),
    Option("--worker-kills", f"worker SIGKILLs under load ({KILLS})"),
    Option(
        "--workers",
        "tokenizer worker counts, comma-separated (1,2,4); 1, the baseline, always runs",
        type=worker_counts,
        metavar="LIST",
    ),
)

PROMPTS = (
    "Tell me about the harbour of Yokohama.",
    "你好，请介绍一下你自己。",  # noqa: RUF001 (CJK punctuation is the point)
    "Bonjour à tous 😀, quoi de neuf ?",
    "Explain continuous batching in one short paragraph, please.",
)
#: Roles a process of a server's tree plays, by the start of its title's name.
ROLES = ("server", "worker", "detokenizer", "router", "scheduler")
ENGINE = "scheduler"


@dataclass(frozen=True)
class Variant:
    """One server measured."""

    key: str
    label: str
    role: str  # "baseline" or "serve" (the peer's role)
    workers: int
    detokenizers: int = 1
    figure_role: str = SUBJECT
    traced: bool = False
    #: The clients send a ``traceparent`` header with every request.
    context: bool = False
    #: Slowloris connections held against the server during the load.
    slow_clients: int = 0
    #: Streaming clients of its load (0: the suite's ``--concurrency``).
    clients: int = 0


def variants(workers: Sequence[int]) -> list[Variant]:
    """The baselines and the serve variants, worker count by worker count."""
    out: list[Variant] = []
    for k in workers:
        out.append(Variant(f"baseline{k}", f"baseline, {k} workers", "baseline", k, 1, BASELINE))
        detokenizers = default_detokenizers(k)
        label = f"serve, {k} workers" + (f", {detokenizers} detokenizers" if k > 3 else "")
        out.append(Variant(f"serve{k}", label, "serve", k, detokenizers))
    if 4 in workers:
        out.append(Variant("serve4d1", "serve, 4 workers, 1 detokenizer", "serve", 4, 1, INFO))
    if 2 in workers:
        out.append(Variant("serve2d2", "serve, 2 workers, 2 detokenizers", "serve", 2, 2, INFO))
        out.append(Variant("serve2traced", "serve, 2 workers, traced", "serve", 2, 1, INFO, True))
        # A token's way through the front end, with nothing queued behind other streams:
        # at the suite's concurrency two CPUs share every stream, and a gap between two
        # chunks of one is a share of the throughput, not the path's latency.
        out.append(Variant("serve2c1", "serve, 2 workers, 1 client", "serve", 2, clients=1))
        out.append(
            Variant(
                "baseline2c1",
                "baseline, 2 workers, 1 client",
                "baseline",
                2,
                1,
                BASELINE,
                clients=1,
            )
        )
        out.append(
            Variant(
                "serve2context",
                "serve, 2 workers, context passed",
                "serve",
                2,
                1,
                INFO,
                context=True,
            )
        )
        out.append(
            Variant(
                "serve2slow",
                f"serve, 2 workers, {SLOW_CLIENTS:,} slow clients held",
                "serve",
                2,
                1,
                INFO,
                slow_clients=SLOW_CLIENTS,
            )
        )
    return out


# -- processes ------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """``pid`` and every descendant, from ``/proc``."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def role_of(pid: int, root: int) -> str:
    """What a process of the tree is, from its title (the root is the server)."""
    if pid == root:
        return "server"
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return "other"
    name = title.removeprefix("tokenyard::")
    for role in ROLES:
        if name.startswith(role) or (role == "worker" and name.startswith("tokenizer_worker")):
            return role
    return "other"


def snapshot(root: int) -> dict[int, tuple[str, float]]:
    """Every process of the tree: its role and CPU seconds so far."""
    return {p: (role_of(p, root), cpu_seconds(p)) for p in tree(root)}


class _Peer:
    """A server peer process: started, ready, stopped with its report."""

    def __init__(self, variant: Variant, kills: int = 0) -> None:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks._serve_peer",
            variant.role,
            "--workers",
            str(variant.workers),
            "--detokenizers",
            str(variant.detokenizers),
        ]
        if kills:
            cmd += ["--kills", str(kills), "--kill-every", "0.8"]
        env = _env()
        if variant.traced:
            env[SETUP_ENV] = TRACING_SETUP
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.port = self._ready(timeout=120.0)

    def _ready(self, timeout: float) -> int:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().decode() if ready else ""
        if not line.startswith("ready "):
            reap(self.proc, group=True)
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            raise BenchmarkError(f"a server did not start: {line!r}\n{err[-3000:]}")
        return int(line.split()[1])

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def stop(self) -> PeerReport:
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            reap(self.proc, group=True)
            raise BenchmarkError("a server did not stop within 60 s of SIGTERM") from None
        finally:
            reap(self.proc, group=True)
        lines = out.decode().strip().splitlines()
        if not lines:
            raise BenchmarkError(f"a server printed no report:\n{err.decode()[-3000:]}")
        return msgspec.json.decode(lines[-1], type=PeerReport)


@contextlib.contextmanager
def slow_clients(port: int, count: int) -> Iterator[None]:
    """``count`` slowloris connections held against ``port`` until the block ends."""
    if not count:
        yield
        return
    cmd = [sys.executable, "-m", "benchmarks._slowloris", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--connections", str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60.0)
        line = proc.stdout.readline().decode() if ready else ""
        if not line.startswith("holding"):
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise BenchmarkError(f"the slow clients did not connect: {line!r}\n{err[-2000:]}")
        yield
    finally:
        reap(proc, group=True)


@contextlib.contextmanager
def running(variant: Variant, kills: int = 0) -> Iterator[_Peer]:
    peer = _Peer(variant, kills)
    try:
        yield peer
    finally:
        if peer.proc.poll() is None:
            reap(peer.proc, group=True)


# -- one variant ------------------------------------------------------------------------------


def _rusage() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spec(port: int, concurrency: int, duration: float, **kw: Any) -> LoadSpec:
    return LoadSpec(
        url=f"http://127.0.0.1:{port}",
        concurrency=concurrency,
        duration=duration,
        requests=None,
        max_tokens=MAX_TOKENS,
        prompts=PROMPTS,
        **kw,
    )


def measure(variant: Variant, concurrency: int, duration: float) -> list[Figure]:
    """Load one server and read every process's CPU around the timed load."""
    headers = (("traceparent", TRACEPARENT),) if variant.context else ()
    concurrency = variant.clients or concurrency
    with running(variant) as peer:
        # The slow clients go before the server stops: it would drain them too.
        with slow_clients(peer.port, variant.slow_clients):
            warmup = _spec(peer.port, concurrency, min(duration, 1.5), headers=headers)
            anyio.run(run_load, warmup)
            root = peer.proc.pid
            before = snapshot(root)
            load0 = _rusage()
            spec = _spec(peer.port, concurrency, duration, headers=headers)
            result = anyio.run(run_load, spec)
            load_cpu = _rusage() - load0
            after = snapshot(root)
        peer.stop()
    return figures_of(variant, result, before, after, load_cpu)


def figures_of(
    variant: Variant,
    result: LoadResult,
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    load_cpu: float,
) -> list[Figure]:
    """The figures of one variant (pure: testable without a run)."""
    ok = [r for r in result.records if r.ok]
    n = len(ok)
    if not n:
        raise BenchmarkError(f"{variant.label}: no request succeeded ({result.records[:3]})")
    tokens = sum(r.output_tokens for r in ok)
    per_process = {
        pid: (role, cpu - before.get(pid, (role, 0.0))[1]) for pid, (role, cpu) in after.items()
    }
    by_role: dict[str, float] = collections.defaultdict(float)
    for role, cpu in per_process.values():
        by_role[role] += cpu
    front = [(cpu, pid) for pid, (role, cpu) in per_process.items() if role != ENGINE]
    busiest_cpu, _ = max(front)
    busiest_role = next(per_process[p][0] for c, p in front if c == busiest_cpu)
    us = 1e6 / n
    figs: list[Figure] = []

    def add(metric: str, value: float, unit: str, note: str = "", role: str = "") -> None:
        figs.append(
            Figure(
                key=f"{variant.key}.{metric}",
                variant=variant.label,
                payload="",
                metric=metric,
                value=round(value, 2),
                unit=unit,
                role=role or variant.figure_role,
                note=note,
            )
        )

    add("requests_per_s", n / result.elapsed, "req/s", "measured")
    add("tokens_per_s", tokens / result.elapsed, "tok/s", "measured")
    series = {
        "ttft": [r.ttft * 1e3 for r in ok if r.ttft is not None],
        "itl": [g * 1e3 for r in ok for g in r.itl],
        "e2e": [r.e2e * 1e3 for r in ok],
    }
    for name, values in series.items():
        for q in (0.5, 0.99):
            if values:
                add(f"{name}_p{round(q * 100)}", nearest_rank_quantile(values, q), "ms")
    # How to read the inter-token latency: at zero step time the engine stand-in outruns
    # the front end, so a text chunk carries several tokens, and the gaps between chunks
    # are either ~0 (chunks a client reads together) or a whole delivery period.
    chunks = sum(len(r.itl) + 1 for r in ok if r.ttft is not None)
    add("tokens_per_chunk", tokens / max(chunks, 1), "tok", "text chunks a client received", INFO)
    for role in ROLES:
        if role in by_role:
            add(f"cpu_{role}_us", by_role[role] * us, "us/req", "measured", INFO)
    add(
        "cpu_front_end_us",
        sum(c for c, _ in front) * us,
        "us/req",
        "every process but the engine stand-in and the load generator",
    )
    add("cpu_per_token_us", sum(c for c, _ in front) * 1e6 / max(tokens, 1), "us/tok", "front end")
    add("busiest_us", busiest_cpu * us, "us/req", f"the busiest process: the {busiest_role}")
    add(
        "projected_rps",
        1.0 / (busiest_cpu / n) if busiest_cpu else math.inf,
        "req/s",
        f"projected: a core per process; the busiest is the {busiest_role}",
    )
    add("load_generator_us", load_cpu * us, "us/req", "the load generator's own CPU", INFO)
    workers = collections.Counter(r.worker for r in ok if r.worker is not None)
    if workers:
        values = [workers.get(k, 0) for k in range(variant.workers)]
        add("balance", max(values) / max(min(values), 1), "x", "busiest / idlest worker")
    return figs


def measure_kills(concurrency: int, kills: int, timeout: float) -> tuple[list[Figure], list[str]]:
    """Serve with 2 workers under load while ``kills`` of its workers are SIGKILLed, one
    every 0.8 s once the previous one's successor serves; the load ends with the kills."""
    variant = Variant("kills", f"serve, 2 workers, {kills} SIGKILLs", "serve", 2)
    with running(variant, kills=kills) as peer:
        results: list[LoadResult] = []

        async def load() -> None:
            stop = asyncio.Event()

            async def one(spec: LoadSpec) -> None:
                results.append(await run_load(spec, stop))

            async def until_done() -> None:
                assert peer.proc.stdout is not None
                line = await anyio.to_thread.run_sync(peer.proc.stdout.readline)
                if line.strip() != b"kills done":
                    raise BenchmarkError(f"the killing server said {line!r}")
                stop.set()

            with anyio.fail_after(timeout):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(one, _spec(peer.port, concurrency, timeout))
                    tg.start_soon(one, _spec(peer.port, 4, timeout, keepalive=False))
                    tg.start_soon(until_done)
                    peer.go()

        anyio.run(load)
        report = peer.stop()
    records = [r for res in results for r in res.records]
    killed = set(report.killed)
    on_killed = {port for port, w, i in report.recent if (w, i) in killed}
    failed = [r for r in records if not r.ok]
    lost = [r for r in failed if r.error == "refused" or r.local_port not in on_killed]

    def figure(metric: str, value: float, role: str = INFO, **extra: Any) -> Figure:
        key = metric.replace(" ", "_")
        return Figure(
            key=f"kills.{key}",
            variant=variant.label,
            payload="",
            metric=metric,
            value=value,
            unit=extra.pop("unit", ""),
            role=role,
            **extra,
        )

    figs = [
        figure("kills", len(report.killed)),
        figure("requests", len(records)),
        figure(
            "failed in flight",
            len(failed) - len(lost),
            note="on connections a killed worker had taken",
        ),
        figure(
            "lost waiting",
            len(lost),
            SUBJECT,
            note="failures on connections no killed worker had taken, and refusals",
        ),
        figure(
            "rehanded",
            report.rehanded,
            note="connections a dying worker had not taken, given to the other",
        ),
    ]
    if report.restarts_ms:
        p50 = round(nearest_rank_quantile(report.restarts_ms, 0.5), 1)
        rounds = [round(r, 1) for r in report.restarts_ms]
        figs.append(figure("restart p50", p50, unit="ms", rounds=rounds))
    errors = collections.Counter(r.error for r in failed)
    return figs, [f"serve kills: failures by kind {dict(errors)}"]


# -- the suite --------------------------------------------------------------------------------

TARGETS = (
    (
        "serve 4 projected >= 3x baseline 4",
        "serve4.projected_rps",
        "baseline4.projected_rps",
        ">=",
        3.0,
    ),
    (
        "serve 4 front-end CPU <= 0.8x baseline 4",
        "serve4.cpu_front_end_us",
        "baseline4.cpu_front_end_us",
        "<=",
        0.8,
    ),
    ("serve 2 req/s >= best baseline", "serve2.requests_per_s", "BEST_BASELINE", ">=", 1.0),
    ("serve 4 balance <= 1.25x", "serve4.balance", "", "<=", 1.25),
    ("serve 2 inter-token latency p50 <= 0.5 ms, 1 client", "serve2c1.itl_p50", "", "<=", 0.5),
    ("0 waiting connections lost over the kills", "kills.lost_waiting", "", "<=", 0.0),
)


#: The variants compared with serve 2, untraced, and how their ratio names it.
AGAINST_SERVE2 = {
    "serve2traced": "tracing off",
    "serve2context": "no context",
    "serve2slow": "no slow clients",
}


def summarise(figures: list[Figure]) -> tuple[list[Figure], list[Target]]:
    """Ratios against the baselines and the issue's targets (pure: testable)."""
    by_key = {f.key: f for f in figures}
    for f in figures:
        variant, _, metric = f.key.partition(".")
        # serve k against baseline k, and serve 2 with one client against its baseline:
        # a variant's baseline is the one whose key differs only in its first word.
        same = by_key.get(f"baseline{variant[5:]}.{metric}") if variant[:5] == "serve" else None
        if same is not None and same.value:
            f.ratios.append(
                Ratio(baseline=same.key, label=same.variant, value=f.value / same.value)
            )
        label = AGAINST_SERVE2.get(variant)
        untraced = by_key.get(f"serve2.{metric}")
        if label is not None and untraced is not None and untraced.value:
            f.ratios.append(
                Ratio(baseline=untraced.key, label=label, value=f.value / untraced.value)
            )
    best = max(
        (f for f in figures if f.key.startswith("baseline") and f.metric == "requests_per_s"),
        key=lambda f: f.value,
        default=None,
    )
    targets = []
    for name, key, base, op, threshold in TARGETS:
        figure = by_key.get(key)
        denominator = best if base == "BEST_BASELINE" else by_key.get(base) if base else None
        if figure is None or (base and denominator is None):
            continue
        value = figure.value / denominator.value if denominator else figure.value
        met = value >= threshold if op == ">=" else value <= threshold
        targets.append(
            Target(
                name=name,
                figure=key,
                baseline=denominator.key if denominator else "",
                op=op,
                threshold=threshold,
                value=round(value, 3),
                met=met,
            )
        )
    return figures, targets


CHARTS = [
    Chart(
        name="serve-throughput",
        title="requests/s over HTTP: measured, and projected with "
        "a core per process (higher is better)",
        metrics=["requests_per_s", "projected_rps"],
        unit="req/s",
        panel_by="",
        log=True,
    ),
    Chart(
        name="serve-cpu",
        title="CPU per request by process role (lower is better)",
        metrics=[f"cpu_{r}_us" for r in ROLES],
        unit="us/req",
        panel_by="",
        kind="stacked",
    ),
]


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Every variant in its own server process; then the kills."""
    start = time.monotonic()
    concurrency = pick(args, "concurrency", 32, 64)
    given: float | None = getattr(args, "duration", None)
    duration = (20.0 if args.full else 5.0) if given is None else given
    todo = variants(getattr(args, "workers", None) or WORKER_COUNTS)
    progress.begin(len(todo) + 1)
    figures: list[Figure] = []
    for variant in todo:
        progress.step(variant.label)
        figures += measure(variant, concurrency, duration)
        progress.advance()
    kills = pick(args, "worker_kills", KILLS, KILLS)
    progress.step(f"serve, {kills} SIGKILLs under load")
    kill_figures, kill_notes = measure_kills(16, kills, timeout=180.0)
    figures += kill_figures
    progress.advance()
    figures, targets = summarise(figures)
    return SuiteResult(
        suite="serve",
        duration_s=round(time.monotonic() - start, 2),
        params={
            "concurrency": concurrency,
            "duration_s": duration,
            "max_tokens": MAX_TOKENS,
            "kills": kills,
            "worker_counts": ",".join(map(str, getattr(args, "workers", None) or WORKER_COUNTS)),
            "full": bool(args.full),
            "load": os.getloadavg()[0],
        },
        figures=figures,
        targets=targets,
        charts=CHARTS,
        notes=[
            "Measured: requests/s, latencies, CPU per request of every process (from /proc).",
            "Projected: 1e6 / the busiest front-end process's us per request, the ceiling "
            "with a core per process; this machine has 2 CPUs, so measured throughput "
            "cannot show scaling past them.",
            "The engine stand-in (scheduler) is excluded from the front end and reported "
            "apart; the load generator's CPU is reported apart.",
            f"Percentiles: {RULE}.",
            *kill_notes,
        ],
    )


SUITE = Suite(
    name="serve",
    help="the OpenAI front end over HTTP: serve vs one process holding a Pipeline",
    run=run,
    options=OPTIONS,
    rounds=False,
)
