"""Multi-host suite: tell and ask between two hosts over CURVE tcp against local ipc, and the
time from a node's loss to ``Down`` at a watcher.

Run it with ``python -m benchmarks multihost [--json PATH] [--full] [--messages N] [--asks N]
[--losses N] [--heartbeats S,S]`` (root only: it makes a network namespace).

The two "hosts" are this network namespace (host A) and a second one joined to it by a veth
pair (host B, `benchmarks._netns`), real tcp between them through the kernel. The root
``ActorSystem`` runs in this process on host A; a node (``python -m runtime node``) runs on
host B. Variants, in the same run:

* **ipc, one host** (baseline): a ``Counter`` and an ``Echo`` actor process spawned by a
  plain ``ActorSystem()`` (ipc sockets in its private directory).
* **CURVE tcp, across hosts**: the same actors spawned with ``spawn(..., node="b")`` by the
  tcp root: every message crosses the veth pair, encrypted and authenticated.

Tell: ``--messages`` small one-way messages, then an ask that travels behind them (its
answer proves every tell was handled); the figure is the best round's rate. Ask: one
``--asks`` sequential round trips per round, percentiles over every round trip.

Loss: for each heartbeat in ``--heartbeats`` (default 1 and 5 s, the default setting),
``--losses`` rounds of: a node started afresh, an actor spawned on it and watched, the node
SIGKILLed (its process, as a host that dies) or the link cut (``ip link set down``, as a
network that parts), alternately; the time from the kill or cut to the watcher's ``Down``
(`Cause.NOCONNECTION`). The bound is one heartbeat.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from runtime import ActorRef, ActorSystem, Cause

from ._actors import Counter, Echo
from ._messages import Ack, CountQuery, SmallAsk, make_small
from ._netns import Hosts, NodeProcess, two_hosts
from ._results import BASELINE, INFO, SUBJECT, Chart, Figure, Ratio, SuiteResult, Target
from ._stats import nearest_rank_quantile
from ._suite import Option, Suite, pick

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._suite import Progress

IPC = "ipc, one host"
TCP = "CURVE tcp, across hosts"
TELL, ASK, LOSS = "tell", "ask", "node loss -> Down"
VARIANTS = (("ipc", IPC, BASELINE), ("tcp", TCP, SUBJECT))
#: How the node is lost, in turn.
LOSS_KINDS = ("kill", "cut")


def _heartbeats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v)
    except ValueError:
        values = ()
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected seconds above 0 such as 1,5, got {text!r}")
    return values


def _needs_root(args: argparse.Namespace) -> str | None:
    if os.geteuid() != 0:
        return "it makes a network namespace: run it as root"
    return None


OPTIONS = (
    Option("--messages", "small tells per round (quick 20,000, --full 100,000)"),
    Option("--asks", "round trips per round (quick 2,000, --full 10,000)"),
    Option("--losses", "node losses per heartbeat (quick 4, --full 10)"),
    Option("--heartbeats", "heartbeats to lose nodes under, seconds (1,5)", _heartbeats, "S,S"),
)


async def _tell_rate(counter: ActorRef[Any], n: int) -> float:
    before = (await counter.ask(CountQuery())).n
    msg = make_small()
    start = time.perf_counter()
    for _ in range(n):
        await counter.tell(msg)
    done: Ack = await counter.ask(CountQuery(), timeout=120)
    took = time.perf_counter() - start
    assert done.n - before == n, (done.n, before, n)
    return n / took


async def _ask_times(echo: ActorRef[Any], n: int) -> list[float]:
    small = make_small()
    msg = SmallAsk(**msgspec.structs.asdict(small))
    times = []
    for _ in range(n):
        start = time.perf_counter_ns()
        await echo.ask(msg)
        times.append((time.perf_counter_ns() - start) / 1000)
    return times


async def _transport(
    system: ActorSystem, node: str | None, counts: dict[str, int], rounds: int
) -> tuple[list[float], list[float]]:
    counter = await system.spawn(Counter, node=node)
    echo = await system.spawn(Echo, node=node)
    await _tell_rate(counter, max(counts["messages"] // 10, 10))  # warm-up
    await _ask_times(echo, max(counts["asks"] // 10, 10))
    rates = [await _tell_rate(counter, counts["messages"]) for _ in range(rounds)]
    asks = [t for _ in range(rounds) for t in await _ask_times(echo, counts["asks"])]
    return rates, asks


class _Root:
    """The tcp root on host A and how to start node b on host B."""

    def __init__(self, hosts: Hosts, keys: Path) -> None:
        self.hosts = hosts
        self.keys = keys

    async def node(self, system: ActorSystem, heartbeat: float) -> NodeProcess:
        return await self.hosts.start_node(
            system.address, self.keys, "b", "--heartbeat", str(heartbeat)
        )

    def system(self, heartbeat: float) -> ActorSystem:
        return ActorSystem(
            name="root",
            transport="tcp",
            tcp_host=self.hosts.a,
            keys=self.keys,
            heartbeat=heartbeat,
        )


async def _one_loss(root: _Root, heartbeat: float, kind: str) -> float:
    async with root.system(heartbeat) as system:
        node = await root.node(system, heartbeat)
        try:
            ref = await system.spawn(Counter, node="b")
            await ref.ask(CountQuery())
            watch = system.watch(ref)
            lose: Callable[[], None] = node.kill if kind == "kill" else root.hosts.cut
            start = time.perf_counter()
            lose()
            try:
                with anyio.fail_after(10 * heartbeat + 10):
                    down = await watch
                took = time.perf_counter() - start
            finally:
                if kind == "cut":
                    root.hosts.restore()
            if down.cause is not Cause.NOCONNECTION:
                raise RuntimeError(f"the node's loss gave {down.cause} ({down.reason})")
            return took
        finally:
            node.stop()


def _percentiles(
    key: str, variant: str, payload: str, samples: list[float], unit: str, role: str
) -> list[Figure]:
    return [
        Figure(
            key=f"{key}.{metric}",
            variant=variant,
            payload=payload,
            metric=metric,
            value=nearest_rank_quantile(samples, q),
            unit=unit,
            role=role,
            rounds=samples if metric == "p50" and len(samples) <= 1000 else [],
        )
        for metric, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))
    ]


@dataclass(frozen=True)
class _Sizes:
    """What one run measures, from the options (quick or ``--full``)."""

    rounds: int
    counts: dict[str, int]
    losses: int
    heartbeats: tuple[float, ...]

    @classmethod
    def of(cls, args: argparse.Namespace) -> _Sizes:
        return cls(
            rounds=args.rounds or (5 if args.full else 3),
            counts={
                "messages": pick(args, "messages", 20_000, 100_000),
                "asks": pick(args, "asks", 2_000, 10_000),
            },
            losses=pick(args, "losses", 4, 10),
            heartbeats=args.heartbeats or (1.0, 5.0),
        )


async def _measure(
    sizes: _Sizes, progress: Progress, hosts: Hosts, workdir: Path
) -> tuple[list[Figure], dict[float, list[tuple[str, float]]]]:
    rounds, counts = sizes.rounds, sizes.counts
    figures: list[Figure] = []
    root = _Root(hosts, workdir / "keys")
    for prefix, label, role in VARIANTS:
        progress.step(f"{label}: tells and asks")
        if prefix == "ipc":
            async with ActorSystem(name="ipc") as system:
                rates, asks = await _transport(system, None, counts, rounds)
        else:
            async with root.system(5.0) as system:
                node = await root.node(system, 5.0)
                try:
                    rates, asks = await _transport(system, "b", counts, rounds)
                finally:
                    node.stop()
        figures.append(
            Figure(
                key=f"{prefix}.tell.throughput",
                variant=label,
                payload=TELL,
                metric="throughput",
                value=max(rates),
                unit="msg/s",
                role=role,
                rounds=rates,
            )
        )
        figures += _percentiles(f"{prefix}.ask", label, ASK, asks, "us", role)
        progress.advance()
    losses: dict[float, list[tuple[str, float]]] = {}
    for heartbeat in sizes.heartbeats:
        n = sizes.losses
        for i in range(n):
            kind = LOSS_KINDS[i % len(LOSS_KINDS)]
            progress.step(f"heartbeat {heartbeat:g} s: node {kind} {i + 1}/{n}")
            took = await _one_loss(root, heartbeat, kind)
            losses.setdefault(heartbeat, []).append((kind, took))
            progress.advance()
    return figures, losses


def _loss_figures(losses: dict[float, list[tuple[str, float]]]) -> list[Figure]:
    figures = []
    for heartbeat, samples in losses.items():
        key = f"loss.hb{heartbeat:g}"
        values = [took for _, took in samples]
        figures += _percentiles(key, f"heartbeat {heartbeat:g} s", LOSS, values, "s", SUBJECT)
        for kind in LOSS_KINDS:
            mine = [took for k, took in samples if k == kind]
            if mine:
                figures.append(
                    Figure(
                        key=f"{key}.{kind}.max",
                        variant=f"heartbeat {heartbeat:g} s, node {kind}",
                        payload=LOSS,
                        metric=f"{kind} max",
                        value=max(mine),
                        unit="s",
                        role=INFO,
                        rounds=mine,
                    )
                )
    return figures


def summarise(figures: list[Figure]) -> list[Target]:
    """Ratios of the tcp figures to the ipc ones, and the heartbeat bound (pure)."""
    by_key = {f.key: f for f in figures}
    for metric in ("tell.throughput", "ask.p50", "ask.p99"):
        tcp, ipc = by_key.get(f"tcp.{metric}"), by_key.get(f"ipc.{metric}")
        if tcp is not None and ipc is not None and ipc.value:
            tcp.ratios.append(Ratio(baseline=ipc.key, label="ipc", value=tcp.value / ipc.value))
    targets = []
    for fig in figures:
        if fig.payload == LOSS and fig.metric == "max":
            heartbeat = float(fig.key.split(".")[1].removeprefix("hb"))
            targets.append(
                Target(
                    name=f"node loss -> Down within the heartbeat ({heartbeat:g} s)",
                    figure=fig.key,
                    baseline="",
                    op="<",
                    threshold=heartbeat,
                    value=fig.value,
                    met=fig.value < heartbeat,
                )
            )
    return targets


CHARTS = [
    Chart(
        name="multihost-tell",
        title="tell between two hosts (CURVE tcp) against one host (ipc); higher is better",
        metrics=["throughput"],
        unit="msg/s",
        payloads=[TELL],
        reference=IPC,
    ),
    Chart(
        name="multihost-ask",
        title="ask round trips, two hosts against one (lower is better)",
        metrics=["p50", "p99"],
        unit="us",
        payloads=[ASK],
    ),
    Chart(
        name="multihost-loss",
        title="a node's loss to the watcher's Down (lower is better)",
        metrics=["p50", "max"],
        unit="s",
        payloads=[LOSS],
    ),
]


def run(args: argparse.Namespace, progress: Progress) -> SuiteResult:
    """Make the second host, measure, remove it (as root: `_needs_root`, which the CLI asks
    before any suite runs)."""
    start = time.monotonic()
    sizes = _Sizes.of(args)
    progress.begin(len(VARIANTS) + sizes.losses * len(sizes.heartbeats))
    with two_hosts() as hosts, tempfile.TemporaryDirectory(prefix="tokenyard-bench-") as tmp:
        figures, losses = asyncio.run(_measure(sizes, progress, hosts, Path(tmp)))
    figures += _loss_figures(losses)
    return SuiteResult(
        suite="multihost",
        duration_s=round(time.monotonic() - start, 2),
        params={
            **sizes.counts,
            "losses": sizes.losses,
            "heartbeats": ",".join(f"{h:g}" for h in sizes.heartbeats),
            "rounds": sizes.rounds,
            "full": bool(args.full),
        },
        figures=figures,
        targets=summarise(figures),
        charts=CHARTS,
        notes=[
            "Two network namespaces on one machine joined by a veth pair: real tcp through the"
            " kernel, no real wire; both hosts share the same 2 CPUs.",
            "tell: best round of --messages small tells then one ask behind them; ask:"
            " percentiles over every sequential round trip of every round.",
            "node loss: the node SIGKILLed and the link cut, in turn, each round with a fresh"
            " root and node; time from the kill or cut to the watcher's Down (noconnection)."
            " The heartbeat pings every 1/8 of it and counts a peer lost after 0.8 of silence,"
            " so the bound is one heartbeat.",
        ],
    )


SUITE = Suite(
    name="multihost",
    help="tell/ask across two network namespaces over CURVE tcp vs ipc; node loss -> Down",
    run=run,
    options=OPTIONS,
    check=_needs_root,
)
