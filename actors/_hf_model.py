"""The vLLM test model's directory: a Hugging Face ``config.json`` of a tiny llama and the
pipeline's tokenizer, with no weights (vLLM runs it with ``--load-format dummy``: random
weights, nothing downloaded).

``python -m actors make-hf-model DIR`` writes it. The shape (2 layers, width 128, 2 heads of
64, vocabulary the tokenizer's) is the smallest vLLM's CPU attention takes: its kernels
refuse a head size of 16 (``Unsupported CPU attention configuration: head_dim=16``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._tokenizer import BOS_TOKEN, DEFAULT_TOKENIZER_PATH, PAD_TOKEN, eos_token_id, load_tokenizer

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("CHAT_TEMPLATE", "MAX_MODEL_LEN", "main", "write_hf_model_dir")

#: The context the config declares (``max_position_embeddings``).
MAX_MODEL_LEN = 4096

#: The chat template: each message ``<bos>{role}\\n{content}<eos>\\n``, the reply opened with
#: ``<bos>assistant\\n`` (the llama.cpp test model's, `actors._gguf`).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token }}{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


def write_hf_model_dir(directory: Path, *, tokenizer: Path | None = None) -> Path:
    """Write ``config.json``, ``generation_config.json``, ``tokenizer_config.json`` and
    ``tokenizer.json`` into ``directory`` (created if missing).

    Args:
        directory: Where to write.
        tokenizer: The ``tokenizer.json`` (default: the bundled one).

    Returns:
        ``directory``.
    """
    source = DEFAULT_TOKENIZER_PATH if tokenizer is None else tokenizer
    hf = load_tokenizer(source)
    vocab = hf.get_vocab(with_added_tokens=True)
    eos = eos_token_id(hf)
    bos, pad = vocab.get(BOS_TOKEN), vocab.get(PAD_TOKEN)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "vocab_size": max(vocab.values()) + 1,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN if bos is not None else None,
        "eos_token": None if eos is None else hf.id_to_token(eos),
        "pad_token": PAD_TOKEN if pad is not None else None,
        "model_max_length": MAX_MODEL_LEN,
        "chat_template": CHAT_TEMPLATE,
    }
    for name, content in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
    ):
        text = json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        (directory / name).write_text(text, encoding="utf-8")
    if source.resolve() != (directory / "tokenizer.json").resolve():
        shutil.copyfile(source, directory / "tokenizer.json")
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m actors make-hf-model DIR``: write the vLLM test model's directory."""
    parser = argparse.ArgumentParser(
        prog="python -m actors make-hf-model",
        description="write a tiny llama's config.json and the tokenizer into DIR, for vLLM "
        "with --load-format dummy (random weights; nothing is downloaded)",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: the bundled)")
    args = parser.parse_args(argv)
    write_hf_model_dir(args.directory, tokenizer=args.tokenizer)
    sys.stdout.write(f"wrote {args.directory}\n")
    return 0
