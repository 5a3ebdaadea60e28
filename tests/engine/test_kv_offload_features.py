"""KV offload tiers under the engine's other features: preemption, forked choices (n > 1),
n-gram speculation (drafts rolled back), int8 and fp8 KV caches, a prefill-only engine, and
migrated requests (they come back with the tokens they had, their blocks gone meanwhile). Each
runs a workload that evicts far more than the pool holds, with tiers on (host memory and a disk
behind it) and off, and must give the same tokens - while the tiers really served prefixes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.shared.sampling import SamplingParams
from tests.engine.test_kv_offload import FILLERS, POOL, PROMPTS, SEEDED, block_gib, tiers
from tests.engine.test_spec_engine import NGRAM, repeating_prompts
from tests.engine_support import make_engine, run_staggered, step_outputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def alternate(engine, prompts, run_prompt, fill=None) -> list:
    """Each prompt, then fillers that push its blocks out of the pool."""
    outputs = []
    for i, prompt in enumerate(prompts):
        outputs.append(run_prompt(prompt, i))
        for filler in FILLERS[(3 * i) % 18 : (3 * i) % 18 + 3]:
            fill(filler) if fill is not None else engine.generate([filler], GREEDY)
    return outputs


def run(feature: str, model_dir, options: dict):
    if feature == "preemption":  # staggered arrivals over a pool that cannot hold them all
        engine = make_engine(model_dir, num_kv_blocks=10, **options)
        prompts = [x for pair in zip(PROMPTS, FILLERS[6:12], strict=True) for x in pair]
        return engine, run_staggered(engine, prompts, replace(GREEDY, max_tokens=24))
    if feature == "forks":
        engine = make_engine(model_dir, num_kv_blocks=2 * POOL, **options)
        sp = replace(SEEDED, n=3)
        return engine, alternate(engine, PROMPTS, lambda p, i: engine.generate_choices([p], sp))
    if feature == "ngram":
        engine = make_engine(model_dir, num_kv_blocks=POOL, **NGRAM, **options)
        prompts = [PROMPTS[i % 2][:64] + p for i, p in enumerate(repeating_prompts(4, seed=5))]
        sp = replace(GREEDY, max_tokens=16)
        return engine, alternate(engine, prompts, lambda p, i: engine.generate([p], sp))
    if feature == "migration":
        engine = make_engine(model_dir, num_kv_blocks=POOL, **options)
        return engine, alternate(engine, PROMPTS, lambda p, i: migrated(engine, p, i))
    if feature in ("int8", "fp8_e4m3"):
        engine = make_engine(model_dir, num_kv_blocks=POOL, kv_cache_dtype=feature, **options)
        return engine, alternate(engine, PROMPTS, lambda p, i: engine.generate([p], SEEDED))
    assert feature == "prefill_only"  # a prefill worker's engine: its first tokens
    engine = make_engine(model_dir, num_kv_blocks=POOL, prefill_only=True, **options)

    def first_token(prompt, i):  # parked once prefilled, until released
        engine.add_request(f"r{i}", prompt, GREEDY)
        while not (outs := step_outputs(engine)):  # a chunk, or a disk load, at a time
            pass
        engine.release(f"r{i}")
        step_outputs(engine)
        return [o.new_token_ids for o in outs]

    return engine, alternate(engine, PROMPTS, first_token, lambda p: first_token(p, "f"))


def migrated(engine, prompt: list[int], i: int) -> list[int]:
    """A request served whole, then again as a migrated decode leg resumes it: from its prompt
    and the 8 tokens it had sent, after fillers pushed its blocks out of the pool. The resumed
    leg must go on with the tokens the whole run had."""
    sp = replace(GREEDY, max_tokens=16)
    whole = engine.generate([prompt], sp)[0]
    for filler in FILLERS[(5 * i) % 18 : (5 * i) % 18 + 3]:
        engine.generate([filler], GREEDY)
    engine.add_request(f"migrated-{i}", prompt, sp, output_token_ids=whole[:8])
    rest: list[int] = []
    while engine.has_unfinished():
        rest += [t for out in step_outputs(engine) for t in out.new_token_ids]
    assert rest == whole[8:], i
    return whole


@pytest.mark.parametrize(
    "feature", ["preemption", "forks", "ngram", "int8", "fp8_e4m3", "prefill_only", "migration"]
)
def test_features_give_the_same_tokens_with_tiers_on(llama_dir, tmp_path, feature):
    plain, expected = run(feature, llama_dir, {})
    one = block_gib(llama_dir)
    options = {"kv_offload_ram_gib": 8 * one, "kv_offload_disk": str(tmp_path)}
    engine, out = run(feature, llama_dir, options)
    assert out == expected
    stats = tiers(engine)
    assert stats.stored > 0 and stats.host_hits + stats.disk_hits > 0
    assert stats.load_failures == 0 and stats.disk.corrupt_removed == 0
    assert engine.stats().prefix_hits > plain.stats().prefix_hits
    if feature == "preemption":
        assert engine.stats().preemptions > 0
    if feature == "ngram":
        assert engine.stats().spec.accepted_tokens > 0
    end = engine.stats()
    assert end.free_blocks == end.total_blocks and not (end.running or end.pulling)
    engine.close()
