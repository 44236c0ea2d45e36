"""Byte-level detokenization: each token id's bytes, looked up once, then decoded only at
character boundaries.

A byte-level BPE tokenizer (GPT-2's scheme, used by Llama 3, Qwen, GPT-NeoX and the
bundled tokenizer) decodes by turning every token into bytes on its own, concatenating
them, and decoding the whole as UTF-8 with each invalid sequence replaced by U+FFFD. So
a stream can skip the tokenizer entirely: look each id's bytes up in a table and feed them
to Python's incremental UTF-8 decoder, which holds back an incomplete trailing character
and, joined, gives exactly the one-shot lossy decode. The table is built from the
tokenizer's own vocabulary and checked, id by id, against the tokenizer's own ``decode``;
a tokenizer whose decoder does anything else (SentencePiece's metaspace, WordPiece) or
whose table fails the check gets no table, and the caller decodes windows instead.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ("ByteTable", "byte_table", "special_ids")

T = TypeVar("T")


def _byte_chars() -> dict[str, int]:
    """The byte-level alphabet: the character that stands for each byte in a vocabulary.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, the soft
    hyphen) are given the code points from 256 upwards, in byte order.
    """
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_chars()


def _token_bytes(token: str) -> bytes:
    """A vocabulary entry's bytes: through the alphabet when every character is in it, as
    the byte-level decoder does, else the entry's own UTF-8 (an added token's text)."""
    try:
        return bytes([_BYTE_OF_CHAR[c] for c in token])
    except KeyError:
        return token.encode()


class ByteTable:
    """The bytes of every token id of one tokenizer, with and without special tokens.

    Attributes:
        with_special: ``with_special[id]``: the id's bytes when special tokens are kept.
        without_special: The same with every special token's bytes empty.
    """

    __slots__ = ("with_special", "without_special")

    def __init__(self, with_special: tuple[bytes, ...], without_special: tuple[bytes, ...]):
        self.with_special = with_special
        self.without_special = without_special

    def of(self, skip_special_tokens: bool) -> tuple[bytes, ...]:
        """The table to use for one request."""
        return self.without_special if skip_special_tokens else self.with_special


def _build(tokenizer: Any) -> ByteTable | None:
    """The table of ``tokenizer``, or ``None`` when its decode is not byte-level concatenation."""
    try:
        from tokenizers import Tokenizer, decoders
    except ImportError:  # pragma: no cover - tokenizers is a dependency of actors
        return None
    if not isinstance(tokenizer, Tokenizer) or not isinstance(
        tokenizer.decoder, decoders.ByteLevel
    ):
        return None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
    tokens: list[str | None] = [None] * size
    for token, index in vocab.items():
        if not 0 <= index < size:
            return None
        tokens[index] = token
    if any(t is None for t in tokens):
        return None
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    with_special = tuple(_token_bytes(t) for t in tokens if t is not None)
    without_special = tuple(b"" if i in special else b for i, b in enumerate(with_special))
    table = ByteTable(with_special, without_special)
    # The check, both ways: every id decodes alone as its bytes do, and the whole
    # vocabulary in order and in reverse (ids whose bytes are parts of characters, next
    # to each other) decodes as its bytes joined do.
    singles = [[i] for i in range(size)]
    every = list(range(size))
    for skip in (False, True):
        rows = table.of(skip)
        got = tokenizer.decode_batch(singles, skip_special_tokens=skip)
        if any(g != rows[i].decode("utf-8", "replace") for i, g in enumerate(got)):
            return None
        for ids in (every, every[::-1]):
            joined = b"".join([rows[i] for i in ids]).decode("utf-8", "replace")
            if tokenizer.decode(ids, skip_special_tokens=skip) != joined:
                return None
    return table


_lock = threading.Lock()
# Tokenizers seen, by id, each held so that its id is not reused while it is cached; a
# process loads one or two tokenizers, so a few entries are plenty.
_cache: dict[int, tuple[Any, ByteTable | None]] = {}
_CACHE_SIZE = 4


def _once_per_tokenizer(
    cache: dict[int, tuple[Any, T]], tokenizer: Any, build: Callable[[Any], T]
) -> T:
    """What ``build`` makes of ``tokenizer``, made once per tokenizer object and kept in
    ``cache`` (at most `_CACHE_SIZE` of them, the oldest let go first)."""
    with _lock:
        hit = cache.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    made = build(tokenizer)
    with _lock:
        if len(cache) >= _CACHE_SIZE:
            del cache[next(iter(cache))]
        cache[id(tokenizer)] = (tokenizer, made)
    return made


def byte_table(tokenizer: Any) -> ByteTable | None:
    """The byte table of ``tokenizer``, built once per tokenizer object, or ``None`` when its
    decode is not byte-level (the caller then decodes windows of ids instead)."""
    return _once_per_tokenizer(_cache, tokenizer, _build)


# Tokenizers seen, by id, with their special ids (held as `_cache` holds them).
_specials: dict[int, tuple[Any, frozenset[int]]] = {}


def _find_specials(tokenizer: Any) -> frozenset[int]:
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    return frozenset() if added is None else frozenset(i for i, t in added().items() if t.special)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids a decode with ``skip_special_tokens`` leaves out, found once per tokenizer
    object: its added tokens marked special, as ``tokenizers.Tokenizer`` lists them (none
    for a tokenizer that lists no added tokens)."""
    return _once_per_tokenizer(_specials, tokenizer, _find_specials)
