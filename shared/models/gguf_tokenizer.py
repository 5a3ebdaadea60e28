"""A ``tokenizers`` tokenizer (tokenizer.json) and tokenizer_config.json from a GGUF's vocabulary.

llama.cpp stores a byte-level BPE vocabulary as metadata: ``tokenizer.ggml.tokens`` (id order),
``.merges`` ("a b" strings, best first), ``.token_type`` (1 normal, 3 control, 4 user-defined),
the special ids, and ``.pre``, the name of the pre-tokenizer (how text is split before BPE). The
name matters: SmolLM splits digits one by one, Llama 3 keeps up to three digits together, GPT-2
keeps runs. Each supported name maps to the split the model was trained with, as llama.cpp
defines it; an unknown name is refused rather than silently split the GPT-2 way.

Only the ``gpt2`` tokenizer model (byte-level BPE) is supported: Llama/SmolLM/Qwen2 style files.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.shared.errors import ModelLoadError
from pdserve.shared.models.gguf_file import GGUFFile

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4

# Split patterns, as the models' own tokenizers define them.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# pre-tokenizer name -> (split regex or None for GPT-2's, digits one by one first)
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False),
    "gpt2": (None, False),
    "gpt-2": (None, False),
    "smollm": (None, True),
    "starcoder": (None, True),
    "refact": (None, True),
    "codeshell": (None, True),
    "llama-bpe": (_LLAMA3, False),
    "llama3": (_LLAMA3, False),
    "llama-v3": (_LLAMA3, False),
    "smaug-bpe": (_LLAMA3, False),
    "dbrx": (_LLAMA3, False),
    "qwen2": (_QWEN2, False),
    "deepseek-r1-qwen": (_QWEN2, False),
}


def build_tokenizer(f: GGUFFile):
    """The ``tokenizers.Tokenizer`` the file describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{f.path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2', "
            "as in Llama 3, SmolLM and Qwen2 files)"
        )
    tokens = _strings(f, "tokenizer.ggml.tokens")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = _strings(f, "tokenizer.ggml.merges")
    if len(types) != len(tokens):
        raise ModelLoadError(f"{f.path}: {len(types)} token types for {len(tokens)} tokens")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {_byte_level(tok, alphabet): i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise ModelLoadError(f"{f.path}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as exc:  # a merge naming a token that is not in the vocabulary
        raise ModelLoadError(f"{f.path}: inconsistent BPE vocabulary: {exc}") from None
    tok.pre_tokenizer = _pre_tokenizer(f)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) are matched whole and are special (skipped when decoding);
    # user-defined ones are matched whole but decoded as text. A control token spelled outside the
    # byte alphabet cannot be a byte-level token at all: llama.cpp mislabels a few, and adding one
    # would grow the vocabulary past the embedding, so it is left alone (as transformers does).
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind_ in zip(tokens, types, strict=True)
        if kind_ == CONTROL and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind_ in zip(tokens, types, strict=True)
        if kind_ == USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    _post_processor(f, tok, tokens)
    return tok


def tokenizer_config(f: GGUFFile) -> dict[str, Any]:
    """tokenizer_config.json: special token strings, BOS/EOS flags and the chat template."""
    tokens = _strings(f, "tokenizer.ggml.tokens")
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(f.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        i = f.integer(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= i < len(tokens):
            cfg[name] = tokens[i]
    template = f.get("tokenizer.chat_template")
    if isinstance(template, str):
        cfg["chat_template"] = template
    arch = f.get("general.architecture")
    context = f.integer(f"{arch}.context_length") if isinstance(arch, str) else None
    if context:
        cfg["model_max_length"] = context
    return cfg


def _strings(f: GGUFFile, key: str) -> list[str]:
    value = f.get(key)
    if key.endswith("merges") and value is None:
        raise ModelLoadError(f"{f.path}: missing metadata {key!r} (a BPE tokenizer needs merges)")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"{f.path}: missing or malformed metadata {key!r}")
    return value


def _byte_level(token: str, alphabet: set[str]) -> str:
    """Byte-level vocabularies spell every token in the 256-character byte alphabet; a few files
    store some tokens (user-defined ones) as raw text, which is respelled byte by byte."""
    if set(token) <= alphabet:
        return token
    from pdserve.shared.models.demo import bytes_to_unicode

    spelling = bytes_to_unicode()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _pre_tokenizer(f: GGUFFile):
    from tokenizers import Regex, pre_tokenizers

    name = f.get("tokenizer.ggml.pre")
    if name is None:
        # Files older than the key: llama.cpp splits them the GPT-2 way too.
        log.warning("%s: no tokenizer.ggml.pre; splitting text the GPT-2 way", f.path)
        name = "default"
    if name not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{f.path}: pre-tokenizer {name!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    regex, digits = PRE_TOKENIZERS[name]
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _post_processor(f: GGUFFile, tok, tokens: list[str]) -> None:
    """BOS/EOS added by ``encode(add_special_tokens=True)`` when the file asks for them."""
    from tokenizers import processors

    marks = []
    for flag, key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        i = f.integer(f"tokenizer.ggml.{key}")
        marks.append(tokens[i] if f.get(f"tokenizer.ggml.{flag}") and i is not None else None)
    bos, eos = marks
    if bos is None and eos is None:
        return

    def template(seq: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos, seq, eos) if t]

    single = " ".join(template("$A", 0))
    pair = " ".join(template("$A", 0) + template("$B", 1))
    ids = {t: tok.token_to_id(t) for t in (bos, eos) if t}
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(ids.items())
    )
