"""A host that forks from a coroutine while its system runs, and whose child leaves with
``sys.exit(0)``: the child's ``asyncio.run`` unwinds, cancelling every task it has a copy
of, the system's in-process actors included, and leaving the ``async with``.

``forks_and_exits.py``: reports, as one JSON line, how the child exited and what the
parent's actors (one in-process, one a process) answer afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import warnings
from typing import Any

from runtime import ActorSystem, TokenyardError
from tests.integration._actors import Echo, Ping


async def main() -> dict[str, Any]:
    async with ActorSystem(shutdown_timeout=2) as system:
        refs = {
            "in-process": await system.spawn(Echo, process=False),
            "process": await system.spawn(Echo),
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded": libzmq
            pid = os.fork()
        if pid == 0:  # the child: leaves the way a host's child commonly does
            signal.alarm(20)  # a child that hangs ends, and says so by its status
            sys.exit(0)
        # Waited on in the loop's own thread: the child's loop, closing, took the reader of
        # the loop's self-pipe out of the epoll set they share, so a thread's wake-up
        # (``to_thread``) would never reach this loop (asyncio's hazard, not the system's).
        _, status = os.waitpid(pid, 0)  # noqa: ASYNC222 - the child exits at once
        answers: dict[str, Any] = {"child": os.waitstatus_to_exitcode(status)}
        for name, ref in refs.items():
            try:
                answers[name] = (await ref.ask(Ping(n=1), timeout=5)).n
            except TokenyardError as err:
                answers[name] = f"{type(err).__name__}: {err}"
        return answers


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
