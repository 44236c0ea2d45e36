"""The terminal side of a run: a rich progress bar while suites run, tables at the end."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichProgressBar
from rich.table import Table

from ._results import BASELINE, INFO, SUBJECT

if TYPE_CHECKING:
    from types import TracebackType

    from rich.console import Console

    from ._results import Figure, Machine, SuiteResult


class RichProgress:
    """A ``Progress`` (see ``benchmarks._suite``) drawn as one rich bar per suite."""

    def __init__(self, console: Console) -> None:
        self._bar = RichProgressBar(
            SpinnerColumn(),
            TextColumn("[bold]{task.fields[suite]}[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=console,
            transient=False,
        )
        self._task: TaskID | None = None
        self._suite = ""

    def __enter__(self) -> RichProgress:
        self._bar.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bar.__exit__(exc_type, exc, tb)

    def suite(self, name: str) -> None:
        """Start reporting for the suite ``name`` (its bar appears at ``begin``)."""
        self._suite = name
        self._task = None

    def begin(self, total: int) -> None:
        """Draw the suite's bar with ``total`` steps."""
        self._task = self._bar.add_task("", total=total, suite=self._suite)

    def step(self, label: str) -> None:
        """Show the step now running."""
        if self._task is not None:
            self._bar.update(self._task, description=label)

    def advance(self) -> None:
        """One step done."""
        if self._task is not None:
            self._bar.advance(self._task)

    def done(self) -> None:
        """Clear the description of the finished suite."""
        if self._task is not None:
            self._bar.update(self._task, description="[green]done[/]")


class PlainProgress:
    """A ``Progress`` (see ``benchmarks._suite``) as plain lines, one a step, for output
    that is not a terminal (``make bench > log``, a pipe, CI), where a rich bar shows only
    once the run has ended."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._suite = ""
        self._started = 0.0
        self._total = 0
        self._done = 0

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def _say(self, text: str) -> None:
        self._console.print(text, markup=False, highlight=False, soft_wrap=True)
        self._console.file.flush()

    def suite(self, name: str) -> None:
        """Say that the suite ``name`` starts."""
        self._suite, self._started, self._total, self._done = name, time.monotonic(), 0, 0
        self._say(f"{name}: started")

    def begin(self, total: int) -> None:
        """Note how many steps the suite takes."""
        self._total = total

    def step(self, label: str) -> None:
        """Say which step runs, and where it stands among the suite's steps."""
        self._say(f"{self._suite} [{self._done + 1}/{self._total}]: {label}")

    def advance(self) -> None:
        """One step done."""
        self._done += 1

    def done(self) -> None:
        """Say that the suite finished, and in how long."""
        self._say(f"{self._suite}: done in {time.monotonic() - self._started:.1f} s")


def format_value(value: float, unit: str) -> str:
    """A figure for people: thousands separators for rates, two decimals for times."""
    if unit.endswith("/s"):
        return f"{value:,.0f} {unit}"
    if unit in ("us", "ms"):
        return f"{value:,.1f} {unit}"
    return f"{value:,.3g} {unit}"


_ROLE_STYLE = {SUBJECT: "bold cyan", BASELINE: "", INFO: "dim"}


def _ratios(fig: Figure) -> str:
    return "\n".join(f"{r.value:.2f}x {r.label}" for r in fig.ratios)


def suite_table(result: SuiteResult) -> Table:
    """Every figure of a suite: variant, payload, figure, value, ratio vs baselines."""
    table = Table(
        title=f"{result.suite} suite ({result.duration_s:.1f} s)",
        title_justify="left",
        show_lines=False,
    )
    table.add_column("variant")
    table.add_column("payload")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("ratio vs baseline", justify="right")
    last = ""
    for fig in result.figures:
        group = f"{fig.payload}:{fig.unit}"
        if last and group != last:
            table.add_section()
        last = group
        table.add_row(
            fig.variant,
            fig.payload,
            fig.metric,
            format_value(fig.value, fig.unit),
            _ratios(fig),
            style=_ROLE_STYLE.get(fig.role, ""),
        )
    return table


def targets_table(result: SuiteResult) -> Table | None:
    """The suite's goals and whether this run met them (``None`` when it has none)."""
    if not result.targets:
        return None
    table = Table(title=f"{result.suite} targets", title_justify="left")
    table.add_column("target")
    table.add_column("measured", justify="right")
    table.add_column("met", justify="center")
    for target in result.targets:
        unit = "x" if target.baseline else f" {result.figure(target.figure).unit}"
        table.add_row(
            target.name,
            f"{target.value:.2f}{unit}",
            "[green]yes[/]" if target.met else "[red]no[/]",
        )
    return table


def machine_line(machine: Machine) -> str:
    """One line saying where the numbers come from."""
    load = ", ".join(f"{x:.2f}" for x in machine.load_average) or "n/a"
    return (
        f"{machine.cpu_count} CPUs, {machine.platform}, Python {machine.python}, "
        f"pyzmq {machine.pyzmq} (libzmq {machine.libzmq}), msgspec {machine.msgspec}, "
        f"anyio {machine.anyio}, tokenizers {machine.tokenizers or 'n/a'}, "
        f"tokenyard {machine.tokenyard or 'n/a'}; load average {load}"
    )


def print_summary(console: Console, machine: Machine, results: list[SuiteResult]) -> None:
    """Print the machine, then each suite's figures, targets and notes."""
    console.print(f"[dim]{machine_line(machine)}[/]")
    for result in results:
        console.print(suite_table(result))
        targets = targets_table(result)
        if targets is not None:
            console.print(targets)
        for note in result.notes:
            console.print(f"[dim]- {note}[/]")
