"""docs/examples/fastapi_app.py under a real uvicorn server, and its error mapping in-process.

The server runs as a subprocess on 127.0.0.1 with a free port; it is shut down by a signal,
and the test checks that every pipeline process it started is gone and that its ipc
directory was removed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from actors import Member, WorkerDiedError
from tests.conftest import free_port

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from types import ModuleType

    from anyio.abc import Process

ROOT = Path(__file__).resolve().parents[2]
APP_FILE = ROOT / "docs" / "examples" / "fastapi_app.py"
WORKERS = 2
#: Seconds per step of the stand-in engine: a long stream lasts long enough to disconnect.
STEP_TIME = 0.005
PROMPTS = [f"request {i}: tell me about {w}" for i, w in enumerate(["cats", "ships"] * 10)]


def tokenyard_children(parent: int) -> dict[int, str]:
    """``{pid: start time}`` of the ``tokenyard::`` processes whose parent is ``parent``.

    The start time tells a survivor from an unrelated process that reused its pid later.
    (A child's environment cannot mark it: setproctitle writes the title over it.)
    """
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes()
            stat = (proc / "stat").read_text()
        except OSError:
            continue  # exited during the scan
        fields = stat.rpartition(")")[2].split()  # after "pid (comm)": state, ppid, ...
        if title.startswith(b"tokenyard::") and int(fields[1]) == parent:
            found[int(proc.name)] = fields[19]
    return found


def still_alive(procs: dict[int, str]) -> dict[int, str]:
    """Which of ``procs`` (from `tokenyard_children`) still run, with their titles."""
    alive: dict[int, str] = {}
    for pid, started in procs.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[19] == started:
            alive[pid] = title.rstrip(b"\0 ").decode(errors="replace")
    return alive


def ipc_dirs_of(pid: int) -> list[str]:
    """The actor-system directories process ``pid`` created in the temp dir."""
    return sorted(p.name for p in Path(tempfile.gettempdir()).glob(f"tokenyard-{pid}-*"))


def parse_sse(lines: list[str]) -> list[tuple[str, Any]]:
    """``(event, decoded data)`` for each event of a ``text/event-stream`` body."""
    events: list[tuple[str, Any]] = []
    event, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                events.append((event, json.loads("\n".join(data))))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))
    return events


@dataclass
class Server:
    process: Process
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    """``python -m uvicorn docs.examples.fastapi_app:app`` on a free port, once it serves."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        TOKENYARD_WORKERS=str(WORKERS),
        TOKENYARD_STEP_TIME=str(STEP_TIME),
    )
    command = [sys.executable, "-m", "uvicorn", "docs.examples.fastapi_app:app"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        process = await anyio.open_process(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env
        )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            for _ in range(600):  # a readiness probe: at most 60 s at 0.1 s a try
                if process.returncode is not None:
                    pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()}")
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.1)  # sync-ok: an external server says ready only over HTTP
            else:
                pytest.fail(f"the server did not serve /health within 60 s:\n{log.read_text()}")
        yield Server(process, url, log)
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()  # the test failed before its own shutdown
            await process.aclose()


