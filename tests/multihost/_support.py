"""What the multi-host tests share: whether a process still runs, a supervised child's
replacement."""

from __future__ import annotations

import os
import select
from typing import Any

import anyio

from runtime import ActorRef, Children, WhichChildren


def running(pid: int) -> bool:
    """Whether ``pid`` has not exited (a zombie has): its pidfd, checked once."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        return not select.select([fd], [], [], 0)[0]
    finally:
        os.close(fd)


async def replacement(sup: ActorRef[Any], old: ActorRef[Any]) -> ActorRef[Any]:
    """The incarnation that replaced ``old`` under ``sup`` (asked once it is known dead)."""
    with anyio.fail_after(30):
        while True:
            children: Children = await sup.ask(WhichChildren())
            ref = children.refs[old.name]
            if ref is not None and ref != old:
                return ref
