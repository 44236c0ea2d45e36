"""``open_server``: the pipeline with every tokenizer worker serving HTTP on one port, and
``python -m actors serve``, its command line.

The process that runs it owns the listening socket (`Dispatcher`) and the pipeline's
supervisor; each worker process serves the OpenAI-compatible API (`HttpWorker`) on the
connections handed to it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from actors._tokenizer import tokenizer_option_error
from actors.pipeline import Pipeline
from runtime._logging import configure_logging

from ._dispatch import Dispatcher, DispatchStatistics

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from ._config import ServeConfig

__all__ = ("Server", "main", "open_server")

logger = logging.getLogger("tokenyard.http")


@dataclass(frozen=True)
class Server:
    """A running server: the pipeline behind it and the port's owner.

    Attributes:
        pipeline: The pipeline (its workers serve the HTTP).
        dispatcher: Who owns the port and hands out the connections.
    """

    pipeline: Pipeline
    dispatcher: Dispatcher

    @property
    def url(self) -> str:
        """The base URL clients use (``http://host:port``)."""
        host, port = self.dispatcher.address
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def statistics(self) -> DispatchStatistics:
        """Connections accepted, and handed to each worker."""
        return self.dispatcher.statistics()


def default_detokenizers(workers: int) -> int:
    """One detokenizer per two workers: with one, the detokenizer became the busiest process
    at 4 workers (the serve benchmark, docs/benchmarks.md)."""
    return max(1, workers // 2)


@contextlib.asynccontextmanager
async def open_server(
    workers: int = 4,
    tokenizer: str | os.PathLike[str] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    detokenizers: int | None = None,
    config: ServeConfig | None = None,
    model: str | None = None,
    context_length: int | None = None,
    **pipeline: Any,
) -> AsyncIterator[Server]:
    """Start the pipeline with its workers serving the OpenAI API on ``host:port``.

    Args:
        workers: Tokenizer workers, each serving HTTP in its own process.
        tokenizer: A ``tokenizer.json`` (None: the bundled one).
        host: The interface to listen on.
        port: The port (0: any free one; `Server.url` says which).
        detokenizers: Detokenizer processes (None: `default_detokenizers`, one per two
            workers).
        config: The HTTP layer's limits.
        model: The model id (None: derived from the tokenizer).
        context_length: Most prompt plus completion tokens of one request.
        **pipeline: Other `actors.Pipeline` arguments (``step_time``, limits, ...).

    Yields:
        The server, once every worker serves.
    """
    dispatcher = Dispatcher(
        host,
        port,
        config=config,
        model=model,
        context_length=context_length,
        max_stream_buffer=pipeline.get("max_stream_buffer", 4 << 20),
    )
    try:
        async with Pipeline(
            workers,
            tokenizer,
            detokenizers=default_detokenizers(workers) if detokenizers is None else detokenizers,
            channels=dispatcher,
            model=model,
            **pipeline,
        ) as p:
            yield Server(p, dispatcher)
    finally:
        dispatcher.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m actors serve",
        description="the OpenAI-compatible server: every tokenizer worker serves HTTP on one port",
    )
    parser.add_argument("--workers", type=int, default=4, help="tokenizer workers (default 4)")
    parser.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--tokenizer", help="a tokenizer.json, or a directory holding one")
    parser.add_argument(
        "--detokenizers", type=int, default=None, help="detokenizers (default: one per two workers)"
    )
    parser.add_argument("--model", help="the model id (default: from the tokenizer)")
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds per step (one token per request) of the stand-in engine. The default, "
        "0, leaves no pause between steps: a whole reply is generated at once, and a streaming "
        "client gets it in one chunk or a few. --step-time 0.02 (20 ms a token) streams "
        "token by token, as a real model does",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="logging level (default WARNING)",
    )
    parser.add_argument(
        "--credentials",
        metavar="PATH",
        help="write the system's credentials here (mode 0600, removed on exit), for "
        "`python -m runtime top --credentials PATH`",
    )
    return parser


async def _serve(args: argparse.Namespace) -> int:
    # Open before the server starts and kept until the end: a signal during the start is
    # acted on once it is up; a second one during the shutdown is ignored, not a crash.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        started = False
        try:
            async with open_server(
                args.workers,
                args.tokenizer,
                host=args.host,
                port=args.port,
                detokenizers=args.detokenizers,
                model=args.model,
                step_time=args.step_time,
            ) as server:
                started = True
                if args.credentials:
                    pipeline = server.pipeline
                    pipeline.system.credentials(collector=pipeline.collector).save(args.credentials)
                sys.stdout.write(
                    f"serving {server.url} with {args.workers} workers and "
                    f"{args.detokenizers} detokenizer(s); Ctrl-C stops\n"
                )
                sys.stdout.flush()
                try:
                    async for signum in signals:
                        return 128 + signum
                finally:
                    if args.credentials:
                        with contextlib.suppress(OSError):
                            os.unlink(args.credentials)
        except OSError as err:
            if started:
                raise
            sys.stderr.write(_cannot_serve(args.host, args.port, err) + "\n")
            return 1
    return 0


def _cannot_serve(host: str, port: int, err: OSError) -> str:
    """The one line that says why the server could not start, and what to change."""
    reason = (err.strerror or str(err)).lower()
    if err.errno == errno.EADDRINUSE:
        hint = " (another server? pick another --port)"
    elif err.errno == errno.EACCES:
        hint = " (a port below 1024 needs privileges: pick another --port)"
    elif err.errno == errno.EADDRNOTAVAIL or isinstance(err, socket.gaierror):
        hint = " (is --host an address of this machine?)"
    else:
        hint = ""
    return f"cannot serve on {host}:{port}: {reason}{hint}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m actors serve``: serve until SIGINT, SIGTERM or SIGHUP (exit 128 + it).

    A problem found before anything starts is one line on standard error: a bad argument
    (exit 2; a ``--tokenizer`` that does not load is one, found before any process starts)
    or a port it cannot listen on (exit 1).
    """
    args = _parser().parse_args(argv)
    if args.detokenizers is None and args.workers >= 1:
        args.detokenizers = default_detokenizers(args.workers)
    if args.workers < 1 or args.detokenizers < 1:
        sys.stderr.write("--workers and --detokenizers must be at least 1\n")
        return 2
    problem = tokenizer_option_error(args.tokenizer)
    if problem is not None:
        sys.stderr.write(problem + "\n")
        return 2
    configure_logging(args.log_level, "serve")
    return anyio.run(_serve, args)
