"""A tokenizer that adds a special token of its own: the bundled one with a BOS prepended.

The bundled tokenizer's post-processor adds nothing, so ``add_special_tokens`` changes
nothing with it; this one, written into a test's directory, adds ``<|bos|>`` to every
encoding that asks for special tokens, as many models' tokenizers do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers.processors import TemplateProcessing

from actors._tokenizer import BOS_TOKEN, load_tokenizer

if TYPE_CHECKING:
    from pathlib import Path


def write_bos_tokenizer(directory: Path) -> Path:
    """Write ``directory/bos-model/tokenizer.json`` (model id ``bos-model``); its path."""
    tokenizer = load_tokenizer()
    bos = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos)]
    )
    model = directory / "bos-model"
    model.mkdir()
    path = model / "tokenizer.json"
    tokenizer.save(str(path))
    return path
