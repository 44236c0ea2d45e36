"""The servers the serve suite measures, each run as ``python -m benchmarks._serve_peer``.

Roles:

``baseline``  one uvicorn process holding an ``actors.Pipeline`` (``OpenAIApp`` over
              ``PipelineEngine``): every request enters and leaves through that one process,
              the shape of ``docs/examples/fastapi_app.py`` with the OpenAI API.
``serve``     ``actors.http.open_server``: the port owned by this process, every worker
              process serving HTTP itself.

Each prints ``ready <port>`` once it serves, then serves until SIGTERM, and then prints one
JSON line: the dispatcher's statistics and its record of which client port went to which
worker incarnation (``serve``), and the workers it killed. With ``--kills N`` a ``serve``
peer, once told ``go`` on stdin, SIGKILLs a worker (in turn) every ``--kill-every`` seconds,
N times, each once the previous one's successor serves.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from ._proc import die_with_parent


class PeerReport(msgspec.Struct, kw_only=True):
    """What a server peer says when it stops.

    Attributes:
        handed: Connections handed to each worker index (serve).
        rehanded: Connections a dying worker had not taken, given to another (serve).
        recent: (client port, worker, incarnation) of every connection handed (serve).
        killed: (worker, incarnation) of every worker it killed.
        restarts_ms: Kill to successor serving, per kill.
    """

    handed: dict[int, int] = {}
    rehanded: int = 0
    recent: list[tuple[int, int, int]] = []
    killed: list[tuple[int, int]] = []
    restarts_ms: list[float] = []


async def _until_sigterm() -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            return


def _ready(port: int) -> None:
    sys.stdout.write(f"ready {port}\n")
    sys.stdout.flush()


async def run_baseline(opts: argparse.Namespace) -> PeerReport:
    import uvicorn

    from actors.http import OpenAIApp, PipelineEngine

    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    # asyncio turns Nagle off only on sockets whose proto says TCP, and create_server's
    # (and so its accepted ones) say 0: without this every streamed chunk after the head
    # waited for the client's delayed ACK, 40 ms to a first token with one client. An
    # accepted socket inherits it (`serve`'s port owner sets it on each connection).
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    port = listener.getsockname()[1]
    async with PipelineEngine.open(workers=opts.workers, step_time=opts.step_time) as engine:
        config = uvicorn.Config(
            OpenAIApp(engine), lifespan="off", log_level="warning", access_log=False
        )
        config.load()
        server = uvicorn.Server(config)
        # uvicorn's own start and stop, without its main loop (which only refreshes the
        # Date header and watches for signals this process handles itself).
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[listener])
        _ready(port)
        await _until_sigterm()
        await server.shutdown(sockets=[listener])
    return PeerReport()


async def run_serve(opts: argparse.Namespace) -> PeerReport:
    from actors.http import open_server

    report = PeerReport()
    async with open_server(
        opts.workers,
        port=0,
        detokenizers=opts.detokenizers,
        step_time=opts.step_time,
    ) as server:
        _ready(server.dispatcher.address[1])
        async with anyio.create_task_group() as tg:
            if opts.kills:
                tg.start_soon(_kill_loop, server, opts, report)
            await _until_sigterm()
            tg.cancel_scope.cancel()
        stats = server.statistics()
        report.handed = stats.handed
        report.rehanded = stats.rehanded
        report.recent = [(p, o.worker, o.incarnation) for p, o in server.dispatcher.recent]
    return report


async def _kill_loop(server: Any, opts: argparse.Namespace, report: PeerReport) -> None:
    await anyio.to_thread.run_sync(sys.stdin.readline)  # the load is running: go
    pipeline = server.pipeline
    for n in range(opts.kills):
        await anyio.sleep(opts.kill_every)  # sync-ok: the pace of the kills under test
        k = n % opts.workers
        t0 = anyio.current_time()
        ref = pipeline.kill_worker(k)
        report.killed.append((k, ref.incarnation))
        await pipeline.wait_worker(k, after=ref.incarnation)
        report.restarts_ms.append((anyio.current_time() - t0) * 1e3)
    await anyio.sleep(opts.kill_every)  # sync-ok: the load goes on past the last restart
    sys.stdout.write("kills done\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Run one server role until SIGTERM; print its report."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._serve_peer")
    parser.add_argument("role", choices=["baseline", "serve"])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--detokenizers", type=int, default=1)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--kills", type=int, default=0)
    parser.add_argument("--kill-every", type=float, default=1.0)
    opts = parser.parse_args(argv)
    die_with_parent()
    run = run_baseline if opts.role == "baseline" else run_serve
    report = anyio.run(run, opts)
    sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
