"""OpenAIApp under a real uvicorn server on 127.0.0.1, in front of a real Pipeline.

The official ``openai`` client drives the happy paths (completions and chat, streamed and
not); aiohttp and raw sockets drive every refusal, disconnects and the endpoints the client
has no method for. One server and pipeline serve the module; tests that kill a worker or
close the pipeline make their own.
"""

from __future__ import annotations

import asyncio
import gzip
import importlib.metadata
import re
import threading
import time
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import anyio.lowlevel
import msgspec
import openai
import pytest
from openai import AsyncOpenAI

from actors import Pipeline
from actors._tokenizer import BOS_TOKEN, INLINE_CHARS, TOKENIZER_THREADS
from actors.http import EngineError, OpenAIApp, PipelineEngine, ServeConfig
from actors.http._pipeline_engine import BUNDLED_MODEL_ID

from ._server import Served, serve, serve_pipeline, sse_events
from ._tokenizer import write_bos_tokenizer

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator, Callable, MutableMapping
    from pathlib import Path

    from openai.types.chat import ChatCompletionMessageParam

    from actors.http import Chunk, Completion
    from actors.messages import SamplingParams

#: Small limits, so that each is cheap to pass.
CONFIG = ServeConfig(
    context_length=512,
    max_body_bytes=64 * 1024,
    max_prompt_bytes=16 * 1024,
    max_tokens_limit=3000,
    default_max_tokens=32,
)
#: Seconds per engine step: streams come in several chunks, and a long one lasts seconds.
STEP_TIME = 0.002
PROMPT = "Tell me about the harbour of Yokohama 🚢"
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "你好，请介绍一下你自己。"},  # noqa: RUF001 (CJK punctuation)
]
JSON = {"content-type": "application/json"}
#: Each route, and the methods it takes as its Allow header says them.
ROUTES = {
    "/v1/completions": "POST",
    "/v1/chat/completions": "POST",
    "/v1/models": "GET, HEAD",
    f"/v1/models/{BUNDLED_MODEL_ID}": "GET, HEAD",
    "/tokenize": "POST",
    "/detokenize": "POST",
    "/version": "GET, HEAD",
    "/health": "GET, HEAD",
}
#: Before the module's server started.
STARTED = int(time.time())


@pytest.fixture(scope="module")
async def module_server() -> AsyncIterator[Served]:
    async with serve_pipeline(workers=2, config=CONFIG, step_time=STEP_TIME) as served:
        # Warm both workers and the server's first request paths before the tests' guards
        # take their snapshots.
        async with aiohttp.ClientSession() as http:
            for stream in (False, True, False, True):
                body = {"prompt": "warm up", "max_tokens": 2, "stream": stream}
                async with http.post(served.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
        yield served


@pytest.fixture
async def server(module_server: Served) -> AsyncIterator[Served]:
    """The module's server; each test leaves it idle, its request tasks ended."""
    yield module_server
    await module_server.settle()


@pytest.fixture
async def client(server: Served) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture
async def http(server: Served) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=server.url) as session:
        yield session


async def post(http: aiohttp.ClientSession, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
    """POST ``body`` (bytes as they are, anything else as JSON): status and decoded JSON."""
    if isinstance(body, bytes):
        kw.setdefault("headers", JSON)
        request = http.post(path, data=body, **kw)
    else:
        request = http.post(path, json=body, **kw)
    async with request as response:
        return response.status, await response.json(content_type=None)


async def still_serves(http: aiohttp.ClientSession) -> None:
    status, body = await post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] <= 3


async def still_serves_no_more(http: aiohttp.ClientSession) -> None:
    async with http.get("/health") as r:
        assert r.status == 200  # the server lives on; only its engine is gone


