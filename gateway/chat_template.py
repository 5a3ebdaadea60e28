"""Render chat messages to a prompt with the model's Jinja chat template.

Templates come from model files, so they run in jinja2's immutable sandbox. The environment
matches what Hugging Face templates expect (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text) so a template gives
the same text here as with ``transformers``' ``apply_chat_template``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.gateway.api_models import ChatMessage


class TemplateInputError(Exception):
    """The template refused the conversation (its ``raise_exception`` ran): the client's fault."""


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
        self.template = env.from_string(source)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        conversation = []
        for m in messages:
            item: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.name is not None:
                item["name"] = m.name
            conversation.append(item)
        try:
            return self.template.render(
                messages=conversation,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateInputError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise TemplateFailure(f"chat template failed: {exc}") from exc
