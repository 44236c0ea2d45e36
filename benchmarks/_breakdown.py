"""Where a restart's time goes, as figures: what a fresh Python process costs, and the
parts of kill -> answering (used by the supervision suite).

The parts are taken per kill on one clock (``CLOCK_MONOTONIC``): the death noticed, the new
process having imported the actor's module, its ``on_start``, and its answer (see
``benchmarks._lifecycle_actors``). Only the interpreter's own start is measured apart
(``python -c pass``), and taken out of the time to the import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._results import INFO, Figure
from ._startup import ACTOR_MODULE
from ._stats import nearest_rank_quantile

if TYPE_CHECKING:
    from collections.abc import Sequence

STARTUP = "a fresh process (medians)"
PARTS = "kill → answering, part by part"

#: Fresh-process costs timed with ``python -c <code>`` until the code has run: (key,
#: label, code, bytecode cached?).
TIMINGS = (
    ("python_pass", "interpreter started", "pass", True),
    ("import_runtime", "runtime imported", "import runtime", True),
    ("import_actor", "actor module imported", f"import {ACTOR_MODULE}", True),
    ("import_actor_as_given", "same, env as given", f"import {ACTOR_MODULE}", False),
)

#: The parts of kill -> answering, in the order they happen (the stack of the parts
#: chart): (key, metric).
PART_METRICS = (
    ("noticed", "death noticed"),
    ("interpreter", "interpreter start"),
    ("imports", "spawn + imports"),
    ("child_start", "runtime start in the child"),
    ("answer", "ready + asks"),
)
FRESH = "fresh system.spawn (no kill)"


@dataclass(frozen=True)
class PartsSource:
    """One series of restarts (a kill loop) or of fresh spawns, to split into parts.

    Attributes:
        name: Figure key part (``"caller"``).
        label: The figures' variant.
        role: The figures' role.
        samples: The driver's report: ``imported``, ``started`` and the two below, in ms
            from the kill (or the spawn).
        noticed: The series of death noticed (``None`` for fresh spawns: no death).
        answered: The series of the new incarnation answering.
    """

    name: str
    label: str
    role: str
    samples: dict[str, list[float]]
    noticed: str | None
    answered: str


def ms_figure(
    key: str,
    label: str,
    payload: str,
    metric: str,
    value: float,
    *,
    role: str = INFO,
    rounds: list[float] | None = None,
) -> Figure:
    """A figure in milliseconds, rounded for people (every sample stays in ``rounds``)."""
    return Figure(
        key=key,
        variant=label,
        payload=payload,
        metric=metric,
        value=round(value, 2),
        unit="ms",
        role=role,
        rounds=rounds or [],
    )


def _parts(source: PartsSource, interpreter: float) -> dict[str, float]:
    """The median of each part over a source's events."""
    samples = source.samples
    imported = samples["imported"]
    death = samples[source.noticed] if source.noticed else [0.0] * len(imported)
    rows = zip(death, imported, samples["started"], samples[source.answered], strict=True)
    per: dict[str, list[float]] = {key: [] for key, _ in PART_METRICS}
    for down, at_import, started, answer in rows:
        per["noticed"].append(down)
        per["interpreter"].append(interpreter)
        per["imports"].append(at_import - down - interpreter)
        per["child_start"].append(started - at_import)
        per["answer"].append(answer - started)
    if source.noticed is None:
        del per["noticed"]
    return {key: nearest_rank_quantile(values, 0.5) for key, values in per.items()}


def part_figures(sources: Sequence[PartsSource], interpreter: float) -> list[Figure]:
    """Split each source's kill -> answering (or spawn -> answering) into its parts, each
    the median over its events; ``interpreter`` is ``python -c pass``'s median."""
    metrics = dict(PART_METRICS)
    return [
        ms_figure(
            f"part.{source.name}.{key}", source.label, PARTS, metrics[key], ms, role=source.role
        )
        for source in sources
        for key, ms in _parts(source, interpreter).items()
    ]


def startup_figures(
    timings: dict[str, list[float]], restarts: dict[str, tuple[str, list[float]]]
) -> tuple[list[Figure], dict[str, float]]:
    """The fresh-process costs and the supervisors' restart times (medians), and the
    medians of ``timings`` by key.

    Args:
        timings: ``TIMINGS`` keys and ``spawn_ready``, each with its samples.
        restarts: By loop key: a short name of the loop and its restart times (death
            seen -> ready).
    """
    labels = {key: label for key, label, _, _ in TIMINGS}
    labels["spawn_ready"] = "fresh spawn → ready"
    medians = {key: nearest_rank_quantile(samples, 0.5) for key, samples in timings.items()}
    figures = [
        ms_figure(f"startup.{key}", labels[key], STARTUP, "p50", medians[key], rounds=samples)
        for key, samples in timings.items()
    ]
    figures += [
        ms_figure(
            f"startup.restart.{key}",
            f"restart: {label}",
            STARTUP,
            "p50",
            nearest_rank_quantile(samples, 0.5),
            rounds=samples,
        )
        for key, (label, samples) in restarts.items()
    ]
    return figures, medians