def assert_error(body: Any, param: str | None = None, code: str | None = None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


class TestWithTheOpenAIClient:
    async def test_a_completion_has_openais_shape_usage_and_finish_reason(
        self, client: AsyncOpenAI, server: Served
    ) -> None:
        done = await client.completions.create(
            model=BUNDLED_MODEL_ID, prompt=PROMPT, max_tokens=12, seed=1
        )
        assert done.object == "text_completion"
        assert done.id.startswith("cmpl-")
        assert done.model == BUNDLED_MODEL_ID
        (choice,) = done.choices
        assert choice.index == 0
        assert choice.finish_reason in ("stop", "length")
        assert choice.text
        assert done.usage is not None
        engine = server.app.engine
        assert engine is not None
        assert done.usage.prompt_tokens == len(engine.encode(PROMPT))
        assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
        assert done.usage.completion_tokens <= 12

    async def test_a_streamed_completion_joins_to_the_same_text_and_ends_with_usage(
        self, client: AsyncOpenAI
    ) -> None:
        args: dict[str, Any] = {"model": BUNDLED_MODEL_ID, "prompt": PROMPT, "seed": 7}
        args |= {"max_tokens": 40, "temperature": 0.8, "extra_body": {"ignore_eos": True}}
        whole = await client.completions.create(**args)
        stream = await client.completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        *texts, usage = chunks
        assert "".join(c.choices[0].text for c in texts) == whole.choices[0].text
        assert len(texts) > 1
        assert [c.choices[0].finish_reason for c in texts] == [None] * (len(texts) - 1) + ["length"]
        assert usage.choices == []
        assert usage.usage is not None
        assert whole.usage is not None
        assert usage.usage.completion_tokens == whole.usage.completion_tokens == 40
        assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
        assert {c.id for c in chunks} == {chunks[0].id}

    async def test_a_chat_completion_and_its_stream_agree(self, client: AsyncOpenAI) -> None:
        create = client.chat.completions.create
        args: dict[str, Any] = {"seed": 3, "max_completion_tokens": 30}
        args["extra_body"] = {"ignore_eos": True}
        whole = await create(model=BUNDLED_MODEL_ID, messages=CHAT, stream=False, **args)
        assert whole.object == "chat.completion"
        (choice,) = whole.choices
        assert (choice.message.role, choice.finish_reason) == ("assistant", "length")
        stream = await create(
            model=BUNDLED_MODEL_ID,
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            **args,
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        contents = [c.choices[0].delta.content for c in chunks if c.choices]
        assert "".join(x for x in contents if x) == choice.message.content
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] == "length"
        assert set(finish[:-1]) == {None}
        assert chunks[-1].usage is not None
        assert whole.usage is not None
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        assert chunks[-1].usage.completion_tokens == 30

    async def test_a_stream_without_usage_ends_at_done_with_no_usage_chunk(
        self, client: AsyncOpenAI
    ) -> None:
        stream = await client.chat.completions.create(
            model=BUNDLED_MODEL_ID, messages=CHAT, max_tokens=5, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert all(c.choices and c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    async def test_a_stop_string_cuts_the_text_with_finish_reason_stop(
        self, client: AsyncOpenAI
    ) -> None:
        args: dict[str, Any] = {"model": BUNDLED_MODEL_ID, "prompt": PROMPT, "max_tokens": 30}
        args["extra_body"] = {"ignore_eos": True}
        plain = (await client.completions.create(**args)).choices[0].text
        stop = plain[10:13]
        cut = await client.completions.create(**args, stop=[stop, "never seen"])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == plain[: plain.index(stop)]
        stream = await client.completions.create(**args, stop=stop, stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == cut.choices[0].text

    async def test_the_model_list_names_the_one_model(self, client: AsyncOpenAI) -> None:
        models = await client.models.list()
        assert [m.id for m in models.data] == [BUNDLED_MODEL_ID]
        assert (await client.models.retrieve(BUNDLED_MODEL_ID)).id == BUNDLED_MODEL_ID
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-4")

    async def test_refusals_reach_the_client_as_its_typed_errors(self, client: AsyncOpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=BUNDLED_MODEL_ID, prompt="x", n=2)
        assert bad.value.param == "n"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="gpt-4", messages=CHAT)
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError) as long_name:
            await client.chat.completions.create(model="m" * 60_000, messages=CHAT)
        assert len(long_name.value.message) < 1_000  # the name quoted in part
        with pytest.raises(openai.BadRequestError) as tools:
            await client.chat.completions.create(
                model=BUNDLED_MODEL_ID,
                messages=CHAT,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            )
        assert tools.value.param == "tools"


BAD_COMPLETIONS = [
    (b'{"prompt": "x"', 400, None),
    (b"", 400, None),
    (b'{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"max_tokens": 5}', 400, "prompt"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 3001}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 99999999999999999999999}', 400, "max_tokens"),
    (b'{"prompt": "x", "temperature": 2.01}', 400, "temperature"),
    (b'{"prompt": "x", "seed": -5}', 400, "seed"),
    (b'{"prompt": ""}', 400, "prompt"),
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"prompt": [1, 99999]}', 400, "prompt[1]"),
    (b'{"prompt": "x", "n": 2}', 400, "n"),
    (b'{"prompt": "x", "best_of": 3}', 400, "best_of"),
    (b'{"prompt": "x", "logprobs": 2}', 400, "logprobs"),
    (b'{"prompt": "x", "echo": true}', 400, "echo"),
    (b'{"prompt": "x", "suffix": "!"}', 400, "suffix"),
    (b'{"prompt": "x", "min_tokens": 2}', 400, "min_tokens"),
    (b'{"prompt": "x", "stop": ["a", ""]}', 400, "stop"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "stream_options"),
    (b'{"prompt": "\xff"}', 400, None),
    (b'{"prompt": "x", "logit_bias": {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}}", 400, None),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
]

BAD_CHATS = [
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": [{"role": "user"}]}', 400, "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
    (b'{"messages": [{"content": "x"}]}', 400, "messages[0].role"),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
        b'"image_url": {"url": "data:,"}}]}]}',
        400,
        "messages[0].content[0]",
    ),
    (b'{"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}', 400, None),
    (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', 400, None),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}', 400, None),
    (
        b'{"messages": [{"role": "user", "content": "x"}], '
        b'"response_format": {"type": "json_schema", "json_schema": {}}}',
        400,
        "response_format",
    ),
    (b'{"messages": [{"role": "user", "content": "x"}], "audio": {}}', 400, "audio"),
]


