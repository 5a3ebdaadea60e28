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
        self.template = env.from_string(source)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text. ``continue_final_message`` leaves the last message open for the
        model to continue; ``variables`` are more names for the template (vLLM's
        chat_template_kwargs; the caller keeps them off the names set here)."""
        conversation = []
        for m in messages:
            item: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.name is not None:
                item["name"] = m.name
            conversation.append(item)
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
