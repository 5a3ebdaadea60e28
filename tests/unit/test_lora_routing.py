"""Multi-LoRA off the engine: the adapter in the first block's hash (equal tokens under another
adapter never name the same blocks, the base model's hashes unchanged), and the router's choice
among workers by the adapters they serve and hold."""

from __future__ import annotations

import time
from dataclasses import replace

from pdserve.gateway.router import Router
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.kv.layout import ROOT_HASH, hash_block, identity_keys, prefix_block_hashes

BS = 16
MODEL = "m"


def load(wid: str, role: str, served=(), resident=(), running: int = 0) -> WorkerLoad:
    return WorkerLoad(
        worker_id=wid,
        role=role,
        model=MODEL,
        free_blocks=100,
        total_blocks=100,
        running=running,
        waiting=0,
        ts=time.time(),
        block_size=BS,
        lora_adapters=list(served),
        lora_resident=list(resident),
    )


def test_adapter_enters_only_the_first_block_hash():
    tokens = list(range(3 * BS))
    base = prefix_block_hashes(tokens, BS)
    a = prefix_block_hashes(tokens, BS, extra_keys=identity_keys("a"))
    b = prefix_block_hashes(tokens, BS, extra_keys=identity_keys("b"))
    assert identity_keys(None) == ()
    assert base[0] == hash_block(ROOT_HASH, tokens[:BS])  # the base model's names as ever
    assert len({base[0], a[0], b[0]}) == 3
    # the chain after the first block is keyed by its parent: every block differs
    assert not set(a) & set(b) and not set(a) & set(base)
    assert a[1] == hash_block(a[0], tokens[BS : 2 * BS])


def test_router_sends_an_adapter_only_where_it_is_served_and_prefers_it_resident():
    prefill = [load("p-none", "prefill"), load("p-cold", "prefill", ["a"])]
    prefill.append(load("p-hot", "prefill", ["a"], ["a"]))
    decode = [load("d-cold", "decode", ["a"]), load("d-hot", "decode", ["a"], ["a"], running=1)]
    decode.append(load("d-none", "decode"))
    router = Router(lambda role: prefill if role == "prefill" else decode, BS, model=MODEL)
    prompt = list(range(40))
    assert router.pick_prefill(prompt, lora="a") == "p-hot"
    assert router.pick_decode(100, lora="a") == "d-hot"  # one more request beats a load
    # far busier where it is resident: the load is worth it
    decode[1] = replace(decode[1], running=10)
    assert router.pick_decode(100, lora="a") == "d-cold"
    # nobody serves it: no worker (the gateway 404s such a name before routing)
    assert router.pick_prefill(prompt, lora="zzz") is None
    assert router.pick_decode(100, lora="zzz") is None
    # the base model goes anywhere
    assert router.pick_decode(100) in {"d-cold", "d-none"}
