"""Death notices: ``Down`` and how an exit status becomes a reason."""

from __future__ import annotations

import os
import signal as _signal
from typing import Any

from ._message import Message
from ._ref import ActorRef


class Down(Message):
    """Delivered to watchers when an actor incarnation has died.

    Attributes:
        ref: The dead incarnation.
        reason: ``"normal"`` for a clean stop, else what happened (exit status, the error
            text, the signal, or an out-of-memory kill).
        exitcode: The process exit status (negative: killed by that signal); ``None`` for an
            in-process actor.
        signal: The signal number that killed it, if any.
    """

    ref: ActorRef[Any]
    reason: str
    exitcode: int | None = None
    signal: int | None = None

    @property
    def normal(self) -> bool:
        """Whether the actor stopped cleanly (a graceful stop or a zero exit)."""
        return self.reason == "normal"


_PROC_CGROUP = "/proc/self/cgroup"
_CGROUP_ROOT = "/sys/fs/cgroup"


def _memory_events_paths() -> list[str]:
    """Where this process's cgroup v2 ``memory.events`` may be: under its own cgroup (on a
    host, where the root cgroup has none), then at the mount's root (in a container with its
    own cgroup namespace, whose root is its cgroup). Children inherit the cgroup, and the
    file's counts include those of sub-cgroups."""
    paths = []
    try:
        with open(_PROC_CGROUP, encoding="utf-8") as cgroups:
            for line in cgroups:
                if line.startswith("0::"):  # the cgroup v2 line: "0::/path/of/the/cgroup"
                    own = line[3:].strip().strip("/")
                    if own:
                        paths.append(os.path.join(_CGROUP_ROOT, own, "memory.events"))
    except OSError:
        pass
    paths.append(os.path.join(_CGROUP_ROOT, "memory.events"))
    return paths


def oom_kills() -> int | None:
    """The cgroup's count of out-of-memory kills, where the OS exposes it (cgroup v2)."""
    for path in _memory_events_paths():
        try:
            with open(path, encoding="ascii") as events:
                for line in events:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return None
        return None
    return None


def reason_for_status(
    status: int, error: str | None = None, oom_before: int | None = None
) -> tuple[str, int | None]:
    """Turn a process exit status (and an error the process reported) into a reason.

    Args:
        status: The exit status (negative: the signal that killed it).
        error: What the process said before exiting, if anything.
        oom_before: The cgroup's OOM-kill count when the process started: a SIGKILL while
            that count grew is reported as a kill for memory.
    """
    if status == 0:
        return "normal", None
    if status < 0:
        signum = -status
        if signum == _signal.SIGKILL and oom_before is not None:
            now = oom_kills()
            if now is not None and now > oom_before:
                return "killed for memory (the kernel's OOM killer)", signum
        try:
            name = _signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"killed by {name}", signum
    if error:
        return f"exception: {error}", None
    return f"exited with status {status}", None


class LookupQuery(Message):
    """Which live incarnation answers to ``name`` under this actor's system (control)."""

    name: str


class LookupReply(Message):
    """The answer to a ``LookupQuery``: the ref, or ``None`` when nobody has that name."""

    ref: ActorRef[Any] | None = None
