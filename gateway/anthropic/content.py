"""The pieces of an Anthropic Messages request: content blocks, messages, tools and the tool
choice, as pydantic models on the same ``StrictModel`` as the OpenAI bodies (strict types,
unknown fields refused, null read as absent). ``bodies.py`` puts them together.

- A user message holds ``text`` and ``tool_result`` blocks (``tool_use_id``, ``content`` a
  string or text blocks, ``is_error``); an assistant message ``text``, ``tool_use`` (``id``,
  ``name``, ``input`` object) and ``thinking`` blocks (a reply sent back whole). Images,
  documents and the other block types are refused by name: nothing here can read them.
- ``tools``: client tools ``{"name", "description"?, "input_schema", "strict"?}``, with chat's
  bounds on functions (``gateway/tools/request.py``); Anthropic's server tools are refused.
- ``tool_choice``: ``auto``, ``any``, ``tool`` (``name``), ``none``; ``disable_parallel_tool_use``.
- ``cache_control`` is accepted wherever Anthropic takes it, and ignored: every prompt is
  prefix-cached here, marked or not.

Blocks are picked by their ``type`` before they are validated (``typed``), so an error names the
path the client wrote (``messages[0].content[1].input``) and an unknown type is one clear error.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Field, PlainValidator, TypeAdapter, model_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.schema_base import INVALID_TYPE, INVALID_VALUE, StrictModel, field_error
from pdserve.gateway.tools.request import (
    MAX_DESCRIPTION_CHARS,
    MAX_SCHEMA_CHARS,
    FunctionName,
)

UNSUPPORTED_BLOCK = "unsupported_content_type"


def typed(members: dict[str, Any], unsupported: tuple[str, ...], what: str) -> PlainValidator:
    """A union picked by the value's ``type``: ``members[type]``; a type in ``unsupported`` is
    refused by name, any other is an error listing the accepted ones."""
    adapters = {kind: TypeAdapter(model) for kind, model in members.items()}
    accepted = ", ".join(repr(k) for k in members)

    def validate(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if not isinstance(value, dict):
            raise PydanticCustomError(INVALID_TYPE, "must be {what} object", {"what": what})
        if kind in unsupported:
            raise PydanticCustomError(
                UNSUPPORTED_BLOCK,
                "has type {kind}, which is not supported here",
                {"kind": repr(kind)},
            )
        if kind not in adapters:
            raise PydanticCustomError(
                INVALID_VALUE,
                "must be {what} with 'type' one of {accepted}",
                {"what": what, "accepted": accepted},
            )
        return adapters[kind].validate_python(value, strict=True)

    schema_type = Union[tuple(members.values())]  # noqa: UP007 (a runtime tuple of members)
    return PlainValidator(validate, json_schema_input_type=schema_type)


class CacheControl(StrictModel):
    """Anthropic's prompt-caching marker: accepted and ignored (every prompt's blocks are
    prefix-cached here, marked or not)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


def cache_field() -> Any:
    """``cache_control``'s field (a fresh one per model: pydantic keeps a field's info)."""
    return Field(None, description="accepted and ignored: the prefix cache needs no markers")


