"""What the gateway sends, as pydantic v2 models: ``/openapi.json``'s response schemas are
generated from them, and the tests validate real responses against them.

The models describe the bodies built in ``gateway/generation.py`` (a whole answer),
``gateway/streaming.py`` (SSE chunks), ``gateway/logprob_format.py`` (the two log-prob shapes),
``gateway/errors.py`` and ``gateway/server.py`` (``/v1/models``). They are not used to build
responses, so serving costs nothing; the tests keep both in step.

Unknown fields are refused (``extra="forbid"``), so a field sent without its model fails the
tests; the published schema still leaves room for fields added later, as OpenAI's does. A field
the gateway sometimes leaves out (rather than sending null) is written with ``omitted``: not
required, and not nullable.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def _open_to_additions(schema: dict[str, Any]) -> None:
    schema.pop("additionalProperties", None)


class ResponseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_open_to_additions)


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def omitted(description: str) -> Any:
    """A field that is either absent or of its (non-null) type."""
    return Field(default=None, description=description, json_schema_extra=_no_default)


# A choice ends with "length" at max_tokens, else "stop" (EOS, a stop token or stop string). A
# worker-side abort or error never reaches a choice: it is an error response or error event.
FinishReason = Literal["stop", "length"]
# A chat answer with tool calls that ended on its own ends with "tool_calls" instead of "stop".
ChatFinishReason = Literal["stop", "length", "tool_calls"]


# ----------------------------------------------------------------------------- errors


class ErrorDetail(ResponseModel):
    message: str = Field(description="what went wrong, for people")
    type: str = Field(description="the kind of error, e.g. invalid_request_error, server_error")
    param: str | None = Field(description="the request field at fault (e.g. 'messages[0].role')")
    code: str | None = Field(description="machine-readable code, e.g. invalid_value, overloaded")


class ErrorBody(ResponseModel):
    """OpenAI's error shape: every 4xx and 5xx body, and an error event in a stream."""

    error: ErrorDetail


# ----------------------------------------------------------------------------- usage


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = Field(description="prompt tokens served from a worker's prefix cache")


class RunningUsage(ResponseModel):
    """Token counts so far: with continuous_usage_stats, on every stream chunk (vLLM's shape)."""

    prompt_tokens: int = Field(description="of every prompt in the request")
    completion_tokens: int = Field(description="generated, over every choice")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens")


class Usage(RunningUsage):
    """The request's token counts."""

    prompt_tokens_details: PromptTokensDetails


# ----------------------------------------------------------------------------- log-probs


class CompletionLogprobs(ResponseModel):
    """The completions shape: one entry per token in each list. With echo the prompt's tokens
    come first, its first token with a null log-prob and null alternatives."""

    tokens: list[str] = Field(description="each token's own text (special tokens included)")
    token_logprobs: list[float | None] = Field(
        description="each token's log-prob (-9999.0 stands for -inf); null for the prompt's "
        "first token"
    )
    top_logprobs: list[dict[str, float] | None] = Field(
        description="text -> log-prob: the token itself, then the logprobs likeliest "
        "(up to logprobs + 1 entries; other tokens sharing a text keep the likeliest); null "
        "for the prompt's first token"
    )
    text_offset: list[int] = Field(
        description="where each token's text starts in the choice's text (a stream keeps "
        "counting across chunks)"
    )


class TopLogprob(ResponseModel):
    token: str = Field(description="the token's own text")
    logprob: float = Field(description="its log-prob (-9999.0 stands for -inf)")
    bytes: list[int] = Field(description="the UTF-8 bytes of token")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(
        description="the likeliest alternatives, likeliest first (top_logprobs of them)"
    )


class ChatLogprobs(ResponseModel):
    """The chat shape: one entry per generated token."""

    content: list[ChatTokenLogprob]


class PromptLogprob(ResponseModel):
    """vLLM's log-prob of one token at one prompt position."""

    logprob: float = Field(description="-9999.0 stands for -inf")
    rank: int = Field(description="1 + how many tokens were likelier there")
    decoded_token: str = Field(description="the token's own text")


