"""The main job of ``python -m actors`` (``make run``).

It starts the embedded default pipeline (4 tokenizer workers on the bundled tokenizer, the
stand-in engine at zero step time), streams a few generations to the terminal piece by
piece, then runs a closed-loop load with a progress bar and SIGKILLs one worker when a
third of the requests are done. At the end it prints requests/s, p50/p99 latency, how many
requests were resubmitted or failed, and the worker's restart time (kill until its new
incarnation serves).

A request is *lost* when it neither completed nor failed with ``WorkerDiedError`` (any other
error, or no answer before the deadline). The exit status is 0 only when no request was
lost and the killed worker served again; 1 otherwise; 2 for bad arguments; 128 + the
signal's number after SIGINT, SIGTERM or SIGHUP, which stop the job cleanly.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

try:
    from rich.console import Console
    from rich.logging import RichHandler
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Table
except ImportError as err:  # the `bench` extra; `make run` installs it
    raise SystemExit(
        f"python -m actors needs rich ({err}); install it with: pip install 'tokenyard[bench]'"
    ) from err

from . import Pipeline, WorkerDiedError
from ._tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

STREAM_PROMPTS = (
    "Tell me about the harbour of Yokohama 🚢",
    "你好，请介绍一下你自己。",  # noqa: RUF001 (CJK punctuation is the point)
    "Bonjour à tous 😀, quoi de neuf ?",
)
LOAD_PROMPTS = (
    "Hello there",
    "Explain continuous batching in one short paragraph, please.",
    "東京の天気は晴れです。明日は雨が降るでしょう。",
    "Bonjour à tous 😀 — ça va ?",
    "🇯🇵🎉👍🏽 emoji soup 🍜🍣🍱",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "안녕하세요, 만나서 반갑습니다.",
    "Привет, мир! Как дела?",
)
#: Alternating styles make the piece boundaries of a stream visible.
PIECE_STYLES = ("bold green", "green")
#: Seconds a killed worker has to serve again before the job calls it a failure.
RESTART_TIMEOUT = 60.0
#: Seconds one streamed generation may take.
STREAM_TIMEOUT = 60.0
#: Reasons of lost requests printed at the end.
MAX_ERRORS_SHOWN = 5


@dataclass
class LoadReport:
    """What happened to the requests of one load.

    Attributes:
        requests: Requests sent.
        latencies: Seconds from submit to result of each completed request.
        died: Requests that failed with ``WorkerDiedError``.
        lost: Requests that neither completed nor failed with ``WorkerDiedError``.
        errors: What happened to the first lost requests.
        elapsed: Seconds from the first request to the last answer.
        killed: Which worker was killed, and when; ``""`` if none was.
        restart_s: Seconds from the kill until the worker's new incarnation served.
        restart_error: Why there is no restart time, when a kill was asked for.
    """

    requests: int
    latencies: list[float] = field(default_factory=list)
    died: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    killed: str = ""
    restart_s: float | None = None
    restart_error: str = ""

    @property
    def completed(self) -> int:
        """Requests that returned a result."""
        return len(self.latencies)

    def lose(self, count: int, why: str) -> None:
        """Count ``count`` lost requests; keep the first few reasons."""
        self.lost += count
        if len(self.errors) < MAX_ERRORS_SHOWN:
            self.errors.append(why)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0 < q <= 1) of ``values``: the smallest value with at
    least ``q * n`` of the ``n`` values at or below it (p99 of 1..100 is 99); NaN when there
    are none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def load_prompt(i: int) -> tuple[str, int]:
    """Request ``i``'s prompt and ``max_new_tokens`` (16..32), deterministic."""
    return LOAD_PROMPTS[i % len(LOAD_PROMPTS)], 16 + (i * 7) % 17


async def stream_demo(p: Pipeline, console: Console, max_new_tokens: int) -> list[str]:
    """Stream each demo prompt's generation to the terminal as its pieces arrive.

    Returns:
        What went wrong, one line per failed stream (empty when all went well).
    """
    errors: list[str] = []
    console.rule("[bold]streaming")
    console.print(
        "[dim]The stand-in engine draws its tokens, so the text is noise; the colour "
        "alternates with each streamed piece.[/]"
    )
    for prompt in STREAM_PROMPTS:
        console.print(f"[bold cyan]>[/] {escape(prompt)}")
        pieces = 0
        t0 = time.perf_counter()
        try:
            with anyio.fail_after(STREAM_TIMEOUT):
                async for piece in p.stream(prompt, max_new_tokens=max_new_tokens):
                    console.print(
                        piece,
                        style=PIECE_STYLES[pieces % 2],
                        end="",
                        markup=False,
                        highlight=False,
                        soft_wrap=True,
                    )
                    pieces += 1
        # A stream that fails is a lost request like any other: count it and go on.
        except Exception as err:  # noqa: BLE001
            errors.append(f"stream of {prompt!r}: {type(err).__name__}: {err}")
        ms = (time.perf_counter() - t0) * 1000
        console.print(f"\n[dim]  {pieces} pieces in {ms:.0f} ms[/]")
    return errors


