"""``python -m benchmarks._slowloris --port P --connections N``: hold N slow connections
against a server while the serve suite measures its normal clients.

Each connection sends the start of a request and then one more header byte every
``--every`` seconds, never ending its headers (the slowloris attack); one the server closes
(its header timeout) is opened again at once, so that N are held the whole time. It prints
``holding N`` once N are open, and runs until SIGTERM or the end of its stdin.
"""

from __future__ import annotations

import argparse
import signal
import sys

import anyio

from ._proc import die_with_parent

HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\nx-slow: "


async def _one(port: int, every: float, opened: list[int], ready: anyio.Event, n: int) -> None:
    """One connection slot, for ever: opened, trickled, opened again once closed."""
    while True:
        try:
            stream = await anyio.connect_tcp("127.0.0.1", port)
        except OSError:
            await anyio.sleep(every)  # refused (the server is full or gone): try again later
            continue
        opened[0] += 1
        if opened[0] >= n:
            ready.set()
        async with stream:
            try:
                await stream.send(HEAD)
                while True:
                    await anyio.sleep(every)
                    await stream.send(b"z")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # closed by the server's header timeout: open another


async def _until_told(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def run(port: int, connections: int, every: float) -> None:
    """Hold ``connections`` slow connections against ``127.0.0.1:port`` until told to stop."""
    opened = [0]
    ready = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_until_told, tg.cancel_scope)
        for _ in range(connections):
            tg.start_soon(_one, port, every, opened, ready, connections)
        await ready.wait()
        sys.stdout.write(f"holding {connections}\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Hold the connections (the serve suite's slow clients)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._slowloris")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--every", type=float, default=1.0, help="seconds between bytes")
    args = parser.parse_args(argv)
    die_with_parent()
    anyio.run(run, args.port, args.connections, args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
