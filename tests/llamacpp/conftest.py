"""The llama.cpp tests' model and server: built once per session, from the bundled tokenizer.

The model is the default of ``python -m actors make-model``: random weights that write byte
fragments, so every test that generates goes through the held-back ids of
`actors._llamacpp`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from actors._gguf import MODEL_FILE, write_model_dir
from actors._llamacpp import LlamaCppServer, Sampling
from actors._tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from actors._llamacpp import Finished

#: Slots and per-slot context of the shared server.
N_PARALLEL = 2
CONTEXT = 512


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory written by `write_model_dir` with its defaults."""
    directory = tmp_path_factory.mktemp("model")
    write_model_dir(directory)
    return directory


@pytest.fixture(scope="session")
def model(model_dir: Path) -> Path:
    """The default test model's GGUF."""
    return model_dir / MODEL_FILE


@pytest.fixture(scope="session")
def hf() -> object:
    """The bundled Hugging Face tokenizer."""
    return load_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[LlamaCppServer]:
    """One server for a test module (it starts in a tenth of a second)."""
    with LlamaCppServer(model, n_parallel=N_PARALLEL, context_length=CONTEXT) as running:
        yield running


class Collected:
    """What a generation handed back: its ids, in the calls they came in, and its end."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.finished: list[Finished] = []

    @property
    def ids(self) -> list[int]:
        return [i for call in self.calls for i in call]

    @property
    def end(self) -> Finished:
        assert len(self.finished) == 1, self.finished
        return self.finished[0]


def generate(
    server: LlamaCppServer, prompt: list[int], sampling: Sampling, timeout: float = 10.0
) -> Collected:
    """Run one generation to its end."""
    got = Collected()
    generation = server.submit(prompt, sampling, got.calls.append, got.finished.append)
    assert generation.wait(timeout), "the generation did not finish"
    return got
