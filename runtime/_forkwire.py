"""The fork server's wire: the messages on its socket, and what its process runs.

Shared by the parent's side (`runtime._forking`) and the server (`runtime._forkserver`),
which imports the whole actor process; the parent imports only this.
"""

from __future__ import annotations

import struct

import msgspec

#: What the server process runs (``-c``, not ``-m``: ``-m`` would run this module as a
#: second copy named ``__main__`` beside the one the ``runtime`` package imports). The
#: collector is off from its first import on (Python's recipe for forking without exec,
#: with ``gc.freeze`` before each fork and ``gc.enable`` in the child): a collection frees
#: blocks in pages every child shares, and each child's allocations fill, and so copy,
#: those pages.
COMMAND = "import gc; gc.disable(); from runtime._forkserver import main; main()"
#: Most descriptors one request may carry (the kernel's SCM_MAX_FD).
MAX_FDS = 253
#: Largest request, in bytes (a request names modules and numbers, never arguments).
MAX_REQUEST = 1 << 20
#: How a child reports its own pid on its stdin socket, first thing after the fork.
PID = struct.Struct("!I")


class Hello(msgspec.Struct, tag=True, kw_only=True):
    """The parent's first message: what to import before serving.

    Attributes:
        name: The system's name (the server's process title).
        preload: Modules to import, in order (``ActorSystem(preload=...)``).
        sys_path: The parent's ``sys.path``.
    """

    name: str
    preload: list[str]
    sys_path: list[str]


class ForkRequest(msgspec.Struct, tag=True, kw_only=True):
    """Fork one actor process.

    Attributes:
        id: Correlates the `Reply`.
        actor: The actor class's ``module:QualName``: its module is imported first.
        main: How to re-import ``__main__`` for a class defined there ('' otherwise).
        sys_path: The parent's ``sys.path`` now.
        cwd: The parent's working directory now (for relative ``sys.path`` entries).
        fds: The number each carried descriptor takes in the child, after the first (the
            child's stdin): 1 and 2 for the parent's stdout and stderr, then ``inherit``.
    """

    id: int
    actor: str
    main: str
    sys_path: list[str]
    cwd: str
    fds: list[int]


class Reply(msgspec.Struct, kw_only=True):
    """The answer to `Hello` (``id`` 0) or to a `ForkRequest`.

    Attributes:
        id: The request's id.
        pid: The forked child (for `Hello`: this server).
        refused: A module whose import started a thread (the server exits after saying so).
        threads: How many threads the server had after importing it.
        error: Why nothing was forked, in words.
    """

    id: int
    pid: int = 0
    refused: str = ""
    threads: int = 0
    error: str = ""


request_decoder = msgspec.msgpack.Decoder(Hello | ForkRequest)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
