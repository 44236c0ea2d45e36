"""`LlamaCppModel`: llama.cpp as the scheduler's `actors.engines.Generator`.

The scheduler admits at most ``n_parallel`` requests (the generator's capacity), so every
admitted one has a llama.cpp slot at once and llama.cpp batches them continuously. Each
generation runs in a worker thread of `actors._llamacpp.LlamaCppServer` with the GIL
released; its ids land in a per-request buffer under a lock, and ``notify`` wakes the
scheduler, which takes what every request produced since its last step as one step.

The model's vocabulary must be the pipeline tokenizer's: it is checked when the model is
opened (the vocabulary size, and llama.cpp's tokenization of a sample text against the
tokenizer's), so that a mismatch is one clear error, not garbage text.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from runtime import Throttle

from ._tokenizer import eos_token_id, vocab_size
from .engines import Produced

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from ._llamacpp import Finished, Generation, LlamaCppServer
    from .engines import LlamaCpp
    from .messages import SamplingParams

__all__ = ("LlamaCppModel", "open_llamacpp")

logger = logging.getLogger("tokenyard.llamacpp")

#: Text whose tokenization by llama.cpp and by the pipeline's tokenizer must agree.
_SAMPLE = "The harbour of Yokohama, 横浜港, at dawn: 😀 ships → ports; «été» 123.\n"


class _Output:
    """What one request produced and nobody took yet (written by its worker thread)."""

    __slots__ = ("finished", "generation", "ids")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.finished: str | None = None
        self.generation: Generation | None = None


class LlamaCppModel:
    """llama.cpp behind the scheduler (see the module).

    Args:
        server: The llama.cpp server, its model loaded.
        vocab_size: Ids ``0..vocab_size-1`` are the model's.
        eos: The end-of-sequence id, if any.
        notify: Called, from a worker thread, when output is ready.
    """

    def __init__(
        self,
        server: LlamaCppServer,
        *,
        vocab_size: int,
        eos: int | None,
        notify: Callable[[], None],
    ) -> None:
        self._server = server
        self._vocab_size = vocab_size
        self._eos = eos
        self._notify = notify
        self._lock = threading.Lock()
        self._live: dict[Hashable, _Output] = {}
        self._ready = False
        self._errors = Throttle(logger)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        return self._vocab_size

    @property
    def eos(self) -> int | None:
        """The tokenizer's eos."""
        return self._eos

    @property
    def capacity(self) -> int:
        """llama.cpp's slots."""
        return self._server.n_parallel

    @property
    def pace(self) -> float:
        """No pause: each step is whatever came since the last."""
        return 0.0

    @property
    def context_length(self) -> int:
        """Each slot's share of the KV cache."""
        return self._server.context_length

    def admit(self, key: Hashable, prompt_ids: list[int], sampling: SamplingParams) -> int:
        """Start generating in a slot of its own."""
        from ._llamacpp import Sampling

        output = _Output()
        with self._lock:
            self._live[key] = output

        def on_ids(ids: list[int]) -> None:
            with self._lock:
                if self._live.get(key) is not output:
                    return  # cancelled: nobody takes it
                output.ids.extend(ids)
                self._ready = True
            self._notify()

        def on_finish(finished: Finished) -> None:
            if finished.reason == "error":
                self._errors.warning("llama.cpp failed a request: %s", finished.error)
            with self._lock:
                if self._live.get(key) is not output:
                    return
                output.finished = "abort" if finished.reason == "error" else finished.reason
                self._ready = True
            self._notify()

        output.generation = self._server.submit(
            prompt_ids,
            Sampling(
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                seed=sampling.seed if sampling.temperature > 0 else None,
                stop_token_ids=tuple(sampling.stop_token_ids),
                ignore_eos=sampling.ignore_eos,
            ),
            on_ids,
            on_finish,
        )
        return 0

    def cancel(self, key: Hashable) -> None:
        """Abort its generation (its slot is freed at its next step)."""
        with self._lock:
            output = self._live.pop(key, None)
        if output is not None and output.generation is not None:
            self._server.abort(output.generation)

    def ready(self) -> bool:
        """Whether some request produced ids, or ended, since the last take."""
        with self._lock:
            return self._ready

    def take(self) -> dict[Hashable, Produced]:
        """Every request's ids since the last take, and the ends llama.cpp reached."""
        taken: dict[Hashable, Produced] = {}
        with self._lock:
            self._ready = False
            for key, output in list(self._live.items()):
                if not output.ids and output.finished is None:
                    continue
                taken[key] = Produced(output.ids, output.finished)
                output.ids = []
                if output.finished is not None:
                    del self._live[key]
        return taken

    def flush(self) -> bool:
        """llama.cpp's cache is its slots' own: nothing to forget when nothing runs."""
        with self._lock:
            return not self._live

    async def aclose(self) -> None:
        """Abort everything and stop llama.cpp (its threads joined, in a thread of its own so
        the event loop keeps running)."""
        import anyio.to_thread

        with self._lock:
            self._live.clear()
        await anyio.to_thread.run_sync(self._server.close)


async def open_llamacpp(
    spec: LlamaCpp, tokenizer: Any, notify: Callable[[], None]
) -> LlamaCppModel:
    """Load ``spec.model`` and check it against the pipeline's tokenizer.

    Raises:
        ValueError: The model's vocabulary is not the tokenizer's.
        FileNotFoundError: The model file does not exist.
        ImportError: xllamacpp is not installed (the ``llamacpp`` extra).
    """
    import anyio.to_thread

    from ._llamacpp import LlamaCppServer

    def load() -> LlamaCppServer:
        # A large model takes a while: the log says what loads and, after, how long it
        # took (at WARNING, the default level, as a launched vLLM engine's progress is).
        gib = os.path.getsize(spec.model) / (1 << 30)
        logger.warning("loading llama.cpp's model %s (%.1f GiB)", spec.model, gib)
        began = time.monotonic()
        server = LlamaCppServer(
            spec.model,
            n_parallel=spec.n_parallel,
            context_length=spec.context_length,
            threads=spec.threads,
        )
        logger.warning("llama.cpp's model loaded in %.1f s", time.monotonic() - began)
        return server

    server = await anyio.to_thread.run_sync(load)
    try:
        size = vocab_size(tokenizer)
        theirs = server.tokenize(_SAMPLE)
        ours = tokenizer.encode(_SAMPLE, add_special_tokens=False).ids
        if theirs != ours:
            raise ValueError(
                f"the model {spec.model} does not tokenize as the pipeline's tokenizer does "
                f"(llama.cpp: {theirs[:8]}..., the tokenizer: {ours[:8]}...): give the "
                "tokenizer.json of this model (serve --tokenizer)"
            )
    except BaseException:
        server.close()
        raise
    return LlamaCppModel(server, vocab_size=size, eos=eos_token_id(tokenizer), notify=notify)
