"""Pipeline suite: the LLM front end end to end, with the stand-in engine at zero step time.

Run it with ``python -m benchmarks pipeline [--json PATH] [--full] [--requests N]
[--concurrency N] [--workers 1,2,4]``.

Each worker count (1, 2 and 4 tokenizer workers by default; 1, the baseline, always runs)
runs in a fresh driver process that opens its own ``actors.Pipeline(workers=k,
step_time=0.0)`` on the bundled tokenizer: the scheduler, detokenizer, router, supervisor
and workers are processes of that driver's session, torn down with it. The load is
closed-loop: ``--concurrency`` clients each send one ``generate`` at a time and the next as
soon as it returns, until a round's ``--requests`` are done. Prompts cycle through a fixed
list mixing ASCII, CJK and emoji; ``max_new_tokens`` cycles through 16..32. One warm-up
round, then the timed rounds; a round's throughput is its requests over its wall time, its
latencies are per request, submit to result. The reported value is the best round (the
highest throughput, the round with the lowest p50), since on a shared machine noise only
ever makes a round slower.

With one worker the driver also times a short request (``max_new_tokens`` 4) alone, then
sent right behind a long prompt (``LONG_PROMPT_BYTES`` of the tokenizer's corpus, refused
once its tokens are counted) told to the same worker: what one long prompt costs the
requests that come after it, against the same request alone in the same run.

The tokenizer's share is measured in the same driver once its pipeline is closed: the
requests of the last round are tokenized (``encode``) and their outputs detokenized
incrementally, one id per push as the detokenizer gets them at zero step time, with the
bundled tokenizer in that process; that time per request is divided by the end-to-end
time per request.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from actors import Pipeline
from actors._detokenize import IncrementalDetokenizer
from actors._tokenizer import load_tokenizer
from actors.build_tokenizer import DEFAULT_CORPUS_PATH
from actors.messages import Generate, GetSchedulerStatistics, RequestOutputs
from runtime import Actor, TokenyardError, handler

from ._proc import BenchmarkError, Latency, die_with_parent, latency_of, started
from ._results import BASELINE, INFO, SUBJECT, Chart, Figure, Ratio, SuiteResult
from ._stats import RULE
from ._suite import Option, Suite, pick, positive_int

if TYPE_CHECKING:
    from collections.abc import Sequence

    from actors import GenerateResult

    from ._suite import Progress

#: Worker counts measured unless ``--workers`` says otherwise; 1 is the baseline.
WORKER_COUNTS = (1, 2, 4)
#: Processes besides the workers: scheduler, detokenizer, router, and the caller (the
#: driver, which holds the supervisor and the inbox in its event loop).
OTHER_PROCESSES = 4

PROMPTS = (
    "Hello there",
    "Explain continuous batching in one short paragraph, please.",
    "你好，世界！今天天气怎么样？",  # noqa: RUF001 (CJK punctuation is the point)
    "東京の天気は晴れです。明日は雨が降るでしょう。",
    "Bonjour à tous 😀 — ça va ?",
    "🇯🇵🎉👍🏽 emoji soup 🍜🍣🍱",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "안녕하세요, 만나서 반갑습니다.",
    "Привет, мир! Как дела?",
    "The quick brown fox jumps over the lazy dog. 🦊🐶",
)
MIN_NEW_TOKENS, MAX_NEW_TOKENS = 16, 32
#: UTF-8 bytes of the long prompt a short request is sent behind: just under the default
#: ``max_prompt_bytes``, about half a second of tokenizing with the bundled tokenizer.
LONG_PROMPT_BYTES = 1_000_000
#: Short requests timed alone, and as many behind a long prompt each (never more than a
#: round's requests, so a smoke run stays short).
BEHIND_SAMPLES = 5

SHARE_METHOD = (
    "tokenizer share = (encode of every prompt + incremental decode of every output, one id "
    "per push, with the bundled tokenizer in the driver process after its pipeline closed) "
    "per request, divided by the end-to-end wall time per request of the best round "
    "(round time / requests). 'of CPU' divides by the CPU time per request instead: user + "
    "system time of every pipeline process and the caller during that round, over requests."
)


def prompt_of(i: int) -> tuple[str, int]:
    """Request ``i``'s prompt and ``max_new_tokens`` (deterministic)."""
    span = MAX_NEW_TOKENS - MIN_NEW_TOKENS + 1
    return PROMPTS[i % len(PROMPTS)], MIN_NEW_TOKENS + (i * 7) % span


