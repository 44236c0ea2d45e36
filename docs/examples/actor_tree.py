"""A supervision tree from a script: two actors defined right here, under one supervisor.

The supervisor runs in its own process and starts both children in processes of their own;
the classes live in this script's ``__main__``, which each child process re-imports (hence
the ``if __name__ == "__main__":`` guard at the bottom, as with multiprocessing). One child
is killed with SIGKILL: its watcher gets a ``Down``, the supervisor starts a new
incarnation, and the other child carries on untouched.

The supervisor is a small ``Supervisor`` subclass that reports every child start to an actor
running in this script's event loop, so the script *waits* for the restart, as an event,
instead of polling ``lookup`` until a new incarnation shows up.

Run it with ``python docs/examples/actor_tree.py``.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

import anyio

from runtime import (
    Actor,
    ActorRef,
    ActorSystem,
    ChildSpec,
    Message,
    Request,
    Restart,
    Strategy,
    Supervisor,
    handler,
)

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream


class Greet(Request["Greeting"]):
    name: str


class Greeting(Message):
    text: str
    pid: int


class Add(Request["Total"]):
    n: int


class Total(Message):
    value: int
    pid: int


class Greeter(Actor[Greet]):
    """Stateless: answers from its constructor argument."""

    def __init__(self, greeting: str) -> None:
        self.greeting = greeting

    @handler
    def greet(self, msg: Greet) -> Greeting:
        return Greeting(text=f"{self.greeting}, {msg.name}!", pid=os.getpid())


class Accumulator(Actor[Add]):
    """Stateful: its running total is lost when it dies (a restart is a fresh start)."""

    def __init__(self) -> None:
        self.total = 0

    @handler
    def add(self, msg: Add) -> Total:
        self.total += msg.n
        return Total(value=self.total, pid=os.getpid())


class ChildStarted(Message):
    """A supervisor's report: its child ``name`` started (or restarted) as ``ref``."""

    name: str
    ref: ActorRef[Any]


class ReportingSupervisor(Supervisor[Any]):
    """A ``Supervisor`` that tells ``report_to`` of every child start, restarts included."""

    def __init__(
        self,
        children: list[ChildSpec],
        report_to: ActorRef[Any],
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        max_restarts: int = 3,
        period: float = 5.0,
    ) -> None:
        super().__init__(children, strategy=strategy, max_restarts=max_restarts, period=period)
        self.report_to = report_to

    async def on_child_started(self, name: str, ref: ActorRef[Any]) -> None:
        # Called once the child is ready: a ref reported here already answers.
        await self.report_to.tell(ChildStarted(name=name, ref=ref))


class Starts(Actor[ChildStarted]):
    """Runs in main()'s event loop (``process=False``): passes each report on to main()."""

    def __init__(self, out: MemoryObjectSendStream[ChildStarted]) -> None:
        self.out = out

    @handler
    async def started(self, msg: ChildStarted) -> None:
        await self.out.send(msg)


async def restarted(
    starts: MemoryObjectReceiveStream[ChildStarted], name: str, after: int
) -> ActorRef[Any]:
    """Wait for the supervisor to report ``name`` started as an incarnation after ``after``."""
    with anyio.fail_after(30):
        async for report in starts:  # earlier starts (the first ones) are passed over
            if report.name == name and report.ref.incarnation > after:
                return report.ref
    raise RuntimeError("the supervisor's reports ended before the restart")


async def main() -> None:
    # Room for every report of this run: the two first starts and one restart.
    send, starts = anyio.create_memory_object_stream[ChildStarted](8)
    with send, starts:  # closed after the system, and the actor holding `send`, are gone
        async with ActorSystem() as system:
            reporter = await system.spawn(Starts, send, name="starts", process=False)
            await system.spawn(
                ReportingSupervisor,
                children=[
                    ChildSpec(Greeter, kwargs={"greeting": "Hello"}, name="greeter"),
                    ChildSpec(Accumulator, name="accumulator", restart=Restart.PERMANENT),
                ],
                report_to=reporter,
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
            print(
                f"Down: {down.ref.name} incarnation {down.ref.incarnation}, reason {down.reason!r}"
            )

            new = await restarted(starts, "accumulator", accumulator.incarnation)
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
