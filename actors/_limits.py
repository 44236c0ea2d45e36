"""`RequestLimits`: what one request may ask for, and the one checker of it.

Each door into the pipeline holds a request to one `RequestLimits`, with this one checker:
a `Generate` to the tokenizer worker's (`actors.PipelineConfig.limits`), whoever sent it
(`actors.Pipeline` checks what it can before sending too: a prompt too large to ship); an
HTTP request to its server's (`actors.http.ServeConfig.limits`), checked once by the HTTP
validator, whose worker then takes the ids it admitted as they are
(`TokenizerWorker.submit_local`). A refusal names the setting that refused it, in the
config that set it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

from ._tokenizer import outside_vocabulary

if TYPE_CHECKING:
    from .messages import SamplingParams

__all__ = ("RequestLimits", "context_refusal", "sampling_refusal", "vocabulary_refusal")


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one request may ask for.

    Attributes:
        max_prompt_bytes: Most UTF-8 bytes of a prompt's text, checked before tokenizing.
        max_prompt_tokens: Most tokens of a prompt.
        max_new_tokens: Upper bound of a request's tokens to generate.
        context_length: Prompt plus generated tokens a request may use, named in a
            refusal (0: not known here; the engine's side bounds it).
        settings: The settings the three limits come from, in that order, as a refusal
            names them (``ServeConfig.max_tokens_limit``, say): the fix for a refusal.
    """

    max_prompt_bytes: int = 1 << 20
    max_prompt_tokens: int = 32_768
    max_new_tokens: int = 32_768
    context_length: int = 0
    settings: tuple[str, str, str] = (
        "PipelineConfig.max_prompt_bytes",
        "PipelineConfig.max_prompt_tokens",
        "PipelineConfig.max_new_tokens",
    )

    def text_refusal(self, text: str, what: str = "the prompt") -> str | None:
        """Why ``text`` is too long a prompt (``None``: it is not), before it is tokenized."""
        limit = self.max_prompt_bytes
        # A str of n characters is at most 4n UTF-8 bytes: most prompts skip the encoding.
        if len(text) * 4 <= limit:
            return None
        size = len(text.encode("utf-8", "surrogatepass"))
        if size <= limit:
            return None
        return f"{what} is {size} bytes, longer than {limit} bytes ({self.settings[0]})"

    def tokens_refusal(self, count: int) -> str | None:
        """Why a prompt of ``count`` tokens is too long (``None``: it is not)."""
        limit = self.max_prompt_tokens
        if count <= limit:
            return None
        context = f"; the context holds {self.context_length}" if self.context_length else ""
        return (
            f"the prompt is {count} tokens long, more than this server takes ({limit}, "
            f"{self.settings[1]}{context})"
        )

    def new_tokens_refusal(
        self, count: int, what: str = "max_new_tokens", least: int = 0
    ) -> str | None:
        """Why ``count`` tokens to generate are refused (``None``: they are not);
        ``least``: the fewest the door takes."""
        limit = self.max_new_tokens
        if least <= count <= limit:
            return None
        return f"{what} must be within [{least}, {limit}] ({self.settings[2]}), got {count}"

    def refusal(self, text: str | None, ids: list[int] | None, max_new_tokens: int) -> str | None:
        """Why a request breaks a limit (``None``: it does not): its ``text`` before it is
        tokenized, its ``ids`` once it is, and its ``max_new_tokens``."""
        refusal = self.new_tokens_refusal(max_new_tokens)
        if refusal is None and text is not None:
            refusal = self.text_refusal(text)
        if refusal is None and ids is not None:
            refusal = self.tokens_refusal(len(ids))
        return refusal


def sampling_refusal(sampling: SamplingParams) -> str | None:
    """Why no engine can run these sampling parameters (``None``: one can): a temperature
    that is not a finite number >= 0, a negative ``max_new_tokens``. vLLM's engine dies of
    them (its input thread validates a request outside any guard); the others would only
    misread them. Both doors to an engine refuse them: the scheduler and a worker that is
    the engine's client itself."""
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        return f"temperature={sampling.temperature}: an engine takes a finite temperature >= 0"
    if sampling.max_new_tokens < 0:
        return f"max_new_tokens={sampling.max_new_tokens}: it must be >= 0"
    return None


def context_refusal(count: int, context_length: int | None) -> str | None:
    """Why a prompt of ``count`` ids does not fit an engine whose context holds
    ``context_length`` ids, prompt and completion (``None``: it fits, or the length is not
    known): it must leave room for one generated id."""
    if not context_length or count < context_length:
        return None
    return (
        f"the prompt is {count} tokens: the engine's context holds {context_length} "
        "(prompt and completion), no room is left to generate"
    )


def vocabulary_refusal(ids: list[int], size: int) -> str | None:
    """Why a prompt of ``ids`` is not one for an engine whose vocabulary is ``0..size-1``
    (``None``: every id is in it): the engine would index past its embeddings. Both doors
    to an engine refuse it with this reason: the scheduler and a worker that is the
    engine's client itself."""
    outside = outside_vocabulary(ids, size)
    if outside is None:
        return None
    return (
        f"prompt id {outside} is outside the engine's vocabulary (0..{size - 1}); tokenize "
        "with the tokenizer of the engine's model"
    )
