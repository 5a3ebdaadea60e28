"""What ``/v1/messages`` and ``/v1/messages/count_tokens`` send, as pydantic models:
``/openapi.json``'s schemas come from them, and the tests hold real answers to them (as
``gateway/response_models.py`` does for the OpenAI endpoints, whose ``ResponseModel`` they use:
unknown fields fail the tests, the published schema stays open to additions).

A message's ``content`` is ``thinking`` (with ``--reasoning-parser``), ``text`` and ``tool_use``
blocks; a stream is one event model per Anthropic event type, each event's data being its model
with the event's name as its ``type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pdserve.gateway.response_models import ResponseModel

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(ResponseModel):
    type: Literal["text"]
    text: str


class ThinkingBlock(ResponseModel):
    type: Literal["thinking"]
    thinking: str = Field(description="the answer's reasoning (--reasoning-parser)")
    signature: str = Field(description="always empty: the reasoning is not signed")


class ToolUseBlock(ResponseModel):
    type: Literal["tool_use"]
    id: str = Field(description="toolu_...: the id a tool_result answers")
    name: str
    input: dict[str, Any] = Field(description="the call's arguments")


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]


class MessageUsage(ResponseModel):
    input_tokens: int = Field(description="prompt tokens computed (not read from the cache)")
    output_tokens: int
    cache_creation_input_tokens: int = Field(description="always 0: caching is automatic")
    cache_read_input_tokens: int = Field(
        description="prompt tokens served from a prefill worker's prefix cache"
    )


class AnthropicMessage(ResponseModel):
    id: str = Field(description="msg_ and the request's id")
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = Field(description="null only in message_start")
    stop_sequence: str | None = Field(description="the stop sequence that ended the answer")
    usage: MessageUsage


class MessageStartEvent(ResponseModel):
    type: Literal["message_start"]
    message: AnthropicMessage


class PingEvent(ResponseModel):
    type: Literal["ping"]


class ContentBlockStartEvent(ResponseModel):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlock = Field(description="empty: its deltas follow")


class TextDelta(ResponseModel):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(ResponseModel):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(ResponseModel):
    type: Literal["input_json_delta"]
    partial_json: str = Field(description="the tool_use's input as JSON text (here: whole)")


class ContentBlockDeltaEvent(ResponseModel):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStopEvent(ResponseModel):
    type: Literal["content_block_stop"]
    index: int


class MessageDelta(ResponseModel):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDeltaEvent(ResponseModel):
    type: Literal["message_delta"]
    delta: MessageDelta
    usage: MessageUsage = Field(description="the final usage")


class MessageStopEvent(ResponseModel):
    type: Literal["message_stop"]


class AnthropicErrorDetail(ResponseModel):
    type: Literal[
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "timeout_error",
        "api_error",
        "overloaded_error",
    ]
    message: str


class AnthropicError(ResponseModel):
    """Every error of these endpoints, and a stream's ``error`` event."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class CountTokensResponse(ResponseModel):
    input_tokens: int = Field(description="the prompt's tokens, as /v1/messages would serve it")


# the models of a stream's events, by event name
STREAM_EVENTS: dict[str, type[ResponseModel]] = {
    "message_start": MessageStartEvent,
    "ping": PingEvent,
    "content_block_start": ContentBlockStartEvent,
    "content_block_delta": ContentBlockDeltaEvent,
    "content_block_stop": ContentBlockStopEvent,
    "message_delta": MessageDeltaEvent,
    "message_stop": MessageStopEvent,
    "error": AnthropicError,
}
