"""Structured output after a reasoning model's thoughts (``GuidedDecoding.reasoning``): the
grammar llguidance compiles lets any text through up to the first ``</think>`` and holds the
answer after it to the grammar, whatever kind the grammar is; "tag" makes the thoughts optional,
so an answer that starts right away is held from its first token. Walked token by token with a
real (trained) tokenizer, as the engine's matcher consumes them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer

from pdserve.shared.sampling import GuidedDecoding
from pdserve.shared.structured_output import GrammarCompiler
from tests.unit.gateway_fixtures import train_byte_level

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
GUIDES = {
    "json_schema": (GuidedDecoding("json_schema", json.dumps(SCHEMA)), '{"a": 12}', '{"b": 1}'),
    "regex": (GuidedDecoding("regex", "ab+"), "abbb", "ba"),
    "choice": (GuidedDecoding("choice", '["yes", "no"]'), "no", "maybe"),
    "grammar": (GuidedDecoding("grammar", 'start: "x" "y"+'), "xyy", "yx"),
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_byte_level(300)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok.to_str())


def walk(compiler: GrammarCompiler, tok: Tokenizer, guided: GuidedDecoding, text: str) -> Any:
    """The matcher after ``text``'s tokens, or None when one was refused."""
    matcher = compiler.new_matcher(guided)
    for token in tok.encode(text, add_special_tokens=False).ids:
        if not matcher.consume_token(token):
            return None
    return matcher


@pytest.mark.parametrize("kind", GUIDES)
def test_inside_the_thoughts_are_free_and_the_answer_is_held(compiler, tok, kind):
    plain, good, bad = GUIDES[kind]
    guided = GuidedDecoding(plain.kind, plain.spec, reasoning="inside")
    thoughts = "Hmm, maybe {not json} </thin k> or <think> here.\n</think>\n\n"
    done = walk(compiler, tok, guided, thoughts + good)
    assert done is not None and done.is_accepting()
    assert walk(compiler, tok, guided, thoughts + bad) is None
    # without reasoning, the same thoughts break the grammar at once
    assert walk(compiler, tok, plain, thoughts + good) is None


@pytest.mark.parametrize("kind", GUIDES)
def test_tag_makes_the_thoughts_optional(compiler, tok, kind):
    plain, good, bad = GUIDES[kind]
    guided = GuidedDecoding(plain.kind, plain.spec, reasoning="tag")
    for text in (good, f"<think>\nfree {{text}}\n</think>\n{good}", f" <think>x</think>{good}"):
        done = walk(compiler, tok, guided, text)
        assert done is not None and done.is_accepting(), text
    # no <think>: the answer is held from its first token
    assert walk(compiler, tok, guided, "free text</think>" + good) is None
    assert walk(compiler, tok, guided, f"<think>x</think>{bad}") is None


def test_the_thoughts_end_at_the_first_close_tag(compiler, tok):
    """Text after the first </think> is the answer, so a second one cannot reopen thinking."""
    plain, good, _ = GUIDES["json_schema"]
    guided = GuidedDecoding(plain.kind, plain.spec, reasoning="inside")
    assert walk(compiler, tok, guided, f"a</think>b</think>{good}") is None


def test_an_unknown_reasoning_start_is_refused():
    with pytest.raises(ValueError, match="reasoning"):
        GuidedDecoding("regex", "a", reasoning="later")


def test_each_reasoning_start_compiles_apart(compiler):
    plain = GUIDES["regex"][0]
    starts = {
        id(compiler.compile(GuidedDecoding(plain.kind, plain.spec, reasoning=r)))
        for r in ("", "inside", "tag")
    }
    assert len(starts) == 3
