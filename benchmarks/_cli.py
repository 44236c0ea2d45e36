"""The ``python -m benchmarks`` command line: one subcommand per suite, ``all``, ``plot``."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

import msgspec
import zmq
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
from ._console import PlainProgress, RichProgress, print_summary
from ._proc import BenchmarkError
from ._results import (
    Results,
    check_writable,
    describe_machine,
    now_iso,
    read_results,
    write_results,
)
from ._suite import positive_int

if TYPE_CHECKING:
    from types import FrameType

    from ._results import SuiteResult
    from ._suite import Option, Suite

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


#: The options every suite's command takes, which ``all`` hands to each suite.
COMMON = ("command", "json", "full", "rounds", "check")


class CommandError(Exception):
    """The command cannot do what it was asked (a file it cannot read or write, a suite that
    cannot run here): one line says why."""


def _common(parser: argparse.ArgumentParser, rounds: str = "timed rounds per variant") -> None:
    parser.add_argument("--json", metavar="PATH", help="write every figure and the machine here")
    parser.add_argument(
        "--full",
        action="store_true",
        help="longer runs (default: quick sizes, a minute or two a suite)",
    )
    if rounds:
        parser.add_argument("--rounds", type=positive_int, metavar="N", help=rounds)
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 when a target is missed"
    )


def _meanings() -> dict[str, set[str]]:
    """Each suite option's flag, and the names the suites that have it read it under."""
    meanings: dict[str, set[str]] = {}
    for suite in SUITES.values():
        for option in suite.options:
            meanings.setdefault(option.flag, set()).add(option.name)
    return meanings


def _dest_in_all(suite: Suite, option: Option, meanings: dict[str, set[str]]) -> str:
    """Where ``all`` stores a suite's option: a flag of one meaning once, under the flag,
    for every suite that has it; a flag of several meanings under each suite's name (two
    suites' options of one name, dispatch's ``--workers N`` and serve's ``--workers 1,2,4``,
    never share a place)."""
    if len(meanings[option.flag]) > 1:
        return f"{suite.name}.{option.name}"
    return option.flag


def suite_args(args: argparse.Namespace, suite: Suite) -> argparse.Namespace:
    """The arguments as ``suite`` reads them: under ``all``, the common options and the
    suite's own, each under the name the suite reads, and nothing of the other suites'."""
    if args.command != "all":
        return args
    own = argparse.Namespace(**{k: v for k, v in vars(args).items() if k in COMMON})
    meanings = _meanings()
    for option in suite.options:
        setattr(own, option.name, getattr(args, _dest_in_all(suite, option, meanings)))
    return own


