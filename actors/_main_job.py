"""The main job of ``python -m actors`` (``make run``): the server, used as its clients use it.

It starts ``serve``'s shape on the bundled tokenizer (4 tokenizer workers, each serving the
OpenAI API on one port) in front of a real engine: llama.cpp, on a tiny model it writes
first with the tokenizer's vocabulary and *random weights* (``--model`` names another;
``--engine stand-in`` takes the zero-cost stand-in instead). It streams a few chat
completions to the terminal piece by piece over HTTP, then drives a closed-loop streaming
load through real HTTP (keep-alive clients, and clients opening a new connection for every
request) with a progress bar, and SIGKILLs one worker a third of the way in. At the end it prints
requests/s, TTFT, inter-token and end-to-end latency percentiles, the requests each worker
served, the worker's restart time, how many requests failed and how many *waiting
connections were lost*.

A failed request is allowed only when it was in flight on the killed worker: on a connection
that worker incarnation had taken (the server records which client port went to which
worker). Any other failure, and any refused connection, is a lost waiting connection. The
exit status is 0 only when none was lost and the killed worker served again; 1 otherwise; 2
for bad arguments; 128 + the signal's number after SIGINT, SIGTERM or SIGHUP.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
        " (python -m actors serve, the server, needs only the serve extra)"
    ) from err

from runtime import SpawnError, configure_logging

from ._stop_signals import open_stop_signals
from ._tokenizer import DEFAULT_TOKENIZER_PATH, tokenizer_option_error

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from .http import Server
    from .http.load import RequestRecord

CHAT_PROMPTS = (
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
#: Clients opening a new connection for every request, beside the keep-alive ones: new
#: connections keep arriving while the worker dies and comes back.
FRESH_CLIENTS = 4
#: Requests of the load, by engine: the stand-in costs nothing, llama.cpp computes.
DEFAULT_REQUESTS = {"llamacpp": 600, "stand-in": 2_000}
#: Tokens each request of the load asks for.
LOAD_TOKENS = 24
#: llama.cpp's slots (requests generated together) and compute threads: one thread, so
#: that the front end keeps a core of this 2-core-sized job.
LLAMACPP_SLOTS = 16
LLAMACPP_THREADS = 1


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0 < q <= 1) of ``values``: the smallest value with at
    least ``q * n`` of the ``n`` values at or below it (p99 of 1..100 is 99); NaN when there
    are none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class LoadReport:
    """What happened to the requests of one load.

    Attributes:
        records: Every request's record.
        elapsed: Seconds from the first request to the last answer.
        killed: The worker killed, and its incarnation (``None``: no kill).
        restart_s: Seconds from the kill until its successor served.
        restart_error: Why there is no restart time, when a kill was asked for.
        lost: The requests that failed other than in flight on the killed worker.
    """

    records: list[RequestRecord] = field(default_factory=list)
    elapsed: float = 0.0
    killed: tuple[int, int] | None = None
    restart_s: float | None = None
    restart_error: str = ""
    lost: list[RequestRecord] = field(default_factory=list)

    @property
    def ok(self) -> list[RequestRecord]:
        """The requests that streamed to the end."""
        return [r for r in self.records if r.ok]

    @property
    def failed(self) -> int:
        """Requests that failed in flight on the killed worker (allowed)."""
        return sum(not r.ok for r in self.records) - len(self.lost)


#: Why the streamed text means nothing, by engine.
NOISE = {
    "llamacpp": "The model's weights are random, so the text is noise",
    "stand-in": "The stand-in engine draws its tokens at random, so the text is noise",
}


async def stream_chats(server: Server, console: Console, max_tokens: int, engine: str) -> list[str]:
    """Stream each chat prompt's completion to the terminal as its chunks arrive.

    Returns:
        What went wrong, one line per failed stream (empty when all went well).
    """
    from .http.load import stream_chat

    errors: list[str] = []
    console.rule("[bold]streaming chat completions over HTTP")
    console.print(f"[dim]{NOISE[engine]}; the colour changes at every chunk the server sent.[/]")
    for prompt in CHAT_PROMPTS:
        console.print(f"[bold cyan]user>[/] {escape(prompt)}")
        console.print("[bold magenta]assistant>[/] ", end="")
        n = 0
        try:
            with anyio.fail_after(60):
                async for piece in stream_chat(server.url, prompt, max_tokens):
                    console.print(escape(piece), style=PIECE_STYLES[n % 2], end="")
                    n += 1
        except (OSError, TimeoutError, ValueError) as err:
            errors.append(f"streaming {prompt!r} failed: {err}")
        console.print(f"\n[dim]({n} chunks)[/]")
    return errors


async def run_load(
    server: Server,
    console: Console,
    *,
    requests: int,
    concurrency: int,
    kill: int | None,
) -> LoadReport:
    """The load, with a progress bar, and worker ``kill`` SIGKILLed a third of the way in."""
    from .http.load import LoadSpec
    from .http.load import run_load as load

    report = LoadReport()
    done = asyncio.Event()
    third = anyio.Event()
    fresh_share = max(requests // 8, 1)
    keep = LoadSpec(
        url=server.url,
        concurrency=concurrency,
        requests=requests - fresh_share,
        max_tokens=LOAD_TOKENS,
        prompts=LOAD_PROMPTS,
    )
    fresh = LoadSpec(
        url=server.url,
        concurrency=FRESH_CLIENTS,
        requests=fresh_share,
        max_tokens=LOAD_TOKENS,
        prompts=LOAD_PROMPTS,
        keepalive=False,
    )
    columns = (
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    t0 = time.perf_counter()
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("streaming requests", total=requests)

        def on_record(record: RequestRecord) -> None:
            report.records.append(record)
            progress.advance(task)
            if len(report.records) >= requests // 3:
                third.set()
            if len(report.records) >= requests:
                done.set()

        async def killer(k: int) -> None:
            await third.wait()
            pipeline = server.pipeline
            ref = pipeline.kill_worker(k)
            report.killed = (k, ref.incarnation)
            killed_at = time.perf_counter()
            progress.update(task, description=f"worker {k} SIGKILLed; streaming requests")
            try:
                with anyio.fail_after(RESTART_TIMEOUT):
                    await pipeline.wait_worker(k, after=ref.incarnation)
            except TimeoutError:
                report.restart_error = (
                    f"worker {k} did not serve again within {RESTART_TIMEOUT:g} s"
                )
                return
            report.restart_s = time.perf_counter() - killed_at
            progress.update(task, description=f"worker {k} back; streaming requests")

        async with anyio.create_task_group() as tg:
            if kill is not None:
                tg.start_soon(killer, kill)
            async with anyio.create_task_group() as loads:
                loads.start_soon(load, keep, None, on_record)
                loads.start_soon(load, fresh, None, on_record)
            third.set()  # the load may have ended early: let a pending kill go
    report.elapsed = time.perf_counter() - t0
    if report.killed is not None:
        on_killed = {
            port
            for port, origin in server.dispatcher.recent
            if (origin.worker, origin.incarnation) == report.killed
        }
    else:
        on_killed = set()
    report.lost = [
        r
        for r in report.records
        if not r.ok and (r.error == "refused" or r.local_port not in on_killed)
    ]
    return report


def summary(report: LoadReport, server: Server, workers: int) -> Table:
    """The figures of one load, as a table."""
    ok = report.ok
    table = Table(title="load over HTTP", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rps = len(ok) / report.elapsed if report.elapsed else float("nan")
    table.add_row("requests/s", f"{rps:,.0f}")
    series = {
        "TTFT": [r.ttft * 1e3 for r in ok if r.ttft is not None],
        "inter-token": [g * 1e3 for r in ok for g in r.itl],
        "end-to-end": [r.e2e * 1e3 for r in ok],
    }
    for name, values in series.items():
        for q in (0.5, 0.99):
            table.add_row(f"{name} p{round(q * 100)}", f"{percentile(values, q):.1f} ms")
    served = Counter(r.worker for r in ok if r.worker is not None)
    table.add_row(
        "served per worker", ", ".join(f"{k}: {served.get(k, 0):,}" for k in range(workers))
    )
    table.add_row("completed", f"{len(ok):,}")
    table.add_row("failed in flight on the killed worker", f"{report.failed:,}")
    table.add_row("lost waiting connections", f"{len(report.lost):,}")
    stats = server.statistics()
    table.add_row("connections accepted", f"{stats.accepted:,}")
    table.add_row("given to another worker after a death", f"{stats.rehanded:,}")
    if report.killed is not None:
        table.add_row("killed", f"worker {report.killed[0]} (incarnation {report.killed[1]})")
    if report.restart_s is not None:
        table.add_row("restart time", f"{report.restart_s:.2f} s")
    return table


def engine_options(
    args: argparse.Namespace, console: Console, scratch: ExitStack
) -> dict[str, Any]:
    """`actors.http.open_server`'s engine arguments for ``args`` (and ``args.tokenizer`` set
    to the model's): with llama.cpp and no ``--model``, the tiny random-weight model is
    written first, into a directory ``scratch`` removes."""
    if args.engine == "stand-in":
        return {}
    from .engines import LlamaCpp

    if args.model is None:
        from ._gguf import write_model_dir

        directory = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="tokenyard-")))
        t0 = time.perf_counter()
        tokenizer = None if args.tokenizer is None else Path(args.tokenizer)
        args.model = str(write_model_dir(directory, tokenizer=tokenizer))
        args.tokenizer = str(directory)
        console.print(
            f"[dim]wrote a tiny llama.cpp model with the tokenizer's vocabulary and "
            f"[bold]random weights[/bold] in {time.perf_counter() - t0:.2f} s[/]"
        )
    spec = LlamaCpp(model=args.model, n_parallel=LLAMACPP_SLOTS, threads=LLAMACPP_THREADS)
    return {"engine": spec, "context_length": spec.context_length}


async def run_job(args: argparse.Namespace, console: Console) -> int:
    """Start the server, stream, load, report; the exit status."""
    with ExitStack() as scratch:
        engine = engine_options(args, console, scratch)
        name = args.tokenizer or f"{DEFAULT_TOKENIZER_PATH.name} (bundled)"
        what = "the stand-in engine" if args.engine == "stand-in" else f"llama.cpp ({args.model})"
        console.print(
            f"[bold]tokenyard[/] serve: {args.workers} tokenizer workers serving HTTP, {name}; "
            f"{what}"
        )
        return await serve_and_load(args, console, engine)


async def serve_and_load(args: argparse.Namespace, console: Console, engine: dict[str, Any]) -> int:
    """The job proper, on a server started with the ``engine`` arguments."""
    from .http import open_server
    from .http._serve import cannot_serve, first_failure

    t0 = time.perf_counter()
    async with AsyncExitStack() as stack:
        # What stops the server from starting is one line, as `serve` says it, not the
        # traceback of a task group: a port in use, a model llama.cpp does not load.
        try:
            server = await stack.enter_async_context(
                open_server(args.workers, args.tokenizer, port=args.port, **engine)
            )
        except OSError as err:
            console.print(f"[red]{escape(cannot_serve('127.0.0.1', args.port, err))}[/]")
            return 1
        except SpawnError as err:
            console.print(f"[red]the pipeline did not start: {escape(first_failure(err))}[/]")
            return 1
        console.print(
            f"[dim]{server.url}: every worker serves after {time.perf_counter() - t0:.2f} s[/]"
        )
        errors = await stream_chats(server, console, args.max_tokens, args.engine)
        console.rule("[bold]load")
        kill = None if args.no_kill else args.workers - 1
        console.print(
            f"{args.requests:,} streaming requests from {args.concurrency} keep-alive and "
            f"{FRESH_CLIENTS} new-connection clients"
            + ("" if kill is None else f"; worker {kill} is SIGKILLed a third of the way in")
        )
        report = await run_load(
            server, console, requests=args.requests, concurrency=args.concurrency, kill=kill
        )
        console.print(summary(report, server, args.workers))
    problems = list(errors)
    problems += [f"request on port {r.local_port} failed: {r.error}" for r in report.lost[:5]]
    if report.restart_error:
        problems.append(report.restart_error)
    if not problems:
        console.print(
            f"[bold green]no waiting connection lost[/]: {len(report.ok):,} completed, "
            f"{report.failed:,} failed in flight on the killed worker"
        )
        return 0
    console.print(f"[bold red]{len(report.lost):,} waiting connections lost[/]")
    for problem in problems:
        console.print(f"[red]- {escape(problem)}[/]")
    return 1


async def main_job(args: argparse.Namespace, console: Console) -> int:
    """`run_job`, stopped cleanly (every process and socket gone) on SIGINT, SIGTERM or
    SIGHUP: a signal cancels the job inside the server's ``async with``."""
    received: list[int] = []

    async def watch(signals: AsyncIterator[int], scope: anyio.CancelScope) -> None:
        async for signum in signals:
            console.print(f"[yellow]{signal.Signals(signum).name}: stopping[/]")
            received.append(signum)
            scope.cancel()

    status = 1
    # A signal held since `python -m actors` began to import arrives first.
    with open_stop_signals() as signals:
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as job:
                tg.start_soon(watch, signals, job)
                status = await run_job(args, console)
            tg.cancel_scope.cancel()
    if received:
        console.print("[yellow]interrupted[/]")
        return 128 + received[0]
    return status


