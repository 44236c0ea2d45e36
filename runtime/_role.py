"""Which member of a system an ``ActorSystem`` is, as one value with a constructor each.

A system has one *root* (the process that opened it, owning its directory), and may have
*nodes* (``python -m runtime node`` on other hosts, each owning a directory of its own),
*attached* clients (``ActorSystem(attach=...)``: a process of the same user that joins a
running system and owns nothing of it), and the system of each *actor process*, which shares
its root's directory, reports to its parent and lingers on close so its last words arrive.
Everything that differs between them is read off the `Role`, never off a flag of its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import os

    from ._auth import Keys
    from ._credentials import Credentials
    from ._spawn import SpawnSpec
    from ._transport import TransportOptions


class RoleKind(enum.Enum):
    """The four kinds of member."""

    ROOT = "root"
    """The process that opened the system."""
    NODE = "node"
    """A system on another host that belongs to the root's."""
    ATTACHED = "attached"
    """A client that joined a running system with its credentials."""
    ACTOR_PROCESS = "actor process"
    """The system of one actor process, started by its parent."""


@dataclass(frozen=True)
class Role:
    """Which member a system is, and what it takes from the system it belongs to.

    Attributes:
        kind: Which member.
        root: The root's reply inbox, where node names resolve ('' for the root itself, and
            for an attached client, which does not know it).
        ipc_dir: The directory it shares ('' for a member that makes its own).
        root_pid: The pid of the process owning that directory (0: its own).
        cookie: The system's secret, when it joins one (b'': its own, drawn or derived).
        transport: The system's transport settings, when it joins one.
        keys: The system's CURVE keys, or where they are.
        issuer: For an attached client, the reply inbox of the system that gave its
            credentials, where the names it does not hold itself resolve ('' otherwise).
    """

    kind: RoleKind
    root: str = ""
    ipc_dir: str = ""
    root_pid: int = 0
    cookie: bytes = b""
    transport: TransportOptions | None = None
    keys: Keys | str | os.PathLike[str] | None = None
    issuer: str = ""

    @classmethod
    def new_root(cls, keys: Keys | str | os.PathLike[str] | None) -> Role:
        """The root of a system of its own."""
        return cls(RoleKind.ROOT, keys=keys)

    @classmethod
    def node_of(cls, root: str, keys: Keys | str | os.PathLike[str] | None) -> Role:
        """A node of the system whose root's reply inbox is ``root``."""
        return cls(RoleKind.NODE, root=root, keys=keys)

    @classmethod
    def attached_to(cls, credentials: Credentials) -> Role:
        """A client of the running system ``credentials`` describe."""
        return cls(
            RoleKind.ATTACHED,
            ipc_dir=credentials.ipc_dir,
            root_pid=credentials.root_pid,
            cookie=credentials.cookie,
            transport=credentials.options,
            keys=credentials.keys,
            issuer=credentials.issuer,
        )

    @classmethod
    def actor_process(cls, spec: SpawnSpec) -> Role:
        """The system of the actor process ``spec`` starts."""
        return cls(
            RoleKind.ACTOR_PROCESS,
            root=spec.root,
            ipc_dir=spec.ipc_dir,
            root_pid=spec.root_pid,
            cookie=spec.cookie,
            transport=spec.options,
            keys=spec.keys,
        )

    @property
    def owns_dir(self) -> bool:
        """Whether it makes (and removes) a directory of its own: the root and a node. Over
        CURVE tcp, these two derive the cookie from the keys, the same on every host."""
        return self.kind in (RoleKind.ROOT, RoleKind.NODE)

    @property
    def keeps_nodes(self) -> bool:
        """Whether it answers for the system's nodes itself (`runtime._nodes.NodeTable`) when
        it has keys: the root, and an attached client, which does not know the root's
        address to ask it."""
        return self.kind in (RoleKind.ROOT, RoleKind.ATTACHED)

    @property
    def in_actor_process(self) -> bool:
        """Whether it is an actor process's: it lingers on close (its last replies and
        notices reach their peers) and leaves delivering tells to its actor's ending."""
        return self.kind is RoleKind.ACTOR_PROCESS