class TestRefusals:
    @pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
    async def test_a_bad_completion_body_gets_a_4xx_json_error(
        self, http: aiohttp.ClientSession, body: bytes, status: int, param: str | None
    ) -> None:
        got, error = await post(http, "/v1/completions", body)
        assert got == status, error
        assert_error(error, param)
        await still_serves(http)

    @pytest.mark.parametrize(("body", "status", "param"), BAD_CHATS)
    async def test_a_bad_chat_body_gets_a_4xx_json_error(
        self, http: aiohttp.ClientSession, body: bytes, status: int, param: str | None
    ) -> None:
        got, error = await post(http, "/v1/chat/completions", body)
        assert got == status, error
        assert_error(error, param)
        await still_serves(http)

    async def test_streaming_requests_are_refused_before_the_stream_begins(
        self, http: aiohttp.ClientSession
    ) -> None:
        status, error = await post(http, "/v1/completions", {"prompt": "", "stream": True})
        assert status == 400
        assert_error(error, "prompt")

    async def test_prompts_over_the_context_in_tokens_or_bytes_are_refused(
        self, http: aiohttp.ClientSession
    ) -> None:
        tokens = {"prompt": list(range(10, 10 + 512))}
        status, error = await post(http, "/v1/completions", tokens)
        assert status == 400
        assert_error(error, "prompt", "context_length_exceeded")
        room = {"prompt": list(range(10, 10 + 500)), "max_tokens": 13}
        status, error = await post(http, "/v1/completions", room)
        assert_error(error, "max_tokens", "context_length_exceeded")
        text = {"prompt": "é" * (8 * 1024 + 1)}  # 16 KiB + 2 bytes of UTF-8
        status, error = await post(http, "/v1/completions", text)
        assert status == 400
        assert_error(error, "prompt", "context_length_exceeded")
        chat = {"messages": [{"role": "user", "content": "harbour " * 600}]}
        status, error = await post(http, "/v1/chat/completions", chat)
        assert_error(error, "messages", "context_length_exceeded")
        await still_serves(http)

    async def test_a_body_over_the_limit_is_refused_with_413(
        self, http: aiohttp.ClientSession
    ) -> None:
        big = {"prompt": "x" * (64 * 1024)}
        status, error = await post(http, "/v1/completions", big)
        assert status == 413
        assert_error(error, code="request_too_large")
        await still_serves(http)

    async def test_unknown_paths_wrong_methods_and_content_types_are_refused(
        self, http: aiohttp.ClientSession
    ) -> None:
        async with http.get("/v1/nothing") as r:
            assert r.status == 404
            assert_error(await r.json(), code="not_found")
        async with http.get("/v1/completions") as r:
            assert r.status == 405
            assert r.headers["allow"] == "POST"
            assert_error(await r.json(), code="method_not_allowed")
        async with http.delete("/health") as r:
            assert r.status == 405
            assert r.headers["allow"] == "GET, HEAD"
        body = b'{"prompt": "x"}'
        headers = {"content-type": "text/plain"}
        async with http.post("/v1/completions", data=body, headers=headers) as r:
            assert r.status == 415
            assert_error(await r.json(), code="unsupported_media_type")
        # A compressed body, which was read as it came and refused as invalid JSON.
        headers = {"content-type": "application/json", "content-encoding": "gzip"}
        async with http.post("/v1/completions", data=gzip.compress(body), headers=headers) as r:
            assert r.status == 415
            assert_error(await r.json(), code="unsupported_media_type")
        await still_serves(http)

    async def test_a_body_naming_no_content_type_is_read_as_json(self, server: Served) -> None:
        body = b'{"prompt": "x", "max_tokens": 2}'
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
        head += f"content-length: {len(body)}\r\n\r\n".encode()
        answer = await raw_request(server, head, body)
        assert answer.startswith(b"HTTP/1.1 200 "), answer


