"""Actors the tokenyard variants spawn; module level so the child process can import them."""

from __future__ import annotations

from runtime import Actor, handler

from ._messages import Ack, BatchAsk, BatchTokenIDOutput, CountQuery, SmallAsk, SmallRequest


class Counter(Actor[SmallRequest | BatchTokenIDOutput | CountQuery]):
    """Counts what it is told; ``ask(CountQuery())`` returns the count.

    The count query travels behind the tells on the same pipe, so its reply proves every
    message told before it was handled: that is where a throughput measurement stops.
    """

    def __init__(self) -> None:
        self.count = 0

    @handler
    def small(self, msg: SmallRequest) -> None:
        """Count one small message."""
        self.count += 1

    @handler
    def batch(self, msg: BatchTokenIDOutput) -> None:
        """Count one batch message."""
        self.count += 1

    @handler
    def query(self, msg: CountQuery) -> Ack:
        """Reply with the number of messages handled so far."""
        return Ack(n=self.count)


class Echo(Actor[SmallAsk | BatchAsk]):
    """Answers every ask with a small ``Ack``: the round trip is all transport and codec."""

    @handler
    def small(self, msg: SmallAsk) -> Ack:
        """Acknowledge a small request with its sequence number."""
        return Ack(n=msg.seq)

    @handler
    def batch(self, msg: BatchAsk) -> Ack:
        """Acknowledge a batch with its size."""
        return Ack(n=len(msg.rids))
