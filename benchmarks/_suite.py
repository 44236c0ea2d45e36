"""What a benchmark suite is, for the CLI: a name, its options, and a ``run`` function.

A new suite is a module exposing ``SUITE = Suite(...)`` plus one line in
``benchmarks._cli.SUITES``; the CLI gives it a subcommand, a place in ``all``, the progress
bar, the summary table, ``--json`` and ``plot`` without further edits.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._results import SuiteResult


class Progress(Protocol):
    """How a suite reports progress (the CLI draws it as a rich progress bar)."""

    def begin(self, total: int) -> None:
        """Announce how many steps the suite will take."""

    def step(self, label: str) -> None:
        """Announce the step starting now (shown next to the bar)."""

    def advance(self) -> None:
        """Mark the current step done."""


def positive_int(text: str) -> int:
    """An option's value that must be a whole number above zero.

    Raises:
        argparse.ArgumentTypeError: It is not.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


@dataclass(frozen=True)
class Option:
    """A suite-specific command-line option (``--messages N``).

    Options with the same flag and ``dest`` in two suites are one option: ``all`` adds it
    once, and gives its value to each. One flag with two meanings (two ``dest``) is added to
    ``all`` once per suite, as ``--<suite>-<flag>``. Either way, ``all`` hands each suite
    only its own options' values (``benchmarks._cli.suite_args``).

    Attributes:
        flag: The option as typed (``"--workers"``).
        help: One line for ``--help``.
        type: Turns the text into the value (and rejects bad text with
            ``argparse.ArgumentTypeError``, so that a bad value ends the command line before
            any suite runs); default `positive_int`.
        metavar: The placeholder in ``--help``.
        dest: The attribute of the parsed arguments the suite reads (default: the flag's
            name, ``--max-new`` -> ``max_new``).
    """

    flag: str
    help: str
    type: Callable[[str], object] = positive_int
    metavar: str = "N"
    dest: str = ""

    @property
    def name(self) -> str:
        """The attribute of the parsed arguments that holds the value."""
        return self.dest or self.flag.removeprefix("--").replace("-", "_")

    def add_to(
        self,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        flag: str = "",
        dest: str = "",
        help: str = "",
    ) -> None:
        """Add the option (default ``None``: the suite picks quick or ``--full`` sizes),
        under ``flag``, into ``dest`` and with ``help`` instead of its own if given."""
        parser.add_argument(
            flag or self.flag,
            dest=dest or self.name,
            type=self.type,
            metavar=self.metavar,
            help=help or self.help,
        )


@dataclass(frozen=True)
class Suite:
    """One benchmark suite.

    Attributes:
        name: Subcommand name and key in the results file.
        help: One line for ``--help``.
        run: Measures everything and returns the suite's result; ``args`` holds the common
            options (``full``, ``rounds``) and the suite's own.
        options: The suite's own options.
        check: Why the suite cannot run with ``args`` here (``None``: it can), asked of
            every suite before the first runs, so that ``all`` does not stop at a suite's
            turn after measuring the others (multihost: root).
        rounds: Whether ``--rounds`` means something to it (not to a suite that runs
            each variant for ``--duration`` seconds).
    """

    name: str
    help: str
    run: Callable[[argparse.Namespace, Progress], SuiteResult]
    options: tuple[Option, ...] = field(default=())
    check: Callable[[argparse.Namespace], str | None] = field(default=lambda _: None)
    rounds: bool = True


def positive_seconds(text: str) -> float:
    """An option's value in seconds: a finite number above zero.

    Raises:
        argparse.ArgumentTypeError: It is not.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds above 0, got {text!r}"
        )
    return value


def pick(args: argparse.Namespace, name: str, quick: int, full: int) -> int:
    """The size the user gave for ``name``, else the quick or ``--full`` default."""
    given: int | None = getattr(args, name, None)
    if given is not None:
        if given <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive (got {given})")
        return given
    return full if args.full else quick
