"""Processes for benchmarks: start a peer, read its measurement, and never leave one behind.

Every variant runs in fresh processes started with ``subprocess`` (``python -m
benchmarks._peers <role>``; multiprocessing is banned in this project). The suite starts one
*driver* per variant in a session of its own; the driver starts its peer (a plain pyzmq
sink, or a tokenyard actor through ``ActorSystem.spawn``) inside that session. Killing the
session's process group therefore reaches every process a variant started, however it failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ._stats import nearest_rank_quantile

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

#: Seconds a process gets between SIGTERM and SIGKILL.
_GRACE = 2.0
_PR_SET_PDEATHSIG = 1


class BenchmarkError(Exception):
    """A variant failed: its process exited badly, timed out, or reported nonsense."""


class Latency(msgspec.Struct, kw_only=True):
    """Round-trip times of one round, in microseconds (p50 and p99: nearest rank)."""

    p50_us: float
    p99_us: float
    mean_us: float
    min_us: float
    n: int


class Measurement(msgspec.Struct, kw_only=True):
    """What a driver prints on stdout (one JSON line) for the suite to read.

    Attributes:
        throughput: Messages per second, one value per round.
        latency: Round-trip statistics, one per round.
        frame_bytes: Size of one encoded message on the wire (0 when unknown).
    """

    throughput: list[float] = msgspec.field(default_factory=list)
    latency: list[Latency] = msgspec.field(default_factory=list)
    frame_bytes: int = 0


def latency_of(samples_ns: Sequence[int]) -> Latency:
    """Summarise one round of round-trip samples, in ns; p50 and p99 are
    ``benchmarks._stats.nearest_rank_quantile``.

    Raises:
        BenchmarkError: The round has no samples.
    """
    n = len(samples_ns)
    if n == 0:
        raise BenchmarkError("a latency round with no samples")
    return Latency(
        p50_us=nearest_rank_quantile(samples_ns, 0.50) / 1000,
        p99_us=nearest_rank_quantile(samples_ns, 0.99) / 1000,
        mean_us=sum(samples_ns) / n / 1000,
        min_us=min(samples_ns) / 1000,
        n=n,
    )


def _package_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def peer_command(role: str, *args: str) -> list[str]:
    """The command line that runs ``role`` of ``benchmarks._peers`` in a fresh interpreter."""
    return [sys.executable, "-m", "benchmarks._peers", role, *args]


def _env() -> dict[str, str]:
    # The peer must import `benchmarks` and `runtime` from where this process did, whatever
    # the working directory.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), env.get("PYTHONPATH")]))
    return env


def reap(proc: subprocess.Popen[bytes], *, group: bool = False) -> None:
    """Stop ``proc`` (and its process group when it leads one) and wait for it.

    A process still running gets SIGTERM, then SIGKILL after a grace period. With ``group``,
    whatever else is left in its process group is killed too, so a peer whose driver died
    does not outlive the run.
    """

    def send(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)

    try:
        if proc.poll() is None:
            send(signal.SIGTERM)
            try:
                proc.wait(_GRACE)
            except subprocess.TimeoutExpired:
                send(signal.SIGKILL)
                proc.wait()
    finally:
        if group:
            # The leader is gone; members it left behind (a peer blocked in recv) are not.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@contextlib.contextmanager
def started(
    cmd: Sequence[str], *, capture: bool = False, session: bool = False
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` for the duration of the block; it is reaped on exit, even on Ctrl-C.

    Args:
        cmd: The command line.
        capture: Pipe stdout and stderr (for drivers, whose stdout carries the result).
        session: Start a new session, so the whole tree can be killed as one group.
    """
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(
        list(cmd),
        stdin=subprocess.DEVNULL,
        stdout=pipe,
        stderr=pipe,
        env=_env(),
        start_new_session=session,
    )
    try:
        yield proc
    finally:
        reap(proc, group=session)


def run_driver(cmd: Sequence[str], timeout: float) -> Measurement:
    """Run one variant's driver to completion and return its measurement.

    Raises:
        BenchmarkError: It exited with an error, ran past ``timeout`` seconds, or printed
            no measurement.
    """
    with started(cmd, capture=True, session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchmarkError(
                f"{' '.join(cmd[2:])} did not finish within {timeout:g} s; "
                "pass smaller sizes or check that the machine is not overloaded"
            ) from None
    text = err.decode(errors="replace").strip()
    if proc.returncode != 0:
        raise BenchmarkError(
            f"{' '.join(cmd[2:])} exited with status {proc.returncode}:\n{text[-3000:]}"
        )
    lines = out.decode().strip().splitlines()
    if not lines:
        raise BenchmarkError(f"{' '.join(cmd[2:])} printed no measurement:\n{text[-3000:]}")
    return msgspec.json.decode(lines[-1], type=Measurement)


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (no-op elsewhere).

    A peer blocked in ``recv`` cannot notice that its driver is gone; this makes the kernel
    notice for it.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def parent_death_signal(signum: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that has Linux send the child ``signum``
    when its parent dies, however it dies (SIGKILL, the OOM killer); ``None`` elsewhere.

    For a child that is not ours to edit (``python -m actors serve``, ``vllm serve``), as
    `die_with_parent` is for our peers. Linux sends it when the *thread* that forked the
    child ends: start the child from the thread that outlives it (the main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was asked for
            os._exit(1)

    return preexec
