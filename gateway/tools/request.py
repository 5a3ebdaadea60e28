"""Tool calling's request fields: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` on the
chat body, and the ``tool_calls`` of past assistant messages, as pydantic models (they validate
a request and describe it in ``/openapi.json``).

- ``tools``: 1 to ``MAX_TOOLS`` entries ``{"type": "function", "function": {"name",
  "description"?, "parameters"?, "strict"?}}``; names follow OpenAI's rule (``FUNCTION_NAME``)
  and are unique; ``parameters`` is a JSON schema object of at most ``MAX_SCHEMA_CHARS``
  characters as JSON (absent: the function takes no arguments).
- ``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type": "function", "function":
  {"name"}}`` naming one of ``tools``; only with ``tools``; default ``auto`` (OpenAI's).
- ``parallel_tool_calls``: whether an answer may hold several calls (default true). Accepted
  without ``tools`` too (some SDKs always send it), where it changes nothing.

Whether a schema compiles is checked where the gateway compiles grammars
(``gateway/tools/grammar.check_schemas``), with the tokenizer at hand.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pdserve.gateway.schema_base import INVALID_VALUE, StrictModel, field_error, shaped
from pdserve.gateway.tools.setup import ToolSetup

MAX_TOOLS = 128  # OpenAI's limit on tools per request
MAX_SCHEMA_CHARS = 16 * 1024  # one function's parameters, as JSON
MAX_DESCRIPTION_CHARS = 8 * 1024  # one function's description (it goes into every prompt)
FUNCTION_NAME = "^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOL_CALLS = 128  # calls on one past assistant message
MAX_ARGUMENT_CHARS = 64 * 1024  # one past call's arguments, as JSON text

FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME)]


class FunctionDefinition(StrictModel):
    name: FunctionName = Field(description="a-z, A-Z, 0-9, _ and -, at most 64 characters")
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = Field(
        None, description="what the function does: the model reads it in the prompt"
    )
    parameters: dict[str, Any] | None = Field(
        None,
        description=f"the arguments as a JSON schema object (at most {MAX_SCHEMA_CHARS} "
        "characters as JSON); absent: no arguments",
    )
    strict: bool | None = Field(
        None,
        description="true: the arguments are enforced by a grammar (always so with "
        "tool_choice 'required' or a named function)",
    )

    @model_validator(mode="after")
    def _schema_size(self) -> FunctionDefinition:
        if self.parameters is not None:
            size = len(json.dumps(self.parameters))
            if size > MAX_SCHEMA_CHARS:
                raise field_error(
                    "parameters",
                    INVALID_VALUE,
                    f"is {size} characters as JSON; at most {MAX_SCHEMA_CHARS} are accepted",
                    None,
                )
        return self

    def as_sent(self) -> dict[str, Any]:
        """The ``function`` object with its absent fields left out (``ToolSetup.functions``)."""
        return self.model_dump(exclude_none=True)


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: FunctionName


def tool_indices(names: list[str], path: tuple[str, ...] = ("name",)) -> dict[str, int]:
    """Each tool's index by its name, for every API that takes function tools; a name given
    twice is refused at the second (``tools[i]`` then ``path``: where the API keeps the name)."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise field_error(
                ("tools", i, *path),
                INVALID_VALUE,
                f"{name!r} is already the name of tools[{seen[name]}]; names must be unique",
                name,
            )
        seen[name] = i
    return seen


class NamedToolChoice(StrictModel):
    """``tool_choice`` naming the one function the answer must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Any,
    shaped(
        Literal["none", "auto", "required"],
        NamedToolChoice,
        pick=lambda v: 0 if isinstance(v, str) else 1 if isinstance(v, dict) else None,
        otherwise="must be 'none', 'auto', 'required' or an object naming a function",
    ),
]


class ToolFields(StrictModel):
    """The chat body's tool-calling fields."""

    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = Field(
        None, description=f"functions the model may call (1 to {MAX_TOOLS}, unique names)"
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description="'none' (no calls are parsed; the tools are still in the prompt), 'auto' "
        "(the default with tools: text or calls), 'required' (one or more calls, enforced by a "
        "grammar), or {'type': 'function', 'function': {'name'}} (one call of that function)",
    )
    parallel_tool_calls: bool | None = Field(
        None,
        description="whether an answer may hold more than one call (default true); changes "
        "nothing without tools",
    )

    @model_validator(mode="after")
    def _tools_fit_together(self) -> ToolFields:
        if self.tool_choice is not None and self.tools is None:
            raise field_error(
                "tool_choice",
                INVALID_VALUE,
                "is only allowed when 'tools' are given",
                self.tool_choice,
            )
        seen = tool_indices([t.function.name for t in self.tools or []], ("function", "name"))
        if isinstance(self.tool_choice, NamedToolChoice):
            named = self.tool_choice.function.name
            if named not in seen:
                raise field_error(
                    ("tool_choice", "function", "name"),
                    INVALID_VALUE,
                    f"names {named!r}, which is not one of the functions in 'tools'",
                    named,
                )
        return self

    def tool_setup(
        self, parser: str, tag_tokens: tuple[tuple[str, int], ...] = ()
    ) -> ToolSetup | None:
        """What the rest of the gateway needs of these fields; None without tools.
        ``tag_tokens``: the parser's tags the served tokenizer has as one token each."""
        if self.tools is None:
            return None
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        named = None
        if isinstance(choice, NamedToolChoice):
            named, choice = choice.function.name, "function"
        return ToolSetup(
            functions=tuple(t.function.as_sent() for t in self.tools),
            choice=choice,
            parser=parser,
            named=named,
            # a named function is called once (the grammar allows no more), as OpenAI does
            parallel=self.parallel_tool_calls is not False and named is None,
            tag_tokens=tag_tokens,
        )

    @property
    def tools_enforced(self) -> bool:
        """Whether a grammar shapes the answer: tool_choice 'required' or a named function,
        or 'auto' with a strict function."""
        if self.tools is None or self.tool_choice == "none":
            return False
        if self.tool_choice in (None, "auto"):
            return any(t.function.strict for t in self.tools)
        return True

    def tool_choice_text(self) -> str:
        """``tool_choice`` as an error message quotes it."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return f"naming {choice.function.name!r}"
        return repr(choice if choice is not None else "auto")


# ----------------------------------------------------------------------------- past calls

ArgumentText = Annotated[str, Field(max_length=MAX_ARGUMENT_CHARS)]


class CalledFunction(StrictModel):
    name: FunctionName
    arguments: Annotated[
        Any,
        shaped(
            ArgumentText,
            dict[str, Any],
            pick=lambda v: 0 if isinstance(v, str) else 1 if isinstance(v, dict) else None,
            otherwise="must be a string of JSON (OpenAI's form) or an object",
        ),
    ] = Field(description="the arguments as JSON text (OpenAI's form), or as an object")


class ToolCall(StrictModel):
    """One call of a past assistant message, as the API returned it."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """The call as Hugging Face chat templates read it: ``function.arguments`` an object
        where the text parses as one (what transformers' documentation asks for), else the
        text as sent."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


ToolCalls = Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOL_CALLS)]


ToolCallId = Annotated[str, Field(min_length=1, max_length=256)]
