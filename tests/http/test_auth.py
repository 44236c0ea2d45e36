"""API keys: `ApiKey` keeps itself out of reprs, and a server with one answers only clients
that present it, on every route but ``/health``.

The server is a real uvicorn on 127.0.0.1 in front of a real pipeline, driven by the
official ``openai`` client, aiohttp and raw sockets.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import msgspec
import openai
import pytest
import rich.pretty
from openai import AsyncOpenAI

from actors.http import ApiKey, HttpSettings, ServeConfig
from actors.http._auth import BearerCheck
from actors.http._errors import HTTPError
from actors.http._pipeline_engine import BUNDLED_MODEL_ID

from ._server import Served, serve_pipeline

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

KEY = "tk-3f9a1c7e5b2d8064aa91"
CONFIG = ServeConfig(api_key=ApiKey(KEY), context_length=512, default_max_tokens=8)
#: Every route but /health, with a method it takes, and a path no route has.
GUARDED = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", f"/v1/models/{BUNDLED_MODEL_ID}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("GET", "/nowhere"),
]
BODIES: dict[str, Any] = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [42]},
}


def same_length_other(key: str) -> str:
    """A key of ``key``'s length that differs from it in its last character only."""
    return key[:-1] + ("0" if key[-1] != "0" else "1")


class TestTheKeyValue:
    def test_no_repr_of_a_config_shows_the_key(self) -> None:
        config = ServeConfig(api_key=ApiKey(KEY))
        settings = HttpSettings(channel=3, config=config)
        for shown in (repr(config), str(config), repr(settings), f"{config!r}"):
            assert KEY not in shown
            assert "ApiKey(***)" in shown
        assert KEY not in rich.pretty.pretty_repr(settings)

    def test_it_travels_to_a_worker_as_msgspec_encodes_it(self) -> None:
        settings = HttpSettings(channel=3, config=ServeConfig(api_key=ApiKey(KEY)))
        wire = msgspec.msgpack.encode(settings)
        back = msgspec.msgpack.decode(wire, type=HttpSettings)
        assert back.config.api_key == ApiKey(KEY)
        assert back.config.api_key is not None
        assert back.config.api_key.value == KEY

    @pytest.mark.parametrize(
        "bad", ["", "two words", "tab\there", "line\nbreak", "clé-été", "\x00", "key\x7f"]
    )
    def test_a_key_that_no_header_could_carry_is_refused_without_being_shown(
        self, bad: str
    ) -> None:
        with pytest.raises(ValueError, match="API key") as caught:
            ApiKey(bad)
        if bad:
            assert bad not in str(caught.value)

    def test_the_default_config_asks_for_no_key(self) -> None:
        assert ServeConfig().api_key is None


