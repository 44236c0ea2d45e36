"""Spawn suite: time to spawn 16 actor processes until every one is ready, and the memory of
one idle actor process, against fresh interpreters doing only what an actor process imports.

Run it with ``python -m benchmarks spawn [--json PATH] [--full] [--actors N]``.

Variants, each in a fresh driver process (``benchmarks._spawning``):

* **tokenyard spawn**: ``system.spawn`` of ``--actors`` ``Pinger`` processes, one after the
  other and, separately, all at once from a task group; a round ends when every
  ``spawn`` has returned (each actor is ready). Then each answers a ``Ping`` (context) and
  all are stopped gracefully (context).
* **python -c imports** (baseline): the same number of fresh interpreters running
  ``import runtime._child, <actor module>``, until each has imported (they then idle, as
  actors do): the part of a spawn no runtime avoids without a fork server or preloading.
* **memory**: VmRSS of an idle actor process (``/proc/<pid>/status``; PSS and USS from
  ``smaps_rollup`` as context), of a bare ``python -c`` process waiting on stdin (baseline)
  and of one that has only imported what an actor imports (context).

The reported time is the best round (noise only ever makes a round slower); memory is the
median of the rounds. Every round is in the JSON.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from . import _spawning
from ._results import BASELINE, INFO, SUBJECT, Chart, Figure, Ratio, SuiteResult
from ._startup import CHILD_IMPORTS, bytecode_env
from ._stats import RULE, nearest_rank_quantile
from ._stream import advancing, run_reporting_driver
from ._suite import Option, Suite, pick

if TYPE_CHECKING:
    import argparse

    from ._stream import Report
    from ._suite import Progress

MODES = ("sequential", "concurrent")
SPAWNED = "tokenyard spawn"
FLOOR = "python -c imports"
MEMORY = "one idle process"
#: Memory variants: (report prefix, label, role).
PROCESSES = (
    ("actor", "tokenyard actor (idle)", SUBJECT),
    ("bare", "python -c, waiting", BASELINE),
    ("imports", "python -c + actor imports, waiting", INFO),
)
MEMORY_METRICS = ("rss", "pss", "uss")

OPTIONS = (Option("--actors", "actor processes spawned per round (quick and full 16)"),)


def _payload(mode: str, actors: int) -> str:
    return f"{actors} processes, {mode}"


def time_figures(mode: str, actors: int, spawned: Report, floor: Report) -> list[Figure]:
    """Wall times (best round, s), then the per-process means (ms), of one mode."""
    payload = _payload(mode, actors)
    walls: list[Figure] = []
    means: list[Figure] = []
    for name, label, role, report, series in (
        ("spawn", SPAWNED, SUBJECT, spawned, "ready"),
        ("floor", FLOOR, BASELINE, floor, "ready"),
        ("answered", "tokenyard spawn -> all answered", INFO, spawned, "answered"),
        ("stop", "tokenyard graceful stop", INFO, spawned, "stopped"),
    ):
        rounds = report.samples[series]
        best = min(rounds)
        walls.append(
            Figure(
                key=f"{name}.{mode}.wall",
                variant=label,
                payload=payload,
                metric="wall",
                value=round(best / 1000, 3),
                unit="s",
                role=role,
                rounds=[round(r / 1000, 3) for r in rounds],
            )
        )
        if name in ("spawn", "floor"):
            means.append(
                Figure(
                    key=f"{name}.{mode}.per_process",
                    variant=label,
                    payload=payload,
                    metric="per process",
                    value=round(best / actors, 1),
                    unit="ms",
                    role=role,
                    rounds=[round(r / actors, 1) for r in rounds],
                    note="wall time / processes",
                )
            )
    return walls + means


def memory_figures(report: Report) -> list[Figure]:
    """RSS, PSS and USS (median of the rounds, MiB) of each measured process."""
    return [
        Figure(
            key=f"{prefix}.{metric}",
            variant=label,
            payload=MEMORY,
            metric=metric,
            value=round(nearest_rank_quantile(report.samples[f"{prefix}.{metric}"], 0.5) / 1024, 2),
            unit="MiB",
            role=role,
            rounds=[round(kb / 1024, 2) for kb in report.samples[f"{prefix}.{metric}"]],
        )
        for prefix, label, role in PROCESSES
        for metric in MEMORY_METRICS
    ]


def summarise(figures: list[Figure]) -> None:
    """Attach the ratios against the baselines (pure)."""
    by_key = {f.key: f for f in figures}
    pairs = [
        (f"spawn.{mode}.{metric}", f"floor.{mode}.{metric}", FLOOR)
        for mode in MODES
        for metric in ("wall", "per_process")
    ]
    pairs += [(f"actor.{m}", f"bare.{m}", "bare python") for m in MEMORY_METRICS]
    pairs += [(f"imports.{m}", f"bare.{m}", "bare python") for m in MEMORY_METRICS]
    pairs += [("spawn.concurrent.wall", "spawn.sequential.wall", "sequential")]
    for key, base, label in pairs:
        if key in by_key and base in by_key and by_key[base].value:
            fig = by_key[key]
            fig.ratios.append(
                Ratio(baseline=base, label=label, value=fig.value / by_key[base].value)
            )


def charts(actors: int) -> list[Chart]:
    """The suite's charts, as data."""
    return [
        Chart(
            name="spawn-time",
            title=f"spawn {actors} actor processes until all are ready (best round; lower is "
            "better)",
            metrics=["wall"],
            unit="s",
            payloads=[_payload(mode, actors) for mode in MODES],
            reference=FLOOR,
        ),
        Chart(
            name="spawn-memory",
            title="memory of one idle process (median; lower is better)",
            metrics=list(MEMORY_METRICS),
            unit="MiB",
            payloads=[MEMORY],
        ),
    ]


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Measure every variant, each from a fresh driver process."""
    start = time.monotonic()
    actors = pick(args, "actors", 16, 16)
    rounds = args.rounds or (5 if args.full else 1)
    memory_rounds = 5 if args.full else 1
    progress.begin(len(MODES) * 2 * rounds + memory_rounds)
    timeout = 120.0 + rounds * actors * 5.0

    figures: list[Figure] = []
    workdir = tempfile.mkdtemp(prefix="tokenyard-bench-")
    try:
        progress.step("warming a private bytecode cache")
        env = bytecode_env(workdir)
        for mode in MODES:
            reports: dict[str, Report] = {}
            for role, label in (("spawn-many", SPAWNED), ("floor", FLOOR)):
                cmd = _spawning.command(
                    role, "--mode", mode, "--actors", str(actors), "--rounds", str(rounds)
                )
                on_step = advancing(progress, f"{label}, {actors} {mode}")
                reports[role] = run_reporting_driver(cmd, timeout, on_step, env)
            figures += time_figures(mode, actors, reports["spawn-many"], reports["floor"])
        memory = run_reporting_driver(
            _spawning.command("memory", "--rounds", str(memory_rounds)),
            timeout,
            advancing(progress, "memory of idle processes"),
            env,
        )
        figures += memory_figures(memory)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summarise(figures)
    return SuiteResult(
        suite="spawn",
        duration_s=round(time.monotonic() - start, 2),
        params={
            "actors": actors,
            "rounds": rounds,
            "memory_rounds": memory_rounds,
            "cpus": os.cpu_count() or 0,
            "full": bool(args.full),
        },
        figures=figures,
        charts=charts(actors),
        notes=[
            "Times are the best round (every round is in the JSON); memory is the median.",
            RULE,
            "A spawn is ready when system.spawn returns: the process has started, imported"
            " the actor, opened its sockets, run on_start and reported ready.",
            f"python -c imports: fresh interpreters running '{CHILD_IMPORTS}', timed until"
            " each has imported, started the same way (one after the other, or all at once);"
            " like the actors, they stay alive (idle) until the round ends.",
            f"Concurrent spawns share this machine's {os.cpu_count()} CPUs: with fewer CPUs"
            " than processes, the concurrent wall time is CPU time divided by CPUs.",
            "RSS counts shared pages (libpython, libzmq) in every process; PSS shares them"
            " out; USS is what one more process costs.",
            "Processes run with a private, warmed bytecode cache (PYTHONPYCACHEPREFIX), as an"
            " installed package has its .pyc files.",
        ],
    )


SUITE = Suite(
    name="spawn",
    help="time to spawn and ready 16 actor processes; memory of an idle actor process",
    run=run,
    options=OPTIONS,
)
