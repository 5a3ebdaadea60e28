"""Issue 16 through the official ``openai`` client against a real stack: a gateway, one prefill
and one decode worker, real NATS and UCX. HF transformers (float64) on the same tiny checkpoint
is the oracle for every token and log-prob.

Long prompts take the disaggregated path (prefill worker, KV pulled by the decode worker), short
ones are prefilled on the decode worker: the tests use both.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from tests.integration.test_gateway_e2e import serving, wait_all_blocks_free
from tests.oracle import hf_greedy

LOCAL_PREFILL_THRESHOLD = 6
WORKERS = ("p0", "d0")
OPTIONS = {
    "dtype": "float64",
    "num_kv_blocks": 128,
    "block_size": 16,
    "max_num_batched_tokens": 512,
    "heartbeat_seconds": 0.2,
    "local_prefill_threshold": LOCAL_PREFILL_THRESHOLD,
}
LONG = "Paged attention stores keys and values in fixed-size blocks of the cache."
SHORT = "Hi"  # prefilled on the decode worker
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_tokenizer(llama_dir):
    return PreTrainedTokenizerFast.from_pretrained(str(llama_dir))


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float64).eval()


def hf_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the distribution of the token after ids[: i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], dim=-1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    logs = tmp_path_factory.mktemp("features-logs")
    with serving(logs, llama_dir, ("p0",), ("d0",), OPTIONS) as (base, _, _):
        yield base


@pytest.fixture
async def client(stack):
    c = openai.AsyncOpenAI(base_url=stack + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()
    await wait_all_blocks_free(stack, workers=WORKERS)  # nothing leaked by any test


# ----------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("prompt", [LONG, SHORT])
@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs_match_hf(
    client, stack, llama_dir, hf_tokenizer, hf_model, prompt, stream
):
    k = 3
    args = dict(model=llama_dir.name, prompt=prompt, max_tokens=6, temperature=0, logprobs=k)
    if stream:
        tokens, token_lps, tops, offsets, text = [], [], [], [], ""
        async for chunk in await client.completions.create(stream=True, **args):
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                token_lps += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    else:
        choice = (await client.completions.create(**args)).choices[0]
        text = choice.text
        lp = choice.logprobs
        tokens, token_lps, tops, offsets = (
            lp.tokens,
            lp.token_logprobs,
            lp.top_logprobs,
            lp.text_offset,
        )
    ids = hf_tokenizer(prompt).input_ids
    (out,) = hf_greedy(llama_dir, [ids], 6)
    assert len(token_lps) == 6
    dist = hf_log_softmax(hf_model, ids + out)
    for i, t in enumerate(out):
        row = dist[len(ids) - 1 + i]
        assert abs(token_lps[i] - row[t].item()) < TOL
        assert tokens[i] == hf_tokenizer.decode([t])
        top = row.topk(k)
        expected: dict[str, float] = {}
        for v, j in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            expected.setdefault(hf_tokenizer.decode([j]), v)  # texts may repeat: likeliest wins
        assert set(tops[i]) == set(expected)
        for key, value in tops[i].items():
            assert abs(value - expected[key]) < TOL
    assert offsets == [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
    assert text == hf_tokenizer.decode(out)


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_match_hf(client, llama_dir, hf_tokenizer, hf_model, stream):
    messages = [{"role": "user", "content": "Name three colours."}]
    args = dict(
        model=llama_dir.name,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    if stream:
        content = []
        async for chunk in await client.chat.completions.create(stream=True, **args):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
    else:
        content = (await client.chat.completions.create(**args)).choices[0].logprobs.content
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    (out,) = hf_greedy(llama_dir, [list(ids)], 5)
    dist = hf_log_softmax(hf_model, list(ids) + out)
    assert len(content) == 5
    for i, (entry, t) in enumerate(zip(content, out, strict=True)):
        row = dist[len(ids) - 1 + i]
        assert entry.token == hf_tokenizer.decode([t])
        assert abs(entry.logprob - row[t].item()) < TOL
        assert entry.bytes == list(entry.token.encode())
        assert [
            abs(a.logprob - b) < TOL
            for a, b in zip(entry.top_logprobs, row.topk(2).values.tolist(), strict=True)
        ] == [True, True]


# ----------------------------------------------------------------------------- echo


async def test_echo_with_max_tokens_0_returns_prompt_logprobs(
    client, llama_dir, hf_tokenizer, hf_model
):
    """lm-eval's loglikelihood request: token-id prompts in a batch, echo, max_tokens 0."""
    prompts = [hf_tokenizer(LONG).input_ids, hf_tokenizer("The cat sat on the mat").input_ids]
    resp = await client.completions.create(
        model=llama_dir.name, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert [c.index for c in resp.choices] == [0, 1]
    for choice, ids in zip(resp.choices, prompts, strict=True):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        dist = hf_log_softmax(hf_model, ids)
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - dist[i - 1][ids[i]].item()) < TOL
            # the prompt's own token first, then the likeliest: one entry if they are the same
            own, *best = lp.top_logprobs[i].items()
            assert own == (lp.tokens[i], lp.token_logprobs[i])
            assert len(best) == int(dist[i - 1].argmax() != ids[i])
            assert abs(max(lp.top_logprobs[i].values()) - dist[i - 1].max().item()) < TOL
        assert choice.text == hf_tokenizer.decode(ids)
    assert resp.usage.completion_tokens == 0
    assert resp.usage.prompt_tokens == sum(len(p) for p in prompts)


