"""The gateway's view of a request: ``parse_completion`` and ``parse_chat`` check a body with
the pydantic models of ``gateway/request_bodies.py`` and hand the rest of the gateway plain
dataclasses (``GenerationParams``, ``CompletionRequest``, ``ChatRequest``).

Anything a client sends that we do not support is refused with a 400 naming it, rather than
silently ignored, so nobody believes a parameter took effect when it did not. The exceptions are
fields that change nothing (``sampling_fields.py``: ``user``, ``metadata``, ...), accepted so
clients that always send them work, and type-checked all the same. Every bad value is one
OpenAI-shaped 400 naming the field (``schema_base.py``).

A chat request with ``tools`` carries a ``ToolSetup`` (``GenerationParams.tools``), built with
the gateway's tool-call parser; when its calls are enforced, the grammar that enforces them
(``gateway/tools/grammar.py``) is the request's ``guided``, like any structured output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError

from pdserve.gateway.errors import APIError, bad_request
from pdserve.gateway.reasoning import ReasoningSetup
from pdserve.gateway.request_bodies import ChatCompletionBody, CompletionBody, Message
from pdserve.gateway.schema_base import StrictModel, api_error
from pdserve.gateway.tools.grammar import ToolGrammarError, tool_guide
from pdserve.gateway.tools.setup import ToolSetup
from pdserve.shared.sampling import GuidedDecoding


def _accepted(model: type[StrictModel]) -> frozenset[str]:
    """The body fields a model takes (by their JSON names), less any declared only to be
    refused (a field that takes nothing but null)."""
    fields = model.model_fields.items()
    return frozenset(f.alias or name for name, f in fields if f.annotation is not type(None))


COMPLETION_KEYS = _accepted(CompletionBody)
CHAT_KEYS = _accepted(ChatCompletionBody)


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
    guided: GuidedDecoding | None = None  # response_format / guided_* / structured_outputs
    guided_param: str | None = None  # the field that set guided, for its compile errors
    tools: ToolSetup | None = None  # chat with tools: what was asked of tool calling
    # chat with --reasoning-parser: how the answer's reasoning is split out (its prompt decides)
    reasoning: ReasoningSetup | None = None
    speculate: bool = True  # false: no speculative decoding for this request
    # vLLM's extensions (vllm_fields.py)
    prompt_logprobs: int | None = None  # the prompt's log-probs, this many alternatives each
    return_token_ids: bool = False  # token ids beside the text
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: all that fit)
    reply_role: str = "assistant"  # chat: the last message's without a generation prompt
    chat_echo: str = ""  # chat echo: the text the reply starts with (the last message's)
    # vLLM's tenancy fields (gateway/tenancy.py): the client's salt, before the key's is added
    cache_salt: str | None = None
    priority: int = 0


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
    # an assistant's calls, as chat templates read them (ToolCall.for_template)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning, sent back by the client


@dataclass
class ChatRequest:
    params: GenerationParams
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    tool_parser: str = "hermes"  # the format past calls are written in (templates without tools)


# ----------------------------------------------------------------------------- requests

Body = TypeVar("Body", bound=StrictModel)


def validated(model: type[Body], body: dict[str, Any]) -> Body:
    """``body`` as ``model``, or the one 400 naming what is wrong with it."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise api_error(exc) from None


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    req = validated(CompletionBody, body)
    params = _params(
        req,
        max_tokens=req.max_new_tokens,
        logprobs=req.logprobs,
        best_of=req.best_of,
        echo=bool(req.echo),
    )
    prompts = req.prompts()
    return CompletionRequest(params=params, prompt=prompts[0], prompts=prompts)


