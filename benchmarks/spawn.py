"""Spawn suite: time to spawn 16 actor processes until every one is ready, and the memory of
one idle actor process, against fresh interpreters doing only what an actor process imports.

Run it with ``python -m benchmarks spawn [--json PATH] [--full] [--actors N]``.

Variants, each in a fresh driver process (``benchmarks._spawning``):

* **tokenyard spawn**: ``system.spawn`` of ``--actors`` ``Pinger`` processes, one after the
  other and, separately, all at once from a task group; a round ends when every
  ``spawn`` has returned (each actor is ready). Then each answers a ``Ping`` (context) and
  all are stopped gracefully (context). Under both start methods: forked from the
  system's fork server (``start="fork-server"``, the default; the fork server is started
  and has imported the actor's module by an untimed warm-up spawn), and each in a fresh
  interpreter (``start="spawn"``).
* **python -c imports** (baseline): the same number of fresh interpreters running
  ``import runtime._child, <actor module>``, until each has imported (they then idle, as
  actors do): the part of a spawn no runtime avoids without a fork server or preloading.
* **memory**: VmRSS of an idle actor process (``/proc/<pid>/status``; PSS and USS from
  ``smaps_rollup``), forked and fresh, of the fork server itself (context), of a bare
  ``python -c`` process waiting on stdin (baseline) and of one that has only imported what
  an actor imports (context). A forked actor shares its pages with the server until
  either writes them: its USS is what one more actor costs.

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
from ._results import BASELINE, INFO, SUBJECT, Chart, Figure, Ratio, SuiteResult, Target
from ._startup import CHILD_IMPORTS, bytecode_env
from ._stats import RULE, nearest_rank_quantile
from ._stream import advancing, run_reporting_driver
from ._suite import Option, Suite, pick

if TYPE_CHECKING:
    import argparse

    from ._stream import Report
    from ._suite import Progress

MODES = ("sequential", "concurrent")
SPAWNED = "tokenyard spawn, fork server"
SPAWNED_FRESH = "tokenyard spawn, fresh interpreter"
FLOOR = "python -c imports"
MEMORY = "one idle process"
#: Spawn variants: (figure key prefix, label, start method).
STARTS = (("spawn", SPAWNED, "fork-server"), ("spawn_fresh", SPAWNED_FRESH, "spawn"))
#: Memory variants: (report prefix, label, role).
PROCESSES = (
    ("actor", "tokenyard actor (idle), forked", SUBJECT),
    ("actor_fresh", "tokenyard actor (idle), fresh interpreter", SUBJECT),
    ("server", "its fork server", INFO),
    ("bare", "python -c, waiting", BASELINE),
    ("imports", "python -c + actor imports, waiting", INFO),
)
MEMORY_METRICS = ("rss", "pss", "uss")
#: The issue's goals: 16 concurrent spawns (s), and an idle forked actor's USS (MiB).
CONCURRENT_GOAL = 0.3
USS_GOAL = 6.0

OPTIONS = (Option("--actors", "actor processes spawned per round (quick and full 16)"),)


def _payload(mode: str, actors: int) -> str:
    return f"{actors} processes, {mode}"


def time_figures(
    mode: str, actors: int, spawned: Report, floor: Report, fresh: Report | None = None
) -> list[Figure]:
    """Wall times (best round, s), then the per-process means (ms), of one mode: the fork
    server's spawns (``spawned``), the fresh interpreters' (``fresh``) and the floor."""
    payload = _payload(mode, actors)
    walls: list[Figure] = []
    means: list[Figure] = []
    rows = [
        ("spawn", SPAWNED, SUBJECT, spawned, "ready"),
        ("floor", FLOOR, BASELINE, floor, "ready"),
        ("answered", "tokenyard spawn -> all answered", INFO, spawned, "answered"),
        ("stop", "tokenyard graceful stop", INFO, spawned, "stopped"),
    ]
    if fresh is not None:
        rows.insert(1, ("spawn_fresh", SPAWNED_FRESH, SUBJECT, fresh, "ready"))
    for name, label, role, report, series in rows:
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
        if name in ("spawn", "spawn_fresh", "floor"):
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
        if f"{prefix}.{metric}" in report.samples
    ]


def summarise(figures: list[Figure]) -> list[Target]:
    """Attach the ratios against the baselines and check the issue's goals (pure); figures
    that were not measured are skipped."""
    by_key = {f.key: f for f in figures}
    pairs = [
        (f"{prefix}.{mode}.{metric}", f"floor.{mode}.{metric}", FLOOR)
        for prefix in ("spawn", "spawn_fresh")
        for mode in MODES
        for metric in ("wall", "per_process")
    ]
    pairs += [
        (f"spawn.{mode}.{metric}", f"spawn_fresh.{mode}.{metric}", "fresh interpreter")
        for mode in MODES
        for metric in ("wall", "per_process")
    ]
    for prefix in ("actor", "actor_fresh", "imports"):
        pairs += [(f"{prefix}.{m}", f"bare.{m}", "bare python") for m in MEMORY_METRICS]
    pairs += [(f"actor.{m}", f"actor_fresh.{m}", "fresh interpreter") for m in MEMORY_METRICS]
    pairs += [("spawn.concurrent.wall", "spawn.sequential.wall", "sequential")]
    for key, base, label in pairs:
        if key in by_key and base in by_key and by_key[base].value:
            fig = by_key[key]
            fig.ratios.append(
                Ratio(baseline=base, label=label, value=fig.value / by_key[base].value)
            )
    targets = []
    for key, goal, name in (
        ("spawn.concurrent.wall", CONCURRENT_GOAL, "fork server: wall"),
        ("actor.uss", USS_GOAL, "forked actor: USS"),
    ):
        checked = by_key.get(key)
        if checked is not None:
            targets.append(
                Target(
                    name=f"{checked.payload}, {name} < {goal:g} {checked.unit}",
                    figure=key,
                    baseline="",
                    op="<",
                    threshold=goal,
                    value=checked.value,
                    met=checked.value < goal,
                )
            )
    return targets


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
    progress.begin(len(MODES) * (len(STARTS) + 1) * rounds + memory_rounds)
    timeout = 120.0 + rounds * actors * 5.0

    figures: list[Figure] = []
    workdir = tempfile.mkdtemp(prefix="tokenyard-bench-")
    try:
        progress.step("warming a private bytecode cache")
        env = bytecode_env(workdir)
        for mode in MODES:
            reports: dict[str, Report] = {}
            sizes = ("--mode", mode, "--actors", str(actors), "--rounds", str(rounds))
            for key, label, method in STARTS:
                cmd = _spawning.command("spawn-many", *sizes, "--start", method)
                on_step = advancing(progress, f"{label}, {actors} {mode}")
                reports[key] = run_reporting_driver(cmd, timeout, on_step, env)
            on_step = advancing(progress, f"{FLOOR}, {actors} {mode}")
            reports["floor"] = run_reporting_driver(
                _spawning.command("floor", *sizes), timeout, on_step, env
            )
            figures += time_figures(
                mode, actors, reports["spawn"], reports["floor"], reports["spawn_fresh"]
            )
        memory = run_reporting_driver(
            _spawning.command("memory", "--rounds", str(memory_rounds)),
            timeout,
            advancing(progress, "memory of idle processes"),
            env,
        )
        figures += memory_figures(memory)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    targets = summarise(figures)
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
        targets=targets,
        charts=charts(actors),
        notes=[
            "Times are the best round (every round is in the JSON); memory is the median.",
            RULE,
            "A spawn is ready when system.spawn returns: the process has started, imported"
            " the actor, opened its sockets, run on_start and reported ready.",
            "Fork server: the system's fork server forks each actor (start='fork-server', the"
            " default); an untimed warm-up spawn first starts it and has it import the actor's"
            " module. Fresh interpreter: python -m runtime._child per actor (start='spawn').",
            "Memory of a forked actor: its RSS counts the pages it shares with its fork"
            " server; its USS, the pages it has written since (what one more actor costs).",
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
