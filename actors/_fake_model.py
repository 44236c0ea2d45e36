"""The stand-in engine's model: which token ids it draws from, and its fake prefix cache.

Kept apart from the scheduler actor (the batching and the message contract) so each reads
on its own.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ._tokenizer import eos_token_id

# Shares of the draws that pick a non-ASCII token, and a character spelled over several
# tokens: enough that most outputs of a dozen tokens hold multi-byte text.
WIDE_SHARE = 0.3
SPLIT_SHARE = 0.1
# eos is never drawn before this many tokens, so every output has some text.
MIN_TOKENS_BEFORE_EOS = 4
# Texts whose encodings spell a character over several ids, where the vocabulary has them.
_SPLIT_SAMPLES = ("語", "😀", "€", "→", "🎉", "…", "✓", "👍🏽", "中文", "日本語", "😀👍")
# The prefix cache stand-in: hashed prompt prefixes in blocks of this many ids, LRU-bounded.
_CACHE_BLOCK = 16
_CACHE_CAPACITY = 1 << 16


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What the stand-in draws from, sorted into pools once per tokenizer.

    Attributes:
        size: Ids ``0..size-1`` are the vocabulary; prompt ids outside are refused.
        eos: The end-of-sequence id, if the tokenizer has a known one.
        plain: Ids that decode alone to printable ASCII text.
        wide: Ids that decode alone to whole printable non-ASCII characters.
        split: Id sequences spelling non-ASCII characters whose bytes span several ids.
    """

    size: int
    eos: int | None
    plain: tuple[int, ...]
    wide: tuple[int, ...]
    split: tuple[tuple[int, ...], ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> Vocabulary:
        """Sort a ``tokenizers.Tokenizer``'s ordinary ids into the pools.

        Raises:
            ValueError: No ordinary id decodes to printable text on its own.
        """
        special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        eos = eos_token_id(tokenizer)
        if eos is not None:
            special.add(eos)
        ids = sorted(set(tokenizer.get_vocab(with_added_tokens=True).values()) - special)
        plain: list[int] = []
        wide: list[int] = []
        texts = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        for token_id, text in zip(ids, texts, strict=True):
            # U+FFFD: a fragment of a character, only drawn as part of a `split` sequence.
            if not text or "\ufffd" in text or not _printable(text):
                continue
            (plain if text.isascii() else wide).append(token_id)
        split: list[tuple[int, ...]] = []
        for sample in _SPLIT_SAMPLES:
            seq = tuple(tokenizer.encode(sample, add_special_tokens=False).ids)
            text = tokenizer.decode(list(seq), skip_special_tokens=False)
            fragments = any("\ufffd" in tokenizer.decode([i]) for i in seq)
            if fragments and "\ufffd" not in text and not special.intersection(seq):
                split.append(seq)
        if not plain and not wide:
            raise ValueError(
                "the tokenizer has no ordinary token that decodes to printable text on its "
                "own, so the stand-in engine has nothing to generate; pass a tokenizer.json "
                "with a real vocabulary (or None for the bundled default)"
            )
        size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        return cls(size, eos, tuple(plain or wide), tuple(wide), tuple(split))


def _printable(text: str) -> bool:
    return all(c.isprintable() or c in "\n\t" for c in text)


class PrefixCache:
    """Which prompt prefixes were seen, in whole blocks: a bounded stand-in radix cache."""

    def __init__(self, block: int = _CACHE_BLOCK, capacity: int = _CACHE_CAPACITY) -> None:
        self._block = block
        self._capacity = capacity
        # Chained digests of prefixes ending on a block boundary; the oldest are evicted.
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def match(self, ids: list[int]) -> int:
        """Return how many leading ids were cached (whole blocks), then cache ``ids``'s blocks.

        The last id never counts: an engine computes at least one position of a prompt.
        """
        blocks, block = self._blocks, self._block
        data = array("q", ids).tobytes()
        width = block * 8
        digest = hashlib.blake2b(digest_size=16)
        cached, hit = 0, True
        for k in range((len(ids) - 1) // block):
            digest.update(data[k * width : (k + 1) * width])
            key = digest.digest()
            if hit and key in blocks:
                cached += block
            else:
                hit = False
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self._capacity:
            blocks.popitem(last=False)
        return cached

    def clear(self) -> None:
        """Forget every prefix."""
        self._blocks.clear()
