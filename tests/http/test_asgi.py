"""Bounded body reading and JSON answers, driven through ASGI callables directly.

The receive callable hands out a scripted body and counts what was taken, which shows that
reading stops as soon as a body passes its limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

from actors.http._asgi import (
    ClientGoneError,
    header,
    read_body,
    send_error,
    send_json,
    until_disconnect,
)
from actors.http._errors import HTTPError

if TYPE_CHECKING:
    from collections.abc import MutableMapping


class Script:
    """An ASGI receive callable over a list of messages, counting those taken; once they
    are all taken it waits, as a server does for a client that stays connected."""

    def __init__(self, *messages: dict[str, Any]) -> None:
        self.messages = list(messages)
        self.taken = 0

    async def __call__(self) -> MutableMapping[str, Any]:
        if self.taken == len(self.messages):
            await anyio.sleep_forever()  # sync-ok: a client that neither sends nor leaves
        message = self.messages[self.taken]
        self.taken += 1
        return message


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http", "headers": list(headers)}


class TestReadBody:
    async def test_a_body_in_parts_is_joined(self) -> None:
        receive = Script(body(b'{"a"', more=True), body(b": 1}"))
        assert await read_body(scope(), receive, limit=100) == b'{"a": 1}'

    async def test_a_declared_length_over_the_limit_is_refused_before_reading(self) -> None:
        receive = Script(body(b"x" * 10))
        with pytest.raises(HTTPError) as caught:
            await read_body(scope((b"content-length", b"11")), receive, limit=10)
        assert (caught.value.status, caught.value.code, caught.value.close) == (
            413,
            "request_too_large",
            True,
        )
        assert receive.taken == 0

    async def test_reading_stops_at_the_part_that_passes_the_limit(self) -> None:
        receive = Script(*(body(b"x" * 4, more=True) for _ in range(100)))
        with pytest.raises(HTTPError) as caught:
            await read_body(scope(), receive, limit=10)
        assert caught.value.status == 413
        assert receive.taken == 3  # 4, 8, then 12 bytes: no part after the limit is asked for

    async def test_a_body_exactly_at_the_limit_is_read(self) -> None:
        receive = Script(body(b"x" * 5, more=True), body(b"y" * 5))
        assert len(await read_body(scope(), receive, limit=10)) == 10

    async def test_a_client_that_leaves_midway_is_gone(self) -> None:
        receive = Script(body(b"x", more=True), {"type": "http.disconnect"})
        with pytest.raises(ClientGoneError):
            await read_body(scope(), receive, limit=10)

    async def test_a_length_that_is_no_number_is_a_bad_request(self) -> None:
        with pytest.raises(HTTPError) as caught:
            await read_body(scope((b"content-length", b"ten")), Script(), limit=10)
        assert caught.value.status == 400

    @pytest.mark.parametrize(
        "content_type", [b"application/json", b"Application/JSON; charset=utf-8", b""]
    )
    async def test_json_content_types_are_read(self, content_type: bytes) -> None:
        receive = Script(body(b"{}"))
        assert await read_body(scope((b"content-type", content_type)), receive, 10) == b"{}"

    @pytest.mark.parametrize(
        "content_type", [b"text/plain", b"application/x-www-form-urlencoded", b"multipart/x"]
    )
    async def test_other_content_types_are_unsupported_media(self, content_type: bytes) -> None:
        receive = Script(body(b"{}"))
        with pytest.raises(HTTPError) as caught:
            await read_body(scope((b"content-type", content_type)), receive, limit=10)
        assert (caught.value.status, caught.value.code) == (415, "unsupported_media_type")
        assert receive.taken == 0

    @pytest.mark.parametrize(
        ("name", "value", "status"),
        [
            # Read as it came before, a compressed body was refused as JSON it is not.
            (b"content-encoding", b"gzip", 415),
            (b"content-encoding", b"br", 415),
            (b"transfer-encoding", b"gzip, chunked", 501),
            (b"transfer-encoding", b"deflate,chunked", 501),
        ],
    )
    async def test_an_encoded_body_is_refused_unread(
        self, name: bytes, value: bytes, status: int
    ) -> None:
        receive = Script(body(b"\x1f\x8b"))
        with pytest.raises(HTTPError) as caught:
            await read_body(scope((name, value)), receive, limit=10)
        assert caught.value.status == status
        assert caught.value.close
        assert value.decode() in caught.value.message
        assert receive.taken == 0

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            (b"content-encoding", b"identity"),
            (b"transfer-encoding", b"chunked"),
            (b"transfer-encoding", b"Chunked"),
        ],
    )
    async def test_no_coding_is_read(self, name: bytes, value: bytes) -> None:
        assert await read_body(scope((name, value)), Script(body(b"{}")), limit=10) == b"{}"


class Recorder:
    """An ASGI send callable that keeps what it was sent."""

    def __init__(self) -> None:
        self.sent: list[MutableMapping[str, Any]] = []

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)


class TestAnswers:
    async def test_json_is_sent_with_its_length(self) -> None:
        send = Recorder()
        await send_json(send, 200, b'{"a":1}')
        start, sent = send.sent
        assert start["status"] == 200
        assert (b"content-type", b"application/json") in start["headers"]
        assert (b"content-length", b"7") in start["headers"]
        assert sent == {"type": "http.response.body", "body": b'{"a":1}'}

    async def test_an_error_that_left_the_body_unread_closes_the_connection(self) -> None:
        send = Recorder()
        await send_error(send, HTTPError(413, "too big", close=True))
        assert (b"connection", b"close") in send.sent[0]["headers"]
        send = Recorder()
        await send_error(send, HTTPError(400, "bad", headers=((b"x-a", b"1"),)))
        assert (b"connection", b"close") not in send.sent[0]["headers"]
        assert (b"x-a", b"1") in send.sent[0]["headers"]


def test_header_finds_a_lower_case_name() -> None:
    s = scope((b"content-type", b"a"), (b"x-b", b"c"))
    assert (header(s, b"x-b"), header(s, b"x-c")) == (b"c", None)


class TestUntilDisconnect:
    async def test_the_work_s_result_comes_back(self) -> None:
        async def work() -> int:
            return 7

        assert await until_disconnect(Script(), work) == 7

    async def test_the_work_s_error_comes_back_unwrapped(self) -> None:
        async def work() -> int:
            raise HTTPError(503, "busy")

        with pytest.raises(HTTPError, match="busy"):
            await until_disconnect(Script(), work)

    async def test_a_disconnect_cancels_the_work_and_says_the_client_is_gone(self) -> None:
        cancelled = anyio.Event()

        async def work() -> int:
            try:
                await anyio.sleep_forever()  # sync-ok: work that only a disconnect ends
            finally:
                cancelled.set()
            return 0

        receive = Script(body(b"", more=True), {"type": "http.disconnect"})
        with pytest.raises(ClientGoneError):
            await until_disconnect(receive, work)
        assert cancelled.is_set()
