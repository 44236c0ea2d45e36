"""The drivers of the supervision suite: ``python -m benchmarks._restart <role> [options]``.

Each role runs in a fresh process with an ``ActorSystem`` of its own, reports one step per
kill (``benchmarks._stream``) and prints a ``Report`` last:

==============  ========================================================================
role            what it measures
==============  ========================================================================
supervised      a ``Supervisor`` with one PERMANENT ``Pinger`` process (the supervisor in
                this process, ``--where caller``, or in a process of its own, ``--where
                process``); per kill: SIGKILL -> ``Down`` delivered to a ``system.watch``
                watcher, and SIGKILL -> the new incarnation answering an ``ask``
polling         the baseline: the same ``Pinger`` started by the same ``system.spawn``,
                kept alive by a loop that checks the pid every ``--interval`` seconds
                (uvicorn's and xoscar's supervisors) and restarts it when it finds it dead
spawn-ready     ``system.spawn`` of a fresh ``Pinger`` -> ready, the handshake included;
                then what more fresh ``Pinger`` processes import until they have answered,
                by package (their interpreters run with ``PYTHONPROFILEIMPORTTIME``)
pipeline        an ``actors.Pipeline`` under a closed-loop load of ``--concurrency``
                clients; per kill of tokenizer worker 0: SIGKILL -> the new incarnation
                registered and serving; requests failed and resubmitted meanwhile
==============  ========================================================================

``--start`` is the start method of the driver's system (``fork-server`` or ``spawn``); the
supervisor process of ``--where process`` inherits it, and so forks its child from a fork
server of its own. ``spawn-ready`` always starts fresh interpreters (what it profiles).

Every clock is ``time.monotonic()`` (``CLOCK_MONOTONIC``: one clock for every process of
a Linux machine), read in the driver, which both kills and watches, and in the restarted
actor, whose ``Pong`` says when it had imported its module and when ``on_start`` ran. Before
each kill the driver pauses for a seeded, stratified random time: for the polling baseline
over one poll interval, so that kills land at uniformly spread phases of its poll (a kill
right after a poll waits the whole interval, one right before it almost nothing); for
tokenyard over ``--max-pause`` only, as nothing there runs on a timer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import anyio

from runtime import (
    ActorRef,
    ActorSystem,
    Children,
    ChildSpec,
    GetSupervisorStatistics,
    Supervisor,
    SupervisorStatistics,
    Watch,
    WhichChildren,
)

from ._lifecycle_actors import Ping, Pinger, Pong
from ._proc import BenchmarkError, die_with_parent
from ._startup import by_group, parse_importtime, startup_modules
from ._stream import Report, run_role, step

#: Seconds any single wait may take before the run is declared broken (never when healthy).
TIMEOUT = 60.0
CHILD = "pinger"
#: The pipeline's restart intensity window in the pipeline role, in seconds.
PIPELINE_WINDOW = 0.25


def pauses(n: int, span: float, seed: int) -> list[float]:
    """``n`` pauses spread evenly over ``[0, span)`` (one per stratum), in seeded order."""
    rng = random.Random(seed)
    out = [(i + rng.random()) / n * span for i in range(n)]
    rng.shuffle(out)
    return out


def _ms(start: float, end: float) -> float:
    return round((end - start) * 1000, 3)


async def _ping(ref: ActorRef[Any]) -> Pong:
    reply = await ref.ask(Ping(), timeout=TIMEOUT)
    if not isinstance(reply, Pong):
        raise BenchmarkError(f"{ref.name} answered a Ping with {reply!r}")
    return reply


async def _next_incarnation(sup: ActorRef[Any], after: int) -> ActorRef[Any]:
    """Ask the supervisor until it names a newer incarnation: one round trip per try, no
    timer. (Asks queue behind the supervisor's ``Down`` handler, which returns once the
    restart is ready, so this waits more than it spins.)"""
    while True:
        children = await sup.ask(WhichChildren(), timeout=TIMEOUT)
        assert isinstance(children, Children)
        ref = children.refs.get(CHILD)
        if ref is not None and ref.incarnation > after:
            return ref


async def _time_down(watch: Watch, killed: float, pid: int, out: list[float]) -> None:
    """Wait for the watched incarnation's ``Down``; record kill -> delivery in ``out``."""
    down = await watch
    out.append(_ms(killed, time.monotonic()))
    if down.signal != signal.SIGKILL:
        raise BenchmarkError(f"killed {CHILD} (pid {pid}) with SIGKILL; its Down says {down!r}")


