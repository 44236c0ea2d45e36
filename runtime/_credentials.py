"""``Credentials``: what another process of the same user needs to join a running system.

A system's members are its processes; a short-lived client (a command-line tool, a test, a
``top``) can join one with its credentials, ``ActorSystem(attach=credentials)``, and then
ask and tell its actors as a member does. The credentials hold the system's secrets (its
cookie, its CURVE keys), so they are handed over as a file only its owner can read.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import msgspec

from ._auth import Keys
from ._ref import ActorRef
from ._transport import TransportOptions


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    """A system's directory, secrets and settings.

    Attributes:
        ipc_dir: The system's private directory.
        cookie: Its secret, carried by every header.
        options: Its transport settings.
        keys: Its CURVE keys (tcp only).
        root_pid: Pid of the process owning the directory.
        collector: The system's `MetricsCollector`, if it has one (what ``top`` asks).
        issuer: The reply inbox of the system that gave them, which an attached client asks
            for an actor its own `lookup` does not find ('' in credentials older than it).
    """

    ipc_dir: str
    cookie: bytes
    options: TransportOptions
    root_pid: int
    keys: Keys | None = None
    collector: ActorRef[Any] | None = None
    issuer: str = ""

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the credentials to ``path``, readable by their owner only (mode 0600).

        They go to a new file beside it, which then takes ``path``'s name: whatever was at
        ``path`` (a file of another mode, a symlink) is replaced, never written through.

        Returns:
            The file's identity (`file_identity`), to remove it only while it is this one.
        """
        path = os.fspath(path)
        directory, name = os.path.split(os.path.abspath(path))
        fd, fresh = tempfile.mkstemp(prefix=f".{name}.", dir=directory)  # O_EXCL, 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.encode(self))
            os.replace(fresh, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(fresh)
            raise
        return file_identity(path) or ""

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Credentials:
        """Read credentials written by `save`.

        Raises:
            PermissionError: The file is readable by others than its owner.
        """
        info = os.stat(path)
        if info.st_mode & 0o077:
            raise PermissionError(
                f"{os.fspath(path)} is readable by others (mode {info.st_mode & 0o777:o}): "
                "credentials hold the system's secrets; chmod 600 it"
            )
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=cls)


def file_identity(path: str) -> str | None:
    """``path``'s device and inode as ``stat -c %d:%i`` prints them (``None``: nothing
    there): what tells the file a system wrote from one written over it later."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return f"{info.st_dev}:{info.st_ino}"
