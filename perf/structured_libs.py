"""The structured-output libraries that perf/structured_bench.py compares, behind one interface
(compile a spec, make a state, fill a batch's bitmask, advance states), and the tokenizers it
runs them on, in the form each library takes."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

# ---- tokenizers --------------------------------------------------------------------------------
from pdserve.shared.models.demo import bytes_to_unicode


@dataclass
class TokenizerCase:
    name: str
    tokenizer_json: str
    vocab_size: int
    eos: int
    encode: Callable[[str], list[int]]
    byte_vocab: dict[bytes, list[int]]  # non-special tokens as the bytes they decode to


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table (the ByteLevel pre-tokenizer's), inverted."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


def load_tokenizer(name: str, tokenizer, eos: int) -> TokenizerCase:
    decoder = _byte_level_decoder()
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    byte_vocab: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token not in specials:
            byte_vocab.setdefault(bytes(decoder[c] for c in token), []).append(token_id)
    return TokenizerCase(
        name,
        tokenizer.to_str(),
        tokenizer.get_vocab_size(),
        eos,
        lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
        byte_vocab,
    )


def tokenizer_cases() -> list[TokenizerCase]:
    from tokenizers import Tokenizer

    from pdserve.services.engine.model_config import ModelConfig
    from pdserve.shared.models.resolve import resolve
    from tests.checkpoints import train_tokenizer

    model_dir = resolve("smollm2-135m-instruct").path
    smol = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = ModelConfig.from_dir(model_dir).eos_token_ids[0]
    return [load_tokenizer("smollm2", smol, eos), load_tokenizer("tiny", train_tokenizer(), 1)]


# ---- the libraries behind one interface ---------------------------------------------------------


class Backend:
    name = module = install = ""

    def setup(self, tok: TokenizerCase) -> None: ...
    def compile(self, kind: str, spec: str): ...
    def new_state(self, grammar): ...
    def fill(self, states: list, bitmask: torch.Tensor, batched: bool = True) -> None:
        """The next-token masks of ``states`` into rows 0.. of ``bitmask``: through the
        library's batched call when ``batched`` (and it has one), else one row at a time."""

    def advance(self, states: list, tokens: list[int]) -> None: ...


def _choice_regex(choices: list[str]) -> str:
    """Alternation of literals, escaping every character a regex engine could read as syntax."""
    return (
        "("
        + "|".join(
            "".join("\\" + c if c in r"\.+*?()|[]{}^$-&~#" else c for c in ch) for ch in choices
        )
        + ")"
    )


class LLGuidance(Backend):
    name, module, install = "llguidance", "llguidance", "make setup"

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

    def fill(self, states: list, bitmask: torch.Tensor, batched: bool = True) -> None:
        # Not through llguidance.torch: its import costs ~4 s (torch.compile).
        width = bitmask.shape[1] * 4
        if batched and len(states) > 1:
            rows = [(m, i) for i, m in enumerate(states)]
            self.executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), width, len(bitmask))
        else:  # one row: the thread pool's hand-off costs more than the mask
            for i, m in enumerate(states):
                m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), width)

    def advance(self, states: list, tokens: list[int]) -> None:
        for m, t in zip(states, tokens, strict=True):
            if not m.consume_token(t):
                raise AssertionError(m.get_error())


class XGrammar(Backend):
    # --no-deps: its declared dependencies (torch, transformers, triton) are here already, and
    # pip could otherwise replace the torch build; apache-tvm-ffi is its one other need.
    name, module, install = "xgrammar", "xgrammar", "pip install --no-deps xgrammar apache-tvm-ffi"

    def setup(self, tok: TokenizerCase) -> None:
        import xgrammar  # pyright: ignore[reportMissingImports]

        self.xgr = xgrammar
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tok.tokenizer_json)
        vocab = [""] * tok.vocab_size
        for token, token_id in json.loads(tok.tokenizer_json)["model"]["vocab"].items():
            vocab[token_id] = token
        for added in json.loads(tok.tokenizer_json)["added_tokens"]:
            vocab[added["id"]] = added["content"]
        info = xgrammar.TokenizerInfo(
            vocab,
            meta["vocab_type"],
            vocab_size=tok.vocab_size,
            stop_token_ids=[tok.eos],
            add_prefix_space=meta["add_prefix_space"],
        )
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

    def fill(self, states: list, bitmask: torch.Tensor, batched: bool = True) -> None:
        if batched and len(states) > 1:
            self.batch.batch_fill_next_token_bitmask(states, bitmask)
        else:  # one row: the thread pool's hand-off costs more than the mask
            for i, m in enumerate(states):
                m.fill_next_token_bitmask(bitmask, i)

    def advance(self, states: list, tokens: list[int]) -> None:
        if not all(self.batch.batch_accept_token(states, tokens)):
            raise AssertionError("xgrammar refused a valid token")


class OutlinesCore(Backend):
    name, module, install = "outlines-core", "outlines_core", "pip install outlines-core"

    def setup(self, tok: TokenizerCase) -> None:
        import outlines_core  # pyright: ignore[reportMissingImports]

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

    def fill(self, states: list, bitmask: torch.Tensor, batched: bool = True) -> None:
        width = bitmask.shape[1]
        for i, guide in enumerate(states):  # no batched call
            row = bitmask[i]
            guide.write_mask_into(row.data_ptr(), width, 4)

    def advance(self, states: list, tokens: list[int]) -> None:
        for guide, t in zip(states, tokens, strict=True):
            guide.advance(t, return_tokens=False)


BACKENDS: list[type[Backend]] = [XGrammar, LLGuidance, OutlinesCore]
