"""What ``serve`` reads of the ``vllm serve`` arguments it passes on (those after ``--``).

vLLM's parser takes ``--max_model_len`` for ``--max-model-len`` (its long names with
underscores), ``--name=value`` as well as ``--name value``, the last of a repeated
argument, and human-readable numbers (``1k`` is 1000, ``1K`` 1024; ``auto`` or ``-1``: the
model's own length). These are read the same way here: the HTTP layer's context is the
engine's as long as the command line says it, and an argument that would undo what
tokenyard sets itself (`actors._vllm_engine.engine_command`) is refused before anything
starts.
"""

from __future__ import annotations

import re

__all__ = ("max_model_len", "overridden")

#: The arguments `engine_command` gives vLLM, with their short aliases: another value
#: would leave the engine unreachable (not headless, another address or port, several
#: engines or API servers, a tokenizer of its own).
_SET_BY_TOKENYARD = {
    "--headless": "--headless",
    "--skip-tokenizer-init": "--skip-tokenizer-init",
    "--no-skip-tokenizer-init": "--skip-tokenizer-init",
    "--data-parallel-address": "--data-parallel-address",
    "-dpa": "--data-parallel-address",
    "--data-parallel-rpc-port": "--data-parallel-rpc-port",
    "-dpp": "--data-parallel-rpc-port",
    "--data-parallel-size": "--data-parallel-size",
    "-dp": "--data-parallel-size",
    "--api-server-count": "--api-server-count",
    "-asc": "--api-server-count",
}

_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _name(arg: str) -> str:
    """An argument's name as vLLM's parser reads it: before ``=``, underscores of a long
    name as dashes."""
    name = arg.partition("=")[0]
    return name.replace("_", "-") if name.startswith("--") else name


def overridden(args: list[str]) -> str | None:
    """Why ``args`` cannot be given to a launched engine (one that tokenyard sets
    itself is among them), or ``None``."""
    for arg in args:
        if arg == "--":
            break
        given = _SET_BY_TOKENYARD.get(_name(arg))
        if given is not None:
            return (
                f"vLLM argument {arg.partition('=')[0]}: serve sets {given} itself for the "
                "engine it launches (headless, dialling the scheduler, one engine, no "
                "tokenizer of its own); leave it out"
            )
    return None


def _length(value: str) -> int | None:
    """A ``--max-model-len`` value as vLLM reads it (``None``: ``auto``, the model's own).

    Raises:
        ValueError: vLLM would refuse it.
    """
    text = value.strip()
    if text == "-1" or text.lower() == "auto":
        return None
    match = _HUMAN.fullmatch(text)
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    return int(number) * _BINARY[suffix]  # a decimal with a binary suffix: ValueError


def max_model_len(args: list[str]) -> int | None:
    """The engine's context as ``args`` set it (``--max-model-len``, the last one given),
    or ``None`` when they leave it to the model (none given, or ``auto``).

    Raises:
        ValueError: Its value is one vLLM does not take, or it has none; the message
            says which.
    """
    found: int | None = None
    for k, arg in enumerate(args):
        if arg == "--":
            break
        if _name(arg) != "--max-model-len":
            continue
        if "=" in arg:
            value = arg.partition("=")[2]
        elif k + 1 < len(args):
            value = args[k + 1]
        else:
            raise ValueError(f"vLLM argument {arg} has no value: give a length, 1k, or auto")
        try:
            found = _length(value)
        except ValueError:
            raise ValueError(
                f"vLLM argument {arg.partition('=')[0]} {value!r}: not a length vLLM takes "
                "(a number of tokens, 1k for 1000, 1K for 1024, or auto)"
            ) from None
        if found is not None and found < 2:
            raise ValueError(
                f"vLLM argument {arg.partition('=')[0]} {value!r}: a context holds a prompt "
                "token and a generated one at the least (give at least 2)"
            )
    return found
