"""Fixtures of the HTTP tests that serve the real app against scripted workers: a model
directory the gateway loads (a byte-level BPE tokenizer trained on the spot, 300 tokens, a
Llama-like chat template, a 4096-token context), its variant whose template opens the reasoning
(``thinking_dir``), and its tokenizer. A module that needs another model defines its own
``model_dir``, which takes precedence."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import train_byte_level, write_model_dir

# A Qwen3.5-like template: the generation prompt opens the reasoning, or with
# enable_thinking false writes an empty one, closed; past answers show their reasoning.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{% if message.reasoning_content %}"
    "<think>{{ message.reasoning_content }}</think>{% endif %}{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / MODEL
    return write_model_dir(path, train_byte_level(300), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("thinking") / MODEL
    tok = train_byte_level(300)
    return write_model_dir(path, tok, template=THINKING_TEMPLATE, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids
