"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` as pydantic models:
the validation and the ``/openapi.json`` schemas both come from these classes.

A chat request's messages: roles ``system``, ``developer``, ``user``, ``assistant`` (with the
``tool_calls`` it made, its content then optional) and ``tool`` (a call's result, naming the call
by ``tool_call_id``), and content as a string or a list of ``{"type": "text"}`` parts (images and
audio are refused with a 400 naming the part). Tool calling's own fields are
``gateway/tools/request.py``'s.

Each body is its endpoint's own fields plus the shared groups (sampling, streaming, structured
output, vLLM's extensions, the fields accepted and ignored; chat: tool calling). The rules that
tie fields together are the models' ``after`` validators, each naming the field a client has to
change; they run once every field is valid on its own. Where OpenAI is silent, vLLM's OpenAI server is the reference.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.guided_fields import GuidedFields
from pdserve.gateway.sampling_fields import (
    ChatNeutralFields,
    NeutralFields,
    SamplingFields,
    StreamFields,
    TokenId,
    bounded_integer,
)
from pdserve.gateway.schema_base import (
    INVALID_VALUE,
    MISSING,
    StrictModel,
    field_error,
    shaped,
)
from pdserve.gateway.tenancy import TenancyFields
from pdserve.gateway.tools.request import ToolCallId, ToolCalls, ToolFields
from pdserve.gateway.vllm_fields import ChatVllmFields, VllmFields
from pdserve.shared.sampling import MAX_MAX_TOKENS

Role = Literal["system", "developer", "user", "assistant", "tool"]


def _only_text(kind: Any) -> Any:
    if isinstance(kind, str) and kind != "text":
        raise PydanticCustomError(
            "unsupported_content_type",
            "{kind} is not supported; only 'text' parts are",
            {"kind": repr(kind[:40])},
        )
    return kind  # not a string: the Literal check says what it must be


class TextPart(StrictModel):
    type: Annotated[Literal["text"], BeforeValidator(_only_text)]
    text: str


Content = Annotated[
    Any,
    shaped(
        str,
        list[TextPart],
        pick=lambda v: 0 if isinstance(v, str) else 1 if isinstance(v, list) else None,
        otherwise="must be a string or an array of text parts",
    ),
]


class Message(StrictModel):
    role: Role
    content: Content | None = Field(None, description="required except for the assistant")
    name: str | None = None
    tool_calls: ToolCalls | None = Field(
        None, description="assistant only: the calls it made, as the API returned them"
    )
    tool_call_id: ToolCallId | None = Field(
        None, description="tool only (and required there): the id of the call answered"
    )
    reasoning_content: str | None = Field(
        None,
        description="assistant only: its reasoning, as a reply with --reasoning-parser gave it "
        "(agents send replies back whole); handed to the template, which may show or drop it",
    )

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise field_error("content", MISSING, "is required", None)
        if self.tool_calls is not None and self.role != "assistant":
            raise field_error(
                "tool_calls", INVALID_VALUE, "is only allowed on assistant messages", None
            )
        if self.role == "tool" and self.tool_call_id is None:
            raise field_error("tool_call_id", MISSING, "is required on tool messages", None)
        if self.tool_call_id is not None and self.role != "tool":
            raise field_error(
                "tool_call_id", INVALID_VALUE, "is only allowed on tool messages", None
            )
        if self.reasoning_content is not None and self.role != "assistant":
            raise field_error(
                "reasoning_content", INVALID_VALUE, "is only allowed on assistant messages", None
            )
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatMessages(StrictModel):
    """A conversation: the chat endpoint's and /tokenize's ``messages``."""

    messages: Annotated[list[Message], Field(min_length=1)]

    def _check_tool_results(self) -> None:
        """A tool message answers a call an earlier assistant message made (OpenAI's rule):
        a template could not place it otherwise. The bodies' own validators call it, after
        their other rules."""
        made: set[str] = set()
        for i, message in enumerate(self.messages):
            made.update(call.id for call in message.tool_calls or [])
            if message.role == "tool" and message.tool_call_id not in made:
                raise field_error(
                    ("messages", i, "tool_call_id"),
                    INVALID_VALUE,
                    "must be the id of a call in an earlier assistant message's 'tool_calls'",
                    message.tool_call_id,
                )


DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's legacy completions default


MAX_PROMPTS = 64  # prompts in one completions request


MAX_CHOICES = 128  # choices sampled for one request: (best_of or n) times the prompts


PromptText = Annotated[str, Field(min_length=1)]


TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_MAX_TOKENS)]


def _prompt_shape(value: Any) -> int | None:
    if isinstance(value, str):
        return 0
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0  # [] is an empty list of token ids
    if isinstance(first, (int, float)):  # bool and float too: "must be an integer" says why
        return 1
    if isinstance(first, str):
        return 2
    return 3 if isinstance(first, list) else None


Prompt = Annotated[
    Any,
    shaped(
        PromptText,
        TokenIds,
        Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)],
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)],
        pick=_prompt_shape,
        otherwise="must be a string, an array of token ids, an array of strings or an array "
        "of token-id arrays",
    ),
]


