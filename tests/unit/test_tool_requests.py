"""Tool calling's request side: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and tool
messages are validated into a ``ToolSetup`` (and, when calls are enforced, a grammar on
``guided``), bad ones are one OpenAI-shaped 400 naming the field; and through the real gateway
app (HTTP, the in-memory bus, a scripted decode worker) what reaches the worker: the tools in
the prompt, the grammar in the sampling parameters, a schema llguidance cannot compile refused
before anything is sent, ``--tool-call-parser`` choosing the format."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient
from tokenizers import Tokenizer

from pdserve.gateway.api_models import CHAT_KEYS, parse_chat
from pdserve.gateway.errors import APIError
from pdserve.gateway.tools.request import MAX_SCHEMA_CHARS, MAX_TOOLS
from pdserve.shared.config import GatewayConfig
from pdserve.shared.errors import StartupError
from pdserve.shared.sampling import MAX_GUIDED_SPEC_CHARS
from tests.unit.fake_workers import MODEL, FakeWorker
from tests.unit.gateway_fixtures import serving

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CHAT = {"model": MODEL, "messages": USER, "tools": [WEATHER, NOOP]}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def error_of(body: dict, parser: str = "hermes") -> dict:
    with pytest.raises(APIError) as info:
        parse_chat(body, tool_parser=parser)
    err = info.value
    assert err.status == 400
    payload = err.body()["error"]
    assert set(payload) == {"message", "type", "param", "code"}
    assert payload["type"] == "invalid_request_error"
    return payload


def strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


BIG = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(700)}}


@pytest.mark.parametrize(
    "patch, param, code",
    [
        ({"tools": None, "tool_choice": "auto"}, "tool_choice", "invalid_value"),
        ({"tools": None, "tool_choice": "none"}, "tool_choice", "invalid_value"),
        ({"tools": []}, "tools", "invalid_value"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": f"f{i}"}}
                    for i in range(MAX_TOOLS + 1)
                ]
            },
            "tools",
            "invalid_value",
        ),
        (
            {"tools": [{"type": "retrieval", "function": NOOP["function"]}]},
            "tools[0].type",
            "invalid_value",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
        (
            {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
            "tools[0].function.name",
            "invalid_value",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
            "tools[0].function.name",
            "invalid_value",
        ),
        ({"tools": [WEATHER, NOOP, WEATHER]}, "tools[2].function.name", "invalid_value"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
            "invalid_type",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BIG}}]},
            "tools[0].function.parameters",
            "invalid_value",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict",
            "invalid_type",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"tool_choice": 1}, "tool_choice", "invalid_type"),
        (
            {"tool_choice": {"type": "function"}},
            "tool_choice.function",
            "missing_required_parameter",
        ),
        ({"tool_choice": named("get_time")}, "tool_choice.function.name", "invalid_value"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "invalid_value",
        ),
        ({"tool_choice": named("noop"), "guided_regex": "a+"}, "guided_regex", "invalid_value"),
        (
            {"tools": [strict(WEATHER)], "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
            "messages[0].tool_calls",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
            "missing_required_parameter",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "tool", "content": None, "tool_call_id": "c"}]},
            "messages[0].content",
            "missing_required_parameter",
        ),
        (
            {"messages": [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
            "messages[1].tool_call_id",
            "invalid_value",
        ),
        (
            {
                "messages": [
                    *HISTORY[:2],
                    {"role": "tool", "tool_call_id": "call_2", "content": "x"},
                ]
            },
            "messages[2].tool_call_id",
            "invalid_value",
        ),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {**CALL, "function": {"name": "get_weather", "arguments": 3}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "invalid_type",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "tool_calls": []}]},
            "messages[1].tool_calls",
            "invalid_value",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "x"}]}]},
            "messages[1].tool_calls[0].type",
            "invalid_value",
        ),
    ],
)
def test_bad_tool_fields_are_one_400_naming_the_field(patch, param, code):
    body = {k: v for k, v in {**CHAT, **patch}.items() if v is not None}
    payload = error_of(body)
    assert (payload["param"], payload["code"]) == (param, code), payload
    assert param.split("[")[0].split(".")[0] in payload["message"]


def test_a_guide_beside_enforced_tools_says_why():
    payload = error_of({**CHAT, "tool_choice": "required", "guided_choice": ["a"]})
    assert payload["message"] == (
        "'guided_choice' cannot be combined with tool_choice 'required': the answer follows "
        "the tool calls' grammar"
    )
    payload = error_of({**CHAT, "tools": [strict(WEATHER)], "guided_json": {"type": "object"}})
    assert "tool_choice 'auto' and a strict function" in payload["message"]


def test_a_schema_the_pythonic_format_cannot_enforce_is_refused_naming_it():
    pattern = {"type": "object", "properties": {"city": {"type": "string", "pattern": "[A-Z]"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": pattern}}
    body = {**CHAT, "tools": [NOOP, tool], "tool_choice": "required"}
    payload = error_of(body, parser="pythonic")
    assert payload["param"] == "tools[1].function.parameters"
    assert payload["code"] == "invalid_function_parameters"
    assert "'pattern'" in payload["message"] and "pythonic" in payload["message"]
    # the same tools are fine where nothing is enforced, and in a JSON format
    parse_chat({**body, "tool_choice": "auto"}, tool_parser="pythonic")
    parse_chat(body, tool_parser="hermes")


def test_a_grammar_longer_than_the_wire_carries_is_refused():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40)}}
    assert len(json.dumps(schema)) < MAX_SCHEMA_CHARS
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
        for i in range(100)
    ]
    body = {**CHAT, "tools": tools, "tool_choice": "required"}
    payload = error_of(body)
    assert payload["param"] == "tools" and str(MAX_GUIDED_SPEC_CHARS) in payload["message"]
    assert parse_chat({**body, "tool_choice": named("f3")}).params.guided is not None


def test_tools_become_a_tool_setup():
    req = parse_chat(CHAT, tool_parser="llama3_json")
    setup = req.params.tools
    assert setup.choice == "auto" and setup.parser == "llama3_json" and setup.parallel
    assert setup.names == ["get_weather", "noop"]
    assert setup.functions[1] == {"name": "noop"}  # as sent: no invented fields
    assert setup.functions[0] == WEATHER["function"]
    assert req.params.guided is None  # auto without a strict function: no grammar
    assert req.tool_parser == "llama3_json"

    setup = parse_chat({**CHAT, "tool_choice": named("noop")})
    assert (setup.params.tools.choice, setup.params.tools.named) == ("function", "noop")
    # a named function is called once, as OpenAI does: the response side is told so
    assert not setup.params.tools.parallel and setup.params.tools.forced
    assert not parse_chat({**CHAT, "parallel_tool_calls": False}).params.tools.parallel
    assert setup.params.guided.kind == "grammar" and setup.params.guided_param == "tool_choice"

    none = parse_chat({**CHAT, "tool_choice": "none"}).params
    assert none.tools.choice == "none" and not none.tools.parses_calls and none.guided is None

    auto_strict = parse_chat({**CHAT, "tools": [strict(WEATHER), NOOP]}).params
    assert auto_strict.guided.kind == "grammar" and auto_strict.guided_param == "tools"
    assert '"x-guidance"' in auto_strict.guided.spec


def test_guides_and_tools_where_nothing_is_enforced():
    """auto without a strict function and none: the guide shapes the answer (documented)."""
    for choice in ("auto", "none"):
        params = parse_chat({**CHAT, "tool_choice": choice, "guided_regex": "a+"}).params
        assert params.guided.kind == "regex" and params.guided_param == "guided_regex"
        assert params.tools.choice == choice


def test_parallel_tool_calls_without_tools_changes_nothing():
    params = parse_chat({**CHAT, "tools": None, "parallel_tool_calls": False}).params
    assert params.tools is None and params.guided is None
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= CHAT_KEYS


def test_past_calls_and_tool_results_reach_the_template_as_hf_reads_them():
    text_args = {**CALL, "id": "call_2", "function": {"name": "noop", "arguments": "not json"}}
    dict_args = {**CALL, "id": "call_3", "function": {"name": "noop", "arguments": {"a": 1}}}
    messages = [
        *USER,
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, text_args, dict_args]},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "18 "}, {"type": "text", "text": "C"}],
        },
        {"role": "tool", "tool_call_id": "call_3", "content": "ok"},
    ]
    req = parse_chat({**CHAT, "messages": messages})
    assistant, result, second = req.messages[1:]
    assert assistant.content == "Checking."
    assert [c["function"]["arguments"] for c in assistant.tool_calls] == [
        {"city": "Paris"},
        "not json",
        {"a": 1},
    ]
    assert assistant.tool_calls[0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert (result.role, result.content, result.tool_call_id) == ("tool", "18 C", "call_1")
    assert second.tool_call_id == "call_3"
    # an assistant message of calls only: its content is empty text
    assert parse_chat({**CHAT, "messages": HISTORY}).messages[1].content == ""


# ----------------------------------------------------------------------------- the real app


async def sent(client: TestClient, d0: FakeWorker, body: dict, model_dir: Path):
    """POST a chat; the decode request the worker got and its prompt's text."""
    answer = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    request = await d0.next_request()
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = tok.decode(request.prompt_token_ids, skip_special_tokens=False)
    await d0.tokens(request, tok.encode("Sunny", add_special_tokens=False).ids, "stop")
    response = await asyncio.wait_for(answer, 10)
    assert response.status == 200, await response.text()
    response.release()
    return request, prompt


