"""Prefill and decode workers as real processes, driven over a real nats-server by a test client
that speaks the gateway's side of the protocol. KV moves over real UCX on loopback; HF
transformers (float64) is the oracle for every generated token."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from pdserve.shared.bus.lease_messages import ReleaseLease
from pdserve.shared.bus.request_messages import Cancel, PrefillRequest
from pdserve.shared.kv.layout import prefix_block_hashes
from pdserve.shared.sampling import SamplingParams
from tests.integration.stack import (
    Child,
    NatsServer,
    log_text,
    start_nats,
    start_service,
    stop_all,
    wait_until,
)
from tests.integration.worker_client import GREEDY, MAX_TOKENS, connected, tokens
from tests.oracle import hf_greedy
from tests.otlp_receiver import OtlpReceiver

LEASE_SECONDS = 3.0
PROMPTS = [
    list(range(5, 45)),  # 40 tokens: 3 blocks, the last one partial
    [7, 300, 12, 99, 45, 45, 45, 2],
    list(range(100, 132)),  # exactly 2 full blocks
]
WORKER_OPTIONS = {
    "dtype": "float64",  # greedy ties cannot flip between engine and oracle
    "num_kv_blocks": 64,
    "block_size": 16,
    "max_num_batched_tokens": 256,
    "heartbeat_seconds": 0.2,
    "lease_seconds": LEASE_SECONDS,
}


@pytest.fixture(scope="module")
def expected(llama_dir) -> list[list[int]]:
    return hf_greedy(llama_dir, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    """nats-server, prefill p0, decode d0 (kv failure: fail) and d1 (kv failure: recompute)."""
    logs = tmp_path_factory.mktemp("worker-logs")
    nats = start_nats(logs)
    traces = OtlpReceiver()
    traces.start_in_thread()
    opts = {**WORKER_OPTIONS, "model": str(llama_dir)}
    env = traces.env()
    children = [
        start_service("prefill", nats.url, logs, env, {**opts, "worker_id": "p0"}),
        start_service("decode", nats.url, logs, env, {**opts, "worker_id": "d0"}),
        start_service(
            "decode",
            nats.url,
            logs,
            env,
            {**opts, "worker_id": "d1", "kv_failure_policy": "recompute"},
        ),
        start_service("prefill", nats.url, logs, env, {**opts, "worker_id": "p-drain"}),
        # room for two of the test prompts at a time: the rest wait for blocks
        start_service(
            "decode", nats.url, logs, env, {**opts, "worker_id": "d-small", "num_kv_blocks": 6}
        ),
    ]
    yield Stack(nats, children, logs, opts, traces)
    stop_all(children)
    nats.stop()
    traces.stop_in_thread()


@dataclass
class Stack:
    nats: NatsServer
    children: list[Child]
    logs: Path
    options: dict
    traces: OtlpReceiver


@pytest.fixture
async def gw(stack):
    # p-drain leaves for good in its drain test
    children = [c for c in stack.children if c.name != "p-drain" or c.popen.returncode is None]
    async with connected(stack.nats.url, children) as gateway:
        yield gateway
    for child in children:
        assert child.alive() or child.name == "p-drain", f"{child.name} died:\n{log_text(child)}"


async def test_disaggregated_greedy_matches_hf(gw, expected) -> None:
    """Prefill on p0, pull over UCX, decode on d0: token for token what HF generates."""

    async def one(i: int, prompt: list[int]) -> list[int]:
        rid = f"dis-{i}"
        result = await gw.prefill("p0", rid, prompt)
        assert result.error is None and result.finish_reason is None
        assert result.kv.num_tokens == len(prompt)
        assert len(result.kv.block_ids) == -(-len(prompt) // 16)
        items = await gw.decode("d0", rid, prompt, [result.first_token], result.kv)
        assert all(item.error is None for item in items)
        assert items[-1].finish_reason == "length"
        return [result.first_token] + tokens(items)

    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    assert outputs == expected
    # one TokenBatch per step for this inbox: concurrent requests share messages
    dis = [b for b in gw.batches if any(it.bus_id.startswith("dis-") for it in b.items)]
    assert any(len(b.items) > 1 for b in dis)
    assert all(len({it.bus_id for it in b.items}) == len(b.items) for b in dis)
    # leases released by the decode side's ReleaseLease, well before they would expire
    await gw.until_idle("p0", "d0", timeout=LEASE_SECONDS - 1.0)


async def test_one_trace_across_workers_with_phase_spans(gw, stack) -> None:
    """The traceparent in NATS headers makes every worker phase a child of the caller's span;
    prompts arriving together share a prefill forward pass."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
    prompts = [[20 + i] * (10 + 7 * i) for i in range(6)]
    results = await asyncio.gather(
        *(gw.prefill("p0", f"tr-{i}", p, headers=headers) for i, p in enumerate(prompts))
    )
    await asyncio.gather(
        *(
            gw.decode("d0", f"tr-{i}", p, [r.first_token], r.kv, headers=headers)
            for i, (p, r) in enumerate(zip(prompts, results, strict=True))
        )
    )
    phases = {"prefill.queue", "prefill.forward", "kv.transfer", "decode.queue", "decode.generate"}

    def complete(spans) -> bool:
        ours = [s for s in spans if s.trace_id == trace_id]
        return all(
            phases <= {s.name for s in ours if s.attributes.get("pdserve.request_id") == f"tr-{i}"}
            for i in range(len(prompts))
        )

    spans = [s for s in await stack.traces.wait_for(complete, 20) if s.trace_id == trace_id]
    assert all(s.parent_span_id == parent for s in spans)
    assert {s.service for s in spans} == {"pdserve-prefill", "pdserve-decode"}
    forwards = [s for s in spans if s.name == "prefill.forward"]
    assert max(s.attributes["pdserve.batch_size"] for s in forwards) >= 2  # packed prompts
    for s in forwards:
        assert s.attributes["pdserve.batch_tokens"] >= 10
    for i, r in enumerate(results):
        (kv,) = [
            s
            for s in spans
            if s.name == "kv.transfer" and s.attributes["pdserve.request_id"] == f"tr-{i}"
        ]
        assert kv.attributes["pdserve.kv.blocks"] == len(r.kv.block_ids)
        assert (
            kv.attributes["pdserve.kv.bytes"] > 0 and kv.attributes["pdserve.kv.transport"] == "ucx"
        )
        (gen,) = [
            s
            for s in spans
            if s.name == "decode.generate" and s.attributes["pdserve.request_id"] == f"tr-{i}"
        ]
        assert gen.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS - 1
    await gw.until_idle("p0", "d0")


