"""The Messages API's renderer of a ``Generation`` (``serving.Respond``): Anthropic's server-sent
events when the client asked for a stream, else one JSON message, both from ``events.py``.

A stream is ``event: <type>`` and ``data: <json>`` lines, as Anthropic sends them and its SDK
reads them: ``message_start``, ``ping``, each block's ``content_block_start`` /
``content_block_delta`` / ``content_block_stop``, ``message_delta`` (stop reason, usage),
``message_stop``; no ``[DONE]``. As on the chat endpoint the stream opens at the first piece,
so a failure before it still gets its real status (in Anthropic's shape, by the error
middleware); after it, a failure is an ``error`` event (``{"type": "error", "error": {...}}``,
which the SDK raises as an APIStatusError) and the stream ends, never with a ``message_stop``
that would make a cut answer look complete. A client that goes away is the chat stream's case:
the generation is closed, which cancels the request on its workers.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from aiohttp import web

from pdserve.gateway.anthropic.errors import error_body
from pdserve.gateway.anthropic.events import Event, MessageEvents, content_of, stop_reason
from pdserve.gateway.errors import server_error
from pdserve.gateway.generation import FAULTS, Generation, fault_error
from pdserve.gateway.streaming import SSEWriter, encode_event

log = logging.getLogger(__name__)


async def respond(request: web.Request, gen: Generation) -> web.StreamResponse:
    return await (stream_message(request, gen) if gen.params.stream else whole_message(gen))


async def whole_message(gen: Generation) -> web.Response:
    events = MessageEvents(gen)
    built: list[Event] = []
    try:
        async with contextlib.aclosing(gen.pieces()) as pieces:
            async for _, piece in pieces:
                built += events.piece(piece)
    except FAULTS as exc:
        raise fault_error(exc) from None
    built += events.close()
    reason, sequence = stop_reason(gen.choices[0])
    return web.json_response(events.message(content_of(built), reason, sequence), dumps=_dumps)


def sse(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: its name line, then its data as the chat stream encodes it."""
    return b"event: " + kind.encode("ascii") + b"\n" + encode_event(data)


async def stream_message(request: web.Request, gen: Generation) -> web.StreamResponse:
    events = MessageEvents(gen)
    writer: SSEWriter | None = None

    async def send(batch: list[Event]) -> None:
        assert writer is not None
        for kind, data in batch:
            await writer.response.write(sse(kind, data))

    try:
        async with contextlib.aclosing(gen.pieces()) as pieces:
            async for choice, piece in pieces:
                if writer is None:
                    writer = await SSEWriter.open(request, {"x-request-id": gen.client_id})
                    await send(events.start())
                await send(events.piece(piece))
                if choice.done:
                    await send(events.finish(choice))
    except FAULTS as exc:
        err = fault_error(exc)
        if writer is None:
            raise err from None
        log.warning("request %s failed mid-stream: %s", gen.client_id, exc)
        await send([("error", error_body(err))])
        await writer.response.write_eof()
        return writer.response
    except ConnectionResetError:
        gen.progress.finish_reason = "abort"  # the client went away; the workers were cancelled
        raise
    except Exception:
        # A bug must not look like a short but successful stream: end it with an error event.
        log.exception("request %s failed", gen.client_id)
        gen.progress.finish_reason = "error"
        if writer is None:
            raise
        await send([("error", error_body(server_error("internal server error")))])
        await writer.response.write_eof()
        return writer.response
    if writer is None:  # no piece at all (cannot happen: a choice always ends with one)
        writer = await SSEWriter.open(request, {"x-request-id": gen.client_id})
        await send(events.start() + events.finish(gen.choices[0]))
    await writer.response.write_eof()
    return writer.response


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)
