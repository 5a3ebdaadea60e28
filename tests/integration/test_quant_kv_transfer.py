"""A quantized KV cache across the disaggregated path (issue 18): a prefill and a decode worker
with ``--kv-cache-dtype int8`` move the int8 blocks and their scales over real UCX, and the decode
worker generates what one engine with the same options generates alone; a decode worker with a
float cache refuses the int8 pull with an error that names the KV dtype, and the gateway, which
sees each worker's KV layout in its heartbeats, never sends it one."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import torch

from pdserve.services.engine.quant.kv_cache import kv_cache_spec
from tests.engine_support import make_engine
from tests.integration.stack import (
    free_port,
    log_text,
    start_nats,
    start_service,
    stop_all,
    wait_http,
)
from tests.integration.worker_client import GREEDY, MAX_TOKENS, connected, tokens

PROMPTS = [list(range(5, 45)), [7, 300, 12, 99, 45, 45, 45, 2]]
OPTIONS = {
    "dtype": "float32",
    "kv_cache_dtype": "int8",
    "num_kv_blocks": 64,
    "block_size": 16,
    "max_num_batched_tokens": 256,
    "heartbeat_seconds": 0.2,
}


def pulled_bytes(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("pdserve_kv_transfer_bytes_total")]
    return float(lines[0].split()[-1])


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    logs = tmp_path_factory.mktemp("quant-kv-logs")
    nats = start_nats(logs)
    opts = {**OPTIONS, "model": str(llama_dir)}
    ports = {name: free_port() for name in ("d-int8", "d-float", "gateway")}
    children = [
        start_service("prefill", nats.url, logs, None, {**opts, "worker_id": "p-int8"}),
        start_service(
            "decode",
            nats.url,
            logs,
            None,
            {**opts, "worker_id": "d-int8", "metrics_port": ports["d-int8"]},
        ),
        start_service(
            "decode",
            nats.url,
            logs,
            None,
            {
                **opts,
                "worker_id": "d-float",
                "kv_cache_dtype": "auto",
                "metrics_port": ports["d-float"],
            },
        ),
    ]
    gateway = start_service(
        "gateway", nats.url, logs, options={"model": str(llama_dir), "port": ports["gateway"]}
    )
    yield nats, children, ports
    stop_all([gateway, *children])
    nats.stop()


@pytest.fixture
async def gw(stack):
    nats, children, _ = stack
    async with connected(nats.url, children) as gateway:
        yield gateway
    for child in children:
        assert child.alive(), f"{child.name} died:\n{log_text(child)}"


async def test_int8_blocks_and_scales_cross_ucx_intact(gw, stack, llama_dir) -> None:
    engine = make_engine(llama_dir, **{k: OPTIONS[k] for k in ("dtype", "kv_cache_dtype")})
    expected = engine.generate(PROMPTS, GREEDY)
    spec = engine.kv_spec
    float_spec = kv_cache_spec(
        "auto", torch.float32, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim
    )
    before = pulled_bytes(stack[2]["d-int8"])
    blocks = 0
    for i, prompt in enumerate(PROMPTS):
        result = await gw.prefill("p-int8", f"q{i}", prompt)
        assert result.error is None
        assert result.kv.fingerprint["kv_dtype"] == "int8"
        items = await gw.decode("d-int8", f"q{i}", prompt, [result.first_token], result.kv)
        assert all(item.error is None for item in items)
        assert [result.first_token] + tokens(items) == expected[i]
        blocks += len(result.kv.block_ids)
    # what crossed UCX: the int8 values and their fp32 scales, a quarter of the fp32 blocks
    assert spec.quantized and spec.bytes_per_block < float_spec.bytes_per_block / 3
    assert pulled_bytes(stack[2]["d-int8"]) - before == blocks * spec.bytes_per_block
    assert len(expected[0]) == MAX_TOKENS
    await gw.until_idle("p-int8", "d-int8")


async def test_float_decode_worker_refuses_an_int8_pull(gw) -> None:
    result = await gw.prefill("p-int8", "mixed", PROMPTS[0])
    items = await gw.decode("d-float", "mixed", PROMPTS[0], [result.first_token], result.kv)
    assert items[-1].finish_reason == "error" and items[-1].error_code == "kv_transfer"
    assert "kv_dtype" in items[-1].error and "int8" in items[-1].error
    assert tokens(items) == []
    await gw.until_idle("p-int8", "d-float")


def complete(base: str, prompt: list[int]) -> dict:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


async def test_gateway_sends_int8_blocks_only_to_int8_decode_workers(gw, stack) -> None:
    """d-float is idle and d-int8 busy with the same requests, yet every pull lands on d-int8:
    the gateway pairs workers by the KV layout their heartbeats carry."""
    ports = stack[2]
    base = f"http://127.0.0.1:{ports['gateway']}"
    await asyncio.to_thread(wait_http, f"{base}/health")
    await gw.until_idle("p-int8", "d-int8", "d-float")
    before = {w: pulled_bytes(ports[w]) for w in ("d-int8", "d-float")}
    prompts = [[5 + i] + list(range(50, 80)) for i in range(6)]
    answers = await asyncio.gather(*(asyncio.to_thread(complete, base, p) for p in prompts))
    assert all(a["usage"]["completion_tokens"] == 4 for a in answers)
    assert pulled_bytes(ports["d-int8"]) > before["d-int8"]
    assert pulled_bytes(ports["d-float"]) == before["d-float"]
