"""The request body of ``POST /v1/responses`` (OpenAI's Responses API) as a pydantic model: it
validates a request and describes it in ``/openapi.json``, as ``gateway/request_bodies.py``'s
models do for chat.

Served: ``model``, ``input`` (a string or items: ``items.py``), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``text.format`` (``text``,
``json_object``, ``json_schema``: the chat endpoint's structured output), function ``tools`` with
``tool_choice`` and ``parallel_tool_calls``, ``store`` and ``previous_response_id``.
``metadata`` is kept and returned; ``user``, ``service_tier``, ``safety_identifier``,
``prompt_cache_key``, ``stream_options.include_obfuscation`` and ``truncation: "disabled"`` are
accepted and change nothing. ``background: true`` is refused (not built), as are the other
tool types, ``include`` entries, ``reasoning``, ``top_logprobs``, ``max_tool_calls``,
``conversation`` and ``prompt``: each a 400 naming it.

Unlike OpenAI, a function's ``strict`` defaults to false, as on the chat endpoint: true enforces
its arguments with a grammar (then every call the model writes follows the schema).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.guided_fields import SCHEMA_NAME, SchemaObject
from pdserve.gateway.request_bodies import ModelField
from pdserve.gateway.responses.items import Input, ItemId
from pdserve.gateway.sampling_fields import Metadata, bounded_integer
from pdserve.gateway.schema_base import (
    INVALID_VALUE,
    UNSUPPORTED,
    StrictModel,
    field_error,
    refused,
    shaped,
)
from pdserve.gateway.tenancy import TenancyFields
from pdserve.gateway.tools.request import (
    MAX_TOOLS,
    FunctionDefinition,
    FunctionName,
    tool_indices,
)
from pdserve.gateway.tools.setup import ToolSetup
from pdserve.shared.sampling import MAX_GUIDED_SPEC_CHARS, GuidedDecoding

if TYPE_CHECKING:  # pyright sees what a field holds; pydantic gets the types that validate it
    MaxOutputTokens: TypeAlias = int
    Temperature: TypeAlias = float
    TopP: TypeAlias = float
    Verbosity: TypeAlias = None
    Reasoning: TypeAlias = None
    TopLogprobs: TypeAlias = None
    MaxToolCalls: TypeAlias = None
    Conversation: TypeAlias = None
    PromptTemplate: TypeAlias = None
else:
    from pdserve.gateway.sampling_fields import Temperature, TopP

    MaxOutputTokens = bounded_integer("max_tokens", minimum=1)
    Verbosity = refused("verbosity is not supported")
    Reasoning = refused("reasoning options are not supported")
    TopLogprobs = refused("log-probs are not produced by /v1/responses")
    MaxToolCalls = refused("max_tool_calls is not supported")
    Conversation = refused("conversations are not supported; use previous_response_id")
    PromptTemplate = refused("prompt templates are not supported")


def _only_functions(kind: Any) -> Any:
    if isinstance(kind, str) and kind != "function":
        raise PydanticCustomError(
            "unsupported_tool_type",
            "{kind} is not supported; only 'function' tools are",
            {"kind": repr(kind[:40])},
        )
    return kind


def _nothing_included(value: Any) -> Any:
    if isinstance(value, list) and value:
        raise PydanticCustomError(
            UNSUPPORTED,
            "{entry} is not produced; only an empty list is accepted",
            {"entry": repr(str(value[0])[:60])},
        )
    return value


class FunctionTool(FunctionDefinition):
    """A function the model may call: the Responses API's flat shape (``name`` beside
    ``type``, not inside a ``function`` object)."""

    type: Annotated[Literal["function"], BeforeValidator(_only_functions)]

    @model_validator(mode="before")
    @classmethod
    def _kind_first(cls, data: Any) -> Any:
        """Another tool type is named as such, before the fields a function would need."""
        if isinstance(data, dict):
            try:
                _only_functions(data.get("type"))
            except PydanticCustomError as exc:
                raise field_error("type", exc.type, exc.message(), data.get("type")) from None
        return data


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: FunctionName


ToolChoice = Annotated[
    Any,
    shaped(
        Literal["none", "auto", "required"],
        NamedFunctionChoice,
        pick=lambda v: 0 if isinstance(v, str) else 1 if isinstance(v, dict) else None,
        otherwise="must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
    ),
]


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=SCHEMA_NAME)] | None = Field(
        None, description="json_schema: the schema's name (required there)"
    )
    schema_: SchemaObject | None = Field(
        None, alias="schema", description="json_schema: the JSON schema the answer follows"
    )
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")
    description: str | None = None

    @model_validator(mode="after")
    def _schema_goes_with_its_type(self) -> TextFormat:
        if self.type == "json_schema":
            for name, value in (("name", self.name), ("schema", self.schema_)):
                if value is None:
                    raise field_error(name, "missing_required_parameter", "is required", None)
        elif self.schema_ is not None or self.name is not None:
            raise field_error(
                "schema" if self.schema_ is not None else "name",
                INVALID_VALUE,
                "is only allowed when 'type' is 'json_schema'",
                None,
            )
        return self


class TextOptions(StrictModel):
    format: TextFormat | None = Field(
        None, description="text (default), json_object or json_schema"
    )
    verbosity: Verbosity = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = Field(
        None, description="accepted; events are never padded with obfuscation text"
    )


class ResponsesBody(TenancyFields, ModelField):
    """A response (OpenAI's Responses API), rendered with the model's chat template. Other
    fields are a 400 `unsupported_parameter` unless null."""

    input: Input = Field(description="a user message as a string, or a list of items")
    instructions: str | None = Field(
        None,
        description="a system message put first; not carried over to a response that "
        "continues this one (previous_response_id), as in OpenAI",
    )
    previous_response_id: ItemId | None = Field(
        None, description="continue this stored response: its input and output come first"
    )
    store: bool | None = Field(
        None,
        description="keep the response for GET and previous_response_id (default true; "
        "without JetStream, stored only when asked for, which is then a 400)",
    )
    max_output_tokens: MaxOutputTokens | None = Field(
        None, description="most tokens to generate; default: the rest of the context"
    )
    temperature: Temperature | None = Field(None, description="sampling temperature; 0 is greedy")
    top_p: TopP | None = Field(None, description="nucleus sampling mass")
    stream: bool | None = Field(None, description="server-sent events, one per step (below)")
    stream_options: ResponsesStreamOptions | None = None
    text: TextOptions | None = Field(None, description="the answer's format")
    tools: Annotated[list[FunctionTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = Field(
        None, description=f"functions the model may call (1 to {MAX_TOOLS})"
    )
    tool_choice: ToolChoice | None = Field(
        None, description="'none', 'auto' (default), 'required' or one named function"
    )
    parallel_tool_calls: bool | None = Field(None, description="more than one call per answer")
    metadata: Metadata | None = Field(None, description="kept and returned with the response")
    background: bool | None = Field(None, description="only false: background mode is not built")
    truncation: Literal["disabled"] | None = Field(
        None, description="only 'disabled': a conversation longer than the context is a 400"
    )
    user: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="accepted and ignored"
    )
    include: Annotated[list[str], BeforeValidator(_nothing_included)] | None = Field(
        None, description="only empty: no extra output data is produced"
    )
    reasoning: Reasoning = None
    top_logprobs: TopLogprobs = None
    max_tool_calls: MaxToolCalls = None
    conversation: Conversation = None
    prompt: PromptTemplate = None

    @model_validator(mode="after")
    def _rules(self) -> ResponsesBody:
        if self.background:
            raise field_error(
                "background",
                UNSUPPORTED,
                "background mode is not built: send the request without it",
                True,
            )
        if self.stream_options is not None and not self.stream:
            raise field_error(
                "stream_options", INVALID_VALUE, "is only allowed when 'stream' is true", None
            )
        if self.tool_choice is not None and self.tools is None:
            raise field_error(
                "tool_choice", INVALID_VALUE, "is only allowed when 'tools' are given", None
            )
        self._check_tool_names()
        guide = self.guided
        if guide is not None and len(guide.spec) > MAX_GUIDED_SPEC_CHARS:
            raise field_error(
                ("text", "format", "schema"),
                INVALID_VALUE,
                f"is longer than {MAX_GUIDED_SPEC_CHARS} characters as JSON",
                None,
            )
        if guide is not None and self.tools_enforced:
            raise field_error(
                ("text", "format"),
                INVALID_VALUE,
                "cannot be combined with enforced tool calls (tool_choice 'required', a named "
                "function, or a strict function): the answer follows the calls' grammar",
                None,
            )
        return self

    def _check_tool_names(self) -> None:
        seen = tool_indices([tool.name for tool in self.tools or []])
        if isinstance(self.tool_choice, NamedFunctionChoice) and self.tool_choice.name not in seen:
            raise field_error(
                ("tool_choice", "name"),
                INVALID_VALUE,
                f"names {self.tool_choice.name!r}, which is not one of the functions in 'tools'",
                self.tool_choice.name,
            )

    @property
    def stores(self) -> bool:
        """store defaults to true, as in OpenAI."""
        return self.store is not False

    @property
    def tools_enforced(self) -> bool:
        """Whether a grammar shapes the calls (as ``ToolFields.tools_enforced`` on chat)."""
        if self.tools is None or self.tool_choice == "none":
            return False
        if self.tool_choice in (None, "auto"):
            return any(t.strict for t in self.tools)
        return True

    @property
    def guided(self) -> GuidedDecoding | None:
        """``text.format`` as the structured output the chat endpoint's response_format makes."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return GuidedDecoding("json_object", "")
        return GuidedDecoding("json_schema", json.dumps(fmt.schema_))

    def tool_setup(self, parser: str, tag_tokens: tuple[tuple[str, int], ...]) -> ToolSetup | None:
        """The tools as the chat endpoint's ``ToolSetup``; None without tools."""
        if self.tools is None:
            return None
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        named = None
        if isinstance(choice, NamedFunctionChoice):
            named, choice = choice.name, "function"
        functions = tuple(t.model_dump(exclude_none=True, exclude={"type"}) for t in self.tools)
        return ToolSetup(
            functions=functions,
            choice=choice,
            parser=parser,
            named=named,
            parallel=self.parallel_tool_calls is not False and named is None,
            tag_tokens=tag_tokens,
        )

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them."""
        fmt = self.text.format if self.text is not None and self.text.format else None
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        for tool in tools:
            tool.setdefault("strict", False)
            tool.setdefault("description", None)
            tool.setdefault("parameters", None)
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if isinstance(choice, NamedFunctionChoice):
            choice = choice.model_dump()
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": dict(self.metadata or {}),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "temperature": 1.0 if self.temperature is None else float(self.temperature),
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None
                else {"type": "text"}
            },
            "tool_choice": choice,
            "tools": tools,
            "truncation": "disabled",
            "user": self.user,
        }
