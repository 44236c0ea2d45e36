"""Mailbox suite: tokenyard ``tell`` throughput and ``ask`` latency between two processes,
against plain pyzmq and SGLang's ``send_pyobj`` measured in the same run.

Run it with ``python -m benchmarks mailbox [--json PATH] [--full]``.

Payloads (``benchmarks._messages``): a *small* request; a 32-request *batch* shaped like
SGLang's ``BatchTokenIDOutput`` on a decode step where no request asked for logprobs (the
common case: every logprob field ``None``); and the same batch with *logprobs* (every logprob
field carrying one list per request), where decoding dominates every variant.

Variants, each in fresh processes (a driver and its peer, see ``benchmarks._peers``):

* **tokenyard tell**: the ``ActorSystem`` process tells a counting actor process; a round
  runs from the first ``tell`` until the actor has handled the last (an ``ask`` queued
  behind the tells returns the count).
* **pyzmq floor**: a synchronous PUSH -> PULL loop; the sender msgspec-encodes each message,
  the receiver decodes each with a ``msgspec`` decoder. The same bytes as tokenyard's tell.
* **pyzmq, no decode** (context only): one pre-encoded frame sent again and again, the
  receiver only counts: the transport alone.
* **send_pyobj**: SGLang's way: a synchronous ``send_pyobj`` of an equivalent dataclass into
  a ``zmq.asyncio`` receiver awaiting ``recv_pyobj`` per message.
* **tokenyard tell, metrics off**: the same tell with ``TOKENYARD_METRICS=off`` in both
  processes (no handler clock): what the runtime's own metrics cost on the hot path.
* **tokenyard tell, traced**: the same tell carrying trace context in its frame header,
  as the pipeline's tells do for a traced request (one ``traceparent`` for a small message,
  one per request for a batch): what carrying a trace costs. An untraced tell is one
  frame, the same bytes as before the header could carry one.
* **tokenyard tell, traced, new contexts**: the same, each tell's contexts other than the
  tell before's, so that the receiver decodes every tell's (it decodes contexts once while
  they repeat, as the traced variant's do).
* **tokenyard ask** against raw round trips with **pyzmq sync** and **zmq.asyncio** sockets
  (PUSH/PULL both ways like tokenyard, the same request and ``Ack`` bytes).

Each variant runs ``rounds`` timed rounds after a warm-up (a tenth of a round for
throughput, a whole round for round trips); the reported value is the best
round (the highest throughput, the round with the lowest p50), because on a shared machine
noise only ever makes a round slower. Every round is kept in the JSON. The variants that are
compared to a few percent (`TWINS`: tell with its metrics off and its two traced variants,
ask with its two raw round trips) run in turn, a fresh driver each round.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ._proc import Latency, Measurement, peer_command, run_driver
from ._results import BASELINE, INFO, SUBJECT, Chart, Figure, Ratio, SuiteResult, Target
from ._stats import RULE
from ._suite import Option, Suite, pick

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from ._suite import Progress

THROUGHPUT = "throughput"
LATENCY = "latency"
METRICS_OFF = "tell_nometrics"
TRACED = "tell_traced"
TRACED_NEW = "tell_traced_new"
#: The variants measured in alternate rounds with a subject, by name (its twins): a fresh
#: driver each round, the group's variants in turn, so that a difference of a few percent
#: between them is not the machine's drift between two runs.
TWINS = {"tell": (METRICS_OFF, TRACED, TRACED_NEW), "ask": ("ask_sync", "ask_asyncio")}

OPTIONS = (
    Option("--messages", "small messages told per round (quick 50000, full 500000)"),
    Option(
        "--batches",
        "batch messages told per round (quick 5000, or 2000 with logprobs; full 10x that)",
    ),
    Option("--asks", "asks per round, each payload (quick 1000, full 10000)"),
)


@dataclass(frozen=True)
class Variant:
    """One thing measured in its own processes."""

    name: str  # figure key prefix: "<name>.<payload>.<metric>"
    label: str  # how tables and charts name it
    driver: str  # role in benchmarks._peers
    payload: str
    kind: str  # THROUGHPUT or LATENCY
    role: str  # SUBJECT, BASELINE or INFO
    extra: tuple[str, ...] = ()
    share: float = 1.0  # fraction of the payload's message count a round carries

    @property
    def prefix(self) -> str:
        """Key prefix of this variant's figures."""
        return f"{self.name}.{self.payload}"


