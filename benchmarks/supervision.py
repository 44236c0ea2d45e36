"""Supervision suite: how fast a killed actor process is noticed and answering again, against
a supervisor that polls every 0.5 s (uvicorn's and xoscar's way), and where the time goes.

Run it with ``python -m benchmarks supervision [--json PATH] [--full] [--kills N]``
(``--kills``: 20, ``--full`` 100; ``--rounds``: repeats of each fresh-process timing, 5,
``--full`` 15).

Kill loops, each in a fresh driver process (``benchmarks._restart``), ``--kills`` SIGKILLs,
each tokenyard loop under both start methods, the **fork server** (``start="fork-server"``,
the default: the restarted child is forked from a preloaded process) and the **fresh
interpreter** (``start="spawn"``):

* **supervisor in the caller**: ``system.spawn(Supervisor, ..., process=False)`` in the
  driver's event loop (how ``actors.Pipeline`` runs its supervisor), one PERMANENT
  ``Pinger`` child process. The watcher hears of the death from this process's own pidfd.
* **supervisor process**: the same supervisor in a process of its own (the default of
  ``spawn``): the child is a grandchild of the driver, whose watcher hears of its death
  from the supervisor's process.
* **polling every 0.5 s** (baseline): the same child started by the same ``system.spawn``
  (fresh interpreters), kept alive by a loop that sleeps 0.5 s, checks the pid and
  restarts a dead child.
* **pipeline worker**: an ``actors.Pipeline`` (2 tokenizer workers) under a closed-loop load
  of 8 clients; per kill of worker 0, SIGKILL -> the new incarnation registered and
  serving, fork server against fresh interpreter.

Per kill: *kill -> death noticed* (tokenyard: the ``Down`` delivered to a ``system.watch``
watcher in the driver; polling: the poll that finds the pid gone) and *kill -> answering*
(until the new incarnation has answered an ``ask``).

Where a restart goes, measured in the same run before the kill loops: ``python -c pass``,
``python -c "import runtime"``, ``python -c "import <the actor's module>"`` (each until its
code has run), a fresh ``system.spawn`` -> ready, the kernel's own SIGKILL -> reaped time
for a process of an actor's size, and the imports of real actor processes by package.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import _restart
from ._breakdown import (
    FRESH,
    PART_METRICS,
    PARTS,
    STARTUP,
    TIMINGS,
    PartsSource,
    ms_figure,
    part_figures,
    startup_figures,
)
from ._results import (
    BASELINE,
    INFO,
    ROUNDS,
    STACKED,
    SUBJECT,
    Chart,
    Figure,
    Ratio,
    SuiteResult,
    Target,
)
from ._startup import (
    ACTOR_MODULE,
    CHILD_IMPORTS,
    as_given_env,
    bytecode_cached_by_default,
    bytecode_env,
    kill_to_reaped,
    time_python,
)
from ._stats import RULE, nearest_rank_quantile
from ._stream import advancing, run_reporting_driver
from ._suite import Option, Suite, pick

if TYPE_CHECKING:
    import argparse

    from ._stream import Report
    from ._suite import Progress

POLL_INTERVAL = 0.5
DOWN = "kill → death noticed"
READY = "kill → answering"
IMPORTS = "imports of an actor process, by package"
KILL_FLOOR = "kernel: SIGKILL -> reaped, no runtime"
#: Actor processes whose imports are profiled (median per package).
PROFILES = 2
PERCENTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99, "max": 1.0}
PIPELINE = "pipeline worker: kill → serving again, under load"
#: The issue's goals, in ms.
DOWN_GOAL = 20.0
READY_GOAL = 300.0
#: Kill -> answering with the fork server.
FORK_READY_GOAL = 40.0

OPTIONS = (Option("--kills", "SIGKILLs per kill loop (quick 20, full 100)"),)


@dataclass(frozen=True)
class KillLoop:
    """One kill loop, measured in its own driver process."""

    name: str  # figure key prefix
    label: str  # how tables and charts name it
    role: str  # SUBJECT or BASELINE
    args: tuple[str, ...]  # its role and options in benchmarks._restart


_SPAWN = ("--start", "spawn")
_FORK = ("--start", "fork-server")
CALLER = KillLoop(
    "caller",
    "fresh interpreter, supervisor in the caller",
    SUBJECT,
    ("supervised", "--where", "caller", *_SPAWN),
)
PROCESS = KillLoop(
    "process",
    "fresh interpreter, supervisor process",
    SUBJECT,
    ("supervised", "--where", "process", *_SPAWN),
)
CALLER_FORK = KillLoop(
    "caller_fork",
    "fork server, supervisor in the caller",
    SUBJECT,
    ("supervised", "--where", "caller", *_FORK),
)
PROCESS_FORK = KillLoop(
    "process_fork",
    "fork server, supervisor process",
    SUBJECT,
    ("supervised", "--where", "process", *_FORK),
)
POLLING = KillLoop(
    "polling",
    f"polling every {POLL_INTERVAL:g} s",
    BASELINE,
    ("polling", "--interval", str(POLL_INTERVAL), *_SPAWN),
)
KILL_LOOPS = (CALLER_FORK, PROCESS_FORK, CALLER, PROCESS, POLLING)
#: The loops restarted by a fork server, each with its fresh-interpreter twin.
FORKED = {CALLER_FORK.name: CALLER.name, PROCESS_FORK.name: PROCESS.name}
#: The loops whose restarts start an interpreter, and so split into parts.
FRESH_LOOPS = (CALLER, PROCESS, POLLING)
PIPELINE_FORK = KillLoop(
    "pipeline_fork", "pipeline worker, fork server", SUBJECT, ("pipeline", *_FORK)
)
PIPELINE_SPAWN = KillLoop(
    "pipeline_spawn", "pipeline worker, fresh interpreter", BASELINE, ("pipeline", *_SPAWN)
)
PIPELINE_LOOPS = (PIPELINE_FORK, PIPELINE_SPAWN)

#: Short names of the kill loops where a label must fit under a bar.
SHORT = {
    CALLER_FORK.name: "fork, in caller",
    PROCESS_FORK.name: "fork, sup. process",
    CALLER.name: "fresh, in caller",
    PROCESS.name: "fresh, sup. process",
    POLLING.name: "polling",
}


def percentile_figures(
    prefix: str, label: str, payload: str, role: str, samples: list[float]
) -> list[Figure]:
    """p50, p90, p99 and max of ``samples``; the p50 figure keeps every sample, in order."""
    return [
        ms_figure(
            f"{prefix}.{metric}",
            label,
            payload,
            metric,
            nearest_rank_quantile(samples, q),
            role=role,
            rounds=samples if metric == "p50" else None,
        )
        for metric, q in PERCENTILES.items()
    ]


def pipeline_figures(loop: KillLoop, report: Report) -> list[Figure]:
    """Percentiles of a pipeline loop's restarts, and its request counts (info)."""
    figures = percentile_figures(
        f"{loop.name}.restart", loop.label, PIPELINE, loop.role, report.samples["restart"]
    )
    figures += [
        Figure(
            key=f"{loop.name}.{count}",
            variant=loop.label,
            payload="pipeline requests during the kills",
            metric=count,
            value=report.values[count],
            unit="requests",
            role=INFO,
        )
        for count in ("served", "failed", "resubmitted")
    ]
    return figures


