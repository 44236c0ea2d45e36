"""A root process for the parent-death tests: starts actors, reports, waits to be killed.

With the argument ``tree`` it starts a supervisor (its own process) with two supervised
children (grandchildren of this process) instead of two plain children; with ``stubborn``
one child that ignores SIGTERM; with ``inprocess`` one in-process actor and no process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio

from runtime import ActorSystem, ChildSpec, Supervisor
from tests.integration._actors import Echo, GetPid, Pid, Stubborn, Worker


async def main(shape: str) -> None:
    async with ActorSystem() as system:
        pids: list[int] = []
        if shape == "tree":
            specs = [ChildSpec(Worker, name="leaf-1"), ChildSpec(Worker, name="leaf-2")]
            await system.spawn(Supervisor, children=specs, name="tree-sup")
            for name in ("leaf-1", "leaf-2"):
                reply: Pid = await (await system.lookup(name)).ask(GetPid())
                pids.append(reply.pid)
        elif shape == "stubborn":  # ignores SIGTERM: only a SIGKILL ends it
            await system.spawn(Stubborn, True, name="stubborn")
        elif shape == "inprocess":  # no process of its own, only socket files
            await system.spawn(Echo, name="local", process=False)
        else:
            await system.spawn(Echo, name="orphan-1")
            await system.spawn(Echo, name="orphan-2")
        children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
        pids.extend(int(p) for p in children)
        sys.stdout.write(json.dumps({"pids": pids, "dir": system.ipc_dir}) + "\n")
        sys.stdout.flush()
        await anyio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "flat")
