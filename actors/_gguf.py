"""GGUF files: the tiny random-weight model the tests run llama.cpp on, and the bytes
llama.cpp spells each token of a GGUF with.

``python -m actors make-model DIR`` writes, from a byte-level BPE ``tokenizer.json`` (the
bundled one by default), a model directory:

- ``DIR/model.gguf``: a llama-architecture model (2 layers, width 64, 4 heads, context
  2048, F32, about 2.5 MB) with random weights and the tokenizer's vocabulary and merges,
  which llama.cpp loads and runs (the ``llamacpp`` extra's ``xllamacpp``);
- ``DIR/tokenizer.json``: the tokenizer it was built from, byte for byte;
- ``DIR/tokenizer_config.json``: its ``bos_token``, ``eos_token`` and the chat template,
  the one written into the GGUF too, so the front end renders chats as llama.cpp would.

``python -m actors serve --tokenizer DIR`` serves the directory's tokenizer and template;
an engine that runs llama.cpp opens ``DIR/model.gguf`` (`MODEL_FILE`). The same tokenizer,
seed and options always give the same bytes; nothing is downloaded; it takes a tenth of a
second.

What llama.cpp needs of the file (xllamacpp 2026.10.11549, gguf 0.19.0):

- ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE) and ``tokenizer.ggml.pre = "gpt-2"``
  (the GPT-2 split regex, which is what a byte-level pre-tokenizer with ``use_regex``
  applies). ``"gpt2"`` as the pre-tokenizer fails the load: *unknown pre-tokenizer type*.
- Merges as ``"a b"`` strings; token types ``CONTROL`` for the special added tokens (else
  llama.cpp splits ``<|eos|>`` in a text prompt), ``USER_DEFINED`` for other added ones.
- ``add_bos_token = false``: the bundled tokenizer adds no BOS, and llama.cpp must tokenize
  text as Hugging Face does.

With plain random weights the model writes byte fragments: tokens whose bytes are no UTF-8
on their own, one multi-byte character spelled over several tokens (about one generated
token in eight). That is the default, because the front end must handle them and llama.cpp's
server hides their ids (see `actors._llamacpp`). ``clean=True`` (``--clean``) gives the
model a built-in logit bias against fragments and control tokens, so it never writes one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import gguf
    import numpy as np
except ImportError as err:  # the `llamacpp` extra
    raise ImportError(
        f"building a GGUF needs gguf and numpy ({err}); install them with: "
        "pip install 'tokenyard[llamacpp]'"
    ) from err

from ._tokenizer import BOS_TOKEN, DEFAULT_TOKENIZER_PATH, EOS_TOKEN_CANDIDATES, PAD_TOKEN

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import NDArray

__all__ = (
    "CHAT_TEMPLATE",
    "CONFIG_FILE",
    "MODEL_FILE",
    "TOKENIZER_FILE",
    "ModelShape",
    "byte_decoder",
    "main",
    "token_pieces",
    "write_gguf",
    "write_model_dir",
)

MODEL_FILE = "model.gguf"
"""The GGUF's name in a directory `write_model_dir` writes."""

TOKENIZER_FILE = "tokenizer.json"
"""The tokenizer's name in that directory."""