async def test_local_prefill_matches_hf(gw, expected) -> None:
    """kv=None: the decode worker prefills itself (short prompts, aggregated mode)."""
    outputs = await asyncio.gather(
        *(gw.decode("d1", f"local-{i}", p, [], None) for i, p in enumerate(PROMPTS))
    )
    assert [tokens(items) for items in outputs] == expected
    await gw.until_idle("d1")


async def test_prefix_cache_hits_are_reported_and_published(gw, stack, expected) -> None:
    """A prompt seen before reuses its full blocks, on a prefill worker and on a decode worker
    prefilling locally: the first answer says how many prompt tokens came from the cache, the
    tokens stay HF's, and the worker's KV events tell the registry (the router's signal)."""
    prompt = PROMPTS[0]  # 40 tokens: two full blocks are reusable (the last token never is)
    hashes = prefix_block_hashes(prompt, 16)
    one = replace(GREEDY, max_tokens=1)  # done at the first token: no lease to wait for
    await gw.prefill("p0", "pc-0", prompt, one)
    again = await gw.prefill("p0", "pc-1", prompt, one)
    assert again.cached_tokens == 32 and again.first_token == expected[0][0]
    for rid in ("pc-2", "pc-3"):
        items = await gw.decode("d1", rid, prompt, [], None)
        assert tokens(items) == expected[0]
    assert items[0].cached_tokens == 32
    assert all(item.cached_tokens is None for item in items[1:])
    for worker in ("p0", "d1"):
        await until(lambda w=worker: gw.registry.prefix_hits(w, hashes) == 2, f"{worker}'s events")
    # the prefill.forward spans say how much of the prompt came from the cache
    wanted = {"pc-1", "pc-3"}

    def forwards(spans) -> dict:
        return {
            s.attributes["pdserve.request_id"]: s.attributes["pdserve.cached_tokens"]
            for s in spans
            if s.name == "prefill.forward" and s.attributes.get("pdserve.request_id") in wanted
        }

    assert forwards(await stack.traces.wait_for(lambda s: set(forwards(s)) == wanted, 20)) == {
        "pc-1": 32,
        "pc-3": 32,
    }
    await gw.until_idle("p0", "d1")


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_full_cache_queues_pulls_until_blocks_free(gw, stack, expected) -> None:
    """d-small has 6 blocks; each request needs 3 (40-token prompt + 8 tokens): the third waits
    for blocks instead of failing, then pulls and generates the same tokens."""
    prompt = PROMPTS[0]
    results = [await gw.prefill("p0", f"small-{i}", prompt) for i in range(3)]
    outputs = await asyncio.gather(
        *(
            gw.decode("d-small", f"small-{i}", prompt, [r.first_token], r.kv)
            for i, r in enumerate(results)
        )
    )
    for r, items in zip(results, outputs, strict=True):
        assert [r.first_token] + tokens(items) == expected[0]
    (small,) = [c for c in stack.children if c.name == "d-small"]
    assert "small-2 waits for KV blocks" in log_text(small, tail=100_000)
    await gw.until_idle("p0", "d-small", timeout=LEASE_SECONDS - 1.0)


