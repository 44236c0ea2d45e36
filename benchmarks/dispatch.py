"""Dispatch suite: routing each engine step's outputs to the tokenizer workers that own them.

Run it with ``python -m benchmarks dispatch [--json PATH] [--full] [--steps N]
[--workers N]`` (or ``python -m benchmarks.dispatch`` with the same options).

An engine step is one 32-request ``BatchTokenIDOutput`` (``actors.messages``) whose requests
belong to 4 workers (``--workers``), mixed as continuous batching mixes them. Dispatching it
means getting each request's entry to its worker process. Variants, each driven from a
fresh process that starts one fresh receiver process per worker:

* **SGLang's way** (baseline): for each request, a hand-written per-field copy of entry
  ``i`` into a new one-request dataclass, ``pickle.dumps`` of it (what ``send_pyobj`` does)
  and a send on its worker's PUSH socket; receivers ``pickle.loads`` each and count.
* **tokenyard (raw zmq)**: ``Batch.group(origins)`` into one typed sub-batch per worker,
  msgspec-encoded, one send per worker per step; receivers decode with a
  ``msgspec.msgpack.Decoder`` and count requests. Plain pyzmq isolates the cost of dispatch itself.
* **tokenyard actors**: the same groups, told to counting actor processes through
  ``ActorRef.tell`` (what the ``Detokenizer`` actor does).
* **split + serialize only** (context): the two dispatch loops above with sockets that
  drop what they are given, in one process: the sender's CPU cost alone, free of the
  receivers competing for CPUs on a small machine.

A round runs from the first dispatch until every receiver has counted every request
(receivers report on a control socket after an end-of-round frame; actors answer an ask
queued behind the tells). The value is the best round, since on a shared machine noise
only ever makes a round slower.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os

# The baseline being measured: SGLang sends each request's output with send_pyobj, i.e.
# pickle. Nothing in runtime/ or actors/ may use it.
import pickle  # noqa: TID251
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zmq

from actors.messages import BatchTokenIDOutput, Origin
from runtime import Actor, ActorSystem, handler

from ._messages import Ack, CountQuery
from ._proc import BenchmarkError, Measurement, die_with_parent, run_driver, started
from ._results import BASELINE, INFO, SUBJECT, Chart, Figure, Ratio, SuiteResult, Target
from ._suite import Option, Suite, pick, positive_int

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Sequence

    from ._suite import Progress


#: Workers a step's requests belong to, unless ``--workers`` says otherwise.
WORKERS = 4
BATCH_SIZE = 32
#: Distinct steps cycled through, so the measurement does not reuse one object's caches.
DISTINCT = 16
HWM = 10_000
TIMEOUT = 120.0
END = b""  # end of round: report the count
QUIT = b"q"  # neither a pickle (0x80...) nor a msgpack array: unambiguous

SGLANG, RAW, ACTORS = "sglang", "raw", "actors"
CPU_SGLANG, CPU_RAW = "cpu_sglang", "cpu_raw"
LABELS = {
    SGLANG: "SGLang's way",
    RAW: "tokenyard (raw zmq)",
    ACTORS: "tokenyard actors",
    CPU_SGLANG: "SGLang's split, no sockets",
    CPU_RAW: "tokenyard's split, no sockets",
}
ROLES = {SGLANG: BASELINE, RAW: SUBJECT, ACTORS: SUBJECT, CPU_SGLANG: INFO, CPU_RAW: INFO}
TARGET_RATIO = 5.0


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def payload_of(workers: int) -> str:
    """How tables name the message dispatched."""
    return f"{BATCH_SIZE}-request step, {_workers(workers)}"


# -- the workload ---------------------------------------------------------------------------


def make_step(seed: int, workers: int = WORKERS) -> BatchTokenIDOutput:
    """A decode step of 32 requests of ``workers`` workers, mixed (deterministic for a seed).

    1-8 new ids per request, output logprobs requested, other logprob fields not carried.
    Rids carry SGLang's ``"<worker>_"`` prefix so its baseline can route by parsing them,
    as SGLang does; tokenyard routes by the typed ``origins``.
    """
    rng = random.Random(seed)
    n = BATCH_SIZE
    owners = [rng.randrange(workers) for _ in range(n)]
    new = [rng.randint(1, 8) for _ in range(n)]
    ids = [[rng.randrange(32_000) for _ in range(k)] for k in new]
    return BatchTokenIDOutput(
        rids=[f"{w}_{rng.randbytes(16).hex()}" for w in owners],
        origins=[Origin(w, 1) for w in owners],
        finished_reasons=[
            rng.choice(("stop", "length")) if rng.random() < 0.05 else None for _ in range(n)
        ],
        decode_ids=ids,
        read_offsets=[rng.randint(0, 512) for _ in range(n)],
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        stop=[() for _ in range(n)],
        prompt_tokens=[rng.randint(16, 2048) for _ in range(n)],
        completion_tokens=[rng.randint(1, 512) for _ in range(n)],
        cached_tokens=[rng.randint(0, 1024) for _ in range(n)],
        output_token_logprobs_val=[[-rng.random() * 5 for _ in range(k)] for k in new],
        output_token_logprobs_idx=[list(x) for x in ids],
        step=seed,
    )


@dataclass
class StepObj:
    """SGLang's ``BatchTokenIDOutput``: a plain dataclass, routed by rid prefix (no origins)."""

    rids: list[str]
    finished_reasons: list[str | None]
    decode_ids: list[list[int]]
    read_offsets: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop: list[tuple[str, ...]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    input_token_logprobs_val: list[list[float]] | None
    input_token_logprobs_idx: list[list[int]] | None
    output_token_logprobs_val: list[list[float]] | None
    output_token_logprobs_idx: list[list[int]] | None
    input_top_logprobs_val: list[list[list[float]]] | None
    input_top_logprobs_idx: list[list[list[int]]] | None
    output_top_logprobs_val: list[list[list[float]]] | None
    output_top_logprobs_idx: list[list[list[int]]] | None
    input_token_ids_logprobs_val: list[list[float]] | None
    input_token_ids_logprobs_idx: list[list[int]] | None
    output_token_ids_logprobs_val: list[list[float]] | None
    output_token_ids_logprobs_idx: list[list[int]] | None
    output_hidden_states: list[list[float]] | None
    step: int
    decoded_texts: list[str] | None
    output_ids: list[list[int]] | None
    spec_verify_ct: list[int] | None
    placeholder_tokens_idx: list[list[int] | None] | None
    placeholder_tokens_val: list[list[int] | None] | None


def as_obj(step: BatchTokenIDOutput) -> StepObj:
    """The same step as SGLang's dataclass: the values of the fields it declares (every
    field of ``BatchTokenIDOutput`` but the typed origins, which SGLang does not have)."""
    values = msgspec.structs.asdict(step)
    return StepObj(**{f.name: values[f.name] for f in dataclasses.fields(StepObj)})


def request_at(b: StepObj, i: int) -> StepObj:
    """SGLang's way of splitting: copy entry ``i`` of every field, one field at a time."""
    return StepObj(
        rids=[b.rids[i]],
        finished_reasons=[b.finished_reasons[i]],
        decode_ids=[b.decode_ids[i]],
        read_offsets=[b.read_offsets[i]],
        skip_special_tokens=[b.skip_special_tokens[i]],
        spaces_between_special_tokens=[b.spaces_between_special_tokens[i]],
        no_stop_trim=[b.no_stop_trim[i]],
        stop=[b.stop[i]],
        prompt_tokens=[b.prompt_tokens[i]],
        completion_tokens=[b.completion_tokens[i]],
        cached_tokens=[b.cached_tokens[i]],
        input_token_logprobs_val=None
        if b.input_token_logprobs_val is None
        else [b.input_token_logprobs_val[i]],
        input_token_logprobs_idx=None
        if b.input_token_logprobs_idx is None
        else [b.input_token_logprobs_idx[i]],
        output_token_logprobs_val=None
        if b.output_token_logprobs_val is None
        else [b.output_token_logprobs_val[i]],
        output_token_logprobs_idx=None
        if b.output_token_logprobs_idx is None
        else [b.output_token_logprobs_idx[i]],
        input_top_logprobs_val=None
        if b.input_top_logprobs_val is None
        else [b.input_top_logprobs_val[i]],
        input_top_logprobs_idx=None
        if b.input_top_logprobs_idx is None
        else [b.input_top_logprobs_idx[i]],
        output_top_logprobs_val=None
        if b.output_top_logprobs_val is None
        else [b.output_top_logprobs_val[i]],
        output_top_logprobs_idx=None
        if b.output_top_logprobs_idx is None
        else [b.output_top_logprobs_idx[i]],
        input_token_ids_logprobs_val=None
        if b.input_token_ids_logprobs_val is None
        else [b.input_token_ids_logprobs_val[i]],
        input_token_ids_logprobs_idx=None
        if b.input_token_ids_logprobs_idx is None
        else [b.input_token_ids_logprobs_idx[i]],
        output_token_ids_logprobs_val=None
        if b.output_token_ids_logprobs_val is None
        else [b.output_token_ids_logprobs_val[i]],
        output_token_ids_logprobs_idx=None
        if b.output_token_ids_logprobs_idx is None
        else [b.output_token_ids_logprobs_idx[i]],
        output_hidden_states=None
        if b.output_hidden_states is None
        else [b.output_hidden_states[i]],
        step=b.step,
        decoded_texts=None if b.decoded_texts is None else [b.decoded_texts[i]],
        output_ids=None if b.output_ids is None else [b.output_ids[i]],
        spec_verify_ct=None if b.spec_verify_ct is None else [b.spec_verify_ct[i]],
        # SGLang 0.5.3 does not split these: each one-request copy carries none.
        placeholder_tokens_idx=None,
        placeholder_tokens_val=None,
    )


class Sender(Protocol):
    """Where a dispatch loop sends a worker's frames: a PUSH socket, or `NullSender`."""

    def send(self, data: bytes, /) -> Any:
        """Send one frame."""


def dispatch_sglang(steps: Sequence[StepObj], socks: Sequence[Sender], n: int) -> None:
    """Send ``n`` steps SGLang's way: one pickled one-request copy per request."""
    dumps = pickle.dumps
    for s in range(n):
        batch = steps[s % DISTINCT]
        for i, rid in enumerate(batch.rids):
            socks[int(rid.split("_", 1)[0])].send(dumps(request_at(batch, i), protocol=4))


def dispatch_tokenyard(
    steps: Sequence[BatchTokenIDOutput], socks: Sequence[Sender], n: int
) -> None:
    """Send ``n`` steps tokenyard's way: one msgspec sub-batch per worker per step."""
    encode = msgspec.msgpack.Encoder().encode
    for s in range(n):
        batch = steps[s % DISTINCT]
        for origin, sub in batch.group(batch.origins).items():
            socks[origin.worker].send(encode(sub))


class NullSender:
    """A socket that drops every frame: what is left is the split and the serialization."""

    def send(self, data: bytes, /) -> None:
        """Drop ``data``."""


def drive_cpu(opts: argparse.Namespace) -> Measurement:
    """Time a dispatch loop alone, in this process, with `NullSender` sockets."""
    steps = [make_step(s, opts.workers) for s in range(DISTINCT)]
    objs = [as_obj(b) for b in steps]
    sinks = [NullSender() for _ in range(opts.workers)]
    rates: list[float] = []
    for r in range(opts.rounds + 1):  # round 0 is the warm-up
        n = max(opts.steps // 10, 10) if r == 0 else opts.steps
        t0 = time.perf_counter_ns()
        if opts.variant == CPU_SGLANG:
            dispatch_sglang(objs, sinks, n)
        else:
            dispatch_tokenyard(steps, sinks, n)
        if r:
            rates.append(n * BATCH_SIZE / ((time.perf_counter_ns() - t0) / 1e9))
    return Measurement(throughput=rates)


def wire_bytes_per_request(variant: str, workers: int) -> float:
    """Average bytes sent per request by a variant (pickles, or encoded sub-batches)."""
    steps = [make_step(s, workers) for s in range(DISTINCT)]
    if variant in (SGLANG, CPU_SGLANG):
        objs = [as_obj(b) for b in steps]
        total = sum(
            len(pickle.dumps(request_at(b, i), protocol=4)) for b in objs for i in range(BATCH_SIZE)
        )
    else:
        encode = msgspec.msgpack.encode
        total = sum(len(encode(sub)) for b in steps for sub in b.group(b.origins).values())
    return total / (DISTINCT * BATCH_SIZE)


# -- processes: driver and receivers --------------------------------------------------------


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.dispatch", *args]


def _socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _await_counts(
    ctl: zmq.Socket[bytes], procs: Sequence[subprocess.Popen[bytes]], what: str
) -> list[int]:
    """One count from each receiver, failing (not hanging) if one of them died."""
    poller = zmq.Poller()
    poller.register(ctl, zmq.POLLIN)
    deadline = time.monotonic() + TIMEOUT
    counts: list[int] = []
    while len(counts) < len(procs):
        # Polls in slices only to notice a dead receiver; a report ends the wait.
        if poller.poll(250):
            counts.append(msgspec.msgpack.decode(ctl.recv(), type=int))
            continue
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead:
            raise BenchmarkError(f"a receiver exited with status {dead[0]} during {what}")
        if time.monotonic() > deadline:
            raise BenchmarkError(f"no {what} from every receiver within {TIMEOUT:g} s")
    return counts


def drive_zmq(opts: argparse.Namespace) -> Measurement:
    """Measure the SGLang or raw tokenyard variant with a receiver process per worker."""
    base = Path(opts.dir) / f"{opts.variant}-{time.monotonic_ns()}"
    ctl_addr = f"ipc://{base}-ctl"
    inboxes = [f"ipc://{base}-w{k}" for k in range(opts.workers)]
    steps = [make_step(s, opts.workers) for s in range(DISTINCT)]
    dispatch: Callable[[int], None]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        ctl = _socket(ctx, zmq.PULL)
        ctl.bind(ctl_addr)
        cmds = [
            _command("--receiver", opts.variant, "--bind", a, "--ctl", ctl_addr) for a in inboxes
        ]
        with contextlib.ExitStack() as stack:
            procs = [stack.enter_context(started(cmd)) for cmd in cmds]
            _await_counts(ctl, procs, "ready")
            socks = [_socket(ctx, zmq.PUSH) for _ in inboxes]
            for sock, addr in zip(socks, inboxes, strict=True):
                sock.connect(addr)
            if opts.variant == SGLANG:
                objs = [as_obj(b) for b in steps]
                dispatch = lambda n: dispatch_sglang(objs, socks, n)  # noqa: E731
            else:
                dispatch = lambda n: dispatch_tokenyard(steps, socks, n)  # noqa: E731
            rates: list[float] = []
            sent = 0
            for r in range(opts.rounds + 1):  # round 0 is the warm-up (and the connects)
                n = max(opts.steps // 10, 10) if r == 0 else opts.steps
                t0 = time.perf_counter_ns()
                dispatch(n)
                for sock in socks:
                    sock.send(END)
                counted = sum(_await_counts(ctl, procs, "a round's counts"))
                elapsed = (time.perf_counter_ns() - t0) / 1e9
                sent += n * BATCH_SIZE
                if counted != sent:
                    raise BenchmarkError(f"receivers counted {counted} requests, {sent} sent")
                if r:
                    rates.append(n * BATCH_SIZE / elapsed)
            for sock in socks:
                sock.send(QUIT)
            for proc in procs:
                if proc.wait(TIMEOUT) != 0:
                    raise BenchmarkError(f"a receiver exited with status {proc.returncode}")
    finally:
        ctx.destroy(linger=0)
    wire = wire_bytes_per_request(opts.variant, opts.workers)
    return Measurement(throughput=rates, frame_bytes=round(wire))


def run_receiver(opts: argparse.Namespace) -> None:
    """A worker's end: receive, decode (unpickle or msgspec), count, report each round."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        pull = _socket(ctx, zmq.PULL)
        pull.bind(opts.bind)
        ctl = _socket(ctx, zmq.PUSH)
        ctl.connect(opts.ctl)
        encode = msgspec.msgpack.encode
        ctl.send(encode(0))  # ready
        recv = pull.recv
        # The baseline being measured unpickles what SGLang's send_pyobj sent.
        loads: Callable[[bytes], Any] = (
            pickle.loads
            if opts.receiver == SGLANG
            else msgspec.msgpack.Decoder(BatchTokenIDOutput).decode
        )
        count = 0
        while (frame := recv()) != QUIT:
            if frame == END:
                ctl.send(encode(count))
            else:
                count += len(loads(frame).rids)
    finally:
        ctx.destroy(linger=1000)


class RequestCounter(Actor[BatchTokenIDOutput | CountQuery]):
    """A worker stand-in for the actors variant: counts the requests it is told."""

    def __init__(self) -> None:
        self.count = 0

    @handler
    def output(self, msg: BatchTokenIDOutput) -> None:
        """Count one sub-batch's requests."""
        self.count += len(msg.rids)

    @handler
    def query(self, msg: CountQuery) -> Ack:
        """Reply with the requests counted so far (queued behind the tells: a barrier)."""
        return Ack(n=self.count)


async def drive_actors(opts: argparse.Namespace) -> Measurement:
    """Measure the actors variant: groups told to a counting actor process per worker."""
    steps = [make_step(s, opts.workers) for s in range(DISTINCT)]
    async with ActorSystem(name="bench-dispatch") as system:
        refs = [await system.spawn(RequestCounter, name=f"worker-{k}") for k in range(opts.workers)]
        tells = [ref.tell for ref in refs]
        rates: list[float] = []
        sent = 0
        for r in range(opts.rounds + 1):  # round 0 is the warm-up (and the connects)
            n = max(opts.steps // 10, 10) if r == 0 else opts.steps
            t0 = time.perf_counter_ns()
            for s in range(n):
                batch = steps[s % DISTINCT]
                for origin, sub in batch.group(batch.origins).items():
                    await tells[origin.worker](sub)
            replies = [await ref.ask(CountQuery(), timeout=TIMEOUT) for ref in refs]
            elapsed = (time.perf_counter_ns() - t0) / 1e9
            sent += n * BATCH_SIZE
            counted = sum(reply.n for reply in replies)
            if counted != sent:
                raise BenchmarkError(f"actors counted {counted} requests, {sent} were told")
            if r:
                rates.append(n * BATCH_SIZE / elapsed)
        for ref in refs:
            await system.stop(ref)
    return Measurement(
        throughput=rates, frame_bytes=round(wire_bytes_per_request(ACTORS, opts.workers))
    )


# -- the suite ------------------------------------------------------------------------------


def workers(text: str) -> int:
    """``--workers``: 1 to `BATCH_SIZE` (a step's requests, one a worker at most).

    Raises:
        argparse.ArgumentTypeError: It is not.
    """
    value = positive_int(text)
    if value > BATCH_SIZE:
        raise argparse.ArgumentTypeError(
            f"a step holds {BATCH_SIZE} requests, so at most {BATCH_SIZE} workers can own one"
            f" each, got {value}"
        )
    return value


OPTIONS = (
    Option("--steps", "32-request steps dispatched per round (quick 3000, full 30000)"),
    Option(
        "--workers",
        f"workers the requests of a step belong to, one receiver process each (1-{BATCH_SIZE},"
        f" default {WORKERS})",
        type=workers,
    ),
)


#: (figure, baseline) pairs: every ratio the report shows.
RATIOS = ((RAW, SGLANG), (ACTORS, SGLANG), (CPU_RAW, CPU_SGLANG))
#: Variants held to the goal of the issue: at least TARGET_RATIO x SGLang's way.
TARGETED = (RAW, ACTORS)


def summarise(figures: list[Figure]) -> list[Target]:
    """Attach the ratios to the figures and check the targets (pure: testable alone)."""
    by_key = {f.key: f for f in figures}
    targets: list[Target] = []
    for variant, baseline in RATIOS:
        fig, base = by_key.get(f"{variant}.throughput"), by_key.get(f"{baseline}.throughput")
        if fig is None or base is None or not base.value:
            continue
        ratio = fig.value / base.value
        label = "SGLang's way" if baseline == SGLANG else "SGLang's split"
        fig.ratios.append(Ratio(baseline=base.key, label=label, value=ratio))
        if variant in TARGETED:
            targets.append(
                Target(
                    name=f"{fig.variant} >= {TARGET_RATIO:g}x SGLang's way",
                    figure=fig.key,
                    baseline=base.key,
                    op=">=",
                    threshold=TARGET_RATIO,
                    value=ratio,
                    met=ratio >= TARGET_RATIO,
                )
            )
    return targets


NOTES = (
    "Values are the best of the timed rounds (all rounds are in the JSON).",
    "A round ends when every receiver has counted every request it was sent.",
    "SGLang's way: per-field copy of each request + pickle.dumps + one send each; "
    "receivers pickle.loads each (sync pyzmq on both sides).",
    "tokenyard: Batch.group(origins), one msgspec sub-batch per worker per step; "
    "receivers decode each with a msgspec Decoder (raw zmq), or are actor processes told "
    "each sub-batch with ActorRef.tell (actors).",
    "No sockets: the same split-and-serialize loops in one process, frames dropped.",
    "Wire bytes per request (params): whole pickles, or msgpack sub-batch bodies (tokenyard "
    "actors add a small header per message).",
)


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Measure every variant, each driven from a fresh process, and compare them."""
    start = time.monotonic()
    rounds = args.rounds or (5 if args.full else 3)
    steps = pick(args, "steps", 3_000, 30_000)
    workers = pick(args, "workers", WORKERS, WORKERS)  # at most BATCH_SIZE: see workers()
    progress.begin(len(LABELS))
    figures: list[Figure] = []
    wire: dict[str, int] = {}
    workdir = tempfile.mkdtemp(prefix="tokenyard-bench-")  # 0700: private ipc sockets
    try:
        for variant, label in LABELS.items():
            progress.step(label)
            cmd = _command(
                "--variant",
                variant,
                "--dir",
                workdir,
                "--steps",
                str(steps),
                "--rounds",
                str(rounds),
                "--workers",
                str(workers),
            )
            measured = run_driver(cmd, 600.0 if args.full else 240.0)
            if measured.frame_bytes:
                wire[variant] = measured.frame_bytes
            figures.append(
                Figure(
                    key=f"{variant}.throughput",
                    variant=label,
                    payload=payload_of(workers),
                    metric="throughput",
                    value=round(max(measured.throughput), 1),
                    unit="req/s",
                    role=ROLES[variant],
                    rounds=[round(x, 1) for x in measured.throughput],
                )
            )
            progress.advance()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    targets = summarise(figures)
    notes = list(NOTES)
    cpus = os.cpu_count() or 0
    if cpus < workers + 1:
        notes.append(
            f"This machine has {cpus} CPUs for {workers + 1} busy processes: the socket "
            "variants share CPUs with their receivers, so they measure total CPU per request; "
            "the no-socket lines give the sender's cost alone."
        )
    return SuiteResult(
        suite="dispatch",
        duration_s=round(time.monotonic() - start, 2),
        params={
            "rounds": rounds,
            "steps": steps,
            "batch_size": BATCH_SIZE,
            "workers": workers,
            "full": bool(args.full),
            **{f"{v}_wire_bytes_per_request": b for v, b in wire.items()},
        },
        figures=figures,
        targets=targets,
        charts=[
            Chart(
                name="dispatch-throughput",
                title=f"per-request dispatch of {BATCH_SIZE}-request steps to"
                f" {_workers(workers)} (higher is better)",
                metrics=["throughput"],
                unit="req/s",
                panel_by="",
                reference=LABELS[SGLANG],
            )
        ],
        notes=notes,
    )


SUITE = Suite(
    name="dispatch",
    help="per-request dispatch of batch outputs to workers vs SGLang",
    run=run,
    options=OPTIONS,
)


def _internal(args: list[str]) -> bool:
    """Whether ``args`` start one of the suite's own processes (``--variant`` or
    ``--receiver``), not the suite."""
    role = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    role.add_argument("--variant")
    role.add_argument("--receiver")
    which, _ = role.parse_known_args(args)
    return which.variant is not None or which.receiver is not None


def main(argv: list[str] | None = None) -> int:
    """Run one driver (``--variant``) or one receiver (``--receiver``), as the suite starts
    them; ``python -m benchmarks.dispatch`` without either runs the suite, as ``python -m
    benchmarks dispatch`` (see the end of this module)."""
    args = sys.argv[1:] if argv is None else argv
    if not _internal(args):
        raise SystemExit(
            "a dispatch driver runs with --variant or --receiver: the suite is"
            " python -m benchmarks dispatch"
        )
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch", allow_abbrev=False)
    parser.add_argument("--rounds", type=positive_int, metavar="N")
    for option in OPTIONS:
        option.add_to(parser)
    parser.add_argument("--variant", choices=list(LABELS))
    parser.add_argument("--receiver", choices=[SGLANG, RAW])
    parser.add_argument("--dir")
    parser.add_argument("--bind")
    parser.add_argument("--ctl")
    opts = parser.parse_args(args)
    die_with_parent()
    if opts.receiver:
        run_receiver(opts)
        return 0
    opts.workers = opts.workers or WORKERS
    if opts.variant == ACTORS:
        measured = asyncio.run(drive_actors(opts))
    elif opts.variant in (CPU_SGLANG, CPU_RAW):
        measured = drive_cpu(opts)
    else:
        measured = drive_zmq(opts)
    sys.stdout.write(msgspec.json.encode(measured).decode() + "\n")
    return 0


if __name__ == "__main__":
    if _internal(sys.argv[1:]):
        # Run the module under its import name, not as __main__: pickles then name the
        # class `benchmarks.dispatch.StepObj` and actor processes import it.
        from benchmarks.dispatch import main as _main

        sys.exit(_main())
    # Without --variant or --receiver this is `python -m benchmarks dispatch`, run as that
    # program is (its SIGTERM and Ctrl-C handling, progress, errors, --json): importing the
    # CLI from here would close a circle (the CLI lists this suite).
    import runpy

    sys.argv[1:1] = ["dispatch"]
    runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