async def drive_supervised(opts: argparse.Namespace) -> Report:
    """Kill the supervised child ``opts.kills`` times; time its Down and its restart."""
    down_ms: list[float] = []
    ready_ms: list[float] = []
    restart_ms: list[float] = []
    imported_ms: list[float] = []
    started_ms: list[float] = []
    async with ActorSystem(name="bench-supervision", start=opts.start) as system:
        sup = await system.spawn(
            Supervisor,
            children=[ChildSpec(Pinger, name=CHILD)],
            # Every kill measures an immediate restart: with the default backoff only the
            # first restart within `period` is immediate, later ones wait on purpose.
            max_restarts=opts.kills + 10,
            period=3600.0,
            backoff=0.0,
            name="sup",
            process=opts.where == "process",
        )
        ref = await system.lookup(CHILD)
        pong = await _ping(ref)
        for i, pause in enumerate(pauses(opts.kills, opts.max_pause, opts.seed)):
            watch = system.watch(ref)
            await anyio.sleep(pause)
            killed = time.monotonic()
            os.kill(pong.pid, signal.SIGKILL)
            with anyio.fail_after(TIMEOUT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_time_down, watch, killed, pong.pid, down_ms)
                    new = await _next_incarnation(sup, ref.incarnation)
                    answer = await _ping(new)
                    ready_ms.append(_ms(killed, time.monotonic()))
            if answer.incarnation != new.incarnation or answer.pid == pong.pid:
                raise BenchmarkError(f"kill {i + 1}: the restarted {CHILD} answered {answer!r}")
            stats = await sup.ask(GetSupervisorStatistics(), timeout=TIMEOUT)
            assert isinstance(stats, SupervisorStatistics)
            if stats.last_restart_ms is None or stats.restarted != i + 1:
                raise BenchmarkError(f"after kill {i + 1} the supervisor reports {stats!r}")
            restart_ms.append(round(stats.last_restart_ms, 3))
            imported_ms.append(_ms(killed, answer.imported_at))
            started_ms.append(_ms(killed, answer.started_at))
            ref, pong = new, answer
            step(f"kill {i + 1}/{opts.kills}")
    return Report(
        samples={
            "down": down_ms,
            "ready": ready_ms,
            "restart": restart_ms,
            "imported": imported_ms,
            "started": started_ms,
        }
    )


