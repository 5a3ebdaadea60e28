"""Each tool-call format on what real models write: Qwen2.5 / Hermes ``<tool_call>`` blocks,
Llama 3.1 JSON with and without ``<|python_tag|>``, Llama 3.2 / 4 pythonic lists; text around
calls kept as content, and malformed calls returned as content, never as broken calls."""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.tools.parsers import Call, Parsed, parse, parser_for_template
from pdserve.gateway.tools.setup import ToolSetup

FUNCTIONS = ({"name": "get_weather"}, {"name": "get_time"}, {"name": "search"})


def tools(parser: str, choice: str = "auto", parallel: bool = True) -> ToolSetup:
    return ToolSetup(functions=FUNCTIONS, choice=choice, parser=parser, parallel=parallel)  # type: ignore[arg-type]


def call(name: str, **arguments) -> Call:
    return Call(name, json.dumps(arguments, ensure_ascii=False))


PARIS = call("get_weather", city="Paris")


# ----------------------------------------------------------------------------- hermes

QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_hermes_qwen25_call_alone():
    assert parse(QWEN_CALL, tools("hermes")) == Parsed(None, [PARIS])


def test_hermes_several_calls_and_text_before_and_after():
    text = (
        "I'll look both up.\n"
        + QWEN_CALL
        + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
        + "\nOne moment."
    )
    assert parse(text, tools("hermes")) == Parsed(
        "I'll look both up.\nOne moment.", [PARIS, call("get_time", tz="Europe/Paris")]
    )


def test_hermes_2_pro_writes_arguments_first_and_unicode_stays_unescaped():
    text = '<tool_call>\n{"arguments": {"city": "Zürich"}, "name": "get_weather"}\n</tool_call>'
    parsed = parse(text, tools("hermes"))
    assert parsed.calls == [Call("get_weather", '{"city": "Zürich"}')]


def test_hermes_a_call_without_arguments_and_a_closing_tag_left_out_at_the_end():
    assert parse('<tool_call>{"name": "get_time"}</tool_call>', tools("hermes")).calls == [
        Call("get_time", "{}")
    ]
    # the model stopped right after the JSON: the call is whole, so it counts
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert parse(text, tools("hermes")) == Parsed("Checking.", [PARIS])


def test_hermes_raw_newlines_in_a_string_are_read_and_sent_escaped():
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "a\nb\tc"}}\n</tool_call>'
    assert parse(text, tools("hermes")).calls == [Call("search", '{"query": "a\\nb\\tc"}')]


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # JSON
        '<tool_call>\n{"name": "book_flight", "arguments": {}}\n</tool_call>',  # unknown name
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": 1}"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"t": NaN}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci',  # cut by max_tokens
        "<tool_call> is the tag I would use.",
    ],
)
def test_hermes_malformed_calls_are_content_as_written(bad):
    text = "Before. " + bad
    assert parse(text, tools("hermes")) == Parsed(text, [])


def test_a_malformed_call_beside_a_good_one():
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert parse(QWEN_CALL + "\n" + bad, tools("hermes")) == Parsed(bad, [PARIS])


def test_parallel_tool_calls_false_returns_only_the_first_call():
    text = QWEN_CALL + "\n" + QWEN_CALL.replace("Paris", "Rome")
    assert parse(text, tools("hermes", parallel=False)) == Parsed(None, [PARIS])
    text = '[get_weather(city="Paris"), get_time()]'
    assert parse(text, tools("pythonic", parallel=False)) == Parsed(None, [PARIS])


def test_tool_choice_none_reads_no_calls():
    assert parse(QWEN_CALL, tools("hermes", choice="none")) == Parsed(QWEN_CALL, [])


def test_an_answer_without_calls_is_its_text_unchanged():
    for parser in ("hermes", "llama3_json", "pythonic"):
        for text in ("", "  Hello,\n world!  \n", "[1] is a citation", "{not json} ok"):
            assert parse(text, tools(parser)) == Parsed(text, [])


# ----------------------------------------------------------------------------- llama3_json

LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def test_llama31_json_with_and_without_the_python_tag():
    assert parse(LLAMA_CALL, tools("llama3_json")) == Parsed(None, [PARIS])
    assert parse("<|python_tag|>" + LLAMA_CALL, tools("llama3_json")) == Parsed(None, [PARIS])
    # text before the tag (visible when special tokens are kept) is content
    text = "Let me check.<|python_tag|>" + LLAMA_CALL
    assert parse(text, tools("llama3_json")) == Parsed("Let me check.", [PARIS])


