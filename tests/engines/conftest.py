"""The vLLM tests: `make test-engines` (not in `make test`: they need vLLM's venv, which
install-vllm.sh builds, and each engine takes half a minute to start)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from actors._hf_model import write_hf_model_dir

from ._vllm import shared_memory, vllm_processes, vllm_sockets

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model (`actors._hf_model`): random weights, nothing downloaded."""
    return write_hf_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module", autouse=True)
def no_engine_left() -> Iterator[None]:
    """Fail a module that leaves a vLLM process, its shared memory or its ipc socket files
    behind (they are not this process's children, which the suite-wide guard checks)."""
    procs, shm, sockets = vllm_processes(), shared_memory(), vllm_sockets()
    yield
    assert not vllm_processes() - procs, "vLLM processes left behind"
    assert not shared_memory() - shm, "vLLM shared memory left behind"
    assert not vllm_sockets() - sockets, "vLLM ipc sockets left behind"
