"""The sampling fields both endpoints share: temperature, nucleus and top-k, seed, n, penalties,
min_tokens, logit_bias, stop strings and stop token ids.

Bounds come from ``pdserve.shared.sampling`` (the same ones the wire protocol and the engine enforce).
``presence_penalty`` and ``frequency_penalty`` are OpenAI's; ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``top_k`` and ``ignore_eos`` are vLLM's extensions;
``speculate`` is pdserve's own.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from pdserve.gateway.number_fields import TokenId, bounded_integer, bounded_number
from pdserve.gateway.schema_base import StrictModel, reported_whole, shaped
from pdserve.gateway.schema_errors import INVALID_VALUE
from pdserve.shared.bus.protocol import MAX_TOKEN_ID
from pdserve.shared.sampling import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_STOP_TOKEN_IDS

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
