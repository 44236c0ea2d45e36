"""Serve the OpenAI-compatible API over a Pipeline with uvicorn, and call it with the official
``openai`` client: a completion, a streamed chat with its usage, and a refusal.

The listening socket is bound before the server starts, so its port is known at once and a
client may connect straight away (the kernel queues the connection until uvicorn accepts);
it turns Nagle's algorithm off, as asyncio does for the sockets it makes itself.
"""

from __future__ import annotations

import socket

import anyio
import openai
import uvicorn

from actors.http import OpenAIApp, PipelineEngine, ServeConfig


async def main() -> None:
    sock = socket.socket()
    # asyncio turns Nagle off only on sockets it made: without this, every streamed chunk
    # after the first waits up to 40 ms for the client's delayed ACK (connections accepted
    # from this socket inherit the option).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with PipelineEngine.open(workers=2) as engine:
        app = OpenAIApp(engine, config=ServeConfig(default_max_tokens=16))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused") as client:
                model = (await client.models.list()).data[0].id
                print(f"serving {model} on {url}")

                done = await client.completions.create(
                    model=model,
                    prompt="Hello there",
                    max_tokens=16,
                    extra_body={"ignore_eos": True},
                )
                assert done.usage is not None
                choice = done.choices[0]
                print(
                    f"completion ({choice.finish_reason}, {done.usage.completion_tokens} "
                    f"tokens): {choice.text!r}"
                )

                stream = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Bonjour à tous 😀"}],
                    stream=True,
                    stream_options={"include_usage": True},
                )
                pieces, usage = [], None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)
                    usage = chunk.usage or usage
                assert usage is not None
                print(
                    f"chat: {len(pieces)} pieces, {usage.prompt_tokens} prompt and "
                    f"{usage.completion_tokens} completion tokens"
                )

                try:
                    await client.completions.create(model=model, prompt="Hi", n=2)
                except openai.BadRequestError as err:
                    print(f"refused with {err.status_code}, naming the parameter {err.param!r}")
            server.should_exit = True
    print("server stopped, pipeline closed")


if __name__ == "__main__":
    anyio.run(main)
