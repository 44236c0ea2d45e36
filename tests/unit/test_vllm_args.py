"""`actors._vllm_args`: the ``vllm serve`` arguments serve reads as vLLM's parser does."""

from __future__ import annotations

import pytest

from actors._vllm_args import max_model_len, overridden


class TestMaxModelLen:
    @pytest.mark.parametrize(
        ("args", "length"),
        [
            ([], None),
            (["--max-model-len", "512"], 512),
            (["--max-model-len=512"], 512),
            (["--max_model_len", "512"], 512),
            (["--max_model_len=2048"], 2048),
            (["--max-model-len", "1k"], 1000),
            (["--max-model-len", "1K"], 1024),
            (["--max-model-len", "25.6k"], 25600),
            (["--max-model-len", " 300 "], 300),
            (["--max-model-len", "auto"], None),
            (["--max-model-len", "AUTO"], None),
            (["--max-model-len", "-1"], None),
            (["--max-model-len", "512", "--max-model-len", "1k"], 1000),  # the last wins
            (["--max-model-len", "512", "--max_model_len=auto"], None),
            (["--dtype", "bfloat16", "--max-model-len", "64", "--enforce-eager"], 64),
        ],
    )
    def test_reads_every_spelling_vllm_takes(self, args: list[str], length: int | None) -> None:
        assert max_model_len(args) == length

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--max-model-len", "lots"], "not a length vLLM takes"),
            (["--max-model-len", "1.5K"], "not a length vLLM takes"),
            (["--max-model-len="], "not a length vLLM takes"),
            (["--max-model-len"], "has no value"),
            (["--max-model-len", "1"], "at least 2"),
        ],
    )
    def test_refuses_what_vllm_would_not_take_saying_which(
        self, args: list[str], message: str
    ) -> None:
        with pytest.raises(ValueError, match=message):
            max_model_len(args)


class TestOverridden:
    @pytest.mark.parametrize(
        "arg",
        [
            "--headless",
            "--skip-tokenizer-init",
            "--skip_tokenizer_init",
            "--no-skip-tokenizer-init",
            "--data-parallel-address",
            "--data_parallel_address=10.0.0.1",
            "-dpa",
            "--data-parallel-rpc-port=1234",
            "-dpp",
            "--data-parallel-size",
            "--data_parallel_size=2",
            "-dp",
            "-dp=2",
            "--api-server-count",
            "--api_server_count=2",
            "-asc",
        ],
    )
    def test_refuses_what_tokenyard_sets_itself_in_every_spelling(self, arg: str) -> None:
        problem = overridden(["--dtype", "bfloat16", arg, "2"])
        assert problem is not None
        assert "sets" in problem

    def test_takes_the_others(self) -> None:
        args = ["--load-format", "dummy", "--max-model-len", "512", "--data-parallel-backend"]
        assert overridden(args) is None
