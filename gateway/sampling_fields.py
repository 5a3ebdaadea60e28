"""The request fields that shape sampling and streaming, in four groups: the numeric field types
the request models build on, the fields accepted and ignored, ``stream_options``, and the
sampling fields both endpoints share.

Numeric types: their bounds are read from ``pdserve.shared.sampling``.

Strict, as pydantic's strict mode is: a boolean or a string is never a number. One leniency is
kept from the hand-written checks: an integer field takes a float with no fraction (``8.0``),
which JSON does not tell apart from ``8`` and some clients write; ``1.5`` stays an error.
Numbers must be finite (the JSON pre-parser already refuses NaN and Infinity; this holds for
callers that build the body in Python too).

Accepted and ignored: request fields accepted because they change nothing here, so clients that always send them
(OpenAI SDK defaults, benchmark and eval tools) are not refused.

Each is still type-checked like any other field: a wrong type or shape is a 400 that names it.
``metadata``, ``store`` and ``service_tier`` exist on OpenAI's chat endpoint only, and are
refused on ``/v1/completions`` as OpenAI's legacy completions refuse them. Nothing is stored with
``store: true``. (``parallel_tool_calls`` belongs with ``tools``: ``gateway/tools/request.py``.)

``stream`` and ``stream_options``: how a stream reports usage, OpenAI's field and vLLM's
extension.

- ``include_usage`` (OpenAI): every chunk carries ``"usage": null``, and after the chunk with the
  ``finish_reason`` one more chunk with ``"choices": []`` carries the request's usage, just
  before ``data: [DONE]``.
- ``continuous_usage_stats`` (vLLM): together with ``include_usage``, every chunk's ``usage`` is
  the count so far (``prompt_tokens``, ``completion_tokens``, ``total_tokens``) instead of null.
  Alone it does nothing, as in vLLM, whose clients (guidellm) always send both.

``stream_options`` without ``stream: true`` is a 400, as it is on OpenAI and vLLM.

The sampling fields both endpoints share: temperature, nucleus and top-k, seed, n, penalties,
min_tokens, logit_bias, stop strings and stop token ids.

Bounds come from ``pdserve.shared.sampling`` (the same ones the wire protocol and the engine enforce).
``presence_penalty`` and ``frequency_penalty`` are OpenAI's; ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``top_k`` and ``ignore_eos`` are vLLM's extensions;
``speculate`` is pdserve's own.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.schema_base import (
    INVALID_VALUE,
    StrictModel,
    field_error,
    reported_whole,
    shaped,
)
from pdserve.shared.bus.wire_fields import MAX_TOKEN_ID
from pdserve.shared.sampling import BOUNDS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_STOP_TOKEN_IDS


def whole_float_as_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # anything else is left for the strict int check to refuse


def integer(minimum: int | None = None, maximum: int | None = None) -> Any:
    """An integer type in [minimum, maximum] (either end may be open-ended)."""
    # The bounds first, so that they stay on the int schema (and its JSON schema) inside the
    # before-validator.
    return Annotated[int, Field(ge=minimum, le=maximum), BeforeValidator(whole_float_as_int)]


def bounded_integer(name: str, minimum: int | None = None) -> Any:
    """An integer type with ``pdserve.shared.sampling.BOUNDS[name]`` (``minimum`` may raise the floor)."""
    bound = BOUNDS[name]
    low = int(bound.lo) + (1 if bound.lo_open else 0)
    return integer(low if minimum is None else max(low, minimum), int(bound.hi))


def bounded_number(name: str) -> Any:
    """A finite number type with ``pdserve.shared.sampling.BOUNDS[name]``."""
    bound = BOUNDS[name]
    low = {"gt": bound.lo} if bound.lo_open else {"ge": bound.lo}
    return Annotated[float, Field(le=bound.hi, allow_inf_nan=False, **low)]


# A token id as the wire protocol bounds it; the vocabulary is checked once the model is known.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


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


MAX_STOP_STRINGS = 16


MAX_STOP_LENGTH = 256


TOKEN_ID_KEY = "^[0-9]+$"  # logit_bias keys: token ids written as JSON object keys ("50256")


Temperature = bounded_number("temperature")


TopP = bounded_number("top_p")


TopK = bounded_integer("top_k")


Seed = bounded_integer("seed")


N = bounded_integer("n")


Penalty = bounded_number("presence_penalty")


RepetitionPenalty = bounded_number("repetition_penalty")


MinTokens = bounded_integer("min_tokens")


StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


Stop = Annotated[
    Any,
    shaped(
        StopText,
        Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)],
        pick=lambda v: 0 if isinstance(v, str) else 1 if isinstance(v, list) else None,
        otherwise="must be a string or an array of strings",
    ),
]


def _token_id_key(key: str) -> str:
    if (
        len(key) > len(str(MAX_TOKEN_ID))
        or not re.fullmatch(TOKEN_ID_KEY, key)
        or (int(key) > MAX_TOKEN_ID)
    ):
        raise PydanticCustomError(
            INVALID_VALUE,
            "must be a token id: an integer in [0, {hi}] as a string",
            {"hi": MAX_TOKEN_ID},
        )
    return key


Bias = Annotated[
    float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE, allow_inf_nan=False)
]


LogitBias = Annotated[
    dict[Annotated[str, AfterValidator(_token_id_key)], Bias],
    Field(max_length=MAX_LOGIT_BIAS),
    reported_whole(),
]


class SamplingFields(StrictModel):
    temperature: Temperature | None = Field(None, description="sampling temperature; 0 is greedy")
    top_p: TopP | None = Field(None, description="nucleus sampling mass")
    top_k: TopK | None = Field(
        None, description="sample among the k likeliest tokens; -1 or 0 is off (vLLM)"
    )
    seed: Seed | None = Field(None, description="per-request sampling seed")
    n: N | None = Field(None, description="choices per prompt")
    presence_penalty: Penalty | None = Field(
        None, description="subtracted from a token's logit once it has appeared in the output"
    )
    frequency_penalty: Penalty | None = Field(
        None, description="subtracted from a token's logit times its count in the output so far"
    )
    repetition_penalty: RepetitionPenalty | None = Field(
        None,
        description="vLLM's: logits of tokens in the prompt or output are divided by it "
        "(multiplied when negative); 1 is off",
    )
    min_tokens: MinTokens | None = Field(
        None,
        description="vLLM's: EOS and stop_token_ids cannot end the output before this many "
        "tokens; at most max_tokens",
    )
    logit_bias: LogitBias | None = Field(
        None,
        description='token id (as a string, e.g. "50256") -> bias added to its logit',
        json_schema_extra={"propertyNames": {"pattern": TOKEN_ID_KEY}},
    )
    stop: Stop | None = Field(
        None, description="stop strings, matched on the generated text and not returned"
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="vLLM's: token ids that end the output like EOS"
    )
    ignore_eos: bool | None = Field(None, description="vLLM's: keep going past EOS")
    speculate: bool | None = Field(
        None,
        description="pdserve's: false opts this request out of speculative decoding where the "
        "server runs it (speed only: greedy and seeded outputs are the same either way)",
    )

    def stop_strings(self) -> list[str]:
        """The stop strings, each once, in the order given."""
        items = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return list(dict.fromkeys(items))

    def logit_bias_by_token(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}
