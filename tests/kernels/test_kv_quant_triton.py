"""The Triton kernels over a quantized paged KV cache (issue 18): the store kernel quantizes byte
for byte as the plain-torch twin does, and decode (one query, speculative verification, split-K)
and paged prefill read the int8 / fp8_e4m3 values with their per-token-head scales.

Each attention check has two bounds: against the twin reading the *same* quantized cache in
float64 (tight: the kernel's own rounding only, so ignoring or misplacing a scale fails it), and
against float64 attention over the float cache the values were quantized from (loose: the
quantization error of kernels/reference_quant.py).

CI runs the interpreter in fp32. Its float32 -> float8 cast is not the hardware's (it rounds half
up and drops the mantissa carry: -124.0 becomes -64.0), so the fp8 *store* is checked compiled on
a GPU only; fp8 *reads* convert correctly and are checked everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from pdserve.kernels import ops, reference
from pdserve.kernels.reference_quant import quantize_kv
from pdserve.kernels.triton_decode import DecodeConfig, decode_attention_with
from pdserve.kernels.triton_prefill import PrefillConfig, prefill_attention_with
from pdserve.services.engine.quant.kv_cache import KV_ELEMENT_TYPES, kv_cache_spec
from tests.kernels.helpers import TEST_DEVICE, TEST_DTYPE, PagedKV, assert_close, make_paged_kv
from tests.kernels.test_verify_attention import mixed_shapes, verify_batch

DEV = TEST_DEVICE
DT = TEST_DTYPE
KV_DTYPES = ["int8", "fp8_e4m3"]
# relative error of attention over the quantized cache against the float cache (see
# test_kv_quant.KV_BOUND: one stored vector's error, which attention averages down); bf16 (the
# GPU check) rounds q, p and the output on top, ~3e-3 relative more on these shapes
HALF_SLACK = 0.0 if DT == torch.float32 else 0.01
KV_BOUND = {"int8": 0.01 + HALF_SLACK, "fp8_e4m3": 0.07 + HALF_SLACK}

uses_dot = pytest.mark.skipif(
    DEV == "cpu" and DT == torch.bfloat16, reason="interpreter has no bf16 tl.dot"
)


def _interpreter_casts_fp8(kv_dtype: str) -> None:
    if DEV == "cpu" and kv_dtype == "fp8_e4m3":
        pytest.skip("the Triton interpreter's float32->float8 cast is wrong; checked on CUDA")


class QuantizedPagedKV:
    """A quantized engine cache holding a float PagedKV's contents, quantized by the twin."""

    def __init__(self, paged: PagedKV, kv_dtype: str) -> None:
        blocks, layers, _, block_size, heads, dim = paged.kv_cache.shape
        self.paged = paged
        spec = kv_cache_spec(kv_dtype, DT, layers, block_size, heads, dim)
        self.storage = spec.allocate(blocks, torch.device(DEV))
        self.values, self.scales = spec.split(self.storage)
        values, scales = quantize_kv(paged.kv_cache, spec.dtype)
        self.values.view(torch.uint8).copy_(values.view(torch.uint8))
        self.scales.copy_(scales[..., None])

    def cache_args(self) -> tuple[Tensor, Tensor]:
        layer = self.paged.layer
        return self.values[:, layer, 0], self.values[:, layer, 1]

    def scale_args(self) -> tuple[Tensor, Tensor]:
        layer = self.paged.layer
        return self.scales[:, layer, 0], self.scales[:, layer, 1]

    def scale_args64(self) -> tuple[Tensor, Tensor]:
        return tuple(s.double().cpu() for s in self.scale_args())

    def cache_args_cpu(self) -> tuple[Tensor, Tensor]:
        return tuple(c.cpu() for c in self.cache_args())


def _float_cache64(paged: PagedKV) -> tuple[Tensor, Tensor]:
    cache = paged.kv_cache.double().cpu()
    return cache[:, paged.layer, 0], cache[:, paged.layer, 1]


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


