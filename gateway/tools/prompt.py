"""Tools in the prompt: what a chat template is given when a request has ``tools``, assistant
messages with ``tool_calls``, or ``tool`` messages.

A template **has tool syntax** when its source reads a ``tools`` variable (Hermes, Qwen, Llama
3.1, Mistral templates do). It then gets what transformers' ``apply_chat_template`` gives it:
``tools`` as a list of ``{"type": "function", "function": {...}}``, assistant messages with a
``tool_calls`` list (``function.arguments`` an object where the JSON text parses as one), and
``tool`` messages with their ``tool_call_id`` and content.

A template without (SmolLM2-135M-Instruct's, the default model's) gets the **fallback**, plain
messages any template can hold:

- a system section (added to the first system message, or a new first message) listing each
  function as one line of JSON and saying how to call them in the parser's format (hermes:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and what ``tool_choice`` asks;
- past calls written into their assistant message's text, in the same format;
- tool results as a user message (consecutive results, and a user message right after them,
  merged into one) with each result in ``<tool_response>`` tags, so templates that allow only
  user and assistant turns, alternating, render them.

``tool_choice: "none"`` still lists the tools (OpenAI does), and the fallback says not to call.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pdserve.gateway.api_models import ChatMessage
from pdserve.gateway.tools.pythonic_grammar import python_literal
from pdserve.gateway.tools.setup import PARSERS, ToolSetup

_READS_TOOLS = re.compile(r"\btools\b")
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def reads_tools(template_source: str) -> bool:
    """Whether a chat template has tool syntax: its source reads ``tools``."""
    return bool(_READS_TOOLS.search(template_source))


@functools.lru_cache(maxsize=8)
def resolve_parser(flag: str, template_source: str | None) -> str:
    """``--tool-call-parser``: a parser name as is; ``auto``: the template's own format
    (``parsers.parser_for_template``), or ``hermes`` for a template without tool syntax,
    which gets the fallback prompt in hermes' format."""
    if flag != "auto":
        return flag
    if template_source is None or not reads_tools(template_source):
        return "hermes"
    from pdserve.gateway.tools.parsers import parser_for_template  # the response side's

    parser = parser_for_template(template_source)
    return parser if parser in PARSERS else "hermes"


def tools_variable(setup: ToolSetup) -> list[dict[str, Any]]:
    """The template's ``tools``, as transformers passes them."""
    return [{"type": "function", "function": dict(f)} for f in setup.functions]


def native_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation for a template with tool syntax."""
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls is not None:
            item["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        _reasoning(m, item)
        out.append(item)
    return out


def _reasoning(m: ChatMessage, item: dict[str, Any]) -> None:
    """A past answer's reasoning, for the templates that read it (Qwen3's shows the latest
    turn's in <think> tags); transformers hands a message's keys over as they come."""
    if m.reasoning_content is not None:
        item["reasoning_content"] = m.reasoning_content


def fallback_messages(
    messages: list[ChatMessage], setup: ToolSetup | None, parser: str
) -> list[dict[str, Any]]:
    """The conversation for a template without tool syntax: tools described in a system
    section, past calls and their results written as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            block = f"{RESPONSE_OPEN}\n{m.content}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
            continue
        if m.role == "user" and out and out[-1].get("_results"):
            # one user turn: templates that make roles alternate accept the conversation
            out[-1]["content"] += "\n" + m.content
            out[-1]["_results"] = False
            continue
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls:
            calls = written_calls(m.tool_calls, parser)
            item["content"] = f"{m.content}\n{calls}" if m.content else calls
        _reasoning(m, item)
        out.append(item)
    for item in out:
        item.pop("_results", None)
    if setup is not None:
        section = system_section(setup)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}"
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def written_calls(calls: list[dict[str, Any]], parser: str) -> str:
    """Past calls (``ToolCall.for_template`` shape) as the model writes them in ``parser``'s
    format."""
    pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    if parser == "pythonic":
        return "[" + ", ".join(_python_call(name, args) for name, args in pairs) + "]"
    key = "parameters" if parser == "llama3_json" else "arguments"
    objects = [json.dumps({"name": name, key: args}, ensure_ascii=False) for name, args in pairs]
    if parser == "llama3_json":
        return "; ".join(objects)
    return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)


def _python_call(name: str, arguments: Any) -> str:
    if not isinstance(arguments, dict):  # text that is not a JSON object: kept as one value
        return f"{name}({python_literal(arguments)})"
    return f"{name}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in arguments.items()) + ")"


_FORMATS = {
    "hermes": (
        "To call a function, write a JSON object with its name and arguments between "
        "<tool_call> and </tool_call> tags, on lines of their own:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n'
        "</tool_call>",
        "For several calls, write one such block after another.",
    ),
    "llama3_json": (
        "To call a function, answer with only a JSON object holding its name and arguments:\n"
        '{"name": "function_name", "parameters": {"argument": "value"}}',
        'For several calls, separate the objects with "; ".',
    ),
    "pythonic": (
        "To call a function, answer with only a Python list of calls with keyword "
        'arguments:\n[function_name(argument="value")]',
        "For several calls, put them all in the one list.",
    ),
}


def system_section(setup: ToolSetup) -> str:
    """The fallback's description of the tools and of how to call them."""
    how, several = _FORMATS.get(setup.parser, _FORMATS["hermes"])
    listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools_variable(setup))
    lines = [
        "You have access to functions. Each line below describes one as JSON: its name, what "
        "it does and a JSON schema of its arguments.",
        listed,
        "",
        how,
        several if setup.parallel else "Make at most one call.",
        f"Each result comes back in the next user message between {RESPONSE_OPEN} and "
        f"{RESPONSE_CLOSE} tags.",
    ]
    if setup.choice == "none":
        lines.append("Do not call any function now: answer in plain text.")
    elif setup.choice == "required":
        lines.append("Answer now with one or more function calls and nothing else.")
    elif setup.choice == "function":
        lines.append(f"Answer now by calling the function {setup.named} and nothing else.")
    else:
        lines.append("Call a function when it helps to answer; otherwise answer in plain text.")
    return "\n".join(lines)