FLOOR = "pyzmq floor"
RAW = "pyzmq no decode"
PYOBJ = "send_pyobj asyncio"
TELL = "tokenyard tell"
ASK_SYNC = "pyzmq sync"
ASK_ASYNCIO = "zmq.asyncio"
ASK = "tokenyard ask"


def variants() -> list[Variant]:
    """Every variant, baselines next to the subject so machine drift hits them alike."""
    out: list[Variant] = []
    for payload in ("small", "batch", "logprobs"):
        out += [
            Variant("floor", FLOOR, "floor", payload, THROUGHPUT, BASELINE),
            Variant("raw", RAW, "floor", payload, THROUGHPUT, INFO, ("--no-decode",)),
            # send_pyobj of a small message is ~20x slower than the floor: a fifth of the
            # messages still makes its rounds the longest, and keeps the quick run quick.
            Variant(
                "pyobj",
                PYOBJ,
                "pyobj",
                payload,
                THROUGHPUT,
                BASELINE,
                share=0.2 if payload == "small" else 1.0,
            ),
            Variant("tell", TELL, "tokenyard-tell", payload, THROUGHPUT, SUBJECT),
        ]
        if payload != "logprobs":
            out += [
                Variant(
                    METRICS_OFF,
                    f"{TELL} (metrics off)",
                    "tokenyard-tell",
                    payload,
                    THROUGHPUT,
                    BASELINE,
                    ("--metrics", "off"),
                ),
                Variant(
                    TRACED,
                    f"{TELL} (traced)",
                    "tokenyard-tell",
                    payload,
                    THROUGHPUT,
                    INFO,
                    ("--traced",),
                ),
                Variant(
                    TRACED_NEW,
                    f"{TELL} (traced, new contexts)",
                    "tokenyard-tell",
                    payload,
                    THROUGHPUT,
                    INFO,
                    ("--new-contexts",),
                ),
            ]
    for payload in ("small", "batch"):
        out += [
            Variant("ask_sync", ASK_SYNC, "ask-sync", payload, LATENCY, BASELINE),
            Variant("ask_asyncio", ASK_ASYNCIO, "ask-asyncio", payload, LATENCY, BASELINE),
            Variant("ask", ASK, "tokenyard-ask", payload, LATENCY, SUBJECT),
        ]
    # The cost of CURVE: the same tell and ask over tcp, encrypted and authenticated or not.
    for transport, name, role in (("tcp-plain", "plain", BASELINE), ("tcp", "curve", SUBJECT)):
        out += [
            Variant(
                f"tell_{name}",
                f"{TELL} (tcp, {'CURVE' if name == 'curve' else 'no CURVE'})",
                "tokenyard-tell",
                "small",
                THROUGHPUT,
                role,
                ("--transport", transport),
            ),
            Variant(
                f"ask_{name}",
                f"{ASK} (tcp, {'CURVE' if name == 'curve' else 'no CURVE'})",
                "tokenyard-ask",
                "small",
                LATENCY,
                role,
                ("--transport", transport),
            ),
        ]
    return out


