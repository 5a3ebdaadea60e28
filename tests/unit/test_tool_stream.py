"""Streamed tool calls join to the whole answer's, however the text is cut into deltas.

Property tests (hypothesis) over the three formats: answers built of text, valid calls,
malformed calls and stray pieces of markers, cut at random places (one character per delta,
several tokens per delta, a whole call and text in one delta). Each stream must rebuild,
merged by ``index`` as clients merge it, to exactly ``parse`` of the whole text, and every call
must be sent in OpenAI's shape: a first delta with index, id, type, name and ``arguments: ""``,
then argument fragments that are always strings.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.gateway.tools.parsers import parse
from pdserve.gateway.tools.setup import ToolSetup
from pdserve.gateway.tools.stream import ToolCallStream, joined

FUNCTIONS = ({"name": "get_weather"}, {"name": "noop"}, {"name": "search"})
NAMES = [f["name"] for f in FUNCTIONS]


def setup(parser: str, parallel: bool = True) -> ToolSetup:
    return ToolSetup(functions=FUNCTIONS, choice="auto", parser=parser, parallel=parallel)


def streamed(text: str, cuts: list[int], tools: ToolSetup) -> list[dict]:
    stream = ToolCallStream(tools)
    deltas, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        deltas += stream.feed(text[last:cut])
        last = cut
    return deltas + stream.finish()


def check_shape(deltas: list[dict]) -> None:
    seen: set[int] = set()
    ids = set()
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        if "content" in d:
            assert isinstance(d["content"], str) and d["content"]
            continue
        (entry,) = d["tool_calls"]
        i = entry["index"]
        assert isinstance(entry["function"]["arguments"], str)  # never None
        if i not in seen:  # a call's first delta
            assert i == len(seen), "calls are numbered 0, 1, ... in order"
            seen.add(i)
            assert entry["type"] == "function" and entry["id"].startswith("call_")
            assert entry["function"]["name"] in NAMES and entry["function"]["arguments"] == ""
            ids.add(entry["id"])
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
    assert len(ids) == len(seen)


def check_same(text: str, cuts: list[int], tools: ToolSetup) -> None:
    deltas = streamed(text, cuts, tools)
    check_shape(deltas)
    content, calls = joined(deltas)
    whole = parse(text, tools)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole.calls
    ], (text, cuts)
    assert content == (whole.content or ""), (text, cuts)
    assert whole.content is not None or whole.calls
    for c in calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)


# ----------------------------------------------------------------------------- answers

ARGS = st.dictionaries(
    st.text("abcxyz_", min_size=1, max_size=5),
    st.none()
    | st.booleans()
    | st.integers(-5, 10**12)
    | st.text(" a,[](){}\"'\\;é", max_size=8)
    | st.lists(st.integers(0, 3), max_size=3),
    max_size=3,
)
NAME = st.sampled_from(NAMES)
TEXT = st.text(" \n\tab.;,{}[]()<>/\"'|_é", max_size=12)
MARKERS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "<|python_tag|>",
    "<|python_start|>",
    "[",
    "{",
    '{"name": "noop"',
    "[noop(",
    ";",
    "\n",
]


def hermes_call(name: str, args: dict, space: str) -> str:
    return f"<tool_call>{space}{json.dumps({'name': name, 'arguments': args})}{space}</tool_call>"


def llama_call(name: str, args: dict) -> str:
    return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)


def py_value(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{py_value(k)}: {py_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(py_value(x) for x in v) + "]"
    return repr(v)


def py_call(name: str, args: dict) -> str:
    return f"{name}(" + ", ".join(f"{k}={py_value(v)}" for k, v in args.items()) + ")"


@st.composite
def pieces(draw, parser: str) -> str:
    """Any mix of text, calls (valid, malformed, unknown) and markers in any order."""
    parts = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["text", "call", "call", "bad", "marker"]))
        name, args = draw(NAME), draw(ARGS)
        if kind == "text":
            parts.append(draw(TEXT))
        elif kind == "marker":
            parts.append(draw(st.sampled_from(MARKERS)))
        elif kind == "call":
            parts.append(
                {
                    "hermes": hermes_call(name, args, draw(st.sampled_from(["", "\n", " "]))),
                    "llama3_json": llama_call(name, args) + draw(st.sampled_from(["", "; ", ";"])),
                    "pythonic": "[" + py_call(name, args) + "]",
                }[parser]
            )
        else:
            parts.append(
                draw(
                    st.sampled_from(
                        [
                            '<tool_call>{"name": "get_weather", "arguments": {"a": 1}</tool_call>',
                            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                            '<tool_call>{"name": "noop", "arguments": [1]}</tool_call>',
                            '{"name": "get_weather", "parameters": "x"}',
                            '{"name": "nope", "parameters": {}}',
                            "[noop(1)]",
                            "[noop(a=b)]",
                            "[unknown(a=1)]",
                            "[noop(a=1), 3]",
                            "[noop(a=1",
                            '<tool_call>{"name": "noop"',
                        ]
                    )
                )
            )
    return "".join(parts)


@st.composite
def answer_and_cuts(draw, parser: str) -> tuple[str, list[int]]:
    text = draw(pieces(parser))
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=max(1, len(text))))
    return text, cuts


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(answer_and_cuts("hermes"), st.booleans())
def test_hermes_stream_joins_to_the_whole_answer(case, parallel):
    check_same(*case, setup("hermes", parallel))


@SETTINGS
@given(answer_and_cuts("llama3_json"), st.booleans())
def test_llama3_json_stream_joins_to_the_whole_answer(case, parallel):
    check_same(*case, setup("llama3_json", parallel))


@SETTINGS
@given(answer_and_cuts("pythonic"), st.booleans())
def test_pythonic_stream_joins_to_the_whole_answer(case, parallel):
    check_same(*case, setup("pythonic", parallel))


# ----------------------------------------------------------------------------- the oracle

SAFE_TEXT = st.text(" \n\tabc.,é!?", max_size=10)  # no marker can form in it


@SETTINGS
@given(st.data())
def test_every_written_call_comes_out_whole_and_in_order(data):
    """Answers whose calls are known: the stream returns exactly them, and the text around
    them (no character of it lost) as content."""
    parser = data.draw(st.sampled_from(["hermes", "llama3_json", "pythonic"]))
    calls = data.draw(st.lists(st.tuples(NAME, ARGS), min_size=1, max_size=4))
    before, after = data.draw(SAFE_TEXT), data.draw(SAFE_TEXT)
    if parser == "hermes":
        between = [data.draw(SAFE_TEXT) for _ in calls]
        text = before + "".join(
            t + hermes_call(n, a, "\n") for t, (n, a) in zip(between, calls, strict=True)
        )
        text += after
        words = before + "".join(between) + after
    else:
        before = data.draw(st.sampled_from(["", " ", "\n"]))  # these formats' calls open it
        if parser == "llama3_json":
            text = before + "; ".join(llama_call(n, a) for n, a in calls)
        else:
            text = before + "[" + ", ".join(py_call(n, a) for n, a in calls) + "]"
        text += " " + after
        words = after
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    deltas = streamed(text, cuts, setup(parser))
    check_shape(deltas)
    content, got = joined(deltas)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [
        (n, a) for n, a in calls
    ]
    assert "".join(content.split()) == "".join(words.split())
    if not words.strip():
        assert content == ""
    one = joined(streamed(text, cuts, setup(parser, parallel=False)))[1]
    assert [c["function"]["name"] for c in one] == [calls[0][0]]


def test_one_delta_with_a_whole_call_and_text_and_one_character_per_delta():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>\nDone."
    )
    for cuts in ([], list(range(len(text)))):
        deltas = streamed(text, cuts, setup("hermes"))
        check_shape(deltas)
        content, calls = joined(deltas)
        assert content == "Let me check.\nDone."
        assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # in one delta: text, then the call's two deltas, then text, in the order written
    kinds = [next(iter(d)) for d in streamed(text, [], setup("hermes"))]
    assert kinds == ["content", "tool_calls", "tool_calls", "content"]


def test_text_is_sent_as_it_comes_and_only_a_possible_marker_is_held():
    stream = ToolCallStream(setup("hermes"))
    assert stream.feed("Hello") == [{"content": "Hello"}]
    assert stream.feed(" wor") == [{"content": " wor"}]
    # a space may precede a call (then it is dropped): held until text follows
    assert stream.feed("ld <tool") == [{"content": "ld"}]
    assert stream.feed("s>") == [{"content": " <tools>"}]
    assert stream.finish() == [] and not stream.has_calls


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
def test_escapes_and_brackets_in_strings_cut_anywhere(parser):
    """A delta may end right after a backslash or inside a string holding brackets; the call
    is still read whole (one character per delta, and every two-delta cut)."""
    args = {"text": "say \"hi\" } ] ) \\ 'q' {[(", "n": [1, {"k": '\\"'}]}
    text = {
        "hermes": hermes_call("search", args, "\n"),
        "llama3_json": llama_call("search", args),
        "pythonic": "[" + py_call("search", args) + "]",
    }[parser] + " ok"
    cuts_list = [list(range(len(text)))] + [[i] for i in range(len(text))]
    for cuts in cuts_list:
        content, calls = joined(streamed(text, cuts, setup(parser)))
        assert content == "ok"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("search", args)
        ], cuts
