"""The two command lines, ``python -m actors`` and ``python -m runtime``, as a new user first
meets them: ``--help`` names every command and how to get its own help."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=30, check=False
    )


class TestActorsHelp:
    def test_it_names_the_main_job_and_serve_and_how_to_get_each_ones_help(self) -> None:
        done = run("-m", "actors", "--help")
        assert done.returncode == 0, done.stderr
        usage = done.stdout.split("\n\n")[0]
        assert "python -m actors [options]" in usage
        assert "python -m actors serve [options]" in usage
        assert "python -m actors --help" in done.stdout
        assert "python -m actors serve --help" in done.stdout
        assert "python -m actors make-model DIR" in usage
        assert "python -m actors make-model --help" in done.stdout
        assert "--requests" in done.stdout  # the main job's own options

    def test_a_bad_option_exits_2_with_both_usages(self) -> None:
        done = run("-m", "actors", "--no-such-option")
        assert done.returncode == 2
        assert "python -m actors serve [options]" in done.stderr
        assert "unrecognized arguments: --no-such-option" in done.stderr

    def test_without_rich_the_main_job_says_serve_needs_only_the_serve_extra(self) -> None:
        # What `pip install 'tokenyard[serve]'` gives: no rich.
        script = (
            "import runpy, sys; sys.modules['rich'] = None; sys.argv = ['actors', '--help'];"
            " runpy.run_module('actors', run_name='__main__')"
        )
        done = run("-c", script)
        assert done.returncode == 1
        assert "pip install 'tokenyard[bench]'" in done.stderr
        assert "python -m actors serve, the server, needs only the serve extra" in done.stderr

    def test_without_tokenizers_the_pipeline_names_the_extra_to_install(self) -> None:
        # What `pip install -e .` gives: the runtime alone.
        done = run("-c", "import sys; sys.modules['tokenizers'] = None; import actors")
        assert done.returncode == 1
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: the pipeline needs Hugging Face tokenizers")
        assert "pip install -e '.[pipeline]'" in last

    def test_the_usage_names_every_command(self) -> None:
        done = run("-m", "actors", "--help")
        assert done.returncode == 0
        for command in ("serve", "load --url URL", "make-model DIR", "make-hf-model DIR"):
            assert f"python -m actors {command}" in done.stdout

    def test_make_models_own_help_names_what_it_writes(self) -> None:
        done = run("-m", "actors", "make-model", "--help")
        assert done.returncode == 0, done.stderr
        assert "usage: python -m actors make-model" in done.stdout
        assert "DIR/model.gguf" in done.stdout


class TestRuntimeHelp:
    @pytest.mark.parametrize("flag", ["--help", "-h"])
    def test_help_prints_the_usage_and_both_commands_and_exits_0(self, flag: str) -> None:
        done = run("-m", "runtime", flag)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: python -m runtime {top,node} [options]\n")
        assert "python -m runtime top --help" in done.stdout
        assert "python -m runtime node --help" in done.stdout
        assert done.stderr == ""

    @pytest.mark.parametrize(
        ("args", "problem"),
        [(["frobnicate"], "unknown command 'frobnicate'"), ([], "a command is required")],
    )
    def test_an_unknown_command_or_none_exits_2_with_the_usage(
        self, args: list[str], problem: str
    ) -> None:
        done = run("-m", "runtime", *args)
        assert done.returncode == 2
        assert done.stdout == ""
        assert done.stderr.startswith("usage: python -m runtime {top,node} [options]\n")
        assert done.stderr.rstrip().endswith(f"python -m runtime: error: {problem}")

    def test_each_commands_own_help_exits_0(self) -> None:
        for command in ("top", "node"):
            done = run("-m", "runtime", command, "--help")
            assert done.returncode == 0, done.stderr
            assert f"usage: python -m runtime {command}" in done.stdout