async def test_echo_prepends_the_prompt_to_the_output(client, llama_dir, hf_tokenizer):
    resp = await client.completions.create(
        model=llama_dir.name, prompt=LONG, max_tokens=4, echo=True, temperature=0
    )
    ids = hf_tokenizer(LONG).input_ids
    (out,) = hf_greedy(llama_dir, [ids], 4)
    assert resp.choices[0].text == LONG + hf_tokenizer.decode(out)


# ----------------------------------------------------------------------------- several answers


@pytest.mark.parametrize("prompt", [LONG, SHORT])
async def test_n_greedy_choices_all_equal_hf(client, llama_dir, hf_tokenizer, prompt):
    resp = await client.completions.create(
        model=llama_dir.name, prompt=prompt, max_tokens=6, n=3, temperature=0
    )
    (out,) = hf_greedy(llama_dir, [hf_tokenizer(prompt).input_ids], 6)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.text == hf_tokenizer.decode(out) for c in resp.choices)
    assert resp.usage.completion_tokens == 18


async def test_n_seeded_choices_are_reproducible_and_differ(client, llama_dir):
    args = dict(model=llama_dir.name, prompt=LONG, max_tokens=8, n=4, temperature=1.0, seed=11)
    first = [c.text for c in (await client.completions.create(**args)).choices]
    again = [c.text for c in (await client.completions.create(**args)).choices]
    assert first == again
    assert len(set(first)) > 1
    streamed: dict[int, str] = {}
    async for chunk in await client.completions.create(stream=True, **args):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == first


async def test_prompt_arrays_answer_each_prompt_in_order(client, llama_dir):
    prompts = [LONG, SHORT, "Blocks of sixteen tokens"]
    resp = await client.completions.create(
        model=llama_dir.name, prompt=prompts, max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in resp.choices] == list(range(6))
    for i, p in enumerate(prompts):
        single = await client.completions.create(
            model=llama_dir.name, prompt=p, max_tokens=5, temperature=0
        )
        assert resp.choices[2 * i].text == resp.choices[2 * i + 1].text == single.choices[0].text


async def test_best_of_returns_the_likeliest_choice(client, llama_dir):
    args = dict(model=llama_dir.name, prompt=LONG, max_tokens=6, temperature=1.0, seed=5)
    every = (await client.completions.create(n=3, logprobs=0, **args)).choices
    sums = [sum(c.logprobs.token_logprobs) for c in every]
    best = (await client.completions.create(n=1, best_of=3, **args)).choices
    assert len(best) == 1 and best[0].logprobs is None
    assert best[0].text == every[max(range(3), key=sums.__getitem__)].text