async def test_seeded_sampling_is_the_same_split_or_not(gw) -> None:
    """Sampling noise depends on (seed, output index) only, so a seeded request samples the
    same tokens whether prefill and decode run on one worker or on two."""
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = PROMPTS[1]
    local = tokens(await gw.decode("d1", "seeded-local", prompt, [], None, sampling=sp))
    result = await gw.prefill("p0", "seeded-split", prompt, sp)
    split = await gw.decode(
        "d0", "seeded-split", prompt, [result.first_token], result.kv, sampling=sp
    )
    assert [result.first_token] + tokens(split) == local
    other = replace(sp, seed=4321)
    assert tokens(await gw.decode("d1", "seeded-other", prompt, [], None, sampling=other)) != local


async def test_lease_expiry_frees_unpulled_kv(gw) -> None:
    result = await gw.prefill("p0", "never-pulled", PROMPTS[0])
    assert result.kv is not None
    await asyncio.sleep(0.5)
    load = gw.load("p0")
    assert load.total_blocks - load.free_blocks == len(result.kv.block_ids)
    # nobody pulls or releases: the lease runs out and the blocks come back
    await gw.until_idle("p0", timeout=LEASE_SECONDS + 2.0)


async def test_failed_pull_fail_policy_sends_error_not_text(gw) -> None:
    result = await gw.prefill("p0", "pull-fails", PROMPTS[1])
    await gw.bus.publish(gw.bus.subjects.lease("p0"), ReleaseLease("pull-fails"))  # lease gone
    await gw.until_idle("p0")
    items = await gw.decode("d0", "pull-fails", PROMPTS[1], [result.first_token], result.kv)
    assert len(items) == 1 and tokens(items) == []
    assert items[0].finish_reason == "error" and items[0].error_code == "kv_transfer"
    assert "no lease" in items[0].error
    await gw.until_idle("d0")


