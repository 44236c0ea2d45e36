"""`actors._llamacpp.LlamaCppServer` against real llama.cpp (the default test model, which
writes byte fragments): every id, in order, while streaming; finishes; aborts; shutdown.

The reference is llama.cpp's own answer to the same prompt ids, not streamed: native
``/completion`` with ``return_tokens``, the one path that lists every generated id."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any

import pytest

from actors._held_tokens import ends_mid_character
from actors._llamacpp import Finished, LlamaCppError, LlamaCppServer, Sampling
from actors.build_tokenizer import DEFAULT_CORPUS_PATH

from .conftest import CONTEXT, N_PARALLEL, Collected, generate

if TYPE_CHECKING:
    from pathlib import Path

GREEDY = {"temperature": 0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def native(server: LlamaCppServer, prompt: list[int], n: int, **body: Any) -> dict[str, Any]:
    """llama.cpp's non-streamed native completion of ``prompt``: ``tokens`` and ``content``."""
    host, _, port = server.address.removeprefix("http://").rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    request = {"prompt": prompt, "n_predict": n, "return_tokens": True, **GREEDY, **body}
    headers = {"Authorization": f"Bearer {server.api_key}"}
    try:
        connection.request("POST", "/completion", json.dumps(request), headers)
        answer: dict[str, Any] = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    return answer