CONFIG_FILE = "tokenizer_config.json"
"""Its special tokens and chat template, as Hugging Face names them."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token }}{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)
"""The chat template of the test model: each message is ``<bos>{role}\\n{content}<eos>\\n``,
the generation prompt ``<bos>assistant\\n``, so a reply ends at the eos token, where llama.cpp
stops. It uses only ``bos_token`` and ``eos_token``, which llama.cpp's Jinja engine and
`actors.http.ChatTemplate` both pass."""

_BOS_CANDIDATES = (BOS_TOKEN, "<s>", "<|begin_of_text|>", "<|endoftext|>")
_PAD_CANDIDATES = (PAD_TOKEN, "<pad>")


class ModelShape:
    """The architecture of the test model: small enough to build in a tenth of a second and
    to generate thousands of tokens a second on one CPU.

    Args:
        layers: Transformer blocks.
        width: Embedding width.
        heads: Attention heads (as many key/value heads).
        ffn: Feed-forward width.
        context_length: The context the GGUF declares (llama.cpp's ``n_ctx_train``).
    """

    def __init__(
        self,
        *,
        layers: int = 2,
        width: int = 64,
        heads: int = 4,
        ffn: int = 128,
        context_length: int = 2048,
    ) -> None:
        if width % heads:
            raise ValueError(f"width={width} is not a multiple of heads={heads}")
        self.layers = layers
        self.width = width
        self.heads = heads
        self.ffn = ffn
        self.context_length = context_length


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, backwards: the character standing for each byte.

    Byte-level BPE spells every byte as a printable character (the printable Latin-1 bytes
    as themselves, the other 68 as ``chr(256 + n)``); a token's string in ``tokenizer.json``
    (and in the GGUF) is its bytes in that alphabet.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class _Vocabulary:
    """A byte-level BPE ``tokenizer.json``, as a GGUF writes it."""

    def __init__(self, tokenizer_json: Path) -> None:
        spec: dict[str, Any] = json.loads(tokenizer_json.read_text(encoding="utf-8"))
        _check_byte_level(spec, tokenizer_json)
        model = spec["model"]
        vocab: dict[str, int] = dict(model["vocab"])
        added = {int(t["id"]): t for t in spec.get("added_tokens") or []}
        for token_id, token in added.items():
            vocab[str(token["content"])] = token_id
        tokens: list[str | None] = [None] * (max(vocab.values()) + 1)
        for text, token_id in vocab.items():
            tokens[token_id] = text
        missing = [i for i, t in enumerate(tokens) if t is None]
        if missing:
            raise ValueError(
                f"{tokenizer_json}: token ids are not contiguous ({len(missing)} missing, the "
                f"first {missing[0]}); llama.cpp needs ids 0..n-1"
            )
        self.tokens: list[str] = [t for t in tokens if t is not None]
        self.types = [
            (gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
            if i in added
            else gguf.TokenType.NORMAL
            for i in range(len(self.tokens))
        ]
        self.merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        contents = {str(t["content"]): i for i, t in added.items()}
        self.bos = _first_of(contents, _BOS_CANDIDATES)
        self.eos = _first_of(contents, EOS_TOKEN_CANDIDATES)
        self.pad = _first_of(contents, _PAD_CANDIDATES)

    def fragments(self) -> list[int]:
        """Ids of the normal tokens whose bytes are no UTF-8 on their own."""
        decoder = byte_decoder()
        found = []
        for i, text in enumerate(self.tokens):
            if self.types[i] != gguf.TokenType.NORMAL:
                continue
            try:
                bytes(decoder[ch] for ch in text).decode("utf-8")
            except UnicodeDecodeError:
                found.append(i)
        return found

    def special_token(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokens[token_id]


def _first_of(contents: dict[str, int], candidates: Sequence[str]) -> int | None:
    return next((contents[c] for c in candidates if c in contents), None)


def _check_byte_level(spec: dict[str, Any], where: Path) -> None:
    """Refuse a tokenizer this module cannot write as llama.cpp's ``gpt2`` + ``gpt-2``."""
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    problems = []
    if model.get("type") != "BPE":
        problems.append(f"its model is {model.get('type')!r}, not 'BPE'")
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        problems.append("its pre-tokenizer is not a ByteLevel one with use_regex")
    elif pre.get("add_prefix_space"):
        problems.append("its ByteLevel pre-tokenizer adds a prefix space, which llama.cpp does not")
    if spec.get("normalizer") is not None:
        problems.append("it has a normalizer, which llama.cpp's gpt2 tokenizer does not apply")
    if problems:
        raise ValueError(
            f"{where} cannot become a llama.cpp vocabulary: {'; '.join(problems)}. The test "
            "model needs a GPT-2-style byte-level BPE tokenizer, as `python -m "
            "actors.build_tokenizer` makes"
        )


def write_gguf(
    tokenizer_json: Path,
    out: Path,
    *,
    seed: int = 0,
    clean: bool = False,
    shape: ModelShape | None = None,
) -> None:
    """Write a random-weight llama GGUF with the vocabulary of ``tokenizer_json``.

    Args:
        tokenizer_json: A byte-level BPE ``tokenizer.json``.
        out: The GGUF to write (replaced atomically).
        seed: Seed of the weights; the same seed gives the same bytes.
        clean: Bias the output layer so that byte fragments and control tokens are never
            generated: residual dimension 0 carries a constant that no layer writes to, and
            the output row of each token scales it into a per-token logit bias.
        shape: The architecture (default `ModelShape()`).

    Raises:
        ValueError: The tokenizer is not a byte-level BPE llama.cpp can use.
    """
    shape = shape or ModelShape()
    vocab = _Vocabulary(tokenizer_json)
    n_vocab = len(vocab.tokens)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name("tokenyard-tiny-random-llama")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.width)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.heads)
    writer.add_rope_dimension_count(shape.width // shape.heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types([int(t) for t in vocab.types])
    writer.add_token_merges(vocab.merges)
    if vocab.bos is not None:
        writer.add_bos_token_id(vocab.bos)
    if vocab.eos is not None:
        writer.add_eos_token_id(vocab.eos)
    if vocab.pad is not None:
        writer.add_pad_token_id(vocab.pad)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in _weights(shape, vocab, seed, clean):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)