def latency_figures(loop: KillLoop, report: Report) -> list[Figure]:
    """Percentiles of a kill loop's two series (kill -> death noticed, -> answering)."""
    return [
        fig
        for series, payload in (("down", DOWN), ("ready", READY))
        for fig in percentile_figures(
            f"{loop.name}.{series}", loop.label, payload, loop.role, report.samples[series]
        )
    ]


def _ratio(fig: Figure, base: Figure | None, label: str) -> None:
    if base is not None and base.value:
        fig.ratios.append(Ratio(baseline=base.key, label=label, value=fig.value / base.value))


def _below(label: str, fig: Figure, goal: float) -> Target:
    return Target(
        name=f"{label} p50 < {goal:g} ms",
        figure=fig.key,
        baseline="",
        op="<",
        threshold=goal,
        value=fig.value,
        met=fig.value < goal,
    )


def summarise(figures: list[Figure]) -> list[Target]:
    """Attach ratios against the polling baseline (and of each fork-server loop against its
    fresh-interpreter twin) and check the issue's goals (pure). Loops absent from
    ``figures`` are skipped."""
    by_key = {f.key: f for f in figures}
    targets: list[Target] = []
    for loop in KILL_LOOPS:
        if loop is POLLING or f"{loop.name}.down.p50" not in by_key:
            continue
        for series in ("down", "ready"):
            for metric in ("p50", "max"):
                fig = by_key[f"{loop.name}.{series}.{metric}"]
                _ratio(fig, by_key.get(f"{POLLING.name}.{series}.{metric}"), "polling")
                twin = FORKED.get(loop.name)
                if twin is not None:
                    _ratio(fig, by_key.get(f"{twin}.{series}.{metric}"), "fresh interpreter")
        goals = [("down", DOWN_GOAL, "Down"), ("ready", READY_GOAL, "answering")]
        if loop.name in FORKED:
            goals.append(("ready", FORK_READY_GOAL, "answering"))
        for series, goal, what in goals:
            fig = by_key[f"{loop.name}.{series}.p50"]
            targets.append(_below(f"{loop.label}: kill → {what}", fig, goal))
    fork = by_key.get(f"{PIPELINE_FORK.name}.restart.p50")
    if fork is not None:
        _ratio(fork, by_key.get(f"{PIPELINE_SPAWN.name}.restart.p50"), "fresh interpreter")
    return targets