#: (figure, baseline, label) triples: every ratio the report shows.
RATIOS = (
    ("tell.small.throughput", "floor.small.throughput", "floor"),
    ("tell.small.throughput", "pyobj.small.throughput", "send_pyobj"),
    ("tell.batch.throughput", "floor.batch.throughput", "floor"),
    ("tell.batch.throughput", "pyobj.batch.throughput", "send_pyobj"),
    ("pyobj.small.throughput", "floor.small.throughput", "floor"),
    ("pyobj.batch.throughput", "floor.batch.throughput", "floor"),
    ("raw.small.throughput", "floor.small.throughput", "floor"),
    ("raw.batch.throughput", "floor.batch.throughput", "floor"),
    ("tell.logprobs.throughput", "floor.logprobs.throughput", "floor"),
    ("tell.logprobs.throughput", "pyobj.logprobs.throughput", "send_pyobj"),
    ("pyobj.logprobs.throughput", "floor.logprobs.throughput", "floor"),
    ("raw.logprobs.throughput", "floor.logprobs.throughput", "floor"),
    ("ask.small.p50", "ask_asyncio.small.p50", "zmq.asyncio"),
    ("ask.small.p50", "ask_sync.small.p50", "pyzmq sync"),
    ("ask.small.p99", "ask_asyncio.small.p99", "zmq.asyncio"),
    ("ask.batch.p50", "ask_asyncio.batch.p50", "zmq.asyncio"),
    ("ask.batch.p50", "ask_sync.batch.p50", "pyzmq sync"),
    ("ask.batch.p99", "ask_asyncio.batch.p99", "zmq.asyncio"),
    ("ask_asyncio.small.p50", "ask_sync.small.p50", "pyzmq sync"),
    ("ask_asyncio.batch.p50", "ask_sync.batch.p50", "pyzmq sync"),
    ("tell_curve.small.throughput", "tell_plain.small.throughput", "tcp without CURVE"),
    ("ask_curve.small.p50", "ask_plain.small.p50", "tcp without CURVE"),
    ("ask_curve.small.p99", "ask_plain.small.p99", "tcp without CURVE"),
    ("tell_plain.small.throughput", "tell.small.throughput", "ipc"),
    ("tell.small.throughput", "tell_nometrics.small.throughput", "metrics off"),
    ("tell.batch.throughput", "tell_nometrics.batch.throughput", "metrics off"),
    ("tell_traced.small.throughput", "tell.small.throughput", "untraced"),
    ("tell_traced.batch.throughput", "tell.batch.throughput", "untraced"),
    ("tell_traced_new.small.throughput", "tell.small.throughput", "untraced"),
    ("tell_traced_new.batch.throughput", "tell.batch.throughput", "untraced"),
)

#: The goals of the issue: (name, figure, baseline or "", op, threshold).
TARGETS = (
    ("tell small >= 0.5x floor", "tell.small.throughput", "floor.small.throughput", ">=", 0.5),
    ("tell batch >= 0.8x floor", "tell.batch.throughput", "floor.batch.throughput", ">=", 0.8),
    (
        "tell batch >= 2x send_pyobj",
        "tell.batch.throughput",
        "pyobj.batch.throughput",
        ">=",
        2.0,
    ),
    ("ask p50 (small) < 150 us", "ask.small.p50", "", "<", 150.0),
    ("tell small >= 0.85x floor", "tell.small.throughput", "floor.small.throughput", ">=", 0.85),
    (
        "traced tell small >= 0.6x untraced",
        "tell_traced.small.throughput",
        "tell.small.throughput",
        ">=",
        0.6,
    ),
    (
        "traced tell batch >= 0.9x untraced",
        "tell_traced.batch.throughput",
        "tell.batch.throughput",
        ">=",
        0.9,
    ),
    (
        "ask p50 (small) <= 1.0x zmq.asyncio",
        "ask.small.p50",
        "ask_asyncio.small.p50",
        "<=",
        1.0,
    ),
    (
        "tell small with metrics >= 0.97x metrics off",
        "tell.small.throughput",
        "tell_nometrics.small.throughput",
        ">=",
        0.97,
    ),
    (
        "tell batch with metrics >= 0.97x metrics off",
        "tell.batch.throughput",
        "tell_nometrics.batch.throughput",
        ">=",
        0.97,
    ),
)

