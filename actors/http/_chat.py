"""Chat prompts: a tokenizer's own Jinja chat template, rendered as Hugging Face does.

A model directory holds its template beside its ``tokenizer.json``: in
``chat_template.jinja`` (newer transformers) or as ``chat_template`` in
``tokenizer_config.json``, which also names ``bos_token`` and ``eos_token``. The template is
rendered in a sandbox (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``,
the ``loopcontrols`` extension) with ``messages``, ``add_generation_prompt``, ``bos_token``
and ``eos_token``, the ``tojson`` filter and the ``raise_exception`` and ``strftime_now``
globals that real-world templates call. A tokenizer without a template gets
`DEFAULT_CHAT_TEMPLATE`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

try:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError as err:  # the `serve` extra
    raise ImportError(
        f"actors.http needs jinja2 ({err}); install it with: pip install 'tokenyard[serve]'"
    ) from err

from actors._tokenizer import BOS_TOKEN, DEFAULT_TOKENIZER_PATH, EOS_TOKEN

if TYPE_CHECKING:
    import os
    from collections.abc import Mapping, Sequence

__all__ = ("DEFAULT_CHAT_TEMPLATE", "ChatTemplate", "ChatTemplateError")

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The template of a tokenizer that has none: ChatML's layout. Each message is
``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the generation prompt is
``<|im_start|>assistant\\n``. No ``bos_token`` is written, as no completion prompt gets one."""


class ChatTemplateError(ValueError):
    """The template refused the messages (its ``raise_exception``) or failed on them."""


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to refuse a conversation (e.g. roles that do not alternate).
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters for HTML pages; a prompt wants plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # templates print the local date


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an added-token
    object with its ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


class ChatTemplate:
    """A compiled chat template and the special tokens it may write.

    Args:
        source: The Jinja template.
        bos_token: The tokenizer's beginning-of-sequence token (``bos_token`` in the
            template).
        eos_token: The tokenizer's end-of-sequence token (``eos_token`` in the template).

    Raises:
        ValueError: ``source`` is not a valid Jinja template.

    Example:
        >>> template = ChatTemplate.from_tokenizer("path/to/model")
        >>> template.render([{"role": "user", "content": "Hello"}])
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template is not valid Jinja: {err}") from err

    @classmethod
    def from_tokenizer(cls, path: str | os.PathLike[str] | None = None) -> ChatTemplate:
        """The chat template of a tokenizer, read from its directory.

        Args:
            path: A ``tokenizer.json`` or the directory holding it, as given to
                `actors.Pipeline`. ``None``: the bundled tokenizer, which has no template
                (it gets `DEFAULT_CHAT_TEMPLATE` with the bundled special tokens).

        Returns:
            The template of ``chat_template.jinja`` if the directory has one, else of
            ``chat_template`` in ``tokenizer_config.json``, else `DEFAULT_CHAT_TEMPLATE`.

        Raises:
            ValueError: ``tokenizer_config.json`` is not a JSON object, its template is not
                valid Jinja, or it holds several named templates but none named
                ``default``.
        """
        if path is None:
            return cls(DEFAULT_CHAT_TEMPLATE, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)
        where = Path(path)
        directory = where if where.is_dir() else where.parent
        if directory.resolve() == DEFAULT_TOKENIZER_PATH.parent.resolve():
            return cls.from_tokenizer(None)
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            try:
                loaded = json.loads(config_file.read_text(encoding="utf-8"))
            except ValueError as err:
                raise ValueError(f"{config_file} is not valid JSON: {err}") from err
            if not isinstance(loaded, dict):
                raise ValueError(f"{config_file} is not a JSON object")
            config = loaded
        bos = _token_text(config.get("bos_token"))
        eos = _token_text(config.get("eos_token"))
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), bos_token=bos, eos_token=eos)
        source = cls._source_of(config.get("chat_template"), config_file)
        return cls(source or DEFAULT_CHAT_TEMPLATE, bos_token=bos, eos_token=eos)

    @staticmethod
    def _source_of(value: Any, where: Path) -> str:
        """The template text of a ``chat_template`` entry: a string, or a list of named
        templates of which ``default`` is the chat one."""
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            default = named.get("default")
            if isinstance(default, str):
                return default
            raise ValueError(
                f"{where} has chat templates named {sorted(map(str, named))} but none named "
                "'default', the one chat uses"
            )
        raise ValueError(f"{where}: chat_template must be a string or a list of named templates")

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a conversation.

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts (``content`` a string).
            add_generation_prompt: End with the assistant's turn opened.

        Raises:
            ChatTemplateError: The template refused the messages, or failed on them.
        """
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            LookupError,
            AttributeError,
            ArithmeticError,
        ) as err:
            # A template written for other message shapes fails on these messages: the
            # request's fault as far as the caller can tell, never the server's.
            raise ChatTemplateError(f"the chat template failed on these messages: {err}") from err
