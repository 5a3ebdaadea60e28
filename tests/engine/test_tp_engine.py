"""Tensor parallelism on the real engine: TP 2 (rank 1 a real process, gloo on CPU) generates
token for token what TP 1 and HF generate, for a model whose KV heads split over the ranks and
one whose only KV head both ranks replicate; seeded sampling, the prefix cache, n choices (fork
copies travel to rank 1 with the next step), structured output and log-probs are TP 1's; a TP
the heads cannot split is refused in one line, and a rank that dies makes ``step()`` raise
``RankFailed`` naming it. Quantization and speculation at TP 2: test_tp_features.py.

Only one TP engine may live in a process at a time (rank 0 joins torch.distributed's default
process group), so tests take theirs from ``TPEngines``, which keeps the last one for the next
test with the same options and closes it otherwise."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.parallel.group import RankFailed
from pdserve.shared.errors import StartupError
from pdserve.shared.kv.tp_layout import tp_problem
from pdserve.shared.sampling import SamplingParams
from tests.engine.test_engine_lifecycle import all_free
from tests.engine.test_fork import SEEDED
from tests.engine.test_guided_engine import GUIDES, _sampling, assert_valid, text_of
from tests.engine.test_logprobs import drain, joined_logprobs, the_prompt_logprobs
from tests.engine_support import make_engine, random_prompts, run_staggered
from tests.oracle import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHARED = {"num_kv_blocks": 256}  # the options of the engines most tests share
MHA = "llama-mha-tied"  # 4 KV heads: two on each rank


class TPEngines:
    """The process's one TP engine: reused while tests ask for the same options, closed (its
    rank processes stopped) before another starts and when the module ends."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.engine: LLMEngine | None = None

    def get(self, model_dir: Path, fresh: bool = False, tp: int = 2, **options) -> LLMEngine:
        key = (str(model_dir), tp, sorted(options.items()))
        e = self.engine
        if fresh or key != self.key or e is None or e.ranks.failure or e.has_unfinished():
            self.close()  # before the next one joins the process group
            self.engine = make_engine(model_dir, tensor_parallel_size=tp, **options)
            self.key = key
        return self.engine

    def close(self) -> None:
        engine, self.engine, self.key = self.engine, None, None
        if engine is not None:
            engine.close()


@pytest.fixture(scope="module")
def tp():
    engines = TPEngines()
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def tp1(checkpoints):
    """TP 1 engines with ``SHARED`` options, one per checkpoint, built on first use."""
    built: dict[str, LLMEngine] = {}

    def get(name: str) -> LLMEngine:
        if name not in built:
            built[name] = make_engine(checkpoints[name], **SHARED)
        return built[name]

    return get


def sent_steps(engine: LLMEngine, monkeypatch) -> list:
    """Every StepInputs rank 0 sends the other ranks from now on."""
    sent: list = []
    real = engine.ranks.send_step
    monkeypatch.setattr(
        engine.ranks, "send_step", lambda inputs: sent.append(inputs) or real(inputs)
    )
    return sent


# ---- greedy: TP 1's and HF's tokens -----------------------------------------------------------


@pytest.mark.parametrize(("variant", "kv_heads"), [(MHA, (0, 2)), ("qwen2-bias", (0, 1))])
def test_greedy_matches_tp1_and_hf_with_staggered_arrivals(
    checkpoints, tp, tp1, variant, kv_heads, monkeypatch
):
    """Requests join a running batch one step apart, so decodes and prompt chunks (up to 100
    tokens, a 64-token budget) share passes. qwen2-bias has one KV head (and qkv biases): both ranks hold it."""
    model_dir = checkpoints[variant]
    prompts = [p + list(range(200, 200 + 12 * i)) for i, p in enumerate(random_prompts(6, 1))]
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    assert run_staggered(tp1(variant), prompts, GREEDY) == expected
    engine = tp.get(model_dir, **SHARED)
    assert engine.kv_heads == kv_heads and engine.ranks.ready[0]["num_blocks"] == 256
    sent = sent_steps(engine, monkeypatch)
    assert run_staggered(engine, prompts, GREEDY) == expected
    assert any(s.num_decodes and len(s.counts) > s.num_decodes for s in sent)  # mixed passes
    assert any(c > 1 and st > 0 for s in sent for c, st in zip(s.counts, s.starts, strict=True))
    assert engine.shard.reduce_calls > 0 and all_free(engine)


# ---- the shared TP 2 engine (llama-mha-tied): every feature as at TP 1 ------------------------


def test_seeded_sampling_matches_tp1(checkpoints, tp, tp1):
    prompts = random_prompts(6, seed=2, max_len=30)
    sps = [
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            top_k=(-1, 50)[i % 2],
            seed=100 + i,
            max_tokens=16,
            ignore_eos=True,
        )
        for i in range(6)
    ]
    want = tp1(MHA).generate(prompts, sps)
    assert tp.get(checkpoints[MHA], **SHARED).generate(prompts, sps) == want
    assert len({tuple(w) for w in want}) == len(want)


def test_prefix_cache_hits_give_the_same_tokens(checkpoints, tp, tp1):
    """Prompts sharing a 40-token prefix: the later ones take its two full blocks from the
    cache (block tables point at blocks rank 1 filled for the first one)."""
    base = random_prompts(1, seed=3, max_len=1)[0] + list(range(100, 139))  # 40 tokens
    prompts = [base + tail for tail in ([7, 8], [9], [11, 12, 13])]
    want = make_engine(checkpoints[MHA], prefix_cache=False).generate(prompts, GREEDY)
    engine = tp.get(checkpoints[MHA], **SHARED)
    hits = engine.stats().prefix_hits
    assert engine.generate(prompts[:1], GREEDY) == want[:1]
    assert engine.generate(prompts[1:], GREEDY) == want[1:]
    assert engine.stats().prefix_hits - hits >= 2 * 2  # two full blocks, for each later prompt
    assert all_free(engine)


