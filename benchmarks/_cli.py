"""The ``python -m benchmarks`` command line: one subcommand per suite, ``all``, ``plot``."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

from rich.console import Console

from . import (
    detokenize,
    dispatch,
    engines,
    mailbox,
    multihost,
    pipeline,
    profile,
    serve,
    spawn,
    supervision,
)
from ._console import RichProgress, print_summary
from ._proc import BenchmarkError
from ._results import Results, describe_machine, now_iso, read_results, write_results

if TYPE_CHECKING:
    from types import FrameType

    from ._results import SuiteResult
    from ._suite import Suite

#: Every suite, in the order ``all`` runs them. A new suite is a module with a ``SUITE``
#: and one line here.
SUITES: dict[str, Suite] = {
    suite.name: suite
    for suite in (
        mailbox.SUITE,
        profile.SUITE,
        dispatch.SUITE,
        detokenize.SUITE,
        pipeline.SUITE,
        serve.SUITE,
        engines.SUITE,
        supervision.SUITE,
        spawn.SUITE,
        multihost.SUITE,
    )
}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write every figure and the machine here")
    parser.add_argument(
        "--full", action="store_true", help="longer runs (default: quick, under a minute a suite)"
    )
    parser.add_argument("--rounds", type=int, metavar="N", help="timed rounds per variant")
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 when a target is missed"
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser: a subcommand per suite, ``all`` with every suite's options, ``plot``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="tokenyard benchmarks: each variant in its own processes, baselines in "
        "the same run, ratios in the report.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for suite in SUITES.values():
        p = sub.add_parser(suite.name, help=suite.help, description=suite.help)
        _common(p)
        for option in suite.options:
            option.add_to(p)
    every = sub.add_parser("all", help="run every suite", description="Run every suite.")
    _common(every)
    meanings: dict[str, set[str]] = {}
    for suite in SUITES.values():
        for option in suite.options:
            meanings.setdefault(option.flag, set()).add(option.name)
    added: set[str] = set()
    for suite in SUITES.values():
        group = every.add_argument_group(f"{suite.name} options")
        for option in suite.options:
            if len(meanings[option.flag]) > 1:
                # One flag, two meanings (dispatch's --workers N, pipeline's --workers 1,2,4):
                # in `all`, each suite's is spelled with the suite's name.
                option.add_to(group, f"--{suite.name}-{option.flag.removeprefix('--')}")
            elif option.flag not in added:  # a flag shared by two suites is one option
                added.add(option.flag)
                option.add_to(group)
    plot = sub.add_parser(
        "plot",
        help="draw PNG charts from a --json results file",
        description="Draw every chart the suites in a results file describe, one PNG each.",
    )
    plot.add_argument("results", help="a file written by --json")
    plot.add_argument(
        "--out",
        metavar="DIR",
        help="directory for the PNGs (default: <name>-charts/ next to the results file, "
        "e.g. bench-results/results-charts/ for bench-results/results.json)",
    )
    return parser


def run_suites(
    names: list[str], args: argparse.Namespace, console: Console, argv: list[str]
) -> int:
    """Run the named suites with a progress bar, print the summary, write ``--json``
    (``argv``: the command line it records, without ``python -m benchmarks``)."""
    if args.rounds is not None and args.rounds <= 0:
        raise SystemExit(f"--rounds must be positive (got {args.rounds})")
    started = now_iso()
    results: list[SuiteResult] = []
    with RichProgress(console) as progress:
        for name in names:
            progress.suite(name)
            results.append(SUITES[name].run(args, progress))
            progress.done()
    machine = describe_machine()
    print_summary(console, machine, results)
    if args.json:
        write_results(
            args.json,
            Results(
                started=started,
                argv=["python", "-m", "benchmarks", *argv],
                machine=machine,
                suites=results,
            ),
        )
        console.print(f"wrote {args.json}")
    missed = [t.name for r in results for t in r.targets if not t.met]
    return 1 if args.check and missed else 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # What Ctrl-C does: inside asyncio.run or anyio.run, the runner's SIGINT handler cancels
    # the main task, which unwinds every task (a KeyboardInterrupt raised here would end
    # whichever task runs, and asyncio would log "Task exception was never retrieved");
    # elsewhere, Python's own raises KeyboardInterrupt.
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIGINT ignored (a background job of a script): unwind all the same
        raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks``."""
    if argv is None:
        argv = sys.argv[1:]
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every `finally` runs: the processes of the variant
    # running are killed and the private socket directory is removed.
    signal.signal(signal.SIGTERM, _interrupt)
    # Piped output (make bench, CI logs) gets a table wide enough not to wrap every row.
    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        if args.command == "plot":
            from ._plot import default_out, plot_results

            out = args.out or default_out(args.results)
            for path in plot_results(read_results(args.results), out):
                console.print(f"wrote {path}")
            return 0
        names = list(SUITES) if args.command == "all" else [args.command]
        return run_suites(names, args, console, argv)
    except BenchmarkError as err:
        console.print(f"[red]benchmark failed:[/] {err}")
        return 2
    except KeyboardInterrupt:
        # Every process a variant started was killed on the way out (benchmarks._proc).
        console.print("[yellow]interrupted[/]")
        return 130
