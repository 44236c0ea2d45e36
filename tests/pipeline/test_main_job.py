"""The main job, ``python -m actors`` (what ``make run`` runs), as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
