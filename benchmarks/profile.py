"""Profile suite: where the CPU time of a small ``tell`` goes, part by part, in this
checkout and (``--before REV``) in an older commit's runtime, measured the same way.

Run it with ``python -m benchmarks profile [--json PATH] [--messages N] [--before REV]``.

The driver (``benchmarks._tellprofile``) tells an in-process actor small messages (the
mailbox suite's 81-byte one) and measures the CPU time per tell, both ends together,
unprofiled; then it runs the same tells under ``cProfile`` and splits that time into parts
by the functions' own time (`benchmarks._tellprofile.PARTS`). cProfile's own overhead
weighs on small Python functions more than on C calls, so read the parts as shares, not as
exact costs. ``--before REV`` extracts the ``runtime`` package of that commit
(``git archive``) into a temporary directory and runs the same driver against it: the
before and after of a change to the runtime, side by side in one run.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ._proc import BenchmarkError, _env
from ._results import BASELINE, INFO, STACKED, SUBJECT, Chart, Figure, Ratio, SuiteResult
from ._stats import RULE
from ._suite import Option, Suite, pick
from ._tellprofile import PARTS, Profile

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator

    from ._suite import Progress

PAYLOAD = "small tell, CPU per tell by part"
TOTAL = "small tell, CPU per tell"
ROOT = Path(__file__).resolve().parent.parent

OPTIONS = (
    Option("--messages", "tells per round (quick 20000, full 200000)"),
    Option(
        "--before",
        "also profile the runtime of this git revision (e.g. a commit before a change)",
        type=str,
        metavar="REV",
    ),
)


@contextlib.contextmanager
def runtime_of(rev: str) -> Iterator[str]:
    """A temporary directory holding the ``runtime`` package of ``rev``.

    Raises:
        BenchmarkError: git cannot produce it.
    """
    out = subprocess.run(
        ["git", "archive", "--format=tar", rev, "runtime"],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
    )
    if out.returncode != 0:
        raise BenchmarkError(f"git archive {rev} runtime failed: {out.stderr.decode()[-500:]}")
    directory = tempfile.mkdtemp(prefix="tokenyard-profile-")
    try:
        with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
            tar.extractall(directory, filter="data")
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def profile(messages: int, rounds: int, runtime: str = "", floor: bool = False) -> Profile:
    """Run the driver once (against ``runtime`` when given) and read its result.

    Raises:
        BenchmarkError: It failed or printed nothing.
    """
    cmd = [sys.executable, "-m", "benchmarks._tellprofile", "--messages", str(messages)]
    cmd += ["--rounds", str(rounds)]
    if runtime:
        cmd += ["--runtime", runtime]
    if floor:
        cmd.append("--floor")
    out = subprocess.run(
        cmd, capture_output=True, env=_env(), timeout=120 + messages / 100, check=False
    )
    lines = out.stdout.decode().strip().splitlines()
    if out.returncode != 0 or not lines:
        raise BenchmarkError(f"the tell profile failed:\n{out.stderr.decode()[-3000:]}")
    return msgspec.json.decode(lines[-1], type=Profile)


def slug(part: str) -> str:
    """A part's name as a figure key's last part (``"libzmq I/O threads"`` ->
    ``"libzmq_i_o_threads"``)."""
    return re.sub(r"[^a-z0-9]+", "_", part.lower()).strip("_")


def figures_of(key: str, label: str, role: str, measured: Profile) -> list[Figure]:
    """The total and the parts of one profile."""
    figures = [
        Figure(
            key=f"{key}.cpu",
            variant=label,
            payload=TOTAL,
            metric="per tell",
            value=round(measured.cpu_us * 1000),
            unit="ns",
            role=role,
            rounds=[round(r * 1000) for r in measured.rounds],
            note=f"runtime from {measured.runtime}",
        )
    ]
    figures += [
        Figure(
            key=f"{key}.{slug(part)}",
            variant=label,
            payload=PAYLOAD,
            metric=part,
            value=round(measured.parts.get(part, 0.0) * 1000),
            unit="ns",
            role=INFO,
        )
        for part in PARTS
    ]
    return figures


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Profile this checkout's runtime, and the one of ``--before`` if given."""
    start = time.monotonic()
    messages = pick(args, "messages", 20_000, 200_000)
    rounds = args.rounds or (5 if args.full else 3)
    before: str | None = getattr(args, "before", None)
    progress.begin(3 if before else 2)
    progress.step("profiling pyzmq and msgspec alone")
    figures = figures_of(
        "floor", "pyzmq + msgspec, no runtime", BASELINE, profile(messages, rounds, floor=True)
    )
    progress.advance()
    if before:
        progress.step(f"profiling the runtime of {before}")
        with runtime_of(before) as directory:
            old = profile(messages, rounds, directory)
        figures += figures_of("before", f"runtime at {before}", INFO, old)
        progress.advance()
    progress.step("profiling this checkout's runtime")
    figures += figures_of("now", "runtime of this checkout", SUBJECT, profile(messages, rounds))
    progress.advance()
    by_key = {f.key: f for f in figures}
    now = by_key["now.cpu"]
    for key, label in (("floor.cpu", "pyzmq + msgspec"), ("before.cpu", f"at {before}")):
        if key in by_key and by_key[key].value:
            now.ratios.append(Ratio(baseline=key, label=label, value=now.value / by_key[key].value))
    return SuiteResult(
        suite="profile",
        duration_s=round(time.monotonic() - start, 2),
        params={"messages": messages, "rounds": rounds, "before": before or ""},
        figures=figures,
        charts=[
            Chart(
                name="profile-tell",
                title="where a small tell's CPU time goes, both ends in one process (cProfile"
                " shares of the unprofiled time; lower is better)",
                metrics=list(PARTS),
                unit="ns",
                payloads=[PAYLOAD],
                kind=STACKED,
            )
        ],
        notes=[
            "CPU time per tell, sender and receiver in one process (an in-process actor:"
            " the same sockets and frames as between processes), best of the rounds,"
            " unprofiled; the parts are cProfile's own-time shares of it.",
            "cProfile weighs on many small Python calls more than on a few C calls: the"
            " parts are shares, not exact costs.",
            RULE,
        ],
    )


def check(args: argparse.Namespace) -> str | None:
    """Why ``--before`` cannot be profiled (``None``: it can), found before any suite runs:
    a revision git does not know, or one without a ``runtime`` package."""
    before: str | None = getattr(args, "before", None)
    if not before:
        return None
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{before}^{{commit}}:runtime"],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
    )
    if found.returncode != 0:
        return f"--before {before}: git knows no commit of that name holding runtime/"
    return None


SUITE = Suite(
    name="profile",
    help="where a small tell's CPU time goes, part by part (and before a given commit)",
    run=run,
    options=OPTIONS,
    check=check,
)
