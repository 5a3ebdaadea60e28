"""A Responses conversation lowered to the chat endpoint's request: items in, a ``ChatRequest``
out, which ``gateway/prepare.chat_prompt`` serves like any chat (one conversion core).

The conversation is the stored one first (``previous_response_id``: that response's input items,
earlier turns' included, then its output), then the request's own ``input``. ``instructions``
become a system message put first; a stored response's instructions are not carried over, as in
OpenAI. Items become chat messages:

- a ``message`` item: a message of its role (``developer`` as ``system``, as the chat endpoint
  treats it), its parts' text joined;
- ``function_call`` items: ``tool_calls`` of the assistant message they follow, or of a new
  assistant message (a response whose answer is only calls has no message item);
- a ``function_call_output``: a ``tool`` message answering the call with that ``call_id``, which
  an earlier item of the conversation must have made (OpenAI's rule; a template could not place
  it otherwise);
- a ``reasoning`` item: the ``reasoning_content`` of the assistant message that follows it (as
  the chat endpoint hands an assistant message's reasoning to the template), dropped when no
  assistant item follows.

``stored_items`` writes the request's input as it is stored and listed (``input_items``): each
item in its full shape, with an id.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter

from pdserve.gateway.api_models import ChatMessage, ChatRequest, GenerationParams
from pdserve.gateway.errors import bad_request
from pdserve.gateway.responses.bodies import ResponsesBody
from pdserve.gateway.responses.items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    ItemModel,
    MessageItem,
    ReasoningItem,
)
from pdserve.gateway.tools.grammar import ToolGrammarError, tool_guide
from pdserve.gateway.tools.request import ToolCall

ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}
_ITEMS = TypeAdapter(list[Item])


def new_id(prefix: str) -> str:
    """An id as OpenAI's look: a prefix, ``_`` and random hex."""
    return f"{prefix}_{secrets.token_hex(24)}"


def input_items(body: ResponsesBody) -> list[ItemModel]:
    """The request's ``input`` as items: a string is one user message."""
    if isinstance(body.input, str):
        return [MessageItem.model_validate({"role": "user", "content": body.input})]
    return list(body.input)


def read_items(stored: list[dict[str, Any]]) -> list[ItemModel]:
    """Items as the store holds them (``stored_items``, and responses' ``output``), checked by
    the same models as a request's input."""
    return _ITEMS.validate_python(stored, strict=True)


def stored_items(items: list[ItemModel]) -> list[dict[str, Any]]:
    """Items in their full shape, each with an id (the one sent, else a new one)."""
    return [_full(item) for item in items]


def _full(item: ItemModel) -> dict[str, Any]:
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        parts = (
            [{"type": kind, "text": item.content}]
            if isinstance(item.content, str)
            else [p.model_dump(exclude_none=True) for p in item.content]
        )
        return {
            "type": "message",
            "id": item.id or new_id("msg"),
            "role": item.role,
            "content": parts,
            "status": item.status or "completed",
        }
    body = item.model_dump(exclude_none=True)
    body["id"] = item.id or new_id(ID_PREFIX[item.type])
    if not isinstance(item, ReasoningItem):
        body["status"] = item.status or "completed"
    else:
        body.setdefault("summary", [])
    return body


def chat_messages(
    instructions: str | None, items: list[ItemModel], param: Callable[[int], str]
) -> list[ChatMessage]:
    """The chat messages of a conversation; ``param(i)`` names item ``i`` in a 400."""
    messages: list[ChatMessage] = []
    if instructions is not None:
        messages.append(ChatMessage(role="system", content=instructions))
    reasoning: str | None = None  # a reasoning item's text, for the assistant message after it
    calls: set[str] = set()  # the call ids made so far
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, MessageItem) and item.role == "assistant":
            messages.append(
                ChatMessage(role="assistant", content=item.text(), reasoning_content=reasoning)
            )
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = _template_call(item)
            calls.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and reasoning is None:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(
                    ChatMessage(
                        role="assistant", content="", tool_calls=[call], reasoning_content=reasoning
                    )
                )
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise bad_request(
                    f"'{param(i)}.call_id' must be the call_id of an earlier function_call item",
                    f"{param(i)}.call_id",
                    "invalid_value",
                )
            messages.append(
                ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id)
            )
        reasoning = None
    return messages


def _template_call(item: FunctionCallItem) -> dict[str, Any]:
    """The call as chat templates read it: the chat endpoint's own conversion (arguments an
    object where the text parses as one)."""
    call = {"id": item.call_id, "type": "function", "function": {}}
    call["function"] = {"name": item.name, "arguments": item.arguments}
    return ToolCall.model_validate(call, strict=True).for_template()


def chat_request(
    body: ResponsesBody,
    history: list[ItemModel],
    parser: str,
    tag_tokens: tuple[tuple[str, int], ...],
) -> ChatRequest:
    """The chat request a Responses request lowers to: ``history`` (a stored conversation)
    and the request's input, with its sampling, tools and output format."""
    own = input_items(body)
    skip = len(history)

    def param(i: int) -> str:
        return f"input[{i - skip}]" if i >= skip else "previous_response_id"

    messages = chat_messages(body.instructions, history + own, param)
    params = GenerationParams(
        model=body.model,
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        stream=bool(body.stream),
        cache_salt=body.cache_salt,
        priority=body.priority or 0,
    )
    params.tools = body.tool_setup(parser, tag_tokens)
    try:
        guide = tool_guide(params.tools)
    except ToolGrammarError as exc:
        raise exc.api_error() from None
    if guide is not None:  # the body refuses a text.format beside enforced calls
        params.guided = guide
        params.guided_param = "tool_choice" if params.tools and params.tools.forced else "tools"
    elif body.guided is not None:
        params.guided, params.guided_param = body.guided, "text.format"
    return ChatRequest(params=params, messages=messages, tool_parser=parser)
