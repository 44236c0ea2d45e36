"""The shape of benchmark results: what a suite returns, what ``--json`` writes, what
``plot`` reads.

Everything is a ``msgspec.Struct`` so the JSON file decodes back into typed objects and a
chart can be drawn from the file alone, long after the run. A suite describes its own charts
(``Chart``) as data, so the plotting code needs no per-suite branch.
"""

from __future__ import annotations

import datetime
import errno
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

#: Figure roles: what the suite measures, what it is compared against, context only.
SUBJECT = "subject"
BASELINE = "baseline"
INFO = "info"

#: Chart kinds: grouped bars of figure values, each figure's rounds as a line, or one bar
#: per variant stacked from its figures (the parts of a whole).
BARS = "bars"
ROUNDS = "rounds"
STACKED = "stacked"


class Ratio(msgspec.Struct, kw_only=True):
    """One figure divided by another measured in the same run.

    Attributes:
        baseline: Key of the figure in the denominator.
        label: How the table names the baseline (``"floor"``, ``"send_pyobj"``).
        value: The ratio (figure / baseline).
    """

    baseline: str
    label: str
    value: float


class Figure(msgspec.Struct, kw_only=True):
    """One measured number.

    Attributes:
        key: Unique within the suite (``"tell.small.throughput"``); ratios and targets
            refer to figures by key.
        variant: What was measured, for people (``"tokenyard tell"``).
        payload: The message shape (``"small"``, ``"batch"``), or ``""``.
        metric: ``"throughput"``, ``"p50"``, ``"p99"``, ``"mean"``, ...
        value: The reported number (best round, see the suite's notes).
        unit: ``"msg/s"``, ``"us"``, ``"s"``, ...
        role: ``SUBJECT``, ``BASELINE`` or ``INFO``.
        rounds: The value of every round, for the curious and for noise checks.
        ratios: This figure against its baselines.
        note: One line of context.
    """

    key: str
    variant: str
    payload: str
    metric: str
    value: float
    unit: str
    role: str = SUBJECT
    rounds: list[float] = msgspec.field(default_factory=list)
    ratios: list[Ratio] = msgspec.field(default_factory=list)
    note: str = ""


class Target(msgspec.Struct, kw_only=True):
    """A goal from the issue, checked against this run.

    Attributes:
        name: The goal in words (``"tell small >= 0.5x floor"``).
        figure: Key of the figure checked.
        baseline: Key of the baseline when the goal is a ratio, else ``""``.
        op: ``">="``, ``"<"`` or ``"<="``.
        threshold: The bound.
        value: The ratio (or the absolute value) measured.
        met: Whether ``value op threshold`` holds.
    """

    name: str
    figure: str
    baseline: str
    op: str
    threshold: float
    value: float
    met: bool


class Chart(msgspec.Struct, kw_only=True):
    """A chart drawn from a suite's figures, described as data.

    One panel per value of ``panel_by`` (``"payload"``: one for small, one for batch). In a
    ``BARS`` chart, one group of bars per variant, one bar per metric in ``metrics``. In a
    ``ROUNDS`` chart, one line per figure with a metric in ``metrics``: its ``rounds``
    against their index (every kill of a supervision run, in order). In a ``STACKED``
    chart, one bar per variant made of its figures, one segment per metric, in order (the
    parts of a restart).

    Attributes:
        name: File stem of the PNG.
        title: Chart title.
        metrics: Figure metrics drawn (``["throughput"]``, ``["p50", "p99"]``).
        unit: Axis unit.
        panel_by: ``"payload"`` or ``""`` (one panel).
        panel_titles: Title of each panel, by its ``panel_by`` value.
        reference: Variant whose value is drawn as a dashed line across its panel (the
            baseline everything is read against), or ``""``.
        limits: An absolute goal drawn as a dotted line, by panel (``{"small": 150.0}``).
        log: Logarithmic value axis.
        kind: ``BARS``, ``ROUNDS`` or ``STACKED``.
        payloads: The payloads drawn, in panel order; empty: every payload of the figures
            with the chart's metrics.
        x_label: ``ROUNDS``: what one point is (``"kill"``).
    """

    name: str
    title: str
    metrics: list[str]
    unit: str
    panel_by: str = "payload"
    panel_titles: dict[str, str] = msgspec.field(default_factory=dict)
    reference: str = ""
    limits: dict[str, float] = msgspec.field(default_factory=dict)
    log: bool = False
    kind: str = BARS
    payloads: list[str] = msgspec.field(default_factory=list)
    x_label: str = ""