def _alive(pid: int) -> bool:
    """What a polling supervisor asks: does ``pid`` still run (a zombie does not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc: os.kill's answer stands


async def drive_polling(opts: argparse.Namespace) -> Report:
    """The baseline: a liveness poll every ``opts.interval`` s restarts the dead child.

    The poll is a plain loop in a thread of its own, as in uvicorn's and xoscar's
    supervisors; a restart is ``system.spawn`` of the same actor, the same code path a
    ``Supervisor`` takes, so the two differ only in how a death is noticed.
    """
    loop = asyncio.get_running_loop()
    restarted: asyncio.Queue[tuple[ActorRef[Any], float]] = asyncio.Queue()
    quit_polling = threading.Event()
    down_ms: list[float] = []
    ready_ms: list[float] = []
    restart_ms: list[float] = []
    imported_ms: list[float] = []
    started_ms: list[float] = []
    async with ActorSystem(name="bench-polling", start=opts.start) as system:
        first = system.pid_of(await system.spawn(Pinger, name=CHILD))
        assert first is not None
        pid = first

        async def restart() -> tuple[ActorRef[Any], int]:
            new = await system.spawn(Pinger, name=CHILD)
            new_pid = system.pid_of(new)
            assert new_pid is not None
            return new, new_pid

        def supervise() -> None:
            nonlocal pid
            while not quit_polling.is_set():
                # Sleeping between checks IS the behaviour this baseline measures: a death
                # is noticed at the next poll, on average half an interval late.
                time.sleep(opts.interval)
                if _alive(pid):
                    continue
                noticed = time.monotonic()
                new, pid = asyncio.run_coroutine_threadsafe(restart(), loop).result(TIMEOUT)
                restart_ms.append(_ms(noticed, time.monotonic()))
                loop.call_soon_threadsafe(restarted.put_nowait, (new, noticed))

        poller = threading.Thread(target=supervise, name="polling-supervisor", daemon=True)
        poller.start()
        try:
            for i, pause in enumerate(pauses(opts.kills, opts.interval, opts.seed)):
                await anyio.sleep(pause)
                old_pid = pid
                killed = time.monotonic()
                os.kill(old_pid, signal.SIGKILL)
                with anyio.fail_after(TIMEOUT):
                    new, noticed = await restarted.get()
                    answer = await _ping(new)
                ready_ms.append(_ms(killed, time.monotonic()))
                down_ms.append(_ms(killed, noticed))
                imported_ms.append(_ms(killed, answer.imported_at))
                started_ms.append(_ms(killed, answer.started_at))
                if answer.incarnation != new.incarnation or answer.pid == old_pid:
                    raise BenchmarkError(f"kill {i + 1}: the restarted child answered {answer!r}")
                step(f"kill {i + 1}/{opts.kills}")
        finally:
            quit_polling.set()
            await anyio.to_thread.run_sync(poller.join, TIMEOUT)
    return Report(
        samples={
            "down": down_ms,
            "ready": ready_ms,
            "restart": restart_ms,
            "imported": imported_ms,
            "started": started_ms,
        }
    )


async def drive_spawn_ready(opts: argparse.Namespace) -> Report:
    """Spawn a fresh ``Pinger`` ``opts.count`` times: spawn -> ready, then -> answering,
    with the moments the child had imported its module and run ``on_start``; then profile
    the imports of ``opts.profiles`` more."""
    samples: dict[str, list[float]] = {
        key: [] for key in ("spawn_ready", "answer", "imported", "started")
    }
    async with ActorSystem(name="bench-spawn", start="spawn") as system:
        for i in range(opts.count):
            t0 = time.monotonic()
            ref = await system.spawn(Pinger, name=f"fresh-{i}")
            t1 = time.monotonic()
            pong = await _ping(ref)
            samples["answer"].append(_ms(t0, time.monotonic()))
            samples["spawn_ready"].append(_ms(t0, t1))
            samples["imported"].append(_ms(t0, pong.imported_at))
            samples["started"].append(_ms(t0, pong.started_at))
            await system.stop(ref)
            step(f"spawn {i + 1}/{opts.count}")
        samples |= await _profile_imports(system, opts.profiles)
    return Report(samples=samples)


async def _spawn_profiled(system: ActorSystem, log: int, name: str) -> ActorRef[Any]:
    """Spawn a ``Pinger`` whose interpreter reports its imports (``-X importtime``) to the
    file ``log``: the child inherits this process's environment and its stderr."""
    saved = os.dup(2)
    os.environ["PYTHONPROFILEIMPORTTIME"] = "1"
    try:
        os.dup2(log, 2)
        return await system.spawn(Pinger, name=name, start="spawn")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        del os.environ["PYTHONPROFILEIMPORTTIME"]


