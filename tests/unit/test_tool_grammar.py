"""The grammar that enforces tool calls, run by llguidance's matcher over a real byte-level BPE
tokenizer: it accepts a call exactly when its arguments validate against the function's schema
(jsonschema is the oracle; arguments written canonically, properties in the schema's order as
llguidance's JSON grammar writes them), in each parser's format, for tool_choice 'required', a
named function and 'auto' with a strict function; and random walks through its token masks
only ever end in calls that a parser written here reads and jsonschema validates."""

from __future__ import annotations

import ast
import json
import random
import re
from typing import Any

import jsonschema
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.gateway.tools.grammar import tool_guide
from pdserve.gateway.tools.pythonic_grammar import python_literal
from pdserve.gateway.tools.setup import ToolSetup
from tests.unit.gateway_fixtures import train_byte_level

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer"},
        "units": {"enum": ["c", "f"]},
        "hourly": {"type": ["boolean", "null"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["city", "units"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}
LOOSE = {
    "name": "note",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
}
NOOP = {"name": "noop"}
FUNCTIONS = (WEATHER, LOOSE, NOOP)


@pytest.fixture(scope="module")
def tokenizer():
    return train_byte_level(400)


@pytest.fixture(scope="module")
def lltok(tokenizer):
    return llguidance.LLTokenizer(tokenizer.to_str())


def setup(parser: str, choice: str = "required", named: str | None = None, parallel=True):
    return ToolSetup(FUNCTIONS, choice, parser, named=named, parallel=parallel)


def matcher(lltok, tools: ToolSetup) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(lltok, tool_guide(tools).spec, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(lltok, tokenizer, tools: ToolSetup, text: str) -> bool:
    m = matcher(lltok, tools)
    ok = m.consume_tokens(tokenizer.encode(text, add_special_tokens=False).ids)
    return bool(ok) and m.is_accepting()


# ----------------------------------------------------------------------------- the oracle

SCHEMAS = {
    f["name"]: f.get(
        "parameters", {"type": "object", "properties": {}, "additionalProperties": False}
    )
    for f in FUNCTIONS
}


def write(parser: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as the format writes them, arguments canonical."""
    if parser == "pythonic":
        inner = ", ".join(
            f"{n}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in a.items()) + ")"
            for n, a in calls
        )
        return f"[{inner}]"
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    blocks = (
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )
    return "\n".join(blocks)


def read_calls(parser: str, text: str) -> tuple[list[tuple[str, Any]], str]:
    """(calls, the text around them) as a parser reads ``text``; ValueError if a call is
    malformed. Written here, independently of the gateway's response side."""
    if parser == "hermes":
        pieces = re.split(r"<tool_call>\n(.*?)\n</tool_call>", text, flags=re.S)
        calls = [json.loads(body) for body in pieces[1::2]]
        outside = "".join(pieces[0::2])
        if "<tool_call>" in outside:
            raise ValueError("a call marker outside a well-formed call")
        return [(c["name"], c["arguments"]) for c in calls], outside
    if parser == "llama3_json":
        if not text.startswith("{"):
            return [], text
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            value, at = decoder.raw_decode(text, at)
            assert list(value) == ["name", "parameters"]
            calls.append((value["name"], value["parameters"]))
            if at == len(text):
                return calls, ""
            if text[at : at + 2] != "; ":
                raise ValueError(f"junk after a call: {text[at:]!r}")
            at += 2
    if not text.startswith("["):
        return [], text
    tree = ast.parse(text, mode="eval").body
    assert isinstance(tree, ast.List)
    calls = []
    for call in tree.elts:
        assert isinstance(call, ast.Call) and not call.args
        calls.append((call.func.id, {k.arg: ast.literal_eval(k.value) for k in call.keywords}))
    return calls, ""


def valid_calls(tools: ToolSetup, calls: list[tuple[str, Any]]) -> bool:
    """Whether every call names a callable function with arguments its schema allows (a
    non-strict function's under auto: any object)."""
    if tools.choice == "function" and len(calls) > 1:
        return False
    for name, arguments in calls:
        if tools.choice == "function" and name != tools.named:
            return False
        if name not in SCHEMAS or not isinstance(arguments, dict):
            return False
        function = next(f for f in FUNCTIONS if f["name"] == name)
        if tools.forced or function.get("strict"):
            try:
                jsonschema.validate(arguments, SCHEMAS[name])
            except jsonschema.ValidationError:
                return False
    return (bool(calls) or not tools.forced) and (tools.parallel or len(calls) <= 1)


# ----------------------------------------------------------------------------- cases

GOOD = ("get_weather", {"city": "Paris", "units": "c"})
FULL = (
    "get_weather",
    {"city": "Oslo", "days": 3, "units": "f", "hourly": None, "tags": ["a", "b"]},
)
CASES = [
    ([GOOD], True),
    ([FULL], True),
    ([GOOD, ("note", {"x": -4}), ("noop", {})], True),
    ([("get_weather", {"city": "Paris"})], False),  # units required
    ([("get_weather", {"city": "Parisienne", "units": "c"})], False),  # maxLength 8
    ([("get_weather", {"city": "P", "units": "k"})], False),  # not in the enum
    ([("get_weather", {"city": "P", "units": "c", "wind": 1})], False),  # no extra properties
    ([("get_weather", {"city": "P", "units": "c", "tags": ["a", "b", "c"]})], False),
    ([("note", {"x": "4"})], False),
    ([("noop", {"a": 1})], False),  # no parameters: no arguments
    ([("get_time", {})], False),  # not a tool
]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
@pytest.mark.parametrize("calls, valid", CASES)
def test_required_accepts_exactly_the_valid_calls(lltok, tokenizer, parser, calls, valid):
    tools = setup(parser)
    assert valid_calls(tools, calls) == valid  # the oracle agrees with the case's label
    assert accepts(lltok, tokenizer, tools, write(parser, calls)) == valid


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
def test_the_shape_around_the_calls(lltok, tokenizer, parser):
    required, one = setup(parser), setup(parser, parallel=False)
    text = write(parser, [GOOD])
    assert not accepts(lltok, tokenizer, required, "")  # required: at least one call
    assert not accepts(lltok, tokenizer, required, "Sure! " + text)  # calls only
    assert not accepts(lltok, tokenizer, required, text + " ")  # then the end
    assert accepts(lltok, tokenizer, one, text)
    assert not accepts(lltok, tokenizer, one, write(parser, [GOOD, GOOD]))  # parallel off
    named = setup(parser, "function", named="noop")  # one call, whatever parallel says
    assert accepts(lltok, tokenizer, named, write(parser, [("noop", {})]))
    assert not accepts(lltok, tokenizer, named, write(parser, [("noop", {}), ("noop", {})]))
    assert not accepts(lltok, tokenizer, named, write(parser, [GOOD]))


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
def test_auto_with_a_strict_function_allows_text_or_valid_calls(lltok, tokenizer, parser):
    auto = setup(parser, "auto")
    assert accepts(lltok, tokenizer, auto, "")
    assert accepts(lltok, tokenizer, auto, "It is sunny in Paris.")
    assert accepts(lltok, tokenizer, auto, write(parser, [GOOD]))
    assert not accepts(lltok, tokenizer, auto, write(parser, [("get_weather", {"city": "P"})]))
    # the loose function's arguments are any object under auto (its schema is not strict)
    assert accepts(lltok, tokenizer, auto, write(parser, [("note", {"y": [1, "z"]})]))
    assert not accepts(lltok, tokenizer, auto, write(parser, [("get_time", {})]))


def test_hermes_auto_text_around_calls_never_hides_an_unchecked_call(lltok, tokenizer):
    auto, call = setup("hermes", "auto"), write("hermes", [GOOD])
    assert accepts(lltok, tokenizer, auto, f"Let me check.\n{call}\nDone.")
    assert accepts(lltok, tokenizer, auto, f"{call}\n{call}")
    bad = write("hermes", [("get_weather", {"city": "P"})])
    assert not accepts(lltok, tokenizer, auto, f"{call}\nthen {bad}")
    assert not accepts(lltok, tokenizer, auto, "text <tool_call> not a call </tool_call>")
    one = setup("hermes", "auto", parallel=False)
    assert not accepts(lltok, tokenizer, one, f"{call} and {call}")


# Arguments from hypothesis: the schema's properties with values of any shape, in the schema's
# order (llguidance's JSON grammar keeps it), sometimes with an unknown key.
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.text(
        st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_characters="\\"), max_size=10
    ),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=4,
)
arguments = st.fixed_dictionaries(
    {},
    optional={
        key: values | st.sampled_from(["c", "f", "ab"]) for key in WEATHER_SCHEMA["properties"]
    },
).map(lambda d: {k: d[k] for k in WEATHER_SCHEMA["properties"] if k in d})
extra = st.one_of(st.just({}), st.fixed_dictionaries({"wind": values}))


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
@settings(max_examples=60, deadline=None)
@given(args=arguments, more=extra)
def test_any_arguments_are_accepted_exactly_when_they_validate(
    lltok, tokenizer, parser, args, more
):
    tools = setup(parser, "function", named="get_weather")
    calls = [("get_weather", {**args, **more})]
    assert accepts(lltok, tokenizer, tools, write(parser, calls)) == valid_calls(tools, calls)


def random_walk(
    lltok, tools: ToolSetup, rng: random.Random, prefix: str = "", steps: int = 300
) -> str | None:
    """``prefix``, then tokens drawn at random from each mask (EOS, when allowed, half the
    time): the text, or None when the walk did not end within ``steps``."""
    m = matcher(lltok, tools)
    eos = lltok.eos_token
    out: list[int] = lltok.tokenize_str(prefix)
    assert m.consume_tokens(out)
    for _ in range(steps):
        mask = m.compute_bitmask()
        allowed = [i for i in range(len(mask) * 8) if mask[i // 8] >> (i % 8) & 1]
        others = [t for t in allowed if t != eos]
        if eos in allowed and (not others or rng.random() < 0.5):
            return lltok.decode_str(out)
        token = rng.choice(others)
        assert m.consume_token(token)
        out.append(token)
    return None


# auto: the walk starts a call (text first where the format allows it), so that it goes
# through the arguments' masks rather than ending at once
OPENINGS = {"hermes": "Let me see. <tool_call>", "llama3_json": "{", "pythonic": "["}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_random_walks_through_the_masks_end_in_valid_calls(lltok, parser, choice):
    tools, rng = setup(parser, choice, parallel=choice == "auto"), random.Random(7)
    prefix = OPENINGS[parser] if choice == "auto" else ""
    walks = (random_walk(lltok, tools, rng, prefix) for _ in range(30))
    ended = [t for t in walks if t is not None]
    assert len(ended) >= 10
    for text in ended:
        calls, _ = read_calls(parser, text)
        assert calls and valid_calls(tools, calls), text
