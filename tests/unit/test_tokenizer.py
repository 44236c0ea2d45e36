"""The bundled tokenizer, its loader and the script that builds it."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import pytest

from actors._tokenizer import (
    BOS_TOKEN,
    DEFAULT_TOKENIZER_PATH,
    EOS_TOKEN,
    PAD_TOKEN,
    encode_ids,
    eos_token_id,
    load_tokenizer,
)
from actors.build_tokenizer import DEFAULT_CORPUS_PATH, DEFAULT_VOCAB_SIZE, main

if TYPE_CHECKING:
    from pathlib import Path

SAMPLES = [
    "潮汐钟并不像手表那样准。",
    "時計守りのイルゼは砂利道を下りていく。",
    "오늘은 아침부터 비가 내렸다.",
    "Příliš žluťoučký kůň úpěl ďábelské ódy; Grüße aus Köln; ¿Qué tal? Ça va.",
    "e\u0301 n\u0303 Z\u0324\u0354\u0367",
    "🇯🇵🇫🇷 👨‍👩‍👧‍👦 🏳️‍🌈 🏴󠁧󠁢󠁳󠁣󠁴󠁿 👋🏽 1️⃣ ❤️‍🔥",
    "def f(x: int) -> int:\n\treturn x ** 2  # 0xDEADBEEF\r\n",
    "words the corpus never saw: ꙮ \U0001d518\U0001d52b\U0001d526 \x00\x7f \U0010ffff",
]


class TestBundledTokenizer:
    def test_the_bundled_file_ships_next_to_the_package(self) -> None:
        assert DEFAULT_TOKENIZER_PATH.is_file()
        assert DEFAULT_TOKENIZER_PATH.parent == DEFAULT_CORPUS_PATH.parent

    def test_it_loads_with_the_default_vocabulary_size(self) -> None:
        assert load_tokenizer().get_vocab_size() == DEFAULT_VOCAB_SIZE

    def test_special_tokens_have_the_first_ids(self) -> None:
        tokenizer = load_tokenizer()
        ids = [tokenizer.token_to_id(t) for t in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)]
        assert ids == [0, 1, 2]

    def test_the_eos_id_is_found_by_the_lookup_helper(self) -> None:
        assert eos_token_id(load_tokenizer()) == 2

    def test_the_eos_lookup_gives_none_when_no_candidate_is_known(self) -> None:
        assert eos_token_id(load_tokenizer(), candidates=("<|no such token|>",)) is None

    @pytest.mark.parametrize("text", SAMPLES)
    def test_encode_then_decode_gives_back_the_exact_text(self, text: str) -> None:
        tokenizer = load_tokenizer()
        assert tokenizer.decode(tokenizer.encode(text).ids) == text

    def test_common_cjk_text_takes_fewer_tokens_than_bytes(self) -> None:
        tokenizer = load_tokenizer()
        text = SAMPLES[0]
        assert len(tokenizer.encode(text).ids) < len(text.encode()) / 2

    def test_some_tokens_hold_only_part_of_a_multibyte_character(self) -> None:
        # The incremental detokenizer's hold-back logic needs such tokens to be exercised.
        tokenizer = load_tokenizer()
        partial = [
            i for i in range(tokenizer.get_vocab_size()) if "\ufffd" in tokenizer.decode([i])
        ]
        assert len(partial) > 100


class TestEncodeIds:
    @pytest.mark.parametrize("chars", [0, 1, 1024, 1025, 40_000])
    @pytest.mark.parametrize("special", [False, True])
    def test_short_and_long_texts_get_the_ids_one_encode_gives(
        self, chars: int, special: bool
    ) -> None:
        tokenizer = load_tokenizer()
        text = ("".join(SAMPLES) + DEFAULT_CORPUS_PATH.read_text())[:chars]
        expected = tokenizer.encode(text, add_special_tokens=special).ids
        assert encode_ids(tokenizer, text, add_special_tokens=special) == expected


class TestLoadTokenizer:
    def test_a_missing_file_names_the_path_and_the_fix(self, tmp_path: Path) -> None:
        missing = tmp_path / "nope" / "tokenizer.json"
        with pytest.raises(FileNotFoundError, match=r"tokenizer\.json") as info:
            load_tokenizer(missing)
        assert str(missing) in str(info.value)
        assert "None for the bundled default" in str(info.value)

    def test_a_directory_without_a_tokenizer_json_is_reported_missing(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
            load_tokenizer(tmp_path)

    def test_a_directory_holding_a_tokenizer_json_loads(self, tmp_path: Path) -> None:
        (tmp_path / "tokenizer.json").write_bytes(DEFAULT_TOKENIZER_PATH.read_bytes())
        assert load_tokenizer(tmp_path).get_vocab_size() == DEFAULT_VOCAB_SIZE

    def test_a_string_path_is_accepted(self) -> None:
        assert load_tokenizer(str(DEFAULT_TOKENIZER_PATH)).get_vocab_size() == DEFAULT_VOCAB_SIZE

    @pytest.mark.parametrize("content", [b"", b"not json", b'{"version": "1.0"}', b"\xff\xfe"])
    def test_a_file_that_is_not_a_tokenizer_json_is_a_value_error(
        self, tmp_path: Path, content: bytes
    ) -> None:
        bad = tmp_path / "tokenizer.json"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match="is not a"):
            load_tokenizer(bad)


class TestBuildScript:
    def test_two_builds_write_identical_bytes(self, tmp_path: Path) -> None:
        first, second = tmp_path / "a.json", tmp_path / "b" / "tokenizer.json"
        assert main(["--out", str(first)]) == 0
        assert main(["--out", str(second)]) == 0
        assert first.read_bytes() == second.read_bytes()

    def test_the_shipped_file_is_what_the_script_builds_from_the_shipped_corpus(
        self, tmp_path: Path
    ) -> None:
        rebuilt = tmp_path / "tokenizer.json"
        assert main(["--out", str(rebuilt)]) == 0
        fresh, shipped = (json.loads(p.read_bytes()) for p in (rebuilt, DEFAULT_TOKENIZER_PATH))
        regenerate = "regenerate it with `python -m actors.build_tokenizer`"
        # The ids the pipeline produces: vocabulary, merges and special tokens.
        assert fresh["model"]["vocab"] == shipped["model"]["vocab"], regenerate
        assert fresh["model"]["merges"] == shipped["model"]["merges"], regenerate
        assert fresh["added_tokens"] == shipped["added_tokens"], regenerate
        # The build is byte-for-byte deterministic, so the whole file can be compared too.
        assert rebuilt.read_bytes() == DEFAULT_TOKENIZER_PATH.read_bytes(), regenerate

    def test_the_built_file_loads_with_the_requested_vocabulary(self, tmp_path: Path) -> None:
        out = tmp_path / "small.json"
        main(["--vocab-size", "512", "--out", str(out)])
        tokenizer = load_tokenizer(out)
        assert tokenizer.get_vocab_size() == 512
        assert tokenizer.decode(tokenizer.encode(SAMPLES[5]).ids) == SAMPLES[5]

    def test_a_custom_corpus_can_be_named(self, tmp_path: Path) -> None:
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("tide clock tide clock 潮汐 潮汐\n" * 20, encoding="utf-8")
        out = tmp_path / "tokenizer.json"
        main(["--corpus", str(corpus), "--vocab-size", "300", "--out", str(out)])
        assert load_tokenizer(out).token_to_id(EOS_TOKEN) == 2

    def test_a_vocabulary_too_small_for_the_byte_alphabet_is_refused(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as info:
            main(["--vocab-size", "100", "--out", str(tmp_path / "t.json")])
        assert info.value.code == 2
        assert "--vocab-size" in capsys.readouterr().err
        assert not (tmp_path / "t.json").exists()

    def test_a_missing_corpus_is_refused(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit):
            main(["--corpus", str(tmp_path / "none.txt"), "--out", str(tmp_path / "t.json")])
        assert "none.txt" in capsys.readouterr().err
