"""Spawn actors in their own processes, talk to them, and print a throughput figure.

Run it with ``python docs/examples/runtime_demo.py``.
"""

from __future__ import annotations

import time

import anyio

from runtime import Actor, ActorRef, ActorSystem, Request, handler


class Add(Request[None], array_like=True):
    """One number to add (array_like: a compact hot-path message)."""

    n: int


class Total(Request["Total"]):
    """Ask for (and receive) the running total, and the mirror's."""

    value: int = 0
    mirrored: int | None = None


class Adder(Actor[Add | Total]):
    """Keeps a running total; forwards every number to an optional mirror."""

    def __init__(self, mirror: ActorRef[Add | Total] | None = None) -> None:
        self.total = 0
        self.mirror = mirror

    @handler
    async def add(self, msg: Add) -> None:
        self.total += msg.n
        if self.mirror is not None:
            await self.mirror.tell(msg)

    @handler
    async def report(self, msg: Total) -> Total:
        mirrored = None
        if self.mirror is not None:
            # Same sender, same pipe: this ask reaches the mirror after every forwarded Add.
            reply: Total = await self.mirror.ask(Total())
            mirrored = reply.value
        return Total(value=self.total, mirrored=mirrored)


async def main(count: int = 200_000) -> None:
    async with ActorSystem() as system:
        mirror = await system.spawn(Adder, name="mirror")
        adder = await system.spawn(Adder, mirror, name="adder")
        print(f"spawned {adder.name} and {mirror.name} in their own processes")

        started = time.perf_counter()
        for i in range(count):
            await adder.tell(Add(n=i))
        total: Total = await adder.ask(Total(), timeout=60)
        elapsed = time.perf_counter() - started

        expected = count * (count - 1) // 2
        if total.value != expected or total.mirrored != expected:
            raise SystemExit(f"lost messages: {total} != {expected}")
        print(f"{count} tells handled (and forwarded) in {elapsed:.2f} s: {count / elapsed:,.0f}/s")
        print(f"total {total.value} == mirrored {total.mirrored}")


if __name__ == "__main__":
    anyio.run(main)
