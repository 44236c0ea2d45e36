"""The tokenyard variants: the system runs in the driver, the actor in its own process.

Both measure through the public API only (``spawn``, ``tell``, ``ask``, ``stop``), so they
measure what a user of the runtime gets.
"""

from __future__ import annotations

import time

import msgspec

from runtime import ActorSystem

from ._actors import Counter, Echo
from ._messages import BATCH_SIZE, TRACEPARENT, CountQuery, make_ask, make_message
from ._proc import BenchmarkError, Latency, Measurement, latency_of

#: Seconds an ask may take before the run is declared broken (never reached when healthy).
_ASK_TIMEOUT = 60.0
#: How the two processes talk: ipc (the default), tcp with CURVE, tcp without it.
TRANSPORTS = ("ipc", "tcp", "tcp-plain")


def _system(transport: str) -> ActorSystem:
    if transport == "ipc":
        return ActorSystem(name="bench")
    return ActorSystem(name="bench", transport="tcp", curve=transport == "tcp")


async def measure_tell(
    payload: str,
    count: int,
    rounds: int,
    warmup: int,
    transport: str = "ipc",
    traced: bool = False,
    new_contexts: bool = False,
) -> Measurement:
    """Throughput of ``tell`` from this process into a counting actor process.

    Each round runs from the first ``tell`` until the actor has *handled* the last one:
    the round ends with an ``ask(CountQuery())`` that queues behind the tells on the same
    pipe, and its reply carries the count, which must match what was sent. ``traced``: each
    tell carries trace context in its frame header, as the pipeline's do when a request is
    traced (one ``traceparent`` for a small message, one per request for a batch), the
    same contexts every tell, or, with ``new_contexts``, contexts other than the tell
    before's (two sets in turn): what a receiver pays when the contexts it decoded last do
    not repeat.
    """
    msg = make_message(payload)
    async with _system(transport) as system:
        ref = await system.spawn(Counter, name="counter")
        tell = ref.tell
        # Called as a user calls it: a ``functools.partial`` holding the keyword cost the
        # traced variant about 0.2 us a tell of the benchmark's own (a dict per call).
        size = 1 if payload == "small" else BATCH_SIZE
        contexts = (TRACEPARENT,) * size if traced else ()
        other = (TRACEPARENT.replace("-01", "-00"),) * size
        sent = 0

        async def burst(n: int) -> float:
            nonlocal sent
            t0 = time.perf_counter_ns()
            if contexts and new_contexts:
                for _ in range(n // 2):
                    await tell(msg, trace=contexts)
                    await tell(msg, trace=other)
                if n % 2:
                    await tell(msg, trace=contexts)
            elif contexts:
                for _ in range(n):
                    await tell(msg, trace=contexts)
            else:
                for _ in range(n):
                    await tell(msg)
            reply = await ref.ask(CountQuery(), timeout=_ASK_TIMEOUT)
            elapsed = (time.perf_counter_ns() - t0) / 1e9
            sent += n
            if reply.n != sent:
                raise BenchmarkError(f"the counter handled {reply!r}, {sent} were told")
            return n / elapsed

        await burst(warmup)  # connects, fills caches, warms the allocator
        rates = [await burst(count) for _ in range(rounds)]
        await system.stop(ref)
    return Measurement(throughput=rates, frame_bytes=len(msgspec.msgpack.encode(msg)))


async def measure_ask(
    payload: str, count: int, rounds: int, warmup: int, transport: str = "ipc"
) -> Measurement:
    """Round-trip time of ``ask`` to an actor process that replies with a small ``Ack``."""
    msg = make_ask(payload)
    async with _system(transport) as system:
        ref = await system.spawn(Echo, name="echo")
        ask = ref.ask
        perf = time.perf_counter_ns
        results: list[Latency] = []
        for r in range(rounds + 1):
            samples: list[int] = []
            for _ in range(warmup if r == 0 else count):
                t0 = perf()
                await ask(msg, timeout=_ASK_TIMEOUT)
                samples.append(perf() - t0)
            if r:  # round 0 is the warm-up
                results.append(latency_of(samples))
        await system.stop(ref)
    return Measurement(latency=results, frame_bytes=len(msgspec.msgpack.encode(msg)))
