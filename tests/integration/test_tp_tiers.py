"""Issue 33 at tensor parallelism, through real processes (``pdserve up``, NATS, UCX, gloo ranks):
a TP-2 prefill worker and a TP-2 decode worker, each with a pool far below the working set and a
host-memory tier. Each rank stores its shard of the blocks its pool evicts, and a repeated
prefix comes back from the tier into both ranks. On the decode side the blocks a pull lands in
are blocks the pool just evicted, so rank 1 must have stored its shard before its KV agent pulls
into them. Workers compute in float64; the oracle is HF transformers on the same weights.

Then ``POST /reset_prefix_cache?reset_external=true`` (vLLM's flag) empties the tiers as well as
the pools: the prefix is computed again, not loaded. A flag that is not true or false, and
``reset_running_requests=true``, get a 400 in the OpenAI error shape.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.engine_support import random_prompts
from tests.integration.stack import free_port, free_port_range, pdserve_up
from tests.integration.test_tp import MODEL, complete
from tests.integration.test_up import metric, scrape
from tests.oracle import hf_greedy

MAX_TOKENS = 10
PREFIX = list(range(40, 72))  # two blocks of 16, shared by every other prompt


@pytest.fixture(scope="module")
def workload():
    """Prompts with the shared prefix, each followed by three that push it out of the pools."""
    tails = random_prompts(3, seed=33, max_len=20)
    # 50 tokens and 10 more: 4 blocks each, so three of them cycle the whole pool of 8
    fillers = [p + p[:1] * (50 - len(p)) for p in random_prompts(9, seed=34, max_len=50)]
    prompts = []
    for i, tail in enumerate(tails):
        prompts += [PREFIX + tail, *fillers[3 * i : 3 * i + 3]]
    return prompts


def post(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST")) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def reset(base: str, query: str) -> dict:
    """The reset's answer, once no worker is busy (a lease just released, say)."""
    deadline = time.monotonic() + 20
    while True:
        status, answer = post(f"{base}/reset_prefix_cache?{query}")
        if status == 200 or time.monotonic() > deadline:
            assert status == 200, answer
            return answer
        time.sleep(0.2)


def test_tp2_tiers_on_both_sides_match_hf(checkpoints, workload, tmp_path):
    model_dir = checkpoints[MODEL]
    want = hf_greedy(model_dir, workload, MAX_TOKENS)
    port, metrics = free_port(), free_port_range(2)
    args = [
        "--port",
        str(port),
        "--model",
        str(model_dir),
        "--dtype",
        "float64",
        "--num-kv-blocks",
        "8",
        "--kv-offload-ram-gib",
        "0.05",
        "--metrics-port",
        str(metrics),
        "--tensor-parallel-size",
        "2",
    ]
    with pdserve_up(args, tmp_path / "up.log"):
        base = f"http://127.0.0.1:{port}"
        got = [complete(base, p, f"tier-{i}") for i, p in enumerate(workload)]
        assert got == want
        prefill = scrape(f"http://127.0.0.1:{metrics}")
        decode = scrape(f"http://127.0.0.1:{metrics + 1}")
        for query, param in (
            ("reset_external=maybe", "reset_external"),
            ("reset_running_requests=true", "reset_running_requests"),
        ):
            status, answer = post(f"{base}/reset_prefix_cache?{query}")
            assert status == 400 and answer["error"]["param"] == param, answer
        answer = reset(base, "reset_external=true")
        assert {w["status"] for w in answer["workers"].values()} == {"ok"}
        assert all(w["tier_blocks"] > 0 for w in answer["workers"].values()), answer
        assert complete(base, workload[0], "after-reset") == want[0]
        after = scrape(f"http://127.0.0.1:{metrics}")
    prefix = "pdserve_worker_prefix_cache_"
    for side in (prefill, decode):  # both pools evicted cached blocks into their tier
        assert metric(side, prefix + "offloaded_total") >= 4
    # the shared prefix came back from host memory on the prefill side, not recomputed
    host_hits = prefix + 'tier_hits_total{role="prefill",tier="host"}'
    assert metric(prefill, host_hits) >= 4
    # after the reset the prefix was nowhere: computed again (the answer is HF's), no tier hit;
    # what host memory holds now came in since the reset
    assert metric(after, host_hits) == metric(prefill, host_hits)
    held = prefix + 'tier_blocks{role="prefill",tier="host"}'
    assert metric(after, held) < metric(prefill, held)
