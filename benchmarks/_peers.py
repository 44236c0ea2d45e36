"""The processes of the mailbox benchmark: ``python -m benchmarks._peers <role> [options]``.

A *driver* role measures one variant and prints a ``Measurement`` as one JSON line; it
starts its peer itself and tears it down before it exits. A *peer* role is the other end:

==============  ============================================  =========================
driver          what it measures                              peer
==============  ============================================  =========================
floor           sync PUSH -> sync PULL + msgspec decode       sink
pyobj           sync send_pyobj -> zmq.asyncio recv_pyobj     pyobj-sink
ask-sync        sync PUSH/PULL round trip, msgspec both ways  echo-sync
ask-asyncio     zmq.asyncio PUSH/PULL round trip              echo-asyncio
tokenyard-tell  ``ref.tell`` into a counting actor process    (``ActorSystem.spawn``)
tokenyard-ask   ``ref.ask`` of an echoing actor process       (``ActorSystem.spawn``)
==============  ============================================  =========================

The driver binds a control PULL socket in the run's private directory before it starts its
peer; the peer binds its own PULL socket, connects back and sends ``ready``. After that, the
peer acknowledges each round on the control socket, and every wait for an acknowledgement
watches the peer's process too, so nothing waits on a peer that died. No sleep anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import TYPE_CHECKING

import msgspec

from ._messages import PAYLOADS
from ._proc import Measurement, die_with_parent
from ._roundtrip import drive_ask_asyncio, drive_ask_sync, run_echo_asyncio, run_echo_sync
from ._throughput import drive_floor, drive_pyobj, run_pyobj_sink, run_sink
from ._tokenyard import TRANSPORTS

if TYPE_CHECKING:
    from collections.abc import Callable


def drive_tokenyard_tell(opts: argparse.Namespace) -> Measurement:
    """``ref.tell`` into an actor process (see ``benchmarks._tokenyard``)."""
    from ._tokenyard import measure_tell

    return asyncio.run(
        measure_tell(
            opts.payload,
            opts.count,
            opts.rounds,
            opts.warmup,
            opts.transport,
            opts.traced or opts.new_contexts,
            opts.new_contexts,
        )
    )


def drive_tokenyard_ask(opts: argparse.Namespace) -> Measurement:
    """``ref.ask`` of an actor process (see ``benchmarks._tokenyard``)."""
    from ._tokenyard import measure_ask

    return asyncio.run(
        measure_ask(opts.payload, opts.count, opts.rounds, opts.warmup, opts.transport)
    )


DRIVERS: dict[str, Callable[[argparse.Namespace], Measurement]] = {
    "floor": drive_floor,
    "pyobj": drive_pyobj,
    "ask-sync": drive_ask_sync,
    "ask-asyncio": drive_ask_asyncio,
    "tokenyard-tell": drive_tokenyard_tell,
    "tokenyard-ask": drive_tokenyard_ask,
}
PEERS: dict[str, Callable[[argparse.Namespace], None]] = {
    "sink": run_sink,
    "pyobj-sink": run_pyobj_sink,
    "echo-sync": run_echo_sync,
    "echo-asyncio": run_echo_asyncio,
}


def main(argv: list[str] | None = None) -> int:
    """Run one role; a driver prints its measurement as one JSON line on stdout."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._peers")
    parser.add_argument("role", choices=[*DRIVERS, *PEERS])
    parser.add_argument("--dir", required=True, help="private directory for ipc sockets")
    parser.add_argument("--payload", choices=PAYLOADS, default="small")
    parser.add_argument("--count", type=int, default=10_000, help="messages (asks) per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--no-decode", action="store_true", help="floor: transport only")
    parser.add_argument("--ctl", default="", help="peer: the driver's control address")
    parser.add_argument("--bind", default="", help="peer: address to bind the inbox to")
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="ipc",
        help="tokenyard drivers: ipc, tcp with CURVE (tcp), or tcp without it (tcp-plain)",
    )
    parser.add_argument(
        "--metrics",
        choices=("on", "off"),
        default="on",
        help="tokenyard drivers: measure handler times and asks (TOKENYARD_METRICS)",
    )
    parser.add_argument(
        "--traced",
        action="store_true",
        help="tokenyard tell: each tell carries trace context in its frame header",
    )
    parser.add_argument(
        "--new-contexts",
        action="store_true",
        help="tokenyard tell: traced, each tell's contexts other than the tell before's",
    )
    opts = parser.parse_args(argv)
    if opts.metrics != os.environ.get("TOKENYARD_METRICS"):
        # The runtime reads the switch once, at import, in every process it starts: run
        # again with it set, so the actor process inherits it too. Both settings take this
        # path (a driver that did not run itself again was measured 25 % faster or slower
        # than one that did, whatever the setting: the comparison must not depend on it).
        os.environ["TOKENYARD_METRICS"] = opts.metrics
        args = sys.argv[1:] if argv is None else list(argv)
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks._peers", *args])
    die_with_parent()
    if opts.role in PEERS:
        PEERS[opts.role](opts)
        return 0
    measurement = DRIVERS[opts.role](opts)
    sys.stdout.write(msgspec.json.encode(measurement).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
