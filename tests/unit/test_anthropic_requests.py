"""Anthropic's Messages requests, model-free: each one lowers to exactly the chat request the
chat endpoint builds from the same conversation written in OpenAI's shape (messages, tools,
tool choice, sampling, structured output), so everything after it is served once; bad bodies
are one 400 naming the field; errors take Anthropic's shape and statuses."""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.anthropic import errors as anthropic_errors
from pdserve.gateway.anthropic.lowering import ERROR_PREFIX, parse_count, parse_messages
from pdserve.gateway.api_models import parse_chat
from pdserve.gateway.errors import APIError, overloaded, timeout_error, unauthorized

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Weather in a city.", "input_schema": SCHEMA}
NOOP = {"name": "noop", "input_schema": {"type": "object"}}
OPENAI_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": SCHEMA},
}
OPENAI_NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
BASE = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "Hi"}]}

# One conversation in both APIs' shapes: system blocks, a call with its thinking, its result
# (an error, then text after it), and text blocks joined as chat joins text parts.
ANTHROPIC_TURNS = {
    "system": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather in "},
                {"type": "text", "text": "Paris?"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "is_error": True,
                    "content": [{"type": "text", "text": "timeout"}],
                },
                {"type": "text", "text": "Try again?"},
            ],
        },
    ],
}
OPENAI_TURNS = {
    "messages": [
        {"role": "system", "content": "Be brief. Be kind."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather in "},
                {"type": "text", "text": "Paris?"},
            ],
        },
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": ERROR_PREFIX + "timeout"},
        {"role": "user", "content": "Try again?"},
    ],
}


def lowered(body: dict, parser: str = "hermes"):
    return parse_messages({**BASE, **body}, parser, ())


def chat(body: dict, parser: str = "hermes"):
    return parse_chat({"model": "m", "max_tokens": 32, **body}, parser, ())


def test_a_conversation_lowers_to_the_chat_request_of_the_same_conversation():
    tools = {"tools": [WEATHER, NOOP]}
    mine = lowered({**ANTHROPIC_TURNS, **tools})
    theirs = chat({**OPENAI_TURNS, "tools": [OPENAI_WEATHER, OPENAI_NOOP]})
    assert mine.messages == theirs.messages
    assert mine.params == theirs.params
    assert (mine.add_generation_prompt, mine.continue_final_message) == (True, False)
    assert mine.messages[3].content == "Error: timeout"  # the failed call, said so
    # count_tokens renders the same conversation
    count = parse_count(
        {k: v for k, v in {**BASE, **ANTHROPIC_TURNS, **tools}.items() if k != "max_tokens"},
        "hermes",
    )
    assert count.messages == mine.messages and count.params.tools == mine.params.tools


@pytest.mark.parametrize(
    ("choice", "openai_choice", "parallel"),
    [
        (None, None, None),
        ({"type": "auto"}, "auto", None),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
        ({"type": "any"}, "required", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            None,
        ),
        ({"type": "none"}, "none", None),
    ],
)
@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
def test_tool_choice_is_chats_with_the_same_grammar(choice, openai_choice, parallel, parser):
    mine = lowered({"tools": [WEATHER, NOOP], "tool_choice": choice}, parser).params
    body = {
        "messages": BASE["messages"],
        "tools": [OPENAI_WEATHER, OPENAI_NOOP],
        "tool_choice": openai_choice,
        "parallel_tool_calls": parallel,
    }
    theirs = chat(body, parser).params
    assert mine.tools == theirs.tools
    assert (mine.guided, mine.guided_param) == (theirs.guided, theirs.guided_param)
    forced = choice is not None and choice["type"] in ("any", "tool")
    assert (mine.guided is not None) == forced


def test_a_strict_tool_under_auto_is_enforced_as_in_chat():
    mine = lowered({"tools": [{**WEATHER, "strict": True}]}).params
    strict = {**OPENAI_WEATHER, "function": {**OPENAI_WEATHER["function"], "strict": True}}
    theirs = chat({"messages": BASE["messages"], "tools": [strict]}).params
    assert mine.guided is not None and mine.guided == theirs.guided and mine.tools == theirs.tools


def test_sampling_stop_sequences_and_structured_output_are_chats():
    mine = lowered(
        {
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "stream": True,
            "stop_sequences": ["\n\n", "END", "END"],
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
            "metadata": {"user_id": "u-1"},
            "service_tier": "auto",
            "cache_control": {"type": "ephemeral"},
        }
    ).params
    theirs = chat(
        {
            "messages": BASE["messages"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "stream": True,
            "stop": ["\n\n", "END"],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            },
        }
    ).params
    assert mine.guided == theirs.guided and mine.guided_param == "output_config.format"
    theirs.guided_param = mine.guided_param
    assert mine == theirs
    assert lowered({"top_k": 0}).params.top_k == -1  # 0 is off, as in chat
    assert lowered({}).params.temperature == 1.0  # Anthropic's default


