"""An actor module that changes the C environment behind ``os.environ``'s back as it is
imported (``os.putenv``, as a C extension's ``setenv`` can), when its variable is set: how a
test shows what a forked actor's environment is made of."""

from __future__ import annotations

import ctypes
import os

from runtime import Actor, Message, Request, handler

#: The variable it changes; set it (to anything) before the module is imported.
VARIABLE = "TOKENYARD_TEST_PUTENV"

if VARIABLE in os.environ:
    os.putenv(VARIABLE, "changed at import")


class WhatIsSet(Request["IsSet"]):
    """What does the C environment hold for ``VARIABLE``?"""


class IsSet(Message):
    """The answer, as ``getenv(3)`` gives it (what a program this actor starts inherits)."""

    value: str | None


class ReadsItsEnvironment(Actor[WhatIsSet]):
    """Answers `WhatIsSet`."""

    @handler
    def what_is_set(self, msg: WhatIsSet) -> IsSet:
        """Read ``VARIABLE`` from the C environment."""
        getenv = ctypes.CDLL(None).getenv
        getenv.restype = ctypes.c_char_p
        raw = getenv(VARIABLE.encode())
        return IsSet(value=None if raw is None else raw.decode())
