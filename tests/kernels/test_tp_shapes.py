"""The Triton kernels at the per-rank shapes of tensor parallelism, against their torch twins.

A rank of a TP-N worker attends over its shard of the heads: num_heads / N query heads and
num_kv_heads / N KV heads, or one replicated KV head once N exceeds the KV heads
(shared/kv/tp_layout.py). Its column-parallel linears see N_out / N output channels and its
row-parallel ones K / N input channels. These shapes are unusual (3 query heads over 1 KV head,
one query head alone, head dim 16 of the test models, K = 192 or 24), so each kernel runs at
them here, and a sharded decode step is checked to compose to the unsharded one.

Inputs, oracles and bounds are the other kernel tests' (imported, not copied). CI: CPU, fp32,
Triton interpreter; lengths and block counts are kept small so the file stays quick there.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import ops, reference
from pdserve.kernels.reference_quant import int8_linear
from pdserve.kernels.triton_cache import store_kvcache
from pdserve.kernels.triton_decode import DecodeConfig, decode_attention_with
from pdserve.kernels.triton_prefill import PrefillConfig, prefill_attention, prefill_attention_with
from pdserve.kernels.triton_rotary import rotary_embedding
from pdserve.services.engine.quant.int8_weights import quantize_per_channel
from pdserve.services.engine.quant.kv_cache import kv_cache_spec
from pdserve.shared.kv.tp_layout import head_range, kv_head_range, tp_problem
from tests.kernels.helpers import TEST_DEVICE, TEST_DTYPE, assert_close, cu_seqlens, make_paged_kv
from tests.kernels.test_int8_group import TOL, q8_0_like, triton_and_twin
from tests.kernels.test_kv_quant_triton import QuantizedPagedKV, _interpreter_casts_fp8
from tests.kernels.test_triton_kernels import _decode_oracle, f64, randn, uses_dot
from tests.kernels.test_verify_attention import mixed_shapes, verify_batch

DEV = TEST_DEVICE
DT = TEST_DTYPE
BLOCK = 16

# model -> its (query heads, kv heads, head dim); rank_heads gives one TP rank's share
MODELS = {
    "smollm2": (9, 3, 64),  # SmolLM2-135M
    "llama8x4": (8, 4, 16),  # a tiny Llama, the test checkpoints' head dim
    "llama4x2": (4, 2, 64),  # tests/gguf_files.py's
}
SHARDS = [("smollm2", 1), ("smollm2", 3), ("llama8x4", 2), ("llama8x4", 4), ("llama4x2", 4)]


def rank_heads(model: str, tp: int) -> tuple[int, int, int]:
    heads, kv_heads, head_dim = MODELS[model]
    assert tp_problem(heads, kv_heads, tp) is None
    lo, hi = head_range(heads, tp, 0)
    kv_lo, kv_hi = kv_head_range(kv_heads, tp, 0)
    return hi - lo, kv_hi - kv_lo, head_dim


# smollm2-tp1 9/3 (GQA 3), smollm2-tp3 3/1, llama8x4-tp2 4/2, llama8x4-tp4 2/1, llama4x2-tp4 1/1
RANKS = [pytest.param(*rank_heads(m, tp), id=f"{m}-tp{tp}") for m, tp in SHARDS]
RANK_KV = [pytest.param(1, 64, id="kv1-d64"), pytest.param(3, 64, id="kv3-d64")]
RANK_KV += [pytest.param(2, 16, id="kv2-d16"), pytest.param(1, 16, id="kv1-d16")]
KV_DTYPES = ["int8", "fp8_e4m3"]


# ---- rotary and the KV store ------------------------------------------------------------------


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", RANKS)
def test_rotary_on_a_ranks_heads(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    tokens = 7
    cache = ops.build_rope_cache(head_dim, 512, 10000.0, None, DEV)
    positions = torch.randint(0, 512, (tokens,), device=DEV)
    # q and k as strided views of the rank's fused qkv projection
    qkv = randn(tokens, num_q_heads + 2 * num_kv_heads, head_dim)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    q64, k64, v_before = f64(q), f64(k), v.clone()
    rotary_embedding(positions, q, k, cache)
    reference.rotary_embedding(f64(positions), q64, k64, f64(cache))
    assert_close(q, q64, DT)
    assert_close(k, k64, DT)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("num_kv_heads,head_dim", RANK_KV)
def test_store_kvcache_of_a_ranks_kv_heads(num_kv_heads: int, head_dim: int) -> None:
    lens = [BLOCK + 1, BLOCK - 1, 1]
    paged = make_paged_kv(lens, BLOCK, num_kv_heads, head_dim, DT, device=DEV)
    twin = make_paged_kv(lens, BLOCK, num_kv_heads, head_dim, DT, device=DEV)
    slots = torch.cat([paged.slot_mapping(i, 0, n) for i, n in enumerate(lens)])
    slots[[0, BLOCK]] = -1  # prefix hits: skipped
    qkv = randn(len(slots), 3 * num_kv_heads, head_dim)  # k and v as views of a fused qkv
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    store_kvcache(key, value, paged.k_cache, paged.v_cache, slots)
    reference.store_kvcache(key, value, twin.k_cache, twin.v_cache, slots)
    assert torch.equal(paged.kv_cache, twin.kv_cache)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", RANK_KV)
def test_quantized_store_of_a_ranks_kv_heads(
    kernel_backend, kv_dtype: str, num_kv_heads: int, head_dim: int
) -> None:
    _interpreter_casts_fp8(kv_dtype)
    spec = kv_cache_spec(kv_dtype, DT, 2, BLOCK, num_kv_heads, head_dim)
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    tokens = 6
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    k *= torch.logspace(-3, 2, tokens)[:, None, None]
    k[0, -1] = 0  # an all-zero vector: the scale clamps
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    k, v = k.to(DEV, DT), v.to(DEV, DT)
    slots = torch.tensor([0, 17, -1, 5, 33, 47], device=DEV)  # -1: a prefix hit
    got, expected = spec.allocate(4, DEV), spec.allocate(4, DEV)
    for backend, storage in (("triton", got), ("torch", expected)):
        kernel_backend(backend)
        values, scales = spec.split(storage)
        ops.store_kvcache(
            k, v, values[:, 1, 0], values[:, 1, 1], slots, scales[:, 1, 0], scales[:, 1, 1]
        )
    assert spec.split(got)[0][:, 1].view(torch.uint8).any()
    assert torch.equal(got, expected), (got != expected).nonzero()[:8]


# ---- decode -----------------------------------------------------------------------------------

DECODE_LENS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 50]
ONE_SPLIT, THREE_SPLITS = DecodeConfig(block_n=16, num_splits=1), DecodeConfig(16, 3)


@pytest.mark.parametrize("config", [ONE_SPLIT, THREE_SPLITS], ids=["one-split", "split-k"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", RANKS)
@uses_dot
def test_decode_on_a_ranks_heads(
    num_q_heads: int, num_kv_heads: int, head_dim: int, config: DecodeConfig
) -> None:
    paged = make_paged_kv(DECODE_LENS, BLOCK, num_kv_heads, head_dim, DT, device=DEV)
    q = randn(len(DECODE_LENS), num_q_heads + 2 * num_kv_heads, head_dim)[:, :num_q_heads]
    scale = 1 / math.sqrt(head_dim)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens(), scale)
    out = decode_attention_with(*args, config)
    assert out.shape == q.shape and out.dtype == DT
    assert_close(out, _decode_oracle(q, paged, scale), DT)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", RANKS)
@uses_dot
def test_decode_verification_rows_on_a_ranks_heads(
    num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # speculative verification: q_len 1..9 per sequence, causal among the new tokens
    shapes = mixed_shapes(BLOCK, seed=num_q_heads, long_prefix=40)
    batch = verify_batch(shapes, BLOCK, num_q_heads, num_kv_heads, head_dim, DT, DEV)
    cu_q, max_q = batch.cu_seqlens_q, batch.max_seqlen_q
    scale = 1 / math.sqrt(head_dim)
    out = decode_attention_with(
        batch.q, *batch.cache_args(), scale, DecodeConfig(block_n=16, num_splits=2), cu_q, max_q
    )
    twin = reference.decode_attention(
        f64(batch.q), *(f64(t) for t in batch.cache_args()), scale, None, f64(cu_q), max_q
    )
    assert out.shape == batch.q.shape
    assert_close(out, twin, DT)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", RANKS[1:])
@uses_dot
def test_decode_over_a_ranks_quantized_cache(
    kv_dtype: str, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    paged = make_paged_kv(DECODE_LENS, BLOCK, num_kv_heads, head_dim, DT, device=DEV)
    quant = QuantizedPagedKV(paged, kv_dtype)
    q = randn(len(DECODE_LENS), num_q_heads, head_dim)
    scale = 1 / math.sqrt(head_dim)
    tables, ctx = paged.block_tables, paged.context_lens()
    out = decode_attention_with(
        q, *quant.cache_args(), tables, ctx, scale, THREE_SPLITS, None, 1, *quant.scale_args()
    )
    twin = reference.decode_attention(
        f64(q),
        *quant.cache_args_cpu(),
        tables.cpu(),
        ctx.cpu(),
        scale,
        None,
        None,
        1,
        *quant.scale_args64(),
    )
    assert_close(out, twin, DT)


@pytest.mark.parametrize(
    "model,tp",
    [("smollm2", 3), ("llama4x2", 4), ("llama8x4", 2)],
    ids=["smollm2-tp3", "llama4x2-tp4", "llama8x4-tp2"],
)
@uses_dot
def test_sharded_decode_composes_to_the_full_model(model: str, tp: int) -> None:
    # Every rank attends with its own query heads over its own (or its replicated) kv heads in a
    # cache of its own; put side by side the ranks' outputs are the unsharded step's.
    heads, kv_heads, head_dim = MODELS[model]
    paged = make_paged_kv(DECODE_LENS, BLOCK, kv_heads, head_dim, DT, device=DEV)
    q = randn(len(DECODE_LENS), heads, head_dim)
    scale = 1 / math.sqrt(head_dim)
    full = _decode_oracle(q, paged, scale)
    tables, ctx = paged.block_tables, paged.context_lens()
    for rank in range(tp):
        lo, hi = head_range(heads, tp, rank)
        kv_lo, kv_hi = kv_head_range(kv_heads, tp, rank)
        cache = paged.kv_cache[..., kv_lo:kv_hi, :].contiguous()
        k_cache, v_cache = cache[:, paged.layer, 0], cache[:, paged.layer, 1]
        out = decode_attention_with(
            q[:, lo:hi].contiguous(), k_cache, v_cache, tables, ctx, scale, THREE_SPLITS
        )
        assert_close(out, full[:, lo:hi], DT)


# ---- prefill ----------------------------------------------------------------------------------

PREFILL_LENS = [1, BLOCK + 1, 40]
# (cached prefix, new tokens): no prefix, a 1-token chunk on a block edge, straddling, longer
PREFIX_SHAPES = [(0, 5), (BLOCK, 1), (BLOCK - 1, BLOCK + 1), (40, 9)]
SMALL_TILES = PrefillConfig(block_m=16, block_n=16)


@pytest.mark.parametrize("config", [SMALL_TILES, None], ids=["16x16", "default"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", RANKS)
@uses_dot
def test_packed_prefill_on_a_ranks_heads(
    num_q_heads: int, num_kv_heads: int, head_dim: int, config: PrefillConfig | None
) -> None:
    total = sum(PREFILL_LENS)
    qkv = randn(total, num_q_heads + 2 * num_kv_heads, head_dim)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    cu, longest = cu_seqlens(PREFILL_LENS, DEV), max(PREFILL_LENS)
    scale = 1 / math.sqrt(head_dim)
    args = (q, k, v, cu, cu, longest, longest, scale)
    if config is None:
        out = prefill_attention(*args)
    else:
        out = prefill_attention_with(*args, None, None, None, config)
    expected = reference.prefill_attention(
        f64(q), f64(k), f64(v), f64(cu), f64(cu), longest, longest, scale
    )
    assert out.shape == q.shape and out.dtype == DT
    assert_close(out, expected, DT)


def _prefix_batch(num_q_heads: int, num_kv_heads: int, head_dim: int):
    """A paged cache holding each sequence's prefix and (stored by the kernel) its new tokens."""
    new = [n for _, n in PREFIX_SHAPES]
    k_lens = [p + n for p, n in PREFIX_SHAPES]
    paged = make_paged_kv(k_lens, BLOCK, num_kv_heads, head_dim, DT, device=DEV, seed=head_dim)
    qkv = randn(sum(new), num_q_heads + 2 * num_kv_heads, head_dim)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    slots = torch.cat([paged.slot_mapping(i, p, p + n) for i, (p, n) in enumerate(PREFIX_SHAPES)])
    store_kvcache(k, v, paged.k_cache, paged.v_cache, slots)
    cu_q, cu_k = cu_seqlens(new, DEV), cu_seqlens(k_lens, DEV)
    return paged, (q, k, v, cu_q, cu_k, max(new), max(k_lens), 1 / math.sqrt(head_dim))


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", RANKS)
@uses_dot
def test_prefill_with_paged_prefix_on_a_ranks_heads(
    num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    paged, args = _prefix_batch(num_q_heads, num_kv_heads, head_dim)
    out = prefill_attention_with(
        *args, paged.k_cache, paged.v_cache, paged.block_tables, SMALL_TILES
    )
    cache64 = f64(paged.kv_cache)
    expected = reference.prefill_attention(
        *(f64(a) if isinstance(a, torch.Tensor) else a for a in args),
        cache64[:, paged.layer, 0],
        cache64[:, paged.layer, 1],
        f64(paged.block_tables),
    )
    assert_close(out, expected, DT)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", RANKS[1:])
@uses_dot
def test_paged_prefill_over_a_ranks_quantized_cache(
    kv_dtype: str, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    paged, args = _prefix_batch(num_q_heads, num_kv_heads, head_dim)
    quant = QuantizedPagedKV(paged, kv_dtype)
    out = prefill_attention_with(
        *args, *quant.cache_args(), paged.block_tables, SMALL_TILES, *quant.scale_args()
    )
    twin = reference.prefill_attention(
        *(f64(a) if isinstance(a, torch.Tensor) else a for a in args),
        *quant.cache_args_cpu(),
        paged.block_tables.cpu(),
        *quant.scale_args64(),
    )
    assert_close(out, twin, DT)


# ---- INT8 linear ------------------------------------------------------------------------------

# (rows, K, N) of one rank's linears; column-parallel split N (and their bias), row-parallel K
LINEARS = [
    pytest.param(3, 576, 320, True, id="smollm2-tp3-qkv"),  # (3 + 1 + 1) heads x 64
    pytest.param(17, 576, 1024, False, id="smollm2-tp3-gate-up"),  # 2 x 1536 / 3, 64-row tile
    pytest.param(3, 192, 576, False, id="smollm2-tp3-o"),  # K = 576 / 3
    pytest.param(5, 512, 576, False, id="smollm2-tp3-down"),  # K = 1536 / 3
    pytest.param(2, 768, 576, False, id="k1536-tp2-down"),  # K = 1536 / 2
    pytest.param(4, 64, 48, True, id="qwen2-tiny-tp4-qkv"),  # (1 + 1 + 1) heads x 16
    pytest.param(4, 16, 64, False, id="tiny-tp4-o"),  # K = 64 / 4: under one K tile
    pytest.param(3, 24, 64, False, id="tiny-tp4-down"),  # K = 96 / 4: not a multiple of 16
]


@pytest.mark.parametrize("m,k,n,with_bias", LINEARS)
def test_int8_linear_at_a_ranks_shape(kernel_backend, m, k, n, with_bias) -> None:
    gen = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=gen).to(DEV, DT)
    w = quantize_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen).to(DEV, DT) if with_bias else None
    got, expected = triton_and_twin(kernel_backend, x, w, bias)
    torch.testing.assert_close(got, expected, atol=TOL * 10, rtol=TOL)


