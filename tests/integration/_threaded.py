"""A module that starts a thread when imported, and an actor that lives in it.

A fork server refuses to go on forking once it has imported this module (a process with
threads cannot be forked safely); the tests check what the system does then.
"""

from __future__ import annotations

import os
import threading

from runtime import Actor, handler

from ._forked import Here, WhereAmI, here

#: The process that ran this module's top level.
IMPORTED_IN = os.getpid()

#: Never set: the thread waits for the life of the process (a daemon: it blocks no exit).
_forever = threading.Event()
threading.Thread(target=_forever.wait, name="started-at-import", daemon=True).start()


class Threaded(Actor[WhereAmI]):
    """Answers `WhereAmI` from a module that started a thread."""

    @handler
    def where(self, msg: WhereAmI) -> Here:
        """Say which process this is."""
        return here(IMPORTED_IN)
