"""The supervisor's arithmetic, in-process: backoff with jitter, the intensity window, and
how an exit status (and the cgroup's OOM-kill counter) becomes a ``Down`` reason."""

from __future__ import annotations

import math
import random
import signal
import time
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import (
    Actor,
    ActorRef,
    ChildSpec,
    GetSupervisorStatistics,
    Message,
    Restart,
    RestartIntensityError,
    Strategy,
    Supervisor,
    handler,
)
from runtime._exit import oom_kills, reason_for_status
from runtime._supervisor import restart_delay

if TYPE_CHECKING:
    from pathlib import Path


class Nudge(Message):
    pass


class Idle(Actor[Nudge]):
    @handler
    def nudge(self, msg: Nudge) -> None:
        return None


def supervisor(max_restarts: int = 3, period: float = 5.0) -> Supervisor[Any]:
    """A supervisor of one child, built but not started (its counters work without a loop)."""
    sup: Supervisor[Any] = Supervisor(
        [ChildSpec(Idle, name="idle")], max_restarts=max_restarts, period=period
    )
    sup.ref = ActorRef("sup", "inproc://sup")
    return sup


def bounds(attempt: int, backoff: float, cap: float) -> tuple[float, float]:
    """The documented range of the ``attempt``-th delay (n >= 2)."""
    grown = backoff * 2.0 ** (attempt - 2)
    return min(grown * 0.5, cap), min(grown * 1.5, cap)


class TestBackoff:
    @pytest.mark.parametrize("attempt", [0, 1])
    def test_the_first_restart_of_a_child_in_its_window_is_immediate(self, attempt: int) -> None:
        assert restart_delay(attempt, 0.05, 2.0, random.Random(0)) == 0.0

    @settings(max_examples=300, deadline=None)
    @given(
        attempt=st.integers(min_value=2, max_value=40),
        backoff=st.floats(min_value=1e-4, max_value=1.0),
        cap=st.floats(min_value=1e-3, max_value=60.0),
        seed=st.integers(min_value=0, max_value=2**32),
    )
    def test_later_restarts_grow_exponentially_within_the_jitter_bounds(
        self, attempt: int, backoff: float, cap: float, seed: int
    ) -> None:
        low, high = bounds(attempt, backoff, cap)
        assert low <= restart_delay(attempt, backoff, cap, random.Random(seed)) <= high

    def test_the_jitter_spreads_delays_over_half_to_one_and_a_half_times_the_base(self) -> None:
        delays = [restart_delay(3, 0.1, 10.0, random.Random(seed)) for seed in range(200)]
        assert all(0.1 <= d <= 0.3 for d in delays)  # base 0.1 * 2 = 0.2
        assert min(delays) < 0.11  # the whole range is used
        assert max(delays) > 0.29
        assert len(set(delays)) == len(delays)  # no two supervisors in step

    @pytest.mark.parametrize("attempt", [9, 10, 100, 1025, 1026, 10_000])
    def test_the_delay_is_capped_at_backoff_max(self, attempt: int) -> None:
        # 0.05 * 2**7 * 0.5 = 3.2 > 2.0: from the 9th restart on, every delay is the cap.
        assert restart_delay(attempt, 0.05, 2.0, random.Random(attempt)) == 2.0

    def test_a_zero_backoff_never_waits(self) -> None:
        assert restart_delay(50, 0.0, 2.0, random.Random(0)) == 0.0

    def test_a_supervisor_spaces_the_restarts_of_one_child_as_documented(self) -> None:
        sup = supervisor(period=60.0)  # the defaults: backoff=0.05, backoff_max=2.0
        assert (sup.backoff, sup.backoff_max) == (0.05, 2.0)
        sup._rng = random.Random(7)
        entry = sup.entries[0]
        delays = [sup._backoff(entry) for _ in range(12)]
        assert delays[0] == 0.0
        for attempt, delay in enumerate(delays[1:], start=2):
            low, high = bounds(attempt, 0.05, 2.0)
            assert low <= delay <= high, (attempt, delay)
        assert delays[-1] == 2.0

    def test_restarts_that_left_the_window_no_longer_grow_the_delay(self) -> None:
        sup = supervisor(period=30.0)
        entry = sup.entries[0]
        entry.restarts.extend([time.monotonic() - 31.0] * 5)  # five restarts, long ago
        assert sup._backoff(entry) == 0.0
        assert len(entry.restarts) == 1

    def test_a_thousand_restarts_in_one_window_wait_the_cap_instead_of_overflowing(
        self,
    ) -> None:
        sup = supervisor(max_restarts=5000, period=3600.0)
        entry = sup.entries[0]
        delays = [sup._backoff(entry) for _ in range(1100)]
        assert delays[-100:] == [2.0] * 100


