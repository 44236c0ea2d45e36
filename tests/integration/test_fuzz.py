"""Fuzzing a live mailbox and a live reply inbox: whatever bytes arrive, the actor answers.

Hypothesis draws structured garbage (msgpack of arbitrary values, messages with the right tag
and the wrong fields), deep nesting, huge declared lengths and headers that lie about the
frames behind them; every example is thrown at an actor's mailbox and at its system's reply
inbox, and then the actor must answer an ask, and the rejections must have been counted.
"""

from __future__ import annotations

import struct

import anyio
import anyio.lowlevel
import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import ActorSystem
from runtime._protocol import Header, Kind, encode_header

from ._actors import Echo, Ping, Pong
from .test_hardening import spray

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
#: Messages a decoder will look at twice: the tag of a real message, wrong fields.
tagged = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from(["Ping", "Tick", "Down", "LookupQuery", "x"]),
    st.dictionaries(st.sampled_from(["n", "ref", "name", "cause"]), values, max_size=3),
)
garbage = values.map(msgspec.msgpack.encode) | tagged.map(msgspec.msgpack.encode) | st.binary()
deep = st.builds(
    lambda opener, depth: opener * depth + b"\xc0",
    st.sampled_from([b"\x91", b"\x81\xa1a", b"\xdc\x00\x01", b"\xde\x00\x01\xa1k"]),
    st.integers(50, 5000),
)
huge = st.builds(
    lambda marker, size, tail: marker + struct.pack("!I", size) + tail,
    st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf"]),  # str32, bin32, array32, map32
    st.integers(2**20, 2**32 - 1),
    st.binary(max_size=16),
)
bodies = garbage | deep | huge


def lying_header(cookie: bytes) -> st.SearchStrategy[list[bytes]]:
    """A header (with the cookie or not, of any kind) and a number of frames behind it that
    may not be the number it announces."""
    return st.builds(
        lambda kind, announced, with_cookie, rest: [
            bytes(
                encode_header(
                    Header(kind, 1, "", "fuzz", frames=announced, cookie=cookie * with_cookie)
                )
            ),
            *rest,
        ],
        # A STOP with the cookie is a member's stop request, not garbage: the one frame
        # that may end an actor, and only from inside the system.
        st.sampled_from([k for k in Kind if k is not Kind.STOP]),
        st.integers(0, 70),
        st.integers(0, 1),
        st.lists(bodies, max_size=5),
    )


def messages(cookie: bytes) -> st.SearchStrategy[list[list[bytes]]]:
    one = (
        bodies.map(lambda b: [b]) | st.binary().map(lambda b: [b"\xc1" + b]) | lying_header(cookie)
    )
    return st.lists(one, min_size=1, max_size=12)


def test_no_bytes_on_a_mailbox_or_a_reply_inbox_keep_the_actor_from_answering() -> None:
    async def main() -> None:
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, name="echo", process=False)
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            to_mailbox = ctx.socket(zmq.PUSH)
            to_inbox = ctx.socket(zmq.PUSH)
            to_mailbox.connect(echo.address)
            to_inbox.connect(system.station.reply_address)
            # Hypothesis draws synchronously: the examples are drawn first, then each is
            # thrown at the live sockets from the running loop, an ask after each.
            examples: list[list[list[bytes]]] = []

            @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
            @given(batch=messages(system.station.cookie))
            def collect(batch: list[list[bytes]]) -> None:
                examples.append(batch)

            collect()
            try:
                for n, batch in enumerate(examples):
                    for parts in batch:
                        await spray(to_mailbox, parts)
                        await spray(to_inbox, parts)
                    with anyio.fail_after(10):
                        assert await echo.ask(Ping(n=n)) == Pong(n=n)
                stats = await system.statistics(echo)
                assert stats.rejected > 0
                assert system.station.rejected > 0
            finally:
                to_mailbox.close(0)
                to_inbox.close(0)
                ctx.term()

    anyio.run(main)
