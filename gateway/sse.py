"""Server-sent events in the shape OpenAI clients parse: ``data: <json>\\n\\n`` ... ``data: [DONE]``.

Errors after the stream has started can no longer change the HTTP status, so they travel as a
``data: {"error": {...}}`` event (which the ``openai`` package raises as an APIError) followed by
``[DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

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
