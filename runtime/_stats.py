"""The typed statistics a system gathers over itself: of each actor (`ActorMetrics`), each
process (`ProcessMetrics`, its `ProcessResources` read from ``/proc``) and the whole system
(`SystemMetrics`), as messages any actor can ask for and any client can decode.

The collector (`runtime.MetricsCollector`) answers with a `SystemMetrics`; `top` reads it;
`runtime.prometheus` renders it.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import msgspec

from ._mailbox import MailboxStatistics
from ._message import Message
from ._metrics import FamilySnapshot, HistogramSnapshot
from ._ref import ActorRef

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class ChildRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a supervisor knows of one child.

    Attributes:
        name: The child's name.
        incarnation: Its live incarnation (0 while it is down).
        restarts: Restarts by the cause of the death that led to each (`Cause` values).
        deaths: Deaths seen, by cause (deliberate stops excluded).
        last_reason: Why it died last ('' if it never did).
        last_death: When (seconds since the epoch; 0 if it never did).
    """

    name: str
    incarnation: int = 0
    restarts: dict[str, int] = {}
    deaths: dict[str, int] = {}
    last_reason: str = ""
    last_death: float = 0.0


class ActorMetrics(Message):
    """One actor incarnation's statistics.

    Attributes:
        ref: The incarnation.
        actor_class: Its class, ``module:QualName``.
        mailbox: Its mailbox counters.
        handler_seconds: How long its handlers took, from taking each message off the queue
            (decoding included) to the handler's return, over a sample: the messages of one
            drained run in 16 (so its count is about a sixteenth of ``mailbox.handled``);
            empty with ``TOKENYARD_METRICS=off``.
        children: What it supervises (a `Supervisor`'s children), in start order.
    """

    ref: ActorRef[Any]
    actor_class: str
    mailbox: MailboxStatistics
    handler_seconds: HistogramSnapshot
    children: list[ChildRecord] = msgspec.field(default_factory=list)


class ProcessResources(msgspec.Struct, frozen=True, kw_only=True):
    """One process's resources, read from ``/proc`` (Prometheus's ``process_*`` metrics).

    Attributes:
        pid: Its pid.
        cpu_seconds: User plus system CPU time used.
        rss_bytes: Resident memory.
        vms_bytes: Virtual memory.
        open_fds: Open file descriptors.
        max_fds: The soft limit of open file descriptors.
        start_time: When it started, seconds since the epoch.
    """

    pid: int
    cpu_seconds: float = 0.0
    rss_bytes: int = 0
    vms_bytes: int = 0
    open_fds: int = 0
    max_fds: int = 0
    start_time: float = 0.0

    @classmethod
    def read(cls, pid: int | None = None) -> ProcessResources:
        """The stats of ``pid`` (default: this process); zeros where ``/proc`` says
        nothing (another system)."""
        pid = os.getpid() if pid is None else pid
        try:
            stat = _read(f"/proc/{pid}/stat").rpartition(")")[2].split()
            statm = _read(f"/proc/{pid}/statm").split()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, IndexError):
            return cls(pid=pid)
        return cls(
            pid=pid,
            cpu_seconds=(int(stat[11]) + int(stat[12])) / _TICK,
            rss_bytes=int(statm[1]) * _PAGE,
            vms_bytes=int(statm[0]) * _PAGE,
            open_fds=fds,
            max_fds=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            start_time=_boot_time() + int(stat[19]) / _TICK,
        )


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


_boot: float | None = None


def _boot_time() -> float:
    global _boot
    if _boot is None:
        _boot = 0.0
        for line in _read("/proc/stat").splitlines():
            if line.startswith("btime "):
                _boot = float(line.split()[1])
    return _boot


class ProcessMetrics(Message):
    """Everything one process of a system measured.

    Attributes:
        name: The process's system name (an actor process's: its actor's name).
        station: The reply inbox of its station (`runtime._station`), which owns its actors.
        process: Its resources.
        actors: Every actor it hosts.
        asks: Round trips of the asks it sent, by the name of the actor asked.
        families: The series its code added (`runtime.metrics`).
        gathered_at: When this was read, seconds since the epoch.
    """

    name: str
    #: On the wire it keeps its first name, ``node``: the METRICS reply did not change.
    station: str = msgspec.field(name="node")
    process: ProcessResources
    actors: list[ActorMetrics] = msgspec.field(default_factory=list)
    asks: dict[str, HistogramSnapshot] = msgspec.field(default_factory=dict)
    families: list[FamilySnapshot] = msgspec.field(default_factory=list)
    gathered_at: float = 0.0


class DeadIncarnation(msgspec.Struct, frozen=True, kw_only=True):
    """An actor incarnation that died, as the collector last saw it alive.

    Attributes:
        actor: Its last statistics.
        pid: The process it lived in.
        process: Its process's last stats, when it was the actor of a process of its own.
        cause: Why it died (a `Cause` value).
        reason: Why, for people.
        died_at: When the collector heard of it, seconds since the epoch.
    """

    actor: ActorMetrics
    pid: int
    process: ProcessResources | None
    cause: str
    reason: str
    died_at: float


class SystemMetrics(Message):
    """A whole system's statistics, gathered from every process.

    Attributes:
        processes: Every live process that answered, the asking one first.
        dead: Dead incarnations still kept (see `runtime.MetricsCollector`).
        families: Every process's `families`, merged: series with the same labels are
            added up, and a dead process's counters and histograms stay counted.
        gathered_at: When the gathering began, seconds since the epoch.
    """

    processes: list[ProcessMetrics]
    dead: list[DeadIncarnation] = msgspec.field(default_factory=list)
    families: list[FamilySnapshot] = msgspec.field(default_factory=list)
    gathered_at: float = 0.0


def now() -> float:
    """Seconds since the epoch."""
    return time.time()
