"""A root left at a low open-file limit that starts more actor processes than the limit
has room for: every child costs its parent descriptors (its pidfd, its stdin, its
connection to the parent's reply inbox), and libzmq aborts a process whose listener cannot
accept a connection.

``many_children.py <soft limit> <children>``: lowers this process's soft ``RLIMIT_NOFILE``,
starts that many actors at once, asks each, and reports the soft limit its system left it
with and how many answered, as one JSON line.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

import anyio

from runtime import ActorRef, ActorSystem
from tests.integration._actors import Echo, Ping, Pong


async def main(soft: int, children: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    answered = 0
    async with ActorSystem() as system:
        raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        refs: dict[int, ActorRef[Any]] = {}

        async def spawn(i: int) -> None:
            refs[i] = await system.spawn(Echo, name=f"child-{i}")

        async with anyio.create_task_group() as tg:
            for i in range(children):
                tg.start_soon(spawn, i)
        for i, ref in sorted(refs.items()):
            assert await ref.ask(Ping(n=i)) == Pong(n=i)
            answered += 1
    print(json.dumps({"soft": raised, "answered": answered}), flush=True)


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]), int(sys.argv[2]))
