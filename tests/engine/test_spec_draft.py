"""Draft-model speculation (``--speculative draft``) in the engine: the target's greedy tokens
(HF's) whatever the draft proposes, the plain sampler's law at temperature > 0, seeded requests
reproducible, the draft's own cache filled locally after a pull and emptied when sequences
leave, and a draft with another vocabulary refused at start-up in one line.

Drafts: the target itself (everything accepted), and the target with its weights perturbed,
right about half of the time, so rejections roll back both caches (a tiny random model cut to
fewer layers agrees with it on almost nothing)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.shared.errors import StartupError
from pdserve.shared.sampling import SamplingParams
from tests.engine.test_engine_lifecycle import all_free, prefill_one, pull
from tests.engine.test_spec_engine import GREEDY, repeating_prompts, run
from tests.engine.test_spec_rejection import PROMPT, assert_same_law, save_tiny_vocab_model
from tests.engine_support import make_engine, run_staggered, step_outputs
from tests.oracle import hf_greedy

FIXED_K = {"speculative": "draft", "spec_token_cost": 0.0}


def shrink(source: Path, out: Path, layers: int, noise: float, seed: int = 5) -> Path:
    """A draft made from ``source``: its first ``layers`` layers, weights perturbed by
    ``noise`` (relative), saved with the same tokenizer files."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp(min=1e-3))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory) -> Path:
    return shrink(llama_dir, tmp_path_factory.mktemp("draft"), layers=2, noise=0.05)


def draft_engine(target: Path, draft: Path, **options):
    return make_engine(target, draft_model=str(draft), **{**FIXED_K, **options})


def draft_free(engine) -> bool:
    proposer = engine.speculator.proposer
    return proposer.blocks.num_free_blocks == proposer.blocks.num_blocks and not proposer.seqs


def test_greedy_is_the_target_s_whatever_the_draft(llama_dir, draft_dir):
    prompts = repeating_prompts(6, seed=1)
    expected = hf_greedy(llama_dir, prompts, GREEDY.max_tokens)
    for draft, accepted in ((draft_dir, (0.3, 0.9)), (llama_dir, (0.97, 1.0))):
        engine = draft_engine(llama_dir, draft)
        assert run_staggered(engine, prompts, GREEDY) == expected
        counters = engine.stats().spec
        rate = counters.accepted_tokens / counters.draft_tokens
        assert accepted[0] <= rate <= accepted[1], (draft, rate)
        assert all_free(engine) and draft_free(engine)


def test_preemption_controls_and_choices_match_speculation_off(llama_dir, draft_dir):
    prompts = repeating_prompts(8, seed=2, max_len=24)
    sps = [
        replace(GREEDY, stop_token_ids=[7], min_tokens=3),
        replace(GREEDY, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=2),
        replace(GREEDY, temperature=0.9, top_p=0.95, seed=11, n=2),
        replace(GREEDY, max_tokens=9),
    ] * 2
    off = run(make_engine(llama_dir, num_kv_blocks=256), prompts, sps)
    # 10 blocks of 16 for 8 sequences of up to ~90 tokens: preemption all along
    engine = draft_engine(
        llama_dir, draft_dir, num_kv_blocks=10, prefix_cache=False, max_num_batched_tokens=40
    )
    got = run(engine, prompts, sps)
    greedy = [k for k in off.tokens if sps[int(k[0][1:])].temperature == 0]
    assert {k: got.tokens[k] for k in greedy} == {k: off.tokens[k] for k in greedy}
    assert got.reasons == off.reasons
    for key, values in off.logprobs.items():
        assert got.logprobs[key] == pytest.approx(values, abs=1e-9)
    assert engine.stats().preemptions > 0 and engine.stats().spec.accepted_tokens > 0
    assert all_free(engine) and draft_free(engine)


def test_seeded_requests_reproduce_in_any_batch(llama_dir, draft_dir):
    prompts = repeating_prompts(5, seed=8)
    sp = SamplingParams(temperature=1.0, seed=21, max_tokens=20, ignore_eos=True)
    alone = [draft_engine(llama_dir, draft_dir).generate([p], sp)[0] for p in prompts[:2]]
    together = draft_engine(llama_dir, draft_dir).generate(prompts, sp)
    assert together[:2] == alone


