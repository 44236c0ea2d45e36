"""The drivers of the spawn suite: ``python -m benchmarks._spawning <role> [options]``.

=============  =========================================================================
role           what it measures, per round
=============  =========================================================================
spawn-many     ``system.spawn`` of ``--actors`` ``Pinger`` processes, one after the other
               (``--mode sequential``) or all at once in a task group (``concurrent``),
               until every one is ready; then until every one has answered a ``Ping``;
               then their graceful stop
floor          the same number of ``python -c "<what an actor process imports>"``
               processes, one after the other or all at once, until every one has
               imported (then idle, like actors): interpreters with no runtime start
memory         the resident set of an idle ``Pinger`` process (forked from a fork server,
               and in a fresh interpreter), of that fork server, of a bare ``python -c``
               process and of a process that only imports what an actor imports (both
               waiting on stdin), read from ``/proc/<pid>/status`` and ``smaps_rollup``
=============  =========================================================================

``spawn-many`` starts its actors with ``--start`` (``fork-server`` or ``spawn``).

Each role reports one step per round and prints a ``Report`` last (``benchmarks._stream``):
samples in milliseconds, memory in kB.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from typing import Any

import anyio

from runtime import ActorRef, ActorSystem, StartMethod

from ._lifecycle_actors import Ping, Pinger, Pong
from ._proc import BenchmarkError, die_with_parent
from ._startup import CHILD_IMPORTS
from ._stream import Report, emit, run_role, step

TIMEOUT = 120.0
#: Seconds a measured process is left alone before its memory is read: idle, not starting.
SETTLE = 0.3
_STATUS_KEYS = {"VmRSS": "rss"}
_ROLLUP_KEYS = {"Pss": "pss", "Private_Clean": "uss", "Private_Dirty": "uss"}


def memory_kb(pid: int) -> dict[str, float]:
    """RSS (``/proc/<pid>/status``), PSS and USS (``smaps_rollup``) of ``pid``, in kB.

    RSS counts every page the process maps, shared libraries included; PSS divides shared
    pages among their sharers; USS is what the process alone holds (freed when it exits).

    Raises:
        BenchmarkError: No ``/proc`` (the suite needs Linux).
    """
    out = {"rss": 0.0, "pss": 0.0, "uss": 0.0}
    try:
        for path, keys in (
            (f"/proc/{pid}/status", _STATUS_KEYS),
            (f"/proc/{pid}/smaps_rollup", _ROLLUP_KEYS),
        ):
            with open(path, encoding="ascii") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in keys:
                        out[keys[key]] += float(rest.split()[0])
    except OSError as err:
        raise BenchmarkError(f"cannot read the memory of pid {pid}: {err} (Linux only)") from err
    return out


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)


async def _answer(ref: ActorRef[Any]) -> int:
    reply = await ref.ask(Ping(), timeout=TIMEOUT)
    if not isinstance(reply, Pong):
        raise BenchmarkError(f"{ref.name} answered a Ping with {reply!r}")
    return reply.pid


async def drive_spawn_many(opts: argparse.Namespace) -> Report:
    """Spawn ``opts.actors`` actors per round (sequentially or concurrently); time it."""
    ready: list[float] = []
    answered: list[float] = []
    stopped: list[float] = []
    async with ActorSystem(name="bench-spawn", start=opts.start) as system:
        # Untimed: the first spawn of a process pays for lazy imports in this one (and
        # for starting the fork server, which then imports the actor's module).
        await system.stop(await system.spawn(Pinger, name="warm-up"))
        for r in range(opts.rounds):
            names = [f"r{r}-a{k}" for k in range(opts.actors)]
            refs: dict[str, ActorRef[Any]] = {}

            async def spawn(name: str, out: dict[str, ActorRef[Any]]) -> None:
                out[name] = await system.spawn(Pinger, name=name)

            t0 = time.perf_counter()
            with anyio.fail_after(TIMEOUT):
                if opts.mode == "sequential":
                    for name in names:
                        await spawn(name, refs)
                else:
                    async with anyio.create_task_group() as tg:
                        for name in names:
                            tg.start_soon(spawn, name, refs)
            ready.append(_ms(t0))
            with anyio.fail_after(TIMEOUT):
                pids = {await _answer(refs[name]) for name in names}
            answered.append(_ms(t0))
            if len(pids) != opts.actors:
                raise BenchmarkError(f"{opts.actors} actors answered from {len(pids)} pids")
            t1 = time.perf_counter()
            if opts.mode == "sequential":
                for name in reversed(names):
                    await system.stop(refs[name])
            else:
                async with anyio.create_task_group() as tg:
                    for name in names:
                        tg.start_soon(system.stop, refs[name])
            stopped.append(_ms(t1))
            step(f"round {r + 1}/{opts.rounds}")
    return Report(samples={"ready": ready, "answered": answered, "stopped": stopped})


def drive_floor(opts: argparse.Namespace) -> Report:
    """Start ``opts.actors`` interpreters that import what an actor does; time until each
    has imported (it says so on stdout). Like actors, they then idle (on stdin) until the
    round is over, so none of them exits while another is still starting."""
    script = f"{CHILD_IMPORTS}\nimport sys\nprint('ready', flush=True)\nsys.stdin.read()"
    cmd = [sys.executable, "-c", script]
    walls: list[float] = []
    for r in range(opts.rounds):
        procs: list[subprocess.Popen[bytes]] = []
        try:
            t0 = time.perf_counter()
            for _ in range(opts.actors):
                procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
                if opts.mode == "sequential":
                    _imported(procs[-1])
            if opts.mode == "concurrent":
                for proc in procs:
                    _imported(proc)
            walls.append(_ms(t0))
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.close()  # EOF: it exits
            codes = [p.wait(TIMEOUT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                for stream in (p.stdin, p.stdout):
                    if stream is not None:
                        stream.close()
        if any(codes):
            raise BenchmarkError(f"an import-only interpreter exited with statuses {codes}")
        step(f"round {r + 1}/{opts.rounds}")
    return Report(samples={"ready": walls})


def _imported(proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``proc`` says it has imported."""
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        raise BenchmarkError(f"an import-only interpreter exited with status {proc.wait()}")


