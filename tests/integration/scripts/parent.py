"""A root process for the parent-death tests: starts actors, reports, waits to be killed.

``parent.py <shape> [<start>]``: with the shape ``tree`` it starts a supervisor (its own
process) with two supervised children (grandchildren of this process) instead of two plain
children; with ``stubborn`` one child that ignores SIGTERM; with ``inprocess`` one in-process
actor and no process. ``start`` is the system's start method (``fork-server`` or ``spawn``).

It reports every process below it (actors, and the fork servers of this process and of the
supervisor), found through ``/proc``, and how many of them are actors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio

from runtime import ActorSystem, ChildSpec, StartMethod, Supervisor
from tests.integration._actors import Echo, GetPid, Pid, Stubborn, Worker


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, depth first."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for child in map(int, children):
            out += [child, *descendants(child)]
    return out


def is_actor(pid: int) -> bool:
    """Whether ``pid`` is titled as an actor process (``tokenyard::<name>:<pid>``)."""
    title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    return title.startswith("tokenyard::") and ".fork-server:" not in title


async def main(shape: str, start: StartMethod) -> None:
    async with ActorSystem(start=start) as system:
        if shape == "tree":
            specs = [ChildSpec(Worker, name="leaf-1"), ChildSpec(Worker, name="leaf-2")]
            await system.spawn(Supervisor, children=specs, name="tree-sup")
            for name in ("leaf-1", "leaf-2"):
                reply: Pid = await (await system.lookup(name)).ask(GetPid())
                assert reply.pid in descendants(os.getpid())
        elif shape == "stubborn":  # ignores SIGTERM: only a SIGKILL ends it
            await system.spawn(Stubborn, True, name="stubborn")
        elif shape == "inprocess":  # no process of its own, only socket files
            await system.spawn(Echo, name="local", process=False)
        else:
            await system.spawn(Echo, name="orphan-1")
            await system.spawn(Echo, name="orphan-2")
        pids = descendants(os.getpid())
        actors = sum(map(is_actor, pids))
        report = {"pids": pids, "actors": actors, "dir": system.ipc_dir}
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
        await anyio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    args = sys.argv[1:]
    start: StartMethod = "spawn" if args[1:2] == ["spawn"] else "fork-server"
    anyio.run(main, args[0] if args else "flat", start)
