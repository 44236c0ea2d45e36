"""Detokenize suite: incremental detokenization per token id, tokenyard against Hugging
Face ``tokenizers``' own streaming decoder (``tokenizers.decoders.DecodeStream``) measured
in the same run.

Run it with ``python -m benchmarks detokenize [--json PATH] [--full] [--tokens N]``.

Every variant streams the same requests (256 ids each, cut from the bundled corpus with
text the bundled tokenizer does not know interleaved, so characters of several byte tokens
are split anywhere) one id at a time through one detokenizer per request, in a fresh
driver process (``benchmarks._detokenizing``):

* **DecodeStream** (the floor): ``tokenizers.decoders.DecodeStream.step`` per id. It is
  not exact: the driver counts the requests whose pieces, joined, differ from the one-shot
  decode, and the count is in the suite's notes.
* **tokenyard** (the subject): ``actors._detokenize.IncrementalDetokenizer.push([id])``
  on the bundled byte-level tokenizer: each id's bytes from a table, decoded at character
  boundaries. Exact (the driver checks every request before timing).
* **tokenyard, windows** (context): the same class on a tokenizer it cannot see is
  byte-level, so it decodes windows of ids through the tokenizer, as for every other kind
  of tokenizer; this was the only way before the byte table.
* **tokenyard, 2 stop strings** (context): the byte path with stop strings to watch.

Rounds alternate: each round runs every variant once, each in a fresh process, so the
machine's drift during the run hits them alike. The reported value is the best round's
nanoseconds per id (noise only ever makes a round slower); every round is in the JSON.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from ._proc import run_driver
from ._results import BASELINE, INFO, SUBJECT, Chart, Figure, Ratio, SuiteResult, Target
from ._stats import RULE
from ._suite import Option, Suite, pick

if TYPE_CHECKING:
    import argparse

    from ._suite import Progress

PAYLOAD = "one id a push"
FLOOR = "HF tokenizers DecodeStream"
#: (driver variant, figure key, label, role).
VARIANTS = (
    ("decodestream", "decodestream", FLOOR, BASELINE),
    ("tokenyard", "tokenyard", "tokenyard, byte-level", SUBJECT),
    ("tokenyard-windows", "windows", "tokenyard, decoding windows", INFO),
    ("tokenyard-stops", "stops", "tokenyard, byte-level, 2 stop strings", INFO),
)
#: The issue's goal: tokenyard's cost per id at most DecodeStream's, while exact.
GOAL = 1.0

OPTIONS = (Option("--tokens", "token ids streamed per round (quick 50000, full 500000)"),)


def command(variant: str, tokens: int, rounds: int) -> list[str]:
    """The driver's command line."""
    return [
        sys.executable,
        "-m",
        "benchmarks._detokenizing",
        variant,
        "--tokens",
        str(tokens),
        "--rounds",
        str(rounds),
    ]


def summarise(figures: list[Figure]) -> list[Target]:
    """Attach every figure's ratio to the floor and check the goal (pure)."""
    by_key = {f.key: f for f in figures}
    base = by_key.get("decodestream.per_token")
    if base is None or not base.value:
        return []
    for fig in figures:
        if fig is not base:
            fig.ratios.append(
                Ratio(baseline=base.key, label="DecodeStream", value=fig.value / base.value)
            )
    subject = by_key.get("tokenyard.per_token")
    if subject is None:
        return []
    value = subject.value / base.value
    return [
        Target(
            name=f"detokenize per id <= {GOAL:g}x DecodeStream, exact",
            figure=subject.key,
            baseline=base.key,
            op="<=",
            threshold=GOAL,
            value=value,
            met=value <= GOAL,
        )
    ]


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Measure every variant, each in a fresh driver, and compare them with the floor."""
    start = time.monotonic()
    tokens = pick(args, "tokens", 50_000, 500_000)
    rounds = args.rounds or (5 if args.full else 3)
    progress.begin(rounds)
    per_token: dict[str, list[float]] = {variant: [] for variant, _, _, _ in VARIANTS}
    for r in range(rounds):
        # Round by round, every variant in turn: the machine's drift hits them alike.
        progress.step(f"round {r + 1} of {rounds}")
        for variant in per_token:
            measured = run_driver(command(variant, tokens, 1), 60.0 + tokens / 5000)
            per_token[variant] += [1e9 / t for t in measured.throughput]
        progress.advance()
    figures: list[Figure] = []
    for variant, key, label, role in VARIANTS:
        figures.append(
            Figure(
                key=f"{key}.per_token",
                variant=label,
                payload=PAYLOAD,
                metric="per token",
                value=round(min(per_token[variant]), 1),
                unit="ns",
                role=role,
                rounds=[round(r, 1) for r in per_token[variant]],
            )
        )
    return SuiteResult(
        suite="detokenize",
        duration_s=round(time.monotonic() - start, 2),
        params={"tokens": tokens, "rounds": rounds, "per_request": 256, "full": bool(args.full)},
        figures=figures,
        targets=summarise(figures),
        charts=[
            Chart(
                name="detokenize-per-token",
                title="incremental detokenization, one id a push (best round; lower is better)",
                metrics=["per token"],
                unit="ns",
                reference=FLOOR,
            )
        ],
        notes=[
            "The best round's nanoseconds per id; every round is in the JSON. Rounds"
            " alternate between the variants, each in a fresh process.",
            RULE,
            "Each variant streams the same requests of 256 ids, a new detokenizer per request"
            " (its creation counted), in its own process; tokenyard's variants are checked"
            " exact (pieces joined == one-shot decode) before timing. DecodeStream is not"
            " exact on text cut inside characters: the driver's stderr counts its misses.",
            f"Measured on {os.cpu_count()} CPUs, one process at a time.",
        ],
    )


SUITE = Suite(
    name="detokenize",
    help="incremental detokenization per token id, against HF tokenizers' DecodeStream",
    run=run,
    options=OPTIONS,
)