async def test_the_worker_gets_the_tools_prompt_and_the_grammar(model_dir):
    body = {**CHAT, "messages": HISTORY, "tool_choice": "required", "max_tokens": 5}
    async with serving(model_dir) as (client, d0):
        request, prompt = await sent(client, d0, body, model_dir)
        guide = request.sampling.guided
        assert guide.kind == "grammar" and '"name\\": \\"get_weather\\"' in guide.spec
        assert "<tool_call>" in guide.spec
        # the test template has no tool syntax: the fallback system section, past calls as
        # text, results in a user turn (the template refuses any other role)
        assert json.dumps(WEATHER, ensure_ascii=False) in prompt
        assert "one or more function calls and nothing else" in prompt
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
        assert "<|user|>\n<tool_response>\n18 C\n</tool_response>" in prompt

        request, prompt = await sent(client, d0, {**body, "tool_choice": "auto"}, model_dir)
        assert request.sampling.guided is None and "plain text" in prompt


async def test_a_schema_llguidance_cannot_compile_is_a_400_before_dispatch(model_dir):
    bad = {"type": "object", "properties": {"city": {"type": "string", "pattern": "(?<=x)a"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    async with serving(model_dir) as (client, d0):
        for choice in ("required", named("f")):
            body = {**CHAT, "tools": [WEATHER, tool], "tool_choice": choice}
            async with client.post("/v1/chat/completions", json=body) as r:
                assert r.status == 400
                error = (await r.json())["error"]
            assert error["param"] == "tools[1].function.parameters", error
            assert error["code"] == "invalid_function_parameters"
            assert "Invalid schema for function 'f'" in error["message"]
        assert d0.received == []  # nothing reached the worker
        # not enforced (auto, no strict function): the schema is only shown to the model
        request, _ = await sent(client, d0, {**CHAT, "tools": [WEATHER, tool]}, model_dir)
        assert request.sampling.guided is None


async def test_the_tool_call_parser_option_picks_the_format(model_dir):
    body = {**CHAT, "tool_choice": named("get_weather")}
    async with serving(model_dir, tool_call_parser="llama3_json") as (client, d0):
        request, prompt = await sent(client, d0, body, model_dir)
        assert '"parameters\\": "' in request.sampling.guided.spec
        assert "<tool_call>" not in request.sampling.guided.spec
        assert '{"name": "function_name", "parameters":' in prompt
    async with serving(model_dir, tool_call_parser="pythonic") as (client, d0):
        request, prompt = await sent(client, d0, body, model_dir)
        assert '"get_weather("' in request.sampling.guided.spec
        assert "Python list of calls" in prompt


def test_the_tool_call_parser_option_is_checked(monkeypatch):
    assert GatewayConfig().tool_call_parser == "auto"
    with pytest.raises(StartupError, match="--tool-call-parser"):
        GatewayConfig(tool_call_parser="xml")


def test_openapi_describes_what_is_accepted():
    from tests.unit.test_openai_conventions import request_validator

    validator = request_validator("ChatCompletionRequest")
    accepted = [
        {**CHAT, "messages": HISTORY, "tool_choice": named("noop"), "parallel_tool_calls": False},
        {**CHAT, "tools": [strict(WEATHER)], "tool_choice": "required"},
        {
            **CHAT,
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "noop", "arguments": {"a": 1}}}],
                },
            ],
        },
    ]
    for body in accepted:
        parse_chat(body)
        assert validator.is_valid(body), list(validator.iter_errors(body))
    for refused in ({**CHAT, "tool_choice": "sometimes"}, {**CHAT, "tools": []}):
        assert not validator.is_valid(refused)
