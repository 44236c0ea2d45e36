"""``runtime._logging``: the one format every process of a system logs in."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
from typing import IO

import anyio
import anyio.from_thread
import anyio.to_thread

from runtime._logging import LOG_BACKLOG, log_formatter

#: A line of the format: time to the millisecond, level, [process], logger: message.
LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (?P<level>[A-Z]+) \[(?P<process>[^\]]+)\] "
    r"(?P<logger>[\w.]+): (?P<message>.*)"
)


def formatted(process: str, message: str, *args: object) -> str:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(log_formatter(process))
    record = logging.LogRecord("tokenyard.test", logging.WARNING, __file__, 1, message, args, None)
    handler.emit(record)
    return out.getvalue()


class TestTheFormat:
    def test_a_line_has_the_time_the_level_the_process_and_the_logger(self) -> None:
        line = formatted("tokenizer_worker:1", "worker %s died", 3)
        match = LINE.fullmatch(line.rstrip("\n"))
        assert match is not None, line
        assert match.group("level", "process", "logger", "message") == (
            "WARNING",
            "tokenizer_worker:1",
            "tokenyard.test",
            "worker 3 died",
        )

    def test_a_percent_sign_in_the_process_name_is_not_a_format(self) -> None:
        assert "[100% busy]" in formatted("100% busy", "x")

    def test_configure_logging_sets_the_root_logger_of_a_fresh_process(self) -> None:
        script = (
            "import logging; from runtime._logging import configure_logging;"
            " configure_logging('INFO', 'serve');"
            " logging.getLogger('tokenyard.x').info('up'); logging.getLogger('y').debug('no')"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
        )
        (line,) = done.stderr.splitlines()
        match = LINE.fullmatch(line)
        assert match is not None, line
        assert match.group("level", "process", "logger", "message") == (
            "INFO",
            "serve",
            "tokenyard.x",
            "up",
        )


class TestTheMainJobsHandler:
    def test_it_prints_the_format_and_no_time_or_level_of_its_own(self) -> None:
        from rich.console import Console

        from actors._main_job import log_handler

        out = io.StringIO()
        handler = log_handler(Console(file=out, width=200))
        handler.setFormatter(log_formatter("main job"))
        handler.handle(
            logging.LogRecord("tokenyard.x", logging.WARNING, __file__, 1, "slow", None, None)
        )
        match = LINE.fullmatch(out.getvalue().strip())
        assert match is not None, out.getvalue()
        assert match.group("process", "message") == ("main job", "slow")


class TestAStandardErrorNobodyReads:
    def test_logging_does_not_wait_for_it_and_says_how_many_lines_it_dropped(self) -> None:
        script = (
            "import logging, sys; from runtime._logging import LOG_BACKLOG, configure_logging;"
            " configure_logging('INFO', 'serve'); log = logging.getLogger('tokenyard.x');"
            " [log.info('line %d %s', n, 'x' * 100) for n in range(2 * LOG_BACKLOG)];"
            " print('logged', flush=True)"
        )
        with subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            assert proc.stdout is not None
            assert proc.stderr is not None
            try:
                # Its standard error is not read until it says it has logged every line: a
                # blocking write would have stopped it at the pipe's 64 KiB.
                with anyio.from_thread.start_blocking_portal() as portal:
                    line = portal.call(_read_line_within, proc.stdout, 30.0)
                assert line == "logged\n"
                err = proc.stderr.read()
                assert proc.wait(timeout=30) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        lines = err.splitlines()
        (dropped,) = [line for line in lines if "log lines dropped" in line]
        count = int(dropped.strip("[").split()[0])
        written = [line for line in lines if LINE.fullmatch(line)]
        assert count + len(written) == 2 * LOG_BACKLOG
        assert len(written) >= LOG_BACKLOG  # the lines kept were written, at the latest at exit


async def _read_line_within(stream: IO[str], timeout: float) -> str:
    with anyio.fail_after(timeout):
        return await anyio.to_thread.run_sync(stream.readline, abandon_on_cancel=True)
