"""Decode attention with several query tokens per sequence (speculative verification, issue 17).

A sequence with context length L (its newest q_len tokens' K/V already in the cache) brings
q_len queries; query j sits at position L - q_len + j and sees keys 0..that position. Both the
CPU twin and the Triton kernel are checked against per-sequence float64 attention on mixed
q_lens in one batch, and with one query everywhere against the plain decode path.

CI: CPU, the twin in fp32/bf16/fp64 and the Triton kernel under the interpreter in fp32.
perf/gpu_check.sh: the Triton tests compiled on CUDA in bf16.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from pdserve.kernels import ops, reference
from pdserve.kernels.triton_decode import DecodeConfig, decode_attention, decode_attention_with
from tests.kernels.helpers import (
    TEST_DEVICE,
    TEST_DTYPE,
    PagedKV,
    assert_close,
    cu_seqlens,
    make_paged_kv,
    naive_attention,
)

DEV = TEST_DEVICE
DT = TEST_DTYPE

uses_dot = pytest.mark.skipif(
    DEV == "cpu" and DT == torch.bfloat16, reason="interpreter has no bf16 tl.dot"
)


@dataclass
class VerifyBatch:
    """A step's verification rows: each sequence's last q_len tokens over its paged context."""

    paged: PagedKV
    q: Tensor  # [T, Hq, D] packed, a strided view into a fused qkv projection
    q_lens: list[int]
    cu_seqlens_q: Tensor  # [B+1] int32

    @property
    def max_seqlen_q(self) -> int:
        return max(self.q_lens)

    def cache_args(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        p = self.paged
        return p.k_cache, p.v_cache, p.block_tables, p.context_lens()

    def expected(self, scale: float) -> Tensor:
        """Per-sequence float64 causal attention, query j at context_len - q_len + j."""
        out = []
        for i, (n, q_len) in enumerate(zip(self.paged.lens, self.q_lens, strict=True)):
            k, v = self.paged.sequence_kv(i)
            s, e = int(self.cu_seqlens_q[i]), int(self.cu_seqlens_q[i + 1])
            out.append(naive_attention(self.q[s:e], k, v, scale, q_offset=n - q_len))
        return torch.cat(out)


def verify_batch(
    shapes: list[tuple[int, int]],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
    num_layers: int = 2,
) -> VerifyBatch:
    """shapes: (tokens cached before this step, q_len) per sequence; the q_len new tokens are
    part of the context (random K/V in their slots, as if this step stored them)."""
    q_lens = [q_len for _, q_len in shapes]
    lens = [prefix + q_len for prefix, q_len in shapes]
    paged = make_paged_kv(
        lens,
        block_size,
        num_kv_heads,
        head_dim,
        dtype,
        device=device,
        num_layers=num_layers,
        layer=num_layers - 1,
        seed=sum(lens),
    )
    gen = torch.Generator().manual_seed(len(lens))
    qkv = torch.randn(sum(q_lens), num_q_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q = qkv.to(device=device, dtype=dtype)[:, :num_q_heads]
    return VerifyBatch(paged, q, q_lens, cu_seqlens(q_lens, device))


def mixed_shapes(block_size: int, seed: int, long_prefix: int = 300) -> list[tuple[int, int]]:
    """q_lens 1, 2, 5 and 9 mixed, new tokens starting and ending on both sides of block
    boundaries, a sequence whose whole context is new, and more sequences than the twin's
    length groups."""
    rng = random.Random(seed)
    bs = block_size
    return [
        (0, 5),  # nothing cached before: the first query sees only key 0
        (bs - 1, 2),  # the two new tokens straddle a block boundary
        (bs - 3, 5),
        (bs, 9),  # new tokens start exactly on a block
        (2 * bs - 4, 9),
        (bs - 1, 1),  # a plain decode row inside the same batch
        (3 * bs, 1),
        (rng.randint(bs, long_prefix), 2),
        (rng.randint(bs, long_prefix), 5),
        (rng.randint(bs, long_prefix), 9),
        (rng.randint(bs, long_prefix), 1),
    ]


# ---- the CPU twin ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,head_dim,num_q_heads,num_kv_heads,block_size",
    [
        (torch.float32, 64, 8, 2, 16),  # GQA 4
        (torch.float32, 32, 6, 6, 32),  # no GQA
        (torch.float64, 64, 8, 1, 16),  # GQA 8 (MQA)
        (torch.bfloat16, 128, 9, 3, 32),  # GQA 3, the served SmolLM2's grouping
    ],
)
def test_twin_matches_naive_on_mixed_query_lengths(
    kernel_backend,
    dtype: torch.dtype,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
) -> None:
    kernel_backend("torch")
    batch = verify_batch(
        mixed_shapes(block_size, seed=head_dim),
        block_size,
        num_q_heads,
        num_kv_heads,
        head_dim,
        dtype,
    )
    scale = 1 / math.sqrt(head_dim)
    args = batch.cache_args()
    out = ops.decode_attention(batch.q, *args, scale, None, batch.cu_seqlens_q, batch.max_seqlen_q)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_close(out, batch.expected(scale), dtype)


def test_twin_one_query_each_is_plain_decode_bit_for_bit(kernel_backend) -> None:
    kernel_backend("torch")
    shapes = [(n - 1, 1) for n in [7, 1, 40, 16, 33, 90, 17, 2, 64, 5, 128, 3]]
    batch = verify_batch(shapes, 16, 8, 2, 64, torch.float32)
    args = (batch.q, *batch.cache_args(), 0.125)
    plain = ops.decode_attention(*args)
    assert torch.equal(ops.decode_attention(*args, None, batch.cu_seqlens_q, 1), plain)
    # A loose bound (the engine's max over a step with no proposal left) still sees q_len 1.
    assert torch.equal(ops.decode_attention(*args, None, batch.cu_seqlens_q, 4), plain)
    assert_close(plain, batch.expected(0.125))


def test_twin_plan_serves_every_layer(kernel_backend) -> None:
    kernel_backend("torch")
    batch = verify_batch(mixed_shapes(16, seed=3), 16, 4, 2, 32, torch.float32, num_layers=3)
    kv, tables, ctx = batch.paged.kv_cache, batch.paged.block_tables, batch.paged.context_lens()
    cu, width = batch.cu_seqlens_q, batch.max_seqlen_q
    plan = ops.decode_plan(tables, ctx, cu, width)
    assert isinstance(plan, reference.DecodePlan)
    for layer in range(3):
        k_cache, v_cache = kv[:, layer, 0], kv[:, layer, 1]
        planned = ops.decode_attention(batch.q, k_cache, v_cache, tables, ctx, 0.2, plan, cu, width)
        alone = ops.decode_attention(batch.q, k_cache, v_cache, tables, ctx, 0.2, None, cu, width)
        assert torch.equal(planned, alone)
    # the last layer is the one the oracle reads
    assert_close(planned, batch.expected(0.2))
    # a plan made for one query per sequence cannot serve a verification step, nor vice versa
    with pytest.raises(ValueError, match="query layout"):
        ops.decode_attention(
            batch.q, k_cache, v_cache, tables, ctx, 0.2, ops.decode_plan(tables, ctx), cu, width
        )
    with pytest.raises(ValueError, match="query layout"):
        ops.decode_attention(batch.q[: len(ctx)], k_cache, v_cache, tables, ctx, 0.2, plan)


def test_twin_empty_step(kernel_backend) -> None:
    kernel_backend("torch")
    paged = make_paged_kv([5], 16, 2, 64, torch.float32)
    out = ops.decode_attention(
        torch.randn(0, 4, 64),
        paged.k_cache,
        paged.v_cache,
        paged.block_tables[:0],
        paged.context_lens()[:0],
        0.1,
        None,
        torch.zeros(1, dtype=torch.int32),
        3,
    )
    assert out.shape == (0, 4, 64)


# ---- the Triton kernel (interpreted on CPU, compiled by perf/gpu_check.sh) ------------------


@pytest.mark.parametrize(
    "head_dim,num_q_heads,num_kv_heads,block_size,config",
    [
        (64, 8, 2, 16, DecodeConfig(block_n=16, num_splits=1)),  # GQA 4: 36 rows, one block
        (64, 4, 4, 32, DecodeConfig(block_n=32, num_splits=3)),  # no GQA, split-K
        (32, 16, 2, 16, DecodeConfig(block_n=16, num_splits=2)),  # GQA 8 x q_len 9: 2 blocks
        (80, 6, 2, 32, None),  # GQA 3, head dim not a power of 2, production heuristic
    ],
)
@uses_dot
def test_triton_matches_naive_on_mixed_query_lengths(
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    config: DecodeConfig | None,
) -> None:
    shapes = mixed_shapes(block_size, seed=num_q_heads, long_prefix=100)
    batch = verify_batch(shapes, block_size, num_q_heads, num_kv_heads, head_dim, DT, DEV)
    scale = 1 / math.sqrt(head_dim)
    args = (batch.q, *batch.cache_args(), scale)
    if config is None:
        out = decode_attention(args[0], *args[1:], None, batch.cu_seqlens_q, batch.max_seqlen_q)
    else:
        out = decode_attention_with(*args, config, batch.cu_seqlens_q, batch.max_seqlen_q)
    assert out.shape == batch.q.shape and out.dtype == DT
    assert_close(out, batch.expected(scale), DT)


@uses_dot
def test_triton_split_holding_no_key_of_an_early_query() -> None:
    # Splits of 16 tokens over a context of 70 whose last 9 tokens are new: the last split
    # (64..69) holds no key that queries 0-2 (positions 61-63) may see. Their partial must
    # weigh nothing in the merge - not NaN, not a zero mixed in.
    batch = verify_batch([(61, 9), (15, 2)], 16, 4, 1, 64, DT, DEV)
    args = (batch.q, *batch.cache_args(), 0.125)
    config = DecodeConfig(block_n=16, num_splits=5)
    out = decode_attention_with(*args, config, batch.cu_seqlens_q, batch.max_seqlen_q)
    assert_close(out, batch.expected(0.125), DT)


@uses_dot
def test_triton_one_query_each_is_plain_decode(kernel_backend) -> None:
    shapes = [(n - 1, 1) for n in [1, 15, 16, 17, 70]]
    batch = verify_batch(shapes, 16, 8, 2, 64, DT, DEV)
    args = (batch.q, *batch.cache_args(), 0.125)
    config = DecodeConfig(block_n=16, num_splits=2)
    plain = decode_attention_with(*args, config)
    assert torch.equal(decode_attention_with(*args, config, batch.cu_seqlens_q, 1), plain)
    # Through the engine's entry point, Triton selected: the same kernel, the same bits.
    kernel_backend("triton")
    assert ops.decode_plan(batch.paged.block_tables, batch.paged.context_lens()) is None
    via_ops = ops.decode_attention(*args, None, batch.cu_seqlens_q, 1)
    assert torch.equal(via_ops, decode_attention(*args))
    # A loose max_seqlen_q takes the multi-query kernel: same math, other tile shapes.
    loose = decode_attention_with(*args, config, batch.cu_seqlens_q, 3)
    assert_close(loose, plain, DT)
    assert_close(plain, batch.expected(0.125), DT)


@uses_dot
def test_triton_through_ops_and_empty_step(kernel_backend) -> None:
    kernel_backend("triton")
    batch = verify_batch([(3, 5), (20, 1), (30, 9)], 16, 4, 2, 64, DT, DEV)
    cu, width = batch.cu_seqlens_q, batch.max_seqlen_q
    args = (batch.q, *batch.cache_args(), 0.125)
    assert torch.equal(
        ops.decode_attention(*args, None, cu, width), decode_attention(*args, None, cu, width)
    )
    empty = decode_attention(
        batch.q[:0],
        batch.paged.k_cache,
        batch.paged.v_cache,
        batch.paged.block_tables[:0],
        batch.paged.context_lens()[:0],
        0.125,
        None,
        cu[:1],
        width,
    )
    assert empty.shape == (0, 4, 64)


def test_query_rows_per_program() -> None:
    from pdserve.kernels.triton_decode_launch import choose_decode_config, query_layout

    cu = torch.zeros(2, dtype=torch.int32)
    # one query per sequence, however it is spelled: the plain kernel, the GQA group as rows
    assert query_layout(4, None, 1) == query_layout(4, cu, 1)
    assert not query_layout(4, cu, 1).multi_query and query_layout(4, cu, 1).block_m == 16
    # q_len x group rows in one program while they fit (pages read once per kv head) ...
    layout = query_layout(4, cu, 9)
    assert (layout.multi_query, layout.block_m, layout.row_blocks) == (True, 64, 1)
    assert query_layout(1, cu, 5).block_m == 16  # tl.dot wants at least 16 rows
    # ... and row blocks of 64 past that
    assert query_layout(8, cu, 9).row_blocks == 2
    # more rows, more warps (registers per thread stay near 100-160 on sm_90)
    device = torch.device(DEV)
    plain = choose_decode_config(64, 8, 2048, 128, device)
    wide = choose_decode_config(64, 8, 2048, 128, device, query_layout(4, cu, 9))
    assert plain.num_warps == 4 and wide.num_warps == 8
