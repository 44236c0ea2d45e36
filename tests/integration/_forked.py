"""Actors for the fork-server tests: each says which process ran its module's top level.

``IMPORTED_IN`` is the pid of the process that executed this module's top level: in an
actor forked from a fork server it is the server's (the module was imported there once, and
the child got a copy), in a fresh interpreter it is the actor's own.

Importing this module blocks while the FIFO named by ``TOKENYARD_TEST_IMPORT_GATE`` exists
and nobody has opened it for writing: how a test holds a fork server inside an import.
"""

from __future__ import annotations

import gc
import os
import signal
from typing import Any

import msgspec

from runtime import Actor, Message, Request, handler

#: The process that ran this module's top level, and whether its collector ran then.
IMPORTED_IN = os.getpid()
IMPORTED_COLLECTING = gc.isenabled()


def _wait_at_the_gate() -> None:
    gate = os.environ.get("TOKENYARD_TEST_IMPORT_GATE", "")
    if gate:
        try:
            with open(gate, "rb") as fifo:  # blocks until the test opens it to write
                fifo.read()  # and until it closes it
        except FileNotFoundError:
            pass  # the test removed the gate: pass through


_wait_at_the_gate()


class WhereAmI(Request["Here"]):
    """Which process is this?"""


class Here(Message):
    """The answer: the process, its parent, and where this module's top level ran."""

    pid: int
    ppid: int
    imported_in: int
    pgid: int
    sid: int
    #: Whether its collector runs, whether it ran where the module was imported, and how
    #: many objects it holds frozen (never scanned).
    collecting: bool
    imported_collecting: bool
    frozen: int
    #: Its environment and working directory.
    environ: dict[str, str] = msgspec.field(default_factory=dict)
    cwd: str = ""


def here(imported_in: int) -> Here:
    """This process, as `Here` says it (``imported_in``: where the actor's module ran)."""
    return Here(
        pid=os.getpid(),
        ppid=os.getppid(),
        imported_in=imported_in,
        pgid=os.getpgid(0),
        sid=os.getsid(0),
        collecting=gc.isenabled(),
        imported_collecting=IMPORTED_COLLECTING,
        frozen=gc.get_freeze_count(),
        environ=dict(os.environ),
        cwd=os.getcwd(),
    )


class ExitWith(Message):
    """Exit at once with this status (0 < status), or die of this signal (status < 0)."""

    status: int


class Forked(Actor[WhereAmI | ExitWith]):
    """Answers `WhereAmI`; exits as told."""

    @handler
    def where(self, msg: WhereAmI) -> Here:
        """Say which process this is."""
        return here(IMPORTED_IN)

    @handler
    def exit_with(self, msg: ExitWith) -> None:
        """End the process as told, without any cleanup."""
        if msg.status < 0:
            os.kill(os.getpid(), -msg.status)
            signal.pause()
        os._exit(msg.status)


class Tokenize(Request["Tokens"]):
    """Tokenize ``text`` with the bundled tokenizer."""

    text: str


class Tokens(Message):
    """The ids, and the text they decode back to."""

    ids: list[int]
    text: str


class Tokenizing(Actor[Tokenize]):
    """Tokenizes with the bundled HF tokenizer, loaded in ``on_start`` (in the child)."""

    def __init__(self) -> None:
        self.tokenizer: Any = None

    async def on_start(self) -> None:
        """Load the tokenizer here: its thread pool must be this process's own."""
        from actors._tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(None)

    @handler
    def tokenize(self, msg: Tokenize) -> Tokens:
        """Encode a batch (the parallel path), then decode the first."""
        batch = self.tokenizer.encode_batch([msg.text] * 8)
        ids = list(batch[0].ids)
        return Tokens(ids=ids, text=self.tokenizer.decode(ids))