class TestTheComparison:
    def check(self, authorization: bytes | None) -> HTTPError | None:
        headers = [] if authorization is None else [(b"authorization", authorization)]
        try:
            BearerCheck(ApiKey(KEY)).check({"headers": headers})
        except HTTPError as err:
            return err
        return None

    def test_fixed_length_digests_are_compared_whatever_length_is_presented(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        compared: list[tuple[int, int]] = []
        real = hmac.compare_digest

        def spy(a: bytes, b: bytes) -> bool:
            compared.append((len(a), len(b)))
            return real(a, b)

        monkeypatch.setattr(hmac, "compare_digest", spy)
        for token in (KEY, KEY[:3], KEY * 10, same_length_other(KEY), ""):
            self.check(b"Bearer " + token.encode())
        assert compared == [(32, 32)] * 5

    def test_the_scheme_is_case_insensitive_and_only_bearer_counts(self) -> None:
        assert self.check(f"Bearer {KEY}".encode()) is None
        assert self.check(f"bearer {KEY}".encode()) is None
        assert self.check(f"BEARER   {KEY} ".encode()) is None
        for wrong in (f"Basic {KEY}", f"Token {KEY}", KEY, f"Bearer{KEY}", "Bearer"):
            err = self.check(wrong.encode())
            assert err is not None
            assert err.status == 401, wrong
            assert err.headers == ((b"www-authenticate", b'Bearer error="invalid_token"'),)

    def test_a_missing_header_is_told_how_to_send_the_key(self) -> None:
        err = self.check(None)
        assert err is not None
        assert (err.status, err.code) == (401, "invalid_api_key")
        assert err.headers == ((b"www-authenticate", b"Bearer"),)
        assert "Authorization: Bearer" in err.message


@pytest.fixture(scope="module")
async def module_server() -> AsyncIterator[Served]:
    async with serve_pipeline(workers=1, config=CONFIG) as served:
        async with aiohttp.ClientSession() as http:
            headers = {"authorization": f"Bearer {KEY}"}
            body = {"prompt": "warm up", "max_tokens": 2}
            async with http.post(served.url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
        yield served


@pytest.fixture
async def server(module_server: Served) -> AsyncIterator[Served]:
    yield module_server
    await module_server.settle()


@pytest.fixture
async def http(server: Served) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=server.url) as session:
        yield session


def client(server: Served, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


async def request(
    http: aiohttp.ClientSession, method: str, path: str, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    body: Any = BODIES.get(path) if method == "POST" else None
    async with http.request(method, path, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def assert_refused(status: int, headers: dict[str, str], body: bytes, *keys: str) -> None:
    assert status == 401, body
    assert headers["WWW-Authenticate"].startswith("Bearer")
    error = msgspec.json.decode(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    for key in filter(None, (KEY, *keys)):
        assert key.encode() not in body


class TestWithTheOpenAIClient:
    async def test_the_right_key_serves_completions_chats_streams_and_models(
        self, server: Served
    ) -> None:
        async with client(server, KEY) as c:
            done = await c.completions.create(model=BUNDLED_MODEL_ID, prompt="Hi", max_tokens=4)
            assert done.choices[0].text
            stream = await c.chat.completions.create(
                model=BUNDLED_MODEL_ID,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                stream=True,
            )
            assert [chunk async for chunk in stream]
            assert [m.id for m in (await c.models.list()).data] == [BUNDLED_MODEL_ID]

    @pytest.mark.parametrize(
        "wrong", [same_length_other(KEY), KEY[:-1], KEY + "0", "sk-x", KEY.upper()]
    )
    async def test_a_wrong_key_is_an_authentication_error(self, server: Served, wrong: str) -> None:
        async with client(server, wrong) as c:
            with pytest.raises(openai.AuthenticationError) as caught:
                await c.completions.create(model=BUNDLED_MODEL_ID, prompt="Hi", max_tokens=4)
            with pytest.raises(openai.AuthenticationError):
                await c.models.list()
        assert caught.value.status_code == 401
        assert caught.value.code == "invalid_api_key"
        assert KEY not in str(caught.value)
        assert wrong not in str(caught.value)


class TestRefusals:
    @pytest.mark.parametrize(("method", "path"), GUARDED)
    @pytest.mark.parametrize("extra", [None, "HEAD", "OPTIONS"])
    async def test_every_route_but_health_asks_for_the_key(
        self, http: aiohttp.ClientSession, method: str, path: str, extra: str | None
    ) -> None:
        status, headers, body = await request(http, extra or method, path, {})
        assert status == 401
        assert headers["WWW-Authenticate"] == "Bearer"
        if extra != "HEAD":
            assert_refused(status, headers, body)

    @pytest.mark.parametrize(
        "authorization",
        [
            f"Bearer {same_length_other(KEY)}",
            f"Bearer {KEY[:-1]}",
            f"Bearer {KEY}{KEY}",
            "Bearer ",
            f"Basic {KEY}",
            f"Token {KEY}",
            KEY,
        ],
    )
    async def test_a_wrong_key_or_scheme_is_refused_on_every_route(
        self, http: aiohttp.ClientSession, authorization: str
    ) -> None:
        for method, path in GUARDED:
            status, headers, body = await request(
                http, method, path, {"authorization": authorization}
            )
            assert_refused(status, headers, body, authorization.partition(" ")[2])

    async def test_the_key_anywhere_but_the_authorization_header_is_not_accepted(
        self, http: aiohttp.ClientSession
    ) -> None:
        for path in (f"/v1/models?api_key={KEY}", f"/v1/models?key={KEY}"):
            status, headers, body = await request(http, "GET", path, {})
            assert_refused(status, headers, body)
        for name in ("x-api-key", "api-key", "proxy-authorization"):
            status, headers, body = await request(
                http, "GET", "/v1/models", {name: f"Bearer {KEY}"}
            )
            assert_refused(status, headers, body)
        in_body = {"prompt": "Hi", "api_key": KEY}
        async with http.post("/v1/completions", json=in_body) as r:
            assert_refused(r.status, dict(r.headers), await r.read())

    async def test_health_answers_without_a_key(self, http: aiohttp.ClientSession) -> None:
        async with http.get("/health") as r:
            assert r.status == 200
        async with http.head("/health") as r:
            assert r.status == 200
        async with http.delete("/health") as r:
            assert r.status == 405

    async def test_with_the_key_every_route_answers_as_without_a_key_configured(
        self, http: aiohttp.ClientSession
    ) -> None:
        auth = {"authorization": f"Bearer {KEY}"}
        for method, path in GUARDED:
            status, _, body = await request(http, method, path, auth)
            assert status == (404 if path == "/nowhere" else 200), body
        async with http.head("/v1/models", headers=auth) as r:
            assert r.status == 200
        async with http.options("/v1/models", headers=auth) as r:
            assert r.status == 405  # CORS is off: OPTIONS is a method no route takes
        async with http.head("/v1/completions", headers=auth) as r:
            assert r.status == 405

    async def test_a_refused_request_body_is_never_read(self, server: Served) -> None:
        # A body of 100 MB is announced and none is sent: the refusal comes at once, and
        # the connection closes.
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer wrong\r\ncontent-length: 100000000\r\n\r\n"
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(head)
            await writer.drain()
            with anyio.fail_after(10):
                answer = await reader.read(-1)
        finally:
            writer.close()
            await writer.wait_closed()
        assert answer.startswith(b"HTTP/1.1 401 ")
        assert b"connection: close" in answer.lower()

    async def test_neither_key_reaches_the_log(
        self, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
    ) -> None:
        wrong = same_length_other(KEY)
        with caplog.at_level(logging.DEBUG):
            for key in (KEY, wrong):
                for method, path in GUARDED:
                    await request(http, method, path, {"authorization": f"Bearer {key}"})
        assert KEY not in caplog.text
        assert wrong not in caplog.text
