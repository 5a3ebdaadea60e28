"""Anthropic's answer, built from a ``Generation``'s pieces: the stream's events, block by block,
and the whole message as exactly those events accumulated.

A piece's text is already read once, as chat reads it (``response_choice.ResponseChoice``): the
reasoning split out by ``--reasoning-parser``'s one incremental reader, tool calls found in the
content by the tool-call parser's. Its ``deltas`` say, in order, what is reasoning, content and
a complete call; here each becomes Anthropic's block: ``thinking`` (``thinking_delta``),
``text`` (``text_delta``), ``tool_use`` (its ``input`` as one ``input_json_delta``: calls are
read whole). Consecutive thinking or text deltas extend their open block; a block of another
kind closes it. Nothing is parsed again here: a whole answer (``content_of``) is the same events
applied in order, so it equals what a client accumulates from the stream, however the tokens
were grouped into events.

``stop_reason``: ``max_tokens`` at the length limit, ``stop_sequence`` (with the one matched)
when a stop sequence ended it, ``tool_use`` when the answer holds calls, else ``end_turn``.
``usage`` counts as Anthropic does: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those served from a prefill worker's prefix cache (the gateway's
cached tokens), so their sum is the prompt (what ``count_tokens`` says).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pdserve.gateway.generation import Generation, Progress
from pdserve.gateway.response_choice import Piece, ResponseChoice

Event = tuple[str, dict[str, Any]]  # (the SSE event's name, its data), the name its data's type
MESSAGE_PREFIX = "msg_"
TOOL_USE_PREFIX = "toolu_"
CALL_PREFIX = "call_"  # the ids chat's tool stream gives calls (tools.stream.call_id)


def usage(progress: Progress) -> dict[str, int]:
    cached = progress.cached_tokens
    return {
        "input_tokens": progress.prompt_tokens - cached,
        "output_tokens": progress.completion_tokens,
        "cache_creation_input_tokens": 0,  # nothing is written on request: caching is automatic
        "cache_read_input_tokens": cached,
    }


def stop_reason(choice: ResponseChoice) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an ended choice."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    matched = choice.out.stops.matched
    if matched is not None:
        return "stop_sequence", matched
    if choice.calls is not None and choice.calls.has_calls:
        return "tool_use", None
    return "end_turn", None


def _parts(piece: Piece) -> Iterator[tuple[str, str, dict[str, Any] | None]]:
    """What a piece adds, in order: (kind, text, call header); a tool_use's text is its
    arguments (a JSON object)."""
    if piece.deltas is None:  # no tools, no reasoning parser: all text
        if piece.text:
            yield "text", piece.text, None
        return
    header: dict[str, Any] | None = None
    for delta in piece.deltas:
        if delta.get("reasoning_content"):
            yield "thinking", delta["reasoning_content"], None
        elif delta.get("content"):
            yield "text", delta["content"], None
        elif "tool_calls" in delta:
            entry = delta["tool_calls"][0]
            if "id" in entry:  # the call's header; its arguments are the next delta
                header = entry
            elif header is not None:
                yield "tool_use", entry["function"]["arguments"], header


class MessageEvents:
    """The events of one generation's answer (one choice: the Messages API has no ``n``)."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.id = MESSAGE_PREFIX + gen.client_id
        self.index = -1  # the last block's index
        self.open: str | None = None  # the kind of the block still open: thinking or text

    def message(
        self, content: list[dict[str, Any]], reason: str | None, sequence: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.gen.params.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(self.gen.progress),
        }

    def start(self) -> list[Event]:
        """``message_start``, then a ``ping`` as Anthropic sends one."""
        started = {"type": "message_start", "message": self.message([], None, None)}
        return [("message_start", started), ("ping", {"type": "ping"})]

    def piece(self, piece: Piece) -> list[Event]:
        out: list[Event] = []
        for kind, text, header in _parts(piece):
            if header is None:
                out += self._extend(kind, text)
            else:
                out += self._tool_use(header, text)
        return out

    def finish(self, choice: ResponseChoice) -> list[Event]:
        """Close the last block; ``message_delta`` with the stop reason and the final usage,
        then ``message_stop``."""
        reason, sequence = stop_reason(choice)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        ended = {"type": "message_delta", "delta": delta, "usage": usage(self.gen.progress)}
        return [*self.close(), ("message_delta", ended), ("message_stop", {"type": "message_stop"})]

    def close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _extend(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        if self.open != kind:
            out += self.close()
            self.index, self.open = self.index + 1, kind
            block = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            out.append(_event("content_block_start", index=self.index, content_block=block))
        delta = (
            {"type": "text_delta", "text": text}
            if kind == "text"
            else {"type": "thinking_delta", "thinking": text}
        )
        out.append(_event("content_block_delta", index=self.index, delta=delta))
        return out

    def _tool_use(self, header: dict[str, Any], arguments: str) -> list[Event]:
        out = self.close()
        self.index += 1
        call_id = TOOL_USE_PREFIX + header["id"].removeprefix(CALL_PREFIX)
        block = {"type": "tool_use", "id": call_id, "name": header["function"]["name"], "input": {}}
        delta = {"type": "input_json_delta", "partial_json": arguments}
        return [
            *out,
            _event("content_block_start", index=self.index, content_block=block),
            _event("content_block_delta", index=self.index, delta=delta),
            _event("content_block_stop", index=self.index),
        ]


def _event(kind: str, **fields: Any) -> Event:
    return kind, {"type": kind, **fields}


def content_of(events: list[Event]) -> list[dict[str, Any]]:
    """The content blocks that ``events`` build, applied as Anthropic's SDK applies them."""
    blocks: list[dict[str, Any]] = []
    inputs: dict[int, str] = {}
    for kind, data in events:
        if kind == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            index, delta = data["index"], data["delta"]
            if delta["type"] == "text_delta":
                blocks[index]["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                blocks[index]["thinking"] += delta["thinking"]
            else:
                inputs[index] = inputs.get(index, "") + delta["partial_json"]
    for index, text in inputs.items():
        blocks[index]["input"] = json.loads(text)
    return blocks