def _weights(
    shape: ModelShape, vocab: _Vocabulary, seed: int, clean: bool
) -> list[tuple[str, NDArray[np.float32]]]:
    """The model's tensors, drawn in a fixed order from one seeded generator."""
    rng = np.random.default_rng(seed)
    width, n_vocab = shape.width, len(vocab.tokens)

    def matrix(rows: int, cols: int, scale: float | None = None) -> NDArray[np.float32]:
        # numpy (out, in) is ggml's ne [in, out], the layout llama.cpp expects
        std = 1.0 / np.sqrt(cols) if scale is None else scale
        drawn: NDArray[np.float32] = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        return drawn

    def ones(n: int) -> NDArray[np.float32]:
        return np.ones(n, dtype=np.float32)

    embeddings = matrix(n_vocab, width, 1.0)
    if clean:
        embeddings[:, 0] = 8.0  # the constant the output layer turns into a bias
    tensors = [("token_embd.weight", embeddings)]
    for layer in range(shape.layers):
        block = f"blk.{layer}."
        attn_out = matrix(width, width)
        ffn_down = matrix(width, shape.ffn)
        tensors += [
            (block + "attn_norm.weight", ones(width)),
            (block + "attn_q.weight", matrix(width, width)),
            (block + "attn_k.weight", matrix(width, width)),
            (block + "attn_v.weight", matrix(width, width)),
            (block + "attn_output.weight", attn_out),
            (block + "ffn_norm.weight", ones(width)),
            (block + "ffn_gate.weight", matrix(shape.ffn, width)),
            (block + "ffn_up.weight", matrix(shape.ffn, width)),
            (block + "ffn_down.weight", ffn_down),
        ]
        if clean:  # no layer writes to dimension 0: it stays the constant
            attn_out[0, :] = 0.0
            ffn_down[0, :] = 0.0
    output = matrix(n_vocab, width)
    if clean:
        output[:, 0] = 0.5
        banned = vocab.fragments() + [
            i for i, t in enumerate(vocab.types) if t == gguf.TokenType.CONTROL
        ]
        output[banned, 0] = -3.0
    tensors += [("output_norm.weight", ones(width)), ("output.weight", output)]
    return tensors


