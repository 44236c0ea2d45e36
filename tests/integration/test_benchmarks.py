"""The benchmark harness: every suite through ``python -m benchmarks`` at its smallest sizes,
the results file it writes and the charts drawn from it; and the pure functions that turn
figures into ratios and targets, on hand-made figures.

The suite runs measure nothing worth reading (one round of one message, one kill, one
actor): they check the plumbing a real run depends on, in a few seconds each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from actors.messages import BatchTokenIDOutput
from benchmarks import dispatch, engines, mailbox, pipeline, serve, spawn, supervision
from benchmarks._cli import SUITES, build_parser
from benchmarks._cli import main as cli_main
from benchmarks._plot import plot_results
from benchmarks._proc import BenchmarkError, Latency
from benchmarks._results import (
    BASELINE,
    INFO,
    SUBJECT,
    Chart,
    Figure,
    Results,
    SuiteResult,
    describe_machine,
    now_iso,
    read_results,
    write_results,
)
from benchmarks._vllm_frontend import missing as vllm_missing
from tests.conftest import exits_within

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Iterator

    from benchmarks._suite import Progress

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

#: Each suite at the smallest sizes its options allow.
SMALLEST: dict[str, list[str]] = {
    "mailbox": ["--messages", "1", "--batches", "1", "--asks", "1"],
    "dispatch": ["--steps", "1", "--workers", "2"],
    "detokenize": ["--tokens", "1"],
    "profile": ["--messages", "1"],
    "pipeline": ["--requests", "1", "--concurrency", "1", "--workers", "2"],
    "supervision": ["--kills", "1"],
    "spawn": ["--actors", "1"],
    "multihost": ["--messages", "1", "--asks", "1", "--losses", "1", "--heartbeats", "1"],
    # llama.cpp only: the vLLM part takes minutes to start its engines.
    "engines": [
        "--engines",
        "llamacpp",
        "--worker-counts",
        "1",
        "--duration",
        "0.5",
        "--concurrency",
        "2",
        "--max-tokens",
        "4",
    ],
    "serve": [
        "--workers",
        "1",
        "--duration",
        "0.5",
        "--concurrency",
        "2",
        "--worker-kills",
        "1",
    ],
}

#: What each suite's results must hold: the params the options set, figures by key, ratios
#: as (figure, baseline) pairs, the figures its targets check, and the charts it draws.
EXPECTED: dict[str, dict[str, Any]] = {
    "multihost": {
        "params": {"messages": 1, "asks": 1, "losses": 1, "heartbeats": "1"},
        "figures": [
            f"{v}.{m}" for v in ("ipc", "tcp") for m in ("tell.throughput", "ask.p50", "ask.p99")
        ]
        + ["loss.hb1.p50", "loss.hb1.max", "loss.hb1.kill.max"],
        "ratios": [
            ("tcp.tell.throughput", "ipc.tell.throughput"),
            ("tcp.ask.p50", "ipc.ask.p50"),
            ("tcp.ask.p99", "ipc.ask.p99"),
        ],
        "targets": ["loss.hb1.max"],
        "charts": ["multihost-tell", "multihost-ask", "multihost-loss"],
    },
    "serve": {
        # --workers 1 is the smallest comparison: a baseline and serve at one worker.
        "params": {"concurrency": 2, "duration_s": 0.5, "kills": 1, "worker_counts": "1"},
        "figures": [
            f"{v}.{m}"
            for v in ("baseline1", "serve1")
            for m in (
                "requests_per_s",
                "ttft_p50",
                "e2e_p99",
                "cpu_front_end_us",
                "busiest_us",
                "projected_rps",
                "load_generator_us",
            )
        ]
        + ["serve1.balance", "kills.lost_waiting", "kills.kills"],
        "ratios": [
            ("serve1.requests_per_s", "baseline1.requests_per_s"),
            ("serve1.projected_rps", "baseline1.projected_rps"),
        ],
        "targets": ["kills.lost_waiting"],
        "charts": ["serve-throughput", "serve-cpu"],
    },
    "engines": {
        "params": {
            "concurrency": 2,
            "duration_s": 0.5,
            "max_tokens": 4,
            "worker_counts": "1",
            "engines": "llamacpp",
        },
        "figures": [
            f"{v}.{m}"
            for v in ("llamacpp", "tokenyard1")
            for m in (
                "requests_per_s",
                "output_tokens",
                "ttft_p50",
                "itl_p99",
                "e2e_p99",
                "cpu_front_end_us",
                "cpu_engine_us",
                "busiest_us",
                "engine_thread_us",
            )
        ]
        + ["llamacpp.cpu_http_us", "tokenyard1.cpu_worker_us", "tokenyard1.cpu_detokenizer_us"],
        "ratios": [
            ("tokenyard1.cpu_front_end_us", "llamacpp.cpu_front_end_us"),
            ("tokenyard1.requests_per_s", "llamacpp.requests_per_s"),
            ("tokenyard1.ttft_p50", "llamacpp.ttft_p50"),
        ],
        "targets": [
            "tokenyard1.cpu_front_end_us",
            "tokenyard1.requests_per_s",
            "tokenyard1.ttft_p50",
        ],
        "charts": ["engines-throughput", "engines-latency", "engines-cpu"],
    },
    "mailbox": {
        "params": {"messages": 1, "batches": 1, "asks": 1, "rounds": 1},
        "figures": [
            f"{variant}.{payload}.throughput"
            for variant in ("floor", "raw", "pyobj", "tell")
            for payload in ("small", "batch", "logprobs")
        ]
        + [
            f"{variant}.{payload}.throughput"
            for variant in ("tell_nometrics", "tell_traced", "tell_traced_new")
            for payload in ("small", "batch")
        ]
        + [
            f"{variant}.{payload}.{metric}"
            for variant in ("ask_sync", "ask_asyncio", "ask")
            for payload in ("small", "batch")
            for metric in ("p50", "p99", "mean")
        ],
        "ratios": [(key, base) for key, base, _ in mailbox.RATIOS],
        # tell batch is held to the floor and to send_pyobj, and both tells to themselves
        # with metrics off; tell small to 0.85x the floor too, each traced tell to the
        # untraced one, and ask p50 to zmq.asyncio's as well as to 150 us.
        "targets": [
            "tell.small.throughput",
            "tell.small.throughput",
            "tell.batch.throughput",
            "tell.batch.throughput",
            "tell.batch.throughput",
            "ask.small.p50",
            "tell.small.throughput",
            "tell_traced.small.throughput",
            "tell_traced.batch.throughput",
            "ask.small.p50",
        ],
        "charts": ["mailbox-throughput", "mailbox-latency"],
    },
    "dispatch": {
        "params": {"steps": 1, "workers": 2, "rounds": 1},
        "figures": [
            f"{v}.throughput" for v in ("sglang", "raw", "actors", "cpu_sglang", "cpu_raw")
        ],
        "ratios": [
            ("raw.throughput", "sglang.throughput"),
            ("actors.throughput", "sglang.throughput"),
            ("cpu_raw.throughput", "cpu_sglang.throughput"),
        ],
        "targets": ["raw.throughput", "actors.throughput"],
        "charts": ["dispatch-throughput"],
    },
    "profile": {
        "params": {"messages": 1, "rounds": 1, "before": ""},
        "figures": [f"{v}.cpu" for v in ("floor", "now")] + ["now.zmq_send", "floor.decode"],
        "ratios": [("now.cpu", "floor.cpu")],
        "targets": [],
        "charts": ["profile-tell"],
    },
    "detokenize": {
        "params": {"tokens": 1, "rounds": 1},
        "figures": [f"{v}.per_token" for v in ("decodestream", "tokenyard", "windows", "stops")],
        "ratios": [
            (f"{v}.per_token", "decodestream.per_token") for v in ("tokenyard", "windows", "stops")
        ],
        "targets": ["tokenyard.per_token"],
        "charts": ["detokenize-per-token"],
    },
    "pipeline": {
        # --workers 2 runs the 1-worker baseline too.
        "params": {"requests": 1, "concurrency": 1, "worker_counts": "1,2", "rounds": 1},
        "figures": [f"w{k}.{m}" for k in (1, 2) for m in ("throughput", "p50", "p99")]
        + [f"w{k}.tokenizer_share" for k in (1, 2)]
        + ["w1.short_alone", "w1.short_behind_long"],
        "ratios": [("w2.throughput", "w1.throughput"), ("w1.short_behind_long", "w1.short_alone")],
        "targets": [],
        "charts": ["pipeline-throughput", "pipeline-latency"],
    },
    "supervision": {
        "params": {"kills": 1, "repeats": 1},
        "figures": [
            f"{loop}.{series}.{metric}"
            for loop in ("caller_fork", "process_fork", "caller", "process", "polling")
            for series in ("down", "ready")
            for metric in ("p50", "p90", "p99", "max")
        ]
        + [
            f"pipeline_{start}.{metric}"
            for start in ("fork", "spawn")
            for metric in ("restart.p50", "restart.p99", "served", "failed", "resubmitted")
        ]
        + ["kill_floor.p50", "startup.python_pass", "startup.spawn_ready"],
        "ratios": [
            (f"{loop}.{series}.{metric}", f"polling.{series}.{metric}")
            for loop in ("caller_fork", "process_fork", "caller", "process")
            for series in ("down", "ready")
            for metric in ("p50", "max")
        ]
        + [
            (f"{where}_fork.{series}.{metric}", f"{where}.{series}.{metric}")
            for where in ("caller", "process")
            for series in ("down", "ready")
            for metric in ("p50", "max")
        ]
        + [("pipeline_fork.restart.p50", "pipeline_spawn.restart.p50")],
        "targets": [
            f"{loop}.{series}.p50"
            for loop in ("caller_fork", "process_fork", "caller", "process")
            for series in ("down", "ready")
        ]
        + ["caller_fork.ready.p50", "process_fork.ready.p50"],
        "charts": [
            "supervision-latency",
            "supervision-timeline",
            "supervision-parts",
            "supervision-startup",
        ],
    },
    "spawn": {
        "params": {"actors": 1, "rounds": 1},
        "figures": [
            f"{name}.{mode}.{metric}"
            for name in ("spawn", "spawn_fresh", "floor")
            for mode in ("sequential", "concurrent")
            for metric in ("wall", "per_process")
        ]
        + [
            f"{p}.{m}"
            for p in ("actor", "actor_fresh", "server", "bare", "imports")
            for m in ("rss", "pss", "uss")
        ],
        "ratios": [
            ("spawn.sequential.wall", "floor.sequential.wall"),
            ("spawn.concurrent.wall", "floor.concurrent.wall"),
            ("spawn_fresh.concurrent.wall", "floor.concurrent.wall"),
            ("spawn.concurrent.wall", "spawn_fresh.concurrent.wall"),
            ("spawn.concurrent.wall", "spawn.sequential.wall"),
            ("actor.rss", "bare.rss"),
            ("actor.uss", "actor_fresh.uss"),
        ],
        "targets": ["spawn.concurrent.wall", "actor.uss"],
        "charts": ["spawn-time", "spawn-memory"],
    },
}


def benchmarks_cli(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks *args`` from the project root, as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    assert done.returncode == 0, (
        f"benchmarks {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


def smallest_run(name: str, results: Path) -> list[str]:
    """The command line that runs suite ``name`` at its smallest into ``results`` (one
    round, for the suites that take ``--rounds``)."""
    rounds = ["--rounds", "1"] if SUITES[name].rounds else []
    return [name, *SMALLEST[name], *rounds, "--json", str(results)]


class SuiteProcess:
    """One ``python -m benchmarks`` run of a suite at its smallest, started at once."""

    def __init__(self, name: str, results: Path) -> None:
        self.results = results
        self.args = smallest_run(name, results)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        self._checked = False

    def wait(self, timeout: float) -> Path:
        """Its results file, once it exited 0."""
        if not self._checked:
            out, err = self.proc.communicate(timeout=timeout)
            assert self.proc.returncode == 0, (
                f"benchmarks {' '.join(self.args)} failed:\n{out[-3000:]}\n{err[-3000:]}"
            )
            self._checked = True
        return self.results

    def end(self) -> None:
        """Stop a run the module's tests did not wait for (a run of some of them): Ctrl-C
        first, so that the suite's clean-up removes its processes and directories, then
        SIGKILL if it does not end."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.communicate()