def build_parser() -> argparse.ArgumentParser:
    """The parser: a subcommand per suite, ``all`` with every suite's options, ``plot``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="tokenyard benchmarks: each variant in its own processes, baselines in "
        "the same run, ratios in the report.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for suite in SUITES.values():
        once = "" if suite.rounds else " Each variant runs once, for --duration seconds."
        p = sub.add_parser(suite.name, help=suite.help, description=suite.help + once)
        _common(p, "timed rounds per variant" if suite.rounds else "")
        for option in suite.options:
            option.add_to(p)
    every = sub.add_parser("all", help="run every suite", description="Run every suite.")
    without = [suite.name for suite in SUITES.values() if not suite.rounds]
    _common(every, f"timed rounds per variant (not {' and '.join(without)}: --duration)")
    meanings = _meanings()
    users: dict[str, list[tuple[Suite, Option]]] = {}
    for suite in SUITES.values():
        for option in suite.options:
            users.setdefault(option.flag, []).append((suite, option))
    shared = every.add_argument_group("options of several suites (each of them gets the value)")
    for suite in SUITES.values():
        group = every.add_argument_group(f"{suite.name} options")
        for option in suite.options:
            dest = _dest_in_all(suite, option, meanings)
            if len(meanings[option.flag]) > 1:
                # One flag, two meanings (dispatch's --workers N, pipeline's --workers 1,2,4):
                # in `all`, each suite's is spelled with the suite's name.
                option.add_to(group, f"--{suite.name}-{option.flag.removeprefix('--')}", dest)
            elif len(users[option.flag]) == 1:
                option.add_to(group, dest=dest)
            elif users[option.flag][0][0] is suite:  # one option, said once for every suite
                text = "; ".join(f"{s.name}: {o.help}" for s, o in users[option.flag])
                option.add_to(shared, dest=dest, help=text)
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


def _reason(err: OSError) -> str:
    if isinstance(err, FileExistsError):  # a directory to make is a file
        return f"{err.filename} is a file, not a directory"
    return err.strerror or str(err)


def run_suites(
    names: list[str], args: argparse.Namespace, console: Console, argv: list[str]
) -> int:
    """Run the named suites with a progress display, print the summary, write ``--json``
    (``argv``: the command line it records, without ``python -m benchmarks``).

    Whatever can stop a suite before it measures (a suite's `Suite.check`, an unwritable
    ``--json``) is found before the first suite runs; ``--json`` is written again after
    every suite, so that a later failure or Ctrl-C keeps what was measured.

    Raises:
        CommandError: A suite cannot run here, or ``--json`` cannot be written.
    """
    problems = [
        f"{name}: {problem}"
        for name in names
        if (problem := SUITES[name].check(suite_args(args, SUITES[name])))
    ]
    if (problem := temporary_directory_problem()) is not None:
        problems.append(problem)
    if problems:
        raise CommandError("; ".join(problems))
    if args.json:
        try:
            check_writable(args.json)
        except OSError as err:
            raise CommandError(f"cannot write --json {args.json}: {_reason(err)}") from None
    started = now_iso()
    results: list[SuiteResult] = []
    machine = describe_machine()
    # A live bar on a terminal; in a log or a pipe, where rich draws it only at the end, a
    # line a step.
    display: RichProgress | PlainProgress = (
        RichProgress(console) if console.is_terminal else PlainProgress(console)
    )
    try:
        with display as progress:
            for name in names:
                progress.suite(name)
                results.append(SUITES[name].run(suite_args(args, SUITES[name]), progress))
                progress.done()
                machine = describe_machine()
                if args.json:
                    record = Results(
                        started=started,
                        argv=["python", "-m", "benchmarks", *argv],
                        machine=machine,
                        suites=results,
                    )
                    try:
                        write_results(args.json, record)
                    except OSError as err:
                        raise CommandError(
                            f"cannot write --json {args.json}: {_reason(err)}"
                        ) from None
    except (BenchmarkError, KeyboardInterrupt):
        if args.json and results:
            done = ", ".join(r.suite for r in results)
            console.print(f"{args.json} holds the suites measured before: {done}", markup=False)
        raise
    print_summary(console, machine, results)
    if args.json:
        console.print(f"wrote {args.json}", markup=False)
    missed = [t.name for r in results for t in r.targets if not t.met]
    return 1 if args.check and missed else 0


def plot(args: argparse.Namespace, console: Console) -> int:
    """Draw the charts of ``args.results``.

    Raises:
        CommandError: The file cannot be read or is not a results file, or the charts
            cannot be written.
    """
    from ._plot import default_out, plot_results

    try:
        results = read_results(args.results)
    except OSError as err:
        raise CommandError(f"cannot read {args.results}: {_reason(err)}") from None
    except msgspec.MsgspecError as err:
        raise CommandError(f"{args.results} is not a results file of --json: {err}") from None
    out = args.out or default_out(args.results)
    try:
        paths = plot_results(results, out)
    except OSError as err:
        raise CommandError(f"cannot write the charts into {out}: {_reason(err)}") from None
    for path in paths:
        console.print(f"wrote {path}", markup=False)
    return 0


#: The longest tail a suite puts after the temporary directory in an ipc socket's path: the
#: dispatch suite's control socket, in its private directory (an actor system's directory
#: and socket, under the runtime's own check, are shorter).
IPC_TAIL = len(f"/tokenyard-bench-{'x' * 8}/sglang-{'9' * 20}-ctl")


def temporary_directory_problem() -> str | None:
    """Why the suites' ipc sockets cannot be bound under the temporary directory (``None``:
    they can): their paths are at most ``zmq.IPC_PATH_MAX_LEN`` bytes (107 on Linux)."""
    directory = tempfile.gettempdir()
    longest = len(os.fsencode(directory)) + IPC_TAIL
    limit = zmq.IPC_PATH_MAX_LEN
    if not limit or longest <= limit:
        return None
    return (
        f"the temporary directory {directory!r} is too long for the suites' ipc sockets "
        f"(paths of at most {limit} bytes; theirs would take {longest}): set TMPDIR to a "
        f"directory at least {longest - limit} bytes shorter"
    )


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # What Ctrl-C does: inside asyncio.run or anyio.run, the runner's SIGINT handler cancels
    # the main task, which unwinds every task (a KeyboardInterrupt raised here would end
    # whichever task runs, and asyncio would log "Task exception was never retrieved");
    # elsewhere, Python's own raises KeyboardInterrupt.
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
        return
    # SIGINT ignored (a background job of a script, `nohup`): no runner installed its
    # handler, so unwind all the same. Inside an event loop, from a callback of the loop,
    # not from the task that runs now: it leaves run_forever, and the runner then cancels
    # and awaits every task, where raised in a task it would be that task's exception only.
    interrupt = KeyboardInterrupt(signal.Signals(signum).name)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise interrupt from None
    loop.call_soon_threadsafe(_raise, interrupt)  # wakes a loop waiting in select()


def _raise(error: BaseException) -> None:
    raise error


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
            return plot(args, console)
        names = list(SUITES) if args.command == "all" else [args.command]
        return run_suites(names, args, console, argv)
    except CommandError as err:
        Console(stderr=True, soft_wrap=True).print(f"error: {err}", style="red", markup=False)
        return 2
    except BenchmarkError as err:
        console.print(f"[red]benchmark failed:[/] {err}")
        return 2
    except KeyboardInterrupt:
        # Every process a variant started was killed on the way out (benchmarks._proc).
        console.print("[yellow]interrupted[/]")
        return 130
