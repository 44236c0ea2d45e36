"""``python -m runtime top`` for real: attached to a running system through its credentials
file, driven through a pseudo-terminal, its screen read back."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
from typing import TYPE_CHECKING

import anyio
import pytest

from runtime import ActorSystem, ChildSpec, MetricsCollector, Supervisor

from ._actors import Echo, Ping

if TYPE_CHECKING:
    from pathlib import Path

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


class Screen:
    """What a program wrote to its terminal, escape sequences taken out."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.raw = bytearray()

    @property
    def text(self) -> str:
        return ANSI.sub(b"", bytes(self.raw)).decode(errors="replace")

    async def wait_for(self, *needles: str, timeout: float = 20.0) -> str:
        """Read until every needle was shown since the screen was last cleared."""
        with anyio.fail_after(timeout):
            while True:
                shown = self.text
                if all(n in shown for n in needles):
                    return shown
                await anyio.wait_readable(self.fd)
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the program closed its terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"top ended before showing {needles}:\n{shown}")
                self.raw += chunk

    def clear(self) -> None:
        self.raw.clear()


def rows_of(shown: str, actor: str) -> list[list[str]]:
    """The rows of the table that show ``actor``, split into their cells' words."""
    return [
        words for line in shown.splitlines() if len(words := line.split()) > 2 and words[1] == actor
    ]


def start_top(
    path: Path, *extra: str, columns: int = 180
) -> tuple[subprocess.Popen[bytes], Screen]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", "top", "--credentials", str(path), *extra],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    os.set_blocking(master, False)
    return proc, Screen(master)


async def stop_top(
    proc: subprocess.Popen[bytes], screen: Screen, *, keys: bytes | None = None, close: bool = True
) -> int:
    """Stop top with SIGINT, or by typing ``keys`` at its terminal; its exit status. The
    terminal is closed unless ``close`` is false (its modes outlive top: the test reads
    them, then closes it)."""
    if keys is None:
        proc.send_signal(signal.SIGINT)
    else:
        os.write(screen.fd, keys)
    await until_exited(proc, screen)
    if close:
        os.close(screen.fd)
    code: int = proc.returncode
    return code


async def until_exited(proc: subprocess.Popen[bytes], screen: Screen) -> None:
    """Read top's terminal until it closes, as top exits; reap it (killed and reaped when
    it does not exit: the failure is this test's, not the next one's)."""
    try:
        with anyio.fail_after(10):
            while True:
                await anyio.wait_readable(screen.fd)  # its terminal closes as it exits
                try:
                    chunk = os.read(screen.fd, 65536)
                except OSError:  # EIO: no process has the terminal open any more
                    break
                if not chunk:
                    break
                screen.raw += chunk
    except TimeoutError:
        proc.kill()
        proc.wait()
        raise
    proc.wait(timeout=10)


def line_mode(fd: int) -> int:
    """The ICANON and ECHO bits of the terminal's local modes (both set: a shell's mode)."""
    lflag: int = termios.tcgetattr(fd)[3]
    return lflag & (termios.ICANON | termios.ECHO)