def threads() -> set[int]:
    """This process's threads (their kernel ids)."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


#: ``pidfd_open``'s flag for a thread rather than a process (Linux 6.9).
_PIDFD_THREAD = os.O_EXCL


def thread_gone(tid: int, timeout: float) -> None:
    """Wait until thread ``tid`` of this process has exited, on its pidfd (an event, not a
    timer), at most ``timeout`` seconds."""
    try:
        fd = os.pidfd_open(tid, _PIDFD_THREAD)
    except ProcessLookupError:
        return  # gone already
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def prompts(hf: Any, count: int) -> list[list[int]]:
    lines = [s for s in DEFAULT_CORPUS_PATH.read_text(encoding="utf-8").splitlines() if s.strip()]
    return [hf.encode(line).ids[:40] for line in lines[:count]]


class TestEveryId:
    def test_streamed_greedy_ids_are_llama_cpps_own_and_decode_to_its_text(
        self, server: LlamaCppServer, hf: Any
    ) -> None:
        recovered = 0
        for prompt in prompts(hf, 24):
            got = generate(server, prompt, Sampling(max_new_tokens=64, ignore_eos=True))
            reference = native(server, prompt, 64, ignore_eos=True)
            assert got.ids == reference["tokens"]
            assert hf.decode(got.ids, skip_special_tokens=False) == reference["content"]
            assert got.end == Finished(
                reason="length",
                prompt_tokens=len(prompt),
                completion_tokens=64,
                recovered_tokens=got.end.recovered_tokens,
                stepped_tokens=got.end.stepped_tokens,
            )
            assert all(got.calls)  # never an empty step
            recovered += got.end.recovered_tokens
        assert recovered > 24  # the held-back ids were exercised, many times

    def test_tokens_still_held_at_the_end_are_generated_again_one_at_a_time(
        self, server: LlamaCppServer, hf: Any, model: Path
    ) -> None:
        # Find a length at which llama.cpp's output stops in the middle of a character:
        # its stream's last frame then names none of the held tokens.
        pieces = server._pieces
        assert pieces is not None
        for prompt in prompts(hf, 24):
            reference = native(server, prompt, 64, ignore_eos=True)["tokens"]
            cuts = [
                n
                for n in range(1, len(reference) + 1)
                if ends_mid_character(b"".join(pieces.piece(t) for t in reference[:n]))
            ]
            if not cuts:
                continue
            n = cuts[0]
            got = generate(server, prompt, Sampling(max_new_tokens=n, ignore_eos=True))
            assert got.ids == reference[:n]
            assert got.end.reason == "length"
            assert got.end.stepped_tokens > 0
            return
        pytest.fail("no prompt's output ended mid-character")

    def test_a_seed_draws_the_same_ids_every_time(self, server: LlamaCppServer, hf: Any) -> None:
        prompt = prompts(hf, 1)[0]
        draws = [
            generate(server, prompt, Sampling(max_new_tokens=48, temperature=1.0, seed=seed)).ids
            for seed in (11, 11, 12)
        ]
        assert draws[0] == draws[1]
        assert draws[0] != draws[2]

    @pytest.mark.parametrize("temperature", [1e-40, 1e-6])
    def test_a_temperature_near_zero_is_greedy(
        self, server: LlamaCppServer, hf: Any, temperature: float
    ) -> None:
        # 1e-40 is below float32's normal range: llama.cpp dividing its float32 logits by
        # it overflows them, and drew one fixed token over and over.
        prompt = prompts(hf, 1)[0]
        greedy = native(server, prompt, 32, ignore_eos=True)["tokens"]
        sampling = Sampling(max_new_tokens=32, ignore_eos=True, temperature=temperature, seed=3)
        assert generate(server, prompt, sampling).ids == greedy

    def test_concurrent_generations_get_the_ids_each_would_alone(
        self, server: LlamaCppServer, hf: Any
    ) -> None:
        batch = prompts(hf, 2 * N_PARALLEL + 1)  # more than the slots: some wait their turn
        alone = [native(server, p, 48, ignore_eos=True)["tokens"] for p in batch]
        collected = [Collected() for _ in batch]
        generations = [
            server.submit(
                p, Sampling(max_new_tokens=48, ignore_eos=True), c.calls.append, c.finished.append
            )
            for p, c in zip(batch, collected, strict=True)
        ]
        assert all(g.wait(10) for g in generations)
        assert [c.ids for c in collected] == alone


class TestFinishing:
    def test_a_stop_token_ends_with_stop_and_is_handed_back(
        self, server: LlamaCppServer, hf: Any
    ) -> None:
        prompt = prompts(hf, 1)[0]
        reference = native(server, prompt, 32, ignore_eos=True)["tokens"]
        stop = reference[10]
        got = generate(server, prompt, Sampling(max_new_tokens=32, stop_token_ids=(stop,)))
        assert got.ids == reference[: reference.index(stop) + 1]
        assert got.end.reason == "stop"

    def test_eos_ends_with_stop_unless_ignored(self, server: LlamaCppServer, hf: Any) -> None:
        eos = hf.token_to_id("<|eos|>")
        prompt = prompts(hf, 1)[0]
        # Random weights rarely choose eos: a seed that samples it within 200 tokens.
        for seed in range(40):
            got = generate(server, prompt, Sampling(max_new_tokens=200, temperature=1.5, seed=seed))
            if got.end.reason == "stop":
                assert got.ids[-1] == eos
                ignoring = Sampling(
                    max_new_tokens=len(got.ids) + 8, temperature=1.5, seed=seed, ignore_eos=True
                )
                assert eos not in generate(server, prompt, ignoring).ids
                return
            assert eos not in got.ids
        pytest.fail("no seed drew eos")

    def test_no_tokens_asked_is_length_at_once(self, server: LlamaCppServer) -> None:
        got = generate(server, [5, 6, 7], Sampling(max_new_tokens=0))
        assert got.calls == []
        assert got.end.reason == "length"
        assert got.end.completion_tokens == 0

    def test_a_full_context_ends_with_length(self, server: LlamaCppServer) -> None:
        prompt = [100 + i % 500 for i in range(CONTEXT - 5)]
        got = generate(server, prompt, Sampling(max_new_tokens=50, ignore_eos=True))
        assert got.end.reason == "length"
        assert len(prompt) + len(got.ids) == CONTEXT

    def test_a_context_llama_cpp_rounds_up_still_ends_at_its_length(self, model: Path) -> None:
        # llama.cpp gives each slot a multiple of 256 tokens: 256 for 100.
        with LlamaCppServer(model, n_parallel=1, context_length=100) as small:
            prompt = [100 + i for i in range(97)]
            got = generate(small, prompt, Sampling(max_new_tokens=10, ignore_eos=True))
        assert got.end.reason == "length"
        assert len(got.ids) == 3

    @pytest.mark.parametrize(
        ("prompt", "match"),
        [([], "empty"), ([1, 99999], "outside the vocabulary"), ([5] * CONTEXT, "at most")],
    )
    def test_a_prompt_llama_cpp_cannot_take_is_refused_at_once(
        self, server: LlamaCppServer, prompt: list[int], match: str
    ) -> None:
        with pytest.raises(ValueError, match=match):
            server.submit(prompt, Sampling(), lambda ids: None, lambda end: None)

    def test_a_failing_on_ids_ends_that_generation_with_error_only(
        self, server: LlamaCppServer, hf: Any
    ) -> None:
        finished: list[Finished] = []

        def on_ids(ids: list[int]) -> None:
            raise RuntimeError("the caller's own bug")

        generation = server.submit([5, 6, 7], Sampling(max_new_tokens=8), on_ids, finished.append)
        assert generation.wait(10)
        assert finished[0].reason == "error"
        assert "the caller's own bug" in (finished[0].error or "")
        assert generate(server, [5, 6, 7], Sampling(max_new_tokens=8)).end.reason == "length"


class TestAbort:
    def test_an_abort_frees_its_slot_and_spares_the_other_generation(
        self, server: LlamaCppServer, hf: Any
    ) -> None:
        first, second = prompts(hf, 2)
        long = Sampling(max_new_tokens=CONTEXT - 50, ignore_eos=True)
        started = threading.Event()
        aborted = Collected()

        def on_ids(ids: list[int]) -> None:
            aborted.calls.append(ids)
            started.set()
            time.sleep(0.002)  # sync-ok: a slow reader, so that the abort lands mid-generation

        generation = server.submit(first, long, on_ids, aborted.finished.append)
        other = Collected()
        bystander = server.submit(
            second,
            Sampling(max_new_tokens=64, ignore_eos=True),
            other.calls.append,
            other.finished.append,
        )
        assert started.wait(10)
        server.abort(generation)
        assert generation.wait(10)
        assert bystander.wait(10)
        assert aborted.end.reason == "abort"
        assert 0 < aborted.end.completion_tokens < long.max_new_tokens
        assert aborted.ids == native(server, first, len(aborted.ids), ignore_eos=True)["tokens"]
        assert other.ids == native(server, second, 64, ignore_eos=True)["tokens"]
        assert other.end.reason == "length"
        assert [slot["is_processing"] for slot in server.slots()] == [False] * N_PARALLEL

    def test_an_abort_after_the_end_changes_nothing(self, server: LlamaCppServer) -> None:
        got = Collected()
        generation = server.submit(
            [5, 6], Sampling(max_new_tokens=4), got.calls.append, got.finished.append
        )
        assert generation.wait(10)
        server.abort(generation)
        server.abort(generation)
        assert got.end.reason == "length"


class TestLifetime:
    async def test_an_event_loop_streams_the_ids_while_llama_cpp_generates(
        self, server: LlamaCppServer, hf: Any
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[int] | Finished] = asyncio.Queue()
        prompt = prompts(hf, 1)[0]
        server.submit(
            prompt,
            Sampling(max_new_tokens=200, ignore_eos=True),
            lambda ids: loop.call_soon_threadsafe(queue.put_nowait, ids),
            lambda end: loop.call_soon_threadsafe(queue.put_nowait, end),
        )
        ids: list[int] = []
        while not isinstance(item := await asyncio.wait_for(queue.get(), 10), Finished):
            ids += item
        assert ids == native(server, prompt, 200, ignore_eos=True)["tokens"]

    def test_close_aborts_what_runs_and_leaves_no_thread(self, model: Path, hf: Any) -> None:
        with LlamaCppServer(model, n_parallel=1, context_length=256):
            pass  # llama.cpp's log starts its one thread for the process's life
        before = threads()
        server = LlamaCppServer(model, n_parallel=2, context_length=1024)
        got = [Collected() for _ in range(3)]
        generations = [
            server.submit(
                p, Sampling(max_new_tokens=900, ignore_eos=True), c.calls.append, c.finished.append
            )
            for p, c in zip(prompts(hf, 3), got, strict=True)
        ]
        server.close()
        assert all(g.wait(0) for g in generations)
        assert {c.end.reason for c in got} <= {"abort", "length"}
        # A thread joined may still be leaving the kernel's table for a moment: wait for
        # each one new since `before` to be gone (a leaked one never goes).
        left = threads() - before
        for tid in left:
            thread_gone(tid, 10)
        assert not threads() - before, left
        assert not [
            t for t in threading.enumerate() if t.name.startswith(server.thread_name_prefix)
        ]
        with pytest.raises(LlamaCppError, match="closed"):
            server.submit([5], Sampling(), lambda ids: None, lambda end: None)
        server.close()

    def test_a_file_llama_cpp_cannot_load_is_a_clear_error(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            LlamaCppServer(tmp_path / "none.gguf")
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGUF" + bytes(64))
        with pytest.raises(LlamaCppError, match="could not load"):
            LlamaCppServer(bad)

    def test_a_context_past_the_models_own_is_refused(self, model: Path) -> None:
        # The test model is trained for 2,048 tokens: llama.cpp would give each slot that
        # many, whatever was asked, and fail longer requests one by one.
        with pytest.raises(LlamaCppError, match=r"at most 2048 tokens .* context_length=4096"):
            LlamaCppServer(model, n_parallel=1, context_length=4096)
