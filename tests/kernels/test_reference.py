"""The plain-torch twins against independent math: HF Llama modules and per-sequence float64."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pdserve.kernels import ops, reference
from tests.kernels.helpers import (
    assert_close,
    cu_seqlens,
    make_paged_kv,
    naive_attention,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@pytest.fixture(autouse=True)
def _force_reference(kernel_backend) -> None:
    kernel_backend("torch")


def edge_lens(block_size: int, seed: int, extra: int = 1) -> list[int]:
    """The lengths every paged kernel must get right, plus random ones up to 2k."""
    rng = random.Random(seed)
    return [1, block_size - 1, block_size, block_size + 1] + [
        rng.randint(2, 2048) for _ in range(extra)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_hf(dtype: torch.dtype, with_residual: bool) -> None:
    hidden, eps = 96, 1e-6
    x = torch.randn(7, hidden, dtype=dtype)
    res = torch.randn(7, hidden, dtype=dtype) if with_residual else None
    hf = LlamaRMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(hidden) + 0.5)
    expected_sum = x + res if res is not None else x
    with torch.no_grad():
        expected = hf(expected_sum)
    out, new_res = ops.rms_norm(x, hf.weight.detach(), eps, res)
    # Same ops in the same order as HF: bit-identical.
    assert torch.equal(out, expected)
    if with_residual:
        assert torch.equal(new_res, expected_sum)
    else:
        assert new_res is None


def test_rms_norm_float64_and_empty() -> None:
    x = torch.randn(5, 64, dtype=torch.float64)
    w = torch.rand(64, dtype=torch.float64)
    out, _ = ops.rms_norm(x, w, 1e-5)
    expected = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    assert_close(out, expected)
    empty, res = ops.rms_norm(x[:0], w, 1e-5, x[:0])
    assert empty.shape == (0, 64) and res.shape == (0, 64)


@pytest.mark.parametrize(
    "head_dim,rope_scaling",
    [(64, None), (128, LLAMA3_SCALING), (64, {"rope_type": "linear", "factor": 2.0})],
)
def test_rope_cache_and_rotary_match_hf(head_dim: int, rope_scaling: dict | None) -> None:
    base, max_pos, tokens = 500000.0, 4096, 33
    rope = {"rope_type": "default"} if rope_scaling is None else rope_scaling
    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        rope_parameters={**rope, "rope_theta": base},
    )
    hf_rope = LlamaRotaryEmbedding(cfg)
    positions = torch.randint(0, max_pos, (tokens,), dtype=torch.int64)
    q = torch.randn(tokens, 4, head_dim)
    k = torch.randn(tokens, 2, head_dim)
    cos, sin = hf_rope(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    cache = ops.build_rope_cache(head_dim, max_pos, base, rope_scaling, "cpu")
    assert cache.shape == (max_pos, head_dim) and cache.dtype == torch.float32
    # q and k as the engine has them: strided views into one fused qkv projection.
    qkv = torch.cat([q.flatten(1), k.flatten(1), torch.zeros(tokens, 2 * head_dim)], dim=1)
    q_view = qkv[:, : 4 * head_dim].view(tokens, 4, head_dim)
    k_view = qkv[:, 4 * head_dim : 6 * head_dim].view(tokens, 2, head_dim)
    ops.rotary_embedding(positions, q_view, k_view, cache)
    assert_close(q_view, q_hf[0].transpose(0, 1))
    assert_close(k_view, k_hf[0].transpose(0, 1))
    assert torch.all(qkv[:, 6 * head_dim :] == 0)


def test_rotary_bf16_rounds_once() -> None:
    cache = ops.build_rope_cache(128, 2048, 10000.0, None, "cpu")
    positions = torch.arange(0, 2048, 61)
    q = torch.randn(len(positions), 8, 128, dtype=torch.bfloat16)
    k = torch.randn(len(positions), 1, 128, dtype=torch.bfloat16)
    q64, k64 = q.double(), k.double()
    ops.rotary_embedding(positions, q64, k64, cache.double())
    ops.rotary_embedding(positions, q, k, cache)
    assert_close(q, q64, torch.bfloat16)
    assert_close(k, k64, torch.bfloat16)


def test_unknown_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="yarn"):
        ops.build_rope_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 4.0}, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_writes_only_its_layer_and_slots(dtype: torch.dtype) -> None:
    paged = make_paged_kv([40, 17], block_size=16, num_kv_heads=2, head_dim=64, dtype=dtype)
    before = paged.kv_cache.clone()
    slots = torch.cat([paged.slot_mapping(0, 30, 40), paged.slot_mapping(1, 0, 17)])
    slots[3] = -1  # a token whose K/V is already cached (prefix hit): must not be written
    key = torch.randn(len(slots), 2, 64, dtype=dtype)
    value = torch.randn(len(slots), 2, 64, dtype=dtype)
    ops.store_kvcache(key, value, paged.k_cache, paged.v_cache, slots)

    expected = before.clone()
    bs = paged.block_size
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // bs, paged.layer, 0, slot % bs] = key[t]
            expected[slot // bs, paged.layer, 1, slot % bs] = value[t]
    assert torch.equal(paged.kv_cache, expected)
    assert not torch.equal(paged.kv_cache, before)

    ops.store_kvcache(key[:0], value[:0], paged.k_cache, paged.v_cache, slots[:0])
    assert torch.equal(paged.kv_cache, expected)


def test_store_quantized_kvcache_skips_cached_slots() -> None:
    from pdserve.kernels.reference_quant import quantize_kv
    from pdserve.services.engine.quant.kv_cache import kv_cache_spec

    spec = kv_cache_spec("int8", torch.float32, 2, 4, 2, 8)
    storage = spec.allocate(6, torch.device("cpu"))
    values, scales = spec.split(storage)
    slots = torch.tensor([9, 2, -1, 21, 5])  # slot -1: a prefix hit, already cached
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    k, v, ks, vs = values[:, 1, 0], values[:, 1, 1], scales[:, 1, 0], scales[:, 1, 1]
    ops.store_kvcache(key, value, k, v, slots, ks, vs)

    written = slots >= 0
    qk, sk = quantize_kv(key[written], torch.int8)
    qv, sv = quantize_kv(value[written], torch.int8)
    rows = slots[written]
    flat = values[:, 1].transpose(0, 1).reshape(2, -1, 2, 8)  # [K/V, slots, heads, dim]
    flat_scales = scales[:, 1].transpose(0, 1).reshape(2, -1, 2)
    assert torch.equal(flat[0, rows], qk) and torch.equal(flat[1, rows], qv)
    assert torch.equal(flat_scales[0, rows], sk) and torch.equal(flat_scales[1, rows], sv)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[rows] = False
    assert not flat[:, untouched].any() and not flat_scales[:, untouched].any()
    assert not values[:, 0].any() and not scales[:, 0].any()  # the other layer


@pytest.mark.parametrize(
    "dtype,head_dim,num_q_heads,num_kv_heads,block_size",
    [
        (torch.float32, 64, 8, 8, 16),
        (torch.float32, 128, 8, 2, 32),
        (torch.float64, 64, 8, 1, 16),
        (torch.bfloat16, 128, 32, 8, 16),
    ],
)
def test_decode_attention_matches_naive(
    dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int, block_size: int
) -> None:
    lens = edge_lens(block_size, seed=head_dim + num_q_heads, extra=2)
    paged = make_paged_kv(lens, block_size, num_kv_heads, head_dim, dtype)
    # q as the engine has it: a strided view into the fused qkv projection.
    qkv = torch.randn(len(lens), num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    q = qkv[:, :num_q_heads]
    scale = 1 / math.sqrt(head_dim)
    out = ops.decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens(), scale
    )
    assert out.shape == q.shape and out.dtype == dtype
    for i, n in enumerate(lens):
        k, v = paged.sequence_kv(i)
        expected = naive_attention(q[i : i + 1], k, v, scale, q_offset=n - 1)
        assert_close(out[i : i + 1], expected, dtype)


def test_one_decode_plan_serves_every_layer() -> None:
    """The model plans once per step and reuses it in every layer: each layer's result must
    equal an unplanned call on that layer, whatever the batch order, with empty contexts too."""
    lens = [0, 7, 1, 40, 16, 33, 0, 90, 17, 2, 64, 5, 128, 3]  # more sequences than groups
    paged = make_paged_kv(lens, 16, 2, 32, torch.float32, num_layers=3)
    q = torch.randn(len(lens), 4, 32)
    tables, ctx = paged.block_tables, paged.context_lens()
    plan = ops.decode_plan(tables, ctx)
    assert isinstance(plan, reference.DecodePlan)
    for layer in range(3):
        k_cache, v_cache = paged.kv_cache[:, layer, 0], paged.kv_cache[:, layer, 1]
        planned = ops.decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, plan)
        alone = ops.decode_attention(q, k_cache, v_cache, tables, ctx, 0.2)
        assert torch.equal(planned, alone)
        assert (planned[[0, 6]] == 0).all()  # nothing to attend: zeros, not NaN
        for i, n in enumerate(lens):
            if n:
                k = k_cache[tables[i, : -(-n // 16)].long()].reshape(-1, 2, 32)[:n]
                v = v_cache[tables[i, : -(-n // 16)].long()].reshape(-1, 2, 32)[:n]
                expected = naive_attention(q[i : i + 1], k, v, 0.2, q_offset=n - 1)
                assert_close(planned[i : i + 1], expected, torch.float32)
    # a plan follows the cache it meets: another cache layout (rows per block) is re-planned
    other = make_paged_kv(lens, 16, 2, 32, torch.float32, num_layers=1, layer=0, spare_blocks=9)
    k_cache, v_cache = other.k_cache, other.v_cache
    planned = ops.decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, plan)
    assert torch.equal(planned, ops.decode_attention(q, k_cache, v_cache, tables, ctx, 0.2))


def test_decode_attention_empty_batch() -> None:
    paged = make_paged_kv([5], 16, 2, 64, torch.float32)
    q = torch.randn(0, 4, 64)
    out = ops.decode_attention(
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables[:0],
        paged.context_lens()[:0],
        0.125,
    )
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize(
    "dtype,head_dim,num_q_heads,num_kv_heads",
    [
        (torch.float32, 64, 4, 4),
        (torch.float32, 128, 8, 2),
        (torch.float64, 64, 8, 1),
        (torch.bfloat16, 64, 8, 2),
    ],
)
def test_prefill_attention_packed_matches_naive(
    dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int
) -> None:
    lens = edge_lens(16, seed=head_dim, extra=1)
    total = sum(lens)
    q = torch.randn(total, num_q_heads, head_dim, dtype=dtype)
    k = torch.randn(total, num_kv_heads, head_dim, dtype=dtype)
    v = torch.randn(total, num_kv_heads, head_dim, dtype=dtype)
    cu = cu_seqlens(lens)
    scale = 1 / math.sqrt(head_dim)
    out = ops.prefill_attention(q, k, v, cu, cu, max(lens), max(lens), scale)
    assert out.shape == q.shape and out.dtype == dtype
    for i in range(len(lens)):
        s, e = int(cu[i]), int(cu[i + 1])
        expected = naive_attention(q[s:e], k[s:e], v[s:e], scale, q_offset=0)
        assert_close(out[s:e], expected, dtype)


@pytest.mark.parametrize(
    "dtype,head_dim,num_q_heads,num_kv_heads,block_size",
    [
        (torch.float32, 64, 8, 1, 16),
        (torch.float32, 128, 4, 4, 32),
        (torch.bfloat16, 128, 8, 2, 16),
    ],
)
def test_prefill_attention_with_cached_prefix(
    dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int, block_size: int
) -> None:
    # (cached prefix, new tokens): prefix hits on block edges, a 1-token chunk, no prefix at all.
    shapes = [
        (0, 5),
        (block_size, 1),
        (block_size - 1, block_size + 1),
        (2 * block_size, block_size),
        (300, 77),
    ]
    new = [n for _, n in shapes]
    k_lens = [p + n for p, n in shapes]
    paged = make_paged_kv(k_lens, block_size, num_kv_heads, head_dim, dtype, pad_value=0)
    q = torch.randn(sum(new), num_q_heads, head_dim, dtype=dtype)
    k = torch.randn(sum(new), num_kv_heads, head_dim, dtype=dtype)
    v = torch.randn(sum(new), num_kv_heads, head_dim, dtype=dtype)
    slots = torch.cat([paged.slot_mapping(i, p, p + n) for i, (p, n) in enumerate(shapes)])
    ops.store_kvcache(k, v, paged.k_cache, paged.v_cache, slots)
    cu_q, cu_k = cu_seqlens(new), cu_seqlens(k_lens)
    scale = 1 / math.sqrt(head_dim)
    out = ops.prefill_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(new),
        max(k_lens),
        scale,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
    )
    for i, (p, _) in enumerate(shapes):
        s, e = int(cu_q[i]), int(cu_q[i + 1])
        k_all, v_all = paged.sequence_kv(i)
        assert torch.equal(k_all[p:], k[s:e])
        expected = naive_attention(q[s:e], k_all, v_all, scale, q_offset=p)
        assert_close(out[s:e], expected, dtype)


def test_prefill_attention_empty_batch() -> None:
    q = torch.randn(0, 4, 64)
    k = torch.randn(0, 2, 64)
    cu = torch.zeros(1, dtype=torch.int32)
    out = ops.prefill_attention(q, k, k, cu, cu, 0, 0, 0.125)
    assert out.shape == (0, 4, 64)


def test_dispatch_auto_uses_reference_on_cpu(kernel_backend) -> None:
    kernel_backend("auto")
    assert ops.backend_for(torch.zeros(1)) == "torch"
    kernel_backend("triton")
    assert ops.backend_for(torch.zeros(1)) == "triton"
    with pytest.raises(ValueError, match="PDSERVE_KERNELS"):
        kernel_backend("cuda-please")
    assert ops.backend_for(torch.zeros(1)) == "triton"  # a bad value changes nothing
    assert reference.rms_norm is not None