async def raw_request(served: Served, head: bytes, body: bytes = b"") -> bytes:
    """Send a hand-made request and return what the server answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    try:
        writer.write(head + body)
        await writer.drain()
        with anyio.fail_after(10):
            return await reader.read(-1)
    finally:
        writer.close()
        await writer.wait_closed()


class TestBodyLimitOnTheWire:
    async def test_a_declared_length_over_the_limit_is_answered_before_any_body_is_sent(
        self, server: Served
    ) -> None:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000000\r\n\r\n"
        )
        answer = await raw_request(server, head)
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert b"request_too_large" in answer

    async def test_a_chunked_body_is_cut_off_once_past_the_limit_without_waiting_for_its_end(
        self, server: Served
    ) -> None:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )

        def chunk(data: bytes) -> bytes:
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        # 80 KiB sent and no last chunk: the body never ends, yet the answer comes (and the
        # server closes the connection, the rest of the body unread).
        body = chunk(b'{"prompt": "') + chunk(b"x" * 8192) * 10
        answer = await raw_request(server, head, body)
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert b"connection: close" in answer.lower()


class TestOtherEndpoints:
    async def test_tokenize_and_detokenize_round_trip(
        self, http: aiohttp.ClientSession, server: Served
    ) -> None:
        status, tokens = await post(
            http, "/tokenize", {"prompt": PROMPT, "model": BUNDLED_MODEL_ID}
        )
        assert status == 200
        engine = server.app.engine
        assert engine is not None
        assert tokens == {
            "tokens": engine.encode(PROMPT),
            "count": len(engine.encode(PROMPT)),
            "max_model_len": 512,
        }
        status, text = await post(http, "/detokenize", {"tokens": tokens["tokens"]})
        assert (status, text) == (200, {"prompt": PROMPT})
        status, chat = await post(http, "/tokenize", {"messages": CHAT})
        assert chat["count"] == len(engine.encode(engine.chat_template.render(CHAT)))
        status, error = await post(http, "/detokenize", {"tokens": [1, 4096]})
        assert status == 400
        assert_error(error, "tokens[1]")
        status, error = await post(http, "/tokenize", {"prompt": "x", "model": "other"})
        assert status == 404

    async def test_health_is_an_empty_200(self, http: aiohttp.ClientSession) -> None:
        async with http.get("/health") as r:
            assert (r.status, await r.read()) == (200, b"")
        async with http.head("/health") as r:
            assert r.status == 200

    async def test_models_is_openais_list(
        self, http: aiohttp.ClientSession, server: Served
    ) -> None:
        async with http.get("/v1/models") as r:
            assert await r.json() == {
                "object": "list",
                "data": [
                    {
                        "id": BUNDLED_MODEL_ID,
                        "object": "model",
                        "created": server.app.created,
                        "owned_by": "tokenyard",
                    }
                ],
            }

    async def test_the_model_was_created_when_the_server_started(
        self, http: aiohttp.ClientSession, server: Served
    ) -> None:
        assert STARTED <= server.app.created <= time.time()
        async with http.get(f"/v1/models/{BUNDLED_MODEL_ID}") as r:
            assert (await r.json())["created"] == server.app.created

    async def test_version_is_the_installed_packages(self, http: aiohttp.ClientSession) -> None:
        async with http.get("/version") as r:
            assert r.status == 200
            assert await r.json() == {"version": importlib.metadata.version("tokenyard")}
        async with http.head("/version") as r:
            assert (r.status, await r.read()) == (200, b"")

    async def test_tokenize_adds_no_special_token_the_bundled_tokenizer_lacks(
        self, http: aiohttp.ClientSession, server: Served
    ) -> None:
        engine = server.app.engine
        assert engine is not None
        ids = engine.encode(PROMPT)
        for special in (True, False, None):
            body = {"prompt": PROMPT, "add_special_tokens": special}
            assert (await post(http, "/tokenize", body))[1]["tokens"] == ids
        status, error = await post(http, "/tokenize", {"prompt": "x", "add_special_tokens": 1})
        assert status == 400
        assert_error(error, "add_special_tokens")

    @pytest.mark.parametrize(("path", "methods"), ROUTES.items())
    async def test_head_and_options_on_each_route_without_cors(
        self, http: aiohttp.ClientSession, path: str, methods: str
    ) -> None:
        async with http.head(path) as r:
            assert r.status == (200 if "HEAD" in methods else 405)
            assert await r.read() == b""
        preflight = {"origin": "https://app.example.com", "access-control-request-method": "GET"}
        for headers in ({}, preflight):
            async with http.options(path, headers=headers) as r:
                assert r.status == 405
                assert r.headers["allow"] == methods
                assert not [h for h in r.headers if h.lower().startswith("access-control-")]
                assert "vary" not in r.headers
                assert_error(await r.json(), code="method_not_allowed")


class TestTokenizeWithSpecialTokens:
    async def test_add_special_tokens_defaults_as_vllms_and_is_honoured(
        self, tmp_path: Path
    ) -> None:
        """With a tokenizer that adds a BOS: a prompt gets it unless told not to, chat
        messages (whose template writes its own) only when told to."""
        path = write_bos_tokenizer(tmp_path)
        async with (
            serve_pipeline(workers=1, tokenizer=str(path)) as served,
            aiohttp.ClientSession(base_url=served.url) as http,
        ):
            engine = served.app.engine
            assert engine is not None
            assert engine.model == "bos-model"
            bos = engine.encode(BOS_TOKEN)
            plain = engine.encode(PROMPT)
            chat = engine.encode(engine.chat_template.render(CHAT))
            assert bos == [1]
            for body, expected in [
                ({"prompt": PROMPT}, bos + plain),
                ({"prompt": PROMPT, "add_special_tokens": True}, bos + plain),
                ({"prompt": PROMPT, "add_special_tokens": False}, plain),
                ({"prompt": ""}, bos),
                ({"prompt": "", "add_special_tokens": False}, []),
                ({"messages": CHAT}, chat),
                ({"messages": CHAT, "add_special_tokens": False}, chat),
                ({"messages": CHAT, "add_special_tokens": True}, bos + chat),
            ]:
                status, answer = await post(http, "/tokenize", body)
                assert status == 200, answer
                assert answer["tokens"] == expected, body
                assert answer["count"] == len(expected)
            # Generation is unchanged: its prompt is tokenized without special tokens.
            status, done = await post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
            assert status == 200
            assert done["usage"]["prompt_tokens"] == len(plain)


class TestRequestIds:
    async def test_a_requests_id_is_echoed_on_answers_errors_and_streams(
        self, http: aiohttp.ClientSession
    ) -> None:
        rid = {"x-request-id": "req-42_ABC.def~" + "x" * 113}  # 128 characters
        async with http.get("/health", headers=rid) as r:
            assert r.headers["x-request-id"] == rid["x-request-id"]
        async with http.get("/nowhere", headers=rid) as r:
            assert (r.status, r.headers["x-request-id"]) == (404, rid["x-request-id"])
        status, _ = await post(http, "/v1/completions", {"prompt": ""}, headers=rid)
        assert status == 400
        for stream in (False, True):
            body = {"prompt": PROMPT, "max_tokens": 3, "stream": stream}
            async with http.post("/v1/completions", json=body, headers=rid) as r:
                assert r.status == 200
                assert r.headers["x-request-id"] == rid["x-request-id"]
                await r.read()

    async def test_the_openai_client_sees_the_id(self, client: AsyncOpenAI) -> None:
        raw = await client.completions.with_raw_response.create(
            model=BUNDLED_MODEL_ID,
            prompt=PROMPT,
            max_tokens=3,
            extra_headers={"X-Request-Id": "abc"},
        )
        assert raw.headers["x-request-id"] == "abc"

    async def test_without_an_id_each_request_gets_a_new_one(
        self, http: aiohttp.ClientSession
    ) -> None:
        ids = []
        for _ in range(3):
            async with http.get("/health") as r:
                ids.append(r.headers["x-request-id"])
        assert len(set(ids)) == 3
        assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)

    @pytest.mark.parametrize(
        "given",
        [
            b"x" * 129,
            b"caf\xc3\xa9",
            b"a b",
            b"tab\there",
            b"\xff\xfe",
            b"",
        ],
    )
    async def test_an_id_too_long_or_not_visible_ascii_is_replaced(
        self, server: Served, given: bytes
    ) -> None:
        head = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-request-id: "
        answer = await raw_request(server, head + given + b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        echoed = re.search(rb"\r\nx-request-id: ([^\r]*)\r\n", answer)
        assert echoed is not None
        assert re.fullmatch(rb"[0-9a-f]{32}", echoed.group(1))

    async def test_the_bound_is_a_setting(self, module_server: Served) -> None:
        assert module_server.pipeline is not None
        config = ServeConfig(max_request_id_length=4)
        app = OpenAIApp(PipelineEngine(module_server.pipeline), config=config)
        async with serve(app) as (_, url), aiohttp.ClientSession(base_url=url) as http:
            async with http.get("/health", headers={"x-request-id": "abcd"}) as r:
                assert r.headers["x-request-id"] == "abcd"
            async with http.get("/health", headers={"x-request-id": "abcde"}) as r:
                assert len(r.headers["x-request-id"]) == 32
            await app.wait_idle()


async def read_events(response: aiohttp.ClientResponse, count: int) -> bytes:
    """Read until ``count`` events have arrived."""
    data = b""
    while data.count(b"\n\n") < count:
        data += await response.content.readany()
    return data


class TestDisconnects:
    async def test_a_client_leaving_mid_stream_abandons_the_request_at_its_worker(
        self, server: Served
    ) -> None:
        before = [await server.worker_stats(k) for k in range(2)]
        disconnects = server.app.statistics().disconnects
        body = {"prompt": PROMPT, "max_tokens": 480, "stream": True, "ignore_eos": True}
        async with (
            aiohttp.ClientSession(base_url=server.url) as session,
            session.post("/v1/completions", json=body) as response,
        ):
            assert response.status == 200
            await read_events(response, 3)
            response.close()  # drops the connection: 480 steps would take a second
        await server.settle()
        assert server.app.statistics().disconnects == disconnects + 1
        after = [await server.worker_stats(k) for k in range(2)]
        assert sum(a.released - b.released for a, b in zip(after, before, strict=True)) == 1
        assert [a.requests for a in after] == [0, 0]

    async def test_a_client_leaving_before_a_whole_completion_abandons_it_too(
        self, server: Served
    ) -> None:
        before = [await server.worker_stats(k) for k in range(2)]
        body = (
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, '
            b'"ignore_eos": true}'
        )
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\n" + f"content-length: {len(body)}\r\n\r\n".encode()
        )
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(head + body)
        await writer.drain()
        await server.wait_in_flight(1)
        writer.close()
        await writer.wait_closed()
        await server.settle()
        after = [await server.worker_stats(k) for k in range(2)]
        assert sum(a.released - b.released for a, b in zip(after, before, strict=True)) == 1
        assert [a.requests for a in after] == [0, 0]


class GatedEngine(PipelineEngine):
    """A real pipeline engine whose long prompts, each in its tokenizer thread, wait for a
    gate to open; ``encoded`` counts the prompts it was given."""

    def __init__(self, pipeline: Pipeline, gate: threading.Event) -> None:
        super().__init__(pipeline)
        self.gate = gate
        self.encoded = 0

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if len(text) > INLINE_CHARS:
            self.encoded += 1
            self.gate.wait(20)
        return super().encode(text, add_special_tokens=add_special_tokens)


class TestDisconnectsWhileTokenizing:
    async def test_a_client_leaving_while_its_prompt_waits_for_a_tokenizer_thread_frees_it(
        self, module_server: Served
    ) -> None:
        """Before, a prompt was tokenized whatever became of its client: clients that sent
        long prompts and left had a worker tokenize each one (a second of CPU a MiB) before
        the prompts of the clients still there, which waited behind them."""
        assert module_server.pipeline is not None
        gate = threading.Event()
        engine = GatedEngine(module_server.pipeline, gate)
        app = OpenAIApp(engine, config=CONFIG)
        body = msgspec.json.encode({"prompt": "word " * (INLINE_CHARS // 4), "max_tokens": 2})
        request = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        request += b"content-length: %d\r\n\r\n%s" % (len(body), body)
        queued = 3
        async with serve(app) as (_, url):
            try:
                await _leave_while_tokenizing(app, engine, url, request, queued)
            finally:
                gate.set()  # the threads are let go, whatever happened
            with anyio.fail_after(20):
                await app.wait_idle()
        assert engine.encoded == TOKENIZER_THREADS
        assert app.statistics().disconnects >= queued


async def _leave_while_tokenizing(
    app: OpenAIApp, engine: GatedEngine, url: str, request: bytes, queued: int
) -> None:
    """Send ``request`` on as many connections as there are tokenizer threads and
    ``queued`` more, then leave once the threads hold theirs, and wait (5 s at most) until
    the app has abandoned the ones waiting for a thread."""
    port = int(url.rpartition(":")[2])
    writers = []
    try:
        for _ in range(TOKENIZER_THREADS + queued):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            writers.append(writer)
        with anyio.fail_after(10):
            # Both threads hold a prompt; the others wait for one.
            await _until(
                lambda: (
                    engine.encoded == TOKENIZER_THREADS and app.statistics().active == len(writers)
                )
            )
    finally:
        for writer in writers:
            writer.close()
    with anyio.move_on_after(5):
        await _until(lambda: app.statistics().disconnects >= queued)


async def _until(condition: Callable[[], bool]) -> None:
    """Return once ``condition()`` holds (nothing announces the counters it reads)."""
    while not condition():
        await anyio.lowlevel.checkpoint()


class BrokenEngine(PipelineEngine):
    """A real pipeline engine whose whole generations fail, and whose streams end early."""

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> Completion:
        raise EngineError("deliberately broken")

    async def stream(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> AsyncGenerator[Chunk, None]:
        async with aclosing(super().stream(prompt, params, traceparent=traceparent)) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason is not None:
                    return  # the last chunk never comes
                yield chunk


class TestServerFaults:
    async def test_an_engine_failure_is_a_500_before_output_and_an_error_event_after(
        self, module_server: Served
    ) -> None:
        assert module_server.pipeline is not None
        app = OpenAIApp(BrokenEngine(module_server.pipeline), config=CONFIG)
        async with serve(app) as (_, url), aiohttp.ClientSession(base_url=url) as http:
            status, error = await post(http, "/v1/completions", {"prompt": PROMPT})
            assert status == 500
            assert error["error"]["type"] == "server_error"
            body = {"prompt": PROMPT, "max_tokens": 20, "stream": True, "ignore_eos": True}
            async with http.post("/v1/completions", json=body) as r:
                assert r.status == 200
                events = sse_events(await r.read())
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["type"] == "server_error"
            assert all("choices" in e for e in events[:-2])
            await app.wait_idle()
        assert app.statistics().server_errors == 2

    async def test_a_closed_pipeline_answers_503_with_a_retry_hint(self) -> None:
        async with Pipeline(workers=1) as p:
            engine = PipelineEngine(p)
        app = OpenAIApp(engine, config=CONFIG)
        async with serve(app) as (_, url), aiohttp.ClientSession(base_url=url) as http:
            for stream in (False, True):
                body = {"prompt": PROMPT, "stream": stream}
                async with http.post("/v1/completions", json=body) as r:
                    assert r.status == 503
                    assert r.headers["retry-after"] == "5"
                    error = await r.json()
                assert error["error"]["type"] == "server_error"
                assert error["error"]["code"] == "service_unavailable"
                assert "closed" in error["error"]["message"]
            await still_serves_no_more(http)
            await app.wait_idle()

    async def test_a_worker_killed_mid_stream_ends_it_with_an_error_event(self) -> None:
        async with serve_pipeline(workers=1, step_time=0.01) as served:
            p = served.pipeline
            assert p is not None
            body = {"prompt": PROMPT, "max_tokens": 1000, "stream": True, "ignore_eos": True}
            async with aiohttp.ClientSession(base_url=served.url) as http:
                async with http.post("/v1/completions", json=body) as r:
                    assert r.status == 200
                    head = await read_events(r, 2)
                    killed = p.kill_worker(0)
                    events = sse_events(head + await r.read())
                assert events[-1] == "[DONE]"
                assert events[-2]["error"]["code"] == "service_unavailable"
                assert "lost its worker" in events[-2]["error"]["message"]
                assert "choices" in events[0]
                await p.wait_worker(0, after=killed.incarnation, timeout=30)
                await still_serves(http)


class ContextEngine(PipelineEngine):
    """A real pipeline engine that records the caller's trace context each request had."""

    seen: list[str | None]

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> Completion:
        self.seen.append(traceparent)
        return await super().generate(prompt, params, traceparent=traceparent)