@pytest.fixture(scope="module")
def suite_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SuiteProcess]]:
    """Every suite run through the CLI at its smallest sizes, all started before the
    module's first test (so the leak guard sees no process appear during a test): most of
    each run is processes starting and waiting, which overlap."""
    runs = {name: SuiteProcess(name, tmp_path_factory.mktemp(name) / "r.json") for name in SMALLEST}
    try:
        yield runs
    finally:
        for run in runs.values():
            run.end()


#: Seconds the first test of a suite's run waits for it: the eleven runs start together
#: and share two CPUs with whatever else runs, so one alone can take a minute or more.
SUITE_WAIT = 300


@pytest.fixture(scope="module", params=list(SMALLEST))
def suite_run(request: pytest.FixtureRequest, suite_runs: dict[str, SuiteProcess]) -> Path:
    """One suite's smallest run (`suite_runs`): the results file it wrote."""
    return suite_runs[request.param].wait(timeout=SUITE_WAIT)


def suite_of(results: Path) -> dict[str, Any]:
    data = json.loads(results.read_text(encoding="utf-8"))
    assert len(data["suites"]) == 1
    suite: dict[str, Any] = data["suites"][0]
    return suite


def test_every_suite_is_run_by_these_tests() -> None:
    assert set(SMALLEST) == set(SUITES) == set(EXPECTED)


