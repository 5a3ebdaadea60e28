"""A quantized KV cache across the disaggregated path (issue 18): a prefill and a decode worker
with ``--kv-cache-dtype int8`` move the int8 blocks and their scales over real UCX, and the decode
worker generates what one engine with the same options generates alone; a decode worker with a
float cache refuses the int8 pull with an error that names the KV dtype."""

from __future__ import annotations

import socket
import urllib.request

import pytest
import torch

from services.engine.quant.kv_cache import kv_cache_spec
from tests.engine_support import make_engine
from tests.integration.stack import log_text, start_nats, start_service, stop_all
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pulled_bytes(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("pdserve_kv_transfer_bytes_total")]
    return float(lines[0].split()[-1])


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    logs = tmp_path_factory.mktemp("quant-kv-logs")
    nats = start_nats(logs)
    opts = {**OPTIONS, "model": str(llama_dir)}
    metrics_port = free_port()
    children = [
        start_service("prefill", nats.url, logs, None, {**opts, "worker_id": "p-int8"}),
        start_service(
            "decode",
            nats.url,
            logs,
            None,
            {**opts, "worker_id": "d-int8", "metrics_port": metrics_port},
        ),
        start_service(
            "decode",
            nats.url,
            logs,
            None,
            {**opts, "worker_id": "d-float", "kv_cache_dtype": "auto"},
        ),
    ]
    yield nats, children, metrics_port
    stop_all(children)
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
    float_spec = kv_cache_spec("auto", torch.float32, spec.num_layers, spec.block_size,
                               spec.num_kv_heads, spec.head_dim)  # fmt: skip
    before = pulled_bytes(stack[2])
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
    assert pulled_bytes(stack[2]) - before == blocks * spec.bytes_per_block
    assert len(expected[0]) == MAX_TOKENS
    await gw.until_idle("p-int8", "d-int8")


async def test_float_decode_worker_refuses_an_int8_pull(gw) -> None:
    result = await gw.prefill("p-int8", "mixed", PROMPTS[0])
    items = await gw.decode("d-float", "mixed", PROMPTS[0], [result.first_token], result.kv)
    assert items[-1].finish_reason == "error" and items[-1].error_code == "kv_transfer"
    assert "kv_dtype" in items[-1].error and "int8" in items[-1].error
    assert tokens(items) == []
    await gw.until_idle("p-int8", "d-float")