# ----------------------------------------------------------------------------- vLLM's fields

PromptLogprobs = list[dict[str, PromptLogprob] | None]
_PROMPT_LOGPROBS = (
    "with prompt_logprobs (vLLM's): per prompt token, null for the first, then token id -> "
    "log-prob: the prompt's own token first (its true rank), then the prompt_logprobs likeliest "
    "(ranks 1..k)"
)
_PROMPT_IDS = "with return_token_ids (vLLM's): the prompt's token ids, after any truncation"
_TOKEN_IDS = "with return_token_ids (vLLM's): the choice's generated token ids"
_CHUNK_TOKEN_IDS = "with return_token_ids (vLLM's): this chunk's token ids"
_CHUNK_PROMPT_IDS = _PROMPT_IDS + "; on each choice's first chunk"


# ----------------------------------------------------------------------------- completions

_INDEX = "the choice's place: prompt i's choice j is i * n + j"
_LOGPROBS = "null unless log-probs were asked"
_CREATED = "Unix time in seconds"


class CompletionChoice(ResponseModel):
    index: int = Field(description=_INDEX)
    text: str = Field(description="the generated text (after the prompt, with echo)")
    logprobs: CompletionLogprobs | None = Field(description=_LOGPROBS)
    finish_reason: FinishReason
    prompt_logprobs: PromptLogprobs = omitted(_PROMPT_LOGPROBS)
    prompt_token_ids: list[int] = omitted(_PROMPT_IDS)
    token_ids: list[int] = omitted(_TOKEN_IDS)


class Completion(ResponseModel):
    """A text completion: n choices per prompt (with best_of, the n likeliest of best_of)."""

    id: str = Field(description="'cmpl-' and the request's x-request-id")
    object: Literal["text_completion"]
    created: int = Field(description=_CREATED)
    model: str = Field(description="the model named in the request")
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(ResponseModel):
    index: int = Field(description=_INDEX)
    text: str = Field(description="the next piece of the choice's text ('' on its last chunk)")
    logprobs: CompletionLogprobs | None = Field(description="of the piece's tokens; " + _LOGPROBS)
    finish_reason: FinishReason | None = Field(description="set on the choice's last chunk")
    prompt_token_ids: list[int] = omitted(_CHUNK_PROMPT_IDS)
    token_ids: list[int] = omitted(_CHUNK_TOKEN_IDS)


_CHUNK_USAGE = (
    "only with stream_options.include_usage: null, or with continuous_usage_stats the counts "
    "so far; the full usage on the last chunk, whose choices are []"
)


class CompletionChunk(ResponseModel):
    """One server-sent event of a streamed completion: one choice's next piece."""

    id: str = Field(description="'cmpl-' and the request's x-request-id")
    object: Literal["text_completion"]
    created: int = Field(description=_CREATED)
    model: str = Field(description="the model named in the request")
    choices: list[CompletionChunkChoice] = Field(
        description="one choice, or none on the usage chunk"
    )
    usage: Usage | RunningUsage | None = Field(None, description=_CHUNK_USAGE)


# ----------------------------------------------------------------------------- chat


# The reply's role: the assistant's, or with add_generation_prompt false the last message's
ReplyRole = Literal["assistant", "user", "system", "developer"]


class FunctionCall(ResponseModel):
    name: str = Field(description="one of the request's tools")
    arguments: str = Field(description="the arguments: a JSON object, as text")


class ChatCompletionMessageToolCall(ResponseModel):
    """One call the model made."""

    id: str = Field(description="'call_' and random characters; a tool message answers it")
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(ResponseModel):
    role: ReplyRole = Field(
        description="'assistant', or with add_generation_prompt false the last message's role"
    )
    content: str | None = Field(
        description="the text (with echo, vLLM's, after the last message's content); with "
        "tools, the text around the calls, null when the answer is only calls"
    )
    reasoning_content: str | None = Field(
        None,
        description="with --reasoning-parser only: the answer's reasoning (its <think> "
        "part), null when it has none; content is then the rest, null when nothing followed",
    )
    tool_calls: list[ChatCompletionMessageToolCall] = omitted(
        "the calls, when the request had tools and the model called them"
    )


