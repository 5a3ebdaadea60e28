"""``--reasoning-parser``: the ``<think>...</think>`` split of a chat answer.

Worked examples for both parsers and each way an answer can start, the start read off the
rendered prompt, and property tests (hypothesis): any text made of tags, pieces of tags, space
and words, cut into deltas anywhere (tags split across deltas included), streams to exactly
``split`` of the whole text, which is what a plain whole-text reading (``reference`` below)
gives."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.gateway.reasoning import (
    ReasoningSetup,
    ReasoningSplitter,
    Start,
    reasoning_setup,
    split,
)


def setup(start: Start, parser: str = "qwen3") -> ReasoningSetup:
    return ReasoningSetup(parser=parser, start=start)


def reference(text: str, start: Start) -> tuple[str | None, str | None]:
    """The split written directly on the whole text, independently of the streaming machine."""
    if start == "off":
        return None, text
    head = text.lstrip()
    if head.startswith("<think>"):
        body = head[len("<think>") :]
    elif start == "inside":
        body = text
    else:
        return None, text
    reasoning, tag, content = body.partition("</think>")
    content = content.lstrip() if tag else ""
    return reasoning.strip() or None, content or None


def streamed(text: str, cuts: list[int], start: Start) -> tuple[str | None, str | None, list]:
    """The stream's events for ``text`` cut at ``cuts``, joined as a client joins them."""
    splitter = ReasoningSplitter(setup(start))
    events, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += splitter.feed(text[last:cut])
        last = cut
    events += splitter.finish()
    reasoning = "".join(v for kind, v in events if kind == "reasoning")
    content = "".join(v for kind, v in events if kind == "content")
    return reasoning or None, content or None, events


@pytest.mark.parametrize(
    ("start", "text", "reasoning", "content"),
    [
        # qwen3: both tags in the answer; the space around them trimmed
        ("tag", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
        ("tag", "Paris.", None, "Paris."),  # no tags: all content, untouched
        ("tag", "  Paris.\n", None, "  Paris.\n"),
        ("tag", "Paris <think>x</think>", None, "Paris <think>x</think>"),  # not at the start
        ("tag", "<think>cut off by max_tokens", "cut off by max_tokens", None),
        ("tag", "<think>\n\n</think>\n\nParis.", None, "Paris."),  # an empty thought
        ("tag", "<think>a</think>", "a", None),
        ("tag", "<thin", None, "<thin"),  # ended on a piece of the tag: text
        # deepseek_r1 / a prompt ending in <think>: the answer starts inside the reasoning
        ("inside", "Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
        ("inside", "<think>\nLet me see.</think>Paris.", "Let me see.", "Paris."),
        ("inside", "still thinking", "still thinking", None),
        ("inside", "a</think>b</think>c", "a", "b</think>c"),  # later tags are content
        ("inside", "a <think> b</think>c", "a <think> b", "c"),
        ("inside", "</think>Paris.", None, "Paris."),
        # thinking switched off: all content, tags and all
        ("off", "<think>a</think>b", None, "<think>a</think>b"),
    ],
)
def test_examples(start: Start, text: str, reasoning: str | None, content: str | None):
    whole = split(text, setup(start))
    assert (whole.reasoning, whole.content) == (reasoning, content)
    assert reference(text, start) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert streamed(text, [cut], start)[:2] == (reasoning, content)


@pytest.mark.parametrize(
    ("parser", "prompt", "kwargs", "start"),
    [
        ("deepseek_r1", "<｜User｜>Hi<｜Assistant｜>", {}, "inside"),
        ("deepseek_r1", "<｜User｜>Hi<｜Assistant｜><think>\n", {}, "inside"),
        ("qwen3", "<|im_start|>assistant\n", {}, "tag"),
        ("qwen3", "<|im_start|>assistant\n<think>\n", {}, "inside"),  # Qwen3.5, -Thinking
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", {}, "off"),
        ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False}, "off"),
        ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": True}, "tag"),
        ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": 0}, "tag"),  # as the template
        ("deepseek_r1", "<｜Assistant｜><think>\n\n</think>", {}, "off"),
        # an earlier turn's reasoning in the prompt says nothing about this answer
        ("qwen3", "<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", {}, "tag"),
    ],
)
def test_the_start_is_read_off_the_prompt(parser, prompt, kwargs, start):
    assert reasoning_setup(parser, prompt, kwargs) == ReasoningSetup(parser=parser, start=start)


def test_no_parser_no_setup():
    assert reasoning_setup(None, "<think>\n", {}) is None


# ----------------------------------------------------------------------------- properties

# tags, pieces of them, space and words
TAGS = ["<think>", "</think>", "<", "</", "<th", "</thi", "think>", ">", "/"]
PIECES = st.sampled_from([*TAGS, " ", "\n", "  \n", "a", "b c", "Paris.", "é", "<tool_call>"])
TEXTS = st.lists(PIECES, max_size=14).map("".join)
STARTS = st.sampled_from(["inside", "tag", "off"])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS, start=STARTS, data=st.data())
def test_any_chunking_streams_the_whole_answer(text: str, start: Start, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 1))
    reasoning, content, events = streamed(text, cuts, start)
    whole = split(text, setup(start))
    assert (reasoning, content or None) == (whole.reasoning, whole.content or None), (text, cuts)
    assert (whole.reasoning, whole.content) == reference(text, start)
    assert all(value for _, value in events), "no empty deltas"


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, start=STARTS)
def test_one_character_per_delta(text: str, start: Start):
    reasoning, content, _ = streamed(text, list(range(len(text) + 1)), start)
    expected = reference(text, start)
    assert (reasoning, content) == (expected[0], expected[1] or None)


def test_held_back_only_while_undecided():
    """A stream is not delayed past what a tag could still change."""
    splitter = ReasoningSplitter(setup("tag"))
    assert splitter.feed("  <th") == []  # may still open the reasoning
    assert splitter.feed("ink>Hmm, ") == [("reasoning", "Hmm,")]  # its space may precede </think>
    assert splitter.feed("so</") == [("reasoning", " so")]
    assert splitter.feed("b") == [("reasoning", "</b")]
    assert splitter.feed("</think>\n") == []
    assert splitter.feed("\nParis") == [("content", "Paris")]
    assert splitter.finish() == []
    plain = ReasoningSplitter(setup("tag"))
    assert plain.feed("Par") == [("content", "Par")]


def test_the_option_is_checked():
    from pdserve.shared.config import GatewayConfig
    from pdserve.shared.errors import StartupError

    assert GatewayConfig().reasoning_parser is None
    assert GatewayConfig(reasoning_parser="").reasoning_parser is None  # an empty variable
    assert GatewayConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(StartupError, match="--reasoning-parser"):
        GatewayConfig(reasoning_parser="granite")
