"""GGUF loading against HF transformers loading the same file.

Small GGUFs are written with ``gguf.GGUFWriter`` from the tiny test checkpoints (tests/gguf_files.py)
in F32, F16, Q8_0 and Q4_0, plus every other supported type on a 256-wide model. The oracle is
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``: same weights bit for bit, logits
close, greedy tokens identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.services.engine.loader import CheckpointFiles
from pdserve.shared.models.resolve import resolve
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import first_step_logits, make_engine, random_prompts
from tests.gguf_files import tiny_llama_256, write_gguf
from tests.oracle import hf_greedy

MAIN_TYPES = ["F32", "F16", "Q8_0", "Q4_0"]
OTHER_TYPES = ["BF16", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory, checkpoints) -> Path:
    """One directory of GGUF files (HF's loader wants a directory and a file name)."""
    out = tmp_path_factory.mktemp("gguf")
    for variant in ("llama-gqa", "llama-mha-tied", "qwen2-bias"):
        write_gguf(checkpoints[variant], out / f"{variant}-F32.gguf", "F32")
    for qtype in MAIN_TYPES[1:]:
        write_gguf(checkpoints["llama-gqa"], out / f"llama-gqa-{qtype}.gguf", qtype)
    wide = tiny_llama_256(out / "wide-ckpt")
    for qtype in OTHER_TYPES:
        write_gguf(wide, out / f"wide-{qtype}.gguf", qtype)
    return out


def hf_from_gguf(path: Path, dtype: torch.dtype = torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()


def hf_greedy_gguf(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    hf = hf_from_gguf(path, torch.float64)
    outs = []
    with torch.no_grad():
        for p in prompts:
            out: list[int] = []
            for _ in range(n):
                logits = hf(input_ids=torch.tensor([p + out]), use_cache=False).logits
                out.append(int(logits[0, -1].argmax()))
            outs.append(out)
    return outs


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mha-tied", "qwen2-bias"])
def test_f32_gguf_restores_the_checkpoint_exactly(gguf_dir, checkpoints, variant) -> None:
    """llama.cpp's Q/K row permutation is undone exactly (Qwen2 files have none); tied heads and
    Llama 3 rope scaling, which a GGUF keeps only as a rope_freqs tensor, come back too."""
    resolved = resolve(str(gguf_dir / f"{variant}-F32.gguf"))
    assert resolved.name == f"{variant}-F32" and resolved.kind == "gguf"
    ours = load_file(str(resolved.path / "model.safetensors"))
    original = load_file(str(checkpoints[variant] / "model.safetensors"))
    if "tied" in variant:
        original.pop("lm_head.weight", None)
    assert set(ours) == set(original)
    for name, value in original.items():
        assert torch.equal(ours[name], value), name
    cfg = json.loads((resolved.path / "config.json").read_text())
    hf_cfg = json.loads((checkpoints[variant] / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == hf_cfg.get("tie_word_embeddings", False)
    if variant == "llama-mha-tied":
        scaling = dict(hf_cfg["rope_parameters"])
        scaling.pop("rope_theta")
        assert cfg["rope_scaling"] == scaling
        # greedy output equals HF on the original checkpoint (HF's own GGUF loader drops the
        # rope_freqs tensor, so it is not the oracle here)
        prompts = random_prompts(3, seed=4)
        engine = make_engine(resolved.path)
        assert engine.generate(prompts, GREEDY) == hf_greedy(checkpoints[variant], prompts, 8)


@pytest.mark.parametrize("qtype", MAIN_TYPES)
def test_gguf_matches_hf_loading_the_same_file(gguf_dir, qtype, monkeypatch) -> None:
    path = gguf_dir / f"llama-gqa-{qtype}.gguf"
    resolved = resolve(str(path))
    hf = hf_from_gguf(path)
    files = CheckpointFiles(resolved.path)  # Q8_0 matrices are stored as int8 + scales
    ours = {name: files.get(name) for name in files.names()}
    hf_weights = hf.state_dict()
    for name, value in ours.items():  # same dequantization, same permutation: same bits
        assert torch.equal(value.float(), hf_weights[name]), name

    prompts = random_prompts(4, seed=2)
    engine = make_engine(resolved.path, dtype="float32")
    logits = first_step_logits(engine, prompts, monkeypatch)
    with torch.no_grad():
        expected = torch.stack(
            [hf(input_ids=torch.tensor([p]), use_cache=False).logits[0, -1] for p in prompts]
        )
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    engine64 = make_engine(resolved.path)  # float64: greedy ties cannot flip
    assert engine64.generate(prompts, GREEDY) == hf_greedy_gguf(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("qtype", OTHER_TYPES)
def test_every_supported_type_dequantizes_like_hf(gguf_dir, qtype) -> None:
    path = gguf_dir / f"wide-{qtype}.gguf"
    ours = load_file(str(resolve(str(path)).path / "model.safetensors"))
    hf_weights = hf_from_gguf(path).state_dict()
    for name, value in ours.items():
        assert torch.equal(value.float(), hf_weights[name]), name
    assert all(torch.isfinite(v).all() for v in ours.values())


def test_tokenizer_and_template_match_hf(gguf_dir, checkpoints) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from pdserve.gateway.tokenizer import ModelTokenizer

    path = gguf_dir / "llama-gqa-F32.gguf"
    ours = ModelTokenizer.from_dir(resolve(str(path)).path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    original = Tokenizer.from_file(str(checkpoints["llama-gqa"] / "tokenizer.json"))
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "naïve café déjà vu — 日本語のテキスト 🚀 emoji",
        "def add(a, b):\n    return a + b\n",
        "  two  spaces\n\n\nand 12345 digits",
        "<|user|>hi</s><|assistant|>",
        "",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"] == original.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.chat_template == hf.chat_template
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    assert ours.eos_token_ids == [1]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_tokenizers_and_bos_match_hf(tmp_path, checkpoints, pre) -> None:
    """Llama 3's and Qwen2's splits (digits in threes, one by one) and a file that asks for BOS."""
    from transformers import AutoTokenizer

    from pdserve.gateway.tokenizer import ModelTokenizer

    path = write_gguf(
        checkpoints["llama-gqa"], tmp_path / f"{pre}.gguf", "F16", pre=pre, add_bos=True
    )
    ours = ModelTokenizer.from_dir(resolve(str(path)).path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["1234567 and 89", "  spaced   out\n\n 42\t7", "naïve 日本語 🚀", "it's 'll 'VE", ""]
    for text in texts:
        ids = ours.encode(text)
        assert ids[0] == 0  # <s>
        assert ids == hf(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == ids[1:]
