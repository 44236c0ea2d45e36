"""The stand-in engine (`FakeModel`): which token ids it draws, and its fake prefix cache.

A `actors.engines.Generator` like any other: the scheduler actor keeps the batching and the
message contract, so each reads on its own.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._tokenizer import eos_token_id, vocab_size
from .engines import Produced

if TYPE_CHECKING:
    from collections.abc import Hashable

    from .engines import StandIn
    from .messages import SamplingParams

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
        size = vocab_size(tokenizer)
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


class _Draws:
    """One request's draws: its random stream, its count, the rest of a character."""

    __slots__ = ("count", "ignore_eos", "pending", "rng")

    def __init__(self, rng: random.Random, ignore_eos: bool) -> None:
        self.rng = rng
        self.ignore_eos = ignore_eos
        self.count = 0
        self.pending: list[int] = []  # the rest of a character being spelled, reversed


class FakeModel:
    """The stand-in engine's `actors.engines.Generator`: one deterministic token per
    running request per step.

    A request's ids are a seeded function of its prompt ids, its sampling seed (only when
    ``temperature > 0``) and the position, drawn from the tokenizer's ordinary vocabulary
    and biased towards non-ASCII text, including characters spelled over several tokens,
    so that the detokenizer's multi-byte handling is exercised. The seed is a BLAKE2
    digest, never ``hash()`` (salted per process): a prompt gives the same ids on every
    run and in every process. eos is drawn now and then after a few tokens (unless
    ``ignore_eos``).

    Args:
        spec: Its step time, seed and eos probability.
        tokenizer: The ``tokenizers.Tokenizer`` whose vocabulary it draws from.
    """

    def __init__(self, spec: StandIn, tokenizer: Any) -> None:
        self._spec = spec
        self._vocab = Vocabulary.from_tokenizer(tokenizer)
        self._cache = PrefixCache()
        self._live: dict[Hashable, _Draws] = {}

    @property
    def vocab_size(self) -> int:
        """Ids ``0..vocab_size-1`` are the tokenizer's."""
        return self._vocab.size

    @property
    def eos(self) -> int | None:
        """The tokenizer's eos, if it has a known one."""
        return self._vocab.eos

    @property
    def capacity(self) -> int | None:
        """No bound of its own: the scheduler's ``max_batch_size``."""
        return None

    @property
    def pace(self) -> float:
        """The spec's step time."""
        return self._spec.step_time

    @property
    def context_length(self) -> None:
        """No bound: it generates from any prompt."""
        return None

    def admit(self, key: Hashable, prompt_ids: list[int], sampling: SamplingParams) -> int:
        """Seed the request's draws; returns the prompt's cached prefix."""
        seed = sampling.seed if sampling.temperature > 0 else None
        digest = hashlib.blake2b(repr((self._spec.seed, seed)).encode(), digest_size=16)
        digest.update(array("q", prompt_ids).tobytes())
        rng = random.Random(int.from_bytes(digest.digest(), "little"))
        self._live[key] = _Draws(rng, sampling.ignore_eos)
        return self._cache.match(prompt_ids)

    def cancel(self, key: Hashable) -> None:
        """Forget the request."""
        self._live.pop(key, None)

    def ready(self) -> bool:
        """Every running request has a token at every step."""
        return bool(self._live)

    def take(self) -> dict[Hashable, Produced]:
        """One token for every running request."""
        return {key: Produced([self._draw(draws)]) for key, draws in self._live.items()}

    def flush(self) -> bool:
        """Forget the cached prefixes, if nothing runs."""
        if self._live:
            return False
        self._cache.clear()
        return True

    async def aclose(self) -> None:
        """Nothing to release."""
        self._live.clear()

    def _draw(self, draws: _Draws) -> int:
        """The request's next id: a function of its draws so far, so of its position."""
        rng = draws.rng
        # One eos roll at every position, whatever follows: requests that differ only in
        # ignore_eos, stop_token_ids or max_new_tokens draw the same ids until they end.
        eos_roll = rng.random()
        position = draws.count
        draws.count += 1
        if draws.pending:
            return draws.pending.pop()  # finish spelling the character; eos never splits one
        vocab = self._vocab
        pick = rng.random()
        if pick < WIDE_SHARE and vocab.wide:
            token = rng.choice(vocab.wide)
        elif pick < WIDE_SHARE + SPLIT_SHARE and vocab.split:
            token, *rest = rng.choice(vocab.split)
            draws.pending = rest[::-1]
        else:
            token = rng.choice(vocab.plain)
        if (
            eos_roll < self._spec.eos_probability
            and position >= MIN_TOKENS_BEFORE_EOS
            and vocab.eos is not None
            and not draws.ignore_eos
        ):
            return vocab.eos
        return token