async def run_load(
    p: Pipeline,
    console: Console,
    *,
    requests: int,
    concurrency: int,
    kill: int | None,
    deadline: float,
) -> LoadReport:
    """Send ``requests`` from ``concurrency`` closed-loop clients; SIGKILL worker ``kill``
    once a third are answered, and time its restart."""
    report = LoadReport(requests=requests)
    indices = iter(range(requests))
    kill_at = max(1, requests // 3)
    killed = anyio.Event()  # set at the kill, or when it could not be done
    answered = 0
    t0 = time.perf_counter()
    last = t0
    incarnation = 0
    t_kill = 0.0

    bar = Progress(
        SpinnerColumn(),
        TextColumn("[bold]load[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>6,.0f} req/s"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
    )
    task = bar.add_task("", total=requests, rate=0.0)

    def kill_now(k: int) -> None:
        nonlocal incarnation, t_kill
        try:
            ref = p.kill_worker(k)
        except LookupError as err:
            report.restart_error = f"could not kill worker {k}: {err}"
        else:
            t_kill = time.perf_counter()
            incarnation = ref.incarnation
            report.killed = (
                f"worker {k} (incarnation {incarnation}) after {answered:,} of {requests:,}"
            )
            bar.update(task, description=f"[yellow]SIGKILLed worker {k}[/]")
        killed.set()

    async def client() -> None:
        nonlocal answered, last
        for i in indices:
            text, budget = load_prompt(i)
            t = time.perf_counter()
            try:
                result = await p.generate(text, max_new_tokens=budget)
            except WorkerDiedError:
                report.died += 1
            # Anything else loses the request: count it, and keep the load going.
            except Exception as err:  # noqa: BLE001
                report.lose(1, f"request {i}: {type(err).__name__}: {err}")
            else:
                if result.finish_reason in ("length", "stop"):
                    report.latencies.append(time.perf_counter() - t)
                else:
                    report.lose(1, f"request {i} finished with {result.finish_reason!r}")
            answered += 1
            last = time.perf_counter()
            bar.update(task, advance=1, rate=answered / (last - t0))
            if kill is not None and answered == kill_at:
                kill_now(kill)

    async def watch_restart(k: int) -> None:
        await killed.wait()
        if report.restart_error:
            return
        try:
            await p.wait_worker(k, after=incarnation, timeout=RESTART_TIMEOUT)
        except TimeoutError:
            report.restart_error = (
                f"worker {k} did not serve again within {RESTART_TIMEOUT:g} s of its kill"
            )
            return
        report.restart_s = time.perf_counter() - t_kill
        bar.update(
            task,
            description=f"[green]worker {k} back after {report.restart_s:.2f} s[/]",
        )

    with bar, anyio.move_on_after(deadline) as scope:
        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, requests)):
                tg.start_soon(client)
            if kill is not None:
                tg.start_soon(watch_restart, kill)
    report.elapsed = last - t0
    if scope.cancelled_caught:
        unanswered = requests - answered
        if unanswered:
            report.lose(unanswered, f"{unanswered} requests unanswered after {deadline:g} s")
    if kill is not None and report.restart_s is None and not report.restart_error:
        report.restart_error = f"worker {kill} had not served again after {deadline:g} s"
    return report