CHARTS = [
    Chart(
        name="mailbox-throughput",
        title="tell throughput between two processes (best round; higher is better)",
        metrics=[THROUGHPUT],
        unit="msg/s",
        reference=FLOOR,
    ),
    Chart(
        name="mailbox-latency",
        title="ask round trip between two processes (best round; lower is better)",
        metrics=["p50", "p99"],
        unit="us",
        limits={"small": 150.0},  # the absolute goal for ask p50
        log=True,  # p99 on a shared machine can be 10x p50; both must stay readable
    ),
]


def _figures(variant: Variant, measured: Measurement) -> list[Figure]:
    """Turn a driver's rounds into figures: the best round is the reported value."""
    if variant.kind == THROUGHPUT:
        return [
            Figure(
                key=f"{variant.prefix}.throughput",
                variant=variant.label,
                payload=variant.payload,
                metric=THROUGHPUT,
                value=max(measured.throughput),
                unit="msg/s",
                role=variant.role,
                rounds=[round(r, 1) for r in measured.throughput],
            )
        ]
    best: Latency = min(measured.latency, key=lambda r: r.p50_us)
    return [
        Figure(
            key=f"{variant.prefix}.{metric}",
            variant=variant.label,
            payload=variant.payload,
            metric=metric,
            value=round(getattr(best, f"{metric}_us"), 2),
            unit="us",
            role=variant.role,
            rounds=[round(getattr(r, f"{metric}_us"), 2) for r in measured.latency],
        )
        for metric in ("p50", "p99", "mean")
    ]


def _check(op: str, value: float, threshold: float) -> bool:
    if op == ">=":
        return value >= threshold
    if op == "<":
        return value < threshold
    if op == "<=":
        return value <= threshold
    raise ValueError(f"unknown comparison {op!r}")


def summarise(figures: list[Figure]) -> tuple[list[Figure], list[Target]]:
    """Attach ratios to the figures and check the targets (pure: testable without a run)."""
    by_key = {f.key: f for f in figures}
    for key, base, label in RATIOS:
        if key in by_key and base in by_key and by_key[base].value:
            by_key[key].ratios.append(
                Ratio(baseline=base, label=label, value=by_key[key].value / by_key[base].value)
            )
    targets = []
    for name, key, base, op, threshold in TARGETS:
        if key not in by_key or (base and base not in by_key):
            continue
        value = by_key[key].value / by_key[base].value if base else by_key[key].value
        targets.append(
            Target(
                name=name,
                figure=key,
                baseline=base,
                op=op,
                threshold=threshold,
                value=value,
                met=_check(op, value, threshold),
            )
        )
    return figures, targets


def groups(todo: list[Variant]) -> list[tuple[Variant, ...]]:
    """The variants in the order they are measured: each alone, or a subject with its
    `TWINS` (of its payload), measured round by round together."""
    by_key = {(v.name, v.payload): v for v in todo}
    twinned = {(t, v.payload) for v in todo for t in TWINS.get(v.name, ())}
    return [
        (v, *(by_key[t, v.payload] for t in TWINS.get(v.name, ()) if (t, v.payload) in by_key))
        for v in todo
        if (v.name, v.payload) not in twinned
    ]


