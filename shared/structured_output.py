"""Structured output's grammars: a ``GuidedDecoding`` compiled by llguidance for one tokenizer.

Two sides use this module. The gateway calls ``check`` so that a spec that cannot compile (a bad
regex, a schema keyword llguidance does not implement) is answered with a 400 before anything is
dispatched. The engine (``services/engine/guided.py``) asks a ``GrammarCompiler`` for a fresh
matcher per guided sequence and fills token masks from it.

llguidance was picked by measurement (``perf/structured_bench.py``, ``perf/README.md``): it
covers every kind (JSON schema or object, regex, choice, a Lark or GBNF grammar), compiles in
well under a millisecond, refuses unimplemented schema keywords instead of ignoring them, and
imports in 0.1 s with no dependency (no torch), which matters to the gateway. Its
``llguidance.torch`` helpers are never imported: that module runs ``torch.compile`` at import
(seconds).

JSON (``json_schema``, ``json_object``) allows at most ``JSON_MAX_WHITESPACE`` whitespace
characters between tokens: enough for pretty-printed output, and a bound, so that a schema with
bounded sizes always ends instead of letting a model pad with whitespace until max_tokens.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance

from pdserve.shared.sampling import THINK_CLOSE, THINK_OPEN, GuidedDecoding

JSON_MAX_WHITESPACE = 12
_JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{JSON_MAX_WHITESPACE}}}"}
_ANY_OBJECT = {"type": "object"}
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept per tokenizer
_MAX_ERROR_CHARS = 600  # llguidance's messages can quote the whole grammar
_MAX_COMPILERS = 8  # tokenizers with a compiler, per process (one per served model in practice)


def grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar for ``guided``; ValueError when its spec is not even well formed
    (compile errors, such as a bad regex, come from ``GrammarCompiler.compile``)."""
    answer = _answer_grammar(guided)
    return after_reasoning(answer, guided.reasoning) if guided.reasoning else answer


def after_reasoning(answer: str, start: str) -> str:
    """``answer`` (a grammar) preceded by a reasoning model's thoughts: free text up to the
    first ``</think>`` ("inside": the prompt left the answer in its reasoning), or an optional
    ``<think>...</think>`` section ("tag"); a little space may follow the thoughts. The answer becomes a
    named sub-grammar of the result, whatever kind it is (JSON schema, regex, Lark)."""
    top = json.loads(answer) if answer.lstrip().startswith("{") else _lark_top(answer)
    grammars = top["grammars"]
    grammars[0]["name"] = "answer"
    close = json.dumps(THINK_CLOSE)
    # A lazy rule ends at the first </think>, so the thoughts cannot run past it.
    thoughts = "start: thoughts SPACE? @answer\n"
    if start == "tag":
        thoughts = f"start: (SPACE? {json.dumps(THINK_OPEN)} thoughts SPACE?)? @answer\n"
    lark = (
        "%llguidance {}\n"
        + thoughts
        + f"thoughts[lazy]: THOUGHT {close}\n"
        + "THOUGHT: /(.|\\n)*/\n"
        + "SPACE: /[ \\t\\r\\n]{1,8}/\n"
    )
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark}, *grammars]})


def _lark_top(lark: str) -> dict[str, Any]:
    return {"grammars": [{"lark_grammar": lark}]}


