"""Throughput baselines: the synchronous pyzmq floor and SGLang's ``send_pyobj``."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from ._messages import BatchTokenIDOutput, SmallRequest, as_dataclass, make_message, message_type
from ._proc import Measurement, peer_command, started
from ._wire import HWM, PEER_TIMEOUT_MS, addresses, await_ack, finish, peer_args, socket_for

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable


def drive_floor(opts: argparse.Namespace) -> Measurement:
    """The floor: a plain synchronous PUSH -> PULL loop carrying msgspec bytes.

    With decoding (the floor proper) the sender encodes each message and the receiver
    decodes each, the work any msgspec sender and receiver must do. With ``--no-decode``
    the sender repeats one pre-encoded frame and the receiver only counts: the transport
    alone.
    """
    return _drive_throughput(opts, "sink", pyobj=False)


def drive_pyobj(opts: argparse.Namespace) -> Measurement:
    """SGLang's way: ``send_pyobj`` of a dataclass into a ``zmq.asyncio`` receiver."""
    return _drive_throughput(opts, "pyobj-sink", pyobj=True)


def _drive_throughput(opts: argparse.Namespace, peer_role: str, *, pyobj: bool) -> Measurement:
    ctl_addr, inbox = addresses(opts)
    msg = make_message(opts.payload)
    frame = msgspec.msgpack.encode(msg)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        ctl = socket_for(ctx, zmq.PULL)
        ctl.bind(ctl_addr)
        extra = ["--no-decode"] if opts.no_decode else []
        with started(peer_command(peer_role, *peer_args(opts, ctl_addr, inbox), *extra)) as peer:
            await_ack(ctl, peer, "ready")
            push = socket_for(ctx, zmq.PUSH)
            push.connect(inbox)
            burst = _burst(push, msg, frame, pyobj=pyobj, encode=not opts.no_decode)
            burst(opts.warmup)  # also covers connecting: no round pays for it
            await_ack(ctl, peer, "warm-up acknowledgement")
            rates: list[float] = []
            for _ in range(opts.rounds):
                t0 = time.perf_counter_ns()
                burst(opts.count)
                await_ack(ctl, peer, "round acknowledgement")
                rates.append(opts.count / ((time.perf_counter_ns() - t0) / 1e9))
            finish(peer)
    finally:
        ctx.destroy(linger=0)
    # A pickle's size is not known here (no pickle outside pyzmq's send_pyobj): report 0.
    return Measurement(throughput=rates, frame_bytes=0 if pyobj else len(frame))


def _burst(
    push: zmq.Socket[bytes],
    msg: SmallRequest | BatchTokenIDOutput,
    frame: bytes,
    *,
    pyobj: bool,
    encode: bool,
) -> Callable[[int], None]:
    """A function sending ``n`` messages the way the variant does."""
    send = push.send
    if pyobj:
        obj = as_dataclass(msg)
        send_pyobj = push.send_pyobj  # the baseline being compared against: pickle

        def burst_pyobj(n: int) -> None:
            for _ in range(n):
                send_pyobj(obj)

        return burst_pyobj
    if encode:
        enc = msgspec.msgpack.Encoder().encode

        def burst_encoded(n: int) -> None:
            for _ in range(n):
                send(enc(msg))

        return burst_encoded

    def burst_raw(n: int) -> None:
        for _ in range(n):
            send(frame)

    return burst_raw


def run_sink(opts: argparse.Namespace) -> None:
    """Receive every round (decoding each frame unless ``--no-decode``), ack each."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        pull = socket_for(ctx, zmq.PULL)
        pull.bind(opts.bind)
        ack = socket_for(ctx, zmq.PUSH)
        ack.connect(opts.ctl)
        ack.send(b"ready")
        recv = pull.recv
        decode = msgspec.msgpack.Decoder(message_type(opts.payload)).decode
        for n in [opts.warmup] + [opts.count] * opts.rounds:
            if opts.no_decode:
                for _ in range(n):
                    recv()
            else:
                for _ in range(n):
                    decode(recv())
            ack.send(b"")
    finally:
        ctx.destroy(linger=1000)


async def _pyobj_sink(opts: argparse.Namespace) -> None:
    ctx = zmq.asyncio.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, HWM)
        pull.bind(opts.bind)
        ack = ctx.socket(zmq.PUSH)
        ack.connect(opts.ctl)
        await ack.send(b"ready")
        recv_pyobj = pull.recv_pyobj
        for n in [opts.warmup] + [opts.count] * opts.rounds:
            # One deadline per round: a timer per message would slow the baseline down.
            async with asyncio.timeout(PEER_TIMEOUT_MS / 1000 + n / 1000):
                for _ in range(n):
                    # The baseline being compared against: SGLang's detokenizer and
                    # tokenizer manager receive every batch like this (pickle).
                    await recv_pyobj()
            await ack.send(b"")
    finally:
        ctx.destroy(linger=1000)


def run_pyobj_sink(opts: argparse.Namespace) -> None:
    """An asyncio receiver doing ``await recv_pyobj()`` per message, as SGLang does."""
    asyncio.run(_pyobj_sink(opts))
