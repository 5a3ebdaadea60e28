"""``auto`` tool calling on a model whose chat template has hermes tool syntax: a tiny Qwen2
checkpoint (random weights, ``tests/checkpoints.build_hermes_checkpoint``) served by a real
disaggregated ``pdserve up`` with ``--tool-call-parser auto``.

A random model writes a call only when told to, so ``logit_bias`` steers it: +100 on the
``<tool_call>`` token makes it open a call at once. What it writes then is the point:

- with a ``strict`` function the grammar takes over inside the call (and EOS, biased below
  ``<tool_call>``, ends the answer after it): one call whose arguments validate;
- without one there is no grammar and it writes ``<tool_call>`` again and again: a malformed
  call, which must come back as content, never as a ``tool_calls`` entry;
- ``tool_choice: none`` leaves the same text as content.

Each answer is asked for whole and streamed; the joined stream must equal the whole answer.
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from tests.checkpoints import build_hermes_checkpoint
from tests.integration.test_tools_smollm2 import joined_stream

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "The weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.integration.stack import free_port, pdserve_up

    tmp = tmp_path_factory.mktemp("hermes")
    model = build_hermes_checkpoint(tmp / "model")
    vocab = json.loads((model / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    port = free_port()
    args = [
        "--model",
        str(model),
        "--port",
        str(port),
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--served-model-name",
        "hermes",
        "--tool-call-parser",
        "auto",
    ]
    env = {"PDSERVE_CACHE_DIR": os.environ["PDSERVE_CACHE_DIR"]}
    with pdserve_up(args, tmp / "up.log", env, timeout=240):
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=120)
        yield client, ids


def ask(client, ids, strict: bool, choice: str = "auto", stream: bool = False):
    body = dict(
        model="hermes",
        messages=ASK,
        max_tokens=120,
        temperature=0,
        parallel_tool_calls=False,
        tools=[{"type": "function", "function": {**WEATHER, "strict": strict}}],
        tool_choice=choice,
        logit_bias={str(ids["<tool_call>"]): 100, str(ids["<|im_end|>"]): 50},
    )
    if stream:
        return joined_stream(client, **body)
    choice_ = client.chat.completions.create(**body).choices[0]
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in choice_.message.tool_calls or []
    ]
    return choice_.message.content or "", calls, choice_.finish_reason


def same(whole, streamed) -> None:
    """Equal answers, call ids aside (each answer draws its own)."""
    strip = lambda calls: [{k: v for k, v in c.items() if k != "id"} for c in calls]  # noqa: E731
    assert (whole[0], strip(whole[1]), whole[2]) == (streamed[0], strip(streamed[1]), streamed[2])


def test_a_strict_call_under_auto_is_parsed_and_valid(stack) -> None:
    client, ids = stack
    whole = ask(client, ids, strict=True)
    content, calls, finish = whole
    assert finish == "tool_calls" and content == "", whole
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["parameters"])
    same(whole, ask(client, ids, strict=True, stream=True))


def test_a_malformed_call_comes_back_as_content(stack) -> None:
    client, ids = stack
    whole = ask(client, ids, strict=False)
    content, calls, finish = whole
    assert calls == [] and finish == "length"
    assert content.startswith("<tool_call><tool_call>"), content
    same(whole, ask(client, ids, strict=False, stream=True))


def test_tool_choice_none_parses_nothing(stack) -> None:
    client, ids = stack
    whole = ask(client, ids, strict=True, choice="none")
    assert whole[1] == [] and whole[0].startswith("<tool_call>") and whole[2] == "length"
    same(whole, ask(client, ids, strict=True, choice="none", stream=True))