def write_model_dir(
    directory: Path,
    *,
    tokenizer: Path | None = None,
    seed: int = 0,
    clean: bool = False,
) -> Path:
    """Write a model directory: `MODEL_FILE`, `TOKENIZER_FILE` and `CONFIG_FILE`.

    Args:
        directory: Where to write (created if missing; the three files are replaced).
        tokenizer: A byte-level BPE ``tokenizer.json`` (default: the bundled one).
        seed: Seed of the weights.
        clean: Build a model that never writes byte fragments (see `write_gguf`).

    Returns:
        The path of the GGUF.

    Raises:
        FileNotFoundError: ``tokenizer`` does not exist.
        ValueError: It is not a byte-level BPE llama.cpp can use.
    """
    source = DEFAULT_TOKENIZER_PATH if tokenizer is None else tokenizer
    if not source.is_file():
        raise FileNotFoundError(
            f"tokenizer file {source} does not exist: name a byte-level BPE tokenizer.json "
            "with --tokenizer, or leave it out for the bundled one"
        )
    directory.mkdir(parents=True, exist_ok=True)
    model = directory / MODEL_FILE
    write_gguf(source, model, seed=seed, clean=clean)
    if source.resolve() != (directory / TOKENIZER_FILE).resolve():
        shutil.copyfile(source, directory / TOKENIZER_FILE)
    vocab = _Vocabulary(source)
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": vocab.special_token(vocab.bos),
        "chat_template": CHAT_TEMPLATE,
        "eos_token": vocab.special_token(vocab.eos),
        "model_max_length": ModelShape().context_length,
        "pad_token": vocab.special_token(vocab.pad),
    }
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    (directory / CONFIG_FILE).write_text(text, encoding="utf-8")
    return model


def token_pieces(path: Path) -> list[bytes] | None:
    """The bytes llama.cpp writes for each token of the GGUF at ``path`` when it renders
    special tokens (``common_token_to_piece(..., special=true)``).

    Read from the file's vocabulary, for byte-level BPE (``tokenizer.ggml.model = "gpt2"``)
    only: a normal token is its string through `byte_decoder`, a control, user-defined or
    unknown token its text as is, an unused one nothing.

    Returns:
        One ``bytes`` per token id, or ``None`` for another kind of vocabulary.
    """
    reader = gguf.GGUFReader(path)
    kind = reader.fields.get("tokenizer.ggml.model")
    if kind is None or kind.contents() != "gpt2":
        return None
    tokens: list[str] = reader.fields["tokenizer.ggml.tokens"].contents()
    types_field = reader.fields.get("tokenizer.ggml.token_type")
    types: list[int] = (
        types_field.contents() if types_field is not None else [gguf.TokenType.NORMAL] * len(tokens)
    )
    decoder = byte_decoder()
    pieces = []
    for text, kind_of in zip(tokens, types, strict=True):
        if kind_of == gguf.TokenType.NORMAL:
            # llama.cpp drops a character outside the alphabet; a real vocabulary has none
            pieces.append(bytes(decoder[ch] for ch in text if ch in decoder))
        elif kind_of == gguf.TokenType.UNUSED:
            pieces.append(b"")
        else:
            pieces.append(text.encode("utf-8"))
    return pieces


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m actors make-model DIR``: write the test model's directory.

    Args:
        argv: Arguments after ``make-model``; ``None`` reads ``sys.argv``.

    Returns:
        The process exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m actors make-model",
        description="Write a tiny random-weight llama.cpp model (DIR/model.gguf) with a "
        "tokenizer's vocabulary, beside the tokenizer and its chat template. Serve it with "
        "`python -m actors serve --engine llamacpp --model DIR` (the tokenizer in DIR is "
        "then the default --tokenizer).",
    )
    parser.add_argument("directory", type=Path, metavar="DIR", help="where to write")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a byte-level BPE tokenizer.json (default: the bundled one)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    parser.add_argument(
        "--clean",
        action="store_true",
        help="a model that never writes byte fragments (tokens that are no UTF-8 on their "
        "own) nor control tokens; by default it writes both, as real models do",
    )
    args = parser.parse_args(argv)
    try:
        model = write_model_dir(
            args.directory, tokenizer=args.tokenizer, seed=args.seed, clean=args.clean
        )
    except (OSError, ValueError) as err:
        parser.error(str(err))
    sys.stdout.write(f"wrote {model} ({model.stat().st_size:,} bytes) and its tokenizer\n")
    return 0
