"""Request fields accepted because they change nothing here, so clients that always send them
(OpenAI SDK defaults, benchmark and eval tools) are not refused.

Each is still type-checked like any other field: a wrong type or shape is a 400 that names it.
``metadata``, ``store``, ``service_tier`` and ``parallel_tool_calls`` exist on OpenAI's chat
endpoint only, and are refused on ``/v1/completions`` as OpenAI's legacy completions refuse
them. Nothing is stored with ``store: true``. ``parallel_tool_calls`` is accepted without tools;
``tools`` and ``tool_choice`` themselves are refused (``request_bodies.ChatCompletionBody``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pdserve.gateway.schema_base import StrictModel, reported_whole

METADATA_MAX_KEYS = 16  # OpenAI's limits on metadata
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512

Metadata = Annotated[
    dict[
        Annotated[str, Field(max_length=METADATA_MAX_KEY_CHARS)],
        Annotated[str, Field(max_length=METADATA_MAX_VALUE_CHARS)],
    ],
    Field(max_length=METADATA_MAX_KEYS),
    reported_whole(),
]


class NeutralFields(StrictModel):
    user: str | None = Field(None, description="accepted and ignored")


class ChatNeutralFields(NeutralFields):
    metadata: Metadata | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="accepted and ignored: nothing is stored")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="accepted and ignored"
    )
    parallel_tool_calls: bool | None = Field(
        None, description="accepted and ignored ('tools' are refused)"
    )
