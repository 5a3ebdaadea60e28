"""The chat template behind vLLM's request extensions, against its oracle:
``continue_final_message`` and ``chat_template_kwargs`` against transformers'
apply_chat_template. Prompt truncation and the ``prompt_logprobs`` shape need no tokenizer:
tests/unit/test_vllm_output.py. The ``grammar`` kind of structured output is tested with the
other kinds, in test_structured_output.py."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from pdserve.gateway.api_models import ChatMessage
from pdserve.gateway.tokenizer import ChatTemplate, TemplateInputError
from tests.engine.test_chat_template import RICH_TEMPLATE
from tests.unit.gateway_fixtures import LLAMA_LIKE_TEMPLATE, train_byte_level, write_model_dir

# Reads a variable only a client's chat_template_kwargs sets, as Qwen3's template does.
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
CONTINUED = [
    ChatMessage("user", "Grüße 😀"),
    ChatMessage("assistant", "Hallo, wie "),  # trailing space: LLAMA_LIKE's trim drops it
]


@pytest.fixture(scope="module")
def byte_tok():
    return train_byte_level()


def oracle(tmp_path, byte_tok, template: str) -> tuple[ChatTemplate, PreTrainedTokenizerFast]:
    model_dir = write_model_dir(tmp_path, byte_tok, template=template)
    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return ChatTemplate(template, "<s>", "</s>"), hf


def as_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


@pytest.mark.parametrize(
    "template",
    [LLAMA_LIKE_TEMPLATE, RICH_TEMPLATE, THINKING_TEMPLATE],
    ids=["trim", "rich", "think"],
)
def test_continue_final_message_matches_transformers(tmp_path, byte_tok, template):
    chat, hf = oracle(tmp_path, byte_tok, template)
    expected = hf.apply_chat_template(
        as_dicts(CONTINUED),
        tokenize=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    text = chat.render(CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert text == expected
    assert text.rstrip().endswith("Hallo, wie") and not text.endswith("</s>")
    whole = chat.render(CONTINUED, add_generation_prompt=False)
    assert whole.startswith(text) and len(whole) > len(text)  # the turn's end is left off


@pytest.mark.parametrize("thinking", [False, True])
def test_template_variables_match_transformers(tmp_path, byte_tok, thinking):
    chat, hf = oracle(tmp_path, byte_tok, THINKING_TEMPLATE)
    messages = [ChatMessage("user", "hi")]
    expected = hf.apply_chat_template(
        as_dicts(messages), tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    text = chat.render(messages, variables={"enable_thinking": thinking})
    assert text == expected
    assert text.endswith("<think></think>") != thinking
    assert not chat.render(messages).endswith("<think></think>")  # undefined: the default


def test_a_message_the_template_drops_cannot_be_continued():
    chat = ChatTemplate("{% for m in messages %}{{ m['role'] }};{% endfor %}", None, None)
    with pytest.raises(TemplateInputError) as info:
        chat.render(CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert info.value.param == "continue_final_message"
    hides = ChatTemplate("{% for m in messages %}{{ m['content'][:3] }}{% endfor %}", None, None)
    with pytest.raises(TemplateInputError, match="cannot be continued"):
        hides.render(CONTINUED, add_generation_prompt=False, continue_final_message=True)
