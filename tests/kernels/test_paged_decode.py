"""kernels/paged_decode.py (issue 42): paged decode attention that reads the pages in place,
against its reference twin (reference.decode_attention, no plan), eagerly and compiled by
Inductor with a dynamic number of blocks per table.

Caches are the engine's: one block-major [blocks, layers, 2, block_size, Hk, D] tensor read
through its strided per-layer views, or a quantized one's byte buffer split into values and
scales (services/engine/quant/kv_cache.py). Tables name shuffled blocks and pad with -1 or a
stale id. Compiled cases are few and small: each compile takes seconds on 2 cores.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

from pdserve.kernels import reference
from pdserve.kernels.paged_decode import paged_decode_attention
from pdserve.kernels.reference_quant import quantize_kv
from pdserve.services.engine.quant.kv_cache import kv_cache_spec
from tests.kernels.helpers import assert_close, make_paged_kv


def edge_lens(block_size: int) -> list[int]:
    """Contexts at the block edges, a long one, and a padding row (context 0)."""
    return [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, 0]


def queries(batch: int, num_q_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_q_heads, head_dim, generator=gen).to(dtype)


def twin(q, k_cache, v_cache, tables, lens, scale, k_scale=None, v_scale=None):
    """The reference, planning for itself (plan=None)."""
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    return reference.decode_attention(q, k_cache, v_cache, tables, lens, scale, **scales)


def with_stale_slot(tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first padding slot of row 0 holds an id past the cache, as a stale table might."""
    tables = tables.clone()
    used = int((tables[0] >= 0).sum())
    tables[0, used] = num_blocks + 5
    return tables


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 128, 8), (6, 2, 32, 4)],
)
def test_eager_matches_twin(num_q_heads, num_kv_heads, head_dim, block_size) -> None:
    lens = edge_lens(block_size)
    kv = make_paged_kv(lens, block_size, num_kv_heads, head_dim, torch.float32, num_layers=3)
    q = queries(len(lens), num_q_heads, head_dim, torch.float32)
    tables = with_stale_slot(kv.block_tables, kv.kv_cache.shape[0])
    args = (q, kv.k_cache, kv.v_cache, tables, kv.context_lens(), head_dim**-0.5)
    out = paged_decode_attention(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, twin(*args))
    assert not out[-1].any()  # the padding row: zeros, not NaN


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_eager_dtypes(dtype) -> None:
    lens = [3, 16, 33, 0, 70]
    kv = make_paged_kv(lens, 16, 3, 64, dtype, pad_value=0)
    q = queries(len(lens), 9, 64, dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.context_lens(), 0.125)
    out = paged_decode_attention(*args)
    assert out.dtype == dtype
    assert_close(out, twin(*args))


def quantized_cache(
    kv_dtype: str, lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, seed: int = 0
):
    """A quantized engine cache (values and scales in one byte buffer) with random K/V in layer 1;
    returns (k, v, k_scale, v_scale, tables), all views of the buffer."""
    gen = torch.Generator().manual_seed(seed)
    spec = kv_cache_spec(kv_dtype, torch.float32, 2, block_size, num_kv_heads, head_dim)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 2
    values, scales = spec.split(spec.allocate(num_blocks, torch.device("cpu")))
    assert scales is not None
    for kind in (0, 1):
        x = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
        stored, scale = quantize_kv(x, spec.dtype)
        values[:, 1, kind].copy_(stored)
        scales[:, 1, kind].copy_(scale[..., None])
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(needed) + 1), -1, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(needed):
        tables[i, :n] = order[taken : taken + n].to(torch.int32)
        taken += n
    return values[:, 1, 0], values[:, 1, 1], scales[:, 1, 0], scales[:, 1, 1], tables


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_eager_quantized_cache(kv_dtype) -> None:
    lens = edge_lens(16)
    k, v, k_scale, v_scale, tables = quantized_cache(kv_dtype, lens, 16, 2, 32)
    q = queries(len(lens), 8, 32, torch.float32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(q, k, v, tables, lens_t, 0.2, k_scale, v_scale)
    # the same stored values and scales: only the order of fp32 roundings differs
    assert_close(out, twin(q, k, v, tables, lens_t, 0.2, k_scale, v_scale))


def allocated_elements(code: str, num_table_blocks: int) -> list[int]:
    """Element counts of the buffers Inductor's wrapper allocates, the dynamic block count
    (a symbol s<N>) set to ``num_table_blocks``."""
    counts = []
    for shape in re.findall(r"empty_strided_cpu\(\(([^)]*)\)", code):
        dims = re.sub(r"\bs\d+\b", str(num_table_blocks), shape).rstrip(",").split(",")
        count = 1
        for dim in dims:
            count *= int(eval(dim, {"__builtins__": {}}))  # products of ints and the symbol
        counts.append(count)
    return counts


def compile_twice(q, k_cache, v_cache, tables, lens, scale, scales=(), wider=3):
    """Compile with a dynamic block count, call with ``tables`` and with ``wider`` more padding
    columns (same batch); returns (both outputs, the first call's code, compiles)."""
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled = torch.compile(paged_decode_attention, backend=counter, fullgraph=True)
    torch._dynamo.mark_dynamic(tables, 1)
    first, code = run_and_get_code(compiled, q, k_cache, v_cache, tables, lens, scale, *scales)
    padded = torch.cat([tables, tables.new_zeros(tables.shape[0], wider)], dim=1)
    second = compiled(q, k_cache, v_cache, padded, lens, scale, *scales)
    return (first, second), code, counter.frame_count


def test_compiled_reads_pages_in_place_without_recompiling() -> None:
    """SmolLM2's attention shape through the strided view of a 6-d cache: matches the twin, keeps
    no [B, S, Hk, D] copy of the pages, and a second block count reuses the graph."""
    lens = edge_lens(16)
    kv = make_paged_kv(lens, 16, 3, 64, torch.float32, num_layers=3)
    q = queries(len(lens), 9, 64, torch.float32)
    tables = with_stale_slot(kv.block_tables, kv.kv_cache.shape[0])
    lens_t = kv.context_lens()
    (first, second), code, compiles = compile_twice(
        q, kv.k_cache, kv.v_cache, tables, lens_t, 0.125
    )
    expected = twin(q, kv.k_cache, kv.v_cache, tables, lens_t, 0.125)
    assert_close(first, expected)
    assert_close(second, expected)
    assert compiles == 1
    batch, num_table_blocks = tables.shape
    pages = batch * num_table_blocks * 16 * 3 * 64  # one gathered copy of K (or V)
    counts = allocated_elements(code[0], num_table_blocks)
    assert counts and max(counts) * 2 < pages, counts  # scores and per-block partials only
    assert kv.kv_cache.numel() > pages  # so a copy of the cache would have shown too


@pytest.mark.parametrize(
    ("kv_dtype", "q_dtype"), [("int8", torch.bfloat16), ("fp8_e4m3", torch.float32)]
)
def test_compiled_quantized_cache(kv_dtype, q_dtype) -> None:
    lens = [0, 1, 31, 32, 33, 50]
    k, v, k_scale, v_scale, tables = quantized_cache(kv_dtype, lens, 16, 2, 32, seed=3)
    q = queries(len(lens), 8, 32, q_dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    (first, second), _, compiles = compile_twice(
        q, k, v, tables, lens_t, 0.2, scales=(k_scale, v_scale)
    )
    expected = twin(q, k, v, tables, lens_t, 0.2, k_scale, v_scale)
    assert first.dtype == q_dtype
    assert_close(first, expected)
    assert_close(second, expected)
    assert compiles == 1
