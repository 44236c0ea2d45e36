"""Front ends the engines suite races, each a running server over one engine, and the CPU
of each of their parts, from ``/proc``.

A `FrontEnd` is what the suite needs of a server: its URL, and a `Snapshot` of the CPU
seconds each *unit* has used so far, with the *part* the unit plays. A unit is a process
(tokenyard's and vLLM's front ends are processes) or a thread (llama.cpp's server is one
process whose HTTP threads and compute threads are told apart by name). The parts in
`ENGINE_PARTS` are the engine; every other part is the front end.

Every process is started in a session of its own and reaped by its process group
(`benchmarks._proc.reap`) when its block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, NamedTuple

from ._llamacpp_server import ENGINE_THREAD
from ._proc import BenchmarkError, _env, parent_death_signal, reap
from .serve import cpu_seconds, tree

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

#: Parts of a front end, in the order the CPU chart stacks them, and the engine's.
OWNER = "owner"  # tokenyard: the port's owner and supervisor, its fork server
WORKER = "worker"  # tokenyard: tokenizer workers, each serving HTTP
DETOKENIZER = "detokenizer"
ROUTER = "router"
#: tokenyard's scheduler process, where the engine is not in it (vLLM, attached): the
#: engine's keeper (handshake, liveness) and, with ``--vllm-clients scheduler``, its one
#: client, a part of the front end (vLLM's API server does that work itself). With
#: llama.cpp in-process, the scheduler process is the engine.
SCHEDULER = "engine_client"
HTTP = "http"  # llama.cpp: every thread of its server but the compute threads
API_SERVER = "api_server"  # vLLM: its API server processes
ENGINE = "engine"
PARTS = (OWNER, WORKER, DETOKENIZER, ROUTER, SCHEDULER, HTTP, API_SERVER, ENGINE)
ENGINE_PARTS = frozenset({ENGINE})

#: Seconds a server may take to say it serves (vLLM's take half a minute).
START_TIMEOUT = 120.0
#: Seconds a server may take to stop once told to.
STOP_TIMEOUT = 60.0
_TICK = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat counts clock ticks


class Unit(NamedTuple):
    """A process or thread: the part it plays and its CPU seconds so far."""

    part: str
    cpu: float


#: Every unit of a front end and its engine, by key (``"1234"``, ``"1234/1240"``).
Snapshot = dict[str, Unit]


@dataclass
class FrontEnd:
    """A server that serves.

    Attributes:
        url: ``http://host:port``.
        snapshot: Reads every unit's CPU now.
        units: ``"process"`` or ``"thread"``: what one unit of its front end is.
    """

    url: str
    snapshot: Callable[[], Snapshot]
    units: str = "process"


# -- /proc ----------------------------------------------------------------------------------


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Every live thread of ``pid``: its name and CPU seconds so far."""
    out: dict[int, tuple[str, float]] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
                name = (task / "comm").read_text().strip()
            except OSError:
                continue  # ended meanwhile
            fields = stat.rpartition(")")[2].split()
            out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def title(pid: int) -> str:
    """A process's title (``tokenyard::router:123``, ``VLLM::EngineCore``), or ``""``."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except (OSError, UnicodeDecodeError):
        return ""


def tokenyard_part(name: str, scheduler: str = ENGINE) -> str:
    """The part a process of ``python -m actors serve`` plays, from its title; the
    scheduler's is the ``scheduler`` argument (`ENGINE` when the engine runs in it,
    `SCHEDULER` when it is an outside engine's client)."""
    name = name.removeprefix("tokenyard::")
    for prefix, part in (
        ("tokenizer_worker", WORKER),
        ("detokenizer", DETOKENIZER),
        ("router", ROUTER),
        ("scheduler", scheduler),
    ):
        if name.startswith(prefix):
            return part
    return OWNER  # the serve process itself (port owner, supervisor), the fork server


