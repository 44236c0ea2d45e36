"""What the vLLM tests share: the venv's Python, the engine's settings on this 2-CPU host,
and the processes of a launched engine."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

from actors._vllm_engine import process_tree

ROOT = Path(__file__).resolve().parents[2]

#: vLLM's venv (``make test-engines`` builds it with install-vllm.sh).
PYTHON = os.environ.get("TOKENYARD_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")

#: One OpenMP thread, unbound, and a 1 GiB KV cache: the host has 2 CPUs, shared.
ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}

#: ``vllm serve`` arguments for the test model (`actors._hf_model`): random weights.
MAX_NUM_SEQS = 8
ARGS = (
    "--load-format",
    "dummy",
    "--max-model-len",
    "4096",
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--dtype",
    "bfloat16",
    "--enforce-eager",
)


def title(pid: int) -> str:
    """A process's command line, as it shows in ps (vLLM names its processes VLLM::...)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def engine_core_of(pid: int) -> int | None:
    """The pid of the engine core process below ``pid`` (``VLLM::EngineCore``), if any."""
    return next((p for p in process_tree(pid)[1:] if "EngineCore" in title(p)), None)


def vllm_processes() -> set[int]:
    """Every process of this host that is a vLLM engine or its launcher (by command line)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            text = title(int(entry.name))
            if "VLLM::" in text or "_vllm_cli.py" in text:
                found.add(int(entry.name))
    return found


def shared_memory() -> set[Path]:
    """vLLM's shared memory files (``/dev/shm/psm_*``)."""
    return set(Path("/dev/shm").glob("psm_*"))


def vllm_sockets() -> set[str]:
    """What vLLM leaves in the temporary directory: ipc socket files named by a UUID (its
    default ``VLLM_RPC_BASE_PATH``) when it is killed, its process group's rendezvous file
    (``vllm_dist_<uuid>``) however it ends, or the private directory the launcher gives it
    for both instead."""
    found = set()
    with os.scandir(tempfile.gettempdir()) as entries:
        for entry in entries:
            if entry.name.startswith(("tokenyard-vllm-", "vllm_dist_")) or (
                UUID.fullmatch(entry.name) and stat.S_ISSOCK(entry.stat().st_mode)
            ):
                found.add(entry.name)
    return found


UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
