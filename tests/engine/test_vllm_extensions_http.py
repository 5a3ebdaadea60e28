"""vLLM's request extensions over real HTTP, against HF transformers (float64) on the same tiny
checkpoint: ``prompt_logprobs`` (log-probs within 1e-4, ranks and the likeliest exactly),
``return_token_ids`` (the prompt's ids are what transformers' tokenizer and chat template give,
the choice's are HF's greedy tokens; streamed chunks join to the whole answer's),
``truncate_prompt_tokens``, chat ``echo`` / ``add_generation_prompt`` /
``continue_final_message`` / ``chat_template_kwargs``, and ``structured_outputs``.

The stack is ``test_response_models``'s: a real gateway and a real decode worker with a float32
engine on one in-memory bus; every response is held to the response models and /openapi.json.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

import tests.engine.test_response_models as memory_stack
from pdserve.gateway.app_state import GATEWAY_KEY
from pdserve.gateway.tokenizer import ChatTemplate, ModelTokenizer
from pdserve.gateway.vllm_fields import TEMPLATE_KWARGS_MAX_KEYS
from tests.engine.test_response_models import Stack, check, check_chunks, ref
from tests.engine.test_vllm_rendering import THINKING_TEMPLATE
from tests.hf_reference import HFReference

TOL = 1e-4
CONTEXT = 512  # the checkpoint's max_position_embeddings
engine_config, engine, stack = memory_stack.engine_config, memory_stack.engine, memory_stack.stack
Completion, Chat = memory_stack.Completion, memory_stack.ChatCompletion
PROMPTS = [[17, 250, 9, 331, 42, 120, 77, 300, 5], [3, 99, 140, 260]]
CONTINUED = [{"role": "user", "content": "The quick"}, {"role": "assistant", "content": "brown"}]


def template_ids(hf_tok: PreTrainedTokenizerFast, messages: list[dict], **kwargs: Any) -> list[int]:
    ids = hf_tok.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids if isinstance(ids, list) else ids["input_ids"])  # a BatchEncoding in v5


def greedy(hf: HFReference, prompt: list[int], n: int) -> list[int]:
    return hf.greedy(prompt, n, lambda logits, out: logits)


def tokenizer(stack: Stack) -> ModelTokenizer:
    return stack.client.server.app[GATEWAY_KEY].model.tokenizer


async def ok(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, payload = await stack.post(path, body)
    assert status == 200, payload
    if path == "/v1/completions":
        check(Completion, payload, ref("CompletionResponse"))
    else:
        check(Chat, payload, ref("ChatCompletionResponse"))
    return payload


async def refused(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, payload = await stack.post(path, body)
    assert status == 400, payload
    return payload["error"]


def check_prompt_logprobs(entries: list, prompt: list[int], k: int, hf, hf_tok) -> None:
    """vLLM's shape, against HF: entry i scores prompt[i] (its own token first, with its true
    rank), then the k likeliest with ranks 1..k."""
    rows = hf.logprobs(prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row, own, entry = rows[i - 1], prompt[i], entries[i]
        top = row.topk(k).indices.tolist()
        assert list(entry) == [str(t) for t in dict.fromkeys([own, *top])], i
        assert entry[str(own)]["rank"] == 1 + int((row > row[own]).sum()), i
        for rank, t in enumerate(top, start=1):
            assert entry[str(t)]["rank"] == rank, i
        for t, value in entry.items():
            assert abs(value["logprob"] - row[int(t)].item()) < TOL, (i, t)
            assert value["decoded_token"] == hf_tok.decode([int(t)])


# ----------------------------------------------------------------------------- prompt_logprobs


async def test_completion_prompt_logprobs_match_hf(stack: Stack, hf, hf_tok):
    body = {
        "prompt": PROMPTS,
        "max_tokens": 2,
        "n": 2,
        "seed": 4,
        "prompt_logprobs": 3,
        "echo": True,
        "logprobs": 1,
    }
    payload = await ok(stack, "/v1/completions", body)
    assert [c["index"] for c in payload["choices"]] == [0, 1, 2, 3]
    for choice in payload["choices"]:
        prompt = PROMPTS[choice["index"] // 2]
        check_prompt_logprobs(choice["prompt_logprobs"], prompt, 3, hf, hf_tok)
        # echo keeps its own count of alternatives: the token and the likeliest one
        echoed = choice["logprobs"]["top_logprobs"][1 : len(prompt)]
        assert all(1 <= len(top) <= 2 for top in echoed) and any(len(t) == 2 for t in echoed)
    # k = 0: each prompt token alone, with its rank; and no field unless asked
    body = {"prompt": PROMPTS[0], "max_tokens": 1, "prompt_logprobs": 0}
    choice = (await ok(stack, "/v1/completions", body))["choices"][0]
    check_prompt_logprobs(choice["prompt_logprobs"], PROMPTS[0], 0, hf, hf_tok)
    assert any(entry[next(iter(entry))]["rank"] > 1 for entry in choice["prompt_logprobs"][1:])
    plain = await ok(stack, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 1})
    assert {"prompt_logprobs", "prompt_token_ids", "token_ids"}.isdisjoint(plain["choices"][0])


async def test_chat_prompt_logprobs_and_token_ids_match_hf(stack: Stack, hf, hf_tok):
    body = {
        "messages": memory_stack.MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "prompt_logprobs": 2,
        "return_token_ids": True,
    }
    payload = await ok(stack, "/v1/chat/completions", body)
    prompt = template_ids(hf_tok, memory_stack.MESSAGES, add_generation_prompt=True)
    assert payload["prompt_token_ids"] == prompt  # at the top, as vLLM puts a chat's
    check_prompt_logprobs(payload["prompt_logprobs"], prompt, 2, hf, hf_tok)
    choice = payload["choices"][0]
    assert choice["token_ids"] == greedy(hf, prompt, 6)
    assert choice["message"]["content"] == tokenizer(stack).decode(choice["token_ids"])
    assert payload["usage"]["prompt_tokens"] == len(prompt)


async def test_prompt_logprobs_above_zero_are_not_streamed(stack: Stack):
    body = {"prompt": "The quick", "stream": True, "prompt_logprobs": 1}
    assert (await refused(stack, "/v1/completions", body))["param"] == "prompt_logprobs"
    events = await stack.stream("/v1/completions", {**body, "prompt_logprobs": 0})
    assert all("prompt_logprobs" not in e["choices"][0] for e in events)  # none, as vLLM


# ----------------------------------------------------------------------------- return_token_ids


def joined(events: list[dict], chat: bool) -> dict[int, dict[str, list]]:
    """Each choice's streamed token_ids, and the prompt_token_ids it got (in order)."""
    out: dict[int, dict[str, list]] = {}
    for event in events:
        choice = event["choices"][0]
        got = out.setdefault(choice["index"], {"token_ids": [], "prompt_token_ids": []})
        got["token_ids"] += choice["token_ids"]
        prompt_ids = (event if chat else choice).get("prompt_token_ids")
        if prompt_ids is not None:
            got["prompt_token_ids"].append(prompt_ids)
        assert "prompt_token_ids" not in (choice if chat else event)
    return out