def test_a_last_assistant_message_is_continued():
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]},
    ]
    req = lowered({"messages": turns})
    assert (req.add_generation_prompt, req.continue_final_message) == (False, True)
    assert req.params.reply_role == "assistant" and req.messages[-1].content == "The colour is"
    theirs = chat(
        {
            "messages": [turns[0], {"role": "assistant", "content": "The colour is"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
    )
    assert req.messages == theirs.messages and req.params == theirs.params


def test_thinking_is_the_templates_enable_thinking():
    """Extended thinking on or off reaches the template as Qwen3's templates read it; without
    it the template decides, as in chat without chat_template_kwargs."""
    on = lowered({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048})
    off = lowered({"thinking": {"type": "disabled"}})
    assert on.template_kwargs == {"enable_thinking": True}
    assert off.template_kwargs == {"enable_thinking": False}
    assert lowered({}).template_kwargs == {}
    conversation = {"model": "m", "messages": BASE["messages"], "thinking": {"type": "disabled"}}
    counted = parse_count(conversation, "hermes")
    assert counted.template_kwargs == {"enable_thinking": False}


def test_null_is_absent_and_cache_control_is_accepted_everywhere():
    cache = {"type": "ephemeral", "ttl": "1h"}
    body = {
        "system": [{"type": "text", "text": "S", "cache_control": cache}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": cache}]}
        ],
        "tools": [{**WEATHER, "cache_control": cache, "type": "custom"}],
        "temperature": None,
        "stop_sequences": None,
        "metadata": None,
    }
    plain = lowered({"system": "S", "tools": [WEATHER]})
    assert lowered(body) == plain


BAD = [
    ({"max_tokens": None}, "max_tokens", "is required"),
    ({"max_tokens": 0}, "max_tokens", "must be >= 1"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", "is required"),
    ({"thinking": {"type": "disabled", "budget_tokens": 2048}}, "thinking.budget_tokens", "only"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens", ">= 1024"),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 4096}, "max_tokens": 4096},
        "thinking.budget_tokens",
        "less than max_tokens",
    ),
    ({"thinking": {"type": "sometimes"}}, "thinking.type", "'enabled' or 'disabled'"),
    ({"temperature": 1.5}, "temperature", "must be <= 1"),
    ({"top_p": 0}, "top_p", "must be > 0"),
    ({"stop_sequences": "END"}, "stop_sequences", "must be an array"),
    ({"metadata": {"user_id": "u", "team": "x"}}, "metadata.team", "Unsupported parameter"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "must be 'user'"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "must not be empty"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "must be"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0]",
        "'image', which is not supported",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        "messages[0].content[0]",
        "'type' one of 'text', 'tool_use', 'tool_result', 'thinking'",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
        "must be a string",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        },
        "messages[0].content[0].type",
        "in a user message, not 'tool_use'",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}],
                }
            ]
        },
        "messages[0].content[0].tool_use_id",
        "earlier assistant message",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                },
            ]
        },
        "messages[1].content",
        "cannot end with a tool_use block",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}],
                },
                BASE["messages"][0],
            ]
        },
        "messages[1].content[0].input",
        "must be an object",
    ),
    ({"tools": []}, "tools", "must not be empty"),
    ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name", "must match"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name", "names must be unique"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "is required"),
    (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "tools[0]",
        "only client tools",
    ),
    ({"tool_choice": {"type": "any"}}, "tool_choice.type", "only when 'tools' are given"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "noop"}},
        "tool_choice.name",
        "not one of the tools",
    ),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "must be a tool choice object"),
    ({"tools": [WEATHER], "tool_choice": {"type": "required"}}, "tool_choice", "'auto', 'any'"),
    (
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "any"},
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        },
        "output_config.format",
        "cannot be combined with enforced tools",
    ),
    (
        {"output_config": {"format": {"type": "json_object"}}},
        "output_config.format.type",
        "must be 'json_schema'",
    ),
    ({"output_config": {"effort": "high"}}, "output_config.effort", "Unsupported parameter"),
]


@pytest.mark.parametrize(("change", "param", "fragment"), BAD)
def test_bad_bodies_are_one_400_naming_the_field(change, param, fragment):
    with pytest.raises(APIError) as info:
        lowered(change)
    err = info.value
    assert (err.status, err.param) == (400, param), err.message
    assert fragment in err.message
    body = anthropic_errors.error_body(err)
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": err.message},
    }


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (APIError(400, "bad"), 400, "invalid_request_error"),
        (unauthorized(), 401, "authentication_error"),
        (APIError(404, "no such model"), 404, "not_found_error"),
        (APIError(409, "duplicate id"), 409, "invalid_request_error"),
        (APIError(413, "too big"), 413, "request_too_large"),
        (APIError(500, "bug"), 500, "api_error"),
        (APIError(502, "worker failed", type="server_error"), 502, "api_error"),
        (overloaded("busy"), 529, "overloaded_error"),
        (timeout_error("late"), 504, "timeout_error"),
    ],
)
def test_errors_take_anthropics_shape_and_statuses(err, status, kind):
    response = anthropic_errors.error_response(err)
    assert response.status == status
    assert json.loads(response.text) == {
        "type": "error",
        "error": {"type": kind, "message": err.message},
    }
    assert dict(response.headers).items() >= err.headers.items()  # Retry-After, WWW-Authenticate
