"""Chat templates: read beside a tokenizer, rendered the way Hugging Face renders them."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from actors._tokenizer import BOS_TOKEN, DEFAULT_TOKENIZER_PATH, EOS_TOKEN
from actors.http import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError

if TYPE_CHECKING:
    from pathlib import Path

# Written for these tests in the layout of Llama 3's template: a bos token, role headers,
# trimmed contents, block tags on their own lines (which trim_blocks/lstrip_blocks remove).
LLAMA3_STYLE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' and not loop.first %}
        {{- raise_exception('a system message may only come first') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim }}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# ChatML with a default system prompt and strict alternation, written in the older style
# whose newlines only trim_blocks and lstrip_blocks keep out of the prompt.
CHATML_STRICT = """\
{% if messages[0]['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{% for message in messages %}
  {% if message['role'] != 'system' and (message['role'] == 'user') != (loop.index0 % 2 == (0 if messages[0]['role'] != 'system' else 1)) %}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""  # noqa: E501

USER = {"role": "user", "content": "Bonjour à tous 😀"}
ASSISTANT = {"role": "assistant", "content": "  Salut !  "}


def write_config(directory: Path, **config: Any) -> Path:
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


class TestRendering:
    def test_a_llama3_style_template_renders_headers_trimmed_contents_and_the_prompt(
        self, tmp_path: Path
    ) -> None:
        write_config(
            tmp_path,
            chat_template=LLAMA3_STYLE,
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
        )
        template = ChatTemplate.from_tokenizer(tmp_path / "tokenizer.json")
        system = {"role": "system", "content": "Be brief."}
        assert template.render([system, USER, ASSISTANT, USER]) == (
            "<|begin_of_text|>"
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBonjour à tous 😀<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nSalut !<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBonjour à tous 😀<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )

    def test_without_the_generation_prompt_the_last_turn_stays_closed(self, tmp_path: Path) -> None:
        write_config(tmp_path, chat_template=LLAMA3_STYLE, bos_token="<s>")
        template = ChatTemplate.from_tokenizer(tmp_path)
        assert template.render([USER], add_generation_prompt=False) == (
            "<s><|start_header_id|>user<|end_header_id|>\n\nBonjour à tous 😀<|eot_id|>"
        )

    def test_trim_and_lstrip_blocks_keep_block_lines_out_of_a_chatml_prompt(
        self, tmp_path: Path
    ) -> None:
        write_config(tmp_path, chat_template=CHATML_STRICT)
        template = ChatTemplate.from_tokenizer(tmp_path)
        assert template.render([USER]) == (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nBonjour à tous 😀<|im_end|>\n"
            "<|im_start|>assistant\n"
        )

    def test_raise_exception_refuses_a_conversation_with_the_templates_message(
        self, tmp_path: Path
    ) -> None:
        write_config(tmp_path, chat_template=CHATML_STRICT)
        template = ChatTemplate.from_tokenizer(tmp_path)
        with pytest.raises(ChatTemplateError, match="roles must alternate"):
            template.render([USER, USER])

    def test_tojson_writes_plain_json_without_ascii_escapes(self) -> None:
        template = ChatTemplate("{{ messages | tojson }}|{{ messages[0] | tojson(indent=1) }}")
        one = [{"role": "user", "content": "<b>日本</b>"}]
        assert template.render(one) == (
            json.dumps(one, ensure_ascii=False)
            + "|"
            + json.dumps(one[0], ensure_ascii=False, indent=1)
        )

    def test_the_sandbox_refuses_a_template_that_mutates_the_messages(self) -> None:
        template = ChatTemplate("{% set _ = messages.append(1) %}{{ messages | length }}")
        with pytest.raises(ChatTemplateError, match="failed on these messages"):
            template.render([USER])

    def test_a_template_that_fails_on_the_messages_is_a_template_error(self) -> None:
        template = ChatTemplate("{{ messages[0]['content'] + 1 }}")
        with pytest.raises(ChatTemplateError, match="failed on these messages"):
            template.render([USER])

    def test_strftime_now_is_there_for_templates_that_print_the_date(self) -> None:
        assert ChatTemplate("{{ strftime_now('%Y') }}").render([]).isdigit()

    def test_invalid_jinja_is_refused_when_the_template_is_made(self) -> None:
        with pytest.raises(ValueError, match="not valid Jinja"):
            ChatTemplate("{% for m in messages %}")


class TestLoading:
    def test_the_bundled_tokenizer_gets_the_default_template_and_its_tokens(self) -> None:
        for where in (None, DEFAULT_TOKENIZER_PATH, DEFAULT_TOKENIZER_PATH.parent):
            template = ChatTemplate.from_tokenizer(where)
            assert template.source == DEFAULT_CHAT_TEMPLATE
            assert (template.bos_token, template.eos_token) == (BOS_TOKEN, EOS_TOKEN)

    def test_the_default_template_is_chatml(self) -> None:
        template = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
        system = {"role": "system", "content": "Be brief."}
        assert template.render([system, USER]) == (
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nBonjour à tous 😀<|im_end|>\n"
            "<|im_start|>assistant\n"
        )

    def test_a_directory_without_a_template_gets_the_default_with_its_own_tokens(
        self, tmp_path: Path
    ) -> None:
        write_config(
            tmp_path,
            bos_token={"content": "<s>", "special": True},
            eos_token="</s>",
        )
        template = ChatTemplate.from_tokenizer(tmp_path)
        assert template.source == DEFAULT_CHAT_TEMPLATE
        assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
        assert ChatTemplate.from_tokenizer(tmp_path / "empty").source == DEFAULT_CHAT_TEMPLATE

    def test_the_default_of_several_named_templates_is_the_chat_one(self, tmp_path: Path) -> None:
        named = [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "chat:{{ messages[0].content }}"},
        ]
        write_config(tmp_path, chat_template=named)
        assert ChatTemplate.from_tokenizer(tmp_path).render([USER]) == "chat:Bonjour à tous 😀"

    def test_named_templates_without_a_default_are_refused(self, tmp_path: Path) -> None:
        write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "x"}])
        with pytest.raises(ValueError, match=r"named \['tool_use'\] but none named 'default'"):
            ChatTemplate.from_tokenizer(tmp_path)

    def test_chat_template_jinja_beside_the_tokenizer_wins(self, tmp_path: Path) -> None:
        write_config(tmp_path, chat_template="from the config", eos_token="</s>")
        (tmp_path / "chat_template.jinja").write_text("from the file {{ eos_token }}")
        assert ChatTemplate.from_tokenizer(tmp_path).render([]) == "from the file </s>"

    @pytest.mark.parametrize(
        ("text", "error"),
        [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object")],
    )
    def test_a_broken_tokenizer_config_is_refused(
        self, tmp_path: Path, text: str, error: str
    ) -> None:
        (tmp_path / "tokenizer_config.json").write_text(text)
        with pytest.raises(ValueError, match=error):
            ChatTemplate.from_tokenizer(tmp_path)

    def test_a_chat_template_of_another_type_is_refused(self, tmp_path: Path) -> None:
        write_config(tmp_path, chat_template=42)
        with pytest.raises(ValueError, match="must be a string or a list"):
            ChatTemplate.from_tokenizer(tmp_path)
