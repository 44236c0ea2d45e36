"""An actor that spawns a helper, asks it from a handler, and watches it through its mailbox.

Run it with ``python docs/examples/watcher.py``; the "Writing an actor" guide walks through it.
"""

from __future__ import annotations

from typing import Any

import anyio

from runtime import Actor, ActorRef, ActorSystem, Down, Message, Request, handler


class Job(Request["Result"]):
    n: int


class Result(Message):
    n: int
    square: int


class Crash(Message):
    """Make the helper fail as a whole."""


class Squarer(Actor[Job | Crash]):
    @handler
    def job(self, msg: Job) -> Result:
        return Result(n=msg.n, square=msg.n * msg.n)

    @handler
    def crash_now(self, msg: Crash) -> None:
        self.crash(RuntimeError("lost count"))


class Foreman(Actor[Job | Down]):
    """Owns one Squarer (a task in the foreman's own process) and replaces it when it dies."""

    def __init__(self) -> None:
        self.helper: ActorRef[Any] | None = None  # every attribute set here, none discovered

    async def on_start(self) -> None:
        await self.hire()

    async def hire(self) -> None:
        self.helper = await self.system.spawn(Squarer, name="squarer", process=False)
        # The Down arrives as a message in this mailbox, handled in turn like any other.
        self.system.watch(self.helper, notify=self.ref)

    @handler
    async def job(self, msg: Job) -> Result:
        assert self.helper is not None
        # Asking another actor from a handler is fine; this mailbox waits meanwhile.
        result: Result = await self.helper.ask(msg)
        return result

    @handler
    async def down(self, msg: Down) -> None:
        if msg.ref == self.helper and not msg.normal:
            print(f"foreman: {msg.ref.name} died ({msg.reason}); hiring another")
            await self.hire()


async def main() -> None:
    async with ActorSystem() as system:
        foreman = await system.spawn(Foreman, name="foreman")
        print(await foreman.ask(Job(n=7)))

        first = await system.lookup("squarer")  # found inside the foreman's process
        await first.tell(Crash())
        with anyio.fail_after(10):
            await system.watch(first)  # this process can watch a grandchild too
            while True:
                helper = await system.lookup("squarer", missing_ok=True)
                if helper is not None and helper.incarnation > first.incarnation:
                    break
        print(f"squarer incarnation {first.incarnation} -> {helper.incarnation}")
        print(await foreman.ask(Job(n=8)))


if __name__ == "__main__":
    anyio.run(main)