def test_the_decode_side_prefills_the_draft_after_a_pull(llama_dir, draft_dir):
    prefill = make_engine(llama_dir, prefill_only=True, draft_model=str(draft_dir), **FIXED_K)
    assert prefill.speculator is None  # a prefill worker never loads the draft
    prompt = repeating_prompts(1, seed=7)[0]
    first = prefill_one(prefill, "a", prompt)
    decode = draft_engine(llama_dir, draft_dir)
    decode.add_request("a", prompt, GREEDY, first.new_token_ids, remote_kv=True)
    pull(decode, decode.step(), prefill, first.kv_block_ids)
    prefill.release("a")
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        tokens += [t for o in step_outputs(decode) for t in o.new_token_ids]
    assert tokens == hf_greedy(llama_dir, [prompt], GREEDY.max_tokens)[0]
    proposer = decode.speculator.proposer
    assert decode.stats().spec.accepted_tokens > 0
    assert proposer.fill_tokens >= len(prompt)  # the whole context, computed here
    assert all_free(decode) and draft_free(decode)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """An 8-token-vocabulary target and a draft of it (no tokenizer: ids only)."""
    out = tmp_path_factory.mktemp("tiny-draft")
    target = save_tiny_vocab_model(out / "target")
    return target, shrink(target, out / "draft", layers=2, noise=0.3)


def test_sampled_tokens_keep_the_plain_sampler_s_law(tiny_pair):
    target, draft = tiny_pair
    requests = 800
    options = dict(num_kv_blocks=2048, max_num_seqs=256, max_num_batched_tokens=4096)
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    off = make_engine(target, dtype="float32", **options)
    on = draft_engine(target, draft, dtype="float32", **options)
    spec = on.generate([PROMPT] * requests, [replace(sp, seed=i) for i in range(requests)])
    counters = on.stats().spec
    assert 0.2 < counters.accepted_tokens / counters.draft_tokens < 0.95  # some rejected
    plain = off.generate(
        [PROMPT] * requests, [replace(sp, seed=requests + i) for i in range(requests)]
    )
    assert_same_law(spec, plain, pair=(0, 1))


def test_a_draft_with_another_vocabulary_is_refused_at_start_up(llama_dir, tmp_path):
    from tests.checkpoints import build_checkpoint

    other = build_checkpoint("llama-gqa", tmp_path / "other")
    raw = json.loads((other / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    a, b = "the", "The"  # same size, two ids swapped
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(StartupError) as err:
        draft_engine(llama_dir, other)
    assert "maps tokens to other ids" in str(err.value) and "\n" not in str(err.value)
    config = json.loads((other / "config.json").read_text())
    size = config["vocab_size"]
    config["vocab_size"] += 8
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        StartupError, match=f"vocabulary has {size + 8} entries, the model's {size}"
    ):
        draft_engine(llama_dir, other)
    with pytest.raises(StartupError, match="^--draft-model /nowhere: no such file"):
        draft_engine(llama_dir, Path("/nowhere"))


def test_the_bench_measures_a_cut_draft_beside_off_and_ngram(llama_dir, tmp_path, capsys):
    """perf/make_draft.py cuts a draft from the target; perf/spec_bench.py runs it, small."""
    from perf import make_draft, spec_bench

    draft = make_draft.cut(llama_dir, tmp_path / "draft", layers=1)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    argv = [
        "--model",
        str(llama_dir),
        "--max-tokens",
        "6",
        "--batch1-prompts",
        "1",
        "--reps",
        "1",
        "--draft-model",
        str(draft),
        "--modes",
        "ngram",
        "draft",
    ]
    results = spec_bench.main(argv)
    assert len(results) == 6 and all(set(r.modes) == {"off", "ngram", "draft"} for r in results)
    greedy = [r for r in results if "T=" not in r.workload]
    assert all(r.modes["draft"].identical_to_off for r in greedy)
    assert any(r.modes["draft"].draft_tokens for r in results)
    assert "computed into the draft's cache here" in capsys.readouterr().out
