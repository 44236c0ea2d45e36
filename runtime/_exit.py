"""How a process exit status becomes a ``Down``: its cause, its reason, its signal."""

from __future__ import annotations

import os
import signal as _signal

from ._protocol import Cause

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
) -> tuple[Cause, str, int | None]:
    """Turn a process exit status (and an error the process reported) into a cause, a
    reason and the signal that ended it.

    Args:
        status: The exit status (negative: the signal that killed it).
        error: What the process said before exiting, if anything.
        oom_before: The cgroup's OOM-kill count when the process started: a SIGKILL while
            that count grew is reported as a kill for memory.
    """
    if status == 0:
        return Cause.NORMAL, "normal", None
    if status < 0:
        signum = -status
        if signum == _signal.SIGKILL and oom_before is not None:
            now = oom_kills()
            if now is not None and now > oom_before:
                return Cause.OOM, "killed for memory (the kernel's OOM killer)", signum
        try:
            name = _signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return Cause.SIGNAL, f"killed by {name}", signum
    if error:
        return Cause.EXCEPTION, f"exception: {error}", None
    return Cause.EXCEPTION, f"exited with status {status}", None