# The wait for a run is bounded by SUITE_WAIT, not by the suite's per-test 60 s: a run that
# started with ten others on a loaded machine is slow, not hung.
@pytest.mark.timeout(SUITE_WAIT + 30)
class TestASuiteRun:
    """``python -m benchmarks <suite> ... --json PATH`` writes a complete results file."""

    def test_it_records_its_command_line_and_the_sizes_it_asked_for(self, suite_run: Path) -> None:
        suite = suite_of(suite_run)
        expected = EXPECTED[suite["suite"]]["params"]
        assert {k: suite["params"].get(k) for k in expected} == expected
        argv = json.loads(suite_run.read_text(encoding="utf-8"))["argv"]
        assert argv == ["python", "-m", "benchmarks", *smallest_run(suite["suite"], suite_run)]

    def test_it_records_every_expected_figure(self, suite_run: Path) -> None:
        suite = suite_of(suite_run)
        figures = {f["key"]: f for f in suite["figures"]}
        missing = [k for k in EXPECTED[suite["suite"]]["figures"] if k not in figures]
        assert not missing, f"{suite['suite']} figures missing: {missing}"
        for key in EXPECTED[suite["suite"]]["figures"]:
            assert figures[key]["role"] in (SUBJECT, BASELINE, INFO)
            assert math.isfinite(figures[key]["value"]), key
            assert figures[key]["value"] >= 0, key
        assert any(f["role"] == BASELINE for f in suite["figures"]), "no baseline was measured"

    def test_it_gives_each_subject_its_ratio_to_the_baseline(self, suite_run: Path) -> None:
        suite = suite_of(suite_run)
        figures = {f["key"]: f for f in suite["figures"]}
        for key, base in EXPECTED[suite["suite"]]["ratios"]:
            ratios = {r["baseline"]: r["value"] for r in figures[key]["ratios"]}
            assert base in ratios, f"{key} has no ratio to {base}"
            if figures[base]["value"]:
                assert ratios[base] == pytest.approx(figures[key]["value"] / figures[base]["value"])

    def test_it_checks_its_targets(self, suite_run: Path) -> None:
        suite = suite_of(suite_run)
        assert sorted(t["figure"] for t in suite["targets"]) == sorted(
            EXPECTED[suite["suite"]]["targets"]
        )
        figures = {f["key"]: f["value"] for f in suite["figures"]}
        for target in suite["targets"]:
            value = figures[target["figure"]]
            if target["baseline"]:
                value /= figures[target["baseline"]]
            assert target["value"] == pytest.approx(value), target["name"]
            value, threshold = target["value"], target["threshold"]
            holds = {"<": value < threshold, "<=": value <= threshold, ">=": value >= threshold}
            assert target["met"] is holds[target["op"]], target["name"]

    def test_it_names_the_machine_and_the_library_versions(self, suite_run: Path) -> None:
        machine = json.loads(suite_run.read_text(encoding="utf-8"))["machine"]
        assert machine["cpu_count"] == os.cpu_count()
        assert machine["python"] == platform.python_version()
        for dist in ("pyzmq", "msgspec", "anyio", "tokenyard", "tokenizers", "rich", "matplotlib"):
            assert machine[dist] == importlib.metadata.version(dist), dist
        assert machine["libzmq"]
        assert len(machine["load_average"]) == 3

    def test_plot_draws_each_of_its_charts_as_a_png(self, suite_run: Path, tmp_path: Path) -> None:
        # What ``python -m benchmarks plot FILE --out DIR`` does, in this process (the
        # command line itself is run by the test below).
        suite = suite_of(suite_run)
        out = tmp_path / "img"
        plot_results(read_results(str(suite_run)), str(out))
        charts = EXPECTED[suite["suite"]]["charts"]
        assert [c["name"] for c in suite["charts"]] == charts
        assert sorted(p.name for p in out.iterdir()) == sorted(f"{c}.png" for c in charts)
        for chart in charts:
            assert (out / f"{chart}.png").read_bytes().startswith(PNG_MAGIC)


