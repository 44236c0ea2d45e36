"""The driver of the profile suite: ``python -m benchmarks._tellprofile [--runtime DIR]``.

One process holds an ``ActorSystem`` and an in-process ``Counter`` actor (``process=False``:
the same mailbox, sockets and frames as between processes, both ends in one interpreter so
that one profiler sees both) and tells it small messages in runs that yield to the event
loop every `YIELD_EVERY` tells. It measures the CPU time per tell twice: unprofiled (the
figure), then under ``cProfile``, whose functions' own times are summed into parts
(`PARTS`) and scaled to the unprofiled figure. ``--runtime DIR`` imports ``runtime`` from
``DIR`` instead (an older commit's, extracted by the suite), with this checkout's
benchmark code: the same measurement of two versions of the runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from runtime import ActorRef

    from ._messages import SmallRequest

#: The parts a tell's CPU time is split into, in the order a tell meets them.
PARTS = (
    "tell call",
    "encode",
    "zmq send",
    "zmq receive",
    "mailbox and dispatch",
    "decode",
    "handler",
    "the rest (event loop, loops)",
    "libzmq I/O threads",
)
#: Tells between two yields to the event loop (a producer that awaits now and then).
YIELD_EVERY = 64


class Profile(msgspec.Struct, kw_only=True):
    """What the driver prints (one JSON line).

    Attributes:
        cpu_us: CPU microseconds per tell, unprofiled, best of the rounds.
        rounds: Every round's CPU microseconds per tell.
        parts: Microseconds per tell of each part (the profile's shares of ``cpu_us``).
        runtime: Where ``runtime`` was imported from.
    """

    cpu_us: float
    rounds: list[float]
    parts: dict[str, float]
    runtime: str


def zmq_send(*args: Any, **kwargs: Any) -> Any:
    """Stands in for pyzmq's send while profiling (see `_watch_zmq`)."""
    return _ZMQ["send"](*args, **kwargs)


def zmq_recv(*args: Any, **kwargs: Any) -> Any:
    """Stands in for pyzmq's recv while profiling."""
    return _ZMQ["recv"](*args, **kwargs)


def zmq_get(*args: Any, **kwargs: Any) -> Any:
    """Stands in for pyzmq's getsockopt while profiling."""
    return _ZMQ["get"](*args, **kwargs)


_ZMQ: dict[str, Any] = {}


def _watch_zmq() -> None:
    """Route the runtime's calls into pyzmq through the functions above.

    pyzmq's socket methods are Cython functions, which cProfile does not see: their time
    would count as their callers' own. Called through a Python function, it counts as
    that function's own, and the parts can name it (at a small cost, under the profiler
    only).
    """
    import zmq

    _ZMQ.update(send=zmq.backend.Socket.send, recv=zmq.backend.Socket.recv)
    _ZMQ["get"] = zmq.backend.Socket.get
    names = {"_send": zmq_send, "recv_frame": zmq_recv, "_get": zmq_get}
    for module in ("runtime._transport", "runtime._mailbox", "runtime._station"):
        loaded = sys.modules.get(module)
        for name, stand_in in names.items():
            if loaded is not None and hasattr(loaded, name):
                setattr(loaded, name, stand_in)


_SENDING = frozenset({"try_send", "_peer", "try_send_traced", "_open_bundle", "_sent_in_turn"})


def part_of(filename: str, function: str) -> str:
    """The part a profiled function's own time belongs to (``filename`` is ``"~"`` for a
    function written in C, named like ``<method 'encode' of 'msgspec...' objects>``)."""
    if filename == "~":
        if "msgspec" in function:
            return "encode" if "encode" in function else "decode"
        if "zmq" in function:
            return "zmq send" if "send" in function else "zmq receive"
        return "the rest (event loop, loops)"
    path = filename.replace("\\", "/")
    if path.endswith(("/runtime/_ref.py", "/runtime/_context.py", "/runtime/_station.py")):
        return "tell call"
    if path.endswith(("/runtime/_transport.py", "/runtime/_protocol.py")):
        if function in _SENDING:
            return "tell call"
        sending = "send" in function or function in ("_flush", "_end_turn", "_clear")
        return "zmq send" if sending else "zmq receive"
    if path.endswith(("/runtime/_mailbox.py", "/runtime/_cell.py")):
        return "mailbox and dispatch"
    if path.endswith("/benchmarks/_actors.py"):
        return "handler"
    if path.endswith("/benchmarks/_tellprofile.py") and function.startswith("zmq_"):
        return "zmq send" if function == "zmq_send" else "zmq receive"
    return "the rest (event loop, loops)"


async def _tells(ref: ActorRef[SmallRequest], msg: SmallRequest, count: int) -> None:
    tell = ref.tell
    for i in range(count):
        await tell(msg)
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)


