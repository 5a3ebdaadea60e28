"""``stream_options``: how a stream reports usage, OpenAI's field and vLLM's extension.

- ``include_usage`` (OpenAI): every chunk carries ``"usage": null``, and after the chunk with the
  ``finish_reason`` one more chunk with ``"choices": []`` carries the request's usage, just
  before ``data: [DONE]``.
- ``continuous_usage_stats`` (vLLM): together with ``include_usage``, every chunk's ``usage`` is
  the count so far (``prompt_tokens``, ``completion_tokens``, ``total_tokens``) instead of null.
  Alone it does nothing, as in vLLM, whose clients (guidellm) always send both.

``stream_options`` without ``stream: true`` is a 400, as it is on OpenAI and vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request, unsupported_parameter

FIELDS: dict[str, str] = {
    "include_usage": "one more chunk, with 'choices': [], carries the usage before [DONE]; "
    "the other chunks have 'usage': null",
    "continuous_usage_stats": "vLLM's extension: with include_usage, every chunk carries the "
    "usage so far (prompt_tokens, completion_tokens, total_tokens)",
}


@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage: bool = False  # running usage on every chunk (implies include_usage)


def parse_stream_options(body: dict[str, Any], stream: bool) -> StreamOptions:
    options = body.get("stream_options")
    if options is None:
        return StreamOptions()
    if not stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true", "stream_options"
        )
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    for key, value in options.items():
        if key not in FIELDS and value is not None:
            raise unsupported_parameter(f"stream_options.{key}")
    include = _flag(options, "include_usage")
    continuous = _flag(options, "continuous_usage_stats")
    return StreamOptions(include_usage=include, continuous_usage=include and continuous)


def _flag(options: dict[str, Any], key: str) -> bool:
    value = options.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        param = f"stream_options.{key}"
        raise bad_request(f"'{param}' must be a boolean", param, "invalid_type")
    return value


def stream_options_schema() -> dict[str, Any]:
    """The JSON schema of ``stream_options`` for ``/openapi.json``."""
    return {
        "type": ["object", "null"],
        "properties": {
            key: {"type": ["boolean", "null"], "description": text} for key, text in FIELDS.items()
        },
        "additionalProperties": False,
        "description": "only with stream=true",
    }
