"""Tool calls enforced on a real engine: a tiny random-weight model sampling at temperature 1
under the grammar a chat request with ``tool_choice`` 'required' or a named function gets
(built by the gateway's own ``parse_chat``) writes calls whose arguments validate against the
schema (jsonschema), in every parser's format, in one engine and split between a prefill-only
engine and a decode engine (the grammar is an ordinary ``guided`` spec, which the decode side
replays). Also: the fallback template the tests use is still the default model's, and a
template with tool syntax renders tools, calls and results exactly as transformers does."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from pdserve.gateway.api_models import parse_chat
from pdserve.gateway.tokenizer import ChatTemplate, ModelTokenizer
from pdserve.shared.models.resolve import BUILTIN_MODELS
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, prefill_then_decode, random_prompts
from tests.unit.gateway_fixtures import train_byte_level, write_model_dir
from tests.unit.test_tool_grammar import FUNCTIONS, read_calls, valid_calls
from tests.unit.test_tool_prompt import CONVERSATION, SMOLLM2_TEMPLATE, TOOLS, TOOLS_TEMPLATE

EOS = 1  # tests.checkpoints' tokenizer
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "tools": [{"type": "function", "function": f} for f in FUNCTIONS],
}
CHOICES = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
}


@pytest.fixture(scope="module")
def tokenizer(llama_dir) -> Tokenizer:
    return Tokenizer.from_file(str(llama_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(llama_dir):
    return make_engine(llama_dir, num_kv_blocks=256)


def guided_params(parser: str, choice: str, seed: int, parallel: bool = False) -> SamplingParams:
    body = {**BODY, "tool_choice": CHOICES[choice], "parallel_tool_calls": parallel}
    params = parse_chat(body, tool_parser=parser).params
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=300, guided=params.guided)


def calls_of(tokenizer: Tokenizer, parser: str, choice: str, output: list[int]) -> list:
    assert output and output[-1] == EOS, "the grammar must have ended the answer"
    text = tokenizer.decode(output[:-1], skip_special_tokens=False)
    calls, outside = read_calls(parser, text)
    setup = parse_chat({**BODY, "tool_choice": CHOICES[choice]}, tool_parser=parser).params.tools
    assert calls and outside == "" and valid_calls(setup, calls), text
    return calls


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_model_forced_by_the_grammar_writes_valid_calls(engine, tokenizer, parser, choice):
    params = [guided_params(parser, choice, seed) for seed in range(8)]
    outputs = engine.generate(random_prompts(8, seed=3), params)
    calls = [calls_of(tokenizer, parser, choice, out) for out in outputs]
    if choice == "named":
        assert {name for c in calls for name, _ in c} == {"get_weather"}
    assert len({repr(c) for c in calls}) > 1  # sampled, not one forced string


def test_parallel_calls_under_the_grammar(engine, tokenizer):
    params = [guided_params("hermes", "required", seed, parallel=True) for seed in range(6)]
    outputs = engine.generate(random_prompts(6, seed=4), params)
    ended = [out for out in outputs if out[-1] == EOS]
    assert len(ended) >= 2
    counts = [len(calls_of(tokenizer, "hermes", "required", out)) for out in ended]
    setup = parse_chat({**BODY, "tool_choice": "required"}, tool_parser="hermes").params.tools
    for out in outputs:
        if out[-1] != EOS:  # many calls ran out of tokens: every finished call is valid
            text = tokenizer.decode(out, skip_special_tokens=False)
            done = text[: text.rindex("</tool_call>") + len("</tool_call>")]
            calls, _ = read_calls("hermes", done)
            assert valid_calls(setup, calls), text
            counts.append(len(calls))
    assert max(counts) > 1  # several calls in one answer


@pytest.mark.parametrize("parser", ["hermes", "pythonic"])
def test_the_decode_engine_continues_the_prefill_engines_tool_grammar(
    llama_dir, engine, tokenizer, parser
):
    prefill = make_engine(llama_dir, num_kv_blocks=64, prefill_only=True)
    prompts = random_prompts(4, seed=5)
    params = [guided_params(parser, "required", seed) for seed in range(4)]
    whole = engine.generate(prompts, params)
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        first, rest = prefill_then_decode(prefill, engine, f"t{i}", prompt, sp)
        assert first + rest == whole[i]  # the decode side's grammar state took over exactly
        calls_of(tokenizer, parser, "required", first + rest)


def test_the_fallback_template_is_the_default_models():
    from gguf import GGUFReader

    path = BUILTIN_MODELS["smollm2-135m-instruct"].locate("smollm2-135m-instruct")
    field = GGUFReader(str(path)).fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == SMOLLM2_TEMPLATE


def test_a_template_with_tool_syntax_renders_as_transformers(tmp_path):
    model_dir = write_model_dir(tmp_path, train_byte_level(), template=TOOLS_TEMPLATE)
    ours = ModelTokenizer.from_dir(model_dir)
    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    req = parse_chat({"model": "m", "messages": CONVERSATION, "tools": TOOLS})
    text = ChatTemplate(ours.chat_template, ours.bos_token, ours.eos_token).render(
        req.messages, tools=req.params.tools
    )
    # transformers as its documentation asks: arguments as objects, results as tool messages
    messages = [
        {
            **m,
            "content": m["content"] or "",
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": eval_args(c)}}
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in CONVERSATION
    ]
    expected = hf.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == expected


def eval_args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])
