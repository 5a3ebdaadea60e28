"""Structured-output libraries side by side: xgrammar, llguidance, outlines-core.

For each tokenizer (the default model's, SmolLM2-135M-Instruct with 49,152 tokens, and the tests'
tiny 384-token BPE) and each library it measures:

- setup: turning the tokenizer into the library's form, plus its first grammar's first mask
  (what it builds lazily for the vocabulary): once per model;
- compile: a grammar from a spec (two JSON schemas, any JSON object, a regex, a choice), with the
  library's own cache off, plus the first mask (llguidance builds its lexer lazily, so compile
  alone would flatter it);
- per step: filling the next-token bitmask [B, ceil(V/32)] and advancing every state by one
  token, for B = 1 and 16 sequences, each replaying a valid document's tokens, through each
  library's batched call where it has one;
- coverage: whether the library enforces what the tests need (integer bounds, maxLength, any
  JSON object at any depth, bad specs refused at compile time).

    python -m perf.structured_bench [--json perf/results/structured_bench.json] [--repeat N]

Grammar work runs on the CPU whatever the model's device is, so no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "note": {"type": "string", "maxLength": 20},
    },
    "required": ["id", "items"],
    "additionalProperties": False,
}
EMAIL_REGEX = r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)"
CHOICES = ["positive", "negative", "neutral"]

# (name, kind, spec, a valid document whose tokens each sequence replays)
WORKLOADS: list[tuple[str, str, str, str]] = [
    ("schema:person", "json_schema", json.dumps(PERSON_SCHEMA),
     '{"name":"Ada Lovelace","age":36,"role":"admin","tags":["a","c"]}'),
    ("schema:order", "json_schema", json.dumps(ORDER_SCHEMA),
     '{"id":4711,"items":[{"sku":"ABC-123","qty":2},{"sku":"XYZ-999","qty":1,"gift":true}],'
     '"note":"leave at door"}'),
    ("json_object", "json_object", "",
     '{"a":[1,2.5,{"b":null,"c":[true,false]}],"d":"some text","e":{"f":{"g":-3e2}}}'),
    ("regex:email", "regex", EMAIL_REGEX, "ada@lovelace.org"),
    ("choice", "choice", json.dumps(CHOICES), "neutral"),
]  # fmt: skip
BATCH_SIZES = (1, 16)


# ---- tokenizers --------------------------------------------------------------------------------


@dataclass
class TokenizerCase:
    name: str
    tokenizer_json: str
    vocab_size: int
    eos: int
    encode: Callable[[str], list[int]]
    byte_vocab: dict[bytes, list[int]]  # non-special tokens as the bytes they decode to


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the printable stand-in char -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def load_tokenizer(name: str, tokenizer, eos: int) -> TokenizerCase:
    decoder = _byte_level_decoder()
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    byte_vocab: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token not in specials:
            byte_vocab.setdefault(bytes(decoder[c] for c in token), []).append(token_id)
    return TokenizerCase(
        name, tokenizer.to_str(), tokenizer.get_vocab_size(), eos,
        lambda text: tokenizer.encode(text, add_special_tokens=False).ids, byte_vocab,
    )  # fmt: skip


def tokenizer_cases() -> list[TokenizerCase]:
    from tokenizers import Tokenizer

    from services.engine.model_config import ModelConfig
    from shared.models.resolve import resolve
    from tests.checkpoints import train_tokenizer

    model_dir = resolve("smollm2-135m-instruct").path
    smol = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = ModelConfig.from_dir(model_dir).eos_token_ids[0]
    return [load_tokenizer("smollm2", smol, eos), load_tokenizer("tiny", train_tokenizer(), 1)]


# ---- the libraries behind one interface ---------------------------------------------------------


class Backend:
    name = ""

    def setup(self, tok: TokenizerCase) -> None: ...
    def compile(self, kind: str, spec: str): ...
    def new_state(self, grammar): ...
    def fill(self, states: list, bitmask: torch.Tensor) -> None: ...
    def advance(self, states: list, tokens: list[int]) -> None: ...


def _choice_regex(choices: list[str]) -> str:
    """Alternation of literals, escaping every character a regex engine could read as syntax."""
    return "(" + "|".join("".join("\\" + c if c in r"\.+*?()|[]{}^$-&~#" else c for c in ch)
                          for ch in choices) + ")"  # fmt: skip


class LLGuidance(Backend):
    name = "llguidance"

    def setup(self, tok: TokenizerCase) -> None:
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            tok.tokenizer_json, n_vocab=tok.vocab_size, eos_token=tok.eos
        )
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, kind: str, spec: str):
        M = self.llg.LLMatcher
        if kind == "json_schema":
            grammar = M.grammar_from_json_schema(spec)
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema({"type": "object"})
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        else:
            grammar = M.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in json.loads(spec))
            )
        error = M.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def new_state(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)

    def fill(self, states: list, bitmask: torch.Tensor) -> None:
        # The executor directly: llguidance.torch's wrapper costs ~4 s at import (torch.compile).
        rows = [(m, i) for i, m in enumerate(states)]
        width = bitmask.shape[1] * 4
        self.executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), width, bitmask.shape[0])

    def advance(self, states: list, tokens: list[int]) -> None:
        for m, t in zip(states, tokens, strict=True):
            if not m.consume_token(t):
                raise AssertionError(m.get_error())


class XGrammar(Backend):
    name = "xgrammar"

    def setup(self, tok: TokenizerCase) -> None:
        import xgrammar

        self.xgr = xgrammar
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tok.tokenizer_json)
        vocab = [""] * tok.vocab_size
        for token, token_id in json.loads(tok.tokenizer_json)["model"]["vocab"].items():
            vocab[token_id] = token
        for added in json.loads(tok.tokenizer_json)["added_tokens"]:
            vocab[added["id"]] = added["content"]
        info = xgrammar.TokenizerInfo(
            vocab, meta["vocab_type"], vocab_size=tok.vocab_size, stop_token_ids=[tok.eos],
            add_prefix_space=meta["add_prefix_space"],
        )  # fmt: skip
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, kind: str, spec: str):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(spec)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}')
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_regex(_choice_regex(json.loads(spec)))

    def new_state(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, states: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(states, bitmask)

    def advance(self, states: list, tokens: list[int]) -> None:
        if not all(self.batch.batch_accept_token(states, tokens)):
            raise AssertionError("xgrammar refused a valid token")


class OutlinesCore(Backend):
    name = "outlines-core"

    def setup(self, tok: TokenizerCase) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(tok.eos, tok.byte_vocab)

    def compile(self, kind: str, spec: str):
        schema_regex = self.oc.json_schema.build_regex_from_schema
        if kind == "json_schema":
            regex = schema_regex(spec)
        elif kind == "json_object":  # a regex: objects nest only as deep as it unrolls
            regex = schema_regex('{"type": "object"}')
        elif kind == "regex":
            regex = spec
        else:
            regex = _choice_regex(json.loads(spec))
        return self.oc.Index(regex, self.vocabulary)

    def new_state(self, grammar):
        return self.oc.Guide(grammar)

    def fill(self, states: list, bitmask: torch.Tensor) -> None:
        width = bitmask.shape[1]
        for i, guide in enumerate(states):  # no batched call
            row = bitmask[i]
            guide.write_mask_into(row.data_ptr(), width, 4)

    def advance(self, states: list, tokens: list[int]) -> None:
        for guide, t in zip(states, tokens, strict=True):
            guide.advance(t, return_tokens=False)


BACKENDS: list[type[Backend]] = [XGrammar, LLGuidance, OutlinesCore]


# ---- measurements ------------------------------------------------------------------------------


@dataclass
class WorkloadResult:
    workload: str
    compile_ms: float  # spec -> compiled grammar (median of repeats)
    first_mask_ms: float  # compile + first state + first mask
    doc_tokens: int
    step_us: dict[str, float] = field(default_factory=dict)  # "fill/B=1" etc: per step
    error: str = ""


@dataclass
class LibraryResult:
    library: str
    tokenizer: str
    setup_ms: float
    workloads: list[WorkloadResult] = field(default_factory=list)
    coverage: dict[str, str] = field(default_factory=dict)


def _ms(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def _replay(backend: Backend, grammar, tokens: list[int], batch: int, bitmask: torch.Tensor):
    """(fill µs, advance µs) per step, the mean over one replay of ``tokens`` by ``batch``
    fresh states."""
    states = [backend.new_state(grammar) for _ in range(batch)]
    fill_s = advance_s = 0.0
    for token in tokens:
        t0 = time.perf_counter()
        backend.fill(states, bitmask[:batch])
        t1 = time.perf_counter()
        word, bit = divmod(token, 32)
        if not (int(bitmask[0, word]) >> bit) & 1:
            raise AssertionError(f"the mask refused token {token} of a valid document")
        backend.advance(states, [token] * batch)
        fill_s += t1 - t0
        advance_s += time.perf_counter() - t1
    return fill_s / len(tokens) * 1e6, advance_s / len(tokens) * 1e6


def _setup_and_first_use(backend: Backend, tok: TokenizerCase) -> None:
    """The per-model cost: the library's tokenizer form plus whatever its first grammar builds
    lazily for the vocabulary (llguidance's token trie: seconds on 49k tokens)."""
    backend.setup(tok)
    bitmask = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    backend.fill([backend.new_state(backend.compile("regex", "[a-z]+"))], bitmask)


def measure(backend: Backend, tok: TokenizerCase, repeat: int) -> LibraryResult:
    setup_ms, _ = _ms(lambda: _setup_and_first_use(backend, tok), 1)
    result = LibraryResult(backend.name, tok.name, setup_ms)
    bitmask = torch.zeros(max(BATCH_SIZES), (tok.vocab_size + 31) // 32, dtype=torch.int32)
    for name, kind, spec, doc in WORKLOADS:
        tokens = tok.encode(doc)
        try:
            compile_ms, grammar = _ms(lambda k=kind, s=spec: backend.compile(k, s), repeat)

            def first_mask(k=kind, s=spec):
                backend.fill([backend.new_state(backend.compile(k, s))], bitmask[:1])

            first_ms, _ = _ms(first_mask, repeat)
            w = WorkloadResult(name, compile_ms, first_ms, len(tokens))
            for b in BATCH_SIZES:
                _replay(backend, grammar, tokens, b, bitmask)  # warm-up: lazily built caches
                runs = [_replay(backend, grammar, tokens, b, bitmask) for _ in range(repeat)]
                w.step_us[f"fill/B={b}"] = statistics.median(f for f, _ in runs)
                w.step_us[f"advance/B={b}"] = statistics.median(a for _, a in runs)
        except Exception as exc:  # a library that cannot do a workload says why in the table
            w = WorkloadResult(name, float("nan"), float("nan"), len(tokens), error=str(exc)[:120])
        result.workloads.append(w)
    result.coverage = coverage(backend, tok)
    return result


def _accepts(backend: Backend, grammar, tok: TokenizerCase, text: str) -> bool:
    """Whether ``text`` then EOS gets through the masks of a fresh state."""
    state = backend.new_state(grammar)
    bitmask = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    for token in [*tok.encode(text), tok.eos]:
        backend.fill([state], bitmask)
        word, bit = divmod(token, 32)
        if not (int(bitmask[0, word]) >> bit) & 1:
            return False
        if token != tok.eos:
            backend.advance([state], [token])
    return True


def coverage(backend: Backend, tok: TokenizerCase) -> dict[str, str]:
    """What the engine's tests rely on, as ok / MISSING (and why)."""
    person = backend.compile("json_schema", json.dumps(PERSON_SCHEMA))
    any_object = backend.compile("json_object", "")
    deep = '{"a":' * 8 + "1" + "}" * 8
    checks = {
        "integer maximum enforced": not _accepts(
            backend, person, tok, '{"name":"x","age":999,"role":"user"}'
        ),
        "maxLength enforced": not _accepts(
            backend, person, tok, '{"name":"abcdefghijklmnop","age":1,"role":"user"}'
        ),
        "json_object nests 8 deep": _accepts(backend, any_object, tok, deep),
    }
    out = {k: "ok" if v else "MISSING" for k, v in checks.items()}
    for label, kind, spec in [
        ("bad regex refused", "regex", "a(b"),
        ("unsupported keyword refused", "json_schema", '{"type":"object","if":{}}'),
    ]:
        try:
            backend.compile(kind, spec)
            out[label] = "MISSING (compiled)"
        except Exception:
            out[label] = "ok"
    return out


def _print(results: list[LibraryResult]) -> None:
    for r in results:
        print(f"\n== {r.library} on {r.tokenizer}: setup {r.setup_ms:.0f} ms")
        print(f"{'workload':16s} {'compile ms':>10s} {'1st mask ms':>11s} {'tok':>4s} "
              + " ".join(f"{k:>14s}" for k in r.workloads[0].step_us))  # fmt: skip
        for w in r.workloads:
            if w.error:
                print(f"{w.workload:16s} ERROR {w.error}")
                continue
            steps = " ".join(f"{v:14.1f}" for v in w.step_us.values())
            print(f"{w.workload:16s} {w.compile_ms:10.2f} {w.first_mask_ms:11.2f} "
                  f"{w.doc_tokens:4d} {steps}")  # fmt: skip
        print("coverage:", ", ".join(f"{k}: {v}" for k, v in r.coverage.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeat", type=int, default=3, help="compile timings: median of N")
    parser.add_argument("--libraries", nargs="*", default=[b.name for b in BACKENDS])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for tok in tokenizer_cases():
        for cls in BACKENDS:
            if cls.name in args.libraries:
                results.append(measure(cls(), tok, args.repeat))
    _print(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
