"""Supervision: a killed child is restarted, callers learn of the death, intensity fails upward.

Run it with ``python docs/examples/supervision.py``; the supervision guide walks through it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio

from runtime import (
    Actor,
    ActorDeadError,
    ActorRef,
    ActorSystem,
    Children,
    ChildSpec,
    GetSupervisorStatistics,
    Message,
    Request,
    Restart,
    Strategy,
    Supervisor,
    SupervisorStatistics,
    WhichChildren,
    handler,
)


class GetPid(Request["Pid"]):
    """Ask a worker for its process id."""


class Pid(Message):
    pid: int


class Work(Request["Done"]):
    """Take ``seconds`` to answer (a request that is in flight when the worker dies)."""

    seconds: float


class Done(Message):
    pass


class Crash(Message):
    """Make the worker fail as a whole (not just this message)."""


class Worker(Actor[GetPid | Work | Crash]):
    @handler
    def pid(self, msg: GetPid) -> Pid:
        return Pid(pid=os.getpid())

    @handler
    async def work(self, msg: Work) -> Done:
        await anyio.sleep(msg.seconds)
        return Done()

    @handler
    def crash_now(self, msg: Crash) -> None:
        self.crash(RuntimeError("state is corrupt"))


async def restarted(sup: ActorRef[Any], name: str, after: int) -> ActorRef[Any]:
    """Ask the supervisor until ``name`` runs with an incarnation newer than ``after``."""
    with anyio.fail_after(30):
        while True:
            children: Children = await sup.ask(WhichChildren())
            ref = children.refs[name]
            if ref is not None and ref.incarnation > after:
                return ref


async def main() -> None:
    async with ActorSystem() as system:
        sup = await system.spawn(
            Supervisor,
            children=[
                ChildSpec(Worker, name="db"),
                ChildSpec(Worker, name="cache", restart=Restart.TRANSIENT),
            ],
            strategy=Strategy.ONE_FOR_ONE,
            max_restarts=3,
            period=5.0,
            name="sup",
        )
        db = await system.lookup("db")
        watch = system.watch(db)  # registered now: a death right after is not missed
        pid: Pid = await db.ask(GetPid())

        async def kill_soon() -> None:
            os.kill(pid.pid, signal.SIGKILL)

        # A request in flight when its actor dies fails at once, not at its timeout.
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_soon)
            try:
                await db.ask(Work(seconds=60), timeout=60)
            except ActorDeadError as err:
                print(f"pending ask failed: {err.reason}")

        down = await watch
        print(f"Down: reason={down.reason!r} exitcode={down.exitcode} signal={down.signal}")

        new_db = await restarted(sup, "db", db.incarnation)
        print(f"db restarted: incarnation {db.incarnation} -> {new_db.incarnation}")
        assert await system.lookup("db") == new_db  # the name resolves to the live one
        try:
            await db.tell(GetPid())  # the old ref names the dead incarnation
        except ActorDeadError:
            print("a tell through the stale ref raises ActorDeadError")
        stats: SupervisorStatistics = await sup.ask(GetSupervisorStatistics())
        print(f"supervisor: {stats.died} death, {stats.restarted} restart")

        # Restart intensity: more than max_restarts restarts within period, and the
        # supervisor stops its children and fails; whoever watches it sees why.
        # (Its worker runs as a task in the supervisor's process: process=False.)
        fragile = await system.spawn(
            Supervisor,
            children=[ChildSpec(Worker, name="fragile-worker", process=False)],
            max_restarts=1,
            period=30.0,
            name="fragile",
        )
        fragile_down = system.watch(fragile)
        incarnation = 0
        for _ in range(2):
            worker = await restarted(fragile, "fragile-worker", incarnation)
            incarnation = worker.incarnation
            await worker.tell(Crash())
        down = await fragile_down
        print(f"fragile supervisor died: {down.reason}")


if __name__ == "__main__":
    anyio.run(main)