async def measure(count: int, rounds: int) -> Profile:
    """Time ``rounds`` runs of ``count`` tells, then profile one."""
    import runtime
    from runtime import ActorSystem

    from ._actors import Counter
    from ._messages import CountQuery, make_small

    msg = make_small()
    async with ActorSystem(name="profile") as system:
        ref = await system.spawn(Counter, name="counter", process=False)
        await _tells(ref, msg, count // 10)
        await ref.ask(CountQuery(), timeout=60)
        cpu: list[tuple[float, float]] = []
        for _ in range(rounds):
            start = time.process_time(), time.thread_time()
            await _tells(ref, msg, count)
            await ref.ask(CountQuery(), timeout=60)
            cpu.append(_per_tell(start, count))
        _watch_zmq()
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        await _tells(ref, msg, count)
        await ref.ask(CountQuery(), timeout=60)
        profiler.disable()
    return _result(cpu, profiler, str(Path(runtime.__file__).parent))


def measure_floor(count: int, rounds: int) -> Profile:
    """The same tells' work with nothing but pyzmq and msgspec, synchronously: encode and
    send a run of `YIELD_EVERY`, then receive and decode it (one PUSH/PULL pair over ipc
    in a private directory)."""
    import os
    import shutil
    import tempfile

    import zmq

    from ._messages import SmallRequest, make_small

    msg = make_small()
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(SmallRequest).decode
    directory = tempfile.mkdtemp(prefix="tokenyard-floor-")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        address = f"ipc://{os.path.join(directory, 'floor')}"
        pull.bind(address)
        push.connect(address)

        def run(send: Any = push.send, recv: Any = pull.recv) -> None:
            for _ in range(count // YIELD_EVERY):
                for _ in range(YIELD_EVERY):
                    send(encode(msg))
                for _ in range(YIELD_EVERY):
                    decode(recv())

        run()
        cpu: list[tuple[float, float]] = []
        for _ in range(rounds):
            start = time.process_time(), time.thread_time()
            run()
            cpu.append(_per_tell(start, count))
        _watch_zmq()
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        run(lambda frame: zmq_send(push, frame), lambda: zmq_recv(pull))
        profiler.disable()
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
        shutil.rmtree(directory, ignore_errors=True)
    return _result(cpu, profiler, "pyzmq + msgspec (no runtime)")


def _per_tell(start: tuple[float, float], count: int) -> tuple[float, float]:
    """CPU microseconds per tell since ``start``: the process's, and the main thread's."""
    process, thread = time.process_time() - start[0], time.thread_time() - start[1]
    return process / count * 1e6, thread / count * 1e6


def _result(cpu: list[tuple[float, float]], profiler: cProfile.Profile, runtime: str) -> Profile:
    """The best round, its main thread's time split by the profile's shares, and the rest
    of the process's time (libzmq's I/O threads)."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    spent = dict.fromkeys(PARTS, 0.0)
    for (filename, _, function), (_, _, own, _, _) in stats.items():
        spent[part_of(filename, function)] += own
    total = sum(spent.values()) or 1.0
    best, main = min(cpu)
    parts = {k: round(main * v / total, 3) for k, v in spent.items()}
    parts["libzmq I/O threads"] = round(max(best - main, 0.0), 3)
    return Profile(
        cpu_us=round(best, 3),
        rounds=[round(c, 3) for c, _ in cpu],
        parts=parts,
        runtime=runtime,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._tellprofile")
    parser.add_argument("--runtime", default="", help="import runtime from this directory")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floor", action="store_true", help="pyzmq and msgspec alone")
    opts = parser.parse_args(argv)
    if opts.runtime:
        sys.path.insert(0, opts.runtime)
    count = max(opts.messages // YIELD_EVERY, 1) * YIELD_EVERY
    if opts.floor:
        result = measure_floor(count, opts.rounds)
    else:
        result = asyncio.run(measure(count, opts.rounds))
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