class ChatChoice(ResponseModel):
    index: int = Field(description=_INDEX)
    message: ChatMessage
    logprobs: ChatLogprobs | None = Field(description=_LOGPROBS)
    finish_reason: ChatFinishReason
    token_ids: list[int] = omitted(_TOKEN_IDS)


class ChatCompletion(ResponseModel):
    """A chat completion: n choices."""

    id: str = Field(description="'chatcmpl-' and the request's x-request-id")
    object: Literal["chat.completion"]
    created: int = Field(description=_CREATED)
    model: str = Field(description="the model named in the request")
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = omitted(_PROMPT_LOGPROBS)
    prompt_token_ids: list[int] = omitted(_PROMPT_IDS)


class FunctionCallDelta(ResponseModel):
    name: str = omitted("on the call's first delta only")
    arguments: str = Field(
        description="the next piece of the arguments' JSON text ('' on the call's first delta)"
    )


class ChoiceDeltaToolCall(ResponseModel):
    """A piece of one call: its first carries id, type and name; the next, its arguments."""

    index: int = Field(description="the call's place among the choice's calls, from 0")
    id: str = omitted("on the call's first delta only")
    type: Literal["function"] = omitted("on the call's first delta only")
    function: FunctionCallDelta


class ChatDelta(ResponseModel):
    """What a chunk adds to the message: the role (first chunk), text, a piece of the
    reasoning, a piece of a tool call, or nothing (last)."""

    role: ReplyRole = omitted("on each choice's first chunk only")
    content: str = omitted("the next piece of text ('' on the first chunk)")
    reasoning_content: str = omitted(
        "with --reasoning-parser: the next piece of the reasoning, apart from the content"
    )
    tool_calls: list[ChoiceDeltaToolCall] = omitted(
        "with tools: a piece of one call; join a call's pieces by index"
    )


class ChatChunkChoice(ResponseModel):
    index: int = Field(description=_INDEX)
    delta: ChatDelta
    logprobs: ChatLogprobs | None = Field(description="of the piece's tokens; " + _LOGPROBS)
    finish_reason: ChatFinishReason | None = Field(description="set on the choice's last chunk")
    token_ids: list[int] = omitted(_CHUNK_TOKEN_IDS)


class ChatCompletionChunk(ResponseModel):
    """One server-sent event of a streamed chat completion: one choice's next piece."""

    id: str = Field(description="'chatcmpl-' and the request's x-request-id")
    object: Literal["chat.completion.chunk"]
    created: int = Field(description=_CREATED)
    model: str = Field(description="the model named in the request")
    choices: list[ChatChunkChoice] = Field(description="one choice, or none on the usage chunk")
    usage: Usage | RunningUsage | None = Field(None, description=_CHUNK_USAGE)
    prompt_token_ids: list[int] = omitted(_PROMPT_IDS + "; on each choice's role chunk")


# ----------------------------------------------------------------------------- models


class ModelCard(ResponseModel):
    """The served model."""

    id: str = Field(description="the name requests use in 'model'")
    object: Literal["model"]
    created: int = Field(description="when the gateway loaded it, Unix time in seconds")
    owned_by: str
    max_model_len: int = Field(
        description="longest prompt + output served (the model's context, or less when the "
        "decode workers' KV cache is smaller)"
    )
    model_versions: list[str] = Field(
        description="the checkpoint versions the workers routed to serve (more than one only "
        "while a rollout switches over; standby workers are not counted)"
    )


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]


# Every response model under the name /openapi.json publishes it by.
RESPONSE_MODELS: dict[str, type[BaseModel]] = {
    "CompletionResponse": Completion,
    "CompletionChunk": CompletionChunk,
    "ChatCompletionResponse": ChatCompletion,
    "ChatCompletionChunk": ChatCompletionChunk,
    "ModelList": ModelList,
    "ModelCard": ModelCard,
    "Error": ErrorBody,
}