# ---- store ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 80)])
def test_store_quantizes_like_the_twin_byte_for_byte(
    kernel_backend, kv_dtype, num_kv_heads, head_dim
) -> None:
    _interpreter_casts_fp8(kv_dtype)
    spec = kv_cache_spec(kv_dtype, DT, 2, 16, num_kv_heads, head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    tokens = 9
    # per-token ranges from 1e-3 to 1e2, an all-zero vector (scale clamps at 1e-8 / QMAX) and
    # one of int8 rounding ties: amax 63.5 makes the scale 0.5, the rest scale to n + 0.5
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    k *= torch.logspace(-3, 2, tokens)[:, None, None]
    k[0, 0] = 0
    k[1, -1] = (torch.arange(head_dim) % 64 - 31.5) * 0.5
    k[1, -1, 0] = -63.5
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    k, v = k.to(DEV, DT), v.to(DEV, DT)
    slots = torch.tensor([0, 17, -1, 5, 33, 34, 47, 48, 2], device=DEV)  # -1: a prefix hit
    got, expected = spec.allocate(5, DEV), spec.allocate(5, DEV)
    for backend, storage in (("triton", got), ("torch", expected)):
        kernel_backend(backend)
        values, scales = spec.split(storage)
        ops.store_kvcache(
            k, v, values[:, 1, 0], values[:, 1, 1], slots, scales[:, 1, 0], scales[:, 1, 1]
        )
    assert spec.split(got)[0][:, 1].view(torch.uint8).any()  # something was written
    assert torch.equal(got, expected), (got != expected).nonzero()[:8]


# ---- decode -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "head_dim,num_q_heads,num_kv_heads,config",
    [
        (64, 8, 2, DecodeConfig(block_n=16, num_splits=1)),  # GQA 4, one split
        (80, 4, 1, DecodeConfig(block_n=16, num_splits=3)),  # split-K, head dim not a power of 2
    ],
)
@uses_dot
def test_decode_one_query_over_quantized_cache(
    kv_dtype, head_dim, num_q_heads, num_kv_heads, config
) -> None:
    lens = [1, 15, 16, 17, 90]
    paged = make_paged_kv(lens, 16, num_kv_heads, head_dim, DT, device=DEV, seed=head_dim)
    quant = QuantizedPagedKV(paged, kv_dtype)
    q = torch.randn(len(lens), num_q_heads, head_dim).to(DEV, DT)
    scale = 1 / math.sqrt(head_dim)
    tables, ctx = paged.block_tables, paged.context_lens()
    out = decode_attention_with(
        q, *quant.cache_args(), tables, ctx, scale, config, None, 1, *quant.scale_args()
    )
    assert out.shape == q.shape and out.dtype == DT
    q64, tables64, ctx64 = q.double().cpu(), tables.cpu(), ctx.cpu()
    twin = reference.decode_attention(
        q64,
        *quant.cache_args_cpu(),
        tables64,
        ctx64,
        scale,
        None,
        None,
        1,
        *quant.scale_args64(),
    )
    assert_close(out, twin, DT)
    exact = reference.decode_attention(q64, *_float_cache64(paged), tables64, ctx64, scale)
    assert 0 < _rel(out, exact) < KV_BOUND[kv_dtype]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "config",
    [DecodeConfig(block_n=16, num_splits=1), DecodeConfig(block_n=16, num_splits=3)],
)
@uses_dot
def test_decode_verification_rows_over_quantized_cache(kv_dtype, config) -> None:
    # speculative verification: q_len 1..9 per sequence, causal among the new tokens
    shapes = mixed_shapes(16, seed=3, long_prefix=80)
    batch = verify_batch(shapes, 16, 8, 2, 64, DT, DEV)
    quant = QuantizedPagedKV(batch.paged, kv_dtype)
    tables, ctx = batch.paged.block_tables, batch.paged.context_lens()
    cu_q, max_q = batch.cu_seqlens_q, batch.max_seqlen_q
    out = decode_attention_with(
        batch.q,
        *quant.cache_args(),
        tables,
        ctx,
        0.125,
        config,
        cu_q,
        max_q,
        *quant.scale_args(),
    )
    q64 = batch.q.double().cpu()
    twin = reference.decode_attention(
        q64,
        *quant.cache_args_cpu(),
        tables.cpu(),
        ctx.cpu(),
        0.125,
        None,
        cu_q.cpu(),
        max_q,
        *quant.scale_args64(),
    )
    assert_close(out, twin, DT)
    assert 0 < _rel(out, batch.expected(0.125)) < KV_BOUND[kv_dtype]


@uses_dot
def test_ops_reaches_the_quantized_triton_decode(kernel_backend) -> None:
    paged = make_paged_kv([5, 40], 16, 2, 64, DT, device=DEV)
    quant = QuantizedPagedKV(paged, "int8")
    q = torch.randn(2, 4, 64).to(DEV, DT)
    args = (q, *quant.cache_args(), paged.block_tables, paged.context_lens(), 0.125)
    kernel_backend("triton")
    via_ops = ops.decode_attention(*args, None, None, 1, *quant.scale_args())
    kernel_backend("torch")
    twin = ops.decode_attention(*args, None, None, 1, *quant.scale_args())
    assert_close(via_ops, twin.double(), DT)


# ---- prefill ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "head_dim,num_q_heads,num_kv_heads,config",
    [
        (64, 8, 2, PrefillConfig(block_m=16, block_n=16)),  # GQA 4, full and diagonal tiles
        (80, 2, 1, PrefillConfig(block_m=32, block_n=16)),  # head dim not a power of 2
    ],
)
@uses_dot
def test_paged_prefill_over_quantized_cache(
    kv_dtype, head_dim, num_q_heads, num_kv_heads, config
) -> None:
    # (cached prefix, new tokens); the new tokens' K/V are already in the cache
    shapes = [(0, 5), (16, 1), (15, 17), (70, 24)]
    new = [n for _, n in shapes]
    k_lens = [p + n for p, n in shapes]
    paged = make_paged_kv(k_lens, 16, num_kv_heads, head_dim, DT, device=DEV, seed=head_dim)
    quant = QuantizedPagedKV(paged, kv_dtype)
    q = torch.randn(sum(new), num_q_heads, head_dim).to(DEV, DT)
    unused = torch.empty(sum(new), num_kv_heads, head_dim, device=DEV, dtype=DT)
    cu_q = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    args = (q, unused, unused, cu_q.to(DEV), cu_k.to(DEV), max(new), max(k_lens), scale)
    out = prefill_attention_with(
        *args, *quant.cache_args(), paged.block_tables, config, *quant.scale_args()
    )
    assert out.shape == q.shape and out.dtype == DT
    args64 = (q.double().cpu(), unused.double().cpu(), unused.double().cpu(), cu_q, cu_k)
    args64 += (max(new), max(k_lens), scale)
    tables64 = paged.block_tables.cpu()
    twin = reference.prefill_attention(
        *args64, *quant.cache_args_cpu(), tables64, *quant.scale_args64()
    )
    assert_close(out, twin, DT)
    exact = reference.prefill_attention(*args64, *_float_cache64(paged), tables64)
    assert 0 < _rel(out, exact) < KV_BOUND[kv_dtype]


def test_every_kv_cache_dtype_is_covered() -> None:
    assert set(KV_DTYPES) == set(KV_ELEMENT_TYPES)
