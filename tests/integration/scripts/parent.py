"""A root process for the parent-death tests: starts actors, reports, waits to be killed.

With the argument ``tree`` it starts a supervisor (its own process) with two supervised
children (grandchildren of this process) instead of two plain children.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio

from runtime import ActorSystem, ChildSpec, Supervisor
from tests.integration._actors import Echo, GetPid, Pid, Worker


async def main(tree: bool) -> None:
    async with ActorSystem() as system:
        pids: list[int] = []
        if tree:
            specs = [ChildSpec(Worker, name="leaf-1"), ChildSpec(Worker, name="leaf-2")]
            await system.spawn(Supervisor, children=specs, name="tree-sup")
            for name in ("leaf-1", "leaf-2"):
                reply: Pid = await (await system.lookup(name)).ask(GetPid())
                pids.append(reply.pid)
        else:
            await system.spawn(Echo, name="orphan-1")
            await system.spawn(Echo, name="orphan-2")
        children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
        pids.extend(int(p) for p in children)
        sys.stdout.write(json.dumps({"pids": pids, "dir": system.ipc_dir}) + "\n")
        sys.stdout.flush()
        await anyio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:] == ["tree"])
