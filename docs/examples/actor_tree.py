"""A supervision tree from a script: two actors defined right here, under one supervisor.

The supervisor runs in its own process and starts both children in processes of their own;
the children's classes live in this script's ``__main__``, which each child process
re-imports (hence the ``if __name__ == "__main__":`` guard at the bottom, as with
multiprocessing). One child is killed with SIGKILL: its watcher gets a ``Down``, the
supervisor starts a new incarnation, and the other child carries on untouched.

Run it with ``python docs/examples/actor_tree.py``.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio

from runtime import (
    Actor,
    ActorRef,
    ActorSystem,
    ChildSpec,
    Message,
    Restart,
    Strategy,
    Supervisor,
    handler,
)


class Greet(Message):
    name: str


class Greeting(Message):
    text: str
    pid: int


class Add(Message):
    n: int


class Total(Message):
    value: int
    pid: int


class Greeter(Actor):
    """Stateless: answers from its constructor argument."""

    def __init__(self, greeting: str) -> None:
        self.greeting = greeting

    @handler
    def greet(self, msg: Greet) -> Greeting:
        return Greeting(text=f"{self.greeting}, {msg.name}!", pid=os.getpid())


class Accumulator(Actor):
    """Stateful: its running total is lost when it dies (a restart is a fresh start)."""

    def __init__(self) -> None:
        self.total = 0

    @handler
    def add(self, msg: Add) -> Total:
        self.total += msg.n
        return Total(value=self.total, pid=os.getpid())


async def restarted(system: ActorSystem, name: str, after: int) -> ActorRef[Any]:
    """The live incarnation of ``name`` once it is newer than ``after``."""
    with anyio.fail_after(30):
        while True:
            ref = await system.lookup(name, missing_ok=True)
            if ref is not None and ref.incarnation > after:
                return ref
            await anyio.sleep(0.05)


async def main() -> None:
    async with ActorSystem() as system:
        await system.spawn(
            Supervisor,
            children=[
                ChildSpec(Greeter, kwargs={"greeting": "Hello"}, name="greeter"),
                ChildSpec(Accumulator, name="accumulator", restart=Restart.PERMANENT),
            ],
            strategy=Strategy.ONE_FOR_ONE,  # a death restarts only the dead child
            max_restarts=3,
            period=10.0,
            name="tree",
        )
        greeter = await system.lookup("greeter")
        accumulator = await system.lookup("accumulator")
        hello: Greeting = await greeter.ask(Greet(name="tree"))
        print(f"greeter (pid {hello.pid}, incarnation {greeter.incarnation}): {hello.text}")
        for n in (1, 2, 3):
            total: Total = await accumulator.ask(Add(n=n))
        print(
            f"accumulator (pid {total.pid}, incarnation {accumulator.incarnation}): "
            f"total {total.value}"
        )

        watch = system.watch(accumulator)  # registered before the kill: no death is missed
        os.kill(total.pid, signal.SIGKILL)
        down = await watch
        print(f"Down: {down.ref.name} incarnation {down.ref.incarnation}, reason {down.reason!r}")

        new = await restarted(system, "accumulator", accumulator.incarnation)
        fresh: Total = await new.ask(Add(n=10))
        print(
            f"accumulator restarted (pid {fresh.pid}, incarnation {new.incarnation}): "
            f"total {fresh.value} (a fresh start)"
        )
        again: Greeting = await (await system.lookup("greeter")).ask(Greet(name="again"))
        assert again.pid == hello.pid  # one-for-one: the greeter was not restarted
        print(f"greeter untouched (pid {again.pid}): {again.text}")
    print("system closed: supervisor and children stopped")


if __name__ == "__main__":
    anyio.run(main)