def test_llama3_json_several_calls_separated_by_semicolons():
    second = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
    want = Parsed(None, [PARIS, call("get_time", tz="UTC")])
    for sep in ("; ", ";", " ;\n", "\n"):
        assert parse(LLAMA_CALL + sep + second, tools("llama3_json")) == want
    # Llama 3.2 may add "type"; the "arguments" key is read too
    typed = '{"type": "function", "name": "get_weather", "arguments": {"city": "Paris"}}'
    assert parse(typed, tools("llama3_json")).calls == [PARIS]


def test_llama3_json_text_after_the_calls_and_json_that_is_not_a_call():
    assert parse(LLAMA_CALL + "\nAnything else?", tools("llama3_json")) == Parsed(
        "Anything else?", [PARIS]
    )
    for text in ('{"city": "Paris"}', '{"name": "nope", "parameters": {}}', LLAMA_CALL[:-5]):
        assert parse(text, tools("llama3_json")) == Parsed(text, [])
    # a call in the middle of prose is not one: the format's calls open the answer
    text = "I would send " + LLAMA_CALL
    assert parse(text, tools("llama3_json")) == Parsed(text, [])


# ----------------------------------------------------------------------------- pythonic


def test_llama32_pythonic_list_with_nested_values_and_tricky_strings():
    text = (
        "[search(query=\"commas, brackets] and (parens)\", filters={'tags': ['a', 'b'], "
        "'range': (1, -2.5), 'exact': True, 'none': None}), get_time()]"
    )
    parsed = parse(text, tools("pythonic"))
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (
            "search",
            {
                "query": "commas, brackets] and (parens)",
                "filters": {"tags": ["a", "b"], "range": [1, -2.5], "exact": True, "none": None},
            },
        ),
        ("get_time", {}),
    ]


def test_pythonic_json_literals_llama4_tag_and_text_after():
    parsed = parse('[get_weather(city="Paris", metric=true, days=null)]', tools("pythonic"))
    assert parsed.calls == [call("get_weather", city="Paris", metric=True, days=None)]
    text = '<|python_start|>[get_weather(city="Paris")] Done.'
    assert parse(text, tools("pythonic")) == Parsed("Done.", [PARIS])


@pytest.mark.parametrize(
    "text",
    [
        '[get_weather("Paris")]',  # positional
        "[get_weather(city=open('x'))]",  # not a literal: never run
        "[get_weather(city=x)]",
        "[get_weather(**{'city': 'Paris'})]",
        "[get_weather(city={1: 2})]",
        "[get_weather(city=1e999)]",  # inf is not JSON
        "[os.system(cmd='ls')]",
        "[book_flight(to='Rome')]",
        "[get_weather(city='Paris'), 3]",
        "[get_weather(city='Par",
        "[1, 2] are numbers",
    ],
)
def test_pythonic_malformed_is_content(text):
    assert parse(text, tools("pythonic")) == Parsed(text, [])


# ----------------------------------------------------------------------------- auto


LLAMA31_TEMPLATE = (
    "{%- if builtin_tools is defined or tools is not none %}Environment: ipython\n{%- endif %}"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.{%- if tool_call.name in builtin_tools %}<|python_tag|>{%- endif %}"
)
PYTHONIC_TEMPLATE = (
    "{%- if tools %}If you decide to invoke any of the function(s), you MUST put it in the "
    "format of [func_name1(params_name1=params_value1, params_name2=params_value2...), "
    "func_name2(params)]\n<|start_header_id|>ipython<|end_header_id|>{%- endif %}"
)
QWEN_TEMPLATE = (
    "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "return a json object within <tool_call></tool_call> XML tags{%- endif %}"
)


def test_parser_for_template():
    assert parser_for_template(QWEN_TEMPLATE) == "hermes"
    assert parser_for_template(LLAMA31_TEMPLATE) == "llama3_json"
    assert parser_for_template(PYTHONIC_TEMPLATE) == "pythonic"
    assert parser_for_template("{{ '<|python_start|>' }}{{ tools }}") == "pythonic"
    # no tool syntax, or none at all: pdserve's fallback prompt asks for hermes
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"
    assert parser_for_template(None) == "hermes"
