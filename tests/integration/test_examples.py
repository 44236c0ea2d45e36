"""Every example in docs/examples/ and the README's example run, exit cleanly, and print
what they are meant to show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
#: Examples with a test of their own (they need a server, or arguments).
DRIVEN_ELSEWHERE = {"fastapi_app.py"}

#: What each example must print: regular expressions, each matching a whole line of its
#: output, in this order (other lines may come between). Pids, timings and generated text
#: vary; what the example is about does not.
SHOWS: dict[str, list[str]] = {
    "actor_tree.py": [
        r"greeter \(pid \d+, incarnation 1\): Hello, tree!",
        r"accumulator \(pid \d+, incarnation 1\): total 6",
        r"Down: accumulator incarnation 1, reason 'killed by SIGKILL'",
        r"accumulator restarted \(pid \d+, incarnation 2\): total 10 \(a fresh start\)",
        r"greeter untouched \(pid \d+\): Hello, again!",
        r"system closed: supervisor and children stopped",
    ],
    "anyio_embedding.py": [
        r"worker [01]: 16 tokens \(length\): .+",
        *(
            rf"worker [01]: {re.escape(repr(prompt))} -> .+"
            for prompt in ("Hello there", "Bonjour à tous", "def f(x): return x", "你好, 世界")
        ),
        r"streamed [1-9]\d* pieces: \[.+\]",
        r"pipeline closed: every worker process stopped",
    ],
    "embedding.py": [
        r"sent 1, running total 1",
        r"sent 2, running total 3",
        r"sent 3, running total 6",
    ],
    "first_actor.py": [
        r"account: balance 120",
        r"local: balance 20",
        r"refused: builtins\.ValueError: cannot withdraw 1000: the balance is 120",
        r"no reply within 0\.1 s \(the handler still runs to its end\)",
        r"stopped: reason='normal' exitcode=0",
        r"after the stop: actor 'account' \(incarnation 1\) is dead: normal",
    ],
    "observing.py": [
        r"pipeline-supervisor \(pid \d+\): \d+ handled, 0 queued, \d+ MiB resident",
        r"scheduler \(pid \d+\): [1-9]\d* handled, 0 queued, \d+ MiB resident",
        r"demo_prompts_total 3",
        r"tokenyard:generation_tokens_total 24",
        r"tokenyard:time_to_first_token_seconds_count 3",
        r"pipeline closed",
    ],
    "openai_server.py": [
        r"serving tokenyard-bundled-bpe on http://127\.0\.0\.1:\d+",
        r"completion \(length, 16 tokens\): .+",
        r"chat: [1-9]\d* pieces, \d+ prompt and ([1-9]|1[0-6]) completion tokens",
        r"refused with 400, naming the parameter 'n'",
        r"server stopped, pipeline closed",
    ],
    "runtime_demo.py": [
        r"spawned adder and mirror in their own processes",
        r"200000 tells handled \(and forwarded\) in [\d.]+ s: [\d,]+/s",
        r"total 19999900000 == mirrored 19999900000",
    ],
    "supervision.py": [
        r"pending ask failed: killed by SIGKILL",
        r"Down: reason='killed by SIGKILL' exitcode=-9 signal=9",
        r"db restarted: incarnation 1 -> 2",
        r"a tell through the stale ref raises ActorDeadError",
        r"supervisor: 1 death, 1 restart",
        r"fragile supervisor died: exception: runtime\.RestartIntensityError: supervisor "
        r"'fragile': more than 1 restarts in 30 s",
    ],
    "testing_actors.py": [r"[1-9]\d* passed in [\d.]+s"],
    "watcher.py": [
        r"Result\(n=7, square=49\)",
        r"foreman: squarer died \(exception: builtins\.RuntimeError: lost count\); hiring "
        r"another",
        r"squarer incarnation 1 -> 2",
        r"Result\(n=8, square=64\)",
    ],
}


def run_python(path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        check=False,
    )


def assert_shows(stdout: str, patterns: list[str]) -> None:
    """Each pattern matches a whole line of ``stdout``, the lines in the patterns' order."""
    lines = iter(stdout.splitlines())
    for pattern in patterns:
        if not any(re.fullmatch(pattern, line) for line in lines):
            raise AssertionError(f"no line (in order) matches {pattern!r} in:\n{stdout}")


def test_every_docs_example_says_what_it_must_print() -> None:
    run_here = {p.name for p in EXAMPLES} - DRIVEN_ELSEWHERE
    assert set(SHOWS) == run_here


@pytest.mark.parametrize(
    "example",
    [p for p in EXAMPLES if p.name not in DRIVEN_ELSEWHERE],
    ids=lambda p: p.name,
)
def test_each_docs_example_runs_to_a_clean_exit_and_shows_its_point(example: Path) -> None:
    done = run_python(example)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_shows(done.stdout, SHOWS.get(example.name, [r".+"]))


def test_the_readme_example_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"```python\n(.*?)```", readme, re.S)
    assert match is not None
    script = tmp_path / "readme_example.py"
    script.write_text(match.group(1), encoding="utf-8")
    done = run_python(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "Pong(n=42)"


#: Appended inside the README pipeline example's ``async with``: the titles of the
#: processes it started, each ``tokenyard::<name>:<pid>``.
CHILDREN = """
        children = Path("/proc/self/task").glob("*/children")
        pids = [pid for path in children for pid in path.read_text().split()]
        titles = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\\0")[0] for pid in pids]
        print()
        print(sorted(title.decode().rpartition(":")[0] for title in titles))
"""


def test_the_readme_pipeline_example_runs_and_starts_what_it_says(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    example = next(block for block in blocks if "Pipeline(" in block)
    imports = [line for line in example.splitlines() if line.startswith("from ")]
    body = [line for line in example.splitlines() if not line.startswith("from ")]
    script = tmp_path / "readme_pipeline.py"
    script.write_text(
        "import anyio\nfrom pathlib import Path\n"
        + "\n".join(imports)
        + "\n\n\nasync def main() -> None:\n"
        + "\n".join(f"    {line}" if line else "" for line in body)
        + CHILDREN
        + '\n\nif __name__ == "__main__":\n    anyio.run(main)\n',
        encoding="utf-8",
    )
    done = run_python(script)
    assert done.returncode == 0, done.stderr[-3000:]
    # What its comment says: four workers, the scheduler, a detokenizer and the router in
    # processes of their own (and the fork server they are forked from); the supervisor in
    # the caller's. Before, it said two detokenizers and a supervisor process.
    assert done.stdout.splitlines()[-1] == str(
        sorted(
            [
                "tokenyard::detokenizer:0",
                "tokenyard::pipeline.fork-server",
                "tokenyard::router",
                "tokenyard::scheduler",
                *(f"tokenyard::tokenizer_worker:{k}" for k in range(4)),
            ]
        )
    )
    assert "two detokenizers" not in example