class SuiteResult(msgspec.Struct, kw_only=True):
    """Everything one suite measured.

    Attributes:
        suite: The suite's name (``"mailbox"``).
        duration_s: Wall time of the suite.
        params: Sizes and settings it ran with.
        figures: Measured numbers, in display order.
        targets: Goals checked against them.
        charts: How ``plot`` draws them.
        notes: Caveats worth printing next to the numbers.
    """

    suite: str
    duration_s: float
    params: dict[str, int | float | str | bool]
    figures: list[Figure]
    targets: list[Target] = msgspec.field(default_factory=list)
    charts: list[Chart] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)

    def figure(self, key: str) -> Figure:
        """The figure with ``key``.

        Raises:
            KeyError: No figure has that key.
        """
        for fig in self.figures:
            if fig.key == key:
                return fig
        raise KeyError(f"suite {self.suite!r} has no figure {key!r}")


class Machine(msgspec.Struct, kw_only=True):
    """Where the numbers come from: they mean little without it.

    Versions are of the installed distributions (``"not installed"`` when one is missing);
    the fields after ``load_average`` came later and default to ``""`` in older files.
    """

    cpu_count: int
    platform: str
    machine: str
    python: str
    implementation: str
    pyzmq: str
    libzmq: str
    msgspec: str
    anyio: str
    commit: str
    load_average: list[float]
    tokenyard: str = ""
    tokenizers: str = ""
    rich: str = ""
    matplotlib: str = ""


class Results(msgspec.Struct, kw_only=True):
    """The file ``--json`` writes: the machine, the command line, every suite."""

    started: str
    argv: list[str]
    machine: Machine
    suites: list[SuiteResult]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    """The checked-out commit ('' outside a git checkout); read-only git plumbing."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _load_average() -> list[float]:
    """The 1, 5 and 15 minute load: a shared machine's numbers need it next to them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):  # not on this platform
        return []


def describe_machine() -> Machine:
    """Collect the machine and library versions the run used."""
    import zmq

    return Machine(
        cpu_count=os.cpu_count() or 0,
        platform=platform.platform(),
        machine=platform.machine(),
        python=sys.version.split()[0],
        implementation=platform.python_implementation(),
        pyzmq=zmq.pyzmq_version(),
        libzmq=zmq.zmq_version(),
        msgspec=msgspec.__version__,
        anyio=_version("anyio"),
        commit=_commit(),
        load_average=_load_average(),
        tokenyard=_version("tokenyard"),
        tokenizers=_version("tokenizers"),
        rich=_version("rich"),
        matplotlib=_version("matplotlib"),
    )


def now_iso() -> str:
    """The current time, ISO 8601 with the UTC offset."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def write_results(path: str, results: Results) -> None:
    """Write ``results`` as indented JSON, creating the parent directory."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(msgspec.json.format(msgspec.json.encode(results), indent=2) + b"\n")


def check_writable(path: str) -> None:
    """Fail now, not after the run, where `write_results` could not write ``path``: its
    parent directory is made, and a file is created in it and removed.

    Raises:
        OSError: ``path`` is a directory, its parent cannot be made, or nothing can be
            written in it.
    """
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    os.unlink(probe)
    if target.exists() and not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)


def read_results(path: str) -> Results:
    """Read a file written by ``--json``.

    Raises:
        OSError: It cannot be read (missing, a directory, no permission).
        msgspec.MsgspecError: It is not a results file (not JSON, empty, another shape).
    """
    return msgspec.json.decode(Path(path).read_bytes(), type=Results)
