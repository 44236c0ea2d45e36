"""Loading a Hugging Face ``tokenizer.json``: the bundled default or one the user names."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    from tokenizers import Tokenizer
except ImportError as err:  # the `pipeline` (or `serve`) extra
    raise ImportError(
        f"the pipeline needs Hugging Face tokenizers ({err}); install it with: "
        "pip install 'tokenyard[pipeline]' (in a checkout: pip install -e '.[pipeline]')"
    ) from err

if TYPE_CHECKING:
    import os

__all__ = (
    "BOS_TOKEN",
    "BUNDLED_MODEL_ID",
    "DEFAULT_TOKENIZER_PATH",
    "EOS_TOKEN",
    "EOS_TOKEN_CANDIDATES",
    "INLINE_CHARS",
    "PAD_TOKEN",
    "TOKENIZER_THREADS",
    "decode_ids",
    "encode_ids",
    "eos_token_id",
    "load_tokenizer",
    "model_id_of",
    "tokenizer_option_error",
)

# "token" as in vocabulary entry, not credential: hence the S105 (hardcoded password) waivers.
BOS_TOKEN = "<|bos|>"  # noqa: S105
"""Beginning-of-sequence token of the bundled tokenizer."""

EOS_TOKEN = "<|eos|>"  # noqa: S105
"""End-of-sequence token of the bundled tokenizer."""

PAD_TOKEN = "<|pad|>"  # noqa: S105
"""Padding token of the bundled tokenizer."""

DEFAULT_TOKENIZER_PATH = Path(__file__).parent / "data" / "tokenizer.json"
"""The byte-level BPE tokenizer shipped in the wheel, built by ``actors.build_tokenizer``."""

BUNDLED_MODEL_ID = "tokenyard-bundled-bpe"
"""The model id of the bundled tokenizer."""

INLINE_CHARS = 2048
"""Texts up to this many characters are tokenized on the event loop (a millisecond or two
at most); longer ones in a thread (through `encode_ids`, which lets go of the GIL while it
works), so that no prompt holds the event loop, and with it every other request of the
process."""

TOKENIZER_THREADS = 2
"""Threads of one tokenizing owner (an HTTP server's validator, a tokenizer worker)
tokenizing long texts at once; more wait their turn."""

#: Longest text (in characters), or id list, done with the single call, which holds the GIL.
_SINGLE_CALL = 1024


def encode_ids(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """The token ids of ``text``.

    A long text goes through the batch call: HF ``tokenizers`` holds the GIL for the whole
    of a single ``encode`` (half a second for a MiB), and lets go of it while it works on a
    batch, so that another thread (the event loop) runs meanwhile. Short ones take the
    single call, which costs less.
    """
    if len(text) <= _SINGLE_CALL:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids
    (encoding,) = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
    long_ids: list[int] = encoding.ids
    return long_ids


def decode_ids(tokenizer: Tokenizer, ids: list[int], *, skip_special_tokens: bool) -> str:
    """The text of ``ids``: many through the batch call, which lets go of the GIL, as
    `encode_ids` does for a long text."""
    if len(ids) <= _SINGLE_CALL:
        text: str = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text
    (long_text,) = tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)
    return str(long_text)


def model_id_of(tokenizer: str | os.PathLike[str] | None) -> str:
    """The model id derived from a tokenizer: the name of the directory holding its
    ``tokenizer.json`` (as a model directory is named), or `BUNDLED_MODEL_ID`."""
    if tokenizer is None:
        return BUNDLED_MODEL_ID
    path = Path(tokenizer).resolve()
    directory = path if path.is_dir() else path.parent
    if directory == DEFAULT_TOKENIZER_PATH.parent.resolve():
        return BUNDLED_MODEL_ID
    return directory.name or BUNDLED_MODEL_ID


EOS_TOKEN_CANDIDATES = (
    EOS_TOKEN,
    "</s>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<eos>",
    "<|im_end|>",
)
"""End-of-sequence spellings tried by `eos_token_id`, bundled tokenizer's first."""

_REBUILD_HINT = "rebuild it with `python -m actors.build_tokenizer` or reinstall tokenyard"


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Any:
    """Load a Hugging Face tokenizer from a ``tokenizer.json``.

    Args:
        path: A ``tokenizer.json`` file, or a directory holding one (a model directory).
            ``None`` loads the bundled default, `DEFAULT_TOKENIZER_PATH`.

    Returns:
        The ``tokenizers.Tokenizer``.

    Raises:
        FileNotFoundError: Nothing exists at ``path`` (or the directory has no
            ``tokenizer.json``); the message names the path and what to pass instead.
        ValueError: The file is not a valid ``tokenizer.json``.
    """
    bundled = path is None
    file = DEFAULT_TOKENIZER_PATH if path is None else Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        if bundled:
            hint = f"the bundled tokenizer is missing; {_REBUILD_HINT}"
        else:
            hint = (
                "pass the path of a Hugging Face tokenizer.json (or of a directory holding "
                "one), or None for the bundled default"
            )
        raise FileNotFoundError(f"tokenizer file {file} does not exist: {hint}")
    try:
        # Read it ourselves so I/O failures surface as the usual OSError subclasses, not
        # as the bare Exception the Rust loader raises for everything.
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{file} is not a tokenizer.json: it is not UTF-8 text") from err
    try:
        return Tokenizer.from_str(text)
    # The tokenizers extension raises a plain Exception for any parse or schema error.
    except Exception as err:
        fix = _REBUILD_HINT if bundled else "pass a tokenizer.json saved by Hugging Face tokenizers"
        raise ValueError(f"{file} is not a valid tokenizer.json ({err}); {fix}") from err


def vocab_size(tokenizer: Any) -> int:
    """Ids ``0..vocab_size-1`` are the tokenizer's (added tokens included): what an engine
    must generate within, and a prompt id must lie in."""
    size: int = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return size


def outside_vocabulary(ids: list[int], size: int) -> int | None:
    """An id of ``ids`` outside ``0..size-1`` (``None``: none is): one ``min`` and one
    ``max``, not a test per id."""
    if not ids:
        return None
    low, high = min(ids), max(ids)
    if low < 0:
        return low
    return high if high >= size else None


def eos_token_id(tokenizer: Any, candidates: tuple[str, ...] = EOS_TOKEN_CANDIDATES) -> int | None:
    """Return the id of the tokenizer's end-of-sequence token, if it has a known one.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``.
        candidates: Token spellings to try, in order.

    Returns:
        The id of the first candidate in the vocabulary, or ``None`` if none is.
    """
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return None


def tokenizer_option_error(path: str | None) -> str | None:
    """What is wrong with a command's ``--tokenizer PATH``, as the one line the command
    prints before it starts anything; ``None`` when the tokenizer loads.

    Args:
        path: The option's value (``None``: the bundled tokenizer).
    """
    if path is not None:
        file = Path(path)
        file = file / "tokenizer.json" if file.is_dir() else file
        if not file.is_file():
            return (
                f"bad --tokenizer: {file} does not exist (name a Hugging Face tokenizer.json, "
                "or a directory holding one; leave --tokenizer out for the bundled one)"
            )
    try:
        load_tokenizer(path)
    except (OSError, ValueError) as err:
        return "bad --tokenizer: " + " ".join(str(err).split())
    return None
