"""An Anthropic Messages request lowered to the chat endpoint's own request (``ChatRequest``:
``GenerationParams`` and the conversation as chat messages), so everything after it - the chat
template with tools in the prompt, reasoning, tool grammars, structured output, sampling,
dispatch through prefill and decode, metrics and spans - is the chat endpoint's code, run once.

The conversation becomes what the equivalent chat request would hold:

- ``system`` (a string, or text blocks joined as chat joins text parts) is the first message,
  role ``system``;
- a user message's text blocks are one user message; each ``tool_result`` becomes a ``tool``
  message answering its ``tool_use_id``, in the order written (text between results stays
  between them); ``is_error: true`` puts ``Error: `` before the result, so the model reads
  that the call failed (chat messages have no such flag);
- an assistant message's text is its content, its ``tool_use`` blocks its ``tool_calls``
  (``input`` is the arguments object templates read), its ``thinking`` its
  ``reasoning_content``;
- a last assistant message is continued, as Anthropic continues it ("prefill"): chat's
  ``continue_final_message``, no generation prompt, and the answer holds only what follows.

Tools become chat's ``ToolSetup`` (``any`` is ``required``, ``tool`` a named function,
``disable_parallel_tool_use`` is ``parallel_tool_calls: false``); enforced calls get chat's
grammar (``tools.grammar.tool_guide``), and ``output_config.format`` chat's JSON-schema guide.
"""

from __future__ import annotations

from typing import Any

from pdserve.gateway.anthropic.bodies import CountTokensBody, MessagesBody
from pdserve.gateway.anthropic.content import (
    MessageParam,
    TextBlockParam,
    ThinkingBlockParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from pdserve.gateway.api_models import ChatMessage, ChatRequest, GenerationParams, validated
from pdserve.gateway.tools.grammar import ToolGrammarError, tool_guide

TagTokens = tuple[tuple[str, int], ...]
ERROR_PREFIX = "Error: "  # before a tool result with is_error: true


def parse_messages(body: dict[str, Any], tool_parser: str, tag_tokens: TagTokens) -> ChatRequest:
    """A ``/v1/messages`` body as the chat request it is served as (a 400 naming the field when
    it is invalid). ``tool_parser`` and ``tag_tokens``: the served model's tool-call format and
    its one-token tags (``prepare.tool_format``)."""
    req = validated(MessagesBody, body)
    params = GenerationParams(
        model=req.model,
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        stop=req.stop_strings(),
        stream=bool(req.stream),
        guided=req.guided,
        guided_param="output_config.format" if req.guided is not None else None,
        cache_salt=req.cache_salt,
        priority=req.priority or 0,
    )
    if req.tools is not None:
        params.tools = req.tool_setup(tool_parser, tag_tokens)
        try:
            guide = tool_guide(params.tools)
        except ToolGrammarError as exc:
            raise exc.api_error() from None
        if guide is not None:  # the body refuses tool grammars beside output_config.format
            params.guided = guide
            params.guided_param = "tool_choice" if params.tools.forced else "tools"
    return _chat_request(req, params, tool_parser)


def parse_count(body: dict[str, Any], tool_parser: str) -> ChatRequest:
    """A ``/v1/messages/count_tokens`` body as the chat request whose prompt it counts."""
    req = validated(CountTokensBody, body)
    params = GenerationParams(model=req.model, max_tokens=None)
    if req.tools is not None:
        params.tools = req.tool_setup(tool_parser)
    return _chat_request(req, params, tool_parser)


def _chat_request(req: CountTokensBody, params: GenerationParams, parser: str) -> ChatRequest:
    continued = req.messages[-1].role == "assistant"
    return ChatRequest(
        params=params,
        messages=chat_messages(req.system, req.messages),
        add_generation_prompt=not continued,
        continue_final_message=continued,
        tool_parser=parser,
        template_kwargs=_thinking_kwargs(req),
    )


def _thinking_kwargs(req: CountTokensBody) -> dict[str, Any]:
    """What the chat template hears of ``thinking`` (Qwen3's templates read enable_thinking)."""
    if req.thinking is None:
        return {}
    return {"enable_thinking": req.thinking.type == "enabled"}


def chat_messages(
    system: str | list[TextBlockParam] | None, messages: list[MessageParam]
) -> list[ChatMessage]:
    """The conversation as the chat template gets it."""
    out: list[ChatMessage] = []
    if system is not None:
        text = system if isinstance(system, str) else "".join(b.text for b in system)
        out.append(ChatMessage(role="system", content=text))
    for message in messages:
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "assistant":
            out.append(_assistant(message))
        else:
            out += _user(message)
    return out


def _assistant(message: MessageParam) -> ChatMessage:
    blocks = message.blocks
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks
        if isinstance(b, ToolUseBlockParam)
    ]
    thoughts = [b.thinking for b in blocks if isinstance(b, ThinkingBlockParam)]
    return ChatMessage(
        role="assistant",
        content="".join(b.text for b in blocks if isinstance(b, TextBlockParam)),
        tool_calls=calls or None,
        reasoning_content="".join(thoughts) if thoughts else None,
    )


def _user(message: MessageParam) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    text: list[str] = []

    def said() -> None:
        if text:
            out.append(ChatMessage(role="user", content="".join(text)))
            text.clear()

    for block in message.blocks:
        if isinstance(block, ToolResultBlockParam):
            said()
            result = (ERROR_PREFIX if block.is_error else "") + block.text()
            out.append(ChatMessage(role="tool", content=result, tool_call_id=block.tool_use_id))
        else:
            text.append(block.text)
    said()
    return out