def process_snapshot(roots: Sequence[int], part_of: Callable[[str], str]) -> Snapshot:
    """Every process of the trees under ``roots``, its part from its title."""
    return {
        str(pid): Unit(part_of(title(pid)), cpu_seconds(pid))
        for root in roots
        for pid in tree(root)
    }


def thread_snapshot(pid: int) -> Snapshot:
    """llama.cpp's server process, thread by thread: ``llama-engine`` threads are the
    engine, the others its HTTP front end. The CPU of threads that ended is the unit
    ``PID/ended`` (the process's total less its live threads'), so the units always add
    up to the process."""
    threads = thread_cpu(pid)
    snap = {
        f"{pid}/{tid}": Unit(ENGINE if name == ENGINE_THREAD else HTTP, cpu)
        for tid, (name, cpu) in threads.items()
    }
    live = sum(cpu for _, cpu in threads.values())
    snap[f"{pid}/ended"] = Unit(HTTP, max(0.0, cpu_seconds(pid) - live))
    return snap


# -- processes ------------------------------------------------------------------------------


def read_line(proc: subprocess.Popen[bytes], prefix: str, timeout: float, what: str) -> str:
    """The first line ``proc`` prints that starts with ``prefix``.

    Raises:
        BenchmarkError: It exited, or printed none within ``timeout`` seconds (with the
            end of its standard error).
    """
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            break
        line = proc.stdout.readline().decode(errors="replace")
        if not line:
            break  # it exited
        if line.startswith(prefix):
            return line.strip()
    reap(proc, group=True)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    raise BenchmarkError(f"{what} did not print {prefix!r} within {timeout:g} s:\n{err[-3000:]}")


def wait_healthy(
    url: str,
    timeout: float = 30.0,
    path: str = "/health",
    watch: Sequence[Watched] = (),
) -> None:
    """Poll ``GET url+path`` until it answers 200 (llama.cpp's says 503 while it loads).

    Raises:
        BenchmarkError: It did not within ``timeout`` seconds, or a process of ``watch``
            ended first (the error quotes the end of its log).
    """
    host, _, port = url.removeprefix("http://").rpartition(":")
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        check_running(watch)
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            if response.status == 200:
                return
            last = f"status {response.status}"
        except OSError as err:
            last = str(err)
        finally:
            connection.close()
        time.sleep(0.05)  # sync-ok: the interval between two polls of the readiness endpoint
    raise BenchmarkError(f"{url}{path} did not answer 200 within {timeout:g} s ({last})")


class Watched(NamedTuple):
    """A process a wait gives up on when it ends, what it is, and where it logs."""

    proc: subprocess.Popen[bytes]
    what: str
    log: Path | None = None


def check_running(watch: Sequence[Watched]) -> None:
    """Raise when a process of ``watch`` has ended: waiting on it would only time out.

    Raises:
        BenchmarkError: One ended; the message has its status and the end of its log.
    """
    for watched in watch:
        code = watched.proc.poll()
        if code is None:
            continue
        tail = ""
        if watched.log is not None:
            with contextlib.suppress(OSError):
                tail = watched.log.read_bytes()[-3000:].decode(errors="replace")
        elif watched.proc.stderr is not None:
            tail = watched.proc.stderr.read()[-3000:].decode(errors="replace")
        raise BenchmarkError(f"{watched.what} exited with status {code}:\n{tail}")


def start(
    cmd: Sequence[str], env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a session of its own, its output piped, or written to ``log`` (for
    a chatty process nobody reads during the run: a full pipe would stall it).

    It gets SIGTERM, and stops as it does when the suite stops it, if this process dies
    without its ``finally`` blocks (SIGKILL, the OOM killer): in a session of its own, no
    signal to this one's process group reaches it. Call from the main thread (see
    `benchmarks._proc.parent_death_signal`).
    """
    if log is None:
        out: int | IO[bytes] = subprocess.PIPE
        err: int | IO[bytes] = subprocess.PIPE
    else:
        out = err = log.open("ab")
    try:
        return subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env or _env(),
            start_new_session=True,
            preexec_fn=parent_death_signal(signal.SIGTERM),
        )
    finally:
        if not isinstance(out, int):
            out.close()


def stop(proc: subprocess.Popen[bytes], what: str) -> None:
    """SIGTERM, a bounded wait, then the group killed whatever is left.

    Raises:
        BenchmarkError: It did not stop within `STOP_TIMEOUT`.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise BenchmarkError(
                f"{what} did not stop within {STOP_TIMEOUT:g} s of SIGTERM"
            ) from None
        finally:
            reap(proc, group=True)
    reap(proc, group=True)


