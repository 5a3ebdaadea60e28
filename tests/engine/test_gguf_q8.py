"""GGUF Q8_0 straight into INT8 (issue 18): the converter keeps a linear layer's Q8_0 matrix as its
int8 values and float16 block scales; a float model dequantizes them bit for bit as the old
converter did; the INT8 weight-only path builds its layers from exactly the file's bytes (Q/K rows
un-permuted, fused rows concatenated) and never asks for a float copy, and its logits equal the
float model's."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdserve.services.engine import loader, model_setup
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.quant.int8_linear import CpuInt8Linear, WeightOnlyInt8Linear
from pdserve.shared.models.gguf_file import GGUFFile
from pdserve.shared.models.gguf_weights import dequantized, unpermute_rows
from pdserve.shared.models.resolve import resolve
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import first_step_logits, make_engine, random_prompts
from tests.gguf_files import gguf_name, permute_rows, write_gguf

VARIANTS = ["llama-gqa", "llama-mha-tied", "qwen2-bias"]
FUSED = {
    "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "self_attn.o_proj": ["self_attn.o_proj"],
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.down_proj": ["mlp.down_proj"],
}


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """Converted here, so a cache entry of an older build of this converter is never what is
    tested (entries are keyed by the file and CONVERTER_VERSION only)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def q8_files(tmp_path_factory, checkpoints) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("q8")
    return {v: write_gguf(checkpoints[v], out / f"{v}-Q8_0.gguf", "Q8_0") for v in VARIANTS}


