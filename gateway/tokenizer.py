"""A model's prompt side: its tokenizer (from a local Hugging Face model directory, without
transformers), its chat template, and prompt truncation.

``tokenizer.json`` is loaded with the Rust ``tokenizers`` library. Special tokens (BOS/EOS) and
the chat template come from ``tokenizer_config.json``; EOS ids are the union of what
``generation_config.json``, ``config.json`` and the tokenizer config name, because instruct
models often end turns with a token (e.g. ``<|eot_id|>``) that only one of those files lists.

vLLM's ``truncate_prompt_tokens``: a prompt too long for the context keeps only its last k
tokens (vLLM's left truncation: the end of a prompt is what the model continues from).

Chat messages are rendered to a prompt with the model's Jinja chat template.

Templates come from model files, so they run in jinja2's immutable sandbox. The environment
matches what Hugging Face templates expect (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text) so a template gives
the same text here as with ``transformers``' ``apply_chat_template``.

Tools, past calls and tool results reach the template as transformers passes them when it has
tool syntax, else as the documented fallback (``gateway/tools/prompt.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from pdserve.gateway.api_models import ChatMessage
from pdserve.gateway.errors import bad_request
from pdserve.gateway.tools.prompt import (
    fallback_messages,
    native_messages,
    reads_tools,
    tools_variable,
)
from pdserve.gateway.tools.setup import ToolSetup


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    vocab_size: int
    eos_token_ids: list[int]
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelTokenizer:
        model_dir = Path(model_dir)
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")

        bos = _token_text(tok_cfg.get("bos_token"))
        eos = _token_text(tok_cfg.get("eos_token"))
        eos_ids: list[int] = []
        for candidate in (
            _ids(gen_cfg.get("eos_token_id")),
            _ids(model_cfg.get("eos_token_id")),
            [] if eos is None else [i for i in [tok.token_to_id(eos)] if i is not None],
        ):
            eos_ids.extend(i for i in candidate if i not in eos_ids)

        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = tok_cfg.get("chat_template")
            # Some models ship several named templates; the one called "default" is the chat one.
            if isinstance(template, list):
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
            if not isinstance(template, str):
                template = None

        # The embedding matrix may be larger than the tokenizer (padding); ids the model can
        # take are bounded by config.json's vocab_size when present.
        vocab_size = model_cfg.get("vocab_size")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
            vocab_size = tok.get_vocab_size(with_added_tokens=True)
        special = frozenset(
            i for i, added in tok.get_added_tokens_decoder().items() if added.special
        )
        return cls(
            tokenizer=tok,
            vocab_size=vocab_size,
            eos_token_ids=eos_ids,
            bos_token=bos,
            eos_token=eos,
            chat_template=template,
            special_ids=special,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def prompt_room(max_tokens: int | None, limit: int, max_prompt_tokens: int) -> int:
    """The most prompt tokens a request with ``max_tokens`` (None: the rest of the context) can
    have: the context less the output, and at least one position to generate into, as
    ``api_models.check_length`` requires; and no more than ``--max-prompt-tokens``."""
    room = limit - max(max_tokens or 1, 1)
    return min(room, max_prompt_tokens) if max_prompt_tokens else room


def truncate_prompt(
    ids: list[int], keep: int | None, max_tokens: int | None, limit: int, max_prompt_tokens: int
) -> list[int]:
    """``ids`` cut to its last ``keep`` tokens (-1: as many as fit); unchanged when ``keep`` is
    None or the prompt is short enough. As in vLLM, a ``keep`` that could never fit with
    ``max_tokens`` is a 400, however short this prompt is."""
    if keep is None:
        return ids
    room = prompt_room(max_tokens, limit, max_prompt_tokens)
    if keep == -1:
        keep = room
    elif keep > room:
        raise bad_request(
            f"'truncate_prompt_tokens' ({keep}) must be at most {room}: the context of {limit} "
            "tokens less max_tokens (and --max-prompt-tokens) leaves that many for the prompt",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    if keep < 1 or len(ids) <= keep:
        return ids  # nothing fits at all: check_length says why, naming max_tokens
    return ids[-keep:]


class TemplateInputError(Exception):
    """The template refused the conversation (its ``raise_exception`` ran), or the conversation
    cannot be continued: the client's fault, a 400 naming ``param``."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class TemplateFailure(Exception):
    """The template itself failed to render: the server's fault, not the client's."""


def _raise_exception(message: str) -> None:
    raise TemplateInputError(message)


def _tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=False)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.has_tool_syntax = reads_tools(source)
        self.template = env.from_string(source)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: dict[str, Any] | None = None,
        tools: ToolSetup | None = None,
        tool_parser: str = "hermes",
    ) -> str:
        """The prompt text. ``continue_final_message`` leaves the last message open for the
        model to continue; ``variables`` are more names for the template (vLLM's
        chat_template_kwargs; the caller keeps them off the names set here). ``tools``: the
        request's, in the template's ``tools`` or the fallback's system section;
        ``tool_parser`` is the format the fallback writes past calls in."""
        if self.has_tool_syntax:
            conversation = native_messages(messages)
        else:
            conversation = fallback_messages(messages, tools, tool_parser)
        if continue_final_message:
            if "content" not in self.source:
                raise TemplateInputError(
                    "the chat template does not read messages' content", "continue_final_message"
                )
            conversation[-1]["content"] += CONTINUE_TAG
        try:
            fixed = {
                "messages": conversation,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "add_generation_prompt": add_generation_prompt,
            }
            if tools is not None and self.has_tool_syntax:
                fixed["tools"] = tools_variable(tools)
            text = self.template.render({**(variables or {}), **fixed})
        except TemplateInputError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise TemplateFailure(f"chat template failed: {exc}") from exc
        return _cut_at_tag(text, messages[-1].content) if continue_final_message else text


# transformers' way of continuing the final message: the message is rendered with this tag
# after it, and the prompt ends where the tag begins, whatever the template writes after a
# message (an end-of-turn token, a newline).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise TemplateInputError(
            "the final message does not appear in the rendered chat, so it cannot be continued",
            "continue_final_message",
        )
    at = text.rindex(CONTINUE_TAG.strip())
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space
