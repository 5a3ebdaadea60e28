"""``stream`` and ``stream_options``: how a stream reports usage, OpenAI's field and vLLM's
extension.

- ``include_usage`` (OpenAI): every chunk carries ``"usage": null``, and after the chunk with the
  ``finish_reason`` one more chunk with ``"choices": []`` carries the request's usage, just
  before ``data: [DONE]``.
- ``continuous_usage_stats`` (vLLM): together with ``include_usage``, every chunk's ``usage`` is
  the count so far (``prompt_tokens``, ``completion_tokens``, ``total_tokens``) instead of null.
  Alone it does nothing, as in vLLM, whose clients (guidellm) always send both.

``stream_options`` without ``stream: true`` is a 400, as it is on OpenAI and vLLM.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from pdserve.gateway.schema_base import StrictModel, field_error
from pdserve.gateway.schema_errors import INVALID_VALUE


class StreamOptions(StrictModel):
    """Only with stream: true."""

    include_usage: bool | None = Field(
        None,
        description="one more chunk, with 'choices': [], carries the usage before [DONE]; "
        "the other chunks have 'usage': null",
    )
    continuous_usage_stats: bool | None = Field(
        None,
        description="vLLM's extension: with include_usage, every chunk carries the usage so far "
        "(prompt_tokens, completion_tokens, total_tokens)",
    )


class StreamFields(StrictModel):
    stream: bool | None = Field(None, description="server-sent events ending in 'data: [DONE]'")
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _options_only_when_streaming(self) -> StreamFields:
        if self.stream_options is not None and not self.stream:
            raise field_error(
                "stream_options",
                INVALID_VALUE,
                "is only allowed when 'stream' is true",
                self.stream_options,
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Running usage on every chunk: rides on include_usage, as in vLLM."""
        options = self.stream_options
        return self.include_usage and bool(options and options.continuous_usage_stats)
