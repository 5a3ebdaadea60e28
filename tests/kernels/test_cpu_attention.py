"""kernels/cpu_attention.cpp (issue 42): the compiled decode step's paged attention as one C++ op
over a layer's block-major pages, against the reference twin: ragged contexts at the block
edges, GQA group sizes with and without a register-tiled kernel, stale and padded table slots,
a padding row, bfloat16 pages, every thread count, and inside a compiled graph."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from pdserve.kernels import cpu_gemv, reference
from tests.kernels.helpers import assert_close, make_paged_kv
from tests.kernels.test_paged_decode import edge_lens, queries, with_stale_slot

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no AVX2 kernel on this CPU")


def layer_pages(kv) -> torch.Tensor:
    """The layer's [blocks, 2, block_size, Hk, D] view, as the engine hands the op."""
    return kv.kv_cache[:, kv.layer]


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    # group 3, 1, 2 and 4 take tiled kernels; 5 and a head of 40 go a query head at a time
    [(9, 3, 64, 16), (4, 4, 32, 16), (8, 4, 64, 8), (8, 2, 128, 8), (10, 2, 32, 4), (6, 3, 40, 16)],
)
def test_matches_twin(num_q_heads, num_kv_heads, head_dim, block_size) -> None:
    lens = edge_lens(block_size) + [3 * block_size + 5]
    kv = make_paged_kv(lens, block_size, num_kv_heads, head_dim, torch.float32, num_layers=3)
    q = queries(len(lens), num_q_heads, head_dim, torch.float32)
    tables = with_stale_slot(kv.block_tables, kv.kv_cache.shape[0])
    lens_t = kv.context_lens()
    out = cpu_gemv.paged_attention(q, layer_pages(kv), tables, lens_t, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = reference.decode_attention(q, kv.k_cache, kv.v_cache, tables, lens_t, head_dim**-0.5)
    assert_close(out, expected)
    assert not out[lens.index(0)].any()  # the padding row: zeros, not NaN


@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_pages_and_thread_counts(threads: int) -> None:
    lens = [3, 16, 33, 0, 70, 130]
    kv = make_paged_kv(lens, 16, 3, 64, torch.bfloat16, pad_value=0)
    q = queries(len(lens), 9, 64, torch.bfloat16)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.context_lens(), 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_gemv.paged_attention(q, layer_pages(kv), *args[3:])
        # fewer rows than threads: a task a (row, KV head)
        few = cpu_gemv.paged_attention(q[:1], layer_pages(kv), *(a[:1] for a in args[3:5]), 0.125)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == torch.bfloat16
    assert_close(out, reference.decode_attention(*args))
    assert torch.equal(few, out[:1])


def test_rejects_pages_that_are_not_block_major() -> None:
    kv = make_paged_kv([5], 16, 2, 32, torch.float32)
    q = queries(1, 4, 32, torch.float32)
    transposed = layer_pages(kv).transpose(3, 4).contiguous().transpose(3, 4)
    with pytest.raises(RuntimeError, match="block-major"):
        cpu_gemv.paged_attention(q, transposed, kv.block_tables, kv.context_lens(), 0.1)


def test_an_opaque_op_in_a_compiled_graph_serves_new_sizes_without_recompiling() -> None:
    def step(q, pages, tables, lens):
        return cpu_gemv.paged_attention(q * 2, pages, tables, lens, 0.125) + 1

    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    kv = make_paged_kv([17, 3, 90, 64, 1], 16, 3, 64, torch.float32, pad_value=0)
    q = queries(5, 9, 64, torch.float32)
    for rows in (4, 5):  # one cache, as the engine's; sizes 2 and 3 would be duck-sized
        args = (q[:rows], layer_pages(kv), kv.block_tables[:rows], kv.context_lens()[:rows])
        assert_close(compiled(*args), step(*args))
    assert counter.frame_count == 1