# ----------------------------------------------------------------------------- sampling controls


async def test_logit_bias_forces_a_token(client, llama_dir, hf_tokenizer):
    token = hf_tokenizer(" blocks", add_special_tokens=False).input_ids[0]
    resp = await client.completions.create(
        model=llama_dir.name,
        prompt=LONG,
        max_tokens=4,
        temperature=0.8,
        seed=1,
        logit_bias={str(token): 100},
    )
    assert resp.choices[0].text == hf_tokenizer.decode([token] * 4)


async def test_min_tokens_holds_back_eos(client, llama_dir, hf_tokenizer):
    eos = hf_tokenizer.eos_token_id
    args = dict(
        model=llama_dir.name, prompt=LONG, max_tokens=10, temperature=0, logit_bias={str(eos): 100}
    )
    assert (await client.completions.create(**args)).usage.completion_tokens == 1
    resp = await client.completions.create(extra_body={"min_tokens": 4}, **args)
    assert resp.usage.completion_tokens == 5 and resp.choices[0].finish_reason == "stop"


async def test_repetition_penalty_matches_hf(client, llama_dir, hf_tokenizer, hf_model):
    """HF's own RepetitionPenaltyLogitsProcessor in a greedy loop is the oracle."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    penalty = RepetitionPenaltyLogitsProcessor(1.5)
    ids = hf_tokenizer(LONG).input_ids
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(8):
            logits = hf_model(input_ids=seq).logits[:, -1]
            seq = torch.cat([seq, penalty(seq, logits).argmax(-1, keepdim=True)], dim=1)
    resp = await client.completions.create(
        model=llama_dir.name,
        prompt=LONG,
        max_tokens=8,
        temperature=0,
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True},
    )
    assert resp.choices[0].text == hf_tokenizer.decode(seq[0, len(ids) :].tolist())


async def test_neutral_penalties_change_nothing(client, llama_dir):
    args = dict(model=llama_dir.name, prompt=LONG, max_tokens=6, temperature=0)
    plain = (await client.completions.create(**args)).choices[0].text
    neutral = await client.completions.create(
        presence_penalty=0, frequency_penalty=0, logit_bias={}, **args
    )
    assert neutral.choices[0].text == plain


# ----------------------------------------------------------------------------- structured output

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


async def test_json_schema_outputs_all_parse_and_validate(client, llama_dir):
    """20 sampled (temperature 1) answers of the random model, half of them through the
    disaggregated path (long prompt, first token sampled on the prefill worker): all valid."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    async def one(i: int) -> str:
        resp = await client.chat.completions.create(
            model=llama_dir.name,
            messages=[{"role": "user", "content": (LONG if i % 2 else SHORT) + f" #{i}"}],
            max_tokens=400,
            temperature=1.0,
            seed=i,
            response_format=fmt,
        )
        # bounded sizes and bounded whitespace: the grammar itself ends the answer
        assert resp.choices[0].finish_reason == "stop"
        return resp.choices[0].message.content

    texts = await asyncio.gather(*(one(i) for i in range(20)))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


async def test_json_object_regex_and_choice(client, llama_dir):
    args = dict(model=llama_dir.name, prompt=LONG, max_tokens=60, temperature=1.0)
    for seed in range(5):
        obj = await client.completions.create(
            seed=seed, extra_body={"response_format": {"type": "json_object"}}, **args
        )
        if obj.choices[0].finish_reason == "stop":  # a JSON object may outgrow max_tokens
            assert isinstance(json.loads(obj.choices[0].text), dict)
        regex = await client.completions.create(
            seed=seed, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"}, **args
        )
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.choices[0].text)
        choice = await client.completions.create(
            seed=seed, extra_body={"guided_choice": ["yes", "no", "maybe"]}, **args
        )
        assert choice.choices[0].text in ("yes", "no", "maybe")


async def test_a_grammar_that_does_not_compile_is_a_400(client, llama_dir):
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(
            model=llama_dir.name, prompt=LONG, max_tokens=4, extra_body={"guided_regex": "a("}
        )
    assert err.value.body["param"] == "guided_regex"
