"""A generation answered in the Responses API's shapes: the response object, whole or streamed,
and stored once it is done. ``ResponseTurn`` is the ``respond`` that ``serve_generation`` calls
with the admitted generation (``gateway/serving.py``), so admission, metrics and the request's
span are the chat endpoint's own.

A whole answer is the response object as JSON. A stream is server-sent events, each
``event: <type>`` and ``data: <json>`` with a ``sequence_number`` from 0: ``response.created``
and ``response.in_progress`` (the response with ``status: in_progress`` and no output) when the
first piece is generated, then the output items' events (``output.py``), then
``response.completed`` - or ``response.incomplete`` (``max_output_tokens`` reached), or
``response.failed`` (a worker failed, a deadline passed) - with the whole response. As on the
chat endpoint, a request that fails before its first piece gets an HTTP error instead.

``status`` is ``completed`` when the model ended its answer, ``incomplete`` with
``incomplete_details.reason: max_output_tokens`` when the token limit (or the context) cut it,
``failed`` with ``error`` when a fault ended it. ``usage.output_tokens_details.reasoning_tokens``
counts the reasoning text's tokens (the tokenizer's count of that text).

With ``store``, the response is written to the store before its last event (or the whole
answer) is sent, so a client that continues it at once finds it; a response that failed is not
stored. A store that fails then makes the answer fail too (503, or ``response.failed``) rather
than promise a response that cannot be continued.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.gateway.errors import APIError, server_error
from pdserve.gateway.generation import FAULTS, Generation, fault_error
from pdserve.gateway.responses.output import Event, OutputBuilder
from pdserve.gateway.responses.store import ResponseStore, StoredResponse, StoreFailed, failed
from pdserve.gateway.streaming import SSEWriter, encode_event

log = logging.getLogger(__name__)


@dataclass
class ResponseTurn:
    """One request's response: its id, what it repeats of the request, and where it is kept."""

    id: str
    created_at: int
    settings: dict[str, Any]  # the request's settings the response repeats (ResponsesBody.echo)
    conversation: list[dict[str, Any]]  # its input items as stored: earlier turns, then its own
    store: ResponseStore | None  # None: not stored
    owner: str  # the key id of the request (StoredResponse.owner)
    output: OutputBuilder = field(default_factory=OutputBuilder)

    async def __call__(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        if gen.params.stream:
            return await self._stream(request, gen)
        return await self._whole(gen)

    # -- whole ------------------------------------------------------------------------------

    async def _whole(self, gen: Generation) -> web.Response:
        try:
            async with contextlib.aclosing(gen.pieces()) as pieces:
                async for _, piece in pieces:
                    self.output.feed(piece)
        except FAULTS as exc:
            raise fault_error(exc) from None
        self.output.finish(incomplete=self._cut(gen))
        body = self.response(gen, self._status(gen))
        await self._save(body)
        return web.json_response(body, dumps=_dumps)

    # -- streamed ---------------------------------------------------------------------------

    async def _stream(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        events = _EventStream()
        try:
            async with contextlib.aclosing(gen.pieces()) as pieces:
                async for _, piece in pieces:
                    if events.writer is None:
                        await self._open(request, gen, events)
                    await events.send_all(self.output.feed(piece))
        except FAULTS as exc:
            if events.writer is None:
                raise fault_error(exc) from None
            log.warning("response %s failed mid-stream: %s", self.id, exc)
            return await self._fail(gen, events, fault_error(exc))
        except ConnectionResetError:
            gen.progress.finish_reason = "abort"  # the client went away; the workers were cancelled
            raise
        except Exception:
            # A bug must not look like a short but complete answer: the response fails.
            log.exception("response %s failed", self.id)
            gen.progress.finish_reason = "error"
            if events.writer is None:
                raise
            return await self._fail(gen, events, server_error("internal server error"))
        if events.writer is None:
            await self._open(request, gen, events)
        await events.send_all(self.output.finish(incomplete=self._cut(gen)))
        status = self._status(gen)
        body = self.response(gen, status)
        try:
            await self._save(body)
        except APIError as err:
            return await self._fail(gen, events, err)
        await events.send({"type": f"response.{status}", "response": body})
        return await events.end()

    async def _open(self, request: web.Request, gen: Generation, events: _EventStream) -> None:
        await events.open(request, gen.client_id)
        start = self.response(gen, "in_progress", output=[])
        await events.send({"type": "response.created", "response": start})
        await events.send({"type": "response.in_progress", "response": start})

    async def _fail(
        self, gen: Generation, events: _EventStream, err: APIError
    ) -> web.StreamResponse:
        body = self.response(gen, "failed", error=err)
        await events.send({"type": "response.failed", "response": body})
        return await events.end()

    # -- the response object ----------------------------------------------------------------

    def _cut(self, gen: Generation) -> bool:
        return gen.choices[0].finish_reason == "length"

    def _status(self, gen: Generation) -> str:
        return "incomplete" if self._cut(gen) else "completed"

    def response(
        self,
        gen: Generation,
        status: str,
        *,
        output: list[dict[str, Any]] | None = None,
        error: APIError | None = None,
    ) -> dict[str, Any]:
        progress = gen.progress
        reasoning = self.output.reasoning_text
        reasoning_tokens = len(gen.gw.model.tokenizer.encode(reasoning, False)) if reasoning else 0
        reasoning_tokens = min(reasoning_tokens, progress.completion_tokens)
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": _error(error) if error is not None else None,
            "incomplete_details": incomplete,
            "model": gen.params.model,
            "output": self.output.items if output is None else output,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": self.store is not None,
            **self.settings,
            # counted once the answer is over, as OpenAI's in-progress responses have none
            "usage": None if status == "in_progress" else _usage(gen, self.output),
        }

    async def _save(self, body: dict[str, Any]) -> None:
        if self.store is None:
            return
        record = StoredResponse(response=body, input_items=self.conversation, owner=self.owner)
        try:
            await self.store.put(self.id, record)
        except StoreFailed as exc:
            log.warning("response %s could not be stored: %s", self.id, exc)
            raise failed(str(exc)) from None


def _error(err: APIError) -> dict[str, Any]:
    """A failure as the response's ``error``: OpenAI's codes are a closed set, where every
    fault of ours is a ``server_error``; pdserve's own code goes in the message."""
    detail = f" ({err.code})" if err.code else ""
    return {"code": "server_error", "message": err.message + detail}


def _usage(gen: Generation, output: OutputBuilder) -> dict[str, Any]:
    progress = gen.progress
    reasoning = output.reasoning_text
    counted = len(gen.gw.model.tokenizer.encode(reasoning, False)) if reasoning else 0
    return {
        "input_tokens": progress.prompt_tokens,
        # cache_write_tokens: OpenAI's newer field, which its SDK requires; a prefix cache
        # that fills as a side effect of serving writes nothing a client pays for
        "input_tokens_details": {"cached_tokens": progress.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": progress.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(counted, progress.completion_tokens)},
        "total_tokens": progress.prompt_tokens + progress.completion_tokens,
    }


class _EventStream:
    """The server-sent events of one response, numbered in order."""

    def __init__(self) -> None:
        self.writer: SSEWriter | None = None
        self.sequence = 0

    async def open(self, request: web.Request, client_id: str) -> None:
        self.writer = await SSEWriter.open(request, {"x-request-id": client_id})

    async def send(self, event: Event) -> None:
        assert self.writer is not None
        event["sequence_number"] = self.sequence
        self.sequence += 1
        await self.writer.response.write(
            b"event: " + event["type"].encode() + b"\n" + encode_event(event)
        )

    async def send_all(self, events: list[Event]) -> None:
        for event in events:
            await self.send(event)

    async def end(self) -> web.StreamResponse:
        """The last event is the response's own (completed, incomplete, failed): no [DONE]."""
        assert self.writer is not None
        await self.writer.response.write_eof()
        return self.writer.response


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)