@pytest.mark.parametrize("m,k,n,with_bias", [p for p in LINEARS if p.values[1] % 32 == 0])
def test_q8_0_linear_at_a_ranks_shape(kernel_backend, m, k, n, with_bias) -> None:
    gen = torch.Generator().manual_seed(m * k + n + 32)
    x = torch.randn(m, k, generator=gen).to(DEV, DT)
    w = q8_0_like(n, k, 32, gen)
    bias = torch.randn(n, generator=gen).to(DEV, DT) if with_bias else None
    got, expected = triton_and_twin(kernel_backend, x, w, bias)
    torch.testing.assert_close(got, expected, atol=TOL * expected.abs().max(), rtol=TOL)


@pytest.mark.parametrize("grouped", [False, True], ids=["per-channel", "q8_0"])
def test_row_parallel_shards_sum_to_the_full_product(kernel_backend, grouped: bool) -> None:
    # SmolLM2's down projection over TP 3: each rank multiplies its K / 3 slice of x by the
    # column slice of the weight (a strided view, and its slice of the group scales); the
    # all-reduce's sum is the full product.
    m, k, n, tp = 3, 1536, 576, 3
    gen = torch.Generator().manual_seed(tp)
    x = torch.randn(m, k, generator=gen).to(DEV, DT)
    w = q8_0_like(n, k, 32, gen) if grouped else quantize_per_channel(torch.randn(n, k) * 0.05)
    qweight, scale = w.qweight.to(DEV), w.scale.to(DEV)
    kernel_backend("triton")
    total = torch.zeros(m, n, dtype=torch.float64)
    per = k // tp
    for rank in range(tp):
        cols = slice(rank * per, (rank + 1) * per)
        rank_scale = scale[:, rank * per // 32 : (rank + 1) * per // 32] if grouped else scale
        total += ops.int8_linear(x[:, cols], qweight[:, cols], rank_scale).double().cpu()
    expected = int8_linear(x.double().cpu(), w.qweight, w.scale.double())
    torch.testing.assert_close(total, expected, atol=TOL * expected.abs().max(), rtol=TOL)
