"""Token ids a request names are checked against the model's vocabulary at the HTTP edge, on
both endpoints and for every field that names them: an id outside it is a 400 in OpenAI's
error shape naming the field, never a 200 (or a worker's failure later).

The stack is ``test_response_models``'s: a real gateway and decode worker on an in-memory bus.
"""

from __future__ import annotations

import json

import pytest

import tests.engine.test_response_models as memory_stack
from tests.engine.test_response_models import Stack

# the real stack's fixtures, module-scoped engine included
engine_config, engine, stack = memory_stack.engine_config, memory_stack.engine, memory_stack.stack

ENDPOINTS = {
    "/v1/completions": {"prompt": "The quick", "max_tokens": 1},
    "/v1/chat/completions": {"messages": memory_stack.MESSAGES, "max_tokens": 1},
}


@pytest.fixture(scope="module")
def vocab(llama_dir) -> int:
    return json.loads((llama_dir / "config.json").read_text())["vocab_size"]


def assert_refused(status: int, payload: dict, param: str, token_id: int) -> None:
    assert status == 400, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, "invalid_token_id")
    assert str(token_id) in error["message"]


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize("stream", [False, True])
async def test_out_of_vocabulary_stop_token_ids_are_refused(
    stack: Stack, vocab: int, path: str, stream: bool
):
    base = {**ENDPOINTS[path], "stream": stream}
    for ids, bad in [([vocab], vocab), ([3, vocab + 1000], vocab + 1000)]:
        status, payload = await stack.post(path, {**base, "stop_token_ids": ids})
        assert_refused(status, payload, "stop_token_ids", bad)
    # the same shape as for logit_bias, which the same check covers
    status, payload = await stack.post(path, {**base, "logit_bias": {str(vocab): 1}})
    assert_refused(status, payload, "logit_bias", vocab)
    # the vocabulary's last id is in it
    response = await stack.client.post(
        path, json={"model": stack.model, **base, "stop_token_ids": [vocab - 1]}
    )
    assert response.status == 200, await response.text()
    await response.read()


async def test_out_of_vocabulary_prompt_ids_name_their_prompt(stack: Stack, vocab: int):
    body = {"prompt": [[1, 2], [3, vocab]], "max_tokens": 1}
    status, payload = await stack.post("/v1/completions", body)
    assert_refused(status, payload, "prompt[1]", vocab)