@contextlib.contextmanager
def running(
    cmd: Sequence[str], what: str, env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` started for the block (its output to ``log`` when given), stopped (SIGTERM,
    then its group killed) at its end, even on an error or Ctrl-C."""
    proc = start(cmd, env, log)
    try:
        yield proc
        stop(proc, what)
    finally:
        reap(proc, group=True)


# -- the front ends ---------------------------------------------------------------------------


def llamacpp_server_command(model: str, n_parallel: int, context: int, threads: int) -> list[str]:
    """``benchmarks._llamacpp_server``: llama.cpp's own server on ``model``."""
    return [
        sys.executable,
        "-m",
        "benchmarks._llamacpp_server",
        "--model",
        model,
        "--n-parallel",
        str(n_parallel),
        "--context",
        str(context),
        "--threads",
        str(threads),
    ]


@contextlib.contextmanager
def open_llamacpp_server(
    model: str, n_parallel: int, context: int, threads: int
) -> Iterator[FrontEnd]:
    """llama.cpp's own HTTP server (`benchmarks._llamacpp_server`) on ``model``."""
    what = "llama.cpp's server"
    with running(llamacpp_server_command(model, n_parallel, context, threads), what) as proc:
        _, url, _ = read_line(proc, "ready ", START_TIMEOUT, what).split()
        wait_healthy(url)
        pid = proc.pid
        yield FrontEnd(url=url, snapshot=lambda: thread_snapshot(pid), units="thread")


def tokenyard_serve_command(workers: int, engine_args: Sequence[str]) -> list[str]:
    """``python -m actors serve`` with ``workers`` on any free port."""
    return [
        sys.executable,
        "-m",
        "actors",
        "serve",
        "--workers",
        str(workers),
        "--port",
        "0",
        *engine_args,
    ]


def llamacpp_engine_args(model: str, n_parallel: int, context: int, threads: int) -> list[str]:
    """``serve``'s options for llama.cpp with the baseline's settings."""
    return [
        "--engine",
        "llamacpp",
        "--model",
        model,
        "--n-parallel",
        str(n_parallel),
        "--engine-context",
        str(context),
        "--engine-threads",
        str(threads),
    ]


@contextlib.contextmanager
def open_tokenyard(
    workers: int,
    engine_args: Sequence[str],
    engine: Watched | None = None,
    ready_timeout: float = 30.0,
) -> Iterator[FrontEnd]:
    """``python -m actors serve --workers N`` with ``engine_args``, once its ``/health``
    says 200 (its engine generates). ``engine``: an engine process of its own, outside
    the server (vLLM, attached): its tree is read as the engine, the scheduler as its
    client (`SCHEDULER`), and the wait for health gives up when it ends."""
    what = f"python -m actors serve --workers {workers}"
    scheduler = ENGINE if engine is None else SCHEDULER
    also = () if engine is None else (engine.proc.pid,)
    with running(tokenyard_serve_command(workers, engine_args), what) as proc:
        # "serving http://127.0.0.1:PORT with ...", once every worker serves.
        url = read_line(proc, "serving ", START_TIMEOUT, what).split()[1]
        wait_healthy(url, ready_timeout, watch=() if engine is None else (engine,))

        def snapshot() -> Snapshot:
            snap = process_snapshot(
                [proc.pid], functools.partial(tokenyard_part, scheduler=scheduler)
            )
            for root in also:
                snap |= process_snapshot([root], lambda _: ENGINE)
            return snap

        yield FrontEnd(url=url, snapshot=snapshot)