async def test_failed_pull_recompute_policy_still_matches_hf(gw, expected) -> None:
    result = await gw.prefill("p0", "pull-recompute", PROMPTS[1])
    await gw.bus.publish(gw.bus.subjects.lease("p0"), ReleaseLease("pull-recompute"))
    items = await gw.decode("d1", "pull-recompute", PROMPTS[1], [result.first_token], result.kv)
    assert [result.first_token] + tokens(items) == expected[1]
    await gw.until_idle("p0", "d1")


async def test_layout_mismatch_fails_and_releases_the_lease(gw) -> None:
    result = await gw.prefill("p0", "mismatch", PROMPTS[0])
    kv = replace(result.kv, fingerprint={**result.kv.fingerprint, "head_dim": 64})
    items = await gw.decode("d0", "mismatch", PROMPTS[0], [result.first_token], kv)
    assert items[-1].error_code == "kv_transfer" and "head_dim" in items[-1].error
    await gw.until_idle("p0", "d0", timeout=LEASE_SECONDS - 1.0)


async def test_cancel_mid_stream_frees_blocks_on_both_workers(gw) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    result = await gw.prefill("p0", "cancel-me", PROMPTS[0], long)
    await gw.send_decode(
        "d0", "cancel-me", PROMPTS[0], [result.first_token], result.kv, sampling=long
    )
    first = await asyncio.wait_for(gw.queue("cancel-me").get(), 20)
    assert first.token_ids and first.error is None
    await gw.bus.publish(gw.bus.subjects.cancel, Cancel("cancel-me"))
    await gw.until_idle("p0", "d0")
    # and a request cancelled while its KV waits under a lease frees at once
    await gw.prefill("p0", "cancel-leased", PROMPTS[0])
    await gw.bus.publish(gw.bus.subjects.cancel, Cancel("cancel-leased"))
    await gw.until_idle("p0", timeout=LEASE_SECONDS - 1.0)


async def test_cancel_that_overtakes_its_request(gw) -> None:
    """A cancel can arrive before the request it cancels (separate subscriptions): the request
    is then dropped instead of generating for nobody."""
    await gw.bus.publish(gw.bus.subjects.cancel, Cancel("overtaken"))
    await gw.bus.flush()
    await asyncio.sleep(0.2)
    await gw.send_decode("d0", "overtaken", PROMPTS[0], [], None)
    probe = await gw.decode("d0", "probe", PROMPTS[1], [], None)  # handled after "overtaken"
    assert probe[-1].finish_reason == "length"
    await gw.until_idle("d0")
    assert gw.queue("overtaken").empty()


async def test_deadlines(gw) -> None:
    # already past: refused without touching the engine
    items = await gw.decode("d0", "late", PROMPTS[1], [], None, deadline=time.time() - 1)
    assert items[-1].error_code == "deadline"
    result = await gw.prefill("p0", "late-p", PROMPTS[1], deadline=time.time() - 1)
    assert result.error_code == "deadline" and result.kv is None
    # passing mid-generation: the answer is not cut off (the deadline bounds the wait for the
    # first token; past it the gateway judges stalls and cancels), and its blocks are freed
    long = SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True)
    t0 = time.time()
    items = await gw.decode("d0", "slow", PROMPTS[1], [], None, sampling=long, deadline=t0 + 0.3)
    assert time.time() - t0 > 0.3 + 0.25  # 450 tokens outlast the deadline and a check after it
    assert items[-1].finish_reason == "length" and len(tokens(items)) == 450
    assert not any(item.error_code for item in items)
    await gw.until_idle("d0")


async def test_bad_bus_input_is_ignored(gw, expected) -> None:
    nc = gw.bus.nc
    for subject in (gw.bus.subjects.prefill("p0"), gw.bus.subjects.decode("d0")):
        await nc.publish(subject, b"\x81\xa1v\x01")  # a map with a version and nothing else
        await nc.publish(subject, b"not msgpack at all")
    # replies only ever go to gateway inboxes
    sneaky = PrefillRequest("sneaky", PROMPTS[1], GREEDY, "pdserve.cancel", time.time() + 30)
    await gw.bus.publish(gw.bus.subjects.prefill("p0"), sneaky)
    # a well-formed request the model cannot serve gets an error, not a crash
    result = await gw.prefill("p0", "bad-token", [5, 10_000])
    assert result.error_code == "invalid" and "token ids" in result.error
    # and the workers still serve
    result = await gw.prefill("p0", "after-junk", PROMPTS[1])
    items = await gw.decode("d0", "after-junk", PROMPTS[1], [result.first_token], result.kv)
    assert [result.first_token] + tokens(items) == expected[1]
    assert gw.queue("sneaky").empty()


