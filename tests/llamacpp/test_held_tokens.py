"""Which tokens spelled the bytes llama.cpp's stream sent late (`actors._held_tokens`)."""

from __future__ import annotations

import pytest

from actors._held_tokens import TokenPieces, ends_mid_character

# "中" is E4 B8 AD, "é" C3 A9, "😀" F0 9F 98 80.
PIECES = [b"a", b"\xe4", b"\xb8", b"\xad", b"\xe4\xb8", b"\xb8\xad", b"\xf0", b"\x9f\x98", b"\x98"]
PIECES += [b"\xf0\x9f", b"\x80", b"<|eos|>"]


class TestEndsMidCharacter:
    @pytest.mark.parametrize(
        "text",
        [b"\xe4", b"a\xe4\xb8", b"\xc3", b"\xf0\x9f\x98", b"\xf0\xc3\xa9", b"\xe4a"],
    )
    def test_a_lead_byte_short_of_its_character_holds_the_text(self, text: bytes) -> None:
        assert ends_mid_character(text)

    @pytest.mark.parametrize(
        "text", [b"", b"a", "中".encode(), "é".encode(), "😀".encode(), b"\xad", b"\xe4ab"]
    )
    def test_whole_characters_and_stray_continuation_bytes_do_not(self, text: bytes) -> None:
        assert not ends_mid_character(text)

    def test_it_mirrors_llama_cpp_past_a_complete_character(self) -> None:
        # llama.cpp's validate_utf8 keeps looking after "é" and finds F0 three bytes back.
        assert ends_mid_character(b"\xf0" + "é".encode())


class TestSpell:
    def test_one_held_token_is_the_one_with_those_bytes(self) -> None:
        assert TokenPieces(PIECES).spell(b"", b"\xe4\xb8", 1) == [4]

    def test_bytes_spelled_one_way_in_that_many_tokens_give_their_ids(self) -> None:
        assert TokenPieces(PIECES).spell(b"a", b"\xe4\xb8", 2) == [1, 2]

    def test_two_spellings_of_the_same_bytes_are_refused(self) -> None:
        # F0 9F 98 in two tokens: F0 + 9F 98, or F0 9F + 98.
        assert TokenPieces(PIECES).spell(b"", b"\xf0\x9f\x98", 2) is None

    def test_a_token_that_would_have_been_sent_is_no_spelling(self) -> None:
        # "a" + E4 in two tokens: "a" ends no character, so it cannot have been held.
        pieces = TokenPieces(PIECES)
        assert pieces.spell(b"", b"a\xe4", 2) is None
        assert pieces.spell(b"", b"a\xe4", 1) is None  # no token spells both

    def test_the_text_before_decides_what_was_held(self) -> None:
        # B8 after E4 still waits for AD; B8 after a whole character ends nothing.
        pieces = TokenPieces(PIECES)
        assert pieces.spell(b"\xe4", b"\xb8", 1) == [2]
        assert pieces.spell("中".encode(), b"\xb8", 1) is None

    def test_a_vocabulary_with_a_silent_token_spells_nothing(self) -> None:
        assert TokenPieces([*PIECES, b""]).spell(b"", b"\xe4\xb8", 1) is None

    def test_nothing_held_is_no_tokens(self) -> None:
        assert TokenPieces(PIECES).spell(b"a", b"", 0) == []
        assert TokenPieces(PIECES).spell(b"a", b"\xe4", 0) is None
