"""Issue 28: tensor parallelism across real processes (``pdserve up``, NATS, UCX, gloo ranks).

A prefill worker of TP Np hands its KV to a decode worker of TP Nd: every decode rank pulls its
own KV heads, head-sliced, from the prefill ranks that hold them. The tiny checkpoint has 4 KV
heads, so every layout splits them. Workers compute in float64 and the oracle is HF
transformers on the same weights. The trace shows one ``kv.transfer`` span per rank pair, and
the bytes pulled add up to exactly one copy of every head of every block.
"""

from __future__ import annotations

import json
import math
import urllib.request

import pytest

from pdserve.shared.kv.tp_layout import pull_plan
from tests.engine_support import random_prompts
from tests.integration.stack import free_port, free_port_range, pdserve_up
from tests.integration.test_up import metric, scrape
from tests.oracle import hf_greedy
from tests.otlp_receiver import OtlpReceiver

MODEL = "llama-mha-tied"  # 4 heads, 4 KV heads, head_dim 16, 2 layers
MAX_TOKENS = 10


def complete(base: str, prompt: list[int], rid: str) -> list[int]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        base + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "x-request-id": rid},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return checkpoints[MODEL]


@pytest.fixture(scope="module")
def expected(model_dir):
    prompts = random_prompts(3, seed=28)
    return prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)])
def test_pd_between_tp_sizes_matches_hf(model_dir, expected, tmp_path, prefill_tp, decode_tp):
    prompts, want = expected
    cfg = json.loads((model_dir / "config.json").read_text())
    kv_heads, layers = cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    port, metrics = free_port(), free_port_range(2)
    args = [
        "--port",
        str(port),
        "--model",
        str(model_dir),
        "--dtype",
        "float64",
        "--num-kv-blocks",
        "64",
        "--metrics-port",
        str(metrics),
        "--prefill-tensor-parallel-size",
        str(prefill_tp),
        "--decode-tensor-parallel-size",
        str(decode_tp),
    ]
    with OtlpReceiver() as rx, pdserve_up(args, tmp_path / "up.log", rx.env()):
        base = f"http://127.0.0.1:{port}"
        got = [complete(base, p, f"tp-{i}") for i, p in enumerate(prompts)]
        assert got == want
        decode = scrape(f"http://127.0.0.1:{metrics + 1}")
        # every head of every prompt block crossed once: no gather, no duplicate
        per_block = layers * 2 * 16 * kv_heads * head_dim * 8  # block_size 16, float64
        blocks = sum(math.ceil(len(p) / 16) for p in prompts)
        assert metric(decode, "pdserve_kv_transfer_bytes_total") == blocks * per_block
        pairs = {
            (rank, piece.prefill_rank, f"{piece.lo}-{piece.hi}")
            for rank in range(decode_tp)
            for piece in pull_plan(kv_heads, prefill_tp, decode_tp, rank)
        }

        def transfers(rid: str, spans) -> set:
            return {
                (
                    s.attributes["pdserve.kv.decode_rank"],
                    s.attributes["pdserve.kv.prefill_rank"],
                    s.attributes["pdserve.kv.heads"],
                )
                for s in spans
                if s.name == "kv.transfer" and s.attributes.get("pdserve.request_id") == rid
            }

        spans = rx.wait_for_sync(lambda spans: transfers("tp-2", spans) == pairs, 30)
        for i in range(len(prompts)):
            assert transfers(f"tp-{i}", spans) == pairs
            assert sum(
                s.name == "kv.transfer" and s.attributes.get("pdserve.request_id") == f"tp-{i}"
                for s in spans
            ) == len(pairs)
