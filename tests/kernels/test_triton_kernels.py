"""Every Triton kernel against its plain-torch twin (run in float64) on the awkward shapes.

CI: CPU, fp32, Triton interpreter (conftest sets TRITON_INTERPRET=1). perf/gpu_check.sh: CUDA,
compiled, PDSERVE_KERNEL_TEST_DTYPE=bfloat16. Shapes are picked so each edge is covered at least
once without a full cartesian product: the interpreter's cost grows with the grid.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import Tensor

from pdserve.kernels import ops, reference
from pdserve.kernels.triton_cache import store_kvcache
from pdserve.kernels.triton_decode import DecodeConfig, decode_attention, decode_attention_with
from pdserve.kernels.triton_norm import rms_norm
from pdserve.kernels.triton_prefill import PrefillConfig, prefill_attention, prefill_attention_with
from pdserve.kernels.triton_rotary import rotary_embedding
from tests.kernels.helpers import (
    TEST_DEVICE,
    TEST_DTYPE,
    assert_close,
    cu_seqlens,
    make_paged_kv,
)

DEV = TEST_DEVICE
DT = TEST_DTYPE

# The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584, "not
# supported yet"), so bf16 attention is checked compiled on a GPU only.
uses_dot = pytest.mark.skipif(
    DEV == "cpu" and DT == torch.bfloat16, reason="interpreter has no bf16 tl.dot"
)


def f64(t: Tensor) -> Tensor:
    """The oracle's copy of an input: float64 on CPU (ints stay ints)."""
    t = t.detach().cpu()
    return t.double() if t.is_floating_point() else t.clone()


def randn(*shape: int) -> Tensor:
    return torch.randn(*shape, device=DEV).to(DT)


def lens_with_edges(block_size: int, seed: int, randoms: int) -> list[int]:
    rng = random.Random(seed)
    return [1, block_size - 1, block_size, block_size + 1] + [
        rng.randint(2, 2048) for _ in range(randoms)
    ]


def test_interpreter_is_active_on_cpu() -> None:
    # If TRITON_INTERPRET were set too late the kernels would try to compile for a missing GPU;
    # make that failure explicit rather than mysterious.
    from triton.runtime.interpreter import InterpretedFunction

    from pdserve.kernels import triton_decode

    is_interpreted = isinstance(triton_decode._decode_split_kernel, InterpretedFunction)
    assert is_interpreted == (DEV == "cpu")


@pytest.mark.parametrize(
    "tokens,hidden,with_residual",
    [(5, 96, True), (3, 4096, False), (0, 64, True)],
)
def test_rms_norm(tokens: int, hidden: int, with_residual: bool) -> None:
    # x as a strided row slice of a wider buffer, as a fused projection would produce.
    x = randn(tokens, hidden + 32)[:, :hidden]
    weight = (torch.rand(hidden, device=DEV) + 0.5).to(DT)
    residual = randn(tokens, hidden) if with_residual else None
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = reference.rms_norm(
        f64(x), f64(weight), 1e-6, f64(residual) if residual is not None else None
    )
    assert out.shape == (tokens, hidden) and out.dtype == DT
    assert_close(out, expected, DT)
    if with_residual:
        assert_close(new_residual, expected_residual, DT)
    else:
        assert new_residual is None


