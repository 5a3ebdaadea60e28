"""Structured output in the engine: the per-sequence grammar state and the step's token mask
(services/engine/guided.py), then the engine on a tiny checkpoint sampling at temperature 1
under each kind of guide, in a batch with unguided rows, split across a prefill-only engine and
a decode engine, preempted, and forked into n choices. Every finished output is parsed and
validated (jsonschema for schemas), so a mask that lets one wrong token through fails."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from tokenizers import Tokenizer

from pdserve.services.engine.guided import GuidedDecoder
from pdserve.services.engine.sequence import Sequence
from pdserve.services.engine.sequence_group import fork_choice
from pdserve.shared.sampling import GuidedDecoding, SamplingParams
from tests.engine_support import make_engine, prefill_then_decode, random_prompts

EOS = 1
VOCAB = 384  # tests.checkpoints' tokenizer and config
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 250},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["id", "kind", "name"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["yes", "no", "lazy dog", 'say "hi"']
GUIDES = {
    "json_schema": GuidedDecoding("json_schema", json.dumps(SCHEMA)),
    "json_object": GuidedDecoding("json_object"),
    "regex": GuidedDecoding("regex", REGEX),
    "choice": GuidedDecoding("choice", json.dumps(CHOICES)),
}


@pytest.fixture(scope="module")
def tokenizer(llama_dir) -> Tokenizer:
    return Tokenizer.from_file(str(llama_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(llama_dir):
    return make_engine(llama_dir, num_kv_blocks=256)


def text_of(tokenizer: Tokenizer, output: list[int]) -> str:
    """The output's text; it must have ended with EOS (the grammar finished: "stop")."""
    assert output and output[-1] == EOS, f"no EOS at the end: {output}"
    assert EOS not in output[:-1]
    return tokenizer.decode(output[:-1], skip_special_tokens=False)


def assert_valid(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def allowed(mask_row) -> set[int]:
    return {
        w * 32 + b for w, word in enumerate(mask_row.tolist()) for b in range(32) if (word >> b) & 1
    }


def guided_seq(guide: GuidedDecoding | None, outputs=(), prompt=(5, 6, 7)) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(max_tokens=50, guided=guide), 0, 0.0)
    seq.token_ids.extend(outputs)
    return seq


# ---- the state and the mask, without a model --------------------------------------------------


