"""Messages on the wire: round trips, mailbox decoders, header frames."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime._codec import MailboxDecoder
from runtime._message import registry, type_path
from runtime._protocol import HEADER_BYTE, Header, Kind, decode_header, encode_header

from ._messages import Nested, Other, Ping, Point, Pong

points = st.builds(
    Point,
    x=st.floats(allow_nan=False),
    y=st.floats(allow_nan=False),
    label=st.text(),
)
nested = st.builds(
    Nested,
    points=st.lists(points, max_size=5),
    tags=st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), max_size=5),
    blob=st.binary(max_size=64),
    maybe=st.none() | st.integers(-(2**63), 2**63 - 1),
)


class TestRoundTrips:
    @settings(max_examples=200, deadline=None)
    @given(msg=st.one_of(points, nested, st.builds(Ping, n=st.integers(-(2**63), 2**63 - 1))))
    def test_a_mailbox_decoder_returns_exactly_what_was_encoded(self, msg: object) -> None:
        decoder = MailboxDecoder([Ping, Point, Nested])
        assert decoder.decode(msgspec.msgpack.encode(msg)) == msg

    @settings(max_examples=200, deadline=None)
    @given(
        kind=st.sampled_from(list(Kind)),
        corr=st.integers(0, 2**63 - 1),
        reply_to=st.text(),
        body_type=st.text(),
        frames=st.integers(1, 64),
        cookie=st.binary(max_size=16),
    )
    def test_a_header_frame_round_trips_and_starts_with_the_mark(
        self, kind: Kind, corr: int, reply_to: str, body_type: str, frames: int, cookie: bytes
    ) -> None:
        header = Header(kind, corr, reply_to, "x", body_type, frames, cookie)
        frame = bytes(encode_header(header))
        assert frame[:1] == HEADER_BYTE
        assert decode_header(frame) == header

    @settings(max_examples=100, deadline=None)
    @given(msg=st.one_of(points, nested))
    def test_no_message_body_ever_starts_with_the_header_mark(self, msg: object) -> None:
        assert msgspec.msgpack.encode(msg)[:1] != HEADER_BYTE


class TestMailboxDecoder:
    def test_it_accepts_array_like_and_map_like_messages_together(self) -> None:
        decoder = MailboxDecoder([Ping, Point])
        assert decoder.decode(msgspec.msgpack.encode(Ping(n=1))) == Ping(n=1)
        assert decoder.decode(msgspec.msgpack.encode(Point(x=1, y=2))) == Point(x=1, y=2)

    def test_it_refuses_a_well_formed_message_of_another_type(self) -> None:
        decoder = MailboxDecoder([Ping])
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(msgspec.msgpack.encode(Other(text="no")))

    def test_it_refuses_an_array_when_it_only_takes_maps(self) -> None:
        decoder = MailboxDecoder([Ping])
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(msgspec.msgpack.encode(Point(x=1, y=2)))

    @settings(max_examples=300, deadline=None)
    @given(data=st.binary(max_size=64))
    def test_random_bytes_raise_only_msgspec_errors(self, data: bytes) -> None:
        decoder = MailboxDecoder([Ping, Point, Nested])
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            decoder.decode(data)


class TestRegistry:
    def test_every_message_class_is_registered_by_its_import_path(self) -> None:
        assert registry[type_path(Pong)] is Pong
        assert type_path(Pong) == "tests.unit._messages:Pong"

    def test_runtime_messages_are_registered_under_their_defining_module(self) -> None:
        from runtime import Down, MailboxStatistics

        assert registry["runtime._protocol:Down"] is Down
        assert registry["runtime._mailbox:MailboxStatistics"] is MailboxStatistics