@pytest.mark.parametrize(
    "head_dim,num_q_heads,num_kv_heads,rope_scaling",
    [
        (64, 8, 8, None),
        (
            128,
            8,
            1,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        ),
    ],
)
def test_rotary_in_place_on_strided_views(
    head_dim: int, num_q_heads: int, num_kv_heads: int, rope_scaling: dict | None
) -> None:
    tokens = 19
    cache = ops.build_rope_cache(head_dim, 4096, 500000.0, rope_scaling, DEV)
    positions = torch.randint(0, 4096, (tokens,), device=DEV)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = randn(tokens, width)
    q = qkv[:, : num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(
        tokens, num_kv_heads, head_dim
    )
    q64, k64, untouched_v = f64(q), f64(k), qkv[:, (num_q_heads + num_kv_heads) * head_dim :]
    untouched_v = untouched_v.clone()
    rotary_embedding(positions, q, k, cache)
    reference.rotary_embedding(f64(positions), q64, k64, f64(cache))
    assert_close(q, q64, DT)
    assert_close(k, k64, DT)
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], untouched_v)
    rotary_embedding(positions[:0], q[:0], k[:0], cache)  # empty batch: no launch, no error


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 8, 64), (32, 2, 128)])
def test_store_kvcache_matches_reference_exactly(
    block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    lens = [block_size + 1, block_size - 1, 1]
    paged = make_paged_kv(lens, block_size, num_kv_heads, head_dim, DT, device=DEV)
    twin = make_paged_kv(lens, block_size, num_kv_heads, head_dim, DT, device=DEV)
    slots = torch.cat([paged.slot_mapping(i, 0, n) for i, n in enumerate(lens)])
    slots[[0, block_size]] = -1  # prefix hits: skipped
    key = randn(len(slots), num_kv_heads, head_dim)
    value = randn(len(slots), num_kv_heads, head_dim)
    store_kvcache(key, value, paged.k_cache, paged.v_cache, slots)
    reference.store_kvcache(key, value, twin.k_cache, twin.v_cache, slots)
    assert torch.equal(paged.kv_cache, twin.kv_cache)
    store_kvcache(key[:0], value[:0], paged.k_cache, paged.v_cache, slots[:0])
    assert torch.equal(paged.kv_cache, twin.kv_cache)


def _decode_oracle(q: Tensor, paged, scale: float) -> Tensor:
    return reference.decode_attention(
        f64(q),
        f64(paged.kv_cache)[:, paged.layer, 0],
        f64(paged.kv_cache)[:, paged.layer, 1],
        f64(paged.block_tables),
        f64(paged.context_lens()),
        scale,
    )


@pytest.mark.parametrize(
    "head_dim,num_q_heads,num_kv_heads,block_size,config",
    [
        (64, 4, 4, 16, DecodeConfig(block_n=32, num_splits=1)),  # GQA 1, tiles span pages
        (128, 8, 2, 32, DecodeConfig(block_n=16, num_splits=4)),  # GQA 4, tile < page, split-K
        (128, 8, 1, 16, None),  # GQA 8, the production heuristic
        (64, 16, 2, 32, DecodeConfig(block_n=64, num_splits=3)),  # GQA 8, uneven split count
        (80, 4, 1, 16, DecodeConfig(block_n=16, num_splits=2)),  # head dim not a power of 2
    ],
)
@uses_dot
def test_decode_attention(
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    config: DecodeConfig | None,
) -> None:
    lens = lens_with_edges(block_size, seed=head_dim * num_q_heads, randoms=1)
    paged = make_paged_kv(lens, block_size, num_kv_heads, head_dim, DT, device=DEV)
    q = randn(len(lens), num_q_heads + 2 * num_kv_heads, head_dim)[:, :num_q_heads]  # qkv view
    scale = 1 / math.sqrt(head_dim)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens(), scale)
    out = decode_attention(*args) if config is None else decode_attention_with(*args, config)
    assert out.shape == q.shape and out.dtype == DT
    assert_close(out, _decode_oracle(q, paged, scale), DT)


@uses_dot
def test_decode_attention_long_context_splits() -> None:
    # Flash-decoding's reason to exist: one sequence, thousands of tokens, many splits.
    paged = make_paged_kv([2048, 1], 32, 1, 64, DT, device=DEV)
    q = randn(2, 4, 64)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens(), 0.125)
    out = decode_attention_with(*args, DecodeConfig(block_n=64, num_splits=8))
    assert_close(out, _decode_oracle(q, paged, 0.125), DT)


@uses_dot
def test_decode_attention_empty_batch_and_dispatch(kernel_backend) -> None:
    paged = make_paged_kv([3], 16, 2, 64, DT, device=DEV)
    q = randn(0, 4, 64)
    out = decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables[:0], paged.context_lens()[:0], 0.1
    )
    assert out.shape == (0, 4, 64)
    # The engine's entry point reaches this very kernel when Triton is selected.
    kernel_backend("triton")
    q = randn(1, 4, 64)
    via_ops = ops.decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens(), 0.1
    )
    direct = decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens(), 0.1
    )
    assert torch.equal(via_ops, direct)
    assert ops.backend_for(q) == "triton"
    kernel_backend("auto")
    assert ops.backend_for(q) == ("triton" if DEV == "cuda" else "torch")


