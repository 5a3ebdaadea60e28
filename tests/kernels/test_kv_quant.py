"""The quantized paged KV cache (issue 18): int8 / fp8_e4m3 values with per-token-head scales,
read by the decode and prefill twins, with the error bounded against the float cache (the INT8
weight-only linear: tests/kernels/test_int8_group.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import ops
from pdserve.kernels.reference_quant import dequantize_kv, quantize_kv
from pdserve.services.engine.quant.kv_cache import kv_cache_spec

KV_DTYPES = ["int8", "fp8_e4m3"]
# relative error of one stored vector: int8 rounds to 1/254 of the vector's range, fp8 e4m3 keeps
# 3 mantissa bits (2**-4 relative)
KV_BOUND = {"int8": 0.01, "fp8_e4m3": 0.07}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantize_kv_round_trip_is_bounded(kv_dtype) -> None:
    spec = kv_cache_spec(kv_dtype, torch.float32, 1, 16, 2, 64)
    # seeded: the largest of 600 vectors' errors sits near the int8 bound, and an unseeded draw
    # depended on the tests before it (under pytest-xdist's order it exceeded it once)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 2, 64, generator=gen) * torch.logspace(-3, 2, 300)[:, None, None]
    values, scales = quantize_kv(x, spec.dtype)
    back = dequantize_kv(values, scales, torch.float32)
    rel = (back - x).norm(dim=-1) / x.norm(dim=-1)
    assert rel.max() < KV_BOUND[kv_dtype]


def _filled_caches(kv_dtype: str, lens: list[int], block_size: int = 16):
    """A float and a quantized engine cache holding the same K/V, written through store_kvcache
    with scattered block tables; returns (float views, quantized views + scales, tables)."""
    layers, heads, dim = 2, 2, 32
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + 3
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1))[
        : len(lens) * max_blocks
    ]
    tables = (perm + 1).view(len(lens), max_blocks).to(torch.int32)
    flt = kv_cache_spec("auto", torch.float32, layers, block_size, heads, dim)
    qnt = kv_cache_spec(kv_dtype, torch.float32, layers, block_size, heads, dim)
    f_cache, (q_values, q_scales) = (
        flt.allocate(num_blocks, "cpu"),
        qnt.split(qnt.allocate(num_blocks, "cpu")),
    )
    gen = torch.Generator().manual_seed(7)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        k, v = torch.randn(2, n, heads, dim, generator=gen)
        ops.store_kvcache(k, v, f_cache[:, 1, 0], f_cache[:, 1, 1], slots)
        ops.store_kvcache(
            k, v, q_values[:, 1, 0], q_values[:, 1, 1], slots, q_scales[:, 1, 0], q_scales[:, 1, 1]
        )
    return f_cache[:, 1], (q_values[:, 1], q_scales[:, 1]), tables


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_attention_reads_quantized_cache(kv_dtype) -> None:
    lens = [1, 17, 40, 64]
    f, (qv, qs), tables = _filled_caches(kv_dtype, lens)
    q = torch.randn(len(lens), 4, 32, generator=torch.Generator().manual_seed(3))
    ctx = torch.tensor(lens, dtype=torch.int32)
    ref = ops.decode_attention(q, f[:, 0], f[:, 1], tables, ctx, 32**-0.5)
    got = ops.decode_attention(
        q, qv[:, 0], qv[:, 1], tables, ctx, 32**-0.5, None, None, 1, qs[:, 0], qs[:, 1]
    )
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < KV_BOUND[kv_dtype]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefill_attention_reads_quantized_cache(kv_dtype) -> None:
    lens = [20, 48]
    f, (qv, qs), tables = _filled_caches(kv_dtype, lens)
    q_lens = [4, 16]  # the last tokens of each sequence, their K/V already stored
    cu_q = torch.tensor([0, 4, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 68], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 4, 32, generator=torch.Generator().manual_seed(5))
    unused = torch.empty(sum(q_lens), 2, 32)
    args = (q, unused, unused, cu_q, cu_k, 16, 48, 32**-0.5)
    ref = ops.prefill_attention(*args, f[:, 0], f[:, 1], tables)
    got = ops.prefill_attention(*args, qv[:, 0], qv[:, 1], tables, qs[:, 0], qs[:, 1])
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < KV_BOUND[kv_dtype]


def test_quantized_block_carries_its_scales_as_bytes() -> None:
    """Copying a block's bytes (what the KV transfer and fork copies do) moves values and scales."""
    spec = kv_cache_spec("int8", torch.float32, 2, 4, 2, 8)
    storage = spec.allocate(3, "cpu")
    values, scales = spec.split(storage)
    k = torch.randn(4, 2, 8)
    slots = torch.arange(4) + 4  # block 1
    ops.store_kvcache(
        k, k, values[:, 0, 0], values[:, 0, 1], slots, scales[:, 0, 0], scales[:, 0, 1]
    )
    storage[2] = storage[1]
    got = dequantize_kv(values[2, 0, 0], scales[2, 0, 0, :, :, 0], torch.float32)
    torch.testing.assert_close(got, k, atol=0.02, rtol=0.01)
    assert spec.bytes_per_block == 2 * 2 * 4 * 2 * (8 + 4)
