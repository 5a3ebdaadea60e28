"""The engine's request lifecycle, driven through its commands: requests whose KV is pulled from
a prefill engine (reserve, pull, ready / failed under both policies, abort mid-pull), one
admission policy for pulled and local requests, the engine thread, and the prefix-cache feed."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from pdserve.services.engine import scheduler as scheduler_module
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.engine_thread import EngineThread
from pdserve.services.engine.outputs import StepResult
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, random_prompts, step_outputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def prefill(llama_dir) -> LLMEngine:
    return make_engine(llama_dir, prefill_only=True)


def prefill_one(prefill: LLMEngine, rid: str, prompt: list[int]):
    """Prefill ``prompt``: its first token and the parked output carrying its blocks."""
    prefill.add_request(rid, prompt, GREEDY)
    while True:
        outs = step_outputs(prefill)
        if outs:
            (out,) = outs
            assert out.finish_reason is None and out.num_kv_tokens == len(prompt)
            return out


def pull(decode: LLMEngine, result: StepResult, prefill: LLMEngine, src: list[int]) -> str:
    """What the decode worker does with a step's KVPull: copy the blocks, say ready."""
    (p,) = result.pulls
    for s, d in zip(src, p.block_ids, strict=False):
        decode.kv_cache[d].copy_(prefill.kv_cache[s])
    decode.kv_ready(p.bus_id)
    return p.bus_id


