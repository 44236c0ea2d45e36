"""One llama.cpp generation, as `actors._llamacpp.LlamaCppServer` takes and reports it:
how it samples (`Sampling`), how it ended (`Finished`), the caller's handle (`Generation`)
and the state a worker thread keeps while it runs (`Run`: ids handed on, stop ids and
``max_new_tokens`` applied, the request body for the position reached).

No llama.cpp here: these are plain values, so that the server's module is only about
driving llama.cpp.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ("FinishReason", "Finished", "Generation", "LlamaCppError", "Run", "Sampling")

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a generation ended: an eos or stop token, the token or context limit, an abort, or
an engine error."""

#: llama.cpp's "draw a random seed" value, never sent as a derived seed.
_RANDOM_SEED = 0xFFFFFFFF

#: Temperatures below this are greedy. llama.cpp divides the logits by the temperature in
#: float32: a temperature in float32's subnormal range (about 1e-45 to 1.2e-38) overflows
#: them to infinity and the "sample" is one fixed token, not the greedy one (vLLM 0.32 is
#: greedy only at 0: it raises a temperature between 0 and 0.01 to 0.01, and samples).
_GREEDY_BELOW = 1e-5


class LlamaCppError(RuntimeError):
    """llama.cpp refused or failed a request, or the server could not start."""


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """How to generate.

    Plain temperature sampling: llama.cpp's top-k, top-p and min-p filters are turned off
    and no penalty applies, as the front end's stand-in engine does.

    Attributes:
        max_new_tokens: Most tokens to generate (0 finishes at once with ``length``).
        temperature: 0 is greedy.
        seed: Seed of the draws (``None``: llama.cpp draws one).
        stop_token_ids: Ids that finish the request with ``stop`` (the id is handed back).
        ignore_eos: Do not finish on the model's end-of-generation tokens (llama.cpp biases
            them away).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    """How a generation ended, passed once to ``on_finish``.

    Attributes:
        reason: See `FinishReason`.
        prompt_tokens: Prompt length in tokens.
        completion_tokens: Ids handed to ``on_ids``.
        recovered_tokens: Of those, ids the stream held back and `TokenPieces.spell`
            recovered from their bytes.
        stepped_tokens: Of those, ids generated one at a time (the fallback).
        error: What failed, when ``reason`` is ``"error"``.
    """

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    recovered_tokens: int = 0
    stepped_tokens: int = 0
    error: str | None = None


class Generation:
    """One submitted generation: `LlamaCppServer.abort` takes it; `wait` blocks until its
    ``on_finish`` has run.

    Attributes:
        id: Its number in the server, from 1.
        prompt_ids: The prompt.
        sampling: How it generates.
        finished: How it ended, once it has.
    """

    def __init__(
        self,
        generation_id: int,
        prompt_ids: list[int],
        sampling: Sampling,
        on_ids: Callable[[list[int]], object],
        on_finish: Callable[[Finished], object],
    ) -> None:
        self.id = generation_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.finished: Finished | None = None
        self._on_ids = on_ids
        self._on_finish = on_finish
        self._abort = threading.Event()
        self._done = threading.Event()

    @property
    def aborted(self) -> bool:
        """Whether an abort was asked for."""
        return self._abort.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the generation has finished; ``False`` if ``timeout`` passed first."""
        return self._done.wait(timeout)

    def abort(self) -> None:
        """Ask its worker thread to stop it (the server's `abort` calls this)."""
        self._abort.set()

    def finish(self, finished: Finished) -> None:
        """Record how it ended, tell ``on_finish``, then release `wait` (its worker thread
        calls this once)."""
        self.finished = finished
        try:
            self._on_finish(finished)
        finally:
            self._done.set()

    def __repr__(self) -> str:
        return f"<Generation {self.id} {self.finished.reason if self.finished else 'running'}>"


class Run:
    """The state of one generation while a worker thread runs it."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.sampling = generation.sampling
        self.stop_ids = frozenset(generation.sampling.stop_token_ids)
        self.ids: list[int] = []
        self.recovered = 0
        self.stepped = 0
        self.reason: FinishReason | None = None

    @property
    def remaining(self) -> int:
        return self.sampling.max_new_tokens - len(self.ids)

    def deliver(self, ids: list[int]) -> None:
        """Hand ``ids`` on, up to and including a stop token; stop at ``max_new_tokens``."""
        for n, token in enumerate(ids):
            if token in self.stop_ids:
                ids = ids[: n + 1]
                self.reason = "stop"
                break
        ids = ids[: self.remaining]
        if ids:
            self.ids += ids
            self.generation._on_ids(ids)
        if self.reason is None and self.remaining <= 0:
            self.reason = "length"

    def body(self) -> dict[str, Any]:
        """The sampling part of a request, for its current position."""
        body: dict[str, Any] = {
            "prompt": self.generation.prompt_ids + self.ids,
            "temperature": (
                self.sampling.temperature if self.sampling.temperature >= _GREEDY_BELOW else 0.0
            ),
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "ignore_eos": self.sampling.ignore_eos,
            "cache_prompt": True,
        }
        if self.sampling.seed is not None:
            # The first request keeps the seed: a run that never falls back draws exactly
            # what llama.cpp would for it.
            seed = (self.sampling.seed + len(self.ids) * 0x9E3779B1) & 0xFFFFFFFF
            body["seed"] = seed if seed != _RANDOM_SEED else _RANDOM_SEED - 1
        return body
