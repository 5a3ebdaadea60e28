"""--quantization int8 and --kv-cache-dtype on a real engine (issue 18): every linear is swapped,
the quantized engine runs and stays close to fp32, the layout fingerprint names the KV element
type and scale layout, and an unknown quantization refuses to start. The INT8 linear's error
bound and the option checks on their own are tests/unit/test_int8_quant.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.services.engine.quant.int8_linear import quantize_linears
from pdserve.shared.errors import StartupError
from pdserve.shared.sampling import SamplingParams
from tests.engine.test_spec_engine import GREEDY, NGRAM, repeating_prompts
from tests.engine_support import make_engine


def test_quantize_linears_swaps_every_linear_and_the_head(checkpoints) -> None:
    engine = make_engine(checkpoints["llama-mha-tied"], dtype="float32", quantization="int8")
    model = engine.runner.model
    kinds = {type(m).__name__ for m in model.modules()}
    assert "CpuInt8Linear" in kinds
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.embed_tokens, torch.nn.Embedding)  # the embedding stays float
    assert quantize_linears(model, torch.device("cpu"), torch.float32) == 0


@pytest.mark.parametrize(
    ("quantization", "kv"), [("int8", "auto"), ("none", "int8"), ("none", "fp8_e4m3")]
)
def test_quantized_engine_logits_stay_close_to_fp32(checkpoints, quantization, kv) -> None:
    model_dir = checkpoints["llama-gqa"]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = [[5, 17, 99, 3, 250, 11] * 5, [42] * 3]
    # small budget: prompts run in chunks, so later chunks read the (quantized) cache back
    kw = dict(dtype="float32", max_num_batched_tokens=16)
    base = make_engine(model_dir, **kw).generate(prompts, sp)
    quant = make_engine(model_dir, quantization=quantization, kv_cache_dtype=kv, **kw)
    out = quant.generate(prompts, sp)
    assert [len(o) for o in out] == [6, 6]
    same = sum(a == b for o, r in zip(out, base, strict=True) for a, b in zip(o, r, strict=True))
    assert same >= 9  # random tiny weights give near-ties; most greedy tokens still agree


def test_fingerprint_names_kv_dtype_and_scales(checkpoints) -> None:
    model_dir = checkpoints["llama-gqa"]
    plain = make_engine(model_dir, dtype="float32")
    int8 = make_engine(model_dir, dtype="float32", kv_cache_dtype="int8")
    assert plain.layout_fingerprint()["kv_dtype"] == "float32"
    assert int8.layout_fingerprint()["kv_dtype"] == "int8"
    assert int8.layout_fingerprint()["kv_scales"] != plain.layout_fingerprint()["kv_scales"]
    # one int8 byte per value plus a 4-byte scale per head_dim values, against 4 bytes each
    cfg = int8.model_config
    ratio = int8.bytes_per_block / plain.bytes_per_block
    assert ratio == pytest.approx((cfg.head_dim + 4) / (4 * cfg.head_dim))
    assert int8.kv_cache.dtype == torch.uint8 and int8.kv_cache.shape[0] == int8.num_blocks


def test_engine_start_refuses_unknown_quantization(checkpoints) -> None:
    with pytest.raises(StartupError, match="--quantization"):
        make_engine(checkpoints["llama-gqa"], quantization="int4")


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_forks_and_speculation_read_the_quantized_cache_exactly(checkpoints, kv) -> None:
    """n choices fork the prompt's last partial block (its values and scales copied as bytes),
    and speculative verification stores drafts and reads several positions back at once: greedy
    (float64 compute, no near-ties), both give the tokens a plain run over the same quantized
    cache gives."""
    model_dir = checkpoints["llama-gqa"]
    prompts = repeating_prompts(3, seed=5)
    plain = make_engine(model_dir, kv_cache_dtype=kv).generate(prompts, GREEDY)
    forked = make_engine(model_dir, kv_cache_dtype=kv)
    assert forked.generate_choices(prompts, replace(GREEDY, n=3)) == [[p] * 3 for p in plain]
    speculating = make_engine(model_dir, kv_cache_dtype=kv, **NGRAM)
    assert speculating.generate(prompts, GREEDY) == plain
    assert speculating.stats().spec.accepted_tokens > 0
