"""tokenyard's LLM front-end pipeline, built on ``runtime``: tokenizer workers, a scheduler
stand-in, a detokenizer, a router and their supervisor."""

from __future__ import annotations

__all__: tuple[str, ...] = ()
