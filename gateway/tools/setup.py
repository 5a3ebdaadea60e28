"""What a chat request asked of tool calling, as the rest of the gateway needs it.

Built once from the validated request body (``tools``, ``tool_choice``,
``parallel_tool_calls``) and the served model's parser, carried on ``GenerationParams.tools``;
the response side reads it to decide whether and how the generated text is parsed into
``tool_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Choice = Literal["none", "auto", "required", "function"]
PARSERS = ("hermes", "llama3_json", "pythonic")  # what --tool-call-parser resolves to


@dataclass(frozen=True)
class ToolSetup:
    # each tool's ``function`` object as sent: {"name", "description"?, "parameters"?, "strict"?}
    functions: tuple[dict[str, Any], ...]
    choice: Choice  # "function": tool_choice named one function (``named``)
    parser: str  # one of PARSERS: the format the model writes calls in
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls: more than one call per answer allowed
    # the format's tags that the served tokenizer has as one token each: (tag, token id)
    tag_tokens: tuple[tuple[str, int], ...] = ()

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    @property
    def parses_calls(self) -> bool:
        """Whether the answer's text is read for calls (``none``: it is all content)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """``required`` or a named function: a grammar makes the answer be calls."""
        return self.choice in ("required", "function")