async def _profile_imports(system: ActorSystem, count: int) -> dict[str, list[float]]:
    """What ``count`` fresh actor processes import, by package, start to first answer: the
    imports of ``runtime._child`` and the actor's module, and those made once the loop
    runs. Keys are ``imports.<package>``; values in ms, one per process."""
    startup = startup_modules(dict(os.environ))
    groups: dict[str, list[float]] = {}
    for i in range(count):
        with tempfile.TemporaryFile() as log:
            ref = await _spawn_profiled(system, log.fileno(), f"profiled-{i}")
            await _ping(ref)
            await system.stop(ref)
            log.seek(0)
            lines = parse_importtime(log.read().decode(errors="replace"))
        if not lines:
            raise BenchmarkError("the profiled actor process reported no imports")
        for group, ms in by_group(lines, startup).items():
            groups.setdefault(f"imports.{group}", [0.0] * i).append(round(ms, 3))
        for series in groups.values():
            series.extend([0.0] * (i + 1 - len(series)))
        step(f"import profile {i + 1}/{count}")
    return groups


async def drive_pipeline(opts: argparse.Namespace) -> Report:
    """Kill tokenizer worker 0 of a loaded ``Pipeline`` ``opts.kills`` times; time each
    restart until the new incarnation serves."""
    from actors import Pipeline, WorkerDiedError

    restart_ms: list[float] = []
    counts = {"served": 0, "failed": 0}
    # Each kill comes after the supervisor's restart window has passed, so every restart
    # is the first of its window, immediate: the deliberate backoff of later restarts
    # within one window (up to 2 s) is not what this measures.
    pipeline = Pipeline(workers=opts.workers, max_restarts=opts.kills + 10, period=PIPELINE_WINDOW)
    # The pipeline's own system, with the start method under test (preloading only where
    # there is a fork server to preload).
    preload = ("actors",) if opts.start == "fork-server" else ()
    pipeline.system = ActorSystem(name="pipeline", start=opts.start, preload=preload)
    async with pipeline, anyio.create_task_group() as load:

        async def client(c: int) -> None:
            n = 0
            while True:
                n += 1
                try:
                    await pipeline.generate(f"client {c} request {n}", max_new_tokens=16)
                    counts["served"] += 1
                except WorkerDiedError:
                    counts["failed"] += 1

        for c in range(opts.concurrency):
            load.start_soon(client, c)
        for i, pause in enumerate(pauses(opts.kills, opts.max_pause, opts.seed)):
            await anyio.sleep(PIPELINE_WINDOW * 1.2 + pause)
            killed = time.monotonic()
            old = pipeline.kill_worker(0)
            await pipeline.wait_worker(0, after=old.incarnation, timeout=TIMEOUT)
            restart_ms.append(_ms(killed, time.monotonic()))
            step(f"kill {i + 1}/{opts.kills}")
        load.cancel_scope.cancel()
    return Report(
        samples={"restart": restart_ms},
        values={
            "served": float(counts["served"]),
            "failed": float(counts["failed"]),
            "resubmitted": float(pipeline.resubmitted),
        },
    )


DRIVERS = {
    "supervised": drive_supervised,
    "polling": drive_polling,
    "spawn-ready": drive_spawn_ready,
    "pipeline": drive_pipeline,
}


def command(role: str, *args: str) -> list[str]:
    """The command line that runs ``role`` in a fresh interpreter."""
    return [sys.executable, "-m", "benchmarks._restart", role, *args]


def main(argv: list[str] | None = None) -> int:
    """Run one driver role and print its report."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._restart")
    parser.add_argument("role", choices=list(DRIVERS))
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--where", choices=["caller", "process"], default="process")
    parser.add_argument("--interval", type=float, default=0.5, help="polling: seconds")
    parser.add_argument("--max-pause", type=float, default=0.05, help="supervised: seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=10, help="spawn-ready: timed spawns")
    parser.add_argument("--profiles", type=int, default=2, help="spawn-ready: profiled ones")
    parser.add_argument("--start", choices=["fork-server", "spawn"], default="fork-server")
    parser.add_argument("--workers", type=int, default=2, help="pipeline: tokenizer workers")
    parser.add_argument("--concurrency", type=int, default=8, help="pipeline: clients")
    opts = parser.parse_args(argv)
    die_with_parent()
    return run_role(DRIVERS[opts.role], opts)


if __name__ == "__main__":
    sys.exit(main())