class TestIntensity:
    def test_exceeding_the_intensity_raises_and_is_counted_in_statistics(self) -> None:
        sup = supervisor(max_restarts=2, period=30.0)
        sup._count_restart("idle")
        sup._count_restart("idle")
        with pytest.raises(RestartIntensityError, match="'sup': more than 2 restarts in 30 s"):
            sup._count_restart("idle")
        stats = sup.statistics(GetSupervisorStatistics())
        assert stats.intensity_exceeded == 1
        assert stats.last_restart_ms is None  # no restart was completed

    def test_restarts_older_than_the_period_leave_the_intensity_window(self) -> None:
        sup = supervisor(max_restarts=2, period=30.0)
        sup.intensity.extend([time.monotonic() - 31.0] * 2)
        sup._count_restart("idle")
        sup._count_restart("idle")
        assert len(sup.intensity) == 2
        assert sup.statistics(GetSupervisorStatistics()).intensity_exceeded == 0


class TestArgumentsAreCheckedWhereTheyAreGiven:
    @pytest.mark.parametrize(
        ("knobs", "error", "match"),
        [
            # NaN: the second restart of a child waited for ever, and the supervisor with it.
            ({"backoff": math.nan}, ValueError, "backoff=nan"),
            ({"backoff": -1.0}, ValueError, "backoff=-1.0"),
            ({"backoff_max": math.nan}, ValueError, "backoff_max=nan"),
            ({"backoff_max": -1.0}, ValueError, "backoff_max=-1.0"),
            ({"period": math.nan}, ValueError, "period=nan"),
            ({"max_restarts": math.nan}, TypeError, "max_restarts=nan"),
            ({"max_restarts": 1.5}, TypeError, "max_restarts=1.5"),
            ({"strategy": "one_for_none"}, ValueError, "'one_for_none' is not a Strategy"),
        ],
    )
    def test_a_supervisor_refuses_knobs_out_of_their_bounds(
        self, knobs: dict[str, Any], error: type[Exception], match: str
    ) -> None:
        with pytest.raises(error, match=match):
            Supervisor([ChildSpec(Idle, name="idle")], **knobs)

    def test_a_strategy_or_restart_type_given_by_its_value_is_that_one(self) -> None:
        # As in a supervisor's own process, where the arguments arrive decoded: compared by
        # identity, "one_for_all" read as REST_FOR_ONE here, and "transient" as PERMANENT.
        sup: Supervisor[Any] = Supervisor(
            [ChildSpec(Idle, name="idle", restart="transient")],  # type: ignore[arg-type]
            strategy="one_for_all",  # type: ignore[arg-type]
        )
        assert sup.strategy is Strategy.ONE_FOR_ALL
        assert sup.entries[0].spec.restart is Restart.TRANSIENT
        with pytest.raises(ValueError, match="ChildSpec 'idle': 'sometimes' is not a Restart"):
            ChildSpec(Idle, name="idle", restart="sometimes")  # type: ignore[arg-type]


class Cgroup:
    """A fake cgroup v2 tree and ``/proc/self/cgroup``, read in place of the system's."""

    def __init__(self, root: Path, proc: Path) -> None:
        self.root = root
        self.proc = proc

    def place(self, path: str) -> None:
        """Say this process lives in the cgroup ``path`` (as /proc/self/cgroup would)."""
        self.proc.write_text(f"0::{path}\n")

    def write(self, path: str, oom_kill: int | str) -> None:
        """Write the cgroup's ``memory.events`` as the kernel does (oom_group_kill: 5.17+)."""
        events = self.root / path.strip("/") / "memory.events"
        events.parent.mkdir(parents=True, exist_ok=True)
        events.write_text(f"low 0\nhigh 0\nmax 17\noom 3\noom_kill {oom_kill}\noom_group_kill 0\n")


