"""Engines suite: tokenyard's front end against another front end **on the same engine**,
measured in the same run, with the CPU of every process (and, for llama.cpp's server, every
thread) from ``/proc``, split front end / engine.

Run it with ``python -m benchmarks engines [--json PATH] [--full] [--concurrency N]
[--duration S] [--worker-counts 1,2] [--max-tokens N] [--n-parallel N] [--engines
llamacpp,vllm] [--vllm-python PATH]``.

**llama.cpp** (the ``llamacpp`` extra): the tiny random-weight model (`actors._gguf`, its
*clean* variant, which never writes a byte fragment, so that llama.cpp's stream names every
token and neither side recovers or regenerates held tokens: the engine does the same work
for both), served by

* **llama.cpp's server** (the baseline): ``xllamacpp.Server``, llama.cpp's own
  ``llama-server`` in one process (`benchmarks._llamacpp_server`), its HTTP threads the
  front end and its compute thread, named ``llama-engine`` there, the engine;
* **tokenyard, k workers**: ``python -m actors serve --engine llamacpp --workers k``, whose
  scheduler process runs the same llama.cpp in-process; every other process (port owner
  and supervisor, fork server, workers, detokenizers, router) is the front end.

Both get the same slots (``--n-parallel``), context per slot, and one compute thread.

**vLLM** (`benchmarks._vllm_frontend`): ``vllm serve`` with 1 and 2 API servers against
tokenyard attached to a headless engine with 1 and 2 workers; skipped, with the reason in
the notes, when vLLM's venv or the vLLM engine is missing.

The load, the same for every front end: ``--concurrency`` closed-loop clients on keep-alive
connections (`actors.http.load`, in this process) streaming ``/v1/completions`` with
``stream_options.include_usage`` and ``ignore_eos`` (both servers honour it: every request
generates ``--max-tokens`` tokens, which ``output_tokens`` shows), the same prompts, a
warm-up of `WARMUP` seconds (less when ``--duration`` is shorter), then ``--duration``
seconds timed.

**Measured**: requests/s, output tokens/s, TTFT, ITL (the gaps between text chunks as the
client reads them: chunks a server's writes coalesce on the socket arrive together, a gap
of microseconds), TPOT (per request, (end-to-end - TTFT) / (output tokens - 1)), end-to-end
latency, CPU per request of every part. **Projected**: the front end's ceiling with a core
per unit, 1e6 / the busiest front-end unit's µs per request: a process for tokenyard and
vLLM (one Python interpreter each), a thread for llama.cpp's server (C++ threads run in
parallel in one process).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from actors.http.load import LoadResult, LoadSpec, run_load

from . import _vllm_frontend as vllm
from ._frontend import (
    ENGINE,
    ENGINE_PARTS,
    PARTS,
    FrontEnd,
    Snapshot,
    llamacpp_engine_args,
    open_llamacpp_server,
    open_tokenyard,
    thread_cpu,
)
from ._proc import BenchmarkError
from ._results import BASELINE, INFO, SUBJECT, Chart, Figure, Ratio, SuiteResult, Target
from ._stats import RULE, nearest_rank_quantile
from ._suite import Option, Suite, pick, positive_seconds
from .serve import PROMPTS

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from contextlib import AbstractContextManager

    from ._suite import Progress

LLAMACPP = "llamacpp"
VLLM = "vllm"
ENGINES = (LLAMACPP, VLLM)
WORKER_COUNTS = (1, 2)
MAX_TOKENS = 32
N_PARALLEL = 4
#: Tokens of one slot (prompt plus completion), tokenyard's engine's default.
CONTEXT = 2048
#: llama.cpp's compute threads: the machine has 2 CPUs, shared.
THREADS = 1
#: vLLM's max_num_seqs, both sides.
VLLM_MAX_NUM_SEQS = 16


def counts(text: str) -> tuple[int, ...]:
    """``--worker-counts``: positive counts, comma-separated."""
    try:
        values = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,2, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"counts must be at least 1, got {text!r}")
    return tuple(values)


def engines(text: str) -> tuple[str, ...]:
    """``--engines``: some of `ENGINES`, comma-separated."""
    chosen = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [e for e in chosen if e not in ENGINES]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"choose among {', '.join(ENGINES)}, got {text!r}")
    return chosen


OPTIONS = (
    Option("--concurrency", "streaming clients (quick 8, full 16)"),
    Option(
        "--duration",
        "seconds of timed load per variant (quick 5, full 20)",
        type=positive_seconds,
        metavar="S",
    ),
    Option(
        "--worker-counts",
        "engines: tokenyard worker counts and vLLM API server counts, comma-separated (1,2)",
        type=counts,
        metavar="LIST",
    ),
    Option("--max-tokens", f"engines: tokens each request generates ({MAX_TOKENS})"),
    Option("--n-parallel", f"engines: llama.cpp's slots, both front ends ({N_PARALLEL})"),
    Option(
        "--engines",
        "engines: the comparisons to run, comma-separated (llamacpp,vllm)",
        type=engines,
        metavar="LIST",
    ),
    Option(
        "--vllm-python",
        "engines: the Python of vLLM's venv (.venv-vllm/bin/python)",
        type=str,
        metavar="PATH",
    ),
)


@dataclass(frozen=True)
class Variant:
    """One front end measured.

    Attributes:
        key: Prefix of its figures' keys.
        label: Its name in tables and charts.
        engine: `LLAMACPP` or `VLLM` (the charts' panel).
        baseline: Key of the variant it is compared with (``""``: it is a baseline).
        processes: Front-end processes it was asked for (workers, API servers; 1 for
            llama.cpp's server): the targets compare front ends of the same count.
        vllm_clients: On vLLM, tokenyard's ``--vllm-clients``: ``workers`` (the default,
            which the targets hold) or ``scheduler`` (its ratios for information).
    """

    key: str
    label: str
    engine: str
    baseline: str = ""
    processes: int = 1
    vllm_clients: str = "workers"

    @property
    def targeted(self) -> bool:
        """Whether the targets hold it (not the scheduler path on vLLM, which the default
        path replaces)."""
        return self.vllm_clients == "workers"

    @property
    def role(self) -> str:
        return SUBJECT if self.baseline else BASELINE


LLAMACPP_SERVER = Variant("llamacpp", "llama.cpp's server", LLAMACPP)


def llamacpp_variants(worker_counts: Sequence[int]) -> list[Variant]:
    """llama.cpp's server, then tokenyard with each worker count."""
    out = [LLAMACPP_SERVER]
    for k in worker_counts:
        label = f"tokenyard, {k} worker{'s' if k > 1 else ''}"
        out.append(Variant(f"tokenyard{k}", label, LLAMACPP, LLAMACPP_SERVER.key, k))
    return out


def vllm_variants(worker_counts: Sequence[int]) -> list[Variant]:
    """vllm serve with k API servers, then tokenyard with k workers, each the engine's
    client (``--vllm-clients workers``, the default), then with the scheduler its one
    client (``--vllm-clients scheduler``), for each k."""
    out = []
    for k in worker_counts:
        base = Variant(f"vllm_api{k}", f"vllm serve, {k} API server{'s' * (k > 1)}", VLLM, "", k)
        workers = f"{k} worker{'s' * (k > 1)}"
        out += [
            base,
            Variant(f"tokenyard_vllm{k}", f"tokenyard on vLLM, {workers}", VLLM, base.key, k),
            Variant(
                f"tokenyard_vllm_scheduler{k}",
                f"tokenyard on vLLM, {workers}, via the scheduler",
                VLLM,
                base.key,
                k,
                vllm_clients="scheduler",
            ),
        ]
    return out


# -- one variant ------------------------------------------------------------------------------


def _rusage() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spec(
    url: str, concurrency: int, duration: float, max_tokens: int, model: str | None
) -> LoadSpec:
    return LoadSpec(
        url=url,
        concurrency=concurrency,
        duration=duration,
        requests=None,
        max_tokens=max_tokens,
        prompts=PROMPTS,
        model=model,
        ignore_eos=True,
    )


def engine_threads(snap: Snapshot) -> dict[str, float]:
    """The engine's threads and their CPU so far: each thread of an engine process, or
    each engine unit that is a thread already."""
    out: dict[str, float] = {}
    for key, unit in snap.items():
        if unit.part not in ENGINE_PARTS:
            continue
        if "/" in key:
            out[key] = unit.cpu
        else:
            out |= {f"{key}/{tid}": cpu for tid, (_, cpu) in thread_cpu(int(key)).items()}
    return out


@dataclass
class Measured:
    """What one variant's timed load gave: the load's records and every unit's CPU."""

    result: LoadResult
    before: Snapshot
    after: Snapshot
    threads_before: dict[str, float]
    threads_after: dict[str, float]
    load_cpu: float
    units: str


#: Seconds of load before the timed part: a fresh vLLM engine answers its first batches
#: slowly for about 2 s (requests sent then waited 0.5 s and more for their first token).
WARMUP = 3.0


def measure(
    front: FrontEnd,
    concurrency: int,
    duration: float,
    max_tokens: int,
    model: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> Measured:
    """Warm ``front`` up, then load it for ``duration`` s, reading its CPU around that."""
    progress("warm-up")
    anyio.run(run_load, _spec(front.url, concurrency, min(duration, WARMUP), max_tokens, model))
    progress(f"{duration:g} s of load")
    before = front.snapshot()
    threads_before = engine_threads(before)
    load0 = _rusage()
    result = anyio.run(run_load, _spec(front.url, concurrency, duration, max_tokens, model))
    load_cpu = _rusage() - load0
    after = front.snapshot()
    threads_after = engine_threads(after)
    return Measured(result, before, after, threads_before, threads_after, load_cpu, front.units)


def figures_of(variant: Variant, m: Measured) -> list[Figure]:
    """The figures of one variant (pure: testable without a run)."""
    ok = [r for r in m.result.records if r.ok]
    n = len(ok)
    if not n:
        raise BenchmarkError(f"{variant.label}: no request succeeded ({m.result.records[:3]})")
    tokens = sum(r.output_tokens for r in ok)
    delta = {
        key: (unit.part, unit.cpu - m.before[key].cpu if key in m.before else unit.cpu)
        for key, unit in m.after.items()
    }
    by_part: dict[str, float] = dict.fromkeys(PARTS, 0.0)
    for part, cpu in delta.values():
        by_part[part] += cpu
    front = {key: cpu for key, (part, cpu) in delta.items() if part not in ENGINE_PARTS}
    if m.units == "thread":  # the ended threads' CPU is no one thread's
        front = {key: cpu for key, cpu in front.items() if not key.endswith("/ended")}
    busiest_key = max(front, key=lambda k: front[k])
    busiest = front[busiest_key]
    busiest_part = delta[busiest_key][0]
    engine_thread = max(
        (cpu - m.threads_before.get(key, 0.0) for key, cpu in m.threads_after.items()),
        default=0.0,
    )
    front_cpu = sum(cpu for part, cpu in by_part.items() if part not in ENGINE_PARTS)
    us = 1e6 / n
    figs: list[Figure] = []

    def add(metric: str, value: float, unit: str, note: str = "", role: str = "") -> None:
        figs.append(
            Figure(
                key=f"{variant.key}.{metric}",
                variant=variant.label,
                payload=variant.engine,
                metric=metric,
                value=round(value, 2),
                unit=unit,
                role=role or variant.role,
                note=note,
            )
        )

    add("requests_per_s", n / m.result.elapsed, "req/s", "measured")
    add("tokens_per_s", tokens / m.result.elapsed, "tok/s", "output tokens, measured")
    add("output_tokens", tokens / n, "tok/req", "per request, from each stream's usage", INFO)
    add("failed", len(m.result.records) - n, "req", "requests that did not stream to [DONE]", INFO)
    series = {
        "ttft": [r.ttft * 1e3 for r in ok if r.ttft is not None],
        "itl": [g * 1e3 for r in ok for g in r.itl],
        "e2e": [r.e2e * 1e3 for r in ok],
        # Time per output token after the first, per request (vLLM's TPOT): unlike the gaps
        # between chunks, the same however a server's writes coalesce on the socket.
        "tpot": [
            (r.e2e - r.ttft) * 1e3 / (r.output_tokens - 1)
            for r in ok
            if r.ttft is not None and r.output_tokens > 1
        ],
    }
    for name, values in series.items():
        for q in (0.5, 0.99):
            if values:
                add(f"{name}_p{round(q * 100)}", nearest_rank_quantile(values, q), "ms")
    for part, cpu in by_part.items():
        if part not in ENGINE_PARTS and any(unit.part == part for unit in m.after.values()):
            add(f"cpu_{part}_us", cpu * us, "us/req", "measured", INFO)
    add("cpu_front_end_us", front_cpu * us, "us/req", "every process or thread but the engine's")
    add("cpu_engine_us", by_part[ENGINE] * us, "us/req", "the engine's process or threads")
    unit = "thread" if m.units == "thread" else "process"
    add("busiest_us", busiest * us, "us/req", f"the busiest front-end {unit}: {busiest_part}")
    if busiest:  # else under the clock tick of /proc: a run too short to project from
        add(
            "projected_rps",
            n / busiest,
            "req/s",
            f"projected: a core per front-end {unit}; the busiest is {busiest_part}",
        )
    add("engine_thread_us", engine_thread * us, "us/req", "the engine's busiest thread", INFO)
    add(
        "engine_other_us",
        max(0.0, by_part[ENGINE] - engine_thread) * us,
        "us/req",
        "the engine's CPU outside its busiest thread",
        INFO,
    )
    add("load_generator_us", m.load_cpu * us, "us/req", "the load generator's own CPU", INFO)
    return figs


# -- the suite --------------------------------------------------------------------------------

#: (name, subject metric, op, threshold): each tokenyard variant against its baseline,
#: at the same number of front-end processes (llama.cpp's server: one).
TARGETS = (
    ("front-end CPU per request <= 0.5x", "cpu_front_end_us", "<=", 0.5),
    ("requests/s >= 1.0x", "requests_per_s", ">=", 1.0),
    ("TTFT p50 <= 1.1x", "ttft_p50", "<=", 1.1),
)


def summarise(
    figures: list[Figure], variants: Sequence[Variant]
) -> tuple[list[Figure], list[Target]]:
    """Every tokenyard figure's ratio to its baseline's, and the targets (pure: testable)."""
    by_key = {f.key: f for f in figures}
    labels = {v.key: v.label for v in variants}
    compared = {v.key: v for v in variants if v.baseline}
    for f in figures:
        variant_key, _, metric = f.key.partition(".")
        variant = compared.get(variant_key)
        if variant is None:
            continue
        base = by_key.get(f"{variant.baseline}.{metric}")
        if base is not None and base.value:
            label = labels.get(variant.baseline, variant.baseline)
            f.ratios.append(Ratio(baseline=base.key, label=label, value=f.value / base.value))
    targets = []
    for variant in compared.values():
        base_variant = next((v for v in variants if v.key == variant.baseline), None)
        if (
            base_variant is None
            or base_variant.processes != variant.processes
            or not variant.targeted
        ):
            continue
        for name, metric, op, threshold in TARGETS:
            figure = by_key.get(f"{variant.key}.{metric}")
            base = by_key.get(f"{variant.baseline}.{metric}")
            if figure is None or base is None or not base.value:
                continue
            value = figure.value / base.value
            met = value >= threshold if op == ">=" else value <= threshold
            targets.append(
                Target(
                    name=f"{variant.label} {name} {base_variant.label}'s",
                    figure=figure.key,
                    baseline=base.key,
                    op=op,
                    threshold=threshold,
                    value=value,
                    met=met,
                )
            )
    return figures, targets


PANELS = {
    LLAMACPP: "llama.cpp engine (tiny model, 1 compute thread)",
    VLLM: "vLLM engine (tiny model, CPU)",
}
CHARTS = [
    Chart(
        name="engines-throughput",
        title="requests/s over HTTP on the same engine (higher is better)",
        metrics=["requests_per_s"],
        unit="req/s",
        panel_titles=PANELS,
    ),
    Chart(
        name="engines-latency",
        title="time to first token and end to end, per request (lower is better)",
        metrics=["ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"],
        unit="ms",
        panel_titles=PANELS,
    ),
]


def cpu_chart(figures: Sequence[Figure]) -> Chart:
    """CPU per request stacked by part, the parts that were measured."""
    metrics = {f.metric for f in figures}
    return Chart(
        name="engines-cpu",
        title="CPU per request: front-end parts and the engine (lower is better)",
        metrics=[m for part in PARTS if (m := f"cpu_{part}_us") in metrics],
        unit="us/req",
        panel_titles=PANELS,
        kind="stacked",
    )


def _llamacpp_plan(
    directory: Path, worker_counts: Sequence[int], n_parallel: int
) -> list[tuple[Variant, Callable[[], AbstractContextManager[FrontEnd]]]]:
    from actors._gguf import write_model_dir

    model_dir = directory / "llamacpp"
    model = str(write_model_dir(model_dir, clean=True))
    engine_args = llamacpp_engine_args(str(model_dir), n_parallel, CONTEXT, THREADS)
    plan: list[tuple[Variant, Callable[[], AbstractContextManager[FrontEnd]]]] = []
    for variant in llamacpp_variants(worker_counts):
        if variant.baseline:
            opener = functools.partial(open_tokenyard, variant.processes, engine_args)
        else:
            opener = functools.partial(open_llamacpp_server, model, n_parallel, CONTEXT, THREADS)
        plan.append((variant, opener))
    return plan


def _vllm_plan(
    directory: Path, worker_counts: Sequence[int], python: Path
) -> list[tuple[Variant, Callable[[], AbstractContextManager[FrontEnd]]]]:
    model = vllm.make_model(directory / "vllm")
    seqs = VLLM_MAX_NUM_SEQS
    plan: list[tuple[Variant, Callable[[], AbstractContextManager[FrontEnd]]]] = []
    for variant in vllm_variants(worker_counts):
        args = (python, model, variant.processes, seqs)
        if not variant.baseline:
            opener = functools.partial(vllm.open_vllm_serve, *args)
        else:
            opener = functools.partial(vllm.open_tokenyard_vllm, *args, variant.vllm_clients)
        plan.append((variant, opener))
    return plan


def llamacpp_missing() -> str | None:
    """Why the llama.cpp part cannot run here, or ``None``."""
    try:
        import xllamacpp  # noqa: F401
    except ImportError as err:
        return f"llama.cpp part skipped: {err} (pip install 'tokenyard[llamacpp]')"
    return None


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Every front end in its own processes, one after the other, each with a fresh engine."""
    start = time.monotonic()
    concurrency = pick(args, "concurrency", 8, 16)
    given: float | None = getattr(args, "duration", None)
    duration = (20.0 if args.full else 5.0) if given is None else given
    max_tokens = pick(args, "max_tokens", MAX_TOKENS, MAX_TOKENS)
    n_parallel = pick(args, "n_parallel", N_PARALLEL, N_PARALLEL)
    worker_counts = getattr(args, "worker_counts", None) or WORKER_COUNTS
    chosen = getattr(args, "engines", None) or ENGINES
    python = vllm.default_python(getattr(args, "vllm_python", None))
    notes: list[str] = []
    figures: list[Figure] = []
    variants: list[Variant] = []
    with tempfile.TemporaryDirectory(prefix="tokenyard-engines-") as tmp:
        plan: list[tuple[Variant, Callable[[], AbstractContextManager[FrontEnd]]]] = []
        if LLAMACPP in chosen:
            problem = llamacpp_missing()
            if problem:
                notes.append(problem)
            else:
                plan += _llamacpp_plan(Path(tmp), worker_counts, n_parallel)
        if VLLM in chosen:
            problem = vllm.missing(python)
            if problem:
                notes.append(problem)
            else:
                plan += _vllm_plan(Path(tmp), worker_counts, python)
        progress.begin(max(len(plan), 1))
        for variant, opener in plan:
            progress.step(f"{variant.label}: starting")
            with opener() as front:
                model = vllm.MODEL_NAME if variant.engine == VLLM else None

                def say(what: str, label: str = variant.label) -> None:
                    progress.step(f"{label}: {what}")

                measured = measure(front, concurrency, duration, max_tokens, model, say)
                progress.step(f"{variant.label}: stopping")
            figures += figures_of(variant, measured)
            variants.append(variant)
            progress.advance()
    if not plan:
        progress.advance()
    figures, targets = summarise(figures, variants)
    return SuiteResult(
        suite="engines",
        duration_s=round(time.monotonic() - start, 2),
        params={
            "concurrency": concurrency,
            "duration_s": duration,
            "max_tokens": max_tokens,
            "n_parallel": n_parallel,
            "context": CONTEXT,
            "threads": THREADS,
            "worker_counts": ",".join(map(str, worker_counts)),
            "engines": ",".join(chosen),
            "full": bool(args.full),
            "load": os.getloadavg()[0],
        },
        figures=figures,
        targets=targets,
        charts=[*CHARTS, cpu_chart(figures)],
        notes=[
            *notes,
            "Measured: requests/s, tokens/s, latencies, CPU per request of every process "
            "(llama.cpp's server: every thread) from /proc.",
            "Projected: 1e6 / the busiest front-end unit's us per request (a process for "
            "tokenyard and vLLM, a thread for llama.cpp's server), the front end's ceiling "
            "with a core per unit; the engine, not the front end, bounds what is measured.",
            "llama.cpp's server: its compute thread (named llama-engine by the runner, "
            "found by a probe completion) is the engine; it also samples and turns tokens "
            "into text. tokenyard: the scheduler process, llama.cpp in-process, is the engine.",
            "vLLM: its engine core and workers are the engine on both sides; every tokenyard "
            "process is front end: its workers (each the headless engine's client, by "
            "default) and its scheduler (the engine's keeper; via the scheduler, its one "
            "client), which speak vLLM's protocol as vLLM's API server does.",
            "The load generator runs in this process and its CPU is reported apart.",
            RULE,
        ],
    )


SUITE = Suite(
    name="engines",
    help="tokenyard's front end against llama.cpp's server (and vllm serve) on the same engine",
    run=run,
    options=OPTIONS,
    rounds=False,
)
