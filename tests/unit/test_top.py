"""``runtime.top``'s view at every terminal width: columns are left out, numbers never cut;
and the values and files its command line refuses before it attaches."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest
from rich.console import Console

from runtime import ActorRef
from runtime._mailbox import MailboxStatistics
from runtime._metrics import HistogramSnapshot
from runtime._stats import (
    ActorMetrics,
    ChildRecord,
    DeadIncarnation,
    ProcessMetrics,
    ProcessResources,
    SystemMetrics,
)
from runtime.top import COLUMNS, Frame, main, render_frame

if TYPE_CHECKING:
    from pathlib import Path

BOUNDS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def actor(
    name: str, incarnation: int, done: int, *, queued: int = 0, failed: int = 0
) -> ActorMetrics:
    return ActorMetrics(
        ref=ActorRef(name=name, address=f"ipc:///run/{name}", incarnation=incarnation),
        actor_class="app:Actor",
        mailbox=MailboxStatistics(
            received=done + queued,
            rejected=0,
            handled=done,
            failed=failed,
            queued=queued,
            queued_bytes=queued * 1900,
        ),
        handler_seconds=HistogramSnapshot(BOUNDS, (10, done // 2, done // 4, 3, 1, 0, 0), 1.0),
        children=[
            ChildRecord(
                name="tokenizer_worker:1",
                incarnation=2,
                restarts={"signal": 1},
                last_reason="killed by SIGKILL",
            )
        ]
        if name == "pipeline-supervisor"
        else [],
    )


def process(
    name: str, pid: int, cpu: float, actors: list[ActorMetrics], at: float
) -> ProcessMetrics:
    stats = ProcessResources(pid=pid, cpu_seconds=cpu, rss_bytes=95_000_000)
    return ProcessMetrics(name=name, station="", process=stats, actors=actors, gathered_at=at)


def gathering(at: float, scale: int) -> SystemMetrics:
    """A four-worker serve under load after worker 1's SIGKILL, at time ``at``."""
    parent = [actor("pipeline-supervisor", 1, 40), actor("pipeline-inbox", 1, 9_000 * scale)]
    processes = [process("serve", 4_123_456, 10.0 * scale, parent, at)]
    for k in range(4):
        worker = actor(
            f"tokenizer_worker:{k}",
            2 if k == 1 else 1,
            123_400 * scale,
            queued=1_234,
            failed=12,
        )
        name = f"tokenizer_worker:{k}"
        processes.append(process(name, 4_123_460 + k, 5.0 * scale, [worker], at))
    dead = DeadIncarnation(
        actor=actor("tokenizer_worker:1", 1, 1_000),
        pid=4_123_400,
        process=None,
        cause="signal",
        reason="killed by SIGKILL",
        died_at=at - 1,
    )
    return SystemMetrics(processes=processes, dead=[dead], gathered_at=at)


FRAME = Frame(gathering(101.0, 2), gathering(100.0, 1))


def shown(width: int) -> list[str]:
    console = Console(width=width, force_terminal=False, color_system=None)
    with console.capture() as capture:
        console.print(render_frame(FRAME))
    return capture.get().splitlines()


def row(lines: list[str], name: str) -> list[str]:
    """The words of the first row that shows ``name``."""
    return next(line.split() for line in lines if name in line.split())