def charts() -> list[Chart]:
    """The suite's charts, as data."""
    goals = {DOWN: DOWN_GOAL, READY: FORK_READY_GOAL}
    return [
        Chart(
            name="supervision-latency",
            title="SIGKILL of a supervised actor process (lower is better)",
            metrics=list(PERCENTILES),
            unit="ms",
            payloads=[DOWN, READY, PIPELINE],
            limits=goals,
            log=True,  # 5 ms and 500 ms on one axis
        ),
        Chart(
            name="supervision-timeline",
            title="every kill, in order",
            metrics=["p50"],  # the p50 figure of each loop carries every kill
            unit="ms",
            payloads=[DOWN, READY],
            limits=goals,
            log=True,
            kind=ROUNDS,
            x_label="kill",
        ),
        Chart(
            name="supervision-parts",
            title="where kill → answering goes (median of each part)",
            metrics=[metric for _, metric in PART_METRICS],
            unit="ms",
            payloads=[PARTS],
            limits={PARTS: READY_GOAL},
            kind=STACKED,
        ),
        Chart(
            name="supervision-startup",
            title="what a fresh Python process costs (medians)",
            metrics=["p50"],
            unit="ms",
            payloads=[STARTUP],
        ),
    ]


def _notes(kills: int, as_given_cached: bool) -> list[str]:
    notes = [
        "Start methods: 'fork server' loops restart the child by a fork of the system's"
        " preloaded fork server (start='fork-server'); 'fresh interpreter' loops and the"
        " polling baseline start python -m runtime._child (start='spawn'). The parts of"
        " kill → answering are split for the fresh-interpreter loops only: a forked child"
        " imports nothing (its module's import time is the server's).",
        "pipeline worker: actors.Pipeline(workers=2) with 8 closed-loop clients (16 new tokens"
        " each) while worker 0 is SIGKILLed; kill → its new incarnation registered and"
        " serving (Pipeline.wait_worker). Its supervisor's restart window is 0.25 s and"
        " kills are 0.3-0.35 s apart, so each restart is immediate (later restarts within"
        " one window back off on purpose, up to 2 s). Requests served, failed"
        " (WorkerDiedError) and resubmitted over the loop are info figures.",
        f"{kills} SIGKILLs per loop; percentiles are over all kills (with fewer than 100"
        " kills, p99 is the max). Every kill is in the JSON (the p50 figures' rounds).",
        RULE,
        "kill → death noticed: tokenyard, the Down delivered to a system.watch watcher in the"
        " driver; polling, the poll that found the pid gone.",
        "kill → answering: tokenyard asks the supervisor WhichChildren in a loop (each try a"
        " round trip, no sleep) until it names a new incarnation, then asks that a Ping.",
        "Supervisors run with backoff=0 and max_restarts above the kill count, so every kill"
        " measures an immediate restart (with the default backoff the first restart in a"
        " period is immediate too; later ones are delayed on purpose).",
        "polling: the same system.spawn restarts the child; a thread sleeps"
        f" {POLL_INTERVAL:g} s between pid checks. Kills land at stratified random phases of"
        " its poll (a seeded pause before each); tokenyard kills pause 0-0.05 s.",
        f"{KILL_FLOOR}: SIGKILL of an idle python process holding the actor's imports, until"
        " it can be reaped: the kernel's share of kill → death noticed.",
        "Actor processes run with a private, warmed bytecode cache (PYTHONPYCACHEPREFIX), as"
        " an installed package has its .pyc files.",
        f"{STARTUP}: python -c 'pass', 'import runtime', 'import {ACTOR_MODULE}' (with the"
        " bytecode cache, then with the environment as given), each until the code has run"
        " (the exit is not timed: an actor's is not); system.spawn of a fresh actor until"
        " ready; restart: each supervisor's own measure, death seen -> new child ready"
        " (SupervisorStatistics.last_restart_ms; for polling, from the poll that saw it).",
        f"Imports of an actor process: -X importtime of {PROFILES} real actor processes"
        " (median), start to first answer, so modules imported once the loop runs count too;"
        " a package counts what it pulls in (asyncio: ssl, socket; runtime: logging, inspect)."
        " The tracing adds overhead; the actor's own module (imported by importlib) is not"
        " listed.",
        "Parts of kill → answering, per kill on one clock (CLOCK_MONOTONIC), then the median"
        " of each: death noticed (the watcher's Down, or the poll); interpreter start (python"
        " -c pass, measured apart); spawn + imports (until the new process has imported the"
        " actor's module); runtime start in the child (until on_start: event loop, sockets,"
        " lazy imports); ready + asks (ready report, supervisor, WhichChildren, Ping). The"
        " medians add up to about the p50.",
    ]
    if not as_given_cached:
        notes.append(
            "This environment sets PYTHONDONTWRITEBYTECODE without PYTHONPYCACHEPREFIX: run as"
            " it is, every actor process compiles runtime from source (see 'same, env as"
            " given')."
        )
    return notes