def test_forked_choices_match_tp1_and_rank_1_copies_the_blocks(checkpoints, tp, tp1, monkeypatch):
    """Greedy n=3: every choice is choice 0. Seeded n=4: each choice is TP 1's. Either way a
    child's copy of the last prompt block must reach rank 1 before its first decode, or its
    half of the heads would read another block's KV."""
    prompts = random_prompts(2, seed=4, max_len=40)
    greedy = replace(GREEDY, n=3)
    want = tp1(MHA).generate(prompts, GREEDY)
    want_seeded = tp1(MHA).generate_choices(prompts, SEEDED)
    engine = tp.get(checkpoints[MHA], **SHARED)
    sent = sent_steps(engine, monkeypatch)
    assert engine.generate_choices(prompts, greedy) == [[w] * 3 for w in want]
    assert engine.generate_choices(prompts, SEEDED) == want_seeded
    copies = [c for s in sent for c in s.block_copies]
    assert len(copies) == len(prompts) * (2 + 3)  # a copy per child: 2 + 3 children per prompt
    assert not engine.runner.block_copies and all_free(engine)


def test_guided_output_matches_tp1(checkpoints, tp, tp1):
    tokenizer_dir = checkpoints[MHA]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    prompts = random_prompts(6, seed=5, max_len=20)
    kinds = ["json_schema", "regex"] * 3
    sps = [_sampling(GUIDES[k], seed, max_tokens=150) for seed, k in enumerate(kinds)]
    want = tp1(MHA).generate(prompts, sps)
    got = tp.get(checkpoints[MHA], **SHARED).generate(prompts, sps)
    assert got == want
    for kind, out in zip(kinds, got, strict=True):
        assert_valid(kind, text_of(tokenizer, out))


def test_logprobs_and_prompt_logprobs_match_tp1(checkpoints, tp, tp1):
    """Sampled tokens' log-probs (greedy and seeded) and prompt log-probs over a prompt that
    runs in two chunks: the same tokens and alternatives as TP 1, values within 1e-6."""
    prompts = [
        random_prompts(1, seed=6, max_len=1)[0] + list(range(20, 90)),
        *random_prompts(2, seed=7, max_len=30),
    ]
    sps = [
        replace(GREEDY, logprobs=3, prompt_logprobs=4),
        replace(GREEDY, temperature=0.8, seed=9, logprobs=5),
        replace(GREEDY, prompt_logprobs=0, logprobs=0),
    ]

    def outputs(engine: LLMEngine) -> dict:
        for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
            engine.add_request(f"lp{i}", p, sp)
        return drain(engine)

    want = outputs(tp1(MHA))
    got = outputs(tp.get(checkpoints[MHA], **SHARED))
    for i, sp in enumerate(sps):
        rid = f"lp{i}"
        pairs = [(joined_logprobs(got[rid]), joined_logprobs(want[rid]))]
        if sp.prompt_logprobs is not None:
            pairs.append((the_prompt_logprobs(got[rid]), the_prompt_logprobs(want[rid])))
        for g, w in pairs:
            assert (g.top_k, g.ranks, g.top_token_ids) == (w.top_k, w.ranks, w.top_token_ids)
            assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-6)
            assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-6)
    assert len(the_prompt_logprobs(got["lp0"])) == len(prompts[0]) - 1


# ---- refusals and failures --------------------------------------------------------------------


def child_pids() -> set[int]:
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return pids


@pytest.mark.parametrize(("variant", "tp_size"), [("llama-gqa", 3), ("qwen2-bias", 8)])
def test_a_tp_the_heads_cannot_split_is_refused_in_one_line(checkpoints, tp, variant, tp_size):
    tp.close()
    before = child_pids()
    heads, kv_heads = 4, {"llama-gqa": 2, "qwen2-bias": 1}[variant]
    with pytest.raises(StartupError) as err:
        tp.get(checkpoints[variant], tp=tp_size)
    message = str(err.value)
    assert message == tp_problem(heads, kv_heads, tp_size) and "\n" not in message
    assert f"{heads} attention heads" in message and f"--tensor-parallel-size {tp_size}" in message
    assert child_pids() <= before  # refused before any rank process started


def test_a_rank_that_dies_makes_step_raise_rank_failed(checkpoints, tp):
    engine = tp.get(checkpoints["llama-gqa"], fresh=True)
    engine.generate([[5, 6, 7]], GREEDY)  # a working group first
    proc = engine.ranks.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    engine.add_request("after", [8, 9, 10], GREEDY)
    start, raised = time.monotonic(), None
    while raised is None and time.monotonic() - start < 10.0:
        try:
            engine.step()  # at once after the kill: mid-collective, or the watcher has spoken
        except RankFailed as exc:
            raised = exc
    assert raised is not None, "step() went on after rank 1 died"
    assert time.monotonic() - start < 5.0
    failure = engine.ranks.failure
    assert failure is not None and str(raised) == failure
    assert f"TP rank 1 (pid {proc.pid})" in failure and "-9" in failure
    with pytest.raises(RankFailed, match="TP rank 1"):
        engine.step()  # and every step after
    tp.close()
    assert proc.poll() is not None
