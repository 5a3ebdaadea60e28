"""Incremental detokenizer and stop strings: streamed text must equal the full decode."""

from __future__ import annotations

import random

import pytest

from pdserve.gateway.response_choice import IncrementalDetokenizer, StopStringMatcher
from pdserve.gateway.tokenizer import ModelTokenizer
from tests.unit.gateway_fixtures import (
    CORPUS,
    train_byte_level,
    train_metaspace,
    write_model_dir,
)


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request, tmp_path_factory) -> ModelTokenizer:
    tok = train_byte_level() if request.param == "byte_level" else train_metaspace()
    return ModelTokenizer.from_dir(write_model_dir(tmp_path_factory.mktemp(request.param), tok))


def stream(tok: ModelTokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    pieces, i = [], 0
    for size in chunk_sizes:
        if i >= len(ids):
            break
        pieces.append(detok.add(ids[i : i + size]))
        i += size
    if i < len(ids):
        pieces.append(detok.add(ids[i:]))
    pieces.append(detok.finish())
    return pieces


@pytest.mark.parametrize("text", CORPUS)
def test_token_by_token_concatenates_to_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(pieces) == tokenizer.decode(ids)


def test_random_chunking_and_random_ids(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        sizes = [rng.randrange(1, 4) for _ in range(len(ids))]
        pieces = stream(tokenizer, ids, sizes)
        assert "".join(pieces) == tokenizer.decode(ids)


def test_multibyte_character_never_split(tmp_path):
    tok = ModelTokenizer.from_dir(write_model_dir(tmp_path, train_byte_level(vocab_size=260)))
    # A tiny vocabulary leaves these characters as several single-byte tokens each.
    text = "😀日本"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text), "test needs characters spread over several tokens"
    pieces = stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # Each non-empty piece is whole characters only: the emoji arrives in one piece.
    assert "😀" in [p for p in pieces if p]


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("The quick fox", add_special_tokens=False) + [eos]
    pieces = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(pieces) == tokenizer.decode(ids[:-1])


def test_invalid_bytes_released_once_a_character_follows(tmp_path):
    tok = ModelTokenizer.from_dir(write_model_dir(tmp_path, train_byte_level(vocab_size=260)))
    lead = tok.encode("😀", add_special_tokens=False)[0]  # a lone UTF-8 lead byte
    filler = tok.encode("a", add_special_tokens=False)[0]
    detok = IncrementalDetokenizer(tok)
    held = "".join(detok.add([lead]) for _ in range(3))
    assert held == "", "an incomplete character is held back"
    released = detok.add([filler])
    assert released.endswith("a") and "\ufffd" in released
    assert held + released + detok.finish() == tok.decode([lead] * 3 + [filler])


# ----------------------------------------------------------------------------- stop strings


def run_stops(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out, hit = "", False
    for chunk in chunks:
        text, hit = m.feed(chunk)
        out += text
        if hit:
            return out, True
    return out + m.flush(), False


def test_stop_across_chunks_is_held_and_cut():
    assert run_stops(["END"], ["abc E", "N", "D tail"]) == ("abc ", True)


def test_partial_match_released_when_it_diverges():
    m = StopStringMatcher(["END"])
    assert m.feed("abc EN") == ("abc ", False)
    assert m.feed("X") == ("ENX", False)


def test_earliest_stop_wins_and_no_match_flushes():
    assert run_stops(["zz", "b"], ["aazz b"]) == ("aa", True)
    assert run_stops(["STOP"], ["no S", "TO"]) == ("no STO", False)


@pytest.mark.parametrize("seed", range(20))
def test_stop_matches_full_text_semantics(seed):
    rng = random.Random(seed)
    alphabet = "ab\n"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(2)]
    cuts = sorted(rng.sample(range(1, 60), 8))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [60], strict=True)]
    positions = [text.find(s) for s in stops if s in text]
    expected = (text[: min(positions)], True) if positions else (text, False)
    assert run_stops(stops, chunks) == expected
