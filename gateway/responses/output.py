"""A generated answer as the Responses API's output items, and the stream events that build them.

``OutputBuilder`` reads the pieces of the one choice a Responses request generates - the chat
deltas its ``ResponseChoice`` makes (``{"content"}``, ``{"reasoning_content"}`` with
``--reasoning-parser``, ``{"tool_calls"}`` with tools), or its plain text - and turns them into
output items, in order:

- ``reasoning`` (``rs_...``): the reasoning text, as one ``reasoning_text`` content part;
- ``message`` (``msg_...``): the answer's text, as one ``output_text`` part;
- ``function_call`` (``fc_...``): one per call, with the ``call_id`` the chat endpoint would give
  it, the function's name and its arguments as JSON text.

An item is open while its text streams in and closed when another kind begins or the answer
ends, so items never interleave. Whitespace alone does not open a message (the space a model
writes between or after calls is no message); where nothing else was generated, it is one.

The events are OpenAI's: ``response.output_item.added``, ``response.content_part.added``, the
text's ``response.output_text.delta`` (``response.reasoning_text.delta``; a call's
``response.function_call_arguments.delta``) and the matching ``.done``, then
``response.content_part.done`` and ``response.output_item.done``. A whole answer is the same
builder with the events dropped, so a stream joins to exactly the whole answer.
"""

from __future__ import annotations

from typing import Any

from pdserve.gateway.response_choice import Piece
from pdserve.gateway.responses.conversation import new_id

Event = dict[str, Any]


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # the output so far, closed items and the open one
        self._open: dict[str, Any] | None = None  # the item text goes to (the last of items)
        self._space = ""  # whitespace that no message holds yet

    @property
    def reasoning_text(self) -> str:
        return "".join(
            part["text"]
            for item in self.items
            if item["type"] == "reasoning"
            for part in item["content"]
        )

    def feed(self, piece: Piece) -> list[Event]:
        """The events of one piece of the answer."""
        deltas: list[dict[str, Any]] = (
            piece.deltas if piece.deltas is not None else [{"content": piece.text}]
        )
        events: list[Event] = []
        for delta in deltas:
            if delta.get("content"):
                events += self._content(delta["content"])
            elif delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            for call in delta.get("tool_calls", []):
                events += self._call(call)
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """Close the answer; ``incomplete``: it was cut off (``max_output_tokens``), and so is
        its last item."""
        events: list[Event] = []
        if not self.items:  # an answer of nothing (or only space) is one message all the same
            events += self._content("", force=True)
        return events + self._close("incomplete" if incomplete else "completed")

    # -- the three kinds of item -------------------------------------------------------------

    def _content(self, text: str, force: bool = False) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if item is None or item["type"] != "message":
            pending = self._space + text
            if not force and pending.strip() == "":
                self._space = pending  # no message for space alone, yet
                return []
            events += self._close("completed")
            item = _new_item("msg", "message", role="assistant", content=[])
            events += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item, 0, part=dict(part)))
            text = pending
        if not text:
            return events
        item["content"][0]["text"] += text
        delta = self._event("response.output_text.delta", item, 0, delta=text, logprobs=[])
        return events + [delta]

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if item is None or item["type"] != "reasoning":
            events += self._close("completed")
            item = _new_item("rs", "reasoning", summary=[], content=[])
            events += self._add(item)
            part = {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item, 0, part=dict(part)))
        item["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", item, 0, delta=text)]

    def _call(self, entry: dict[str, Any]) -> list[Event]:
        """A tool_calls delta: a call's header (its id and name) opens its item, its arguments
        follow (``tools/stream.py`` sends each call whole: the header, then all arguments)."""
        function = entry.get("function", {})
        if "id" in entry:
            events = self._close("completed")
            item = _new_item(
                "fc", "function_call", call_id=entry["id"], name=function["name"], arguments=""
            )
            return events + self._add(item)
        item, arguments = self._open, function.get("arguments", "")
        if item is None or item["type"] != "function_call" or not arguments:
            return []
        item["arguments"] += arguments
        return [self._event("response.function_call_arguments.delta", item, None, delta=arguments)]

    # -- opening and closing -----------------------------------------------------------------

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = item
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
        return [{**added, "item": _copy(item)}]

    def _close(self, status: str) -> list[Event]:
        """Close the open item (if any) with ``status``; space held for a message is dropped."""
        item, self._open, self._space = self._open, None, ""
        if item is None:
            return []
        events: list[Event] = []
        if item["type"] == "function_call":
            name, arguments = item["name"], item["arguments"]
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item,
                    None,
                    name=name,
                    arguments=arguments,
                )
            )
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if kind == "output_text" else {}
            events.append(self._event(f"response.{kind}.done", item, 0, text=part["text"], **extra))
            events.append(self._event("response.content_part.done", item, 0, part=dict(part)))
        item["status"] = status
        done = {"type": "response.output_item.done", "output_index": self.items.index(item)}
        return events + [{**done, "item": _copy(item)}]

    def _event(
        self, kind: str, item: dict[str, Any], content_index: int | None, **fields: Any
    ) -> Event:
        where: dict[str, Any] = {"item_id": item["id"], "output_index": self.items.index(item)}
        if content_index is not None:
            where["content_index"] = content_index
        return {"type": kind, **where, **fields}


def _new_item(prefix: str, kind: str, **fields: Any) -> dict[str, Any]:
    return {"id": new_id(prefix), "type": kind, "status": "in_progress", **fields}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (events must not change as the item grows)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out