def test_plot_without_out_draws_into_a_directory_next_to_the_results_file(
    tmp_path: Path,
) -> None:
    results = tmp_path / "run" / "results.json"
    suite = SuiteResult(
        suite="hand-made",
        duration_s=0.0,
        params={},
        figures=[figure("base.throughput", 10.0, BASELINE), figure("ours.throughput", 20.0)],
        charts=[Chart(name="hand-made", title="t", metrics=["throughput"], unit="x/s")],
    )
    write_results(
        str(results),
        Results(started=now_iso(), argv=[], machine=describe_machine(), suites=[suite]),
    )
    done = benchmarks_cli("plot", str(results))
    charts = tmp_path / "run" / "results-charts"
    assert (charts / "hand-made.png").read_bytes().startswith(PNG_MAGIC)
    assert sorted(p.name for p in results.parent.iterdir()) == ["results-charts", "results.json"]
    assert "results-charts" in done.stdout


class TestTheCommandLine:
    """Options parse into what the suites read (no run)."""

    def test_pipeline_worker_counts_always_include_the_one_worker_baseline(self) -> None:
        args = build_parser().parse_args(["pipeline", "--workers", "4,2,2"])
        assert args.worker_counts == (1, 2, 4)

    @pytest.mark.parametrize(
        ("argv", "flag"),
        [
            (["dispatch", "--workers", "0"], "--workers"),
            (["pipeline", "--workers", "1,x"], "--workers"),
            (["all", "--workers", "2"], "--workers"),
            # Each suite's values are checked as the command line is read, not at the
            # suite's turn in `all`, after the suites before it have run.
            (["all", "--losses", "0"], "--losses"),
            (["all", "--dispatch-workers", "33"], "--dispatch-workers"),
            (["mailbox", "--messages", "-1"], "--messages"),
            (["all", "--rounds", "0"], "--rounds"),
            (["serve", "--duration", "0"], "--duration"),
            (["serve", "--duration", "-1"], "--duration"),
            (["engines", "--duration", "nan"], "--duration"),
            (["all", "--duration", "inf"], "--duration"),
            (["multihost", "--heartbeats", "0"], "expected seconds above 0"),
            (["multihost", "--heartbeats", "1,x"], "expected seconds above 0"),
            # serve and engines run each variant once, for --duration: --rounds would
            # be ignored.
            (["serve", "--rounds", "2"], "--rounds"),
            (["engines", "--rounds", "2"], "--rounds"),
        ],
        ids=[
            "zero workers",
            "not a count",
            "ambiguous in all",
            "zero losses in all",
            "more dispatch workers than requests in all",
            "negative messages",
            "zero rounds",
            "zero seconds",
            "negative seconds",
            "nan seconds",
            "endless in all",
            "zero heartbeat",
            "a heartbeat not a number",
            "rounds of serve",
            "rounds of engines",
        ],
    )
    def test_a_bad_option_is_refused_before_anything_runs(
        self, argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert flag in err
        assert "invalid" not in err  # the type's own message, not argparse's "invalid x value"

    def test_all_takes_rounds_for_the_suites_that_do(self) -> None:
        assert build_parser().parse_args(["all", "--rounds", "1"]).rounds == 1

    def test_all_says_what_a_shared_option_means_to_each_suite(self) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks", "all", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100"),
            check=True,
        )
        text = " ".join(done.stdout.split())
        assert "pipeline: closed-loop clients" in text
        assert "serve: streaming clients (quick 32, full 64)" in text
        assert "engines: streaming clients (quick 8, full 16)" in text
        assert "under a minute" not in text


class FakeSuites:
    """Every suite of the CLI with its ``run`` replaced: it records the arguments it was
    given and the output printed so far, reports one step, and returns one figure, or
    raises what ``fail`` holds for it. Nothing is measured."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
        self.seen: dict[str, argparse.Namespace] = {}
        self.printed: dict[str, str] = {}
        self.fail: dict[str, BaseException] = {}
        self._capsys = capsys
        for name, suite in list(SUITES.items()):
            run = functools.partial(self._run, name)
            monkeypatch.setitem(SUITES, name, dataclasses.replace(suite, run=run))
        # The multihost suite needs root; as nothing is measured, any user will do.
        monkeypatch.setattr(os, "geteuid", lambda: 0)

    def _run(self, name: str, args: argparse.Namespace, progress: Progress) -> SuiteResult:
        self.seen[name] = args
        progress.begin(1)
        progress.step(f"{name}'s only variant")
        out, err = self._capsys.readouterr()
        self.printed[name] = out
        sys.stdout.write(out)  # kept for the test's own readouterr
        sys.stderr.write(err)
        if name in self.fail:
            raise self.fail[name]
        progress.advance()
        fig = figure(f"{name}.throughput", 1.0)
        return SuiteResult(suite=name, duration_s=0.0, params={}, figures=[fig])


@pytest.fixture
def fake_suites(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> FakeSuites:
    """`FakeSuites`, for a test that runs the CLI's ``main`` in this process."""
    return FakeSuites(monkeypatch, capsys)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """``python -m benchmarks`` in this process: its exit status, stdout and stderr (the
    SIGTERM handler it installs is removed afterwards)."""
    previous = signal.getsignal(signal.SIGTERM)

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli_main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    try:
        yield run
    finally:
        signal.signal(signal.SIGTERM, previous)