def parse_chat(
    body: dict[str, Any], tool_parser: str = "hermes", tag_tokens: tuple[tuple[str, int], ...] = ()
) -> ChatRequest:
    """``tool_parser``: the format the served model writes calls in (``--tool-call-parser``,
    resolved for its template); ``tag_tokens``: its tags that are one token each
    (``tools.grammar.tag_tokens``)."""
    req = validated(ChatCompletionBody, body)
    params = _params(req, max_tokens=req.max_new_tokens, logprobs=req.top_alternatives)
    params.tools = req.tool_setup(tool_parser, tag_tokens)
    try:
        guide = tool_guide(params.tools)
    except ToolGrammarError as exc:
        raise exc.api_error() from None
    if guide is not None:  # the body refuses tool grammars beside another guide
        params.guided = guide
        params.guided_param = "tool_choice" if params.tools.forced else "tools"
    # As vLLM: without a generation prompt the reply continues the last message's role, and
    # echo repeats the last message when it has the reply's role.
    last = req.messages[-1]
    params.reply_role = "assistant" if req.generation_prompt else last.role
    params.chat_echo = last.text() if req.echo and last.role == params.reply_role else ""
    return ChatRequest(
        params=params,
        messages=chat_messages(req.messages),
        add_generation_prompt=req.generation_prompt,
        continue_final_message=bool(req.continue_final_message),
        template_kwargs=dict(req.chat_template_kwargs or {}),
        tool_parser=tool_parser,
    )


def chat_messages(messages: list[Message]) -> list[ChatMessage]:
    """A body's messages as the chat template gets them."""
    # 'developer' is OpenAI's newer name for the system role; templates only know 'system'.
    return [
        ChatMessage(
            role="system" if m.role == "developer" else m.role,
            content=m.text(),
            name=m.name,
            tool_calls=[c.for_template() for c in m.tool_calls] if m.tool_calls else None,
            tool_call_id=m.tool_call_id,
            reasoning_content=m.reasoning_content,
        )
        for m in messages
    ]


def _params(
    req: CompletionBody | ChatCompletionBody,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    best_of: int | None = None,
    echo: bool = False,
) -> GenerationParams:
    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    return GenerationParams(
        model=req.model,
        max_tokens=max_tokens,
        temperature=float(given(req.temperature, 1.0)),
        top_p=float(given(req.top_p, 1.0)),
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        seed=req.seed,
        stop=req.stop_strings(),
        ignore_eos=bool(req.ignore_eos),
        stream=bool(req.stream),
        include_usage=req.include_usage,
        continuous_usage=req.continuous_usage,
        n=given(req.n, 1),
        best_of=best_of,
        logprobs=logprobs,
        echo=echo,
        presence_penalty=float(given(req.presence_penalty, 0.0)),
        frequency_penalty=float(given(req.frequency_penalty, 0.0)),
        repetition_penalty=float(given(req.repetition_penalty, 1.0)),
        min_tokens=given(req.min_tokens, 0),
        logit_bias=req.logit_bias_by_token(),
        stop_token_ids=list(req.stop_token_ids or []),
        guided=req.guided,
        guided_param=req.guided_param,
        speculate=given(req.speculate, True),
        prompt_logprobs=req.prompt_logprobs_asked,
        return_token_ids=bool(req.return_token_ids),
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        cache_salt=req.cache_salt,
        priority=given(req.priority, 0),
    )


def check_token_ids(ids: list[int], vocab_size: int, where: str = "prompt") -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise bad_request(
                f"Token id {t} at {where}[{i}] is outside the vocabulary [0, {vocab_size})",
                where,
                "invalid_token_id",
            )


def check_param_token_ids(params: GenerationParams, vocab_size: int) -> None:
    """The token ids a request names besides its prompt, checked against the vocabulary once
    the model is known (the schema bounds them only by the wire's limit). Both endpoints call
    this one check, so a field added here is checked on both."""
    for t in params.logit_bias:
        if not 0 <= t < vocab_size:
            raise bad_request(
                f"logit_bias names token id {t}, outside the vocabulary [0, {vocab_size})",
                "logit_bias",
                "invalid_token_id",
            )
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")


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
