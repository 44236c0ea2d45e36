"""Forking a sibling: a copy of this process whose parent is this process's parent.

The fork server (`runtime._forkserver`) makes every actor process with `fork_sibling`, so
the actor is a child of the process that owns the ``ActorSystem``, exactly as a fresh
interpreter started with ``subprocess`` is: that process reaps it with ``waitpid`` and reads
its exit status and signal from the kernel, its parent-death signal follows that process,
and the fork server's own death touches no actor.

It is Linux's ``clone(CLONE_PARENT | SIGCHLD)``, made as a raw system call (no libc or
Python wrapper offers the flag) and wrapped in CPython's own fork hooks
(``PyOS_BeforeFork``, ``PyOS_AfterFork_Child``, ``PyOS_AfterFork_Parent``), the same ones
``os.fork`` calls: the import lock, the GIL, the thread states, ``os.register_at_fork``
handlers (``random`` reseeds in the child) are handled as by ``os.fork``. What a raw clone
skips is libc's own bookkeeping: ``pthread_atfork`` handlers do not run, and the main
thread's glibc descriptor keeps the fork server's thread id, which only thread-id based
calls made on the child's main thread would notice (``pthread_setname_np``,
``pthread_setschedparam`` on it, priority-inheritance mutexes). A fork server is
single-threaded and holds no lock when it forks, which is what makes the skipped parts
moot; an actor that needs those calls starts with ``start="spawn"``.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import sys

_CLONE_PARENT = 0x00008000
#: ``SYS_clone`` by machine: the only argument passed is the flags, first on every ABI.
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(platform.machine())

#: Whether this platform can fork siblings (Linux on x86-64 or arm64).
SUPPORTED = sys.platform.startswith("linux") and _SYS_CLONE is not None


def fork_sibling() -> int:
    """Fork this process; the copy's parent is this process's parent.

    Must be called from a single-threaded process (the fork server), with the GIL held
    across the system call (``ctypes.PyDLL`` keeps it), as ``os.fork`` does.

    Returns:
        0 in the copy; the copy's pid here.

    Raises:
        OSError: The kernel refused (a seccomp policy, a pid limit), or the platform has no
            sibling fork (see ``SUPPORTED``).
    """
    if _SYS_CLONE is None or not SUPPORTED:
        raise OSError(f"no sibling fork on {sys.platform}/{platform.machine()}")
    api = ctypes.PyDLL(None, use_errno=True)
    clone = api.syscall
    clone.restype = ctypes.c_long
    clone.argtypes = [ctypes.c_long, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p]
    api.PyOS_BeforeFork()
    pid: int = clone(_SYS_CLONE, _CLONE_PARENT | signal.SIGCHLD, None, None)
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    errno = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(errno, f"clone(CLONE_PARENT): {os.strerror(errno)}")
    return pid