class TestAll:
    """``python -m benchmarks all`` and a suite's command, with suites that measure nothing."""

    def test_each_suite_gets_its_own_options_and_no_other_suites(
        self, fake_suites: FakeSuites, cli: Callable[..., tuple[int, str, str]]
    ) -> None:
        code, _, _ = cli(
            "all", "--dispatch-workers", "8", "--serve-workers", "4", "--pipeline-workers", "2",
            "--worker-counts", "3", "--steps", "5", "--concurrency", "7",
        )  # fmt: skip
        assert code == 0
        seen = fake_suites.seen
        assert list(seen) == list(SUITES)
        assert (seen["dispatch"].workers, seen["dispatch"].steps) == (8, 5)
        assert seen["serve"].workers == (1, 4)
        assert seen["pipeline"].worker_counts == (1, 2)
        assert seen["engines"].worker_counts == (3,)
        assert [seen[n].concurrency for n in ("pipeline", "serve", "engines")] == [7, 7, 7]
        assert not hasattr(seen["dispatch"], "worker_counts")
        assert not hasattr(seen["mailbox"], "workers")

    def test_one_suites_workers_never_reach_another_suite(
        self, fake_suites: FakeSuites, cli: Callable[..., tuple[int, str, str]]
    ) -> None:
        assert cli("all", "--serve-workers", "1,2", "--pipeline-workers", "4")[0] == 0
        seen = fake_suites.seen
        assert (seen["dispatch"].workers, seen["serve"].workers) == (None, (1, 2))
        assert (seen["pipeline"].worker_counts, seen["engines"].worker_counts) == ((1, 4), None)

    @pytest.mark.parametrize(
        ("failure", "status"),
        [(BenchmarkError("a driver exited with status 1"), 2), (KeyboardInterrupt(), 130)],
        ids=["a suite fails", "ctrl-c"],
    )
    def test_the_suites_measured_before_a_failure_are_kept_in_json(
        self,
        fake_suites: FakeSuites,
        cli: Callable[..., tuple[int, str, str]],
        tmp_path: Path,
        failure: BaseException,
        status: int,
    ) -> None:
        names = list(SUITES)
        fake_suites.fail[names[2]] = failure
        results = tmp_path / "results.json"
        code, out, _ = cli("all", "--json", str(results))
        assert code == status
        assert [s.suite for s in read_results(str(results)).suites] == names[:2]
        assert str(results) in out

    def test_a_suite_that_cannot_run_here_stops_all_before_the_first_suite(
        self,
        fake_suites: FakeSuites,
        cli: Callable[..., tuple[int, str, str]],
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
    ) -> None:
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        code, _, err = cli("all", "--json", str(tmp_path / "results.json"))
        assert code == 2
        assert fake_suites.seen == {}
        assert "multihost" in err
        assert "root" in err
        assert "Traceback" not in err
        assert list(tmp_path.iterdir()) == []

    # Before, each failed at its suite's turn, after the suites ahead of it had run: a long
    # TMPDIR with libzmq's "longer than 107 characters", a bad --before at profile's.
    @pytest.mark.parametrize(
        ("argv", "said"),
        [
            (["all"], "set TMPDIR"),
            (["all", "--before", "no-such-revision"], "--before no-such-revision"),
            (["all", "--before", "0" * 40], "git knows no commit"),
            (["all", "--before", "HEAD:docs"], "git knows no commit"),
        ],
        ids=["temporary directory too long", "unknown revision", "absent commit", "a tree"],
    )
    def test_a_problem_found_first_stops_all_before_the_first_suite_in_one_line(
        self,
        fake_suites: FakeSuites,
        cli: Callable[..., tuple[int, str, str]],
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        argv: list[str],
        said: str,
    ) -> None:
        if said == "set TMPDIR":
            long = tmp_path / ("d" * 100)
            long.mkdir()
            monkeypatch.setattr(tempfile, "tempdir", str(long))
        code, _, err = cli(*argv)
        assert code == 2
        assert fake_suites.seen == {}
        assert said in err
        assert len(err.splitlines()) == 1

    def test_a_before_revision_of_this_repository_runs(
        self, fake_suites: FakeSuites, cli: Callable[..., tuple[int, str, str]]
    ) -> None:
        code, _, err = cli("profile", "--before", "HEAD")
        assert (code, err) == (0, "")
        assert fake_suites.seen["profile"].before == "HEAD"

    @pytest.mark.parametrize("where", ["a file", "a directory"])
    def test_an_unwritable_json_path_is_refused_before_anything_runs(
        self,
        fake_suites: FakeSuites,
        cli: Callable[..., tuple[int, str, str]],
        tmp_path: Path,
        where: str,
    ) -> None:
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "results.json" if where == "a file" else tmp_path
        code, _, err = cli("detokenize", "--json", str(path))
        assert code == 2
        assert fake_suites.seen == {}
        assert len(err.splitlines()) == 1
        assert str(path) in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]

    def test_piped_output_shows_each_step_as_it_starts(
        self, fake_suites: FakeSuites, cli: Callable[..., tuple[int, str, str]]
    ) -> None:
        assert cli("mailbox")[0] == 0
        # printed by the time the suite's first step ran, not when the run ended
        assert fake_suites.printed["mailbox"].splitlines() == [
            "mailbox: started",
            "mailbox [1/1]: mailbox's only variant",
        ]


class TestPlotErrors:
    """``plot`` on what is not a results file, or into what is not a directory: one line."""

    @pytest.mark.parametrize(
        ("content", "says"),
        [
            (None, "No such file"),
            (b"{not json", "not a results file"),
            (b"", "not a results file"),
            (b'{"a": 1}', "not a results file"),
            ("directory", "Is a directory"),
        ],
        ids=["missing", "malformed", "empty", "another shape", "a directory"],
    )
    def test_a_file_that_is_not_a_results_file(
        self,
        cli: Callable[..., tuple[int, str, str]],
        tmp_path: Path,
        content: bytes | str | None,
        says: str,
    ) -> None:
        path = tmp_path / "results.json"
        if content == "directory":
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        code, _, err = cli("plot", str(path))
        assert code == 2
        assert len(err.splitlines()) == 1, err
        assert str(path) in err
        assert says in err

    def test_out_that_is_a_file(
        self, cli: Callable[..., tuple[int, str, str]], tmp_path: Path
    ) -> None:
        results = tmp_path / "results.json"
        write_results(
            str(results),
            Results(started=now_iso(), argv=[], machine=describe_machine(), suites=[]),
        )
        code, _, err = cli("plot", str(results), "--out", str(results))
        assert code == 2
        assert len(err.splitlines()) == 1, err
        assert "not a directory" in err