@pytest.mark.parametrize(
    "head_dim,num_q_heads,num_kv_heads,lens,config",
    [
        (64, 2, 2, [1, 15, 16, 17, 100], PrefillConfig(block_m=16, block_n=32)),  # GQA 1
        (128, 4, 1, [33, 1, 64, 65], None),  # GQA 4, production tiling
        (64, 8, 1, [1, 1531], PrefillConfig(block_m=64, block_n=64)),  # GQA 8, long prompt
        (80, 2, 1, [40, 17], PrefillConfig(block_m=16, block_n=16)),  # head dim not a power of 2
    ],
)
@uses_dot
def test_prefill_attention_packed(
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    lens: list[int],
    config: PrefillConfig | None,
) -> None:
    total = sum(lens)
    # q, k, v as the engine has them: strided views into one fused qkv projection.
    qkv = randn(total, num_q_heads + 2 * num_kv_heads, head_dim)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    if head_dim == 128:
        k = k.contiguous()  # K and V with different strides (rotated k copied, v still a view)
    cu = cu_seqlens(lens, DEV)
    scale = 1 / math.sqrt(head_dim)
    args = (q, k, v, cu, cu, max(lens), max(lens), scale)
    if config is None:
        out = prefill_attention(*args)
    else:
        out = prefill_attention_with(*args, None, None, None, config)
    expected = reference.prefill_attention(
        f64(q), f64(k), f64(v), f64(cu), f64(cu), max(lens), max(lens), scale
    )
    assert out.shape == q.shape and out.dtype == DT
    assert_close(out, expected, DT)


@pytest.mark.parametrize(
    "head_dim,num_q_heads,num_kv_heads,block_size,config",
    [
        (128, 8, 2, 16, PrefillConfig(block_m=16, block_n=16)),  # GQA 4
        (64, 8, 8, 32, None),  # GQA 1
    ],
)
@uses_dot
def test_prefill_attention_with_paged_prefix(
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    config: PrefillConfig | None,
) -> None:
    # (cached prefix, new tokens): no prefix, block edges, a 1-token chunk, a long random prefix.
    rng = random.Random(block_size)
    shapes = [
        (0, 5),
        (block_size, 1),
        (block_size - 1, block_size + 1),
        (block_size + 1, 2 * block_size),
        (rng.randint(100, 1500), rng.randint(1, 60)),
    ]
    new = [n for _, n in shapes]
    k_lens = [p + n for p, n in shapes]
    paged = make_paged_kv(k_lens, block_size, num_kv_heads, head_dim, DT, device=DEV)
    q = randn(sum(new), num_q_heads, head_dim)
    k, v = randn(sum(new), num_kv_heads, head_dim), randn(sum(new), num_kv_heads, head_dim)
    slots = torch.cat([paged.slot_mapping(i, p, p + n) for i, (p, n) in enumerate(shapes)])
    store_kvcache(k, v, paged.k_cache, paged.v_cache, slots)
    cu_q, cu_k = cu_seqlens(new, DEV), cu_seqlens(k_lens, DEV)
    scale = 1 / math.sqrt(head_dim)
    args = (q, k, v, cu_q, cu_k, max(new), max(k_lens), scale)
    cache_args = (paged.k_cache, paged.v_cache, paged.block_tables)
    if config is None:
        out = prefill_attention(*args, *cache_args)
    else:
        out = prefill_attention_with(*args, *cache_args, config)
    cache64 = f64(paged.kv_cache)
    expected = reference.prefill_attention(
        f64(q),
        f64(k),
        f64(v),
        f64(cu_q),
        f64(cu_k),
        max(new),
        max(k_lens),
        scale,
        cache64[:, paged.layer, 0],
        cache64[:, paged.layer, 1],
        f64(paged.block_tables),
    )
    assert_close(out, expected, DT)


def test_prefill_attention_empty_batch() -> None:
    q, k = randn(0, 4, 64), randn(0, 2, 64)
    cu = torch.zeros(1, dtype=torch.int32, device=DEV)
    assert prefill_attention(q, k, k, cu, cu, 0, 0, 0.125).shape == (0, 4, 64)


def test_decode_split_heuristic() -> None:
    from pdserve.kernels.triton_decode import choose_decode_config

    device = torch.device(DEV)
    # One long sequence: the context is split so more than one program works on it...
    long_one = choose_decode_config(1, 1, 32768, 128, device)
    assert long_one.num_splits > 1
    # ...but never into slivers shorter than ~256 tokens,
    assert choose_decode_config(1, 1, 512, 128, device).num_splits <= 2
    # and a batch that already fills the device is not split at all.
    assert choose_decode_config(4096, 8, 2048, 128, device).num_splits == 1