CompletionMaxTokens = bounded_integer("max_tokens")  # 0 only with echo


ChatMaxTokens = bounded_integer("max_tokens", minimum=1)


Logprobs = bounded_integer("logprobs")


BestOf = bounded_integer("n")


class ModelField(StrictModel):
    model: Annotated[str, Field(min_length=1)] = Field(description="the served model's name")


class CommonFields(
    TenancyFields, NeutralFields, GuidedFields, StreamFields, SamplingFields, ModelField
):
    """What both endpoints take."""

    def _check_min_tokens(self, max_tokens: int | None) -> None:
        if self.min_tokens is not None and max_tokens is not None and self.min_tokens > max_tokens:
            raise field_error(
                "min_tokens", INVALID_VALUE, f"must be <= max_tokens ({max_tokens})", max_tokens
            )


class CompletionBody(VllmFields, CommonFields):
    """A text completion (OpenAI's legacy API, with vLLM's extensions). Other fields are a 400
    `unsupported_parameter` unless null."""

    prompt: Prompt = Field(
        description=f"text, token ids, or a batch of up to {MAX_PROMPTS} of either; each prompt "
        "is answered with n choices"
    )
    max_tokens: CompletionMaxTokens | None = Field(
        None,
        description=f"most tokens to generate (default {DEFAULT_COMPLETION_TOKENS}); 0 only "
        "with echo (the prompt's log-probs, nothing generated)",
    )
    best_of: BestOf | None = Field(
        None,
        description="sample this many per prompt and return the n likeliest; >= n, and equal "
        "to n when streaming",
    )
    logprobs: Logprobs | None = Field(
        None, description="log-probs of each token plus this many likeliest alternatives"
    )
    echo: bool | None = Field(None, description="return the prompt before the completion")

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionBody:
        if self.max_tokens == 0 and not self.echo:
            raise field_error(
                "max_tokens",
                INVALID_VALUE,
                "must be >= 1; 0 is allowed only with 'echo': true (the prompt's log-probs, "
                "nothing generated)",
                0,
            )
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise field_error("best_of", INVALID_VALUE, f"must be >= n ({n})", self.best_of)
        if self.best_of is not None and self.best_of > n and self.stream:
            raise field_error(
                "best_of",
                INVALID_VALUE,
                "greater than n cannot be streamed: the best choices are known only at the end",
                self.best_of,
            )
        self._check_min_tokens(self.max_new_tokens)
        per_prompt, count = self.best_of or n, len(self.prompts())
        if per_prompt * count > MAX_CHOICES:
            raise field_error(
                "best_of" if self.best_of is not None else "n",
                INVALID_VALUE,
                f"times the number of prompts ({per_prompt} x {count}) must be at most "
                f"{MAX_CHOICES}",
                per_prompt,
            )
        return self

    @property
    def max_new_tokens(self) -> int:
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Every prompt, in order: one string or token list becomes a batch of one."""
        if isinstance(self.prompt, str) or not isinstance(self.prompt[0], (str, list)):
            return [self.prompt]
        return list(self.prompt)


class ChatCompletionBody(ToolFields, ChatNeutralFields, ChatVllmFields, CommonFields, ChatMessages):
    """A chat completion, rendered with the model's chat template. With `tools`, the model may
    call functions: `tool_choice` 'required' or a named function (and 'auto' with a `strict`
    function) enforce the calls' format and arguments with a grammar, which cannot be combined
    with `response_format` / `guided_*` / `structured_outputs`. Other fields are a 400
    `unsupported_parameter` unless null."""

    max_tokens: ChatMaxTokens | None = Field(
        None, description="most tokens to generate; default: the rest of the context"
    )
    max_completion_tokens: ChatMaxTokens | None = Field(
        None, description="OpenAI's newer name for max_tokens"
    )
    logprobs: bool | None = Field(None, description="log-probs of each generated token")
    top_logprobs: Logprobs | None = Field(
        None, description="with logprobs: this many likeliest alternatives per token"
    )

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionBody:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise field_error(
                "max_completion_tokens",
                INVALID_VALUE,
                "must equal max_tokens when both are given",
                self.max_completion_tokens,
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error(
                "top_logprobs",
                INVALID_VALUE,
                "is only allowed when 'logprobs' is true",
                self.top_logprobs,
            )
        self._check_min_tokens(self.max_new_tokens)
        if self.guided is not None and self.tools_enforced:
            guide = (self.guided_param or "response_format").split(".")[0]
            raise field_error(
                guide,
                INVALID_VALUE,
                f"cannot be combined with tool_choice {self.tool_choice_text()}"
                + (" and a strict function" if self.tool_choice in (None, "auto") else "")
                + ": the answer follows the tool calls' grammar",
                None,
            )
        self._check_tool_results()
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """None: up to the end of the context window."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def top_alternatives(self) -> int | None:
        """GenerationParams.logprobs: None without log-probs, else the alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None