def drain(engine: LLMEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in step_outputs(engine):
            outputs.setdefault(out.bus_id, []).append(out)
    return outputs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def all_free(engine: LLMEngine) -> bool:
    s = engine.stats()
    return s.free_blocks == s.total_blocks and not (s.running or s.waiting or s.pulling)


def test_pulled_kv_generates_what_a_local_prefill_does(llama_dir, prefill) -> None:
    prompt = random_prompts(1, seed=11, max_len=40)[0] + [9] * 20
    expected = make_engine(llama_dir).generate([prompt], GREEDY)[0]
    first = prefill_one(prefill, "a", prompt)
    decode = make_engine(llama_dir)
    decode.add_request("a", prompt, GREEDY, first.new_token_ids, remote_kv=True)
    result = decode.step()  # admission reserves blocks and hands out the pull; nothing runs
    assert result.outputs == [] and result.stats.num_seqs == 0
    assert len(result.pulls[0].block_ids) == -(-len(prompt) // 16)
    assert decode.stats().pulling == 1
    assert decode.step() is None  # nothing moves until the pull answers
    pull(decode, result, prefill, first.kv_block_ids)
    prefill.release("a")
    assert first.new_token_ids + tokens(drain(decode)["a"]) == expected
    assert prefill.step() is None and all_free(prefill) and all_free(decode)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_pull_recomputes_or_errors_by_policy(llama_dir, policy) -> None:
    prompt = random_prompts(1, seed=12)[0]
    local = make_engine(llama_dir)
    expected = local.generate([prompt], GREEDY)[0]
    decode = make_engine(llama_dir, kv_failure_policy=policy)
    decode.add_request("b", prompt, GREEDY, expected[:1], remote_kv=True)
    (p,) = decode.step().pulls
    decode.kv_failed(p.bus_id, "no lease")
    outs = drain(decode)["b"]
    if policy == "recompute":
        assert expected[:1] + tokens(outs) == expected
    else:
        assert len(outs) == 1 and outs[0].finish_reason == "error" and not outs[0].new_token_ids
        assert outs[0].error == "KV transfer failed: no lease"
    assert all_free(decode)


def test_abort_mid_pull_frees_the_blocks_only_when_the_pull_answers(llama_dir) -> None:
    decode = make_engine(llama_dir, num_kv_blocks=8)
    decode.add_request("c", [5] * 40, GREEDY, [6], remote_kv=True)
    assert decode.step().pulls
    decode.abort("c")
    assert decode.step() is None
    assert decode.stats().free_blocks == 8 - 3  # the pull may still write into them
    decode.kv_ready("c")
    assert decode.step() is None  # finished quietly: an aborted request says nothing more
    assert all_free(decode)
    # a pull the worker never started (request dropped meanwhile) is answered with kv_failed
    decode.add_request("d", [5] * 40, GREEDY, [6], remote_kv=True)
    assert decode.step().pulls
    decode.abort("d")
    decode.kv_failed("d", "the request ended before its pull")
    assert decode.step() is None and all_free(decode)


def test_pulled_and_local_requests_share_one_admission_queue(llama_dir) -> None:
    """Room for one 3-block request: the next pull waits, and a local request behind it waits
    too (arrival order), until blocks come back."""
    decode = make_engine(llama_dir, num_kv_blocks=4, max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    decode.add_request("p1", [5] * 40, sp, [6], remote_kv=True)
    decode.add_request("p2", [7] * 40, sp, [8], remote_kv=True)
    decode.add_request("local", [9] * 4, sp)
    result = decode.step()
    assert [p.bus_id for p in result.pulls] == ["p1"]
    assert decode.stats().waiting == 2 and decode.stats().pulling == 1
    decode.kv_ready("p1")
    seen: list[str] = []
    while decode.has_unfinished():
        result = decode.step()
        for p in result.pulls if result else ():
            seen.append(p.bus_id)
            decode.kv_ready(p.bus_id)
        for out in result.outputs if result else ():
            if out.finish_reason:
                seen.append(out.bus_id)
    assert seen == ["p1", "p2", "p2", "local"]  # finished, admitted, finished, finished
    assert all_free(decode)


def test_a_request_finished_by_its_first_token_is_not_pulled(llama_dir) -> None:
    decode = make_engine(llama_dir)
    decode.add_request("e", [5] * 20, SamplingParams(max_tokens=1), [6], remote_kv=True)
    result = decode.step()
    assert result.pulls == [] and [(o.bus_id, o.finish_reason) for o in result.outputs] == [
        ("e", "length")
    ]
    assert all_free(decode)


def test_prefix_cache_feed_matches_the_cache(llama_dir) -> None:
    engine = make_engine(llama_dir, num_kv_blocks=6)
    feed = engine.kv_event_feed()
    engine.generate([list(range(5, 45))], GREEDY)  # 2 full prompt blocks + 1 of output
    stored, removed = feed.drain()
    assert len(stored) == 2 and removed == []
    engine.generate([list(range(100, 190))], SamplingParams(max_tokens=1))  # evicts them
    assert set(feed.snapshot()) == set(engine.block_manager.hash_to_block)
    assert feed.drain() == ([], [])


async def test_the_engine_thread_applies_commands_and_sleeps_when_idle(llama_dir) -> None:
    engine = make_engine(llama_dir)
    loop = asyncio.get_running_loop()
    results: asyncio.Queue[StepResult] = asyncio.Queue()
    steps = 0
    step = engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counting_step
    thread = EngineThread(engine, loop, results.put_nowait)
    thread.start()
    try:
        engine.add_request("t", [5, 6, 7], GREEDY)
        got: list[int] = []
        while not got or len(got) < GREEDY.max_tokens:
            got += (await asyncio.wait_for(results.get(), 30)).outputs[0].new_token_ids
        await asyncio.sleep(0.1)
        before = steps
        await asyncio.sleep(0.5)
        assert steps - before <= 1  # asleep on the command queue, not polling
        t0 = time.monotonic()
        engine.add_request("u", [5, 6, 7], SamplingParams(max_tokens=1))
        (out,) = (await asyncio.wait_for(results.get(), 30)).outputs
        assert out.finish_reason == "length" and time.monotonic() - t0 < 0.5  # woken at once
    finally:
        thread.stop()
    assert thread.error is None and all_free(engine)


def test_a_prefill_engine_serves_late_prompts_after_on_time_ones_and_counts_them(
    llama_dir, monkeypatch
) -> None:
    clock = [100.0]  # the scheduler's clock (arrivals and the deadline), moved by hand
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    # 24-token prompts and a budget of 24 tokens a step: one prompt a step, so the order of
    # first tokens is the order of admission
    engine = make_engine(
        llama_dir, prefill_only=True, max_num_batched_tokens=24, prompt_deadline_ms=200.0
    )
    prompt = [5 + i for i in range(24)]
    for rid in ("a", "b", "c"):
        engine.add_request(rid, prompt, GREEDY)
    order = [o.bus_id for o in step_outputs(engine) if o.new_token_ids]  # "a", on time
    clock[0] += 1.0  # "b" and "c" have waited 1 s: past the deadline
    engine.add_request("fresh", prompt, GREEDY)
    while len(order) < 4:
        order += [o.bus_id for o in step_outputs(engine) if o.new_token_ids]
    assert order == ["a", "fresh", "b", "c"]
    assert engine.stats().late_prompts == 2