def test_mask_rows_follow_each_sequence_and_leave_unguided_rows_open(llama_dir, tokenizer):
    decoder = GuidedDecoder(llama_dir, VOCAB, (EOS,))
    choice = GUIDES["choice"]
    rows = [guided_seq(None), guided_seq(choice), guided_seq(choice, tokenizer.encode("ye").ids)]
    mask = decoder.bitmask(rows)
    assert mask.shape == (3, VOCAB // 32) and mask.dtype.is_signed
    assert allowed(mask[0]) == set(range(VOCAB))
    first = allowed(mask[1])
    assert tokenizer.encode("y").ids[0] in first and tokenizer.encode("e").ids[0] not in first
    assert allowed(mask[2]) == set(tokenizer.encode("s").ids)  # "ye" -> "yes" only
    assert decoder.bitmask([guided_seq(None)]) is None


def test_state_follows_output_tokens_not_calls(llama_dir, tokenizer):
    decoder = GuidedDecoder(llama_dir, VOCAB, (EOS,))
    seq = guided_seq(GUIDES["choice"], tokenizer.encode("l").ids)  # replayed: a first token
    before = decoder.bitmask([seq])
    state = decoder.state(seq)
    assert state is not None and state.num_consumed == 1
    # another mask with no new output token (a recomputed step, a preempted sequence) is the same
    assert decoder.bitmask([seq]).equal(before)
    assert state.num_consumed == 1
    seq.token_ids.extend(tokenizer.encode("azy dog").ids)
    assert allowed(decoder.bitmask([seq])[0]) == {EOS}  # finished: EOS only
    assert state.num_consumed == len(seq.output_token_ids)


def test_eos_after_a_finished_grammar_is_no_error(llama_dir, tokenizer, caplog):
    """ignore_eos: a finished grammar's sequence goes on drawing EOS, the one token allowed."""
    decoder = GuidedDecoder(llama_dir, VOCAB, (EOS,))
    seq = guided_seq(GUIDES["choice"], [*tokenizer.encode("no").ids, EOS, EOS])
    assert allowed(decoder.bitmask([seq])[0]) == {EOS}
    seq.token_ids.append(EOS)
    assert allowed(decoder.bitmask([seq])[0]) == {EOS}
    assert not decoder.state(seq).failed and "broke" not in caplog.text


def test_forked_choice_starts_its_own_state(llama_dir, tokenizer):
    decoder = GuidedDecoder(llama_dir, VOCAB, (EOS,))
    parent = guided_seq(GUIDES["choice"], tokenizer.encode("n").ids)
    child = fork_choice(parent, 1)
    mask = decoder.bitmask([parent, child])
    assert allowed(mask[0]) == set(tokenizer.encode("o").ids)
    assert allowed(mask[1]) == allowed(decoder.bitmask([guided_seq(GUIDES["choice"])])[0])


def test_a_token_outside_the_grammar_leaves_only_eos(llama_dir, tokenizer, caplog):
    decoder = GuidedDecoder(llama_dir, VOCAB, (EOS,))
    seq = guided_seq(GUIDES["regex"], tokenizer.encode("A").ids)  # not [a-z]
    assert allowed(decoder.bitmask([seq])[0]) == {EOS}
    assert "broke its grammar" in caplog.text


def test_padded_logits_are_never_allowed(llama_dir):
    decoder = GuidedDecoder(llama_dir, VOCAB + 45, (EOS,))
    mask = decoder.bitmask([guided_seq(GuidedDecoding("regex", "(.|\n)*")), guided_seq(None)])
    assert mask.shape == (2, (VOCAB + 45 + 31) // 32)
    assert max(allowed(mask[0])) < VOCAB
    assert allowed(mask[1]) == set(range(VOCAB + 45))  # unguided: every logit, padding too


def test_logits_narrower_than_the_tokenizer_cut_the_mask(llama_dir):
    decoder = GuidedDecoder(llama_dir, VOCAB - 20, (EOS,))
    mask = decoder.bitmask([guided_seq(GuidedDecoding("regex", "(.|\n)*"))])
    assert mask.shape == (1, (VOCAB - 20 + 31) // 32)
    assert max(allowed(mask[0])) < VOCAB - 20


def test_min_tokens_holds_eos_back_only_while_the_grammar_can_go_on(llama_dir, tokenizer):
    decoder = GuidedDecoder(llama_dir, VOCAB, (EOS,))
    letters = GuidedDecoding("regex", "[a-z]{1,8}")
    short = [
        Sequence(r, [5], SamplingParams(min_tokens=4, guided=g), 0, 0.0)
        for r, g in (("a", letters), ("b", letters), ("c", GUIDES["choice"]))
    ]
    short[1].sampling = SamplingParams(guided=letters)  # the same, without min_tokens
    for seq, text in zip(short, ("a", "a", "yes"), strict=True):
        seq.token_ids.extend(tokenizer.encode(text).ids)
    mask = decoder.bitmask(short)
    assert EOS in allowed(mask[1])  # "a" matches: it may end...
    assert allowed(mask[0]) == allowed(mask[1]) - {EOS}  # ...but not before min_tokens
    assert allowed(mask[2]) == {EOS}  # "yes" is finished: the grammar wins, it must end


# ---- the engine --------------------------------------------------------------------------------


def _sampling(guide: GuidedDecoding, seed: int, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 200), guided=guide, **kw
    )


def _json_object_bias(tokenizer: Tokenizer) -> dict:
    """Any JSON object has no size bound: with near-uniform random logits a string runs for
    hundreds of tokens. Favouring the closing tokens keeps outputs short; the mask, applied
    before the bias, still decides what is allowed."""
    closers = [tokenizer.token_to_id(t) for t in ('"', "}", "]")]
    return dict(logit_bias_token_ids=closers, logit_bias_values=[6.0] * len(closers))


@pytest.mark.parametrize("kind", list(GUIDES))
def test_twenty_sampled_outputs_obey_the_guide(engine, tokenizer, kind):
    extra = _json_object_bias(tokenizer) if kind == "json_object" else {}
    params = [_sampling(GUIDES[kind], seed, **extra) for seed in range(20)]
    outputs = engine.generate(random_prompts(20, seed=7), params)
    texts = [text_of(tokenizer, out) for out in outputs]
    for text in texts:
        assert_valid(kind, text)
    assert len(set(texts)) > 1  # sampled, not one forced string


def test_bias_cannot_force_a_token_the_grammar_refuses(engine, tokenizer):
    banned = tokenizer.token_to_id("A")
    sp = _sampling(GUIDES["regex"], 3, logit_bias_token_ids=[banned], logit_bias_values=[100.0])
    (output,) = engine.generate(random_prompts(1, seed=3), sp)
    assert_valid("regex", text_of(tokenizer, output))
    unguided = _sampling(None, 3, logit_bias_token_ids=[banned], logit_bias_values=[100.0])
    assert engine.generate(random_prompts(1, seed=3), unguided)[0][0] == banned  # the bias works


def test_min_tokens_under_a_guide(engine, tokenizer):
    letters = GuidedDecoding("regex", "[a-z]{1,30}")
    params = [_sampling(letters, s, min_tokens=6) for s in range(6)]
    params += [_sampling(GuidedDecoding("choice", '["yes"]'), 0, min_tokens=6)]
    outputs = engine.generate(random_prompts(7, seed=8), params)
    for out in outputs[:6]:
        assert len(out) > 6 and re.fullmatch("[a-z]{1,30}", text_of(tokenizer, out))
    assert text_of(tokenizer, outputs[6]) == "yes"  # finished early: it ends, and stays valid


def test_guided_rows_leave_unguided_rows_of_the_batch_unchanged(engine, tokenizer):
    prompts = random_prompts(8, seed=11)
    free = [_sampling(None, seed, max_tokens=24, ignore_eos=True) for seed in range(4)]
    alone = engine.generate(prompts[:4], free)
    guided = [_sampling(GUIDES["json_schema"], seed) for seed in range(4)]
    mixed = engine.generate(prompts, free + guided)
    assert mixed[:4] == alone
    for out in mixed[4:]:
        assert_valid("json_schema", text_of(tokenizer, out))


def test_decode_engine_continues_the_prefill_engines_grammar(llama_dir, engine, tokenizer):
    prefill = make_engine(llama_dir, num_kv_blocks=64, prefill_only=True)
    prompts = random_prompts(6, seed=5)
    for kind in ("json_schema", "regex"):
        params = [_sampling(GUIDES[kind], seed) for seed in range(len(prompts))]
        whole = engine.generate(prompts, params)  # the same requests in one engine
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            first, rest = prefill_then_decode(prefill, engine, f"{kind}{i}", prompt, sp)
            assert first + rest == whole[i]  # the decode side's grammar took over exactly
            assert_valid(kind, text_of(tokenizer, first + rest))


def test_preemption_does_not_advance_a_grammar_twice(llama_dir, engine, tokenizer):
    prompts = random_prompts(8, seed=2)
    params = [_sampling(GUIDES["json_schema"], seed, max_tokens=120) for seed in range(8)]
    expected = engine.generate(prompts, params)
    small = make_engine(llama_dir, num_kv_blocks=16, prefix_cache=False)
    assert small.generate(prompts, params) == expected
    assert small.stats().preemptions > 0


def test_each_forked_choice_follows_its_own_grammar_state(engine, tokenizer):
    for kind in ("regex", "json_schema"):
        sp = _sampling(GUIDES[kind], 21, n=4)
        (choices,) = engine.generate_choices(random_prompts(1, seed=21), sp)
        texts = [text_of(tokenizer, c) for c in choices]
        for text in texts:
            assert_valid(kind, text)
        assert len(set(texts)) > 1


def test_padded_vocabulary_is_never_sampled_under_a_guide(tmp_path):
    import transformers

    from tests.checkpoints import VARIANTS, save_checkpoint, train_tokenizer

    tok = train_tokenizer()
    kwargs = VARIANTS["llama-gqa"][1]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB + 45, bos_token_id=0, eos_token_id=EOS, initializer_range=0.1, **kwargs
    )
    padded = make_engine(save_checkpoint(config, tok, tmp_path / "padded"), num_kv_blocks=128)
    guide = GuidedDecoding("regex", "[a-z ]{0,40}")
    outputs = padded.generate(random_prompts(8, seed=4), [_sampling(guide, s) for s in range(8)])
    assert all(t < VOCAB for out in outputs for t in out)
    unguided = padded.generate(random_prompts(8, seed=4), [_sampling(None, s) for s in range(8)])
    assert any(t >= VOCAB for out in unguided for t in out)  # the padding is live without one


def test_a_spec_that_does_not_compile_is_refused_by_add_request(engine):
    with pytest.raises(ValueError, match="invalid regex"):
        engine.add_request("bad", [5, 6], _sampling(GuidedDecoding("regex", "[a-"), 0))
    with pytest.raises(ValueError, match="if"):
        engine.add_request("bad", [5, 6], _sampling(GuidedDecoding("json_schema", '{"if": {}}'), 0))
    assert not engine.has_unfinished()
