"""The streamed shape of an answer with tool calls: OpenAI's chat deltas.

Text arrives as it is generated; ``ToolCallStream`` turns it into deltas: ``{"content": ...}``
for text, and for each call, once the call is complete, a first delta with its ``index``,
``id``, ``type`` and name (``arguments: ""``) and then one delta with its arguments. A call is
sent only whole, so one delta holding many tokens, or a call and text together, loses nothing,
and ``arguments`` is always a string. Joined by index, the deltas are exactly what
``parsers.parse`` makes of the whole text.
"""

from __future__ import annotations

import secrets
from typing import Any

from pdserve.gateway.tools.parsers import Event, Segmenter
from pdserve.gateway.tools.setup import ToolSetup


def call_id() -> str:
    """An id for one call, as OpenAI's: ``call_`` and random characters."""
    return "call_" + secrets.token_hex(12)


class ToolCallStream:
    def __init__(self, setup: ToolSetup) -> None:
        self._seg = Segmenter(setup)
        self.sent = 0  # calls sent so far: the next one's index

    @property
    def has_calls(self) -> bool:
        """Whether the answer has calls (then its finish reason is ``tool_calls``)."""
        return self.sent > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self._seg.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self._seg.finish())

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for _, value in events:
            if isinstance(value, str):
                out.append({"content": value})
                continue
            header = {
                "index": self.sent,
                "id": call_id(),
                "type": "function",
                "function": {"name": value.name, "arguments": ""},
            }
            arguments = {"index": self.sent, "function": {"arguments": value.arguments}}
            out += [{"tool_calls": [header]}, {"tool_calls": [arguments]}]
            self.sent += 1
        return out


def content_of(deltas: list[dict[str, Any]]) -> str:
    return "".join(d.get("content", "") for d in deltas)


def joined(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The content and the calls (``{"id", "type", "function": {"name", "arguments"}}``) that a
    client rebuilds from a stream's deltas, merging each call's by ``index``."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for entry in d.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"function": {"name": "", "arguments": ""}})
            for key in ("id", "type"):
                if key in entry:
                    call[key] = entry[key]
            for key in ("name", "arguments"):
                call["function"][key] += entry["function"].get(key, "")
    return content_of(deltas), [calls[i] for i in sorted(calls)]
