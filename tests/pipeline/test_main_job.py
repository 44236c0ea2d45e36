"""The main job, ``python -m actors`` (what ``make run`` runs), as a user runs it."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.http.test_serve import _pids_with, signalled_while_importing

ROOT = Path(__file__).resolve().parents[2]


def run_main_job(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "actors", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        check=False,
    )


def figure(output: str, name: str) -> str:
    """The value printed next to ``name`` in the summary table."""
    match = re.search(rf"^[│|] {re.escape(name)} +[│|] *(.*?) *[│|]$", output, re.MULTILINE)
    assert match is not None, f"no {name!r} in the output:\n{output}"
    return match.group(1)


@pytest.mark.timeout(180)
def test_the_main_job_serves_llamacpp_and_loses_no_waiting_connection_on_a_kill() -> None:
    # The default engine: llama.cpp on the tiny model the job writes, said to be random.
    done = run_main_job("--requests", "200", "--concurrency", "16")
    out = done.stdout
    assert done.returncode == 0, f"{out[-3000:]}\n{done.stderr[-3000:]}"
    assert "random weights" in out
    assert re.search(r"llama\.cpp\s+\(\S*model\.gguf", out), out[:2000]
    assert "user> " in out
    assert "assistant> " in out
    assert re.fullmatch(r"[\d,]+", figure(out, "requests/s"))
    for name in ("TTFT", "inter-token", "end-to-end"):
        assert re.fullmatch(r"[\d.]+ ms", figure(out, f"{name} p50"))
        assert re.fullmatch(r"[\d.]+ ms", figure(out, f"{name} p99"))
    served = {
        int(k): int(v.replace(",", ""))
        for k, v in re.findall(r"(\d+): ([\d,]+)", figure(out, "served per worker"))
    }
    assert sorted(served) == [0, 1, 2, 3]
    failed = int(figure(out, "failed in flight on the killed worker").replace(",", ""))
    assert figure(out, "lost waiting connections") == "0"
    assert int(figure(out, "completed").replace(",", "")) + failed == 200
    assert sum(served.values()) == 200 - failed
    assert figure(out, "killed") == "worker 3 (incarnation 1)"
    assert re.fullmatch(r"[\d.]+ s", figure(out, "restart time"))
    assert "no waiting connection lost" in out


def test_a_missing_tokenizer_is_a_usage_error() -> None:
    done = run_main_job("--tokenizer", str(ROOT / "no-such-tokenizer.json"), timeout=60)
    assert done.returncode == 2
    assert "does not exist" in done.stdout


def test_a_model_with_the_stand_in_is_a_usage_error() -> None:
    done = run_main_job("--engine", "stand-in", "--model", str(ROOT / "x.gguf"), timeout=60)
    assert done.returncode == 2
    assert "--model is llama.cpp's" in done.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--port", "70000"), "--port 70000: a TCP port is 0 (any free one) to 65535"),
        (("--stream-tokens", "0"), "--stream-tokens must be at least 1"),
        (("--model", str(ROOT / "README.md")), "is not a GGUF file"),
    ],
    ids=["port", "stream-tokens", "model"],
)
def test_a_bad_option_is_one_line_naming_it_and_status_2(args: tuple[str, ...], says: str) -> None:
    # Before, a port out of range and a file that is no GGUF were a task group's traceback
    # and status 1, and --stream-tokens 0 was refused as "--max-tokens".
    done = run_main_job(*args, timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert says in done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_a_port_in_use_is_one_line_and_status_1() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run_main_job("--engine", "stand-in", "--port", str(port), timeout=60)
    out = " ".join(done.stdout.split())  # the console wraps at 100 columns
    assert done.returncode == 1, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert f"cannot serve on 127.0.0.1:{port}: address already in use" in out
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_signal_while_python_still_imports_it_stops_it_as_a_later_one_does(
    tmp_path: Path, signum: int
) -> None:
    # Before, SIGINT there was a KeyboardInterrupt traceback from the import, and SIGTERM
    # killed it without a word.
    args = ("--engine", "stand-in", "--workers", "1", "--requests", "10")
    done = signalled_while_importing(tmp_path, signum, *args)
    assert done.returncode == 128 + signum, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "interrupted"
    assert f"{signal.Signals(signum).name}: stopping" in done.stdout
    assert done.stderr == ""


def test_an_open_file_limit_too_low_for_its_processes_is_one_line_and_status_1() -> None:
    # Before, libzmq aborted the job during the start (SIGABRT, 'Too many open files
    # (src/ipc_listener.cpp:297)'), its workers already started.
    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENYARD_TEST_MARK=mark)
    with subprocess.Popen(
        [sys.executable, "-m", "actors", "--engine", "stand-in", "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        preexec_fn=limit_files,
    ) as proc:  # fmt: skip
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    assert err == ""
    (line,) = out.splitlines()
    assert re.fullmatch(
        r"the open-file limit \(RLIMIT_NOFILE\) is 64, and 2 workers, 1 detokenizer and 36 "
        r"HTTP clients need at least (\d+) in this process: raise it \(ulimit -n \1, or "
        r"LimitNOFILE= under systemd\), or ask for fewer --workers or a lower --concurrency",
        line,
    ), line
    assert not _pids_with(f"TOKENYARD_TEST_MARK={mark}".encode())
    assert not list(Path(tempfile.gettempdir()).glob(f"tokenyard-{proc.pid}-*"))