def file_blocks(f: GGUFFile, hf: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The GGUF's own int8 values and float16 scales of ``hf``, read straight from its 34-byte
    blocks, in the file's (permuted) row order."""
    t = f.tensors[gguf_name(hf)]
    assert t.type_name == "Q8_0"
    rows, cols = t.shape
    blocks = np.asarray(t.raw).reshape(rows, cols // 32, 34)
    scales = blocks[..., :2].copy().view(np.float16).reshape(rows, cols // 32)
    values = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(values), torch.from_numpy(scales)


def stored(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def heads_of(cfg: ModelConfig, module: str) -> int | None:
    if cfg.model_type != "llama":
        return None
    return {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(module.rsplit(".", 1)[-1])


def in_hf_order(f: GGUFFile, cfg: ModelConfig, hf_module: str) -> tuple[torch.Tensor, ...]:
    """The file's blocks of one layer in HF's row order: llama.cpp's Q/K permutation undone by
    checking against the tests' own forward permutation (not the converter's inverse)."""
    values, scales = file_blocks(f, f"{hf_module}.weight")
    heads = heads_of(cfg, hf_module)
    if heads is None:
        return values, scales
    order = torch.from_numpy(permute_rows(np.arange(values.shape[0]), heads))
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order))
    return values[back], scales[back]


def hf_modules(cfg: ModelConfig, i: int, ours: str) -> list[str]:
    return [f"model.layers.{i}.{m}" for m in FUSED[ours]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_converter_keeps_the_q8_0_blocks(q8_files, variant) -> None:
    model_dir = resolve(str(q8_files[variant])).path
    cfg = ModelConfig.from_dir(model_dir)
    f = GGUFFile(q8_files[variant])
    tensors = stored(model_dir)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32  # a lookup: expanded
    for i in range(cfg.num_layers):
        for ours in FUSED:
            for hf in hf_modules(cfg, i, ours):
                assert f"{hf}.weight" not in tensors
                values, scales = in_hf_order(f, cfg, hf)
                assert tensors[f"{hf}.q8_0_values"].dtype == torch.int8
                assert torch.equal(tensors[f"{hf}.q8_0_values"], values), hf
                assert torch.equal(
                    tensors[f"{hf}.q8_0_scales"].view(torch.int16), scales.view(torch.int16)
                ), hf
    assert ("lm_head.q8_0_values" in tensors) == (not cfg.tie_word_embeddings)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float_load_is_bit_identical_to_the_old_converter(q8_files, variant) -> None:
    """--quantization none: every weight is what ``gguf.quants.dequantize`` gave (the old
    converter wrote exactly that, in float32)."""
    path = q8_files[variant]
    model_dir = resolve(str(path)).path
    cfg = ModelConfig.from_dir(model_dir)
    f = GGUFFile(path)
    files = loader.CheckpointFiles(model_dir)
    model = loader.load_model(model_dir, cfg, torch.device("cpu"), torch.float32)
    params = dict(model.named_parameters())
    for ours, sources in loader._hf_sources(cfg).items():
        old = []
        for hf in sources:
            t = f.tensors[gguf_name(hf)]
            w = dequantized(t)
            heads = heads_of(cfg, hf.removesuffix(".weight").removesuffix(".bias"))
            w = w if heads is None else unpermute_rows(w, heads)
            old.append(torch.from_numpy(np.array(w, dtype=np.float32)))
            assert torch.equal(files.get(hf), old[-1]), hf
        assert torch.equal(params[ours], torch.cat(old)), ours


@pytest.mark.parametrize("variant", VARIANTS)
def test_weight_only_int8_holds_the_gguf_bytes(q8_files, variant, monkeypatch) -> None:
    path = q8_files[variant]
    model_dir = resolve(str(path)).path
    cfg = ModelConfig.from_dir(model_dir)
    f = GGUFFile(path)
    asked: list[str] = []
    real_get = loader.CheckpointFiles.get

    def spy(self, name):
        asked.append(name)
        return real_get(self, name)

    monkeypatch.setattr(loader.CheckpointFiles, "get", spy)
    model = loader.load_model(
        model_dir, cfg, torch.device("cpu"), torch.float32, "int8", weight_only=True
    )
    # no linear weight was ever expanded to float (the tied head reads the float embedding)
    assert not [n for n in asked if n.endswith("_proj.weight") or n == "lm_head.weight"]
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    for i, layer in enumerate(model.layers):
        for ours in FUSED:
            module = layer.get_submodule(ours)
            assert isinstance(module, WeightOnlyInt8Linear) and module.group_size == 32
            blocks = [in_hf_order(f, cfg, hf) for hf in hf_modules(cfg, i, ours)]
            assert torch.equal(module.qweight, torch.cat([v for v, _ in blocks])), ours
            assert module.scale.dtype == torch.float16
            assert torch.equal(
                module.scale.view(torch.int16), torch.cat([s for _, s in blocks]).view(torch.int16)
            ), ours
    head = model.lm_head
    assert isinstance(head, WeightOnlyInt8Linear) and head.group_size == 32
    # untied: the file's output.weight; tied: regrouped from the float embedding, which gives the
    # embedding's own Q8_0 blocks back exactly
    values, scales = file_blocks(
        f, "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    )
    assert torch.equal(head.qweight, values)
    assert torch.equal(head.scale.float(), scales.float())
    if cfg.qkv_bias:
        bias = torch.cat(
            [
                real_get(
                    loader.CheckpointFiles(model_dir), f"model.layers.0.self_attn.{p}_proj.bias"
                )
                for p in "qkv"
            ]
        )
        assert torch.equal(model.layers[0].self_attn.qkv_proj.bias, bias)


@pytest.mark.parametrize("variant", VARIANTS)
def test_weight_only_logits_equal_the_float_model(q8_files, variant, monkeypatch) -> None:
    path = str(q8_files[variant])
    prompts = random_prompts(4, seed=7)
    float_logits = first_step_logits(make_engine(path, dtype="float32"), prompts, monkeypatch)
    weight_only = functools.partial(loader.load_model, weight_only=True)
    monkeypatch.setattr(model_setup, "load_model", weight_only)
    engine = make_engine(path, dtype="float32", quantization="int8")
    assert isinstance(engine.runner.model.layers[0].mlp.down_proj, WeightOnlyInt8Linear)
    int8_logits = first_step_logits(engine, prompts, monkeypatch)
    # same exact weights, only the order of the float32 sums differs
    torch.testing.assert_close(int8_logits, float_logits, atol=2e-5, rtol=1e-5)


def test_cpu_w8a8_path_still_takes_the_float_route(q8_files) -> None:
    """fbgemm needs one scale per output channel (and smoothing, the float weight): a Q8_0
    directory is dequantized, smoothed and rounded per channel there, as any checkpoint is."""
    engine = make_engine(q8_files["llama-gqa"], dtype="float32", quantization="int8")
    model = engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, CpuInt8Linear)
    assert isinstance(model.lm_head, CpuInt8Linear)
    out = engine.generate(random_prompts(2, seed=1), SamplingParams(temperature=0.0, max_tokens=4))
    assert [len(o) for o in out] == [4, 4]
