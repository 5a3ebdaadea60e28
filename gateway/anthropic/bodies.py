"""The request bodies of Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``, as
pydantic models (``content.py`` has their blocks, messages and tools): they validate a request
and describe it in ``/openapi.json``.

``CountTokensBody`` is the conversation (``model``, ``system``, ``messages``, ``tools``,
``tool_choice``); ``MessagesBody`` adds what generation takes: ``max_tokens`` (required),
``temperature`` [0, 1] as Anthropic bounds it, ``top_p``, ``top_k`` (0 is off),
``stop_sequences``, ``stream``, and structured output as ``output_config.format``
(``{"type": "json_schema", "schema"}``). ``metadata.user_id`` and ``service_tier`` are accepted
and ignored, like chat's neutral fields; anything else is refused by name. ``thinking`` turns
the template's ``enable_thinking`` on or off (``ThinkingConfig``).

The rules that tie fields together are the models' ``after`` validators, each naming the field
a client has to change: unique tool names, a ``tool_choice`` naming one of them, a tool result
answering a call an earlier assistant message made, and enforced tools (``any``, ``tool``, or
``auto`` with a strict tool) beside ``output_config.format``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from pdserve.gateway.anthropic.content import (
    CacheControl,
    MessageParam,
    TextContent,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
    cache_field,
)
from pdserve.gateway.request_bodies import ModelField
from pdserve.gateway.sampling_fields import MAX_STOP_STRINGS, StopText, whole_float_as_int
from pdserve.gateway.schema_base import INVALID_VALUE, StrictModel, field_error
from pdserve.gateway.tenancy import TenancyFields
from pdserve.gateway.tools.request import MAX_TOOLS, tool_indices
from pdserve.gateway.tools.setup import Choice, ToolSetup
from pdserve.shared.sampling import BOUNDS, MAX_GUIDED_SPEC_CHARS, GuidedDecoding

MAX_STOP_SEQUENCES = MAX_STOP_STRINGS  # as many as chat's stop strings
MAX_USER_ID_CHARS = 256  # Anthropic's limit on metadata.user_id

# Anthropic's bound: [0, 1] (the OpenAI endpoints take up to 2)
Temperature = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
# The other bounds are the wire's (shared/sampling.py), as on the chat endpoint; an integer may
# come as 8.0, as there. Written out, so that static tools read them as types.
MaxTokens = Annotated[
    int, Field(ge=1, le=int(BOUNDS["max_tokens"].hi)), BeforeValidator(whole_float_as_int)
]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=0, le=int(BOUNDS["top_k"].hi)), BeforeValidator(whole_float_as_int)]
# tool_choice's type -> chat's tool_choice
CHAT_CHOICE: dict[str, Choice] = {
    "auto": "auto",
    "any": "required",
    "tool": "function",
    "none": "none",
}


MIN_THINKING_BUDGET = 1024  # Anthropic's floor for budget_tokens


class ThinkingConfig(StrictModel):
    """Extended thinking, on or off. The chat template hears it as ``enable_thinking`` (Qwen3's
    templates read it: off closes the reasoning in the prompt). The budget is checked as
    Anthropic checks it and bounded by ``max_tokens``, which holds thinking and answer
    together; the reasoning itself is not cut at the budget."""

    type: Literal["enabled", "disabled"] = Field(description="'enabled' or 'disabled'")
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET)] | None = Field(
        None, description=f"enabled only, required: at least {MIN_THINKING_BUDGET}, < max_tokens"
    )

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            need = "is required" if self.type == "enabled" else "is only for type 'enabled'"
            raise field_error(("budget_tokens",), INVALID_VALUE, need, self.budget_tokens)
        return self


class CountTokensBody(ModelField):
    """A conversation, counted in tokens as ``/v1/messages`` would serve it."""

    system: TextContent | None = Field(None, description="a string or text blocks")
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    tools: Annotated[list[ToolParam], Field(min_length=1, max_length=MAX_TOOLS)] | None = Field(
        None, description=f"client tools the model may call (1 to {MAX_TOOLS}, unique names)"
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description="'auto' (the default: text or calls), 'any' (one or more calls, enforced by a "
        "grammar), 'tool' naming one (one call of it), 'none' (the tools stay in the prompt)",
    )
    cache_control: CacheControl | None = cache_field()
    thinking: ThinkingConfig | None = Field(
        None, description="extended thinking on or off (the template's enable_thinking)"
    )

    @model_validator(mode="after")
    def _conversation_rules(self) -> CountTokensBody:
        self._check_tools()
        self._check_results()
        last = self.messages[-1]
        if last.role == "assistant" and any(b.type == "tool_use" for b in last.blocks):
            raise field_error(
                ("messages", len(self.messages) - 1, "content"),
                INVALID_VALUE,
                "cannot end with a tool_use block: a call's result goes in a user message",
                None,
            )
        return self

    def _check_tools(self) -> None:
        seen = tool_indices([tool.name for tool in self.tools or []])
        choice = self.tool_choice
        if isinstance(choice, (ToolChoiceAny, ToolChoiceTool)) and self.tools is None:
            raise field_error(
                ("tool_choice", "type"),
                INVALID_VALUE,
                f"can be {choice.type!r} only when 'tools' are given",
                choice.type,
            )
        if isinstance(choice, ToolChoiceTool) and choice.name not in seen:
            raise field_error(
                ("tool_choice", "name"),
                INVALID_VALUE,
                f"names {choice.name!r}, which is not one of the tools",
                choice.name,
            )

    def _check_results(self) -> None:
        """A tool result answers a call an earlier assistant message made: a template could
        not place it otherwise (chat's rule for tool messages)."""
        made: set[str] = set()
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.blocks):
                if isinstance(block, ToolUseBlockParam):
                    made.add(block.id)
                elif isinstance(block, ToolResultBlockParam) and block.tool_use_id not in made:
                    raise field_error(
                        ("messages", i, "content", j, "tool_use_id"),
                        INVALID_VALUE,
                        "must be the id of a tool_use block in an earlier assistant message",
                        block.tool_use_id,
                    )

    @property
    def tools_enforced(self) -> bool:
        """Whether a grammar shapes the answer: 'any', 'tool', or 'auto' with a strict tool."""
        choice = self.tool_choice
        if self.tools is None or isinstance(choice, ToolChoiceNone):
            return False
        if choice is None or isinstance(choice, ToolChoiceAuto):
            return any(t.strict for t in self.tools)
        return True

    def tool_setup(self, parser: str, tag_tokens: tuple[tuple[str, int], ...] = ()) -> ToolSetup:
        """Chat's ``ToolSetup`` for these tools (``tools`` given): ``any`` is chat's
        ``required``, ``tool`` its named function."""
        assert self.tools is not None
        choice = self.tool_choice
        named = choice.name if isinstance(choice, ToolChoiceTool) else None
        single = getattr(choice, "disable_parallel_tool_use", None) is True
        return ToolSetup(
            functions=tuple(t.function() for t in self.tools),
            choice=CHAT_CHOICE[choice.type] if choice is not None else "auto",
            parser=parser,
            named=named,
            # a named tool is called once (the grammar allows no more), as chat's named function
            parallel=not single and named is None,
            tag_tokens=tag_tokens,
        )


class JSONOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="the answer's JSON schema")

    @model_validator(mode="after")
    def _schema_size(self) -> JSONOutputFormat:
        if len(json.dumps(self.schema_)) > MAX_GUIDED_SPEC_CHARS:
            raise field_error(
                "schema",
                INVALID_VALUE,
                f"is longer than {MAX_GUIDED_SPEC_CHARS} characters as JSON",
                None,
            )
        return self


class OutputConfig(StrictModel):
    format: JSONOutputFormat | None = Field(
        None, description="structured output: the answer follows this JSON schema"
    )


class MetadataParam(StrictModel):
    user_id: Annotated[str, Field(max_length=MAX_USER_ID_CHARS)] | None = Field(
        None, description="accepted and ignored"
    )


class MessagesBody(TenancyFields, CountTokensBody):
    """Anthropic's Messages request, served as the chat endpoint serves the same conversation.
    Other fields are a 400 invalid_request_error unless null."""

    max_tokens: MaxTokens = Field(description="most tokens to generate")
    temperature: Temperature | None = Field(None, description="[0, 1]; 0 is greedy (default 1)")
    top_p: TopP | None = Field(None, description="nucleus sampling mass")
    top_k: TopK | None = Field(None, description="sample among the k likeliest tokens; 0 is off")
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)] | None = Field(
        None,
        description="strings that end the answer where they appear (not returned); the one "
        "matched is the response's stop_sequence",
    )
    stream: bool | None = Field(None, description="server-sent events, Anthropic's")
    output_config: OutputConfig | None = Field(
        None, description="format: {'type': 'json_schema', 'schema'}: structured output"
    )
    metadata: MetadataParam | None = Field(None, description="accepted and ignored")
    service_tier: Literal["auto", "standard_only"] | None = Field(
        None, description="accepted and ignored"
    )

    @model_validator(mode="after")
    def _generation_rules(self) -> MessagesBody:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise field_error(
                ("thinking", "budget_tokens"), INVALID_VALUE, "must be less than max_tokens", budget
            )
        if self.guided is not None and self.tools_enforced:
            raise field_error(
                ("output_config", "format"),
                INVALID_VALUE,
                "cannot be combined with enforced tools (tool_choice 'any' or 'tool', or a "
                "strict tool): the answer follows the tool calls' grammar",
                None,
            )
        return self

    @property
    def guided(self) -> GuidedDecoding | None:
        form = self.output_config.format if self.output_config is not None else None
        return (
            None
            if form is None
            else GuidedDecoding(kind="json_schema", spec=json.dumps(form.schema_))
        )

    def stop_strings(self) -> list[str]:
        """The stop sequences, each once, in the order given."""
        return list(dict.fromkeys(self.stop_sequences or []))
