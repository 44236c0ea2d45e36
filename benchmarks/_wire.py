"""What the baseline drivers and peers share: socket settings, addresses, handshakes."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import zmq

from ._proc import BenchmarkError

if TYPE_CHECKING:
    import argparse
    import subprocess

#: Queue bound of every baseline socket: the same as ``ActorSystem``'s default ``hwm``, so
#: the baselines and tokenyard buffer the same number of messages.
HWM = 10_000
#: Longest a peer waits for the next message before it gives up (it never should).
PEER_TIMEOUT_MS = 60_000
#: Longest a driver waits for a handshake or a round's acknowledgement.
ACK_TIMEOUT = 120.0


def socket_for(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    """A socket with the baselines' queue bounds, no linger, and a receive deadline."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, PEER_TIMEOUT_MS)
    return sock


def addresses(opts: argparse.Namespace) -> tuple[str, str]:
    """The driver's control address and the peer's inbox address for this variant."""
    stem = os.path.join(opts.dir, f"{opts.role}-{os.getpid()}")
    return f"ipc://{stem}-ctl", f"ipc://{stem}-in"


def peer_args(opts: argparse.Namespace, ctl: str, inbox: str) -> list[str]:
    """The command-line options a driver hands its peer."""
    return [
        "--dir", opts.dir, "--payload", opts.payload, "--count", str(opts.count),
        "--rounds", str(opts.rounds), "--warmup", str(opts.warmup),
        "--ctl", ctl, "--bind", inbox,
    ]  # fmt: skip


def await_ack(sock: zmq.Socket[bytes], peer: subprocess.Popen[bytes], what: str) -> bytes:
    """Receive one control message, failing (not hanging) if the peer died first."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + ACK_TIMEOUT
    # Polls in slices only to notice a dead peer; the acknowledgement ends the wait.
    while not poller.poll(250):
        code = peer.poll()
        if code is not None:
            raise BenchmarkError(f"the peer exited with status {code} while we waited: {what}")
        if time.monotonic() > deadline:
            raise BenchmarkError(f"no {what} from the peer within {ACK_TIMEOUT:g} s")
    return sock.recv()


def finish(peer: subprocess.Popen[bytes]) -> None:
    """Wait for a peer that has been told everything to exit cleanly."""
    code = peer.wait(ACK_TIMEOUT)
    if code != 0:
        raise BenchmarkError(f"the peer exited with status {code}")
