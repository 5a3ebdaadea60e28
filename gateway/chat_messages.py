"""A chat request's messages: roles ``system``, ``developer``, ``user`` and ``assistant``, and
content as a string or a list of ``{"type": "text"}`` parts (images, audio and tool messages are
refused with a 400 naming the part or role)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.schema_base import StrictModel, field_error, shaped
from pdserve.gateway.schema_errors import MISSING

Role = Literal["system", "developer", "user", "assistant"]


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

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise field_error("content", MISSING, "is required", None)
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""
