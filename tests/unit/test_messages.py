"""``actors.messages``: what a message reads as in a log line, and on the wire."""

from __future__ import annotations

import msgspec

from actors.messages import Origin


class TestOrigin:
    def test_it_reads_as_a_worker_and_its_incarnation(self) -> None:
        origin = Origin(worker=3, incarnation=1)
        assert str(origin) == "worker 3 (incarnation 1)"
        assert f"{origin}" == "worker 3 (incarnation 1)"
        assert "%s died" % (origin,) == "worker 3 (incarnation 1) died"  # noqa: UP031

    def test_its_repr_stays_the_structs_own(self) -> None:
        assert repr(Origin(worker=3, incarnation=1)) == "Origin(worker=3, incarnation=1)"

    def test_its_encoding_is_unchanged(self) -> None:
        origin = Origin(worker=3, incarnation=1)
        assert msgspec.msgpack.encode(origin) == msgspec.msgpack.encode([3, 1])
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(origin), type=Origin) == origin
