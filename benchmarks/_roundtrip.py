"""Round-trip baselines: ask-style request and reply with raw pyzmq, sync and asyncio."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from ._messages import Ack, BatchTokenIDOutput, make_message, message_type
from ._proc import Measurement, latency_of, peer_command, started
from ._wire import ACK_TIMEOUT, addresses, await_ack, finish, peer_args, socket_for

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable


def _reply_for(payload: str) -> Callable[[bytes], bytes]:
    """Decode a request and encode the ``Ack`` the tokenyard ``Echo`` actor would return."""
    decode = msgspec.msgpack.Decoder(message_type(payload)).decode
    encode = msgspec.msgpack.Encoder().encode

    def reply(frame: bytes) -> bytes:
        msg = decode(frame)
        n = len(msg.rids) if isinstance(msg, BatchTokenIDOutput) else msg.seq
        return encode(Ack(n=n))

    return reply


def drive_ask_sync(opts: argparse.Namespace) -> Measurement:
    """Round trips with blocking pyzmq calls on both sides: the best Python can do."""
    ctl_addr, inbox = addresses(opts)
    msg = make_message(opts.payload)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(Ack).decode
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        replies = socket_for(ctx, zmq.PULL)
        replies.bind(ctl_addr)
        with started(peer_command("echo-sync", *peer_args(opts, ctl_addr, inbox))) as peer:
            await_ack(replies, peer, "ready")
            push = socket_for(ctx, zmq.PUSH)
            push.connect(inbox)
            send, recv = push.send, replies.recv
            rounds = []
            for r in range(opts.rounds + 1):
                samples: list[int] = []
                for _ in range(opts.warmup if r == 0 else opts.count):
                    t0 = time.perf_counter_ns()
                    send(encode(msg))
                    decode(recv())
                    samples.append(time.perf_counter_ns() - t0)
                if r:  # round 0 is the warm-up
                    rounds.append(latency_of(samples))
            push.send(b"")  # tells the echo to exit
            finish(peer)
    finally:
        ctx.destroy(linger=0)
    return Measurement(latency=rounds, frame_bytes=len(encode(msg)))


def run_echo_sync(opts: argparse.Namespace) -> None:
    """Answer each request with an encoded ``Ack`` until an empty frame arrives."""
    reply = _reply_for(opts.payload)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        pull = socket_for(ctx, zmq.PULL)
        pull.bind(opts.bind)
        push = socket_for(ctx, zmq.PUSH)
        push.connect(opts.ctl)
        push.send(b"ready")
        while frame := pull.recv():
            push.send(reply(frame))
    finally:
        ctx.destroy(linger=1000)


async def _drive_ask_asyncio(opts: argparse.Namespace) -> Measurement:
    ctl_addr, inbox = addresses(opts)
    msg = make_message(opts.payload)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(Ack).decode
    ctx = zmq.asyncio.Context()
    try:
        replies = ctx.socket(zmq.PULL)
        replies.bind(ctl_addr)
        with started(peer_command("echo-asyncio", *peer_args(opts, ctl_addr, inbox))) as peer:
            async with asyncio.timeout(ACK_TIMEOUT):
                await replies.recv()  # ready
            push = ctx.socket(zmq.PUSH)
            push.connect(inbox)
            rounds = []
            for r in range(opts.rounds + 1):
                samples: list[int] = []
                # One deadline per round, not per ask: a timer per ask would be measured.
                async with asyncio.timeout(ACK_TIMEOUT):
                    for _ in range(opts.warmup if r == 0 else opts.count):
                        t0 = time.perf_counter_ns()
                        await push.send(encode(msg))
                        decode(await replies.recv())
                        samples.append(time.perf_counter_ns() - t0)
                if r:
                    rounds.append(latency_of(samples))
            await push.send(b"")
            finish(peer)
    finally:
        ctx.destroy(linger=0)
    return Measurement(latency=rounds, frame_bytes=len(encode(msg)))


def drive_ask_asyncio(opts: argparse.Namespace) -> Measurement:
    """Round trips with ``zmq.asyncio`` on both sides: what an asyncio service pays."""
    return asyncio.run(_drive_ask_asyncio(opts))


async def _echo_asyncio(opts: argparse.Namespace) -> None:
    reply = _reply_for(opts.payload)
    ctx = zmq.asyncio.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.bind(opts.bind)
        push = ctx.socket(zmq.PUSH)
        push.connect(opts.ctl)
        await push.send(b"ready")
        # No deadline per request (a timer each would be measured): if the driver dies,
        # the parent-death signal ends this process.
        while frame := await pull.recv():
            await push.send(reply(frame))
    finally:
        ctx.destroy(linger=1000)


def run_echo_asyncio(opts: argparse.Namespace) -> None:
    """The asyncio twin of ``echo-sync``."""
    asyncio.run(_echo_asyncio(opts))