def summary(report: LoadReport, p: Pipeline) -> Table:
    """The figures of a load, one per row."""
    table = Table(title="load", title_justify="left", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rate = report.completed / report.elapsed if report.elapsed > 0 else 0.0
    restart = (
        f"{report.restart_s:.2f} s"
        if report.restart_s is not None
        else (report.restart_error or "no worker killed")
    )
    rows = (
        ("requests", f"{report.requests:,}"),
        ("completed", f"{report.completed:,}"),
        ("requests/s", f"{rate:,.0f}"),
        ("latency p50", f"{percentile(report.latencies, 0.50) * 1000:.1f} ms"),
        ("latency p99", f"{percentile(report.latencies, 0.99) * 1000:.1f} ms"),
        ("resubmitted", f"{p.resubmitted:,}"),
        ("failed (WorkerDiedError)", f"{report.died:,}"),
        ("lost", f"{report.lost:,}"),
        ("killed", report.killed or "none"),
        ("restart time", restart),
    )
    for name, value in rows:
        table.add_row(name, value)
    return table


class Interrupt:
    """A stop signal's number, and the scope it cancels (the job's, inside the pipeline)."""

    def __init__(self) -> None:
        self.signum = 0
        self.scope: anyio.CancelScope | None = None

    def stop(self, signum: int) -> None:
        """Stop the job now if it runs, else as soon as its pipeline is up."""
        self.signum = signum
        if self.scope is not None:
            self.scope.cancel()


async def main_job(args: argparse.Namespace, console: Console) -> int:
    """`run_job`, stopped cleanly (pipeline processes and sockets gone) on SIGINT, SIGTERM
    or SIGHUP.

    A signal cancels only the job *inside* the pipeline's ``async with``: the pipeline must
    not be closed from within a cancelled scope (see ``run_job``).
    """
    interrupt = Interrupt()

    async def watch(signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            console.print(f"[yellow]{signal.Signals(signum).name}: stopping[/]")
            interrupt.stop(signum)

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, signals)
            status = await run_job(args, console, interrupt)
            tg.cancel_scope.cancel()
    return status


async def run_job(args: argparse.Namespace, console: Console, interrupt: Interrupt) -> int:
    """Start the pipeline, stream, load, report; the exit status."""
    name = args.tokenizer or f"{DEFAULT_TOKENIZER_PATH.name} (bundled)"
    console.print(f"[bold]tokenyard[/] pipeline: {args.workers} tokenizer workers, {name}")
    t0 = time.perf_counter()
    async with Pipeline(workers=args.workers, tokenizer=args.tokenizer, step_time=0.0) as p:
        console.print(f"[dim]every worker serves after {time.perf_counter() - t0:.2f} s[/]")
        # Cancelling a scope around `async with Pipeline` would leave its shutdown waiting
        # for children whose watchers were cancelled too; this scope ends inside it.
        with anyio.CancelScope() as interrupt.scope:
            if interrupt.signum:
                interrupt.scope.cancel()
            status = await load_and_report(args, console, p)
        interrupt.scope = None
    if interrupt.signum:
        console.print("[yellow]interrupted[/]")
        return 128 + interrupt.signum
    return status


async def load_and_report(args: argparse.Namespace, console: Console, p: Pipeline) -> int:
    """Stream, run the load, print the figures; the exit status."""
    stream_errors = await stream_demo(p, console, args.max_new_tokens)
    console.rule("[bold]load")
    kill = None if args.no_kill else args.workers - 1
    console.print(
        f"{args.requests:,} requests from {args.concurrency} clients"
        + ("" if kill is None else f"; worker {kill} is SIGKILLed a third of the way in")
    )
    report = await run_load(
        p,
        console,
        requests=args.requests,
        concurrency=args.concurrency,
        kill=kill,
        deadline=args.deadline,
    )
    for error in stream_errors:
        report.lose(1, error)
    console.print(summary(report, p))
    failures = list(report.errors)
    if report.restart_error:
        failures.append(report.restart_error)
    if report.lost == 0 and not report.restart_error:
        console.print(
            f"[bold green]no request lost[/]: {report.completed:,} completed, "
            f"{p.resubmitted:,} resubmitted, {report.died:,} failed with WorkerDiedError"
        )
        return 0
    if report.lost:
        console.print(f"[bold red]{report.lost:,} requests lost[/]")
    else:
        console.print("[bold red]no request lost, but the killed worker did not come back[/]")
    for failure in failures:
        console.print(f"[red]- {escape(failure)}[/]")
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m actors``."""
    parser = argparse.ArgumentParser(
        prog="python -m actors",
        description="Run the tokenyard pipeline: stream a few generations, then a load with "
        "one worker killed midway; exit 0 only if no request was lost.",
    )
    parser.add_argument("--workers", type=int, default=4, help="tokenizer workers (4)")
    parser.add_argument("--requests", type=int, default=2_000, help="requests in the load (2000)")
    parser.add_argument(
        "--concurrency", type=int, default=64, help="closed-loop clients of the load (64)"
    )
    parser.add_argument("--no-kill", action="store_true", help="do not kill a worker")
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="a tokenizer.json (default: the bundled one)"
    )
    parser.add_argument(
        "--stream-tokens",
        dest="max_new_tokens",
        type=int,
        default=48,
        metavar="N",
        help="max_new_tokens of each streamed generation (48)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="requests unanswered this long after the load started are lost (120)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m actors``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("workers", "requests", "concurrency", "max_new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.deadline <= 0:
        parser.error("--deadline must be positive")
    console = Console(width=None if sys.stdout.isatty() else 100)
    logging.basicConfig(
        level=logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    try:
        load_tokenizer(args.tokenizer)  # fail here, clearly, rather than in every worker
    except (OSError, ValueError) as err:
        console.print(f"[red]bad --tokenizer:[/] {escape(str(err))}", soft_wrap=True)
        return 2
    try:
        return anyio.run(main_job, args, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