class TestTheCallersTraceContext:
    async def test_each_request_has_its_own_even_when_one_task_serves_them_all(
        self, module_server: Served
    ) -> None:
        # An in-process client calls the app in its own task, request after request.
        assert module_server.pipeline is not None
        engine = ContextEngine(module_server.pipeline)
        engine.seen = []
        app = OpenAIApp(engine, config=CONFIG)
        traceparent = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        sent: list[MutableMapping[str, Any]] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        for headers in ([(b"traceparent", traceparent)], [], [(b"traceparent", b"junk")]):
            body = [{"type": "http.request", "body": msgspec.json.encode({"prompt": PROMPT})}]

            async def receive(body: list[dict[str, Any]] = body) -> MutableMapping[str, Any]:
                if body:
                    return body.pop()
                await anyio.sleep_forever()  # sync-ok: a client that stays connected
                raise AssertionError

            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/completions",
                "headers": [(b"content-type", b"application/json"), *headers],
            }
            with anyio.fail_after(10):
                await app(scope, receive, send)
        assert engine.seen == [traceparent.decode(), None, None]
        assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200] * 3


class CountingEngine(PipelineEngine):
    """A real pipeline engine that counts the chunks the app pulled from its streams."""

    pulled = 0

    async def stream(
        self, prompt: str | list[int], params: SamplingParams, *, traceparent: str | None = None
    ) -> AsyncGenerator[Chunk, None]:
        async with aclosing(super().stream(prompt, params, traceparent=traceparent)) as chunks:
            async for chunk in chunks:
                self.pulled += 1
                yield chunk


