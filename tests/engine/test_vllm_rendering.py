"""The parts behind vLLM's request extensions, each against its oracle: the chat template's
``continue_final_message`` and ``chat_template_kwargs`` against transformers'
apply_chat_template, prompt truncation, and the ``prompt_logprobs`` shape built from the
engine's lists. The ``grammar`` kind of structured output is tested with the other kinds, in
test_structured_output.py."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from pdserve.gateway.api_models import ChatMessage
from pdserve.gateway.chat_template import ChatTemplate, TemplateInputError
from pdserve.gateway.errors import APIError
from pdserve.gateway.prompt_truncation import prompt_room, truncate_prompt
from pdserve.gateway.vllm_output import prompt_logprobs_json, trim_alternatives
from pdserve.shared.logprobs import TokenLogprobs
from tests.unit.gateway_fixtures import LLAMA_LIKE_TEMPLATE, train_byte_level, write_model_dir
from tests.engine.test_chat_template import RICH_TEMPLATE

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
        as_dicts(CONTINUED), tokenize=False, add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
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


# ----------------------------------------------------------------------------- truncation


def test_truncation_keeps_the_last_tokens():
    ids = list(range(100, 140))
    assert truncate_prompt(ids, None, 16, 64, 0) is ids
    assert truncate_prompt(ids, 10, 16, 64, 0) == ids[-10:]
    assert truncate_prompt(ids, 40, 16, 64, 0) == ids  # already short enough
    assert truncate_prompt(ids, -1, 30, 64, 0) == ids[-34:]  # the context less max_tokens
    assert truncate_prompt(ids, -1, None, 32, 0) == ids[-31:]  # one position to generate into
    assert truncate_prompt(ids, -1, 0, 32, 0) == ids[-31:]  # echo's max_tokens 0 too
    assert truncate_prompt(ids, -1, 4, 64, 20) == ids[-20:]  # and --max-prompt-tokens
    assert prompt_room(16, 64, 0) == 48 and prompt_room(16, 64, 20) == 20


@pytest.mark.parametrize("keep, max_tokens, most", [(49, 16, 0), (21, 4, 20), (64, None, 0)])
def test_a_truncation_that_cannot_fit_is_a_400(keep, max_tokens, most):
    with pytest.raises(APIError) as info:
        truncate_prompt([1, 2, 3], keep, max_tokens, 64, most)  # however short the prompt
    assert (info.value.status, info.value.param) == (400, "truncate_prompt_tokens")


# ----------------------------------------------------------------------------- prompt_logprobs


def test_prompt_logprobs_shape():
    texts = lambda t: f"<{t}>"  # noqa: E731
    # three prompt tokens: two scored, with two alternatives each
    logprobs = TokenLogprobs(2, [-1.5, -0.25], [7, 1], [9, 8, 4, 6], [-0.5, -0.9, -0.25, -3.0])
    got = prompt_logprobs_json([3, 5, 4], logprobs, 2, texts)
    assert got[0] is None
    assert got[1] == {
        "5": {"logprob": -1.5, "rank": 7, "decoded_token": "<5>"},  # the prompt's own, first
        "9": {"logprob": -0.5, "rank": 1, "decoded_token": "<9>"},
        "8": {"logprob": -0.9, "rank": 2, "decoded_token": "<8>"},
    }
    # the prompt's token among the likeliest keeps first place, as in vLLM's dict
    assert list(got[2]) == ["4", "6"] and got[2]["4"]["rank"] == 1
    fewer = prompt_logprobs_json([3, 5, 4], logprobs, 1, texts)
    assert list(fewer[1]) == ["5", "9"] and list(fewer[2]) == ["4"]
    assert prompt_logprobs_json([3], TokenLogprobs(), 0, texts) == [None]
    with pytest.raises(ValueError):
        prompt_logprobs_json([3, 5], logprobs, 2, texts)


def test_trimmed_alternatives_keep_the_likeliest():
    logprobs = TokenLogprobs(3, [-1.0, -2.0], [2, 5], [1, 2, 3, 4, 5, 6], [-0.1, -0.2, -0.3] * 2)
    one = trim_alternatives(logprobs, 1)
    assert (one.top_k, one.top(0), one.top(1)) == (1, [(1, -0.1)], [(4, -0.1)])
    assert (one.token_logprobs, one.ranks) == (logprobs.token_logprobs, logprobs.ranks)
    assert trim_alternatives(logprobs, 3) is logprobs