class Report(msgspec.Struct, kw_only=True):
    """What a driver prints on stdout (one JSON line) for the suite to read.

    Attributes:
        workers: Tokenizer workers of its pipeline.
        throughput: Requests per second, one value per round.
        latency: Submit-to-result times, one summary per round (microseconds).
        cpu_us: CPU time per request of every process of the run, one value per round
            (empty where ``/proc`` is not available).
        batch: Mean running batch of the engine (tokens per step), one value per round
            (empty when the scheduler's counters could not be read).
        encode_us: Encoding one request's prompt, best of the repeats.
        decode_us: Incrementally decoding one request's output, best of the repeats.
        prompt_tokens: Mean prompt length of the last round.
        completion_tokens: Mean completion length of the last round.
        startup_s: Seconds until every worker served.
        short_alone_us: A short request's latency alone (one worker only), per sample.
        short_behind_long_us: The same request's, sent right behind a long prompt.
    """

    workers: int
    throughput: list[float]
    latency: list[Latency]
    cpu_us: list[float]
    batch: list[float]
    encode_us: float
    decode_us: float
    prompt_tokens: float
    completion_tokens: float
    startup_s: float
    short_alone_us: list[float] = []
    short_behind_long_us: list[float] = []


# -- the driver: one pipeline, closed-loop load --------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(p) for p in (task / "children").read_text().split()]
    return out


def tree_cpu_seconds() -> float | None:
    """User + system CPU seconds of this process and every live descendant (Linux only)."""
    if not Path("/proc/self/stat").exists():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    todo = _children(os.getpid())
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError, ValueError, IndexError):
            # Fields after "(comm)": state is [0], utime [11], stime [12] (proc(5)).
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        todo += _children(pid)
    return total


async def engine_counts(p: Pipeline) -> tuple[int, int] | None:
    """The scheduler's steps and generated tokens so far (None if it cannot be asked)."""
    try:
        scheduler = await p.system.lookup("scheduler")
        stats = await scheduler.ask(GetSchedulerStatistics(), timeout=10.0)
    except (TokenyardError, LookupError, TimeoutError):
        return None
    return stats.steps, stats.generated_tokens


async def load_round(
    p: Pipeline, start: int, n: int, concurrency: int
) -> tuple[list[int], list[GenerateResult]]:
    """Requests ``start .. start+n`` from ``concurrency`` closed-loop clients.

    Returns:
        Each request's latency in nanoseconds and its result, in completion order.
    """
    samples: list[int] = []
    results: list[GenerateResult] = []
    indices = iter(range(start, start + n))

    async def client() -> None:
        for i in indices:
            text, budget = prompt_of(i)
            t0 = time.perf_counter_ns()
            result = await p.generate(text, max_new_tokens=budget)
            samples.append(time.perf_counter_ns() - t0)
            if result.finish_reason not in ("length", "stop"):
                raise BenchmarkError(f"request {i} finished with {result.finish_reason!r}")
            results.append(result)

    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, n)):
            tg.start_soon(client)
    return samples, results


