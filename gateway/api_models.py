"""Request parsing and validation for the OpenAI-compatible endpoints.

The body is parsed strictly (UTF-8, JSON, bounded nesting) and every field is checked by hand
against the table below; the same table feeds ``/openapi.json`` so docs and checks cannot drift.
Anything a client sends that we do not support is refused with a 400 naming it, rather than
silently ignored, so nobody believes a parameter took effect when it did not. The exceptions are
fields that change nothing (``neutral_fields.py``: ``user``, ``metadata``, penalties at 0, ...),
accepted so clients that always send them work, and type-checked all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import APIError, bad_request, unsupported_parameter
from gateway.neutral_fields import check_neutral_fields, neutral_names
from gateway.number_fields import NumberField, check_number
from gateway.stream_options import parse_stream_options
from shared.sampling import BOUNDS, GuidedDecoding

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
ALLOWED_ROLES = ("system", "developer", "user", "assistant")


SAMPLING_FIELDS: tuple[NumberField, ...] = (
    NumberField("max_tokens", "integer", "most tokens to generate", minimum=1),
    NumberField(
        "temperature",
        "number",
        "sampling temperature; 0 is greedy",
        BOUNDS["temperature"].lo,
        BOUNDS["temperature"].hi,
    ),
    NumberField(
        "top_p",
        "number",
        "nucleus sampling mass",
        BOUNDS["top_p"].lo,
        BOUNDS["top_p"].hi,
        exclusive_minimum=BOUNDS["top_p"].lo_open,
    ),
    NumberField(
        "top_k",
        "integer",
        "sample among the k likeliest tokens; -1 or 0 is off",
        BOUNDS["top_k"].lo,
        BOUNDS["top_k"].hi,
    ),
    NumberField(
        "seed", "integer", "per-request sampling seed", BOUNDS["seed"].lo, BOUNDS["seed"].hi
    ),
    NumberField("n", "integer", "number of choices; only 1 is supported", 1, 1),
)
_FIELDS_BY_NAME = {f.name: f for f in SAMPLING_FIELDS}

COMMON_KEYS = frozenset(
    ["model", "stream", "stream_options", "stop", "ignore_eos"] + list(_FIELDS_BY_NAME)
)
# Fields that change nothing (gateway/neutral_fields.py) are accepted and type-checked.
COMPLETION_KEYS = COMMON_KEYS | neutral_names(chat=False) | {"prompt"}
CHAT_KEYS = COMMON_KEYS | neutral_names(chat=True) | {"messages", "max_completion_tokens"}


@dataclass
class GenerationParams:
    model: str
    max_tokens: int | None  # None: up to the end of the context window
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False  # a last chunk with "choices": [] and the usage
    continuous_usage: bool = False  # the usage so far on every chunk (vLLM's extension)
    n: int = 1  # choices per prompt
    best_of: int | None = None  # completions: sample this many, return the n likeliest
    # top alternatives per generated token; None: no log-probs (chat: top_logprobs when
    # logprobs is true; completions: the logprobs integer)
    logprobs: int | None = None
    echo: bool = False  # completions: the prompt comes back first (with log-probs if asked)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    guided: GuidedDecoding | None = None  # response_format / guided_regex / guided_choice


@dataclass
class CompletionRequest:
    params: GenerationParams
    prompt: str | list[int]  # the first of prompts (kept while callers move to prompts)
    prompts: list[str | list[int]] = field(default_factory=list)  # each answered as choices


@dataclass
class ChatMessage:
    role: str
    content: str
    name: str | None = None


@dataclass
class ChatRequest:
    params: GenerationParams
    messages: list[ChatMessage]


# ----------------------------------------------------------------------------- fields


def _check_keys(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for key in body:
        # A null for an unknown optional field is the same as leaving it out; some SDKs send them.
        if key not in allowed and body[key] is not None:
            raise unsupported_parameter(key)


def _number(body: dict[str, Any], name: str) -> float | int | None:
    spec = _FIELDS_BY_NAME[name]
    return check_number(body.get(name), spec, name)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name, "invalid_type")
    return value


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", "model", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "model", "invalid_type")
    return model


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has more than {MAX_STOP_STRINGS} strings", "stop")
    for s in items:
        if not s:
            raise bad_request("'stop' strings must not be empty", "stop", "invalid_value")
        if len(s) > MAX_STOP_LENGTH:
            raise bad_request(f"'stop' strings must be <= {MAX_STOP_LENGTH} chars", "stop")
    return list(dict.fromkeys(items))


def _params(body: dict[str, Any], max_tokens: int | None) -> GenerationParams:
    stream = _bool(body, "stream")
    stream_options = parse_stream_options(body, stream)
    top_k = _number(body, "top_k")
    temperature = _number(body, "temperature")
    top_p = _number(body, "top_p")
    _number(body, "n")  # validated to be 1; nothing else to do with it
    return GenerationParams(
        model=_model(body),
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=-1 if top_k in (None, 0) else int(top_k),
        seed=_number(body, "seed"),
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=stream_options.include_usage,
        continuous_usage=stream_options.continuous_usage,
    )


# ----------------------------------------------------------------------------- requests


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    _check_keys(body, COMPLETION_KEYS)
    check_neutral_fields(body, chat=False)
    max_tokens = _number(body, "max_tokens")
    # OpenAI's legacy completions default to 16 new tokens.
    params = _params(body, 16 if max_tokens is None else int(max_tokens))
    prompt = _prompt(body.get("prompt"))
    return CompletionRequest(params=params, prompt=prompt, prompts=[prompt])


def _prompt(value: Any) -> str | list[int]:
    if value is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    # A batch of one is accepted for convenience; real batches would need n>1 semantics.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad_request("'prompt' must not be empty", "prompt", "invalid_value")
        return value
    if isinstance(value, list):
        if not value:
            raise bad_request("'prompt' must not be empty", "prompt", "invalid_value")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return list(value)
        if all(isinstance(t, (str, list)) for t in value):
            raise bad_request("Batched prompts are not supported; send one prompt", "prompt")
    raise bad_request("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    _check_keys(body, CHAT_KEYS)
    check_neutral_fields(body, chat=True)
    max_tokens = _number(body, "max_tokens")
    max_completion = check_number(
        body.get("max_completion_tokens"), _FIELDS_BY_NAME["max_tokens"], "max_completion_tokens"
    )
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_request(
            "Give either 'max_tokens' or 'max_completion_tokens', not both",
            "max_completion_tokens",
        )
    chosen = max_completion if max_completion is not None else max_tokens
    params = _params(body, None if chosen is None else int(chosen))
    return ChatRequest(params=params, messages=_messages(body.get("messages")))


def _messages(value: Any) -> list[ChatMessage]:
    if value is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty array", "messages", "invalid_type")
    return [_message(item, f"messages[{i}]") for i, item in enumerate(value)]


def _message(item: Any, where: str) -> ChatMessage:
    if not isinstance(item, dict):
        raise bad_request(f"'{where}' must be an object", where, "invalid_type")
    for key, value in item.items():
        if key not in ("role", "content", "name") and value is not None:
            raise unsupported_parameter(f"{where}.{key}")
    role = item.get("role")
    if not isinstance(role, str) or role not in ALLOWED_ROLES:
        raise bad_request(
            f"'{where}.role' must be one of {', '.join(ALLOWED_ROLES)}",
            f"{where}.role",
            "invalid_value",
        )
    name = item.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"'{where}.name' must be a string", f"{where}.name", "invalid_type")
    content = _content(item.get("content"), role, f"{where}.content")
    # 'developer' is OpenAI's newer name for the system role; templates only know 'system'.
    return ChatMessage(role="system" if role == "developer" else role, content=content, name=name)


def _content(value: Any, role: str, where: str) -> str:
    if value is None:
        if role == "assistant":
            return ""
        raise bad_request(f"'{where}' is required", where, "missing_required_parameter")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(
            f"'{where}' must be a string or an array of text parts", where, "invalid_type"
        )
    texts = []
    for i, part in enumerate(value):
        here = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise bad_request(f"'{here}' must be an object", here, "invalid_type")
        kind = part.get("type")
        if kind != "text":
            raise bad_request(
                f"'{here}.type' {kind!r} is not supported; only 'text' parts are",
                f"{here}.type",
                "unsupported_content_type",
            )
        for key in part:
            if key not in ("type", "text"):
                raise unsupported_parameter(f"{here}.{key}")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"'{here}.text' must be a string", f"{here}.text", "invalid_type")
        texts.append(text)
    return "".join(texts)


def check_token_ids(ids: list[int], vocab_size: int, where: str = "prompt") -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise bad_request(
                f"Token id {t} at {where}[{i}] is outside the vocabulary [0, {vocab_size})",
                where,
                "invalid_token_id",
            )


def check_logit_bias(bias: dict[int, float], vocab_size: int) -> None:
    for t in bias:
        if not 0 <= t < vocab_size:
            raise bad_request(
                f"logit_bias names token id {t}, outside the vocabulary [0, {vocab_size})",
                "logit_bias",
                "invalid_token_id",
            )


def check_length(
    prompt_len: int, max_tokens: int | None, max_model_len: int, max_prompt_tokens: int
) -> int:
    """Check that the prompt and its output fit; return the max_tokens to use."""
    param = "messages" if max_tokens is None else "max_tokens"
    if prompt_len == 0:
        raise bad_request("The prompt is empty after tokenization", "prompt")
    if max_prompt_tokens and prompt_len > max_prompt_tokens:
        raise bad_request(
            f"The prompt has {prompt_len} tokens; this server accepts at most {max_prompt_tokens}",
            "prompt",
            "context_length_exceeded",
        )
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"The prompt has {prompt_len} tokens, which leaves no room to generate within "
            f"the model's context of {max_model_len} tokens",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(
            400,
            f"The prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