def _waiting_process(code: str) -> dict[str, float]:
    """Memory of a ``python -c`` that runs ``code``, then waits on stdin (idle)."""
    script = f"{code}\nimport sys\nprint('ready', flush=True)\nsys.stdin.read()"
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise BenchmarkError(f"python -c {code!r} exited with status {proc.wait()}")
        time.sleep(SETTLE)
        return memory_kb(proc.pid)
    finally:
        with contextlib.suppress(OSError):
            proc.communicate(timeout=TIMEOUT)  # EOF on stdin: it exits
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def drive_memory(opts: argparse.Namespace) -> Report:
    """Memory of an idle actor process, a bare interpreter and an interpreter with the
    actor's imports, ``opts.rounds`` fresh processes each."""
    values: dict[str, list[float]] = {}

    def add(prefix: str, kb: dict[str, float]) -> None:
        for key, value in kb.items():
            values.setdefault(f"{prefix}.{key}", []).append(value)

    for r in range(opts.rounds):
        add("bare", await anyio.to_thread.run_sync(_waiting_process, "pass"))
        add("imports", await anyio.to_thread.run_sync(_waiting_process, CHILD_IMPORTS))
        starts: tuple[tuple[str, StartMethod], ...] = (
            ("actor", "fork-server"),
            ("actor_fresh", "spawn"),
        )
        for prefix, start in starts:
            async with ActorSystem(name="bench-memory", start=start) as system:
                ref = await system.spawn(Pinger, name="idle")
                pid = await _answer(ref)  # it has served: its sockets are connected
                await anyio.sleep(SETTLE)
                add(prefix, memory_kb(pid))
                server = system.launcher.server
                if server is not None and server.pid is not None:
                    add("server", memory_kb(server.pid))
                await system.stop(ref)
        step(f"round {r + 1}/{opts.rounds}")
    return Report(samples=values)


def command(role: str, *args: str) -> list[str]:
    """The command line that runs ``role`` in a fresh interpreter."""
    return [sys.executable, "-m", "benchmarks._spawning", role, *args]


def main(argv: list[str] | None = None) -> int:
    """Run one driver role and print its report."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._spawning")
    parser.add_argument("role", choices=["spawn-many", "floor", "memory"])
    parser.add_argument("--mode", choices=["sequential", "concurrent"], default="sequential")
    parser.add_argument("--actors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--start", choices=["fork-server", "spawn"], default="fork-server")
    opts = parser.parse_args(argv)
    die_with_parent()
    if opts.role == "floor":
        try:
            emit(drive_floor(opts))
        except KeyboardInterrupt:
            return 130
        return 0
    return run_role(drive_spawn_many if opts.role == "spawn-many" else drive_memory, opts)


if __name__ == "__main__":
    sys.exit(main())
