"""Incremental detokenization with tokenizers that are not byte-level BPE, built here with
Hugging Face ``tokenizers`` as their published ``tokenizer.json`` files are: Llama's and
Mistral's byte-fallback BPE (one token per byte of a character outside the vocabulary, a
decoder that drops the leading space) and BERT's WordPiece ("##" pieces glued to what is
before them). The joined stream must equal the one-shot decode; and long stop strings,
which any client may send, must cost each push little."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from actors._detokenize import IncrementalDetokenizer

if TYPE_CHECKING:
    from collections.abc import Sequence

PROPERTY = settings(deadline=None, max_examples=200)


def llama_like() -> Tokenizer:
    """Byte-fallback BPE with Llama 2's normalizer and decoder chain."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "e", "t", "▁a", "▁b", "▁t", "▁the", "é", "▁é", "中", "x", "."]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>")])
    return tokenizer


def wordpiece() -> Tokenizer:
    """BERT's WordPiece."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2}
    for piece in ["hello", "world", "tide", "##s", "a", "b", "##a"]:
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("[CLS]", "[SEP]")])
    return tokenizer


LLAMA = llama_like()
WORDPIECE = wordpiece()


def ids_of(tokenizer: Tokenizer, *tokens: str) -> list[int]:
    found = [tokenizer.token_to_id(t) for t in tokens]
    assert None not in found, tokens
    return [i for i in found if i is not None]


def joined(pushes: Sequence[Sequence[int]]) -> list[int]:
    return [i for ids in pushes for i in ids]


def streamed(tokenizer: Tokenizer, pushes: Sequence[Sequence[int]], **options: object) -> str:
    detok = IncrementalDetokenizer(tokenizer, **options)  # type: ignore[arg-type]
    pieces = [detok.push(list(ids)) for ids in pushes]
    pieces.append(detok.push([], finished=True))
    return "".join(pieces)


class TestByteFallback:
    @pytest.mark.parametrize("text", ["€", "🌊", "a€b", "中€🌊é"])
    def test_a_character_spelled_in_byte_tokens_streams_whole(self, text: str) -> None:
        ids = LLAMA.encode(text).ids
        assert any(str(LLAMA.id_to_token(i)).startswith("<0x") for i in ids)  # byte tokens
        # One id a push: each byte of the character alone before the last. Before, every
        # byte token's U+FFFD but the last was streamed as final: "€" came out as "\ufffd".
        assert streamed(LLAMA, [[i] for i in ids]) == LLAMA.decode(ids) == text

    @PROPERTY
    @given(text=st.text(max_size=40), data=st.data())
    def test_encoded_text_split_anywhere_streams_back_its_decode(
        self, text: str, data: st.DataObject
    ) -> None:
        ids = LLAMA.encode(text).ids
        cuts = sorted(data.draw(st.sets(st.integers(0, len(ids)), max_size=len(ids) + 1)))
        pushes = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        assert streamed(LLAMA, pushes) == LLAMA.decode(ids)

    @PROPERTY
    @given(
        text=st.text(st.sampled_from("a€🌊é中x "), max_size=12),
        data=st.data(),
    )
    def test_runs_of_skipped_special_tokens_inside_a_character_stream_its_decode(
        self, text: str, data: st.DataObject
    ) -> None:
        # Before, 32 pushes in a row of ids that add no text held a character's first bytes
        # no longer: it streamed as U+FFFD where the one-shot decode gives the character.
        ids = LLAMA.encode(text).ids
        specials = ids_of(LLAMA, "<s>", "</s>")
        pushes: list[list[int]] = []
        for i in ids:
            pushes.append([i])
            run = data.draw(st.sampled_from([0, 0, 1, 31, 32, 33, 100]))
            pushes += [[data.draw(st.sampled_from(specials))] for _ in range(run)]
        assert streamed(LLAMA, pushes) == LLAMA.decode(joined(pushes))

    def test_skipped_special_tokens_held_in_a_character_keep_each_push_small(self) -> None:
        decoded: list[int] = []

        class Counting:
            def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
                decoded.append(len(ids))
                return str(LLAMA.decode(ids, skip_special_tokens=skip_special_tokens))

            def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
                return dict(LLAMA.get_added_tokens_decoder())

        e2, x82, xac, eos = ids_of(LLAMA, "<0xE2>", "<0x82>", "<0xAC>", "</s>")
        detok = IncrementalDetokenizer(Counting())
        pieces = [detok.push([e2]), *(detok.push([eos]) for _ in range(2_000))]
        assert "".join(pieces) == ""  # held: the character is not complete
        assert detok.push([x82, xac]) + detok.push([], finished=True) == "€"
        assert max(decoded) <= 4  # the window held the three bytes, never the 2,000 ids

    def test_invalid_bytes_without_end_keep_each_push_small(self) -> None:
        decoded: list[int] = []

        class Counting:
            def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
                decoded.append(len(ids))
                return str(LLAMA.decode(ids, skip_special_tokens=skip_special_tokens))

        ff = ids_of(LLAMA, "<0xFF>")[0]
        detok = IncrementalDetokenizer(Counting())
        text = "".join(detok.push([ff]) for _ in range(2_000)) + detok.push([], finished=True)
        assert text == "\ufffd" * 2_000
        # The window is committed past a few ids even while its text ends in U+FFFD:
        # before, it grew with the output and each push decoded all of it.
        assert max(decoded) <= 2 * 32 + 2  # two windows of at most _MAX_WAITS pushes


class TestLeftContext:
    def test_a_skipped_special_token_between_two_words_keeps_the_space(self) -> None:
        pushes = [ids_of(LLAMA, "▁a"), ids_of(LLAMA, "</s>"), ids_of(LLAMA, "▁b")]
        assert streamed(LLAMA, pushes) == LLAMA.decode(joined(pushes)) == "a b"

    @pytest.mark.parametrize("specials", [1, 32, 33, 100])
    def test_any_run_of_skipped_special_tokens_keeps_the_space(self, specials: int) -> None:
        pushes = [ids_of(LLAMA, "▁b"), *[ids_of(LLAMA, "</s>")] * specials, ids_of(LLAMA, "▁a")]
        assert streamed(LLAMA, pushes) == LLAMA.decode(joined(pushes)) == "b a"

    def test_a_skipped_special_token_between_two_wordpiece_words_keeps_the_space(self) -> None:
        pushes = [
            ids_of(WORDPIECE, "hello"),
            ids_of(WORDPIECE, "[SEP]"),
            ids_of(WORDPIECE, "world"),
        ]
        assert streamed(WORDPIECE, pushes) == "hello world"

    def test_an_empty_push_does_not_cut_a_word_from_its_continuation(self) -> None:
        pushes = [ids_of(WORDPIECE, "tide"), [], ids_of(WORDPIECE, "##s")]
        assert streamed(WORDPIECE, pushes) == WORDPIECE.decode(joined(pushes)) == "tides"


def held_by_brute_force(buf: str, stops: Sequence[str]) -> int:
    """The longest suffix of ``buf`` that is a proper prefix of a stop (the reference)."""
    return max(
        (k for s in stops for k in range(1, len(s)) if k <= len(buf) and buf.endswith(s[:k])),
        default=0,
    )


class TestLongStopStrings:
    @PROPERTY
    @given(
        stops=st.lists(st.text("ab€", min_size=1, max_size=12), min_size=1, max_size=4),
        text=st.text("ab€x", max_size=40),
    )
    def test_the_text_held_back_is_the_longest_start_of_a_stop(
        self, stops: list[str], text: str
    ) -> None:
        detok = IncrementalDetokenizer(LLAMA, stop=stops)
        assert detok._held_suffix_len(text) == held_by_brute_force(text, stops)

    @pytest.mark.timeout(60)
    def test_sixteen_stops_of_256_characters_for_24_requests_stream_in_bounded_time(
        self,
    ) -> None:
        # The largest stops a client may send (ServeConfig: 16 of 256 bytes), drawn from the
        # two letters the output is made of. Before, each state compiled a regular
        # expression of every prefix (half a second each) and each push backtracked through
        # it (8 ms): two minutes for this, the detokenizer's loop blocked throughout.
        rng = random.Random(0)
        stops = ["".join(rng.choice("ab") for _ in range(256)) for _ in range(16)]
        a, b = ids_of(LLAMA, "a", "b")
        for _ in range(24):
            detok = IncrementalDetokenizer(LLAMA, stop=stops)
            text = "".join(detok.push([rng.choice((a, b))]) for n in range(500))
            assert not detok.stopped
            assert len(text) > 200
