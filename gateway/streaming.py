"""A generation streamed as server-sent events, in OpenAI's chunk shapes.

Each chunk carries one choice (its ``index``), as OpenAI and vLLM send them. The stream opens at
the first generated piece, so faults before it still get a real HTTP status; after it, a fault
travels as an error event. With vLLM's ``return_token_ids`` every chunk with a choice carries
that chunk's ``token_ids``, and the prompt's ``prompt_token_ids`` come once per choice (on its
first chunk; chat: at the top of its role chunk). Chat ``echo`` is one chunk per choice after
the role chunk, holding the last message's content.

With tools, a piece's chat deltas (``tools/stream.py``) go out in order, one chunk each:
``{"content": ...}`` or ``{"tool_calls": [one call's header or arguments]}``; the piece's
log-probs and token ids ride on its first chunk. A choice that ended with calls finishes with
``tool_calls``.

The events are server-sent events in the shape OpenAI clients parse: ``data: <json>\\n\\n`` ... ``data: [DONE]``.

Errors after the stream has started can no longer change the HTTP status, so they travel as a
``data: {"error": {...}}`` event (which the ``openai`` package raises as an APIError) followed by
``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from aiohttp import web

from pdserve.gateway.errors import server_error
from pdserve.gateway.generation import FAULTS, Generation, fault_error
from pdserve.gateway.logprob_format import text_length
from pdserve.gateway.response_choice import Piece, ResponseChoice

DONE = b"data: [DONE]\n\n"


# Line readers that follow str.splitlines (httpx's aiter_lines, which guidellm reads streams
# with) also end a line at NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR. JSON may carry them raw
# inside strings, so they are escaped; a string escape means the same character, and JSON puts
# them nowhere else. The other splitlines breaks (\n \r \v \f \x1c-\x1e) are control
# characters, which json.dumps always escapes. The rest of the text stays UTF-8, not \u escapes.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def encode_event(payload: dict[str, Any]) -> bytes:
    text = json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)
    return b"data: " + text.encode("utf-8") + b"\n\n"


class SSEWriter:
    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request, headers: dict[str, str]) -> SSEWriter:
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                # Reverse proxies (nginx) would otherwise buffer the stream and break TTFT.
                "X-Accel-Buffering": "no",
                **headers,
            },
        )
        await response.prepare(request)
        return cls(response)

    async def send(self, payload: dict[str, Any]) -> None:
        await self.response.write(encode_event(payload))

    async def done(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()


log = logging.getLogger(__name__)


class Chunks:
    """The SSE chunks of one streamed response. With include_usage every chunk has a "usage"
    key, null (as OpenAI sends it) or with continuous_usage_stats the usage so far (as vLLM
    does), and ``usage_chunk`` is the extra last one with "choices": [] and the final usage."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.base = {
            "id": gen.response_id,
            "object": "chat.completion.chunk" if gen.chat else "text_completion",
            "created": int(time.time()),
            "model": gen.params.model,
        }
        self.offsets: dict[int, int] = {}  # completions: each choice's text_offset so far
        self.opened: set[int] = set()  # chat: choices whose role chunk went out
        self.ids_sent: set[int] = set()  # return_token_ids: choices whose prompt ids went out

    def __call__(
        self,
        text: str | None,
        finish: str | None,
        index: int = 0,
        logprobs: Any = None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        if self.gen.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        payload = {**self.base, "choices": [choice]}
        params = self.gen.params
        if params.return_token_ids:
            choice["token_ids"] = token_ids or []
            if index not in self.ids_sent:
                self.ids_sent.add(index)
                where = payload if self.gen.chat else choice
                where["prompt_token_ids"] = self.gen.prompts[index // self.gen.per_prompt].ids
        if params.include_usage:
            payload["usage"] = (
                self.gen.progress.running_usage() if params.continuous_usage else None
            )
        return payload

    def role_chunk(self, index: int) -> dict[str, Any]:
        first = self(None, None, index)
        first["choices"][0]["delta"] = {"role": self.gen.params.reply_role, "content": ""}
        if self.gen.params.continuous_usage:
            # The role comes before any generated text: none counted yet, as in vLLM.
            prompt = self.gen.progress.prompt_tokens
            first["usage"] = {**first["usage"], "completion_tokens": 0, "total_tokens": prompt}
        return first

    def piece(self, choice: ResponseChoice, piece: Piece) -> list[dict[str, Any]]:
        """The chunks for a piece of ``choice``'s output (none when it carries nothing)."""
        logprobs = None
        if choice.logprobs is not None and piece.logprobs:
            offset = self.offsets.get(choice.index, 0)
            logprobs = self.gen.logprobs_json(choice, piece, offset)
            self.offsets[choice.index] = offset + text_length(piece.logprobs, self.gen.texts)
        tokens = self.gen.params.return_token_ids and piece.token_ids
        if piece.deltas:
            chunks = []
            for delta in piece.deltas:
                chunk = self(None, None, choice.index, logprobs, piece.token_ids if tokens else [])
                chunk["choices"][0]["delta"] = delta
                chunks.append(chunk)
                logprobs, tokens = None, False  # on the piece's first chunk only
            return chunks
        if not piece.text and logprobs is None and not tokens:
            return []
        return [self(piece.text, None, choice.index, logprobs, piece.token_ids)]

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": self.gen.progress.usage()}

    async def open(self, request: web.Request) -> SSEWriter:
        w = await SSEWriter.open(request, {"x-request-id": self.gen.client_id})
        if self.gen.chat:
            for choice in self.gen.choices:
                await w.send(self.role_chunk(choice.index))
            for choice in self.gen.choices if self.gen.params.chat_echo else []:
                await w.send(self(self.gen.params.chat_echo, None, choice.index))
        return w


async def stream_response(request: web.Request, gen: Generation) -> web.StreamResponse:
    chunk = Chunks(gen)
    progress = gen.progress
    writer: SSEWriter | None = None
    try:
        async with contextlib.aclosing(gen.pieces()) as pieces:
            async for choice, piece in pieces:
                if writer is None:
                    writer = await chunk.open(request)
                for payload in chunk.piece(choice, piece):
                    await writer.send(payload)
                if choice.done:
                    final = chunk(None if gen.chat else "", choice.reply_finish, choice.index)
                    await writer.send(final)
    except FAULTS as exc:
        err = fault_error(exc)
        if writer is None:
            raise err from None
        log.warning("request %s failed mid-stream: %s", gen.client_id, exc)
        await writer.send(err.body())
        await writer.done()
        return writer.response
    except ConnectionResetError:
        progress.finish_reason = "abort"  # the client went away; the workers were cancelled
        raise
    except Exception:
        # A bug must not look like a short but successful stream: end it with an error event.
        log.exception("request %s failed", gen.client_id)
        progress.finish_reason = "error"
        if writer is None:
            raise
        await writer.send(server_error("internal server error").body())
        await writer.done()
        return writer.response
    if writer is None:
        writer = await chunk.open(request)
    if gen.params.include_usage:
        await writer.send(chunk.usage_chunk())
    await writer.done()
    return writer.response