class TestPushBack:
    async def test_a_stream_whose_send_waits_is_not_read_meanwhile(
        self, module_server: Served
    ) -> None:
        """The app is driven directly, its ``send`` held as a server holds it for a client
        that does not read: while held, nothing more is taken from the engine, whose text
        waits in the pipeline and comes in one piece once ``send`` returns."""
        assert module_server.pipeline is not None
        engine = CountingEngine(module_server.pipeline)
        app = OpenAIApp(engine, config=CONFIG)
        body = {"prompt": PROMPT, "max_tokens": 300, "stream": True, "ignore_eos": True}
        request = {"type": "http.request", "body": msgspec.json.encode(body)}
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"content-type", b"application/json")],
        }
        sent: list[MutableMapping[str, Any]] = []
        held = anyio.Event()
        release = anyio.Event()

        async def receive() -> MutableMapping[str, Any]:
            if request:
                message = dict(request)
                request.clear()
                return message
            await anyio.sleep_forever()  # sync-ok: a client that never disconnects
            raise AssertionError

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not release.is_set():
                held.set()
                await release.wait()

        finished = (await module_server.worker_stats(0)).finished
        finished += (await module_server.worker_stats(1)).finished
        async with anyio.create_task_group() as tg:
            tg.start_soon(app, scope, receive, send)
            with anyio.fail_after(10):
                await held.wait()
                while True:  # until the engine has generated all 300 tokens
                    stats = [await module_server.worker_stats(k) for k in range(2)]
                    if sum(s.finished for s in stats) > finished:
                        break
            assert engine.pulled == 1
            release.set()
        bodies = b"".join(m["body"] for m in sent if m["type"] == "http.response.body")
        events = sse_events(bodies)
        assert events[-1] == "[DONE]"
        assert engine.pulled <= 3  # the first piece, then everything at once
        whole = await module_server.pipeline.generate(
            engine.encode(PROMPT), max_new_tokens=300, ignore_eos=True
        )
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole.text


class TestLifespan:
    async def test_the_lifespan_opens_the_engine_and_closes_it_at_shutdown(self) -> None:
        app = OpenAIApp(open_engine=lambda: PipelineEngine.open(workers=1), config=CONFIG)
        engines: list[object] = [app.engine]
        async with (
            serve(app, fresh_context=True) as (_, url),
            aiohttp.ClientSession(base_url=url) as http,
        ):
            engines.append(app.engine)
            await still_serves(http)
            await app.wait_idle()
        engines.append(app.engine)
        assert engines[0] is None
        assert isinstance(engines[1], PipelineEngine)
        assert engines[2] is None

    async def test_an_engine_that_fails_to_open_fails_the_startup(self) -> None:
        app = OpenAIApp(open_engine=lambda: PipelineEngine.open(workers=1, context_length=1))
        with pytest.raises(RuntimeError, match="did not start"):
            async with serve(app, fresh_context=True):
                pass

    def test_exactly_one_of_engine_and_open_engine_is_taken(self) -> None:
        with pytest.raises(ValueError, match="exactly one"):
            OpenAIApp()