class TestTop:
    async def test_top_shows_every_actor_its_rates_and_a_restart_with_its_reason(
        self, tmp_path: Path
    ) -> None:
        async with ActorSystem(name="demo") as system:
            collector = await system.spawn(MetricsCollector, name="metrics", process=False)
            await system.spawn(
                Supervisor, children=[ChildSpec(Echo, name="echo")], period=30.0, name="sup"
            )
            echo = await system.lookup("echo")
            for n in range(20):
                await echo.ask(Ping(n=n))
            path = tmp_path / "credentials.json"
            system.credentials(collector=collector).save(path)
            proc, screen = start_top(path, "--interval", "0.3")
            try:
                shown = await screen.wait_for("tokenyard top", "metrics", "sup", "echo", "p99")
                assert "3 processes, 3 actors" in shown
                echo_pid = await _pid_of_echo(system)
                (row,) = rows_of(shown, "echo")[-1:]
                assert row[:3] == [str(echo_pid), "echo", "1"], row  # pid, name, incarnation
                # Kill the supervised child: top shows its death, its restart and why.
                os.kill(echo_pid, signal.SIGKILL)
                screen.clear()
                shown = await screen.wait_for("dead (signal): killed by SIGKILL", "echo")
                live = [r for r in rows_of(shown, "echo") if r[2] == "2"]
                assert live, shown
                assert live[-1][-4:] == ["1", "killed", "by", "SIGKILL"], live[-1]
            finally:
                code = await stop_top(proc, screen)
            assert code == 0

    async def test_at_80_columns_it_fits_and_cuts_no_number_and_q_quits(
        self, tmp_path: Path
    ) -> None:
        async with ActorSystem(name="demo") as system:
            collector = await system.spawn(MetricsCollector, name="metrics", process=False)
            await system.spawn(
                Supervisor, children=[ChildSpec(Echo, name="echo")], period=30.0, name="sup"
            )
            path = tmp_path / "credentials.json"
            system.credentials(collector=collector).save(path)
            proc, screen = start_top(path, "--interval", "0.3", columns=80)
            shell_mode = line_mode(screen.fd)
            assert shell_mode == termios.ICANON | termios.ECHO
            try:
                shown = await screen.wait_for("tokenyard top", "echo", "p99", "not shown")
                assert line_mode(screen.fd) == 0  # cbreak: each key as typed, not echoed
                lines = shown.splitlines()
                assert all(len(line) <= 80 for line in lines), lines
                assert not [line for line in lines if re.search(r"\d…", line)], shown
                header = next(x.split() for x in lines if "actor" in x.split())
                core = ["actor", "queued", "done/s", "p99", "restarts", "last", "reason"]
                assert [word for word in header if word in core] == core, header
            except BaseException:
                await stop_top(proc, screen)
                raise
            code = await stop_top(proc, screen, keys=b"q", close=False)
        try:
            assert code == 0, screen.text
            assert line_mode(screen.fd) == shell_mode  # as top found it
        finally:
            os.close(screen.fd)

    async def test_the_terminal_is_restored_when_the_system_stops_answering(
        self, tmp_path: Path
    ) -> None:
        async with ActorSystem(name="demo") as system:
            collector = await system.spawn(MetricsCollector, name="metrics", process=False)
            path = tmp_path / "credentials.json"
            system.credentials(collector=collector).save(path)
            proc, screen = start_top(path, "--interval", "0.2", "--timeout", "1")
            try:
                await screen.wait_for("tokenyard top", "metrics")
                assert line_mode(screen.fd) == 0
            except BaseException:
                await stop_top(proc, screen)
                raise
        # The system is gone: top's next gathering fails, and it ends.
        try:
            await until_exited(proc, screen)
            shown = screen.text
            assert proc.returncode == 1, shown
            assert "the system does not answer" in shown
            assert "Traceback" not in shown
            assert line_mode(screen.fd) == termios.ICANON | termios.ECHO
        finally:
            os.close(screen.fd)

    async def test_top_refuses_credentials_others_can_read(self, tmp_path: Path) -> None:
        async with ActorSystem(name="demo") as system:
            path = tmp_path / "credentials.json"
            system.credentials().save(path)
            path.chmod(0o644)
            done = await anyio.run_process(
                [sys.executable, "-m", "runtime", "top", "--credentials", str(path), "--once"],
                check=False,
            )
        assert done.returncode == 1
        assert b"readable by others" in done.stderr


async def _pid_of_echo(system: ActorSystem) -> int:
    """The echo's process, which its supervisor's process started."""
    metrics = await system.gather_metrics()
    for process in metrics.processes:
        if process.name == "echo":
            return process.process.pid
    pytest.fail("no echo process")