#: A suite whose run is asyncio clients, as the serve and engines suites' load generator
#: is, one of which gets a SIGTERM while it runs.
SIGTERM_IN_A_TASK = """
import asyncio, os, signal, sys
import anyio
from benchmarks import _cli
from benchmarks._suite import Suite

async def client(i):
    while True:
        await asyncio.sleep(0)  # sync-ok: a turn of the loop, as a busy client takes
        if i == 3 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

async def load():
    async with asyncio.TaskGroup() as tg:
        for i in range(8):
            tg.create_task(client(i))

def run(args, progress):
    anyio.run(load)
    raise AssertionError("the load was not interrupted")

sent = []
_cli.SUITES["load"] = Suite(name="load", help="clients in tasks", run=run)
sys.exit(_cli.main(["load"]))
"""


class TestSignals:
    """SIGTERM and Ctrl-C end a run cleanly: its processes and directories gone, no
    traceback; SIGKILL leaves no server behind."""

    # SIGINT ignored: how a script's background job (`make bench &`) or `nohup` starts,
    # where no runner handles SIGINT, and SIGTERM raised in a task was logged as its error.
    @pytest.mark.parametrize("sigint", ["default", "ignored"])
    def test_sigterm_while_asyncio_tasks_run_cancels_them_without_a_traceback(
        self, sigint: str
    ) -> None:
        handler = "signal.SIG_IGN" if sigint == "ignored" else "signal.default_int_handler"
        setup = f"import signal; signal.signal(signal.SIGINT, {handler})\n"
        done = subprocess.run(
            [sys.executable, "-c", setup + SIGTERM_IN_A_TASK],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            check=False,
        )
        assert done.returncode == 130, done.stderr
        assert "interrupted" in done.stdout
        assert done.stderr == ""  # not "Task exception was never retrieved"

    @pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
    def test_dispatch_on_its_own_is_interrupted_as_the_cli_is(
        self, signum: int, short_tmp_path: Path
    ) -> None:
        # Its temporary directories in a directory of the test's own: another run's, in
        # the shared one, are not this test's to judge or remove.
        # Ctrl-C as a terminal sends it, to a process that takes it (this one's may not:
        # a background job of a script starts with SIGINT ignored, and its children too).
        main = (
            "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
            " sys.argv[1:] = ['--steps', '1000000', '--rounds', '1'];"
            " runpy.run_module('benchmarks.dispatch', run_name='__main__', alter_sys=True)"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", main],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(short_tmp_path)),
        )
        try:
            assert proc.stdout is not None
            first = next(iter(dispatch.LABELS.values()))
            for line in proc.stdout:  # until the first variant is being measured
                if first in line:
                    break
            proc.send_signal(signum)
            out = proc.communicate(timeout=60)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        left = list(short_tmp_path.iterdir())
        assert proc.returncode == 130, out
        assert "interrupted" in out
        assert "Traceback" not in out
        assert not left, f"left behind: {sorted(map(str, left))}"

    @pytest.mark.timeout(120)
    def test_the_engines_suites_server_ends_when_the_suite_is_sigkilled(self) -> None:
        # The suite's parent process, cut down to starting tokenyard's server as the
        # engines suite does (benchmarks._frontend), on the stand-in engine.
        script = (
            "import sys\n"
            "from benchmarks._frontend import START_TIMEOUT, read_line, running,"
            " tokenyard_serve_command\n"
            "with running(tokenyard_serve_command(1, []), 'serve') as proc:\n"
            "    read_line(proc, 'serving ', START_TIMEOUT, 'serve')\n"
            "    print(proc.pid, flush=True)\n"
            "    sys.stdin.read()\n"
        )
        parent = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        server: list[int] = []
        try:
            assert parent.stdout is not None
            server = [int(parent.stdout.readline())]
            server += descendants(server[0])
            parent.kill()
            parent.communicate()
            deadline = time.monotonic() + 30
            alive = [
                p for p in server if not exits_within(p, max(0.0, deadline - time.monotonic()))
            ]
        finally:
            if parent.poll() is None:
                parent.kill()
            parent.communicate()
            for pid in server:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        assert len(server) > 1  # the server and its actor processes
        assert not alive, f"still running after the suite's SIGKILL: {alive}"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, now."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *descendants(child)]
    return found


# -- the pure parts, on hand-made figures -----------------------------------------------------


def figure(key: str, value: float, role: str = SUBJECT) -> Figure:
    return Figure(key=key, variant=key, payload="", metric=key.rsplit(".", 1)[-1], value=value,
                  unit="", role=role)  # fmt: skip


def ratios_of(fig: Figure) -> dict[str, float]:
    return {r.baseline: r.value for r in fig.ratios}


