"""Reasoning out of a chat answer (``--reasoning-parser``): the ``<think>...</think>`` family.

Reasoning models write their thoughts first, between ``<think>`` and ``</think>``, then the
answer. The parser splits the text into ``reasoning_content`` and ``content``; tool calls are
then read from the content alone.

Where an answer starts - inside the reasoning, or in content unless it opens with ``<think>``,
or with no reasoning at all - depends on the parser and on what the chat template already wrote
(``reasoning_setup``):

- a prompt that ends with ``<think>`` (DeepSeek-R1's newer templates, Qwen3's thinking and 3.5
  templates) leaves the answer inside the reasoning;
- a prompt that ends with ``</think>`` (Qwen3's template with ``enable_thinking: false``) has
  closed it: the whole answer is content; so does ``enable_thinking: false`` under ``qwen3``;
- otherwise ``deepseek_r1`` starts inside the reasoning (R1 often writes no ``<think>``, as
  vLLM assumes too), and ``qwen3`` only where the answer opens with ``<think>``.

A ``<think>`` at the very start of the answer (after space) is dropped either way. Without a
``</think>`` the reasoning runs to the end: an answer cut off by ``max_tokens`` while thinking
is all reasoning, ``content`` null. Reasoning is trimmed of the space around it, and content of
the space right after ``</think>``; an answer that never entered reasoning is its text unchanged.

One machine (``ReasoningSplitter``) reads the text as it streams in, and a whole answer
(``split``) is the same machine fed everything at once, so the streamed deltas join to exactly
the whole answer however the text was cut (tags split across deltas included): it holds back only
what more text could still change - a possible ``<think>`` at the start, a possible ``</think>``,
and space that may precede it.

Unlike vLLM, a ``<think>`` that is not at the start is text (vLLM's whole-answer parsers drop
whatever precedes the first one, which a stream cannot know in advance), and the space around
the tags is trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from pdserve.gateway.tools.formats import partial_suffix
from pdserve.shared.sampling import THINK_CLOSE as CLOSE
from pdserve.shared.sampling import THINK_OPEN as OPEN
from pdserve.shared.sampling import GuidedDecoding

PARSERS = ("deepseek_r1", "qwen3")  # what --reasoning-parser takes (shared/config.py)

# inside: the answer starts in the reasoning; tag: only if it opens with <think>; off: none
Start = Literal["inside", "tag", "off"]
Event = tuple[Literal["reasoning", "content"], str]


@dataclass(frozen=True)
class ReasoningSetup:
    parser: str  # one of PARSERS
    start: Start


def reasoning_setup(
    parser: str | None, prompt: str, template_kwargs: dict[str, Any]
) -> ReasoningSetup | None:
    """How the answer to the rendered chat ``prompt`` is split (None: no parser, no
    ``reasoning_content`` in the response)."""
    if parser is None:
        return None
    tail = prompt.rstrip()
    start: Start
    # The Qwen3 templates test `enable_thinking is false`: only a JSON false turns it off.
    if tail.endswith(CLOSE) or (
        parser == "qwen3" and template_kwargs.get("enable_thinking") is False
    ):
        start = "off"
    elif tail.endswith(OPEN) or parser == "deepseek_r1":
        start = "inside"
    else:
        start = "tag"
    return ReasoningSetup(parser=parser, start=start)


def guided_after_reasoning(
    guided: GuidedDecoding | None, setup: ReasoningSetup | None
) -> GuidedDecoding | None:
    """Structured output (a response format, a tool grammar) held back until the answer's
    reasoning ends, where the answer can reason at all; the splitter then finds the grammar's
    output in ``content``."""
    if guided is None or setup is None or setup.start == "off":
        return guided
    return replace(guided, reasoning=setup.start)


class ReasoningSplitter:
    """Generated text in; reasoning and content out, in order."""

    def __init__(self, setup: ReasoningSetup) -> None:
        self._state = "content" if setup.start == "off" else "start"
        self._inside = setup.start == "inside"
        self._buf = ""  # text not decided yet
        self._space = ""  # space at the end of the reasoning so far: dropped if </think> follows
        self.entered = False  # the answer went into reasoning (content may then be null)
        self._reasoned = False  # reasoning text sent (space before it is dropped)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """The text has ended: decide everything held."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN):
                    self._buf = head[len(OPEN) :]
                    self._enter()
                elif OPEN.startswith(head) and not final:
                    break  # still space, or maybe the start of <think>
                elif self._inside:
                    self._enter()
                else:
                    self._state = "content"  # untouched: the answer has no reasoning
                continue
            if self._state == "reasoning":
                at = self._buf.find(CLOSE)
                if at != -1:
                    self._reason(self._buf[:at], out, closed=True)
                    self._buf = self._buf[at + len(CLOSE) :]
                    self._state = "after"
                    continue
                keep = 0 if final else partial_suffix(self._buf, CLOSE)
                self._reason(self._buf[: len(self._buf) - keep], out, closed=final)
                self._buf = self._buf[len(self._buf) - keep :]
                break
            if self._state == "after":  # the space between </think> and the answer
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._state = "content"
                continue
            if self._buf:
                out.append(("content", self._buf))
                self._buf = ""
            break
        return out

    def _enter(self) -> None:
        self._state = "reasoning"
        self.entered = True

    def _reason(self, text: str, out: list[Event], closed: bool) -> None:
        if not self._reasoned:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            out.append(("reasoning", self._space + body))
            self._reasoned = True
            self._space = text[len(body) :]
        else:
            self._space += text
        if closed:
            self._space = ""


@dataclass
class Split:
    reasoning: str | None  # None: no reasoning in the answer
    content: str | None  # None: the answer was all reasoning


def split(text: str, setup: ReasoningSetup) -> Split:
    """A whole answer's reasoning and content."""
    splitter = ReasoningSplitter(setup)
    events = splitter.feed(text) + splitter.finish()
    reasoning = "".join(v for kind, v in events if kind == "reasoning")
    content = "".join(v for kind, v in events if kind == "content")
    return Split(reasoning or None, None if splitter.entered and not content else content)