def _measure(
    progress: Progress, kills: int, repeats: int
) -> tuple[dict[str, list[float]], dict[str, Report]]:
    """Everything, each in fresh processes: fresh-process timings, the kernel's kill floor,
    fresh spawns, the import profile, then the kill loops."""
    timeout = 60.0 + kills * 3.0
    loops: dict[str, Report] = {}
    workdir = tempfile.mkdtemp(prefix="tokenyard-bench-")
    try:
        progress.step("warming a private bytecode cache")
        env = bytecode_env(workdir)
        envs = {True: env, False: as_given_env()}
        timings: dict[str, list[float]] = {key: [] for key, _, _, _ in TIMINGS}
        timings["kill_floor"] = []
        for r in range(repeats):  # round-robin, so machine drift hits them alike
            for key, label, code, cached in TIMINGS:
                progress.step(f"{label} ({r + 1}/{repeats})")
                timings[key].append(time_python(code, envs[cached]))
                progress.advance()
            progress.step(f"{KILL_FLOOR} ({r + 1}/{repeats})")
            timings["kill_floor"].append(kill_to_reaped(CHILD_IMPORTS, env))
            progress.advance()
        fresh = run_reporting_driver(
            _restart.command("spawn-ready", "--count", str(repeats), "--profiles", str(PROFILES)),
            timeout,
            advancing(progress, "system.spawn -> ready, fresh actors"),
            env,
        )
        timings["spawn_ready"] = fresh.samples["spawn_ready"]
        loops["fresh"] = fresh
        for loop in (*KILL_LOOPS, *PIPELINE_LOOPS):
            cmd = _restart.command(*loop.args, "--kills", str(kills), "--seed", "1")
            on_step = advancing(progress, loop.label)
            loops[loop.name] = run_reporting_driver(cmd, timeout, on_step, env)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return timings, loops


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Run the kill loops and the fresh-process timings, each in fresh processes."""
    start = time.monotonic()
    kills = pick(args, "kills", 20, 100)
    repeats = args.rounds or (15 if args.full else 5)
    all_loops = len(KILL_LOOPS) + len(PIPELINE_LOOPS)
    progress.begin((len(TIMINGS) + 1) * repeats + repeats + PROFILES + kills * all_loops)
    timings, loops = _measure(progress, kills, repeats)
    figures = [f for loop in KILL_LOOPS for f in latency_figures(loop, loops[loop.name])]
    for loop in PIPELINE_LOOPS:
        figures += pipeline_figures(loop, loops[loop.name])
    figures += percentile_figures("kill_floor", KILL_FLOOR, DOWN, INFO, timings.pop("kill_floor"))
    targets = summarise(figures)
    restarts = {
        loop.name: (SHORT[loop.name], loops[loop.name].samples["restart"]) for loop in KILL_LOOPS
    }
    startup, medians = startup_figures(timings, restarts)
    fresh = loops.pop("fresh")
    sources = [
        PartsSource(loop.name, loop.label, loop.role, loops[loop.name].samples, "down", "ready")
        for loop in FRESH_LOOPS
    ]
    sources.append(PartsSource("fresh", FRESH, INFO, fresh.samples, None, "answer"))
    figures += startup + part_figures(sources, medians["python_pass"])
    profile = {k: v for k, v in fresh.samples.items() if k.startswith("imports.")}
    figures += [
        ms_figure(key, key.removeprefix("imports."), IMPORTS, "self", median, rounds=ms)
        for key, ms, median in sorted(
            ((k, v, nearest_rank_quantile(v, 0.5)) for k, v in profile.items()),
            key=lambda kv: -kv[2],
        )
    ]
    return SuiteResult(
        suite="supervision",
        duration_s=round(time.monotonic() - start, 2),
        params={
            "kills": kills,
            "repeats": repeats,
            "import_profiles": PROFILES,
            "poll_interval_s": POLL_INTERVAL,
            "full": bool(args.full),
            "bytecode_cached_as_given": bytecode_cached_by_default(),
        },
        figures=figures,
        targets=targets,
        charts=charts(),
        notes=_notes(kills, bytecode_cached_by_default()),
    )


SUITE = Suite(
    name="supervision",
    help="SIGKILL -> Down and -> restarted actor answering, vs a 0.5 s polling supervisor",
    run=run,
    options=OPTIONS,
)
