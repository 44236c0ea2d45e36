"""Build the bundled byte-level BPE tokenizer from ``actors/data/corpus.txt``.

Run ``python -m actors.build_tokenizer [--vocab-size N] [--out PATH] [--corpus PATH]``.
The output is a Hugging Face ``tokenizer.json``; the same corpus and vocabulary size
always give the same bytes, so the shipped file can be rebuilt and compared in review.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ._tokenizer import (
    BOS_TOKEN,
    DEFAULT_TOKENIZER_PATH,
    EOS_TOKEN,
    PAD_TOKEN,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = (
    "DEFAULT_CORPUS_PATH",
    "DEFAULT_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "main",
    "write_tokenizer",
)

DEFAULT_CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
"""The corpus the bundled tokenizer is trained on (original text shipped with the project)."""

DEFAULT_VOCAB_SIZE = 4096
"""Vocabulary size of the bundled tokenizer, special tokens and the 256 byte symbols included."""

SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
"""Special tokens, in id order: ``<|pad|>`` is 0, ``<|bos|>`` 1, ``<|eos|>`` 2."""

# The corpus is small (~30 KB), so pairs seen only once must be allowed to merge or training
# stops far short of the requested vocabulary. Capping the token length keeps those rare
# merges word-sized instead of swallowing whole CJK clauses, which have no spaces to split on.
_MIN_FREQUENCY = 1
_MAX_TOKEN_LENGTH = 16


def build_tokenizer(
    corpus: Path = DEFAULT_CORPUS_PATH, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Any:
    """Train a byte-level BPE tokenizer on ``corpus``.

    Args:
        corpus: UTF-8 text file to train on.
        vocab_size: Target vocabulary size, including the special tokens and the 256 byte
            symbols; training may stop short of it when the corpus runs out of pairs.

    Returns:
        The trained ``tokenizers.Tokenizer`` (no normalizer, so encode/decode round-trips
        any text exactly).

    Raises:
        FileNotFoundError: ``corpus`` does not exist.
        ValueError: ``vocab_size`` cannot hold the byte alphabet and the special tokens, or
            the trained tokenizer does not round-trip the corpus.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {minimum} "
            f"({len(alphabet)} byte symbols + {len(SPECIAL_TOKENS)} special tokens); "
            "pass a larger --vocab-size"
        )
    if not corpus.is_file():
        raise FileNotFoundError(
            f"tokenizer corpus {corpus} does not exist; pass an existing UTF-8 text file "
            "with --corpus"
        )

    tokenizer = Tokenizer(models.BPE())
    # No prefix space: decode must give back exactly the text that was encoded.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=_MIN_FREQUENCY,
        max_token_length=_MAX_TOKEN_LENGTH,
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet, seen in the corpus or not, so no input is ever unknown.
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)

    text = corpus.read_text(encoding="utf-8")
    if tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) != text:
        raise ValueError(f"the tokenizer trained on {corpus} does not round-trip its corpus")
    return tokenizer


def write_tokenizer(tokenizer: Any, out: Path) -> None:
    """Write ``tokenizer`` to ``out`` as pretty-printed JSON, atomically.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``.
        out: Destination ``tokenizer.json``; its directory is created if needed.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so an interrupted build never leaves a truncated file that would
    # only fail later, when a pipeline tries to load it.
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(str(tokenizer.to_str(pretty=True)) + "\n", encoding="utf-8")
    os.replace(tmp, out)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: build the tokenizer and write it.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The process exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m actors.build_tokenizer",
        description="Build tokenyard's bundled byte-level BPE tokenizer.",
    )
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER_PATH)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS_PATH)
    args = parser.parse_args(argv)
    try:
        tokenizer = build_tokenizer(args.corpus, args.vocab_size)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    write_tokenizer(tokenizer, args.out)
    sys.stdout.write(f"wrote {args.out} ({tokenizer.get_vocab_size()} tokens)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
