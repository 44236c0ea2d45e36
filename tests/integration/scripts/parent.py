"""A root process for the parent-death test: spawns actors, reports, waits to be killed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio

from runtime import ActorSystem
from tests.integration._actors import Echo


async def main() -> None:
    async with ActorSystem() as system:
        await system.spawn(Echo, name="orphan-1")
        await system.spawn(Echo, name="orphan-2")
        children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
        sys.stdout.write(json.dumps({"pids": [int(p) for p in children], "dir": system.ipc_dir}))
        sys.stdout.write("\n")
        sys.stdout.flush()
        await anyio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    anyio.run(main)
