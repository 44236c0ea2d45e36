"""A launched engine's ``/dev/shm`` files (vLLM's ``psm_*``, a few hundred MB each) do not
outlive it when what launched it is killed: the scheduler, or the whole server. Its
launcher (`actors/_vllm_cli.py`) removes them as it ends its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import TYPE_CHECKING

import aiohttp
import anyio
import pytest

from actors._vllm_engine import process_tree, shared_memory_of
from tests.conftest import exits_within
from tests.http._server import running_serve

from ._vllm import ARGS, ENV, PYTHON, title, vllm_sockets

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.timeout(400)


def launcher_of(serve_pid: int) -> int | None:
    """The pid of the engine's launcher below the server (`actors/_vllm_cli.py`)."""
    return next((p for p in process_tree(serve_pid)[1:] if "_vllm_cli.py" in title(p)), None)


def scheduler_of(serve_pid: int) -> int:
    return next(p for p in process_tree(serve_pid)[1:] if "tokenyard::scheduler" in title(p))


async def ready_engine(url: str, serve_pid: int, not_this: int | None = None) -> int:
    """Wait until the server is healthy with an engine launched by another launcher than
    ``not_this``; that launcher's pid."""
    async with aiohttp.ClientSession() as session:
        with anyio.fail_after(240):
            while True:
                launcher = launcher_of(serve_pid)
                async with session.get(f"{url}/health") as response:
                    if response.status == 200 and launcher not in (None, not_this):
                        assert launcher is not None
                        return launcher
                await anyio.sleep(0.5)  # sync-ok: polling the server from outside


def engine_of(launcher: int) -> tuple[list[int], set[Path]]:
    """The engine's processes below ``launcher``, and its shared memory files, as they are
    now (before it is killed)."""
    processes = process_tree(launcher)
    files = shared_memory_of(launcher)
    assert any(path.name.startswith("psm_") for path in files), files
    return processes, files


def assert_nothing_left(processes: list[int], files: set[Path]) -> None:
    for pid in processes:
        assert exits_within(pid, 60), f"{pid} ({title(pid)}) still runs"
    assert not [path for path in files if path.exists()]


async def test_killing_the_scheduler_or_the_server_leaves_no_shared_memory_of_its_engine(
    model_dir: Path,
) -> None:
    env = {"TOKENYARD_VLLM_PYTHON": PYTHON, **ENV}
    options = ["--engine", "vllm", "--model", str(model_dir), "--", *ARGS]
    before = vllm_sockets()
    with running_serve(*options, workers=1, env=env) as served:
        try:
            url = f"http://127.0.0.1:{served.port}"
            serve_pid = served.proc.pid
            launcher = await ready_engine(url, serve_pid)
            processes, files = engine_of(launcher)
            os.kill(scheduler_of(serve_pid), signal.SIGKILL)
            assert_nothing_left(processes, files)
            # The restarted scheduler launches another engine; then the server is killed.
            launcher = await ready_engine(url, serve_pid, not_this=launcher)
            processes, files = engine_of(launcher)
            served.proc.kill()
            served.proc.wait()
            assert_nothing_left(processes, files)
        finally:
            if served.proc.poll() is None:
                served.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    served.proc.wait(90)
    # Nor the socket files of either engine (before, 28 a run of this directory's tests).
    assert vllm_sockets() <= before
