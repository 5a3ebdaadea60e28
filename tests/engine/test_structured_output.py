"""shared/structured_output.py: GuidedDecoding compiled by llguidance for a real (tiny, trained)
byte-level BPE tokenizer. Masks are checked against an oracle written here from the tokens' bytes,
so a wrong mask (a token allowed that cannot continue the output, or one refused that can) fails."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import llguidance
import pytest

from pdserve.shared.models.demo import bytes_to_unicode
from pdserve.shared.sampling import GuidedDecoding
from pdserve.shared.structured_output import GrammarCompiler, check, compiler_for, grammar_text
from tests.checkpoints import train_tokenizer

EOS = 1  # "</s>" in train_tokenizer's special tokens


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.to_str(), eos_token_ids=(EOS,))


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table (the ByteLevel pre-tokenizer's), inverted."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


@pytest.fixture(scope="module")
def token_bytes(tokenizer) -> dict[int, bytes]:
    """Every non-special token id -> the bytes it stands for."""
    decoder = _byte_decoder()
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    return {
        i: bytes(decoder[c] for c in tok)
        for tok, i in tokenizer.get_vocab().items()
        if tok not in specials
    }


def allowed(matcher: llguidance.LLMatcher) -> set[int]:
    mask = matcher.compute_bitmask()
    return {i for i in range(len(mask) * 8) if mask[i // 8] >> (i % 8) & 1}


def run(compiler: GrammarCompiler, guided: GuidedDecoding, text: str, tokenizer) -> bool:
    """Whether ``text``'s tokens, then EOS, each get through the mask of a fresh matcher."""
    matcher = compiler.new_matcher(guided)
    for token in [*tokenizer.encode(text).ids, EOS]:
        if token not in allowed(matcher):
            return False
        matcher.consume_token(token)
    return True


def test_choice_mask_is_exactly_the_prefixes_of_the_choices(compiler, token_bytes):
    choices = ["quick", "lazy dog", 'say "hi"\n']
    matcher = compiler.new_matcher(GuidedDecoding("choice", json.dumps(choices)))
    encoded = [c.encode() for c in choices]
    expected = {i for i, b in token_bytes.items() if b and any(c.startswith(b) for c in encoded)}
    assert allowed(matcher) == expected
    assert len(expected) > 3  # the oracle is not vacuous: "q", "qu", "l", "la", ...


def test_regex_mask_after_a_prefix(compiler, token_bytes, tokenizer):
    matcher = compiler.new_matcher(GuidedDecoding("regex", r"[a-z]{2,4}-[0-9]+"))
    assert matcher.consume_tokens(tokenizer.encode("ab").ids)
    # after "ab": more letters (up to 4 in all), or "-" and digits
    pattern = re.compile(rb"[a-z]{0,2}(-[0-9]*)?")
    expected = {i for i, b in token_bytes.items() if b and pattern.fullmatch(b)}
    assert allowed(matcher) == expected
    assert EOS not in allowed(matcher)  # "ab" is not a match yet


@pytest.mark.parametrize(
    ("kind", "spec", "good", "bad"),
    [
        ("choice", '["yes", "no"]', ["yes", "no"], ["ye", "yesno", "maybe", ""]),
        ("regex", r"\d{3}-\d{4}", ["555-1234"], ["5551234", "555-123", "555-12345"]),
        ("json_object", "", ['{"a": [1, {"b": null}], "c": "x"}', "{}"], ["[1]", '"a"', "{"]),
        (
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "age": {"type": "integer", "minimum": 0, "maximum": 120},
                        "name": {"type": "string", "maxLength": 5},
                        "kind": {"enum": ["cat", "dog"]},
                    },
                    "required": ["age", "kind"],
                    "additionalProperties": False,
                }
            ),
            ['{"age": 3, "kind": "cat"}', '{"age":120,"name":"Rex","kind":"dog"}'],
            [
                '{"age": 121, "kind": "cat"}',
                '{"age": 3}',
                '{"age": 3, "kind": "cow"}',
                '{"age": 3, "name": "toolong", "kind": "dog"}',
                '{"age": 3, "kind": "cat", "x": 1}',
            ],
        ),
    ],
)
def test_language_of_each_kind(compiler, tokenizer, kind, spec, good, bad):
    guided = GuidedDecoding(kind, spec)
    for text in good:
        assert run(compiler, guided, text, tokenizer), text
    for text in bad:
        assert not run(compiler, guided, text, tokenizer), text


