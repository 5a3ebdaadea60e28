"""A guided request never emits a token its grammar refuses (issue 26): a property test, 200
seeds of every kind of guide at temperature 1 on the tiny checkpoint, every output checked token
by token against its grammar. The fault itself, in the sampler's noise, and its reproduction are
pinned on the sampler alone in tests/unit/test_sampler.py; tests/integration/test_guided_smollm2.py
replays it on the real model.
"""

from __future__ import annotations

import logging
import random

from tokenizers import Tokenizer

from pdserve.shared.sampling import SamplingParams
from pdserve.shared.structured_output import compiler_for
from tests.engine_support import make_engine
from tests.guided_cases import GUIDES, assert_finished_valid, assert_tokens_obey

EOS = 1  # tests.checkpoints' tokenizer
SEEDS = range(200)


def _whitespace_bias(tokenizer: Tokenizer) -> dict:
    """At temperature 1 a random model picks JSON's optional whitespace (up to 12 per gap) as
    often as anything, and objects rarely end within max_tokens. Disfavouring it lets most
    outputs finish; the mask, applied before the bias, still decides what is allowed."""
    ids = [i for i in range(5, tokenizer.get_vocab_size()) if not tokenizer.decode([i]).strip()]
    return dict(logit_bias_token_ids=ids, logit_bias_values=[-4.0] * len(ids))


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    """request id -> (output tokens, finish_reason), every request batched together."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finished: dict[str, str] = {}
    while engine.has_unfinished():
        result = engine.step()
        for out in result.outputs if result else ():
            tokens[out.bus_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.bus_id] = out.finish_reason
    return {rid: (tokens[rid], finished[rid]) for rid in requests}


def test_200_seeds_of_every_guide_obey_it(llama_dir, caplog):
    """Temperature 1, batched: each output's tokens are ones its grammar allowed, in order;
    "stop" outputs parse and validate, "length" ones are prefixes. The worker's warning for a
    refused token must never appear."""
    tokenizer = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    compiler = compiler_for(llama_dir, vocab, (EOS,))
    engine = make_engine(
        llama_dir,
        dtype="float32",
        num_kv_blocks=2048,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
    )
    bias = _whitespace_bias(tokenizer)
    rng = random.Random(26)
    requests = {
        f"{name}/{seed}": (
            [rng.randrange(5, vocab) for _ in range(rng.randint(1, 4))],
            SamplingParams(temperature=1.0, seed=seed, max_tokens=24, guided=guide, **bias),
        )
        for name, guide in GUIDES.items()
        for seed in SEEDS
    }
    with caplog.at_level(logging.WARNING):
        results = run(engine, requests)
    assert "broke its grammar" not in caplog.text
    stopped = dict.fromkeys(GUIDES, 0)
    for rid, (tokens, reason) in results.items():
        name = rid.split("/")[0]
        assert_tokens_obey(compiler, name, tokens, reason)
        if reason == "stop":
            stopped[name] += 1
            assert_finished_valid(name, tokenizer.decode(tokens[:-1], skip_special_tokens=False))
    # outputs of every guide end, so the parse-and-validate side is exercised for each
    assert all(n >= len(SEEDS) // 20 for n in stopped.values()), stopped
