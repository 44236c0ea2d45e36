"""Bounded queues and sizes: a full mailbox, an oversized message, bad settings."""

from __future__ import annotations

import os

import pytest
import zmq

from runtime import ActorRef, ActorSystem, MailboxFullError, ProtocolError
from runtime._transport import TransportOptions

from ._messages import Counter, Ping, Point, Pong


class TestOptions:
    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"hwm": 0}, "0 is unbounded"),
            ({"max_message_size": 0}, "must be positive"),
            ({"transport": "udp"}, "choose 'ipc' or 'tcp'"),
        ],
    )
    def test_unsafe_or_unknown_settings_are_refused(
        self, kwargs: dict[str, object], match: str
    ) -> None:
        with pytest.raises(ValueError, match=match):
            TransportOptions(**kwargs)  # type: ignore[arg-type]


class TestFullMailbox:
    async def test_a_tell_to_a_mailbox_that_stays_full_fails_after_its_timeout(self) -> None:
        async with ActorSystem(hwm=10, send_timeout=0.2) as system:
            # A mailbox nobody reads: a bare PULL socket in the system's directory.
            sock = system.node.ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.RCVHWM, 10)
            path = os.path.join(system.ipc_dir, "stuck")
            sock.bind(f"ipc://{path}")
            stuck: ActorRef[Ping] = ActorRef("stuck", f"ipc://{path}")

            async def flood() -> None:
                for i in range(1_000_000):
                    await stuck.tell(Ping(n=i))

            try:
                with pytest.raises(MailboxFullError, match=r"stayed full \(hwm=10\) for 0.2 s"):
                    await flood()
            finally:
                sock.close(0)


class TestMessageSize:
    async def test_an_oversized_message_is_refused_by_the_sender_with_the_knob_named(
        self,
    ) -> None:
        async with ActorSystem(max_message_size=1024) as system:
            ref = await system.spawn(Counter, process=False)
            with pytest.raises(ProtocolError, match=r"max_message_size=1024"):
                await ref.tell(Point(x=1, y=2, label="x" * 2000))
            assert await ref.ask(Ping(n=1)) == Pong(n=2)