def test_json_whitespace_is_bounded(compiler, tokenizer):
    guided = GuidedDecoding("json_object")
    assert run(compiler, guided, '{\n  "a": 1\n}', tokenizer)
    assert not run(compiler, guided, '{"a":' + " " * 40 + "1}", tokenizer)


def test_finished_grammar_allows_only_eos(tokenizer):
    compiler = GrammarCompiler(tokenizer.to_str(), eos_token_ids=(EOS, 3))
    matcher = compiler.new_matcher(GuidedDecoding("choice", '["quick"]'))
    assert matcher.consume_tokens(tokenizer.encode("quick").ids)
    assert allowed(matcher) == {EOS, 3}


def test_padded_vocabulary_never_allows_padding(tokenizer):
    vocab = tokenizer.get_vocab_size()
    compiler = GrammarCompiler(tokenizer.to_str(), vocab_size=vocab + 40, eos_token_ids=(EOS,))
    assert compiler.vocab_size == vocab + 40
    matcher = compiler.new_matcher(GuidedDecoding("regex", ".*"))
    assert max(allowed(matcher)) < vocab


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("regex", "a(b", "unclosed group"),
        ("regex", "", "regex is empty"),
        ("json_schema", '{"type": "object", "if": {}}', "if"),
        ("json_schema", '{"type": "string", "format": "no-such-format"}', "no-such-format"),
        ("json_schema", '{"type": "nope"}', "nope"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("choice", "[]", "non-empty JSON array of strings"),
        ("choice", '["a", 1]', "non-empty JSON array of strings"),
        ("choice", '"a"', "non-empty JSON array of strings"),
    ],
)
def test_bad_specs_raise_value_error(compiler, kind, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.compile(GuidedDecoding(kind, spec))


def test_check_takes_a_path_a_directory_or_a_tokenizer(tokenizer, tmp_path):
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    good, bad = GuidedDecoding("regex", "[a-z]+"), GuidedDecoding("regex", "[a-z")
    for where in (tmp_path, tmp_path / "tokenizer.json", str(tmp_path), tokenizer):
        check(good, where)
        with pytest.raises(ValueError, match="invalid regex"):
            check(bad, where)
    assert compiler_for(tmp_path) is compiler_for(str(tmp_path / "tokenizer.json"))


def test_cache_is_keyed_by_kind_and_spec_and_bounded(tokenizer):
    compiler = GrammarCompiler(tokenizer.to_str(), cache_size=2)
    a, b, c = (GuidedDecoding("regex", r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(GuidedDecoding("regex", "a+")) is first
    assert compiler.compile(GuidedDecoding("choice", '["a+"]')) is not first
    compiler.compile(b)
    compiler.compile(c)  # a is the least recently used of three: evicted
    assert compiler.compile(a) is not first


def test_new_matchers_do_not_share_state(compiler, tokenizer):
    guided = GuidedDecoding("choice", '["quick", "lazy"]')
    one, two = compiler.new_matcher(guided), compiler.new_matcher(guided)
    assert one.consume_tokens(tokenizer.encode("quick").ids)
    assert allowed(one) == {EOS}
    assert allowed(two) == allowed(compiler.new_matcher(guided)) != {EOS}


def test_import_stays_light():
    """The gateway imports this to check specs: no torch (seconds) may come with it."""
    code = "import sys, shared.structured_output; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_grammar_text_needs_no_tokenizer():
    assert grammar_text(GuidedDecoding("choice", r'["a", "b\\"]')) == r'start: "a" | "b\\"'


# vLLM's structured_outputs.grammar: llguidance reads GBNF and Lark alike
@pytest.mark.parametrize(
    "spec",
    [
        'root ::= "the " animal\nanimal ::= "fox" | "dog" "s"?',  # GBNF (llama.cpp, xgrammar)
        'start: "the " animal\nanimal: "fox" | "dog" "s"?',  # Lark
    ],
    ids=["gbnf", "lark"],
)
def test_grammar_kind_follows_the_grammar(compiler, tokenizer, spec):
    guided = GuidedDecoding("grammar", spec)
    for text in ("the fox", "the dog", "the dogs"):
        assert run(compiler, guided, text, tokenizer), text
    for text in ("the cat", "the foxs", "the", "fox"):
        assert not run(compiler, guided, text, tokenizer), text


@pytest.mark.parametrize("spec", ['root ::= "a', "start: undefined_rule", "   "])
def test_bad_grammars_raise_value_error(compiler, spec):
    with pytest.raises(ValueError):
        compiler.compile(GuidedDecoding("grammar", spec))
