"""Chat templates render exactly as transformers' apply_chat_template (the oracle)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from pdserve.gateway.api_models import ChatMessage
from pdserve.gateway.tokenizer import (
    ChatTemplate,
    ModelTokenizer,
    TemplateFailure,
    TemplateInputError,
)
from tests.unit.gateway_fixtures import LLAMA_LIKE_TEMPLATE, train_byte_level, write_model_dir

# A template in the style of recent instruct models: system prompt hoisting, tojson, loop
# controls and a date helper.
RICH_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = 'You are helpful.' %}{%- set rest = messages %}{%- endif %}"
    "{{- bos_token }}[SYS]{{ system }} {{ {'lang': 'ünï'} | tojson }}[/SYS]\n"
    "{%- for m in rest %}"
    "{%- if loop.index0 > 20 %}{% break %}{% endif %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant') }}"
    "{%- endif %}"
    "\n[{{ m['role'] | upper }}] {{ m['content'] }}"
    "{%- if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}\n[ASSISTANT]{% endif %}"
)

CONVERSATIONS = [
    [ChatMessage("user", "Hi there")],
    [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Grüße 😀"),
        ChatMessage("assistant", "  Hallo!  "),
        ChatMessage("user", "日本語?"),
    ],
]


@pytest.fixture(scope="module")
def byte_tok():
    return train_byte_level()


@pytest.mark.parametrize("template", [LLAMA_LIKE_TEMPLATE, RICH_TEMPLATE], ids=["llama", "rich"])
@pytest.mark.parametrize("in_file", [False, True], ids=["tokenizer_config", "jinja_file"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(tmp_path, byte_tok, template, in_file, add_generation_prompt):
    model_dir = write_model_dir(tmp_path, byte_tok, template=template, template_in_file=in_file)
    ours = ModelTokenizer.from_dir(model_dir)
    assert ours.chat_template == template
    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    chat = ChatTemplate(ours.chat_template, ours.bos_token, ours.eos_token)
    for conversation in CONVERSATIONS:
        messages = [{"role": m.role, "content": m.content} for m in conversation]
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        text = chat.render(conversation, add_generation_prompt=add_generation_prompt)
        assert text == expected
        # Templated text already holds BOS, so it is tokenized without adding special tokens.
        expected_ids = hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(expected_ids, list):  # newer transformers return a BatchEncoding
            expected_ids = expected_ids["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == list(expected_ids)


def test_raise_exception_is_a_client_error():
    chat = ChatTemplate(RICH_TEMPLATE, "<s>", "</s>")
    with pytest.raises(TemplateInputError, match="alternate"):
        chat.render([ChatMessage("user", "a"), ChatMessage("user", "b")])


def test_sandbox_blocks_unsafe_templates():
    chat = ChatTemplate("{{ messages.__class__.__mro__ }}", None, None)
    with pytest.raises(TemplateFailure):
        chat.render([ChatMessage("user", "x")])
    mutate = ChatTemplate("{{ messages.append(1) }}", None, None)
    with pytest.raises(TemplateFailure):
        mutate.render([ChatMessage("user", "x")])


def test_special_tokens_and_eos_ids_from_model_files(tmp_path, byte_tok):
    extra = byte_tok.token_to_id("<s>")
    tok = ModelTokenizer.from_dir(write_model_dir(tmp_path, byte_tok, extra_eos_id=extra))
    eos = byte_tok.token_to_id("</s>")
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.eos_token_ids == [eos, extra]
    assert {eos, extra} <= tok.special_ids
    assert tok.encode("hi")[0] == byte_tok.token_to_id("<s>")
