"""The test model (`actors._gguf`): ``python -m actors make-model``, what llama.cpp makes of
it, and its vocabulary as llama.cpp spells it."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import pytest

from actors.__main__ import main
from actors._gguf import (
    CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    token_pieces,
    write_gguf,
    write_model_dir,
)
from actors._llamacpp import LlamaCppServer, Sampling
from actors._tokenizer import DEFAULT_TOKENIZER_PATH
from actors.build_tokenizer import DEFAULT_CORPUS_PATH
from actors.http import ChatTemplate

from .conftest import generate

if TYPE_CHECKING:
    from pathlib import Path


def corpus_lines() -> list[str]:
    text = DEFAULT_CORPUS_PATH.read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


class TestMakeModel:
    def test_the_command_writes_the_model_its_tokenizer_and_its_template(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        started = time.monotonic()
        assert main(["make-model", str(tmp_path / "m")]) == 0
        assert time.monotonic() - started < 1.0
        written = sorted(p.name for p in (tmp_path / "m").iterdir())
        assert written == sorted([MODEL_FILE, TOKENIZER_FILE, CONFIG_FILE])
        assert (tmp_path / "m" / TOKENIZER_FILE).read_bytes() == DEFAULT_TOKENIZER_PATH.read_bytes()
        assert "model.gguf" in capsys.readouterr().out

    def test_a_seed_gives_the_same_bytes_every_time(self, tmp_path: Path) -> None:
        write_model_dir(tmp_path / "a", seed=7)
        write_model_dir(tmp_path / "b", seed=7)
        write_model_dir(tmp_path / "c", seed=8)
        for name in (MODEL_FILE, CONFIG_FILE):
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / MODEL_FILE).read_bytes() != (
            tmp_path / "c" / MODEL_FILE
        ).read_bytes()

    def test_a_tokenizer_that_is_no_byte_level_bpe_is_refused(self, tmp_path: Path) -> None:
        spec: dict[str, Any] = json.loads(DEFAULT_TOKENIZER_PATH.read_text(encoding="utf-8"))
        spec["pre_tokenizer"] = {"type": "Whitespace"}
        other = tmp_path / "tokenizer.json"
        other.write_text(json.dumps(spec), encoding="utf-8")
        with pytest.raises(ValueError, match="not a ByteLevel"):
            write_gguf(other, tmp_path / "x.gguf")

    def test_a_missing_tokenizer_is_a_usage_error(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as exit_info:
            main(["make-model", str(tmp_path), "--tokenizer", str(tmp_path / "none.json")])
        assert exit_info.value.code == 2
        assert "does not exist" in capsys.readouterr().err


class TestWhatLlamaCppMakesOfIt:
    def test_it_tokenizes_the_corpus_as_hugging_face_does(
        self, server: LlamaCppServer, hf: Any
    ) -> None:
        whole = DEFAULT_CORPUS_PATH.read_text(encoding="utf-8")
        assert server.tokenize(whole) == hf.encode(whole).ids
        lines = corpus_lines()[:100]
        assert [server.tokenize(line) for line in lines] == [hf.encode(line).ids for line in lines]

    def test_its_pieces_are_the_bytes_of_the_hugging_face_tokens(
        self, model: Path, hf: Any
    ) -> None:
        pieces = token_pieces(model)
        assert pieces is not None
        assert len(pieces) == hf.get_vocab_size()
        whole = DEFAULT_CORPUS_PATH.read_text(encoding="utf-8")
        assert b"".join(pieces[i] for i in hf.encode(whole).ids) == whole.encode()
        assert pieces[hf.token_to_id("<|eos|>")] == b"<|eos|>"

    def test_chat_uses_the_template_the_front_end_renders(
        self, server: LlamaCppServer, model_dir: Path, hf: Any
    ) -> None:
        messages = [{"role": "user", "content": "Where is the tidal clock?"}]
        prompt = ChatTemplate.from_tokenizer(model_dir).render(messages)
        assert prompt == "<|bos|>user\nWhere is the tidal clock?<|eos|>\n<|bos|>assistant\n"
        answer = server._server.handle_chat_completions(
            {"messages": messages, "max_tokens": 4, "temperature": 0}
        )
        assert answer["usage"]["prompt_tokens"] == len(hf.encode(prompt).ids)
        assert answer["choices"][0]["message"]["role"] == "assistant"

    def test_by_default_it_writes_byte_fragments(self, server: LlamaCppServer, hf: Any) -> None:
        prompt = hf.encode(corpus_lines()[0]).ids
        got = generate(server, prompt, Sampling(max_new_tokens=64, ignore_eos=True))
        assert got.end.recovered_tokens > 0  # ids the stream held back
        split = [i for i in got.ids if "\ufffd" in hf.decode([i], skip_special_tokens=False)]
        assert split

    def test_a_clean_model_writes_none(self, tmp_path: Path, hf: Any) -> None:
        gguf = write_model_dir(tmp_path, clean=True)
        with LlamaCppServer(gguf, n_parallel=1, context_length=256) as clean:
            for line in corpus_lines()[:4]:
                got = generate(clean, hf.encode(line).ids[:32], Sampling(max_new_tokens=48))
                assert got.end.reason == "length"
                for token in got.ids:
                    assert "\ufffd" not in hf.decode([token], skip_special_tokens=False)
