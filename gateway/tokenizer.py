"""Tokenizer of a local Hugging Face model directory, without transformers.

``tokenizer.json`` is loaded with the Rust ``tokenizers`` library. Special tokens (BOS/EOS) and
the chat template come from ``tokenizer_config.json``; EOS ids are the union of what
``generation_config.json``, ``config.json`` and the tokenizer config name, because instruct
models often end turns with a token (e.g. ``<|eot_id|>``) that only one of those files lists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    vocab_size: int
    eos_token_ids: list[int]
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelTokenizer:
        model_dir = Path(model_dir)
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")

        bos = _token_text(tok_cfg.get("bos_token"))
        eos = _token_text(tok_cfg.get("eos_token"))
        eos_ids: list[int] = []
        for candidate in (
            _ids(gen_cfg.get("eos_token_id")),
            _ids(model_cfg.get("eos_token_id")),
            [] if eos is None else [i for i in [tok.token_to_id(eos)] if i is not None],
        ):
            eos_ids.extend(i for i in candidate if i not in eos_ids)

        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = tok_cfg.get("chat_template")
            # Some models ship several named templates; the one called "default" is the chat one.
            if isinstance(template, list):
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
            if not isinstance(template, str):
                template = None

        # The embedding matrix may be larger than the tokenizer (padding); ids the model can
        # take are bounded by config.json's vocab_size when present.
        vocab_size = model_cfg.get("vocab_size")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
            vocab_size = tok.get_vocab_size(with_added_tokens=True)
        special = frozenset(
            i for i, added in tok.get_added_tokens_decoder().items() if added.special
        )
        return cls(
            tokenizer=tok,
            vocab_size=vocab_size,
            eos_token_ids=eos_ids,
            bos_token=bos,
            eos_token=eos,
            chat_template=template,
            special_ids=special,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