def _interleaved(
    group: tuple[Variant, ...],
    rounds: int,
    command: Callable[[Variant, int], list[str]],
    timeout: float,
) -> dict[Variant, Measurement]:
    """Rounds of a few variants in turn, each round a fresh driver; each round begins with
    the next variant, so that whatever running first or last does is spread over all."""
    merged = {variant: Measurement() for variant in group}
    for n in range(rounds):
        start = n % len(group)
        for variant in group[start:] + group[:start]:
            one = run_driver(command(variant, 1), timeout)
            merged[variant].throughput += one.throughput
            merged[variant].latency += one.latency
            merged[variant].frame_bytes = one.frame_bytes or merged[variant].frame_bytes
    return merged


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Measure every variant, each in fresh processes, and compare them."""
    start = time.monotonic()
    rounds = args.rounds or (5 if args.full else 3)
    counts = {
        "small": pick(args, "messages", 50_000, 500_000),
        "batch": pick(args, "batches", 5_000, 50_000),
        "logprobs": pick(args, "batches", 2_000, 20_000),
    }
    asks = pick(args, "asks", 1_000, 10_000)
    timeout = 600.0 if args.full else 180.0
    todo = variants()
    progress.begin(len(todo))
    figures: list[Figure] = []
    frame_bytes: dict[str, int] = {}
    workdir = tempfile.mkdtemp(prefix="tokenyard-bench-")  # 0700: private ipc sockets

    def command(variant: Variant, n_rounds: int) -> list[str]:
        if variant.kind == THROUGHPUT:
            count = max(int(counts[variant.payload] * variant.share), 1)
            warmup = max(count // 10, 100)
        else:
            # A round's worth: round trips of a process pair that has just started run
            # slower for a tenth of a second or so on this VM, whatever the variant.
            count = warmup = asks
        return peer_command(
            variant.driver,
            "--dir", workdir, "--payload", variant.payload, "--count", str(count),
            "--rounds", str(n_rounds), "--warmup", str(warmup),
            *variant.extra,
        )  # fmt: skip

    try:
        for variant, *twins in groups(todo):
            progress.step(f"{variant.label} ({variant.payload})")
            if not twins:
                measured = {variant: run_driver(command(variant, rounds), timeout)}
            else:
                measured = _interleaved((variant, *twins), rounds, command, timeout)
                for _ in twins:
                    progress.advance()
            for one, measurement in measured.items():
                if measurement.frame_bytes:
                    frame_bytes[one.payload] = measurement.frame_bytes
                figures += _figures(one, measurement)
            progress.advance()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures, targets = summarise(figures)
    titles = {p: f"{p} message ({n:,} B msgpack)" for p, n in frame_bytes.items()}
    charts = [msgspec.structs.replace(c, panel_titles=titles) for c in CHARTS]
    return SuiteResult(
        suite="mailbox",
        duration_s=round(time.monotonic() - start, 2),
        params={
            "rounds": rounds,
            "messages": counts["small"],
            "batches": counts["batch"],
            "asks": asks,
            "small_frame_bytes": frame_bytes.get("small", 0),
            "batch_frame_bytes": frame_bytes.get("batch", 0),
            "logprobs_frame_bytes": frame_bytes.get("logprobs", 0),
            "full": bool(args.full),
        },
        figures=figures,
        targets=targets,
        charts=charts,
        notes=[
            "Values are the best of the timed rounds (all rounds are in the JSON).",
            "tell with metrics on and off, and traced; ask and the two raw round trips: one"
            " fresh driver per round, the variants in turn, so that the machine's drift"
            " between runs is not read as the metrics', the trace context's or the"
            " runtime's cost.",
            "tell (traced): each tell carries trace context in a frame header, one"
            " traceparent for a small message, one per request (32) for a batch, the same"
            " every tell; with new contexts, each tell's differ from the tell before's.",
            "pyzmq floor: sync PUSH/PULL, sender encodes each message, receiver decodes each;"
            " pyzmq no decode: one pre-encoded frame, receiver only counts.",
            "send_pyobj asyncio: pickle of an equal dataclass, sync send_pyobj, received"
            " with zmq.asyncio recv_pyobj (SGLang's way).",
            "Throughput rounds end when the receiver has handled the last message;"
            " send_pyobj small rounds carry a fifth of --messages (rates are per second).",
            "Round trips: PUSH/PULL both ways, same request and Ack bytes; pyzmq sync blocks"
            " on both sides, zmq.asyncio awaits on both sides; p50 and p99 are over one"
            " round's round trips.",
            RULE,
        ],
    )


SUITE = Suite(
    name="mailbox",
    help="tell throughput and ask latency between processes, vs pyzmq and send_pyobj",
    run=run,
    options=OPTIONS,
)
