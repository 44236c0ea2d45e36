"""A real uvicorn server on 127.0.0.1 in the test's event loop, and ways to wait on it.

The server binds an ephemeral port; the helper waits for its startup to finish (an event
set by its own ``startup``), never for a sleep, and at the end waits until every request
task the server ran has finished, so the suite's leak guard sees none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import uvicorn

from actors import Pipeline
from actors.http import OpenAIApp, PipelineEngine, ServeConfig
from actors.messages import GetWorkerStatistics, WorkerStatistics
from tests.conftest import free_port

if TYPE_CHECKING:
    import socket
    from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence


class ReadyServer(uvicorn.Server):
    """A uvicorn server that says when its startup is over, whether it started or not."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = anyio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start, then set `ready`. A failed startup leaves ``started`` false; uvicorn's
        ``sys.exit`` for it, meant for its command line, is not let out of the test."""
        try:
            await super().startup(sockets)
        except SystemExit:
            self.should_exit = True
        finally:
            self.ready.set()


@dataclass
class Served:
    """A running server.

    Attributes:
        app: The app it serves.
        server: The uvicorn server.
        url: ``http://127.0.0.1:<port>``.
        pipeline: The pipeline behind the app's engine, when the test made one.
    """

    app: OpenAIApp
    server: ReadyServer
    url: str
    pipeline: Pipeline | None = None

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self.url.rpartition(":")[2])

    async def settle(self) -> None:
        """Wait until the app answers nothing and every request task has ended."""
        with anyio.fail_after(10):
            await self.app.wait_idle()
            tasks = set(self.server.server_state.tasks)
            if tasks:
                await asyncio.wait(tasks)

    async def wait_in_flight(self, count: int = 1) -> None:
        """Wait until the pipeline's workers hold ``count`` requests. Nothing announces
        that a request reached its worker, so the workers are asked until they say so."""
        assert self.pipeline is not None
        workers = range(self.pipeline.config.workers)
        with anyio.fail_after(10):
            while sum([(await self.worker_stats(k)).requests for k in workers]) < count:
                pass

    async def worker_stats(self, k: int = 0) -> WorkerStatistics:
        """Worker ``k``'s counters."""
        assert self.pipeline is not None
        ref = self.pipeline.worker_ref(k)
        assert ref is not None
        stats = await ref.ask(GetWorkerStatistics(), timeout=10)
        assert isinstance(stats, WorkerStatistics)
        return stats


async def _in_a_fresh_context(server: ReadyServer) -> None:
    """Run the server in a task of its own with an empty context.

    Its request and lifespan tasks then inherit no actor system from the test: as in a
    server process, the system they use is the one the lifespan opened, not one a module
    fixture of the test opened before (a ref sends through the system its task's context
    names, else the newest one open).
    """
    task = asyncio.create_task(server.serve(), context=contextvars.Context())
    try:
        await asyncio.shield(task)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait([task])


@contextlib.asynccontextmanager
async def serve(
    app: Any, *, fresh_context: bool = False, **config: Any
) -> AsyncIterator[tuple[ReadyServer, str]]:
    """Serve ``app`` with uvicorn on an ephemeral port of 127.0.0.1 until the block ends.

    ``fresh_context`` runs the server in a task with an empty context
    (`_in_a_fresh_context`), for an app whose lifespan opens a pipeline of its own.
    """
    server = ReadyServer(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            lifespan="on",
            log_level="warning",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
            **config,
        )
    )
    async with anyio.create_task_group() as tg:
        if fresh_context:
            tg.start_soon(_in_a_fresh_context, server)
        else:
            tg.start_soon(server.serve)
        await server.ready.wait()
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            try:
                yield server, f"http://127.0.0.1:{port}"
            finally:
                server.should_exit = True
    # Raised here, once the server's task has ended: raised in the task group it would
    # come out wrapped.
    if not server.started:
        raise RuntimeError("uvicorn did not start; its log says why")


@contextlib.asynccontextmanager
async def serve_pipeline(
    workers: int = 1, config: ServeConfig | None = None, **pipeline: Any
) -> AsyncIterator[Served]:
    """A pipeline, an `OpenAIApp` over it, and a uvicorn server in front."""
    async with Pipeline(workers=workers, **pipeline) as p:
        app = OpenAIApp(PipelineEngine(p), config=config)
        async with serve(app) as (server, url):
            served = Served(app, server, url, p)
            try:
                yield served
            finally:
                with anyio.CancelScope(shield=True):
                    await served.settle()


def sse_events(body: bytes) -> list[Any]:
    """The data of each event of a ``text/event-stream`` body (``"[DONE]"`` as itself)."""
    events: list[Any] = []
    for block in body.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        data = block.removeprefix(b"data: ")
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Running:
    """A ``python -m actors serve`` process that said it serves.

    Attributes:
        proc: The process (stdout read up to its first line; stderr piped if asked).
        port: The port it serves on.
        line: The first line it wrote (``serving http://...``).
    """

    proc: subprocess.Popen[str]
    port: int
    line: str


@contextlib.contextmanager
def running_serve(
    *options: str,
    workers: int = 2,
    env: Mapping[str, str] | None = None,
    stderr: bool = False,
    preexec_fn: Callable[[], None] | None = None,
    pass_fds: Sequence[int] = (),
) -> Iterator[Running]:
    """``python -m actors serve --workers N OPTIONS`` on a free port of 127.0.0.1, until the
    block ends (then killed, if it still runs); ``pass_fds`` it inherits."""
    port = free_port()
    command = [sys.executable, "-m", "actors", "serve", "--workers", str(workers)]
    with subprocess.Popen(
        [*command, "--port", str(port), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr else None,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
        cwd=ROOT,
        preexec_fn=preexec_fn,
        pass_fds=pass_fds,
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert "serving http://127.0.0.1" in line, line
            yield Running(proc, port, line)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
