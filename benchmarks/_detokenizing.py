"""The driver of the detokenize suite: ``python -m benchmarks._detokenizing <variant>``.

Each variant streams the same requests, one token id at a time, through one incremental
detokenizer per request, and prints a `benchmarks._proc.Measurement` whose throughput is
token ids per second, one value per round. Before timing, it checks its own output: the
pieces of every request, joined, against the tokenizer's one-shot decode (tokenyard's must
be equal; DecodeStream's mismatches are counted and printed to stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ._proc import Measurement

if TYPE_CHECKING:
    from collections.abc import Callable

#: Variants: DecodeStream (HF tokenizers' own streaming decoder, the floor), tokenyard on
#: a byte-level tokenizer (bytes, decoded at character boundaries), tokenyard decoding
#: windows of ids (what any other tokenizer gets), and tokenyard with two stop strings.
VARIANTS = ("decodestream", "tokenyard", "tokenyard-windows", "tokenyard-stops")

#: Text the streamed ids come from: the bundled corpus (English, which the bundled BPE
#: knows) and text it does not know (each character several byte tokens, cut anywhere).
FOREIGN = "潮汐の時計は北の岸にある。🌊 Ж ωραίο 한글 👨‍👩‍👧‍👦 é\u0301 "


class _Windows:
    """A tokenizer that only decodes: the detokenizer cannot see it is byte-level."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def requests(tokenizer: Any, per_request: int, total: int) -> list[list[int]]:
    """``total`` ids cut into requests of ``per_request`` ids, from the corpus and
    `FOREIGN` interleaved paragraph by paragraph."""
    from actors._tokenizer import DEFAULT_TOKENIZER_PATH

    corpus = (DEFAULT_TOKENIZER_PATH.parent / "corpus.txt").read_text()
    text = "".join(p + "\n" + FOREIGN for p in corpus.split("\n\n"))
    ids: list[int] = tokenizer.encode(text).ids
    while len(ids) < total:
        ids = ids + ids
    ids = ids[:total]
    return [ids[i : i + per_request] for i in range(0, total, per_request)]


def streamer(variant: str, tokenizer: Any) -> Callable[[list[int]], list[str]]:
    """A function that streams one request's ids one at a time and returns its pieces."""
    if variant == "decodestream":
        from tokenizers.decoders import DecodeStream

        def decode_stream(ids: list[int]) -> list[str]:
            stream = DecodeStream(skip_special_tokens=True)
            step = stream.step
            return [piece for i in ids if (piece := step(tokenizer, i)) is not None]

        return decode_stream

    from actors._detokenize import IncrementalDetokenizer

    source = _Windows(tokenizer) if variant == "tokenyard-windows" else tokenizer
    stop = ["<<stop>>", "\n\n\n"] if variant == "tokenyard-stops" else []

    def incremental(ids: list[int]) -> list[str]:
        detok = IncrementalDetokenizer(source, stop=stop)
        push = detok.push
        pieces = [push([i]) for i in ids]
        pieces.append(push([], finished=True))
        return pieces

    return incremental


def main(argv: list[str] | None = None) -> int:
    """Run one variant and print its measurement."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks._detokenizing")
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--per-request", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args(argv)

    from actors._tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    batch = requests(tokenizer, opts.per_request, opts.tokens)
    run = streamer(opts.variant, tokenizer)
    wrong = sum(
        "".join(run(ids)) != tokenizer.decode(ids, skip_special_tokens=True) for ids in batch
    )
    if wrong and opts.variant != "decodestream":
        sys.stderr.write(f"{opts.variant}: {wrong} of {len(batch)} requests not exact\n")
        return 1
    sys.stderr.write(f"{opts.variant}: {wrong} of {len(batch)} requests differ from decode\n")
    run(batch[0])  # warm-up: the byte table, caches
    measured = Measurement()
    for _ in range(opts.rounds):
        start = time.perf_counter()
        for ids in batch:
            run(ids)
        measured.throughput.append(opts.tokens / (time.perf_counter() - start))
    sys.stdout.write(msgspec.json.encode(measured).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