async def test_workers_survive_a_nats_restart(gw, stack, expected) -> None:
    stack.nats.restart(down_seconds=1.0)  # blocks the loop: every client sees the outage
    # everyone reconnects by themselves; the workers republish their load at once
    deadline = time.monotonic() + 20
    while not (gw.bus.stats.reconnects and all(gw.load(w) for w in ("p0", "d0", "d1"))):
        assert time.monotonic() < deadline, [gw.load(w) for w in ("p0", "d0", "d1")]
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # subscriptions are restored with the reconnect
    result = await gw.prefill("p0", "after-restart", PROMPTS[2])
    items = await gw.decode("d0", "after-restart", PROMPTS[2], [result.first_token], result.kv)
    assert [result.first_token] + tokens(items) == expected[2]
    # p0 announced its reconnect (WorkerGone rejoining): d0 kept its UCX endpoint to p0, whose
    # twin p0 sends on - aborting it failed pulls until p0 noticed
    (d0,) = [c for c in stack.children if c.name == "d0"]
    assert "was stale" not in log_text(d0, 100_000)


async def test_prefill_sigterm_waits_for_its_leases(gw, stack, expected) -> None:
    """A draining prefill worker refuses new prompts (retryable) but keeps serving the KV it
    holds under lease; it leaves once that was pulled."""
    (worker,) = [c for c in stack.children if c.name == "p-drain"]
    result = await gw.prefill("p-drain", "leased-at-sigterm", PROMPTS[0])
    worker.signal(signal.SIGTERM)
    while not gw.load("p-drain").draining:
        await asyncio.sleep(0.01)
    refused = await gw.prefill("p-drain", "after-sigterm", PROMPTS[1])
    assert refused.error_code == "draining" and refused.kv is None
    await asyncio.sleep(0.5)
    assert worker.alive()  # still holding a lease
    items = await gw.decode("d0", "leased-at-sigterm", PROMPTS[0], [result.first_token], result.kv)
    assert [result.first_token] + tokens(items) == expected[0]
    assert await asyncio.get_running_loop().run_in_executor(None, worker.wait, 10) == 0
    assert gw.load("p-drain") is None  # deregistered with WorkerGone


async def test_sigterm_drains_then_deregisters(gw, stack) -> None:
    worker = start_service(
        "decode", stack.nats.url, stack.logs, options={**stack.options, "worker_id": "d-drain"}
    )
    try:
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: wait_until(lambda: gw.load("d-drain"), 120, "d-drain heartbeat")
        )
        n = 400
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        await gw.send_decode("d-drain", "in-flight", PROMPTS[0], [], None, sampling=sp)
        first = await asyncio.wait_for(gw.queue("in-flight").get(), 20)
        worker.signal(signal.SIGTERM)
        while not gw.load("d-drain").draining:  # announced at once, not at the next beat
            await asyncio.sleep(0.01)
        refused = await gw.decode("d-drain", "too-late", PROMPTS[1], [], None)
        assert refused[-1].error_code == "draining"
        rest = await gw.items("in-flight")
        assert rest[-1].finish_reason == "length"
        assert len(tokens([first, *rest])) == n  # finished in full despite the SIGTERM
        # deregistered at once (WorkerGone), not after the registry timeout
        await asyncio.sleep(0.5)
        assert gw.load("d-drain") is None
        assert await asyncio.get_running_loop().run_in_executor(None, worker.wait, 10) == 0
    finally:
        worker.stop()
