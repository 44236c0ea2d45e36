"""``python -m runtime node``: a node of a running system, on this host (`runtime._nodes`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq

from ._auth import AddressPolicy, Keys
from ._launcher import DEFAULT_START
from ._logging import configure_logging
from ._nodes import NodeService
from ._options import seconds
from ._system import ActorSystem
from ._transport import MAX_HEARTBEAT, bracketed

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger("tokenyard.nodes")

DESCRIPTION = """\
Run a node of the system whose root listens at ADDRESS (its ActorSystem.address, such as
tcp://10.0.0.1:7100), with the system's CURVE keys from DIR (its system.key, mode 0600).
The node binds on HOST and starts actors for the system until SIGTERM or SIGINT (and, with
--stdin-eof, until its standard input ends: how a parent that may die takes it along).
"""


def node_main(argv: list[str]) -> int:
    """``python -m runtime node``: a node of a running system, until told to stop."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime node",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--system", required=True, metavar="ADDRESS", help="the root's address")
    parser.add_argument("--keys", required=True, metavar="DIR", help="holds system.key (0600)")
    parser.add_argument("--name", required=True, help="this node's name in the system")
    parser.add_argument("--host", required=True, help="the address this node binds on")
    parser.add_argument("--port", type=int, default=0, help="its reply inbox's port (0: any)")
    parser.add_argument(
        "--heartbeat",
        type=_heartbeat,
        default=5.0,
        metavar="S",
        help="seconds, above 0 and at most a day (default 5)",
    )
    parser.add_argument(
        "--start",
        default=None,
        choices=("spawn", "fork-server"),
        help="how its actors start (default: fork-server where available)",
    )
    parser.add_argument("--stdin-eof", action="store_true", help="stop when standard input ends")
    args = parser.parse_args(argv)
    if not args.name.strip():
        parser.error(f"--name {args.name!r}: give the node a name (the system finds it by it)")
    if not AddressPolicy("", any_tcp=True).allows(args.system):
        parser.error(
            f"--system {args.system}: give the root's address as tcp://HOST:PORT (its "
            "ActorSystem.address)"
        )
    # A node joins a system whose key exists: it never makes one (a mistyped directory
    # would otherwise get a fresh key, and the node would wait for ever, in silence).
    key_file = os.path.join(args.keys, "system.key")
    if not os.path.isfile(key_file):
        parser.error(f"--keys {args.keys}: no system.key there (copy the system's own, mode 0600)")
    try:
        Keys.load(args.keys)
    except (OSError, ValueError, msgspec.DecodeError) as err:
        parser.error(f"--keys {args.keys}: {err}")
    if args.host in ("0.0.0.0", "::", "[::]", "*"):  # noqa: S104 - refused, not bound
        parser.error(
            f"--host {args.host}: the node tells the system this address to reach it by; "
            "give this host's address on the network the system shares"
        )
    problem = _bind_problem(args.host, args.port)
    if problem is not None:
        where = f"--host {args.host}" + (f" --port {args.port}" if args.port else "")
        parser.error(
            f"{where}: this host cannot bind there ({problem}); give one of its own "
            "addresses (or an interface's name)"
        )
    configure_logging(logging.INFO, f"node {args.name}")
    try:
        anyio.run(_serve_node, args)
    except KeyboardInterrupt:
        return 130
    return 0


def _heartbeat(text: str) -> float:
    """``--heartbeat``: seconds above 0, at most `MAX_HEARTBEAT` (a day)."""
    return seconds(text, MAX_HEARTBEAT)


def _bind_problem(host: str, port: int) -> str | None:
    """Why the node's inbox could not bind on ``host`` and ``port``, or ``None``: found by
    binding a socket there, as the inbox will, and closing it, before anything starts."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.PULL)
        try:
            sock.bind(f"tcp://{bracketed(host)}:{port or '*'}")
        except zmq.ZMQError as err:
            return str(err)
        finally:
            sock.close(0)
    finally:
        ctx.term()
    return None


async def _serve_node(args: Any) -> None:
    system = ActorSystem(
        name=f"node-{args.name}",
        transport="tcp",
        tcp_host=args.host,
        keys=args.keys,
        port=args.port,
        heartbeat=args.heartbeat,
        root=args.system,
        start=args.start or DEFAULT_START,
    )
    async with system, anyio.create_task_group() as tg:
        service = NodeService(system, args.name, args.system)
        service.on_joined = _announcer(service, system.address)
        tg.start_soon(service.run)
        if args.stdin_eof:
            tg.start_soon(_until_stdin_ends, tg.cancel_scope)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                logger.info("node %s: %s: stopping", args.name, signal.Signals(signum).name)
                tg.cancel_scope.cancel()
                break


def _announcer(service: NodeService, address: str) -> Callable[[], None]:
    def announce() -> None:
        # The line a starter waits for (a test, a Ray actor, an operator's script).
        sys.stdout.write(f"node {service.name} joined {service.root} at {address}\n")
        sys.stdout.flush()

    return announce


async def _until_stdin_ends(scope: anyio.CancelScope) -> None:
    await anyio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)
    logger.info("standard input ended: stopping")
    scope.cancel()