class TestSummarise:
    """Each suite's ``summarise`` attaches ratios and checks targets, met or missed."""

    def test_mailbox_ratios_and_a_missed_tell_target(self) -> None:
        figs = [
            figure("floor.small.throughput", 1000.0, BASELINE),
            figure("pyobj.small.throughput", 50.0, BASELINE),
            figure("tell.small.throughput", 400.0),  # 0.4x floor: misses the 0.5x goal
            figure("ask.small.p50", 120.0),  # under 150 us: met
        ]
        _, targets = mailbox.summarise(figs)
        tell = figs[2]
        assert ratios_of(tell) == {
            "floor.small.throughput": pytest.approx(0.4),
            "pyobj.small.throughput": pytest.approx(8.0),
        }
        by_figure = {t.figure: t for t in targets}
        assert set(by_figure) == {"tell.small.throughput", "ask.small.p50"}  # batch: not run
        assert not by_figure["tell.small.throughput"].met
        assert by_figure["tell.small.throughput"].value == pytest.approx(0.4)
        assert by_figure["ask.small.p50"].met

    def test_serve_holds_tracing_a_passed_context_and_slow_clients_to_serve_alone(self) -> None:
        figs = [
            figure("serve2.requests_per_s", 1000.0),
            figure("serve2traced.requests_per_s", 750.0, INFO),
            figure("serve2context.requests_per_s", 980.0, INFO),
            figure("serve2.e2e_p99", 20.0),
            figure("serve2slow.e2e_p99", 30.0, INFO),
        ]
        serve.summarise(figs)
        traced, context, slow = figs[1], figs[2], figs[4]
        assert ratios_of(traced) == {"serve2.requests_per_s": pytest.approx(0.75)}
        assert ratios_of(context) == {"serve2.requests_per_s": pytest.approx(0.98)}
        assert ratios_of(slow) == {"serve2.e2e_p99": pytest.approx(1.5)}
        labels = [r.label for r in traced.ratios + context.ratios + slow.ratios]
        assert labels == ["tracing off", "no context", "no slow clients"]

    def test_serve_measures_slow_clients_held_at_two_workers(self) -> None:
        (slow,) = [v for v in serve.variants([1, 2]) if v.slow_clients]
        assert (slow.key, slow.workers, slow.slow_clients) == ("serve2slow", 2, 1000)
        assert not [v for v in serve.variants([1]) if v.slow_clients]

    def test_serve_reads_inter_token_latency_with_one_client_against_its_baseline(self) -> None:
        ones = [v for v in serve.variants([1, 2]) if v.clients]
        assert [(v.key, v.workers, v.clients) for v in ones] == [
            ("serve2c1", 2, 1),
            ("baseline2c1", 2, 1),
        ]
        assert not [v for v in serve.variants([1]) if v.clients]
        figs = [
            figure("serve2.itl_p50", 3.0),  # 32 clients: a share of the throughput
            figure("serve2c1.itl_p50", 0.3),
            figure("baseline2c1.itl_p50", 0.6, BASELINE),
        ]
        _, targets = serve.summarise(figs)
        assert ratios_of(figs[1]) == {"baseline2c1.itl_p50": pytest.approx(0.5)}
        (itl,) = [t for t in targets if "inter-token" in t.name]
        assert (itl.figure, itl.met, itl.value) == ("serve2c1.itl_p50", True, 0.3)

    def test_engines_read_each_tokenyard_variant_against_its_own_baseline(self) -> None:
        variants = engines.llamacpp_variants([1, 2]) + engines.vllm_variants([2])
        figs = [
            figure("llamacpp.cpu_front_end_us", 400.0, BASELINE),
            figure("tokenyard1.cpu_front_end_us", 100.0),  # 0.25x: met
            figure("tokenyard2.cpu_front_end_us", 300.0),  # 2 workers against 1 process
            figure("vllm_api2.requests_per_s", 50.0, BASELINE),
            figure("tokenyard_vllm2.requests_per_s", 40.0),  # 0.8x: missed
            figure("tokenyard_vllm_scheduler2.requests_per_s", 60.0),  # for information
        ]
        _, targets = engines.summarise(figs, variants)
        assert ratios_of(figs[2]) == {"llamacpp.cpu_front_end_us": pytest.approx(0.75)}
        assert ratios_of(figs[4]) == {"vllm_api2.requests_per_s": pytest.approx(0.8)}
        assert ratios_of(figs[5]) == {"vllm_api2.requests_per_s": pytest.approx(1.2)}
        # Targets only at the same number of front-end processes (not tokenyard2's), and
        # not of the scheduler path on vLLM.
        assert {t.figure: t.met for t in targets} == {
            "tokenyard1.cpu_front_end_us": True,
            "tokenyard_vllm2.requests_per_s": False,
        }

    def test_engines_skip_vllm_saying_why_when_its_venv_is_missing(self, tmp_path: Path) -> None:
        problem = vllm_missing(tmp_path / "no-venv" / "bin" / "python")
        assert problem is not None
        assert "skipped" in problem
        assert "--vllm-python" in problem

    def test_dispatch_ratios_and_a_missed_five_times_target(self) -> None:
        figs = [
            figure("sglang.throughput", 100.0, BASELINE),
            figure("raw.throughput", 600.0),
            figure("actors.throughput", 300.0),  # 3x: misses the 5x goal
            figure("cpu_sglang.throughput", 200.0, INFO),
            figure("cpu_raw.throughput", 900.0, INFO),
        ]
        targets = dispatch.summarise(figs)
        assert ratios_of(figs[1]) == {"sglang.throughput": pytest.approx(6.0)}
        assert ratios_of(figs[4]) == {"cpu_sglang.throughput": pytest.approx(4.5)}
        assert {t.figure: t.met for t in targets} == {
            "raw.throughput": True,
            "actors.throughput": False,
        }

    def test_supervision_ratios_to_polling_and_a_missed_restart_goal(self) -> None:
        values = {"caller": (4.0, 120.0), "process": (8.0, 400.0), "polling": (250.0, 500.0)}
        figs = [
            figure(f"{loop}.{series}.{metric}", value, BASELINE if loop == "polling" else SUBJECT)
            for loop, (down, ready) in values.items()
            for series, value in (("down", down), ("ready", ready))
            for metric in ("p50", "max")
        ]
        targets = supervision.summarise(figs)
        by_key = {f.key: f for f in figs}
        assert ratios_of(by_key["caller.down.p50"]) == {"polling.down.p50": pytest.approx(0.016)}
        assert ratios_of(by_key["process.ready.max"]) == {"polling.ready.max": pytest.approx(0.8)}
        assert {t.figure: t.met for t in targets} == {
            "caller.down.p50": True,
            "caller.ready.p50": True,
            "process.down.p50": True,
            "process.ready.p50": False,  # 400 ms: over the 300 ms goal
        }

    def test_supervision_holds_fork_server_loops_to_their_fresh_twins_and_40_ms(self) -> None:
        values = {
            "caller_fork": (4.0, 30.0),
            "caller": (4.0, 120.0),
            "process_fork": (8.0, 50.0),
            "process": (8.0, 200.0),
            "polling": (250.0, 500.0),
        }
        figs = [
            figure(f"{loop}.{series}.{metric}", value, BASELINE if loop == "polling" else SUBJECT)
            for loop, (down, ready) in values.items()
            for series, value in (("down", down), ("ready", ready))
            for metric in ("p50", "max")
        ]
        figs += [
            figure("pipeline_fork.restart.p50", 20.0),
            figure("pipeline_spawn.restart.p50", 200.0, BASELINE),
        ]
        targets = supervision.summarise(figs)
        by_key = {f.key: f for f in figs}
        assert ratios_of(by_key["caller_fork.ready.p50"]) == {
            "polling.ready.p50": pytest.approx(0.06),
            "caller.ready.p50": pytest.approx(0.25),
        }
        assert ratios_of(by_key["pipeline_fork.restart.p50"]) == {
            "pipeline_spawn.restart.p50": pytest.approx(0.1)
        }
        forty = {t.figure: t.met for t in targets if t.threshold == 40.0}
        assert forty == {"caller_fork.ready.p50": True, "process_fork.ready.p50": False}

    def test_spawn_targets_the_concurrent_fork_server_wall_and_a_forked_actors_uss(self) -> None:
        targets = spawn.summarise([figure("spawn.concurrent.wall", 0.25), figure("actor.uss", 7.5)])
        assert {t.figure: t.met for t in targets} == {
            "spawn.concurrent.wall": True,
            "actor.uss": False,
        }

    def test_spawn_ratios_against_fresh_interpreters_and_bare_python(self) -> None:
        figs = [
            figure("spawn.sequential.wall", 3.0),
            figure("floor.sequential.wall", 2.0, BASELINE),
            figure("spawn.concurrent.wall", 1.5),
            figure("actor.rss", 40.0),
            figure("bare.rss", 10.0, BASELINE),
        ]
        spawn.summarise(figs)
        assert ratios_of(figs[0]) == {"floor.sequential.wall": pytest.approx(1.5)}
        # No concurrent floor was measured: only the ratio to the sequential spawn.
        assert ratios_of(figs[2]) == {"spawn.sequential.wall": pytest.approx(0.5)}
        assert ratios_of(figs[3]) == {"bare.rss": pytest.approx(4.0)}

    def test_pipeline_throughput_is_read_against_one_worker(self) -> None:
        def report(workers: int, throughput: float) -> pipeline.Report:
            latency = Latency(p50_us=1000.0, p99_us=2000.0, mean_us=1200.0, min_us=900.0, n=10)
            return pipeline.Report(
                workers=workers, throughput=[throughput / 2, throughput], latency=[latency] * 2,
                cpu_us=[], batch=[], encode_us=10.0, decode_us=20.0, prompt_tokens=8.0,
                completion_tokens=24.0, startup_s=1.0,
            )  # fmt: skip

        figs = {f.key: f for f in pipeline.figures_of([report(1, 100.0), report(2, 150.0)], 4)}
        assert figs["w1.throughput"].role == BASELINE
        assert figs["w1.throughput"].ratios == []
        assert ratios_of(figs["w2.throughput"]) == {"w1.throughput": pytest.approx(1.5)}
        assert figs["w2.throughput"].value == 150.0  # the best round

    def test_a_short_request_behind_a_long_prompt_is_read_against_it_alone(self) -> None:
        latency = Latency(p50_us=1000.0, p99_us=2000.0, mean_us=1200.0, min_us=900.0, n=10)
        report = pipeline.Report(
            workers=1, throughput=[100.0], latency=[latency], cpu_us=[], batch=[],
            encode_us=10.0, decode_us=20.0, prompt_tokens=8.0, completion_tokens=24.0,
            startup_s=1.0, short_alone_us=[900.0, 1000.0, 3000.0],
            short_behind_long_us=[500_000.0, 6000.0, 4000.0],
        )  # fmt: skip
        figs = {f.key: f for f in pipeline.figures_of([report], 4)}
        assert figs["w1.short_alone"].role == BASELINE
        assert figs["w1.short_alone"].value == 1.0  # the median, in ms
        assert figs["w1.short_behind_long"].value == 6.0
        assert ratios_of(figs["w1.short_behind_long"]) == {"w1.short_alone": pytest.approx(6.0)}


class TestTheDispatchBaseline:
    """SGLang's way must pay for every field SGLang's batch has, as tokenyard's does."""

    def test_its_dataclass_has_every_field_of_the_batch_but_the_typed_origins(self) -> None:
        ours = set(BatchTokenIDOutput.__struct_fields__) - {"origins"}
        assert {f.name for f in dataclasses.fields(dispatch.StepObj)} == ours

    def test_its_per_request_copy_keeps_each_requests_entry_of_every_field(self) -> None:
        step = dispatch.make_step(3)
        obj = dispatch.as_obj(step)
        for i in range(len(step.rids)):
            one = dispatch.request_at(obj, i)
            expected = step.select([i])
            for name in ours_per_request():
                assert getattr(one, name) == getattr(expected, name), name


def ours_per_request() -> list[str]:
    """The per-request fields SGLang's 0.5.3 split copies (it drops the placeholders)."""
    skip = {"origins", "placeholder_tokens_idx", "placeholder_tokens_val"}
    return [n for n in BatchTokenIDOutput.__struct_fields__ if n not in skip]