async def test_streamed_token_ids_join_to_the_whole_answers(stack: Stack, hf_tok):
    body = {
        "prompt": "The quick",
        "max_tokens": 5,
        "n": 2,
        "seed": 11,
        "temperature": 1.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = await ok(stack, "/v1/completions", body)
    prompt = hf_tok("The quick")["input_ids"]
    events = await stack.stream("/v1/completions", body)
    check_chunks(memory_stack.CompletionChunk, "/v1/completions", events)
    streamed = joined(events, chat=False)
    first = {}
    for event in events:
        first.setdefault(event["choices"][0]["index"], event["choices"][0])
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 5
        assert choice["text"] == tokenizer(stack).decode(choice["token_ids"])
        got = streamed[choice["index"]]
        assert got == {"token_ids": choice["token_ids"], "prompt_token_ids": [prompt]}
        assert first[choice["index"]]["prompt_token_ids"] == prompt  # on the choice's first chunk
    body = {
        "messages": memory_stack.MESSAGES,
        "max_tokens": 4,
        "n": 2,
        "seed": 12,
        "temperature": 1.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = await ok(stack, "/v1/chat/completions", body)
    events = await stack.stream("/v1/chat/completions", body)
    check_chunks(memory_stack.ChatCompletionChunk, "/v1/chat/completions", events)
    streamed = joined(events, chat=True)
    for choice in whole["choices"]:
        got = streamed[choice["index"]]
        assert got == {
            "token_ids": choice["token_ids"],
            "prompt_token_ids": [whole["prompt_token_ids"]],
        }
    roles = [e for e in events if e["choices"][0]["delta"].get("role")]
    assert all("prompt_token_ids" in e for e in roles)  # on each choice's role chunk


# ----------------------------------------------------------------------------- truncation


async def test_truncation_keeps_the_prompts_end(stack: Stack, hf, hf_tok):
    prompt = [(7 * i) % 370 + 5 for i in range(40)]
    body = {
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "truncate_prompt_tokens": 10,
        "return_token_ids": True,
        "echo": True,
    }
    choice = (await ok(stack, "/v1/completions", body))["choices"][0]
    assert choice["prompt_token_ids"] == prompt[-10:]
    assert choice["token_ids"] == greedy(hf, prompt[-10:], 4)  # served as if sent short
    assert choice["text"].startswith(hf_tok.decode(prompt[-10:]))  # echo: the prompt served
    # -1: as many as fit the context with max_tokens; usage counts what was served
    long = [(11 * i) % 370 + 5 for i in range(CONTEXT + 100)]
    body = {"prompt": long, "max_tokens": 12, "truncate_prompt_tokens": -1}
    payload = await ok(stack, "/v1/completions", body)
    assert payload["usage"]["prompt_tokens"] == CONTEXT - 12
    error = await refused(stack, "/v1/completions", {**body, "truncate_prompt_tokens": None})
    assert error["code"] == "context_length_exceeded"
    error = await refused(
        stack, "/v1/completions", {**body, "truncate_prompt_tokens": CONTEXT - 11}
    )
    assert error["param"] == "truncate_prompt_tokens"
    # chat: the rendered conversation's last tokens
    body = {
        "messages": memory_stack.MESSAGES,
        "max_tokens": 1,
        "truncate_prompt_tokens": 3,
        "return_token_ids": True,
    }
    payload = await ok(stack, "/v1/chat/completions", body)
    rendered = template_ids(hf_tok, memory_stack.MESSAGES, add_generation_prompt=True)
    assert payload["prompt_token_ids"] == rendered[-3:]
    assert payload["usage"]["prompt_tokens"] == 3


# ----------------------------------------------------------------------------- chat rendering


@pytest.mark.parametrize("stream", [False, True])
async def test_continue_final_message_with_echo(stack: Stack, hf, hf_tok, stream: bool):
    body = {
        "messages": CONTINUED,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "echo": True,
        "return_token_ids": True,
    }
    prompt = template_ids(
        hf_tok, CONTINUED, add_generation_prompt=False, continue_final_message=True
    )
    generated = tokenizer(stack).decode(greedy(hf, prompt, 3))
    if not stream:
        payload = await ok(stack, "/v1/chat/completions", body)
        assert payload["prompt_token_ids"] == prompt
        message = payload["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "brown" + generated}
        # add_generation_prompt left out: continue_final_message turns it off
        del body["add_generation_prompt"]
        assert (await ok(stack, "/v1/chat/completions", body))["prompt_token_ids"] == prompt
        return
    events = await stack.stream("/v1/chat/completions", body)
    check_chunks(memory_stack.ChatCompletionChunk, "/v1/chat/completions", events)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "brown"}  # the echo, before anything generated
    assert "".join(d.get("content", "") for d in deltas) == "brown" + generated


async def test_without_a_generation_prompt_the_reply_continues_the_last_role(stack, hf_tok):
    body = {
        "messages": memory_stack.MESSAGES,
        "max_tokens": 2,
        "add_generation_prompt": False,
        "echo": True,
        "return_token_ids": True,
        "seed": 3,
    }
    payload = await ok(stack, "/v1/chat/completions", body)
    expected = template_ids(hf_tok, memory_stack.MESSAGES, add_generation_prompt=False)
    assert payload["prompt_token_ids"] == expected
    message = payload["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("The quick brown fox")
    # with the generation prompt the reply is the assistant's, so a user turn is not echoed
    plain = {"messages": memory_stack.MESSAGES, "max_tokens": 2, "seed": 3}
    echoed = await ok(stack, "/v1/chat/completions", {**plain, "echo": True})
    assert (
        echoed["choices"][0]["message"]
        == (await ok(stack, "/v1/chat/completions", plain))["choices"][0]["message"]
    )
    error = await refused(
        stack,
        "/v1/chat/completions",
        {**plain, "continue_final_message": True, "add_generation_prompt": True},
    )
    assert error["param"] == "continue_final_message"


async def test_chat_template_kwargs_reach_the_template(stack: Stack, hf_tok):
    gw = stack.client.server.app[GATEWAY_KEY]
    gw.model.chat = ChatTemplate(THINKING_TEMPLATE, "<s>", "</s>")  # reads enable_thinking
    body = {"messages": memory_stack.MESSAGES, "max_tokens": 1, "return_token_ids": True}
    for thinking in (False, True):
        kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
        payload = await ok(stack, "/v1/chat/completions", {**body, **kwargs})
        expected = hf_tok.apply_chat_template(
            memory_stack.MESSAGES,
            chat_template=THINKING_TEMPLATE,
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=thinking,
        )
        assert payload["prompt_token_ids"] == gw.model.tokenizer.encode(expected, False)
        assert ("<think></think>" in expected) != thinking
    too_many = {f"k{i}": 1 for i in range(TEMPLATE_KWARGS_MAX_KEYS + 1)}
    error = await refused(stack, "/v1/chat/completions", {**body, "chat_template_kwargs": too_many})
    assert error["param"] == "chat_template_kwargs"


# ----------------------------------------------------------------------------- structured_outputs


@pytest.mark.parametrize(
    "constraint, pattern",
    [
        ({"grammar": 'root ::= "the " ("fox" | "dog")'}, r"the (fox|dog)"),
        ({"grammar": 'start: "x" DIGIT DIGIT\n%import common.DIGIT'}, r"x\d\d"),
        ({"regex": "[ab]{3}c"}, r"[ab]{3}c"),
        ({"choice": ["alpha", "beta"]}, r"alpha|beta"),
    ],
)
async def test_structured_outputs_constrain_the_output(stack: Stack, constraint, pattern):
    body = {
        "prompt": "The quick",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 5,
        "n": 3,
        "structured_outputs": constraint,
    }
    payload = await ok(stack, "/v1/completions", body)
    for choice in payload["choices"]:
        assert re.fullmatch(pattern, choice["text"]), choice["text"]
        assert choice["finish_reason"] == "stop"


async def test_a_grammar_that_does_not_compile_is_a_400_naming_it(stack: Stack):
    for key, spec in [("grammar", 'root ::= "a'), ("regex", "a(b"), ("json", {"type": "nope"})]:
        body = {"messages": memory_stack.MESSAGES, "structured_outputs": {key: spec}}
        error = await refused(stack, "/v1/chat/completions", body)
        assert (error["param"], error["code"]) == (f"structured_outputs.{key}", "invalid_grammar")
    body = {"prompt": "x", "structured_outputs": {"grammar": "a", "structural_tag": "{}"}}
    error = await refused(stack, "/v1/completions", body)
    assert (error["param"], error["code"]) == (
        "structured_outputs.structural_tag",
        "unsupported_parameter",
    )
