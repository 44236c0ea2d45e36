"""An ActorSystem inside an asyncio server: opened in a lifespan task, used by request handlers.

A web server runs its lifespan (startup and shutdown) in one task and each connection in
tasks of its own that do not descend from it. This script does the same with a plain asyncio
TCP server, so it runs anywhere. Run it with ``python docs/examples/embedding.py``.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from runtime import Actor, ActorRef, ActorSystem, Message, Request, handler

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


class Add(Request["Total"]):
    n: int


class Total(Message):
    value: int


class Counter(Actor[Add]):
    def __init__(self) -> None:
        self.total = 0

    @handler
    def add(self, msg: Add) -> Total:
        self.total += msg.n
        return Total(value=self.total)


@asynccontextmanager
async def lifespan(state: dict[str, ActorRef[Any]]) -> AsyncIterator[None]:
    """What a FastAPI or Starlette lifespan would hold: the system lives as long as the app."""
    async with ActorSystem(name="web") as system:
        state["counter"] = await system.spawn(Counter, name="counter")
        yield
    # Leaving the block stopped the counter and removed the system's directory.


async def run_lifespan(
    state: dict[str, ActorRef[Any]], started: asyncio.Event, shutdown: asyncio.Event
) -> None:
    # Enter and leave in this one task: the system owns a task group, which must be
    # exited by the task that entered it.
    async with lifespan(state):
        started.set()
        await shutdown.wait()


async def main() -> None:
    state: dict[str, ActorRef[Any]] = {}
    started, shutdown = asyncio.Event(), asyncio.Event()
    app = asyncio.create_task(run_lifespan(state, started, shutdown))
    await started.wait()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A connection task, started by asyncio's server, not by the lifespan task: the ref
        # finds the system anyway (the most recently opened one in this process).
        n = int(await reader.readline())
        total: Total = await state["counter"].ask(Add(n=n))
        writer.write(f"{total.value}\n".encode())
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        for n in (1, 2, 3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"{n}\n".encode())
            await writer.drain()
            print(f"sent {n}, running total {int(await reader.readline())}")
            writer.close()
            await writer.wait_closed()

    shutdown.set()
    await app


if __name__ == "__main__":
    asyncio.run(main())
