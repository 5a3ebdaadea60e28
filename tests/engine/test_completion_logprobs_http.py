"""Completion log-probs over real HTTP, against HF transformers (float64) on the same tiny
checkpoint: the legacy ``top_logprobs`` dict of every position holds that position's own token
(the sampled one, or the prompt's with echo) beside the ``logprobs`` likeliest, as OpenAI's
legacy contract and vLLM do; chat keeps OpenAI's chat shape, exactly ``top_logprobs`` entries.

The stack is ``test_response_models``'s: a real gateway and a real decode worker with a float32
engine on one in-memory bus. Sampled token ids are not in the response (only their texts), so a
tap on that bus reads them, with the prompt ids, from the real DecodeRequest and TokenBatch
messages.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
import torch

import tests.engine.test_response_models as memory_stack
from pdserve.shared.bus.protocol import ProtocolError, decode
from pdserve.shared.bus.request_messages import DecodeRequest
from pdserve.shared.bus.stream_messages import TokenBatch
from tests.bus_memory import MemoryClient, RawMessage
from tests.engine.test_response_models import Stack

TOL = 1e-4
# the real stack's fixtures, module-scoped engine included
engine_config, engine, stack = memory_stack.engine_config, memory_stack.engine, memory_stack.stack
PROMPT = [random.Random(26).randrange(5, 380) for _ in range(12)]


class Tap:
    """Every DecodeRequest's prompt and TokenBatch's tokens on the stack's bus (one request at
    a time, one choice)."""

    def __init__(self) -> None:
        self.prompt: list[int] = []
        self.output: list[int] = []

    async def __call__(self, raw: RawMessage) -> None:
        try:
            msg = decode(raw.data)
        except ProtocolError:
            return
        if isinstance(msg, DecodeRequest):
            self.prompt, self.output = list(msg.prompt_token_ids), list(msg.output_token_ids)
        elif isinstance(msg, TokenBatch):
            self.output += [t for item in msg.items for t in item.token_ids]

    async def sequence(self, n_output: int) -> list[int]:
        """Prompt + output once ``n_output`` tokens came (the tap's delivery may lag the
        gateway's by a task switch)."""
        deadline = time.monotonic() + 5
        while len(self.output) < n_output:
            assert time.monotonic() < deadline, (len(self.output), n_output)
            await asyncio.sleep(0.01)
        assert len(self.output) == n_output
        return self.prompt + self.output


async def tapped(stack: Stack) -> tuple[MemoryClient, Tap]:
    tap = Tap()
    client = MemoryClient(stack.worker.bus.network, "tap")
    await client.subscribe(">", cb=tap)
    return client, tap


async def completion_logprobs(stack: Stack, body: dict[str, Any], stream: bool) -> dict:
    """The choice's logprobs object; a stream's chunks joined."""
    if not stream:
        status, payload = await stack.post("/v1/completions", body)
        assert status == 200, payload
        return payload["choices"][0]["logprobs"]
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    async for chunk in stack.events("/v1/completions", body):
        logprobs = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
        for key in joined if logprobs else []:
            joined[key] += logprobs[key]
    return joined


def expected_top(row: torch.Tensor, own: int, k: int, text) -> dict[str, float]:
    """The position's own token first with its log-prob, then the k likeliest (a text shared
    by several tokens keeps the first one's)."""
    out = {text(own): row[own].item()}
    for t in row.topk(k).indices.tolist():
        out.setdefault(text(t), row[t].item())
    return out


def check_positions(lp: dict, sequence: list[int], first: int, k: int, hf, hf_tok) -> int:
    """Entry i of ``lp`` is ``sequence[first + i]``, scored by HF given what precedes it.
    Returns how many of them were outside the k likeliest."""
    rows = hf.logprobs(sequence)
    text = lambda t: hf_tok.decode([t])  # noqa: E731
    assert len(lp["tokens"]) == len(sequence) - first
    outside = 0
    for i, own in enumerate(sequence[first:]):
        row = rows[first + i - 1]
        top = lp["top_logprobs"][i]
        assert lp["tokens"][i] == text(own)
        assert abs(lp["token_logprobs"][i] - row[own].item()) < TOL, i
        want = expected_top(row, own, k, text)
        assert list(top) == list(want), i  # own token first, then the likeliest in order
        assert all(abs(top[key] - want[key]) < TOL for key in want), i
        assert top[text(own)] == lp["token_logprobs"][i]
        outside += int((row > row[own]).sum()) >= k
    return outside


@pytest.mark.parametrize("stream", [False, True])
async def test_sampled_token_is_in_top_logprobs(stack: Stack, hf, hf_tok, stream: bool):
    client, tap = await tapped(stack)
    try:
        for k, seed in [(0, 5), (2, 6)]:
            body = {
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": seed,
                "ignore_eos": True,
                "logprobs": k,
            }
            lp = await completion_logprobs(stack, body, stream)
            sequence = await tap.sequence(8)
            assert sequence[: len(PROMPT)] == PROMPT
            outside = check_positions(lp, sequence, len(PROMPT), k, hf, hf_tok)
            if k == 0:
                assert all(len(top) == 1 for top in lp["top_logprobs"])
            else:  # the case that lost the sampled token: drawn outside the k likeliest
                assert outside >= 2
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_prompt_tokens_are_in_top_logprobs(stack: Stack, hf, hf_tok, stream: bool):
    client, tap = await tapped(stack)
    try:
        body = {
            "prompt": PROMPT,
            "max_tokens": 3,
            "temperature": 1.0,
            "seed": 7,
            "ignore_eos": True,
            "logprobs": 1,
            "echo": True,
        }
        lp = await completion_logprobs(stack, body, stream)
        sequence = await tap.sequence(3)
        # the first prompt token: nothing predicts it
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][0] == hf_tok.decode(PROMPT[:1])
        rest = {key: values[1:] for key, values in lp.items()}
        outside = check_positions(rest, sequence, 1, 1, hf, hf_tok)
        assert outside >= 5  # most of a random prompt is not the likeliest next token
    finally:
        await client.close()


async def test_chat_top_logprobs_stay_exactly_the_k_likeliest(stack: Stack, hf, hf_tok):
    client, tap = await tapped(stack)
    try:
        for k in (0, 2):
            body = {
                "messages": memory_stack.MESSAGES,
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": 8,
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": k,
            }
            status, payload = await stack.post("/v1/chat/completions", body)
            assert status == 200, payload
            content = payload["choices"][0]["logprobs"]["content"]
            sequence = await tap.sequence(8)
            first = len(sequence) - 8
            rows = hf.logprobs(sequence)
            outside = 0
            for i, entry in enumerate(content):
                own, row = sequence[first + i], rows[first + i - 1]
                assert entry["token"] == hf_tok.decode([own])
                assert abs(entry["logprob"] - row[own].item()) < TOL
                top = row.topk(k)
                assert [e["token"] for e in entry["top_logprobs"]] == [
                    hf_tok.decode([t]) for t in top.indices.tolist()
                ]
                for e, value in zip(entry["top_logprobs"], top.values.tolist(), strict=True):
                    assert abs(e["logprob"] - value) < TOL
                outside += int((row > row[own]).sum()) >= k
            assert outside >= 2  # some sampled tokens were outside, and were not added
    finally:
        await client.close()