USAGE = """python -m actors [options]          the main job (what `make run` runs)
       python -m actors serve [options]    the OpenAI-compatible server
       python -m actors load --url URL     a streaming load against a server
       python -m actors make-model DIR     the tiny llama.cpp test model
       python -m actors make-hf-model DIR  the tiny vLLM test model"""

COMMANDS = """\
commands:
  python -m actors        start the server on the bundled tokenizer and llama.cpp (a tiny
                          model with random weights, written at start), stream a few chat
                          completions over HTTP, then a streaming load with one worker
                          killed midway; exit 0 only if no waiting connection was lost
                          (python -m actors --help: its options, below)
  python -m actors serve  serve the OpenAI-compatible API on one port until Ctrl-C
                          (python -m actors serve --help: its options)
  python -m actors load --url URL
                          closed-loop streaming clients against a server, and what they
                          measured (python -m actors load --help)
  python -m actors make-model DIR
                          write a random-weight llama.cpp model and its tokenizer into DIR
                          (the llamacpp extra; python -m actors make-model --help)
  python -m actors make-hf-model DIR
                          write a weightless Hugging Face model directory vLLM loads with
                          --load-format dummy (python -m actors make-hf-model --help)"""


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m actors``."""
    parser = argparse.ArgumentParser(
        prog="python -m actors",
        usage=USAGE,
        description=COMMANDS,
        epilog="The options above are the main job's; python -m actors serve --help lists "
        "the server's.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=4, help="tokenizer workers (4)")
    parser.add_argument(
        "--engine",
        choices=("llamacpp", "stand-in"),
        default="llamacpp",
        help="what generates: llama.cpp on a real (tiny, random-weight) model, or the "
        "zero-cost stand-in for front-end figures (llamacpp)",
    )
    parser.add_argument(
        "--model",
        metavar="GGUF",
        help="llama.cpp's model: a GGUF whose vocabulary is the tokenizer's (default: a tiny "
        "random-weight one written from the tokenizer at start)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        help="requests in the load (600 on llama.cpp, 2000 on the stand-in)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=32, help="keep-alive clients of the load (32)"
    )
    parser.add_argument("--port", type=int, default=0, help="port (0: any free one)")
    parser.add_argument("--no-kill", action="store_true", help="do not kill a worker")
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="a tokenizer.json (default: the bundled one)"
    )
    parser.add_argument(
        "--stream-tokens",
        dest="max_tokens",
        type=int,
        default=48,
        metavar="N",
        help="max_tokens of each streamed chat completion (48)",
    )
    return parser


def log_handler(console: Console) -> logging.Handler:
    """Where the main job's own log lines go: printed by its console (so that they do not
    tear the progress bar), in the format of every process of the system (the handler adds
    no time or level of its own)."""
    return RichHandler(console=console, show_time=False, show_level=False, show_path=False)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m actors``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = DEFAULT_REQUESTS[args.engine]
    if args.model is not None and args.engine != "llamacpp":
        parser.error("--model is llama.cpp's: leave it out with --engine stand-in")
    if args.model is not None and not Path(args.model).is_file():
        parser.error(f"--model {args.model}: no such file (a GGUF)")
    from .http._serve import check_fd_limit, check_gguf, check_port, default_detokenizers

    problem = check_port(args.port) or (
        None if args.model is None else check_gguf(Path(args.model))
    )
    if problem is not None:
        parser.error(problem)
    for flag, dest in (
        ("--workers", "workers"),
        ("--requests", "requests"),
        ("--concurrency", "concurrency"),
        ("--stream-tokens", "max_tokens"),
    ):
        if getattr(args, dest) < 1:
            parser.error(f"{flag} must be at least 1")
    console = Console(width=None if sys.stdout.isatty() else 100)
    configure_logging(logging.WARNING, "main job", handler=log_handler(console))
    problem = tokenizer_option_error(args.tokenizer)  # here, clearly, not in every worker
    if problem is not None:
        console.print(f"[red]{escape(problem)}[/]", soft_wrap=True)
        return 2
    # Before anything starts: below it, libzmq aborts this process during the start.
    short = check_fd_limit(
        args.workers,
        default_detokenizers(args.workers),
        clients=args.concurrency + FRESH_CLIENTS,
        fewer="ask for fewer --workers or a lower --concurrency",
    )
    if short is not None:  # the environment's fault, not an option's: as a busy port
        console.print(f"[red]{escape(short)}[/]", soft_wrap=True)
        return 1
    try:
        return anyio.run(main_job, args, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
