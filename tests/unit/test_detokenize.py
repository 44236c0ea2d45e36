"""Incremental detokenization: joined stream == one-shot decode, stop strings, the states."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors._detokenize import DetokenizerStates, IncrementalDetokenizer, TooManyRequestsError
from actors._tokenizer import BOS_TOKEN, EOS_TOKEN, load_tokenizer

if TYPE_CHECKING:
    from collections.abc import Sequence

TOKENIZER = load_tokenizer()
VOCAB_SIZE: int = TOKENIZER.get_vocab_size()
BOS: int = TOKENIZER.token_to_id(BOS_TOKEN)
EOS: int = TOKENIZER.token_to_id(EOS_TOKEN)

# Pieces that stress UTF-8 boundaries: multi-byte letters, combining marks, and emoji made
# of several code points (flags, ZWJ families, skin tones, keycaps, tag sequences).
FRAGMENTS = [
    "a",
    " ",
    "\n",
    "THE END",
    "é",
    "e\u0301",
    "\u0308\u0316",
    "ß",
    "ø",
    "中",
    "文",
    "潮汐",
    "時計",
    "ひらがな",
    "한글",
    "안녕",
    "Ж",
    "ω",
    "ق",
    "क्ष",
    "🌊",
    "🇯🇵",
    "🇫🇷",
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "👋🏽",
    "1️⃣",
    "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "\ufffd",
    "\U0001d518",  # mathematical fraktur U: four bytes, outside the corpus
]
texts = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=20).map("".join),
)
vocab_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=60)
PROPERTY = settings(deadline=None, max_examples=250)


def _byte_to_token_id() -> dict[int, int]:
    """Map each byte to the id of its single-byte token (GPT-2's byte-to-character table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {b: TOKENIZER.token_to_id(c) for b, c in chars.items()}


BYTE_TOKEN = _byte_to_token_id()


def byte_ids(data: bytes) -> list[int]:
    """One token per byte: lets a test cut a character exactly where it wants."""
    return [BYTE_TOKEN[b] for b in data]


def split(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Cut ``ids`` into chunks of the given sizes (cycled), empty chunks allowed."""
    chunks: list[list[int]] = []
    i = 0
    sizes = list(sizes) or [len(ids) or 1]
    while i < len(ids):
        size = sizes[len(chunks) % len(sizes)]
        chunks.append(list(ids[i : i + size]))
        i += size
    return chunks


chunk_sizes = st.lists(st.integers(0, 7), max_size=12).map(lambda s: [*s, 1])


def stream(
    ids: Sequence[int], sizes: Sequence[int], **options: Any
) -> tuple[list[str], IncrementalDetokenizer]:
    """Push ``ids`` in chunks then finish; return every piece and the detokenizer."""
    detok = IncrementalDetokenizer(TOKENIZER, **options)
    pieces = [detok.push(chunk) for chunk in split(ids, sizes)]
    pieces.append(detok.push([], finished=True))
    return pieces, detok


def one_shot(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return str(TOKENIZER.decode(list(ids), skip_special_tokens=skip_special_tokens))


def cut_at_stop(text: str, stops: Sequence[str], no_stop_trim: bool) -> str:
    """The reference: cut the whole text at the stop string that is complete first."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text
    end, begin, _ = min(found, key=lambda f: (f[0], f[1]))
    return text[:end] if no_stop_trim else text[:begin]


class TestJoinedStreamEqualsOneShotDecode:
    @PROPERTY
    @given(text=texts, sizes=chunk_sizes)
    def test_encoded_text_split_anywhere_streams_back_the_same_text(
        self, text: str, sizes: list[int]
    ) -> None:
        ids = TOKENIZER.encode(text).ids
        pieces, _ = stream(ids, sizes, skip_special_tokens=False)
        assert "".join(pieces) == one_shot(ids, skip_special_tokens=False)

    @PROPERTY
    @given(ids=vocab_ids, sizes=chunk_sizes, skip=st.booleans())
    def test_random_ids_stream_the_same_text_as_one_shot_decode(
        self, ids: list[int], sizes: list[int], skip: bool
    ) -> None:
        # Random ids glue partial characters together in every way, valid or not.
        pieces, _ = stream(ids, sizes, skip_special_tokens=skip)
        assert "".join(pieces) == one_shot(ids, skip)

    @PROPERTY
    @given(data=st.binary(max_size=40), sizes=chunk_sizes)
    def test_arbitrary_bytes_one_token_each_stream_like_lossy_utf8(
        self, data: bytes, sizes: list[int]
    ) -> None:
        pieces, _ = stream(byte_ids(data), sizes)
        assert "".join(pieces) == data.decode("utf-8", errors="replace")

    @PROPERTY
    @given(ids=vocab_ids)
    def test_no_streamed_piece_ends_in_a_character_that_was_still_incomplete(
        self, ids: list[int]
    ) -> None:
        detok = IncrementalDetokenizer(TOKENIZER)
        streamed = ""
        for i, token in enumerate(ids):
            streamed += detok.push([token])
            # What has been streamed is final: a prefix of the decode of any continuation.
            # Between them these continuations complete every possible partial character.
            for more in (b"\x80\x80\x80", b"\x90\x90\x90", b"\xa0\x80\x80"):
                assert one_shot(ids[: i + 1] + byte_ids(more)).startswith(streamed)

    def test_a_split_character_is_held_until_its_last_byte_arrives(self) -> None:
        wave = "🌊".encode()
        detok = IncrementalDetokenizer(TOKENIZER)
        assert [detok.push(byte_ids(wave[i : i + 1])) for i in range(4)] == ["", "", "", "🌊"]

    def test_text_before_an_incomplete_character_is_not_delayed(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER)
        assert detok.push(byte_ids(b"ab" + "中".encode()[:2])) == "ab"
        assert detok.push(byte_ids("中".encode()[2:])) == "中"

    def test_invalid_bytes_already_known_to_be_invalid_are_streamed(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER)
        # 0xFF can never start a character, so its U+FFFD is final; the last 0xE4 may not be.
        assert detok.push(byte_ids(b"\xffx\xff\xe4")) == "\ufffdx\ufffd"
        assert detok.push(byte_ids(b"z")) == "\ufffdz"

    def test_an_incomplete_character_at_the_end_flushes_as_a_replacement(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER)
        assert detok.push(byte_ids(b"ok" + "中".encode()[:2])) == "ok"
        assert detok.push([], finished=True) == "\ufffd"
        assert detok.text == one_shot(byte_ids(b"ok" + "中".encode()[:2]))

    def test_tokens_that_decode_to_nothing_still_advance(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=True)
        assert detok.push([BOS]) == ""
        assert detok.push(TOKENIZER.encode("hi").ids) == "hi"
        assert detok.push([EOS], finished=True) == ""

    def test_special_tokens_are_streamed_when_not_skipped(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=False)
        assert detok.push([BOS, *TOKENIZER.encode("hi").ids]) == "<|bos|>hi"

    def test_a_special_token_inside_a_split_character_is_skipped_like_one_shot(self) -> None:
        ids = [*byte_ids("中".encode()[:1]), EOS, *byte_ids("中".encode()[1:])]
        pieces, _ = stream(ids, [1])
        assert "".join(pieces) == one_shot(ids) == "中"

    def test_decoding_cost_does_not_grow_with_the_output_length(self) -> None:
        decoded: list[int] = []

        class CountingTokenizer:
            def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
                decoded.append(len(ids))
                return str(TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens))

        ids = TOKENIZER.encode("潮汐钟 tide clock 🌊 " * 200).ids
        detok = IncrementalDetokenizer(CountingTokenizer())
        for token in ids:
            detok.push([token])
        # Each push decodes a window of a few ids, never the whole output so far.
        assert max(decoded) <= 8
        assert sum(decoded) < 4 * len(ids)


class TestStopStrings:
    @PROPERTY
    @given(data=st.data(), ids=vocab_ids, sizes=chunk_sizes, no_trim=st.booleans())
    def test_stream_equals_one_shot_text_cut_at_the_first_stop(
        self, data: st.DataObject, ids: list[int], sizes: list[int], no_trim: bool
    ) -> None:
        full = one_shot(ids)
        stops = data.draw(st.lists(_stop_strings(full), min_size=1, max_size=3))
        pieces, detok = stream(ids, sizes, stop=stops, no_stop_trim=no_trim)
        assert "".join(pieces) == cut_at_stop(full, stops, no_trim)
        assert detok.stopped == any(s in full for s in stops)

    @PROPERTY
    @given(data=st.data(), text=texts, sizes=chunk_sizes)
    def test_trimmed_output_never_contains_a_stop_string(
        self, data: st.DataObject, text: str, sizes: list[int]
    ) -> None:
        stops = data.draw(st.lists(_stop_strings(text), min_size=1, max_size=3))
        ids = TOKENIZER.encode(text).ids
        pieces, _ = stream(ids, sizes, stop=stops)
        joined = "".join(pieces)
        assert not any(s in joined for s in stops)
        assert text.startswith(joined)

    def test_a_stop_string_straddling_two_pushes_is_caught_and_never_streamed(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER, stop=["THE END"])
        assert detok.push(TOKENIZER.encode("So ends it. THE EN").ids) == "So ends it. "
        assert detok.push(TOKENIZER.encode("D and more").ids) == ""
        assert detok.matched_stop == "THE END"
        assert detok.text == "So ends it. "

    def test_a_stop_string_split_byte_by_byte_is_caught(self) -> None:
        ids = byte_ids("x 全文完 y".encode())
        pieces, detok = stream(ids, [1], stop=["全文完"])
        assert "".join(pieces) == "x "
        assert detok.stopped

    def test_held_text_is_released_once_it_cannot_be_a_stop_string(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER, stop=["THE END"])
        assert detok.push(TOKENIZER.encode("THE EN").ids) == ""
        assert detok.push(TOKENIZER.encode("VELOPE").ids) == "THE ENVELOPE"
        assert not detok.stopped

    def test_held_text_is_released_when_the_request_finishes(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER, stop=["THE END"])
        assert detok.push(TOKENIZER.encode("at THE E").ids) == "at "
        assert detok.push([], finished=True) == "THE E"

    def test_no_stop_trim_keeps_the_stop_string_and_holds_nothing_back(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER, stop=["THE END"], no_stop_trim=True)
        assert detok.push(TOKENIZER.encode("ok THE EN").ids) == "ok THE EN"
        assert detok.push(TOKENIZER.encode("D, more").ids) == "D"
        assert detok.text == "ok THE END"

    def test_pushes_after_a_stop_return_nothing(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER, stop=["!"])
        assert detok.push(TOKENIZER.encode("hi! there").ids) == "hi"
        assert detok.push(TOKENIZER.encode("more").ids) == ""
        assert detok.push(TOKENIZER.encode("!").ids, finished=True) == ""
        assert detok.finished
        assert detok.num_tokens == len(TOKENIZER.encode("hi! theremore!").ids)

    def test_the_stop_string_completed_first_wins_over_the_listed_first(self) -> None:
        pieces, detok = stream(TOKENIZER.encode("abcdef").ids, [6], stop=["cdef", "bcd"])
        assert "".join(pieces) == "a"
        assert detok.matched_stop == "bcd"

    def test_of_two_stops_completed_together_the_longer_wins(self) -> None:
        pieces, detok = stream(TOKENIZER.encode("abcdef").ids, [6], stop=["cd", "abcd"])
        assert "".join(pieces) == ""
        assert detok.matched_stop == "abcd"

    def test_an_empty_stop_string_is_rejected(self) -> None:
        with pytest.raises(ValueError, match="non-empty"):
            IncrementalDetokenizer(TOKENIZER, stop=["ok", ""])


class TestLifecycle:
    def test_text_is_every_piece_joined(self) -> None:
        pieces, detok = stream(TOKENIZER.encode("潮汐 🌊 tide").ids, [1, 2])
        assert detok.text == "".join(pieces) == "潮汐 🌊 tide"

    def test_a_push_after_the_final_push_is_an_error(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER)
        detok.push([], finished=True)
        with pytest.raises(RuntimeError, match="after the final push"):
            detok.push([1])


class TestDetokenizerStates:
    def test_creating_beyond_the_cap_raises_an_error_naming_the_knob(self) -> None:
        states: DetokenizerStates[int] = DetokenizerStates(TOKENIZER, max_states=2)
        states.create(0, "a")
        states.create(0, "b")
        with pytest.raises(TooManyRequestsError, match="max_states=2") as info:
            states.create(1, "c")
        assert info.value.max_states == 2
        assert len(states) == 2

    def test_popping_a_finished_request_frees_its_slot(self) -> None:
        states: DetokenizerStates[int] = DetokenizerStates(TOKENIZER, max_states=1)
        state = states.create(0, "a")
        assert states.pop(0, "a") is state
        assert (0, "a") not in states
        assert len(states) == 0
        states.create(0, "b")

    def test_popping_an_unknown_request_gives_none(self) -> None:
        states: DetokenizerStates[int] = DetokenizerStates(TOKENIZER, max_states=1)
        assert states.pop(0, "ghost") is None

    def test_dropping_an_origin_frees_only_its_states(self) -> None:
        states: DetokenizerStates[tuple[int, int]] = DetokenizerStates(TOKENIZER, max_states=8)
        dead, alive = (1, 0), (2, 0)
        for rid in ("a", "b", "c"):
            states.create(dead, rid)
        states.create(alive, "d")
        assert states.drop_origin(dead) == ["a", "b", "c"]
        assert len(states) == 1
        assert (alive, "d") in states
        assert list(states.origins()) == [alive]
        assert states.drop_origin(dead) == []

    def test_the_same_rid_from_two_origins_has_two_states(self) -> None:
        states: DetokenizerStates[tuple[int, int]] = DetokenizerStates(TOKENIZER, max_states=8)
        old, new = states.create((1, 0), "r"), states.create((1, 1), "r")
        assert old is not new
        assert states.get((1, 0), "r") is old
        assert states.get((1, 1), "r") is new

    def test_creating_a_live_request_twice_is_an_error(self) -> None:
        states: DetokenizerStates[int] = DetokenizerStates(TOKENIZER, max_states=8)
        states.create(0, "a")
        with pytest.raises(KeyError, match="already has"):
            states.create(0, "a")

    def test_states_carry_their_request_options(self) -> None:
        states: DetokenizerStates[int] = DetokenizerStates(TOKENIZER, max_states=8)
        state = states.create(0, "a", stop=["!"], skip_special_tokens=False)
        assert state.push([BOS, *TOKENIZER.encode("hi!").ids]) == "<|bos|>hi"
        assert state.stopped

    def test_a_cap_below_one_is_rejected(self) -> None:
        with pytest.raises(ValueError, match="max_states"):
            DetokenizerStates(TOKENIZER, max_states=0)


def _stop_strings(text: str) -> st.SearchStrategy[str]:
    """Stop strings that often occur in ``text`` (substrings of it) and sometimes do not."""
    substrings = (
        st.integers(0, max(len(text) - 1, 0))
        .flatmap(lambda i: st.tuples(st.just(i), st.integers(i + 1, i + 4)))
        .map(lambda span: text[span[0] : span[1]])
        .filter(bool)
    )
    return st.one_of(substrings, st.text(min_size=1, max_size=3)) if text else st.text(min_size=1)
