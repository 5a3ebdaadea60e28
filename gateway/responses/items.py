"""The items of a Responses conversation, as pydantic models: what ``input`` may hold, and what
a stored conversation is read back as.

- ``message``: role ``user``, ``system``, ``developer`` or ``assistant``; content a string or a
  list of ``input_text`` / ``output_text`` parts (either kind on any role: a client that sends
  back an earlier ``output`` whole, or writes history by hand, is not refused over which of the
  two it used). ``type`` may be left out, as OpenAI's "easy" input messages do.
- ``function_call``: a call the model made (``call_id``, ``name``, ``arguments`` as JSON text),
  sent back with the conversation.
- ``function_call_output``: the result of a call, naming it by ``call_id``.
- ``reasoning``: the reasoning of an earlier answer (``--reasoning-parser``), sent back whole as
  agents do: its ``content`` (``reasoning_text`` parts) reaches the chat template as the next
  assistant message's ``reasoning_content``. ``encrypted_content`` is refused: pdserve makes none
  and cannot read OpenAI's.

Other item types (``item_reference``, the built-in tools' calls) and other parts (images, files,
audio) are a 400 naming them. Fields OpenAI returns on items (``id``, ``status``,
``annotations``, ``logprobs``) are accepted, so an earlier response's ``output`` can be sent back
as it came; they change nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from pdserve.gateway.schema_base import INVALID_TYPE, StrictModel, shaped
from pdserve.gateway.tools.request import FunctionName

MAX_ITEMS = 4096  # items in one request's input (a conversation of that many turns is absurd)
MAX_ID_CHARS = 256  # an item's or a call's id
ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]

ItemId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


def _only(*kinds: str) -> Any:
    """A ``type`` validator that names what is supported when a client sends another kind."""

    def check(kind: Any) -> Any:
        if isinstance(kind, str) and kind not in kinds:
            raise PydanticCustomError(
                "unsupported_content_type",
                "{kind} is not supported; only {kinds} are",
                {"kind": repr(kind[:40]), "kinds": " and ".join(repr(k) for k in kinds)},
            )
        return kind

    return BeforeValidator(check)


TEXT_PARTS = ("input_text", "output_text")


class ItemTextPart(StrictModel):
    """``input_text`` or ``output_text``: text either way."""

    type: Annotated[Literal["input_text", "output_text"], _only(*TEXT_PARTS)]
    text: str
    annotations: list[Any] | None = Field(None, description="accepted on output_text; ignored")
    logprobs: list[Any] | None = Field(None, description="accepted on output_text; ignored")


Content = Annotated[
    Any,
    shaped(
        str,
        list[ItemTextPart],
        pick=lambda v: 0 if isinstance(v, str) else 1 if isinstance(v, list) else None,
        otherwise="must be a string or an array of input_text / output_text parts",
    ),
]


class MessageItem(StrictModel):
    type: Literal["message"] | None = Field(None, description="may be left out")
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: ItemId | None = None
    status: ITEM_STATUS | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: ItemId
    name: FunctionName
    arguments: str = Field(description="the arguments as JSON text, as the model wrote them")
    id: ItemId | None = None
    status: ITEM_STATUS | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: ItemId = Field(description="the call_id of an earlier function_call item")
    output: Content = Field(description="the call's result: text, or input_text parts")
    id: ItemId | None = None
    status: ITEM_STATUS | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningText(StrictModel):
    type: Annotated[Literal["reasoning_text"], _only("reasoning_text")]
    text: str


class SummaryText(StrictModel):
    type: Annotated[Literal["summary_text"], _only("summary_text")]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: list[SummaryText] | None = Field(None, description="accepted; not shown to the model")
    content: list[ReasoningText] | None = None
    encrypted_content: None = Field(
        None, description="must be null: pdserve neither makes nor reads encrypted reasoning"
    )
    status: ITEM_STATUS | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(value: Any) -> int | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type", "message")  # OpenAI's easy input message has no type
    if kind is None:
        kind = "message"
    if not isinstance(kind, str) or kind not in ITEM_TYPES:
        raise PydanticCustomError(
            INVALID_TYPE,
            "has type {kind}; supported item types are {kinds}",
            {"kind": repr(kind)[:40], "kinds": ", ".join(ITEM_TYPES)},
        )
    return ITEM_TYPES.index(kind)


Item = Annotated[
    Any,
    shaped(
        MessageItem,
        FunctionCallItem,
        FunctionCallOutputItem,
        ReasoningItem,
        pick=_item_kind,
        otherwise="must be an object: a message, function_call, function_call_output or "
        "reasoning item",
    ),
]
ItemModel = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem

Input = Annotated[
    Any,
    shaped(
        str,
        Annotated[list[Item], Field(min_length=1, max_length=MAX_ITEMS)],
        pick=lambda v: 0 if isinstance(v, str) else 1 if isinstance(v, list) else None,
        otherwise="must be a string or an array of items",
    ),
]
