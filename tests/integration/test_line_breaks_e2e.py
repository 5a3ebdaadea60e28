"""A real model emits U+2028, U+2029 and U+0085, and httpx's own line iterator (guidellm's
reader, which splits lines like ``str.splitlines``) still reads every SSE event whole.

The tiny llama checkpoint gets a word-level tokenizer in which every ordinary token decodes to
text ending in one of those characters, so whatever the random weights generate, the stream
carries them. One decode worker (prefilling locally), `pdserve gateway`, real NATS.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx2
import pytest
from tokenizers import Tokenizer, decoders, models

from tests.integration.stack import free_port, start_nats, start_service, stop_all, wait_http

BREAKS = ("\u2028", "\u2029", "\x85")
MAX_TOKENS = 24
WORKER_OPTIONS = {
    "dtype": "float32",
    "num_kv_blocks": 16,
    "block_size": 16,
    "max_num_batched_tokens": 256,
    "heartbeat_seconds": 0.2,
}


@pytest.fixture(scope="module")
def breaking_model(tmp_path_factory, llama_dir) -> Path:
    out = tmp_path_factory.mktemp("breaks") / "breaking-model"
    shutil.copytree(llama_dir, out)
    vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
    vocab = {"<s>": 0, "</s>": 1}  # the checkpoint's BOS and EOS ids
    vocab.update({f"t{i}{BREAKS[i % 3]}": i for i in range(2, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.decoder = decoders.Fuse()  # tokens joined as they are, no spaces
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory, breaking_model):
    logs = tmp_path_factory.mktemp("breaks-logs")
    nats = start_nats(logs)
    port = free_port()
    decode = start_service(
        "decode", nats.url, logs, options={**WORKER_OPTIONS, "model": str(breaking_model)}
    )
    gateway = start_service(
        "gateway", nats.url, logs, options={"model": str(breaking_model), "port": port}
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/health", timeout=180, children=[decode, gateway])
        yield base
    finally:
        stop_all([gateway, decode])
        nats.stop()


async def test_a_model_emitting_line_separators_streams_whole_events(stack):
    body = {
        "model": "breaking-model",
        "prompt": [5, 6, 7, 8, 9],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.monotonic()
    async with httpx2.AsyncClient(timeout=120) as http:
        reply = (await http.post(stack + "/v1/completions", json=body)).json()
        expected = reply["choices"][0]["text"]
        stream = {**body, "stream": True}
        stream["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        events = []
        async with http.stream("POST", stack + "/v1/completions", json=stream) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                assert not line or line.startswith("data: "), line  # no line cut in two
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
    assert any(c in expected for c in BREAKS), expected  # the model did emit them
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == MAX_TOKENS
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert time.monotonic() - started < 120