def long_prompt() -> str:
    """The tokenizer's corpus over and over, cut to at most `LONG_PROMPT_BYTES`."""
    corpus = DEFAULT_CORPUS_PATH.read_text()
    text = (corpus * (LONG_PROMPT_BYTES // len(corpus) + 1))[:LONG_PROMPT_BYTES]
    return text.encode()[:LONG_PROMPT_BYTES].decode(errors="ignore")


class Ended:
    """Set at a long prompt's last output (shared with the driver)."""

    def __init__(self) -> None:
        self.event = anyio.Event()


class LongAnswers(Actor[RequestOutputs]):
    """Where the long prompts' answers go, in the driver's event loop."""

    def __init__(self, ended: Ended) -> None:
        self.ended = ended

    @handler
    def outputs(self, msg: RequestOutputs) -> None:
        if any(o.finish_reason is not None for o in msg.outputs):
            self.ended.event.set()


async def behind_long(p: Pipeline, samples: int) -> tuple[list[float], list[float]]:
    """A short request's latency alone, then sent right behind a long prompt to the same
    (only) worker, ``samples`` of each, in microseconds."""
    worker = p.worker_ref(0)
    if worker is None:
        raise BenchmarkError("the pipeline has no worker 0")
    ended = Ended()
    inbox = await p.system.spawn(LongAnswers, ended, process=False)
    text = long_prompt()

    async def short() -> float:
        t0 = time.perf_counter_ns()
        await p.generate(PROMPTS[0], max_new_tokens=4)
        return (time.perf_counter_ns() - t0) / 1e3

    alone = [await short() for _ in range(samples)]
    behind: list[float] = []
    for i in range(samples):
        ended.event = anyio.Event()
        await worker.tell(Generate(rid=f"long-{i}", reply_to=inbox, text=text))
        behind.append(await short())
        with anyio.fail_after(60):
            await ended.event.wait()  # the next sample starts with the worker idle
    return alone, behind


def time_tokenizer(
    prompts: Sequence[str], outputs: Sequence[GenerateResult], repeats: int
) -> tuple[float, float]:
    """Seconds per request to encode the prompts and to decode the outputs incrementally.

    The decode pushes one id at a time, as the detokenizer gets them from a zero-step-time
    engine, and must reproduce each result's text (checked once, untimed).

    Returns:
        (encode, decode) seconds per request, each the best of ``repeats``.
    """
    tokenizer = load_tokenizer()

    def decode(ids: list[int]) -> str:
        state = IncrementalDetokenizer(tokenizer)
        last = len(ids) - 1
        for j, token in enumerate(ids):
            state.push([token], finished=j == last)
        if not ids:
            state.push([], finished=True)
        return state.text

    for result in outputs:  # warm-up, and proof that the same work is timed
        if decode(result.output_ids) != result.text:
            raise BenchmarkError(f"incremental decode of {result.rid} differs from its text")
    n = len(prompts)
    encode_best = decode_best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for text in prompts:
            tokenizer.encode(text, add_special_tokens=False)
        t1 = time.perf_counter()
        for result in outputs:
            decode(result.output_ids)
        t2 = time.perf_counter()
        encode_best = min(encode_best, (t1 - t0) / n)
        decode_best = min(decode_best, (t2 - t1) / len(outputs))
    return encode_best, decode_best


async def drive(
    workers: int, requests: int, concurrency: int, rounds: int, behind: int = BEHIND_SAMPLES
) -> Report:
    """Open a pipeline of ``workers``, warm it up, time ``rounds`` rounds, then the tokenizer."""
    t0 = time.perf_counter()
    async with Pipeline(workers=workers, step_time=0.0) as p:
        startup = time.perf_counter() - t0
        warmup = max(requests // 10, concurrency)
        await load_round(p, 0, warmup, concurrency)
        throughput: list[float] = []
        latency: list[Latency] = []
        cpu_us: list[float] = []
        batch: list[float] = []
        results: list[GenerateResult] = []
        for r in range(rounds):
            engine0 = await engine_counts(p)
            cpu0 = tree_cpu_seconds()
            t1 = time.perf_counter()
            samples, results = await load_round(p, warmup + r * requests, requests, concurrency)
            elapsed = time.perf_counter() - t1
            cpu1 = tree_cpu_seconds()
            engine1 = await engine_counts(p)
            if engine0 is not None and engine1 is not None and engine1[0] > engine0[0]:
                batch.append((engine1[1] - engine0[1]) / (engine1[0] - engine0[0]))
            throughput.append(requests / elapsed)
            latency.append(latency_of(samples))
            if cpu0 is not None and cpu1 is not None:
                cpu_us.append((cpu1 - cpu0) / requests * 1e6)
        alone, late = await behind_long(p, behind) if workers == 1 and behind else ([], [])
    start = warmup + (rounds - 1) * requests
    prompts = [prompt_of(i)[0] for i in range(start, start + requests)]
    encode_s, decode_s = time_tokenizer(prompts, results, repeats=10)
    return Report(
        workers=workers,
        throughput=throughput,
        latency=latency,
        cpu_us=cpu_us,
        batch=batch,
        encode_us=encode_s * 1e6,
        decode_us=decode_s * 1e6,
        prompt_tokens=sum(r.prompt_tokens for r in results) / len(results),
        completion_tokens=sum(r.completion_tokens for r in results) / len(results),
        startup_s=startup,
        short_alone_us=alone,
        short_behind_long_us=late,
    )


# -- the suite: one driver per worker count -------------------------------------------------


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.pipeline", *args]


def run_report(cmd: Sequence[str], timeout: float) -> Report:
    """Run one driver to completion and read its report (``_proc.run_driver``'s rules).

    Raises:
        BenchmarkError: It exited with an error, ran past ``timeout`` seconds, or printed
            no report.
    """
    what = " ".join(cmd[2:])
    with started(cmd, capture=True, session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchmarkError(
                f"{what} did not finish within {timeout:g} s; pass a smaller --requests or "
                "check that the machine is not overloaded"
            ) from None
    text = err.decode(errors="replace").strip()
    if proc.returncode != 0:
        raise BenchmarkError(f"{what} exited with status {proc.returncode}:\n{text[-3000:]}")
    lines = out.decode().strip().splitlines()
    if not lines:
        raise BenchmarkError(f"{what} printed no report:\n{text[-3000:]}")
    return msgspec.json.decode(lines[-1], type=Report)


def label(workers: int) -> str:
    """How tables and charts name a worker count."""
    return f"{workers} worker" if workers == 1 else f"{workers} workers"


def _best(report: Report) -> int:
    """Index of the best round: the highest throughput."""
    return max(range(len(report.throughput)), key=report.throughput.__getitem__)


def figures_of(reports: Sequence[Report], concurrency: int) -> list[Figure]:
    """Throughput, latency and tokenizer figures of every worker count, ratios vs 1 worker
    (pure: testable without a run)."""
    load = f"{concurrency} clients"
    by_workers = {r.workers: r for r in reports}
    throughput: list[Figure] = []
    latency: list[Figure] = []
    tokenizer: list[Figure] = []
    costs: list[Figure] = []
    engine: list[Figure] = []
    for report in reports:
        k, name = report.workers, label(report.workers)
        role = BASELINE if k == 1 else SUBJECT
        throughput.append(
            Figure(
                key=f"w{k}.throughput",
                variant=name,
                payload=load,
                metric="throughput",
                value=round(max(report.throughput), 1),
                unit="req/s",
                role=role,
                rounds=[round(x, 1) for x in report.throughput],
            )
        )
        best = min(report.latency, key=lambda r: r.p50_us)
        latency += [
            Figure(
                key=f"w{k}.{metric}",
                variant=name,
                payload=load,
                metric=metric,
                value=round(getattr(best, f"{metric}_us") / 1000, 2),
                unit="ms",
                role=role,
                rounds=[round(getattr(r, f"{metric}_us") / 1000, 2) for r in report.latency],
            )
            for metric in ("p50", "p99")
        ]
        tok_us = report.encode_us + report.decode_us
        costs.append(
            Figure(
                key=f"w{k}.tokenizer_us",
                variant=name,
                payload="per request",
                metric="tokenizer encode + decode",
                value=round(tok_us, 1),
                unit="us",
                role=INFO,
                note=f"encode {report.encode_us:.1f} us, decode {report.decode_us:.1f} us",
            )
        )
        wall_us = [1e6 / x for x in report.throughput]
        best_round = _best(report)
        tokenizer.append(
            Figure(
                key=f"w{k}.tokenizer_share",
                variant=name,
                payload="tokenizer",
                metric="share of wall time",
                value=round(100 * tok_us / wall_us[best_round], 1),
                unit="%",
                role=INFO,
                rounds=[round(100 * tok_us / w, 1) for w in wall_us],
                note=f"{tok_us:.0f} us tokenizer / {wall_us[best_round]:.0f} us per request",
            )
        )
        if len(report.cpu_us) == len(report.throughput):
            costs.append(
                Figure(
                    key=f"w{k}.cpu_us",
                    variant=name,
                    payload="per request",
                    metric="CPU, all processes",
                    value=round(report.cpu_us[best_round], 1),
                    unit="us",
                    role=INFO,
                    rounds=[round(c, 1) for c in report.cpu_us],
                    note="user + system time of the caller and every pipeline process",
                )
            )
            tokenizer.append(
                Figure(
                    key=f"w{k}.tokenizer_cpu_share",
                    variant=name,
                    payload="tokenizer",
                    metric="share of CPU",
                    value=round(100 * tok_us / report.cpu_us[best_round], 1),
                    unit="%",
                    role=INFO,
                    rounds=[round(100 * tok_us / c, 1) for c in report.cpu_us],
                    note=f"{tok_us:.0f} us tokenizer / {report.cpu_us[best_round]:.0f} us CPU",
                )
            )
        if len(report.batch) == len(report.throughput):
            engine.append(
                Figure(
                    key=f"w{k}.batch",
                    variant=name,
                    payload="engine",
                    metric="running batch (tokens/step)",
                    value=round(report.batch[best_round], 1),
                    unit="tokens",
                    role=INFO,
                    rounds=[round(b, 1) for b in report.batch],
                    note="mean tokens generated per engine step during the round",
                )
            )
    base = by_workers.get(1)
    behind = _behind_figures(base) if base is not None else []
    if base is not None:
        base_fig = throughput[reports.index(base)]
        for fig in throughput:
            if fig is not base_fig and base_fig.value:
                fig.ratios.append(
                    Ratio(baseline=base_fig.key, label="1 worker", value=fig.value / base_fig.value)
                )
    return throughput + latency + behind + tokenizer + costs + engine


def _behind_figures(report: Report) -> list[Figure]:
    """A short request's latency alone and behind a long prompt (one worker's driver)."""
    if not report.short_alone_us or not report.short_behind_long_us:
        return []
    alone, behind = (
        Figure(
            key=f"w1.short_{which}",
            variant=f"short request, {what}",
            payload="1 worker",
            metric="p50",
            value=round(statistics.median(samples) / 1000, 2),
            unit="ms",
            role=role,
            rounds=[round(x / 1000, 2) for x in samples],
            note=f"{len(samples)} requests, max_new_tokens 4",
        )
        for which, what, samples, role in (
            ("alone", "alone", report.short_alone_us, BASELINE),
            (
                "behind_long",
                f"sent behind a {LONG_PROMPT_BYTES // 1000:,} kB prompt",
                report.short_behind_long_us,
                SUBJECT,
            ),
        )
    )
    if alone.value:
        behind.ratios.append(
            Ratio(baseline=alone.key, label="alone", value=behind.value / alone.value)
        )
    return [alone, behind]


CHARTS = [
    Chart(
        name="pipeline-throughput",
        title="pipeline end to end, engine at zero step time (higher is better)",
        metrics=["throughput"],
        unit="req/s",
        panel_by="",
        reference=label(1),
    ),
    Chart(
        name="pipeline-latency",
        title="pipeline request latency, submit to result (lower is better)",
        metrics=["p50", "p99"],
        unit="ms",
        panel_by="",
    ),
]


def worker_counts(text: str) -> tuple[int, ...]:
    """``--workers``: comma-separated worker counts, plus 1 (the baseline), ascending.

    Raises:
        argparse.ArgumentTypeError: A count is not a positive whole number.
    """
    try:
        counts = {positive_int(part.strip()) for part in text.split(",")}
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(
            f"expected worker counts such as 1,2,4, got {text!r}: {err}"
        ) from None
    return tuple(sorted(counts | {1}))


OPTIONS = (
    Option("--requests", "requests per timed round, each worker count (quick 1000, full 10000)"),
    Option("--concurrency", "closed-loop clients, each with one request in flight (64)"),
    Option(
        "--workers",
        "tokenizer worker counts, comma-separated (1,2,4); 1, the baseline, always runs",
        type=worker_counts,
        metavar="K,K,...",
        dest="worker_counts",
    ),
)


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Measure each worker count in a fresh driver process and compare with 1 worker."""
    start = time.monotonic()
    rounds = args.rounds or (5 if args.full else 3)
    requests = pick(args, "requests", 1_000, 10_000)
    concurrency = pick(args, "concurrency", 64, 64)
    counts: tuple[int, ...] = getattr(args, "worker_counts", None) or WORKER_COUNTS
    timeout = 900.0 if args.full else 180.0
    progress.begin(len(counts))
    reports: list[Report] = []
    for k in counts:
        progress.step(label(k))
        cmd = _command(
            "--driver", "--workers", str(k), "--requests", str(requests),
            "--concurrency", str(concurrency), "--rounds", str(rounds),
            "--behind", str(min(BEHIND_SAMPLES, requests)),
        )  # fmt: skip
        reports.append(run_report(cmd, timeout))
        progress.advance()
    figures = figures_of(reports, concurrency)
    last = reports[-1]
    notes = [
        "Values are the best of the timed rounds (all rounds are in the JSON); latency"
        " figures come from the round with the lowest p50, over that round's requests.",
        RULE,
        f"Closed loop: {concurrency} clients, one generate each in flight; prompts cycle"
        f" through {len(PROMPTS)} ASCII/CJK/emoji texts, max_new_tokens {MIN_NEW_TOKENS}"
        f"..{MAX_NEW_TOKENS}; stand-in engine at step_time=0, bundled tokenizer.",
        SHARE_METHOD,
        f"Short request behind a long prompt (1 worker): {PROMPTS[0]!r}, max_new_tokens 4,"
        f" timed alone, then sent right after a {LONG_PROMPT_BYTES:,}-byte prompt told to the"
        " same worker (refused once tokenized); the next sample waits for that refusal.",
        f"Mean tokens per request: {last.prompt_tokens:.1f} prompt,"
        f" {last.completion_tokens:.1f} completion.",
    ]
    if all(len(r.batch) == len(r.throughput) for r in reports):
        batches = ", ".join(f"{r.batch[_best(r)]:.1f} with {label(r.workers)}" for r in reports)
        notes.append(
            "At zero step time the engine steps as fast as it can, so its running batch stays"
            f" small (mean tokens per step, best round: {batches}) and the per-step work -"
            " one sub-batch message to every worker that has requests in the step - weighs"
            " more with more workers."
        )
    cpus = os.cpu_count() or 0
    if cpus < max(counts) + OTHER_PROCESSES:
        notes.append(
            f"This machine has {cpus} CPUs for up to {max(counts) + OTHER_PROCESSES}"
            " busy processes: more workers add processes competing for the same CPUs, so the"
            " ratios show the cost of the extra hops here, not the scaling on a larger machine."
        )
    return SuiteResult(
        suite="pipeline",
        duration_s=round(time.monotonic() - start, 2),
        params={
            "rounds": rounds,
            "requests": requests,
            "concurrency": concurrency,
            "warmup_requests": max(requests // 10, concurrency),
            "worker_counts": ",".join(map(str, counts)),
            "prompts": len(PROMPTS),
            "max_new_tokens": f"{MIN_NEW_TOKENS}..{MAX_NEW_TOKENS}",
            "step_time": 0.0,
            "tokenizer_share": SHARE_METHOD,
            "full": bool(args.full),
            **{f"startup_s_{r.workers}_workers": round(r.startup_s, 2) for r in reports},
        },
        figures=figures,
        charts=list(CHARTS),
        notes=notes,
    )


SUITE = Suite(
    name="pipeline",
    help="the pipeline end to end: requests/s and latency for 1, 2 and 4 workers (--workers)",
    run=run,
    options=OPTIONS,
)


def main(argv: list[str] | None = None) -> int:
    """Run one driver (the suite starts each with ``--driver``); ``python -m
    benchmarks.pipeline`` without it runs the suite, as ``python -m benchmarks pipeline``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", add_help=False)
    parser.add_argument("--driver", action="store_true")
    parser.add_argument("--workers", default="1")
    parser.add_argument("--requests", type=int, default=1_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--behind", type=int, default=BEHIND_SAMPLES)
    opts, _ = parser.parse_known_args(argv)
    if not opts.driver:
        raise SystemExit(
            "a pipeline driver runs with --driver: the suite is python -m benchmarks pipeline"
        )
    die_with_parent()
    report = anyio.run(
        drive, int(opts.workers), opts.requests, opts.concurrency, opts.rounds, opts.behind
    )
    sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    return 0


if __name__ == "__main__":
    if "--driver" in sys.argv[1:]:
        # Run under the import name, so the suite's objects are defined once.
        from benchmarks.pipeline import main as _main

        sys.exit(_main())
    # Without --driver this is `python -m benchmarks pipeline`, run as that program is:
    # importing the CLI from here would close a circle (the CLI lists this suite).
    import runpy

    sys.argv[1:1] = ["pipeline"]
    runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
