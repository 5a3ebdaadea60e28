"""Issue 33 at tensor parallelism, through real processes (``pdserve up``, NATS, UCX, gloo ranks):
a TP-2 prefill worker and a TP-2 decode worker, each with a pool far below the working set and a
host-memory tier. Each rank stores its shard of the blocks its pool evicts, and a repeated
prefix comes back from the tier into both ranks. On the decode side the blocks a pull lands in
are blocks the pool just evicted, so rank 1 must have stored its shard before its KV agent pulls
into them. Workers compute in float64; the oracle is HF transformers on the same weights.
"""

from __future__ import annotations

import pytest

from tests.engine_support import random_prompts
from tests.integration.stack import free_port, pdserve_up
from tests.integration.test_tp import MODEL, complete
from tests.integration.test_up import free_port_range, metric, scrape
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


def test_tp2_tiers_on_both_sides_match_hf(checkpoints, workload, tmp_path):
    model_dir = checkpoints[MODEL]
    want = hf_greedy(model_dir, workload, MAX_TOKENS)
    port, metrics = free_port(), free_port_range(2)
    args = ["--port", str(port), "--model", str(model_dir), "--dtype", "float64",
            "--num-kv-blocks", "8", "--kv-offload-ram-gib", "0.05",
            "--metrics-port", str(metrics), "--tensor-parallel-size", "2"]  # fmt: skip
    with pdserve_up(args, tmp_path / "up.log"):
        base = f"http://127.0.0.1:{port}"
        got = [complete(base, p, f"tier-{i}") for i, p in enumerate(workload)]
        assert got == want
        prefill = scrape(f"http://127.0.0.1:{metrics}")
        decode = scrape(f"http://127.0.0.1:{metrics + 1}")
    prefix = "pdserve_worker_prefix_cache_"
    for side in (prefill, decode):  # both pools evicted cached blocks into their tier
        assert metric(side, prefix + "offloaded_total") >= 4
    # the shared prefix came back from host memory on the prefill side, not recomputed
    hits = metric(prefill, prefix + 'tier_hits_total{role="prefill",tier="host"}')
    assert hits >= 4