class TextBlockParam(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = cache_field()


class ToolUseBlockParam(StrictModel):
    """A call an earlier assistant reply made."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: FunctionName
    input: dict[str, Any] = Field(description="the call's arguments")
    cache_control: CacheControl | None = cache_field()


_TEXT_BLOCKS: TypeAdapter[list[TextBlockParam]] = TypeAdapter(
    Annotated[
        list[Annotated[Any, typed({"text": TextBlockParam}, ("image",), "a text block")]],
        Field(min_length=1),
    ]
)

# A string, or text blocks: the system prompt, a tool result's content.
TextContent = Annotated[
    Any,
    PlainValidator(
        lambda v: v if isinstance(v, str) else _TEXT_BLOCKS.validate_python(v, strict=True),
        json_schema_input_type=Union[str, list[TextBlockParam]],  # noqa: UP007
    ),
]


class ToolResultBlockParam(StrictModel):
    """A call's result, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: TextContent | None = Field(None, description="a string or text blocks")
    is_error: bool | None = Field(None, description="the call failed: the model is told so")
    cache_control: CacheControl | None = cache_field()

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(block.text for block in self.content)
        return self.content or ""


class ThinkingBlockParam(StrictModel):
    """An earlier reply's reasoning, sent back whole (its signature is not checked)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = Annotated[
    Any,
    typed(
        {
            "text": TextBlockParam,
            "tool_use": ToolUseBlockParam,
            "tool_result": ToolResultBlockParam,
            "thinking": ThinkingBlockParam,
        },
        unsupported=(
            "image",
            "document",
            "search_result",
            "redacted_thinking",
            "server_tool_use",
            "web_search_tool_result",
            "container_upload",
        ),
        what="a content block",
    ),
]

# which blocks each role's message may hold
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: Annotated[
        Any,
        PlainValidator(
            lambda v: v if isinstance(v, str) else _BLOCKS.validate_python(v, strict=True),
            json_schema_input_type=Union[str, list[Block]],  # noqa: UP007
        ),
    ] = Field(description="a string, or content blocks")

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> MessageParam:
        for i, block in enumerate(self.blocks):
            if block.type not in ROLE_BLOCKS[self.role]:
                allowed = ", ".join(ROLE_BLOCKS[self.role])
                raise field_error(
                    ("content", i, "type"),
                    INVALID_VALUE,
                    f"must be one of {allowed} in a {self.role} message, not {block.type!r}",
                    block.type,
                )
        return self

    @property
    def blocks(self) -> list[Any]:
        return [] if isinstance(self.content, str) else self.content


_BLOCKS: TypeAdapter[list[Any]] = TypeAdapter(Annotated[list[Block], Field(min_length=1)])


class ToolParam(StrictModel):
    """A client tool: a function the model may call."""

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind is not None and kind != "custom":
            raise PydanticCustomError(
                UNSUPPORTED_BLOCK,
                "has type {kind}, which is not supported here (only client tools: 'custom')",
                {"kind": repr(kind)},
            )
        return data

    type: Literal["custom"] | None = Field(
        None, description="'custom' or absent; Anthropic's server tools are not served"
    )
    name: FunctionName = Field(description="a-z, A-Z, 0-9, _ and -, at most 64 characters")
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    input_schema: dict[str, Any] = Field(
        description=f"the arguments as a JSON schema object (at most {MAX_SCHEMA_CHARS} "
        "characters as JSON)"
    )
    strict: bool | None = Field(
        None, description="true: the input is enforced by a grammar (always so with 'any' / 'tool')"
    )
    cache_control: CacheControl | None = cache_field()

    @model_validator(mode="after")
    def _schema_size(self) -> ToolParam:
        size = len(json.dumps(self.input_schema))
        if size > MAX_SCHEMA_CHARS:
            raise field_error(
                "input_schema",
                INVALID_VALUE,
                f"is {size} characters as JSON; at most {MAX_SCHEMA_CHARS} are accepted",
                None,
            )
        return self

    def function(self) -> dict[str, Any]:
        """As chat's ``function`` object (``ToolSetup.functions``)."""
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.input_schema
        if self.strict is not None:
            out["strict"] = self.strict
        return out


class ToolChoiceAuto(StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = Field(None, description="true: at most one call")


class ToolChoiceAny(StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = Field(None, description="true: exactly one call")


class ToolChoiceTool(StrictModel):
    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: bool | None = Field(None, description="one call either way")


class ToolChoiceNone(StrictModel):
    type: Literal["none"]


ToolChoice = Annotated[
    Any,
    typed(
        {
            "auto": ToolChoiceAuto,
            "any": ToolChoiceAny,
            "tool": ToolChoiceTool,
            "none": ToolChoiceNone,
        },
        unsupported=(),
        what="a tool choice",
    ),
]
