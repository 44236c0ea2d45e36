"""CORS: configured origins, preflights answered without the API key, and the headers of
every other answer; off by default (`tests.http.test_app` checks that ``OPTIONS`` then
stays 405).

The servers are real uvicorns on 127.0.0.1 in front of one real pipeline; requests are
made as a browser makes them, with aiohttp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from actors import Pipeline
from actors.http import ApiKey, OpenAIApp, PipelineEngine, ServeConfig
from actors.http._cors import MAX_AGE, CorsPolicy

from ._server import serve, sse_events
from .test_app import ROUTES

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

KEY = "tk-cors-0123456789"
APP = "https://app.example.com"
OTHER = "https://evil.example.net"
AUTH = {"authorization": f"Bearer {KEY}"}


class TestOrigins:
    @pytest.mark.parametrize(
        "origin",
        [
            "https://app.example.com/",
            "https://app.example.com/path",
            "app.example.com",
            "null",
            "",
            "https://user@app.example.com",
            "https://app.example.com?x=1",
            "https://app example.com",
        ],
    )
    def test_anything_but_an_origin_or_a_star_is_refused_by_name(self, origin: str) -> None:
        with pytest.raises(ValueError, match=r"ServeConfig\.cors_origins: .* is not an origin"):
            ServeConfig(cors_origins=(APP, origin))

    def test_origins_with_ports_and_any_case_are_taken(self) -> None:
        origins = ("*", "http://localhost:3000", "HTTPS://App.Example.com", "http://[::1]:8080")
        assert ServeConfig(cors_origins=origins).cors_origins == origins
        policy = CorsPolicy(origins[1:])
        assert policy.allowed(b"https://app.example.com") == b"https://app.example.com"
        assert policy.allowed(b"http://localhost:3000") == b"http://localhost:3000"
        assert policy.allowed(b"http://localhost:3001") is None
        assert policy.allowed(None) is None

    def test_cors_is_off_by_default(self) -> None:
        assert ServeConfig().cors_origins == ()


@pytest.fixture(scope="module")
async def pipeline() -> AsyncIterator[Pipeline]:
    async with Pipeline(workers=1) as p:
        yield p


def served_app(pipeline: Pipeline, origins: tuple[str, ...]) -> OpenAIApp:
    config = ServeConfig(api_key=ApiKey(KEY), cors_origins=origins, default_max_tokens=4)
    return OpenAIApp(PipelineEngine(pipeline), config=config)


@pytest.fixture
async def http(pipeline: Pipeline) -> AsyncIterator[aiohttp.ClientSession]:
    """A session with a server allowing `APP` only."""
    app = served_app(pipeline, (APP,))
    async with serve(app) as (_, url), aiohttp.ClientSession(base_url=url) as session:
        yield session
        await app.wait_idle()


@pytest.fixture
async def http_any(pipeline: Pipeline) -> AsyncIterator[aiohttp.ClientSession]:
    """A session with a server allowing any origin."""
    app = served_app(pipeline, ("*",))
    async with serve(app) as (_, url), aiohttp.ClientSession(base_url=url) as session:
        yield session
        await app.wait_idle()


def preflight(origin: str, method: str, headers: str | None = None) -> dict[str, str]:
    asked = {"origin": origin, "access-control-request-method": method}
    if headers is not None:
        asked["access-control-request-headers"] = headers
    return asked


def vary(headers: Any) -> set[str]:
    return {v.strip().lower() for value in headers.getall("vary", []) for v in value.split(",")}


class TestPreflights:
    @pytest.mark.parametrize(("path", "methods"), ROUTES.items())
    async def test_an_allowed_origin_is_answered_for_every_route_without_the_key(
        self, http: aiohttp.ClientSession, path: str, methods: str
    ) -> None:
        asked = "authorization, content-type, x-request-id, x-stainless-os"
        method = methods.split(", ")[0]
        async with http.options(path, headers=preflight(APP, method, asked)) as r:
            assert r.status == 204, await r.text()
            assert r.headers["access-control-allow-origin"] == APP
            assert r.headers["access-control-allow-methods"] == methods
            assert r.headers["access-control-allow-headers"] == asked
            assert r.headers["access-control-max-age"] == str(MAX_AGE)
            assert "access-control-allow-credentials" not in r.headers
            assert "origin" in vary(r.headers)
            assert r.headers["x-request-id"]
            assert await r.read() == b""

    async def test_a_disallowed_origin_is_refused_and_told_nothing(
        self, http: aiohttp.ClientSession
    ) -> None:
        for origin in (OTHER, APP + ":443", APP.replace("https", "http"), APP + ".evil.net"):
            async with http.options("/v1/completions", headers=preflight(origin, "POST")) as r:
                assert r.status == 403
                assert "access-control-allow-origin" not in r.headers
                assert "access-control-allow-methods" not in r.headers
                assert "origin" in vary(r.headers)
                assert (await r.json())["error"]["code"] == "cors_forbidden"

    async def test_a_method_the_route_does_not_take_is_refused(
        self, http: aiohttp.ClientSession
    ) -> None:
        for path, method in (("/v1/completions", "DELETE"), ("/v1/models", "POST")):
            async with http.options(path, headers=preflight(APP, method)) as r:
                assert r.status == 403
                assert "access-control-allow-origin" not in r.headers

    @pytest.mark.parametrize(
        "asked", ["authorization;evil", "x" * 3000, "a b", "(x)", "content-type,", ",x"]
    )
    async def test_asked_headers_that_are_not_header_names_are_refused(
        self, http: aiohttp.ClientSession, asked: str
    ) -> None:
        async with http.options("/v1/completions", headers=preflight(APP, "POST", asked)) as r:
            assert r.status == 403
            assert "access-control-allow-headers" not in r.headers

    async def test_a_preflight_for_no_route_is_a_404(self, http: aiohttp.ClientSession) -> None:
        async with http.options("/nowhere", headers=preflight(APP, "GET")) as r:
            assert r.status == 404

    async def test_options_that_is_no_preflight_needs_the_key_and_is_then_405(
        self, http: aiohttp.ClientSession
    ) -> None:
        for headers in ({}, {"origin": APP}, {"access-control-request-method": "POST"}):
            async with http.options("/v1/completions", headers=headers) as r:
                assert r.status == 401
            async with http.options("/v1/completions", headers={**headers, **AUTH}) as r:
                assert r.status == 405

    async def test_any_origin_is_answered_with_a_star_never_with_itself(
        self, http_any: aiohttp.ClientSession
    ) -> None:
        for origin in (APP, OTHER, "null"):
            async with http_any.options("/v1/models", headers=preflight(origin, "GET")) as r:
                assert r.status == 204
                assert r.headers["access-control-allow-origin"] == "*"
                assert "access-control-allow-credentials" not in r.headers


class TestAnswers:
    async def test_an_allowed_origin_may_read_answers_errors_and_streams(
        self, http: aiohttp.ClientSession
    ) -> None:
        origin = {"origin": APP}
        async with http.get("/v1/models", headers={**origin, **AUTH}) as r:
            assert r.status == 200
            self.assert_readable(r.headers)
        async with http.get("/v1/models", headers=origin) as r:
            assert r.status == 401  # the page can read why
            self.assert_readable(r.headers)
        body = {"prompt": "Hi", "stream": True, "max_tokens": 4}
        async with http.post("/v1/completions", json=body, headers={**origin, **AUTH}) as r:
            assert r.status == 200
            self.assert_readable(r.headers)
            assert sse_events(await r.read())[-1] == "[DONE]"
        async with http.get("/health", headers=origin) as r:
            self.assert_readable(r.headers)

    def assert_readable(self, headers: Any) -> None:
        assert headers["access-control-allow-origin"] == APP
        assert "origin" in vary(headers)
        exposed = {h.strip() for h in headers["access-control-expose-headers"].split(",")}
        assert "x-request-id" in exposed
        assert "access-control-allow-credentials" not in headers

    async def test_another_origin_is_served_but_not_allowed_to_read_it(
        self, http: aiohttp.ClientSession
    ) -> None:
        # CORS is the browser's to enforce: the server answers, without the permission.
        for headers in ({"origin": OTHER}, {}):
            async with http.get("/v1/models", headers={**headers, **AUTH}) as r:
                assert r.status == 200
                assert "access-control-allow-origin" not in r.headers
                assert "access-control-expose-headers" not in r.headers
                assert "origin" in vary(r.headers)

    async def test_any_origin_reads_with_a_star(self, http_any: aiohttp.ClientSession) -> None:
        async with http_any.get("/v1/models", headers={"origin": OTHER, **AUTH}) as r:
            assert r.status == 200
            assert r.headers["access-control-allow-origin"] == "*"
        async with http_any.get("/v1/models", headers=AUTH) as r:
            assert "access-control-allow-origin" not in r.headers