async def generate(client: httpx.AsyncClient, prompt: str, n: int = 24) -> dict[str, Any]:
    response = await client.post("/generate", json={"prompt": prompt, "max_new_tokens": n})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def stream(client: httpx.AsyncClient, prompt: str, n: int = 24) -> list[tuple[str, Any]]:
    body = {"prompt": prompt, "max_new_tokens": n}
    async with client.stream("POST", "/generate/stream", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return parse_sse([line async for line in response.aiter_lines()])


@pytest.mark.timeout(180)
async def test_the_app_serves_json_and_sse_and_a_signal_leaves_no_process(
    server: Server,
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        # JSON, twice: every field, and the same prompt gives the same output.
        first = await generate(client, "Hello there")
        again = await generate(client, "Hello there")
        assert set(first) == {
            "text",
            "output_ids",
            "prompt_tokens",
            "completion_tokens",
            "finish_reason",
            "worker",
        }
        assert first["text"]
        assert first["prompt_tokens"] > 0
        assert first["completion_tokens"] == len(first["output_ids"])
        assert first["completion_tokens"] == 24 or first["finish_reason"] == "stop"
        assert first["worker"] in range(WORKERS)
        assert (again["text"], again["output_ids"]) == (first["text"], first["output_ids"])

        # SSE: one data event per piece, then `done`; the pieces join to the JSON text.
        events = await stream(client, "Bonjour à tous 😀")
        whole = await generate(client, "Bonjour à tous 😀")
        assert events[-1] == ("done", {"pieces": len(events) - 1})
        pieces = [data for kind, data in events[:-1] if kind == "message"]
        assert len(pieces) == len(events) - 1 > 1
        assert "".join(pieces) == whole["text"]

        # Refusals: an empty prompt, a missing one.
        for bad in ({"prompt": "", "max_new_tokens": 4}, {"max_new_tokens": 4}):
            assert (await client.post("/generate", json=bad)).status_code == 422
            assert (await client.post("/generate/stream", json=bad)).status_code == 422

        # 20 at once, spread over the workers.
        results: dict[str, dict[str, Any]] = {}

        async def one(prompt: str) -> None:
            results[prompt] = await generate(client, prompt)

        async with anyio.create_task_group() as tg:
            for prompt in PROMPTS:
                tg.start_soon(one, prompt)
        assert len(results) == len(PROMPTS)
        assert {r["worker"] for r in results.values()} == set(range(WORKERS))
        for r in results.values():
            assert r["completion_tokens"] == 24 or r["finish_reason"] == "stop"

        # A client that leaves mid-stream: the server closes the pipeline's stream, which
        # aborts the request, instead of generating 4000 tokens (20 s) for nobody.
        long = {"prompt": "Hello", "max_new_tokens": 4000, "ignore_eos": True}
        async with client.stream("POST", "/generate/stream", json=long) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen == 3:
                    break
        with anyio.fail_after(10):
            while True:
                health = (await client.get("/health")).json()
                if health["streams_open"] == 0:
                    break
                await anyio.sleep(0.05)  # sync-ok: the server reports its streams only over HTTP
        assert health["streams_aborted"] == 1
        assert health["streams_finished"] == 1

    # Shut down by signal: the lifespan closes the pipeline, every process goes with it.
    pid = server.process.pid
    children = tokenyard_children(pid)
    assert len(children) >= WORKERS + 3, "tokenizer workers, scheduler, detokenizer, router"
    assert ipc_dirs_of(pid)
    server.process.send_signal(signal.SIGTERM)
    with anyio.fail_after(30):
        code = await server.process.wait()
    output = server.output()
    assert code in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output, output
    assert not still_alive(children), f"left running: {still_alive(children)}\n{output}"
    assert not ipc_dirs_of(pid), output


def load_app() -> ModuleType:
    """The example as a module (by path: docs/examples is not a package)."""
    spec = importlib.util.spec_from_file_location("fastapi_app_example", APP_FILE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class DyingPipeline:
    """Stands in for a Pipeline whose worker dies: after output for a stream."""

    async def generate(self, text: str, **sampling: Any) -> Any:
        raise WorkerDiedError("r1", Member.WORKER, "killed by signal SIGKILL")

    async def stream(self, text: str, **sampling: Any) -> AsyncIterator[str]:
        yield "partial"
        raise WorkerDiedError("r2", Member.WORKER, "killed by signal SIGKILL")


async def test_a_dead_worker_is_a_503_and_an_error_event() -> None:
    module = load_app()
    app = module.app
    app.dependency_overrides[module.get_pipeline] = DyingPipeline
    app.state.streams = module.StreamCounts()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        body = {"prompt": "Hello", "max_new_tokens": 4}
        response = await client.post("/generate", json=body)
        assert response.status_code == 503
        assert response.json()["detail"]["error"] == "worker_died"
        assert "SIGKILL" in response.json()["detail"]["message"]

        response = await client.post("/generate/stream", json=body)
        assert response.status_code == 200  # the status line went before the death
        events = parse_sse(response.text.split("\n"))
        assert events[0] == ("message", "partial")
        assert events[1][0] == "error"
        assert events[1][1]["detail"]["error"] == "worker_died"
    assert app.state.streams.finished == 1