def _answer_grammar(guided: GuidedDecoding) -> str:
    M = llguidance.LLMatcher
    if guided.kind == "json_object":
        return M.grammar_from_json_schema(_ANY_OBJECT, overrides=_JSON_OPTIONS)
    if guided.kind == "json_schema":
        schema = _parse_json(guided.spec, "json_schema")
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON object (a JSON Schema)")
        return M.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if guided.kind == "regex":
        if not guided.spec:
            raise ValueError("regex is empty")
        return M.grammar_from_regex(guided.spec)
    if guided.kind == "grammar":
        if not guided.spec.strip():
            raise ValueError("grammar is empty")
        # Lark as is, GBNF (llama.cpp's EBNF, what vLLM's xgrammar backend takes) converted to
        # Lark: llguidance's own reading of vLLM's "grammar", as vLLM's guidance backend does.
        return llguidance.grammar_from("grammar", guided.spec)
    choices = _parse_json(guided.spec, "choice")
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise ValueError("choice must be a non-empty JSON array of strings")
    # Lark string literals take JSON's escapes, so json.dumps quotes any choice exactly.
    return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _parse_json(spec: str, kind: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{kind} is not valid JSON: {exc}") from None


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for one tokenizer, held as a matcher in its start state that is never
    advanced: each sequence gets its own copy (``new_matcher``), which shares the compiled
    lexer and parser tables."""

    guided: GuidedDecoding
    start: llguidance.LLMatcher

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.start.deep_copy()


class GrammarCompiler:
    """Compiles ``GuidedDecoding``s for one tokenizer; the last ``cache_size`` distinct specs
    stay compiled. Thread-safe: the gateway's event loop and an engine thread may share one.

    ``vocab_size`` is the model's logits width when it differs from the tokenizer's (padded
    embeddings): the padding ids are never allowed. ``eos_token_ids`` are what a finished
    grammar allows (and only they); by default the tokenizer's own EOS."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        eos = list(eos_token_ids) or None
        tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        # Padded logits: the ids past the tokenizer's are never allowed. llguidance refuses a
        # vocabulary smaller than the tokenizer's; if the logits are narrower, the ids past them
        # exist in masks only and the engine cuts masks to the logits' width.
        if vocab_size is not None and vocab_size > tokenizer.vocab_size:
            tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eos_token_ids = tuple(self.tokenizer.eos_tokens)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, guided: GuidedDecoding) -> CompiledGrammar:
        """The compiled grammar (cached by kind, spec and reasoning); ValueError if it does not
        compile."""
        key = (guided.kind, guided.spec, guided.reasoning)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        # Compiled outside the lock (llguidance drops the GIL while it builds): two threads
        # compiling the same spec at once both succeed, and one result is kept.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(guided), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {guided.kind}: {_short(matcher.get_error())}")
        compiled = CompiledGrammar(guided, matcher)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, guided: GuidedDecoding) -> llguidance.LLMatcher:
        """A matcher in the grammar's start state, for one sequence."""
        return self.compile(guided).new_matcher()


def _short(error: str) -> str:
    error = error.strip()
    return error if len(error) <= _MAX_ERROR_CHARS else error[:_MAX_ERROR_CHARS] + " ..."


# ---- one compiler per tokenizer, for callers that hold a path or a tokenizers.Tokenizer ------

_compilers: OrderedDict[tuple, tuple[object, GrammarCompiler]] = OrderedDict()
_compilers_lock = threading.Lock()


def compiler_for(
    tokenizer: str | os.PathLike | Any,
    vocab_size: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> GrammarCompiler:
    """The process's compiler for ``tokenizer``: a tokenizer.json path (or the directory holding
    it) or a Hugging Face ``tokenizers.Tokenizer``. Building one costs ~0.3 s for a 50k-token
    vocabulary, so each is kept (the last few tokenizers) and shared."""
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        stat = path.stat()
        identity: tuple = ("path", str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        keep_alive: object = None
    else:  # the object itself is kept with its compiler, so its id cannot be reused meanwhile
        identity, keep_alive = ("object", id(tokenizer)), tokenizer
    key = (*identity, vocab_size, tuple(eos_token_ids))
    with _compilers_lock:
        hit = _compilers.get(key)
        if hit is not None:
            _compilers.move_to_end(key)
            return hit[1]
    text = path.read_text() if keep_alive is None else tokenizer.to_str()
    compiler = GrammarCompiler(text, vocab_size, tuple(eos_token_ids))
    with _compilers_lock:
        _compilers[key] = (keep_alive, compiler)
        while len(_compilers) > _MAX_COMPILERS:
            _compilers.popitem(last=False)
    return compiler


def check(guided: GuidedDecoding, tokenizer: str | os.PathLike | Any) -> None:
    """Raise ValueError, with a message fit for a 400 answer, if ``guided`` does not compile
    for ``tokenizer`` (a tokenizer.json path, its directory, or a ``tokenizers.Tokenizer``).
    The compiled grammar stays cached, so checking then generating compiles once."""
    compiler_for(tokenizer).compile(guided)
