"""In-process helpers for the pipeline tests."""

from __future__ import annotations

import anyio

from actors.messages import FlushReply, LoadReply
from runtime import Actor, handler


class Replies:
    """Control replies one inbox received (shared with the test)."""

    def __init__(self) -> None:
        self.loads: list[LoadReply] = []
        self.flushes: list[FlushReply] = []
        self.arrived = anyio.Event()

    def add(self, msg: LoadReply | FlushReply) -> None:
        if isinstance(msg, LoadReply):
            self.loads.append(msg)
        else:
            self.flushes.append(msg)
        self.arrived.set()
        self.arrived = anyio.Event()


class ReplyInbox(Actor):
    """Receives the control replies a worker passes on."""

    def __init__(self, replies: Replies) -> None:
        self.replies = replies

    @handler
    def load(self, msg: LoadReply) -> None:
        self.replies.add(msg)

    @handler
    def flush(self, msg: FlushReply) -> None:
        self.replies.add(msg)