class TestTheViewAtItsWidth:
    @pytest.mark.parametrize("width", [60, 72, 80, 100, 120, 140, 160, 200])
    def test_no_line_is_wider_than_the_terminal_and_no_number_is_cut(self, width: int) -> None:
        lines = shown(width)
        assert all(len(line.rstrip()) <= width for line in lines), lines
        # An ellipsis only ever ends a reason, never follows a digit.
        assert not [line for line in lines if re.search(r"\d…", line)], lines

    def test_at_80_columns_it_keeps_what_an_operator_needs_whole(self) -> None:
        lines = shown(80)
        header = next(line for line in lines if line.lstrip().startswith("actor"))
        assert header.split() == [
            "actor", "queued", "done/s", "p99", "cpu%", "restarts", "last", "reason",
        ]  # fmt: skip
        assert row(lines, "tokenizer_worker:2") == [
            "tokenizer_worker:2", "1,234", "123,400", "973µs", "500", "0",
        ]  # fmt: skip
        restarted = [line.split() for line in lines if "killed by SIGKILL" in line]
        assert restarted[0][-4:] == ["1", "killed", "by", "SIGKILL"]
        assert lines[-1] == "not shown at this width: pid, inc, bytes, in/s, failed, p50, rss"

    def test_a_wide_terminal_shows_every_column_and_says_nothing_is_hidden(self) -> None:
        lines = shown(200)
        header = next(line for line in lines if line.lstrip().startswith("pid"))
        assert header.split() == [t for c in COLUMNS for t in c.title.split()]
        assert row(lines, "tokenizer_worker:2")[:4] == [
            "4123462", "tokenizer_worker:2", "1", "1,234",
        ]  # fmt: skip
        assert not [line for line in lines if "not shown" in line]

    def test_the_actor_is_shown_at_any_width_and_the_more_useful_columns_first(self) -> None:
        view = render_frame(FRAME)
        actor_column = [c.title for c in COLUMNS].index("actor")
        core = {[c.title for c in COLUMNS].index(t) for t in ("queued", "done/s", "p99")}
        for width in range(20, 201):
            columns = set(view.columns(width))
            assert actor_column in columns
            if len(columns) > 4:
                assert core <= columns, width


class TestTheCommandLine:
    @pytest.mark.parametrize(
        ("arguments", "named"),
        [
            (["--interval", "-1"], "argument --interval: -1: give a finite number of seconds"),
            (["--interval", "nan"], "argument --interval: nan: give a finite number of seconds"),
            (["--interval", "inf"], "argument --interval: inf: give a finite number of seconds"),
            (["--interval", "0"], "argument --interval: 0: give a finite number of seconds"),
            (["--interval", "0.05"], "argument --interval: 0.05: give at least 0.1 seconds"),
            (["--interval", "soon"], "argument --interval: 'soon' is not a number of seconds"),
            (["--timeout", "0"], "argument --timeout: 0: give a finite number of seconds"),
            (["--timeout", "-1"], "argument --timeout: -1: give a finite number of seconds"),
            (["--timeout", "nan"], "argument --timeout: nan: give a finite number of seconds"),
        ],
        ids=[
            "interval-negative",
            "interval-nan",
            "interval-inf",
            "interval-0",
            "interval-below-the-least",
            "interval-not-a-number",
            "timeout-0",
            "timeout-negative",
            "timeout-nan",
        ],
    )
    def test_an_interval_or_timeout_out_of_range_exits_2_with_the_usage(
        self, arguments: list[str], named: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Before, --interval -1 or nan drew one view and then was a traceback, --interval 0
        gathered the whole system back to back, and --timeout 0 or -1 was taken."""
        with pytest.raises(SystemExit) as exited:
            main(["--credentials", "/nonexistent/credentials.json", *arguments])
        assert exited.value.code == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith("usage: python -m runtime top")
        assert err.splitlines()[-1].startswith(f"python -m runtime top: error: {named}")

    @pytest.mark.parametrize(
        ("content", "problem"),
        [
            ("", "Input data was truncated"),
            ("not json", "JSON is malformed"),
            ('{"a": 1}', "Object missing required field"),
        ],
        ids=["empty", "not-json", "another-shape"],
    )
    def test_a_file_that_is_not_credentials_cannot_be_attached_with_in_one_line(
        self, content: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Before, each was a msgspec traceback: only an OSError was caught."""
        path = tmp_path / "credentials.json"
        path.write_text(content)
        path.chmod(0o600)
        assert main(["--credentials", str(path), "--once"]) == 1
        out, err = capsys.readouterr()
        assert out == ""
        (line,) = err.splitlines()
        assert line.startswith(f"cannot attach: {path} is not a credentials file: ")
        assert problem in line
