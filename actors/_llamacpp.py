"""llama.cpp in-process: `LlamaCppServer`, generation from token ids that hands back every
generated id step by step, with finish reasons, usage and aborts.

Built on xllamacpp 2026.10.11549 (llama.cpp's own server compiled into a Python extension;
the ``llamacpp`` extra). ``xllamacpp.Server(CommonParams)`` loads the model and runs the
server's loop in a thread of its own; ``Server.handle_completions(body, callback)`` runs one
OpenAI-shaped completion in the calling thread, with the GIL released, calling ``callback``
with each streamed chunk (a dict) in that thread; the callback returning ``True`` cancels
the request and frees its slot.

**Every id, in order.** No xllamacpp or llama.cpp server path streams every generated id: a
token whose bytes leave the text mid-character (a multi-byte character spelled over several
tokens) is held back with no frame, and its id is never sent, in any stream (in-process or
HTTP, OpenAI or native, with ``logprobs``, ``n_probs``, ``post_sampling_probs`` or
``return_tokens``); only a finished non-streamed request lists them all (native
``/completion`` with ``return_tokens``, or ``__verbose.tokens`` when the server runs at
verbosity 10 and floods its log). So each request here is streamed in-process with
``logprobs: 1`` (each frame's id and its ``bytes``, which carry the held bytes in front)
and ``timings_per_token`` (``timings.predicted_n``: how many tokens the frame accounts for),
with special tokens rendered (``CommonParams.special``, so no token writes nothing), and:

- a frame that accounts for one token gives its id;
- a frame after held tokens gives the ids `actors._held_tokens.TokenPieces.spell` finds for
  the held bytes, when exactly one spelling fits;
- when none or several fit (about one held run in a thousand on the test model), or the
  request ended with tokens still held (the stream's last frame sends no bytes), the stream
  is cancelled there and those tokens are generated again one at a time, each a native
  ``/completion`` with ``n_predict: 1`` and ``return_tokens`` over the server's loopback
  HTTP port (prompt and every id so far, its KV cache reused), then streaming resumes.

Only ids are handed back, so a regenerated token replaces one nobody saw. A greedy request
gives the ids llama.cpp itself would; a sampled one is a sample from the same distribution,
deterministic for a seed when it runs alone (batched with others, llama.cpp's own numbers
may differ, as its bare server's do), but it differs from llama.cpp's own once a request
falls back (the seed of each resumed request is derived from the request's seed and its
position). A temperature under 1e-5 is greedy: llama.cpp divides float32 logits by it, and a
smaller one overflows them.

Cost, on the test model (2 shared CPUs, one thread, 60 greedy requests of 128 tokens):
0.27-0.29 ms a token through `LlamaCppServer`, against 0.26 for the bare stream with
``logprobs`` (0.20 without, and 0.20 not streamed), 0.21 a token with two requests at once
(as the bare stream); 912 of the 7,680 ids were recovered from held bytes, 5 generated again
one at a time, which costs 0.7 ms a token (a request and an HTTP round trip each). On a real
model, whose steps take milliseconds, the difference vanishes. ``tests/llamacpp`` checks the
ids against llama.cpp's own.

Other facts and quirks of this version:

- ``n_ctx`` is the KV cache of all slots: each of ``n_parallel`` slots holds
  ``n_ctx / n_parallel`` tokens, prompt plus completion; a longer prompt is refused
  (``exceed_context_size_error``), and with ``ctx_shift`` off generation ends at the slot's
  end with ``length``.
- Errors are a chunk ``{"error": {...}}`` passed to the callback (or returned), never an
  exception; an exception raised in the callback is swallowed by the binding.
- The server always listens on 127.0.0.1 (a random port): its API key is set here to a
  random secret, so only this process can use it (the in-process calls need no key).
- Verbosity 0 logs nothing on a healthy start; ``Server(params)`` failing raises
  ``RuntimeError: Failed to init server``, the reason only in the log.
- Deleting the server joins its threads; llama.cpp's log keeps one thread for the process's
  life after the first server.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import xllamacpp
except ImportError as err:  # the `llamacpp` extra
    raise ImportError(
        f"running llama.cpp needs xllamacpp ({err}); install it with: "
        "pip install 'tokenyard[llamacpp]'"
    ) from err

from ._gguf import token_pieces
from ._held_tokens import TokenPieces, ends_mid_character
from ._llamacpp_generation import (
    Finished,
    FinishReason,
    Generation,
    LlamaCppError,
    Run,
    Sampling,
)

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Sequence

__all__ = (
    "FinishReason",
    "Finished",
    "Generation",
    "LlamaCppError",
    "LlamaCppServer",
    "Sampling",
)

_log = logging.getLogger(__name__)


class LlamaCppServer:
    """A llama.cpp server in this process, generating from token ids.

    Each `submit` runs in a worker thread (one per slot, so at most ``n_parallel``
    generations are in llama.cpp at once; more wait their turn in order); ``on_ids`` and
    ``on_finish`` are called in that thread (an asyncio caller hops back with
    ``loop.call_soon_threadsafe``).

    Args:
        model: A GGUF file.
        n_parallel: Slots: generations decoded together (continuous batching).
        context_length: Tokens (prompt plus completion) of one generation; the KV cache
            holds ``n_parallel`` times as many.
        threads: CPU threads of generation and of prompt processing.
        verbosity: llama.cpp's log level (0: errors only, quiet on a healthy start).

    Raises:
        FileNotFoundError: ``model`` does not exist.
        LlamaCppError: llama.cpp could not load it (the reason is in its log).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        n_parallel: int = 4,
        context_length: int = 2048,
        threads: int = 1,
        verbosity: int = 0,
    ) -> None:
        path = Path(model)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF model {path} does not exist")
        if n_parallel < 1 or context_length < 2 or threads < 1:
            raise ValueError(
                f"n_parallel={n_parallel}, context_length={context_length}, threads={threads}: "
                "each must be at least 1 (context_length at least 2)"
            )
        self._key = secrets.token_hex(16)
        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.n_parallel = n_parallel
        params.n_ctx = context_length * n_parallel
        params.cpuparams.n_threads = threads
        params.cpuparams_batch.n_threads = threads
        params.verbosity = verbosity
        params.special = True  # every token writes bytes: no held run hides a token
        params.ctx_shift = False  # a full slot ends its generation with `length`
        params.endpoint_metrics = True
        params.endpoint_slots = True
        params.n_threads_http = 2
        params.api_keys = [self._key]
        try:
            self._server: Any = xllamacpp.Server(params)
        except RuntimeError as err:
            raise LlamaCppError(
                f"llama.cpp could not load {path}: {err} (run with verbosity=1 to see why)"
            ) from err
        self._address = str(self._server.listening_address)
        # llama.cpp caps each slot at the model's trained context (n_ctx_train) whatever
        # n_ctx asks for: a longer context_length would be promised to callers (and to the
        # HTTP layer) and refused or cut short by llama.cpp request by request.
        slot_context = min(
            int(slot.get("n_ctx", context_length)) for slot in self._http("GET", "/slots")
        )
        if slot_context < context_length:
            self._server = None
            raise LlamaCppError(
                f"{path} holds at most {slot_context} tokens per generation (its trained "
                f"context), fewer than context_length={context_length}: lower it "
                f"(serve --engine-context {slot_context})"
            )
        try:
            pieces = token_pieces(path)
        except (ValueError, OSError, KeyError):
            # gguf-py may not read a file a newer llama.cpp reads: without the pieces,
            # every held run is generated again one token at a time.
            _log.warning("cannot read the vocabulary of %s: held ids will be stepped", path)
            pieces = None
        self._pieces = TokenPieces(pieces) if pieces is not None else None
        self._n_parallel = n_parallel
        self._context_length = context_length
        self._vocab_size = len(pieces) if pieces is not None else None
        self._ids = itertools.count(1)
        self._live: dict[int, Generation] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._workers = ThreadPoolExecutor(n_parallel, thread_name_prefix=self.thread_name_prefix)

    @property
    def n_parallel(self) -> int:
        """Generations decoded together."""
        return self._n_parallel

    @property
    def context_length(self) -> int:
        """Most prompt plus completion tokens of one generation."""
        return self._context_length

    @property
    def address(self) -> str:
        """The loopback address of llama.cpp's own HTTP server (it needs `api_key`)."""
        return self._address

    @property
    def thread_name_prefix(self) -> str:
        """The name of this server's worker threads: ``llamacpp-<port>_<n>``."""
        return "llamacpp-" + self._address.rpartition(":")[2]

    @property
    def api_key(self) -> str:
        """The bearer key of that HTTP server."""
        return self._key

    def submit(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling,
        on_ids: Callable[[list[int]], object],
        on_finish: Callable[[Finished], object],
    ) -> Generation:
        """Start generating a completion of ``prompt_ids``.

        Args:
            prompt_ids: The prompt, at least one id.
            sampling: How to generate.
            on_ids: Called with each step's new ids, in order (non-empty lists).
            on_finish: Called once, last, with how the generation ended.

        Returns:
            The generation, for `abort`.

        Raises:
            ValueError: The prompt is empty, holds an id outside the vocabulary, or leaves
                no room for a token in the context; ``max_new_tokens`` is negative.
            LlamaCppError: The server is closed.
        """
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token id")
        if self._vocab_size is not None and not all(0 <= i < self._vocab_size for i in prompt):
            raise ValueError(
                f"the prompt holds ids outside the vocabulary 0..{self._vocab_size - 1}"
            )
        if len(prompt) >= self._context_length:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens: at most {self._context_length - 1} fit "
                "the context with one generated token (raise context_length)"
            )
        if sampling.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={sampling.max_new_tokens}: it must be >= 0")
        with self._lock:
            if self._closed:
                raise LlamaCppError("the llama.cpp server is closed")
            generation = Generation(next(self._ids), prompt, sampling, on_ids, on_finish)
            self._live[generation.id] = generation
            self._workers.submit(self._run, generation)
        return generation

    def abort(self, generation: Generation) -> None:
        """Stop ``generation`` at its next step (it finishes with ``abort`` unless it has
        already finished); its slot is freed. Aborting twice is harmless."""
        generation.abort()

    def metrics(self) -> str:
        """llama.cpp's Prometheus metrics (``llamacpp:n_decode_total``, ...)."""
        return str(self._server.handle_metrics())

    def slots(self) -> list[dict[str, Any]]:
        """llama.cpp's ``/slots``: each slot's state (``is_processing``, ...)."""
        slots: list[dict[str, Any]] = self._http("GET", "/slots")
        return slots

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokenization of ``text`` (``/tokenize``; no BOS added unless the
        GGUF says so)."""
        ids: list[int] = self._http("POST", "/tokenize", {"content": text})["tokens"]
        return ids

    def close(self) -> None:
        """Abort every generation, wait for the worker threads to end, and free the model
        and llama.cpp's threads. Closing twice is harmless."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._live.values())
        for generation in live:
            generation.abort()
        self._workers.shutdown(wait=True)
        # The binding's destructor stops the server's loop and joins its threads.
        self._server = None

    def __enter__(self) -> LlamaCppServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- a worker thread ------------------------------------------------------------------

    def _run(self, generation: Generation) -> None:
        run = Run(generation)
        error: str | None = None
        try:
            self._generate(run)
        # llama.cpp's refusals, a broken answer, or the caller's on_ids failing: whatever
        # it is, it ends this generation with `error`, reported through on_finish.
        except Exception as err:  # noqa: BLE001
            _log.warning("llama.cpp generation %d failed", generation.id, exc_info=True)
            error = f"{type(err).__name__}: {err}"
            run.reason = "error"
        if run.reason is None:
            run.reason = "abort"
        finished = Finished(
            reason=run.reason,
            prompt_tokens=len(generation.prompt_ids),
            completion_tokens=len(run.ids),
            recovered_tokens=run.recovered,
            stepped_tokens=run.stepped,
            error=error,
        )
        with self._lock:
            self._live.pop(generation.id, None)
        generation.finish(finished)

    def _generate(self, run: Run) -> None:
        """Stream; where the stream cannot name a token, step over it; until the end."""
        if run.remaining <= 0:
            run.reason = "length"
        while run.reason is None:
            if run.generation.aborted:
                run.reason = "abort"
                return
            if len(run.generation.prompt_ids) + len(run.ids) >= self._context_length:
                run.reason = "length"
                return
            position = len(run.ids)
            unnamed = self._stream(run)
            if run.reason is None and unnamed:
                self._step(run, min(unnamed, run.remaining))
            elif run.reason is None and len(run.ids) == position and not run.generation.aborted:
                raise LlamaCppError("llama.cpp's stream ended with no token and no finish reason")

    def _stream(self, run: Run) -> int:
        """One streamed request from the run's position: hand on the ids each frame names.

        Returns:
            How many generated tokens it could not name (then the stream was cancelled or
            had ended), else 0 (and ``run.reason`` is set unless the run was aborted).
        """
        body = run.body()
        room = self._context_length - len(run.generation.prompt_ids) - len(run.ids)
        body |= {
            # llama.cpp's slot may hold more than context_length (it rounds n_ctx up), and
            # it takes max_tokens as a 32-bit int: never ask past the context.
            "max_tokens": min(run.remaining, room),
            "stream": True,
            "logprobs": 1,
            "timings_per_token": True,
        }
        seen = 0  # tokens of this request handed on
        text = b""  # this request's text, as the server's held-back check sees it
        unnamed = 0
        failure: list[str] = []

        def on_chunk(chunk: dict[str, Any]) -> bool:
            nonlocal seen, text, unnamed
            if run.generation.aborted:
                return True
            if "error" in chunk:
                failure.append(str(chunk["error"].get("message", chunk["error"])))
                return True
            choice = chunk["choices"][0]
            counted = int(chunk["timings"]["predicted_n"])
            entries = (choice.get("logprobs") or {}).get("content") or []
            if len(entries) > 1:  # not seen in this version: take the slow, sure path
                unnamed = counted - seen
                return True
            if entries:
                entry = entries[0]
                token = int(entry["id"])
                sent = bytes(entry["bytes"])
                ids = self._name(text, sent, token, counted - seen - 1)
                if ids is None:
                    unnamed = counted - seen
                    return True
                run.recovered += len(ids) - 1
                seen += len(ids)
                text += sent
                run.deliver(ids)
                if run.reason is not None:
                    return True
            finish = choice.get("finish_reason")
            if finish is not None:
                if counted > seen:
                    unnamed = counted - seen  # ended with tokens still held
                else:
                    run.reason = "stop" if finish == "stop" else "length"
            return False

        answer = self._server.handle_completions(body, _guarded(on_chunk, failure))
        if isinstance(answer, dict) and "error" in answer:
            failure.append(str(answer["error"].get("message", answer["error"])))
        if failure:
            raise LlamaCppError(failure[0])
        return unnamed

    def _name(self, text: bytes, sent: bytes, token: int, held: int) -> list[int] | None:
        """The ids of a frame that sent ``sent`` for ``token`` after ``held`` silent tokens,
        or ``None`` when they cannot be told for sure."""
        if held == 0:
            return [token]
        if self._pieces is None or held < 0:
            return None
        own = self._pieces.piece(token)
        if not sent.endswith(own):
            return None
        held_bytes = sent[: len(sent) - len(own)]
        spelled = self._pieces.spell(text, held_bytes, held)
        if spelled is None or ends_mid_character(text[-4:] + sent):
            return None
        return [*spelled, token]

    def _step(self, run: Run, count: int) -> None:
        """Generate ``count`` tokens one request each (native ``/completion``, which names
        every token when not streamed), handing each on."""
        connection = self._connection()
        try:
            for _ in range(count):
                if run.generation.aborted:
                    run.reason = "abort"
                    return
                if len(run.generation.prompt_ids) + len(run.ids) >= self._context_length:
                    run.reason = "length"
                    return
                body = run.body() | {"n_predict": 1, "return_tokens": True}
                answer = _post(connection, self._key, "/completion", body)
                tokens = [int(t) for t in answer["tokens"]]
                if not tokens:
                    run.reason = "length"
                    return
                run.stepped += len(tokens)
                run.deliver(tokens)
                if run.reason is None and answer.get("stop_type") == "eos":
                    run.reason = "stop"
                if run.reason is not None:
                    return
        finally:
            connection.close()

    def _connection(self) -> http.client.HTTPConnection:
        host, _, port = self._address.removeprefix("http://").rpartition(":")
        return http.client.HTTPConnection(host, int(port), timeout=60)

    def _http(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        connection = self._connection()
        try:
            return _post(connection, self._key, path, body, method=method)
        finally:
            connection.close()


def _post(
    connection: http.client.HTTPConnection,
    key: str,
    path: str,
    body: dict[str, Any] | None,
    *,
    method: str = "POST",
) -> Any:
    """One request to llama.cpp's HTTP server; its JSON answer, or `LlamaCppError`."""
    data = None if body is None else json.dumps(body)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    connection.request(method, path, data, headers)
    response = connection.getresponse()
    answer = json.loads(response.read())
    if response.status != 200 or (isinstance(answer, dict) and "error" in answer):
        error = answer.get("error", answer) if isinstance(answer, dict) else answer
        raise LlamaCppError(f"llama.cpp {path} answered {response.status}: {error}")
    return answer


def _guarded(
    on_chunk: Callable[[dict[str, Any]], bool], failure: list[str]
) -> Callable[[dict[str, Any]], bool]:
    """``on_chunk`` made safe for the binding, which swallows a callback's exception: one
    is kept in ``failure`` and cancels the request."""

    def callback(chunk: dict[str, Any]) -> bool:
        try:
            return on_chunk(chunk)
        except Exception as err:  # noqa: BLE001 - raised again by the caller, from failure
            _log.debug("llama.cpp stream callback failed", exc_info=True)
            failure.append(f"{type(err).__name__}: {err}")
            return True

    return callback
