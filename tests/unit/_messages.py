"""Message and actor types shared by the unit tests (in-process actors only)."""

from __future__ import annotations

from typing import Any

from runtime import Actor, ActorRef, Message, Request, handler


class Pong(Message):
    n: int


class Ping(Request[Pong]):
    n: int


class Point(Message, array_like=True):
    x: float
    y: float
    label: str = ""


class Nested(Message):
    points: list[Point]
    tags: dict[str, int]
    blob: bytes
    maybe: int | None = None


class Other(Message):
    """A message no test actor accepts."""

    text: str


class AskSelf(Request[Pong]):
    pass


class BadReturn(Request[Any]):
    """Answered with a value that is not a message (a protocol error)."""


class Opaque(Message):
    """A reply whose field holds anything, encodable or not."""

    value: Any = None


class AskOpaque(Request[Opaque]):
    """Answered with an `Opaque` holding an object msgspec cannot encode."""


class Counter(Actor[Ping | Point | AskSelf | BadReturn]):
    """Counts pings; misbehaves on demand."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @handler
    async def ping(self, msg: Ping) -> Pong:
        self.seen.append(msg.n)
        return Pong(n=msg.n + 1)

    @handler
    def point(self, msg: Point) -> None:
        self.seen.append(int(msg.x))

    @handler
    async def ask_self(self, msg: AskSelf) -> Pong:
        reply: Pong = await self.ref.ask(Ping(n=0))
        return reply

    @handler
    def bad_return(self, msg: BadReturn) -> int:
        return 42


__all__ = ["ActorRef"]
