from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models

from actors._byte_table import byte_table
from actors._detokenize import IncrementalDetokenizer
from actors._tokenizer import EOS_TOKEN, load_tokenizer

TOKENIZER = load_tokenizer()
EOS: int = TOKENIZER.token_to_id(EOS_TOKEN)


class TestTheByteTable:
    def test_a_byte_level_tokenizer_has_one_and_it_is_built_once(self) -> None:
        table = byte_table(TOKENIZER)
        assert table is not None
        assert byte_table(TOKENIZER) is table
        assert len(table.with_special) == TOKENIZER.get_vocab_size()

    def test_each_id_decodes_as_its_bytes_do(self) -> None:
        table = byte_table(TOKENIZER)
        assert table is not None
        ids = TOKENIZER.encode("The tide clock 潮汐 🌊").ids
        assert b"".join(table.without_special[i] for i in ids).decode() == TOKENIZER.decode(ids)

    def test_special_tokens_are_empty_only_when_skipped(self) -> None:
        table = byte_table(TOKENIZER)
        assert table is not None
        assert table.without_special[EOS] == b""
        assert table.with_special[EOS] == EOS_TOKEN.encode()

    def test_a_tokenizer_that_is_not_byte_level_has_none(self) -> None:
        word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        assert byte_table(word_level) is None

    def test_anything_that_only_decodes_has_none(self) -> None:
        class Decodes:
            def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
                return ""

        assert byte_table(Decodes()) is None


class TestIdsOutsideTheVocabulary:
    def test_an_id_past_the_vocabulary_streams_what_decode_makes_of_it(self) -> None:
        big = TOKENIZER.get_vocab_size() + 5
        ids = [*TOKENIZER.encode("tide clock").ids, big]
        detok = IncrementalDetokenizer(TOKENIZER)
        pieces = [detok.push([i]) for i in ids]
        pieces.append(detok.push([ids[0], big], finished=True))
        assert "".join(pieces) == TOKENIZER.decode([*ids, ids[0], big])

    def test_a_negative_id_fails_as_decode_does(self) -> None:
        detok = IncrementalDetokenizer(TOKENIZER)
        with pytest.raises(OverflowError):
            TOKENIZER.decode([-1])
        with pytest.raises(OverflowError):
            detok.push([-1])