@pytest.fixture
def cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cgroup:
    fake = Cgroup(tmp_path / "cgroup", tmp_path / "proc-self-cgroup")
    fake.root.mkdir()
    fake.place("/")  # a container with its own cgroup namespace: it is the root
    monkeypatch.setattr("runtime._exit._CGROUP_ROOT", str(fake.root))
    monkeypatch.setattr("runtime._exit._PROC_CGROUP", str(fake.proc))
    return fake


class TestOomKillCounter:
    def test_it_is_read_from_the_root_in_a_container(self, cgroup: Cgroup) -> None:
        cgroup.write("/", 4)
        assert oom_kills() == 4

    def test_it_is_read_from_the_processs_own_cgroup_on_a_host(self, cgroup: Cgroup) -> None:
        cgroup.place("/user.slice/user-1000.slice/session-2.scope")
        cgroup.write("/user.slice/user-1000.slice/session-2.scope", 5)
        assert oom_kills() == 5

    def test_the_root_is_the_fallback_when_the_own_cgroup_is_not_mounted_here(
        self, cgroup: Cgroup
    ) -> None:
        cgroup.place("/docker/0123abcd")  # the host's path, inside the container's mount
        cgroup.write("/", 6)
        assert oom_kills() == 6

    def test_there_is_none_where_the_os_does_not_expose_one(self, cgroup: Cgroup) -> None:
        cgroup.proc.write_text("4:memory:/process_api/d04e\n0::/\n")  # cgroup v1 memory
        assert oom_kills() is None

    def test_an_unreadable_counter_counts_as_none(self, cgroup: Cgroup) -> None:
        cgroup.write("/", "many")
        assert oom_kills() is None


class TestKilledForMemory:
    def test_a_sigkill_while_the_oom_kill_count_grew_is_a_kill_for_memory(
        self, cgroup: Cgroup
    ) -> None:
        cgroup.write("/", 4)
        assert reason_for_status(-signal.SIGKILL, None, oom_before=3)[1:] == (
            "killed for memory (the kernel's OOM killer)",
            signal.SIGKILL,
        )

    def test_a_sigkill_while_the_count_stood_still_is_a_plain_sigkill(self, cgroup: Cgroup) -> None:
        cgroup.write("/", 3)
        assert reason_for_status(-signal.SIGKILL, None, oom_before=3)[1:] == (
            "killed by SIGKILL",
            signal.SIGKILL,
        )

    def test_only_a_sigkill_is_taken_for_the_oom_killer(self, cgroup: Cgroup) -> None:
        cgroup.write("/", 9)
        assert reason_for_status(-signal.SIGTERM, None, oom_before=3)[1:] == (
            "killed by SIGTERM",
            signal.SIGTERM,
        )

    def test_without_a_count_at_start_a_sigkill_is_a_plain_sigkill(self, cgroup: Cgroup) -> None:
        cgroup.write("/", 9)
        assert reason_for_status(-signal.SIGKILL, None, oom_before=None)[1] == "killed by SIGKILL"

    def test_a_counter_gone_by_the_death_reads_as_a_plain_sigkill(self, cgroup: Cgroup) -> None:
        assert reason_for_status(-signal.SIGKILL, None, oom_before=3)[1] == "killed by SIGKILL"


class TestExitReasons:
    @pytest.mark.parametrize(
        ("status", "error", "reason", "signum"),
        [
            (0, None, "normal", None),
            (
                1,
                "builtins.RuntimeError: bad state",
                "exception: builtins.RuntimeError: bad state",
                None,
            ),
            (3, None, "exited with status 3", None),
            (-signal.SIGTERM, None, "killed by SIGTERM", signal.SIGTERM),
            (-100, None, "killed by signal 100", 100),
        ],
    )
    def test_an_exit_status_becomes_the_documented_reason(
        self, status: int, error: str | None, reason: str, signum: int | None
    ) -> None:
        assert reason_for_status(status, error)[1:] == (reason, signum)
