"""Shared builders and oracles for the kernel tests: a real block-major paged cache, naive math."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

# The GPU check (perf/gpu_check.sh) reruns the Triton tests on CUDA in bf16; CI runs them on CPU
# in fp32 under the Triton interpreter.
TEST_DTYPE: torch.dtype = getattr(torch, os.environ.get("PDSERVE_KERNEL_TEST_DTYPE", "float32"))
TEST_DEVICE: str = os.environ.get("PDSERVE_KERNEL_TEST_DEVICE", "cpu")

# Error bounds against a float64 oracle, per dtype of the kernel under test: (atol, rtol).
# fp32 accumulation over <= 2k keys stays near 1e-6; bf16 inputs carry ~4e-3 relative rounding,
# and attention outputs are convex mixes of bf16 values, so a few bf16 ulps of 1 is the bound.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype | None = None) -> None:
    """Compare in float64 with the explicit bound for `dtype` (default: actual's dtype)."""
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(
        actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol, equal_nan=False
    )


@dataclass
class PagedKV:
    """One engine-shaped cache [blocks, layers, 2, block_size, Hk, D] and sequences laid into it.

    Tests read and write through the strided per-layer views, exactly as the engine does.
    """

    kv_cache: Tensor
    layer: int
    block_tables: Tensor  # [B, max_blocks] int32, unused tail entries padded
    lens: list[int]

    @property
    def k_cache(self) -> Tensor:
        return self.kv_cache[:, self.layer, 0]

    @property
    def v_cache(self) -> Tensor:
        return self.kv_cache[:, self.layer, 1]

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[3]

    def context_lens(self) -> Tensor:
        return torch.tensor(self.lens, dtype=torch.int32, device=self.kv_cache.device)

    def sequence_kv(self, seq: int) -> tuple[Tensor, Tensor]:
        """K and V [len, Hk, D] of one sequence, read token by token through its block table."""
        keys, values = [], []
        for pos in range(self.lens[seq]):
            block = int(self.block_tables[seq, pos // self.block_size])
            keys.append(self.k_cache[block, pos % self.block_size])
            values.append(self.v_cache[block, pos % self.block_size])
        hk, d = self.kv_cache.shape[4], self.kv_cache.shape[5]
        if not keys:
            empty = self.kv_cache.new_empty(0, hk, d)
            return empty, empty
        return torch.stack(keys), torch.stack(values)

    def slot_mapping(self, seq: int, start: int, end: int) -> Tensor:
        """Slots of positions [start, end) of one sequence."""
        pos = torch.arange(start, end)
        blocks = self.block_tables[seq].cpu().long()[pos // self.block_size]
        return (blocks * self.block_size + pos % self.block_size).to(self.kv_cache.device)


def make_paged_kv(
    lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
    num_layers: int = 2,
    layer: int = 1,
    spare_blocks: int = 3,
    pad_value: int = -1,
    seed: int = 0,
) -> PagedKV:
    """Random cache contents, each sequence on a shuffled set of blocks (not in order)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + spare_blocks
    kv_cache = torch.randn(
        num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen
    ).to(device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    # One padding column beyond the longest sequence, as a table sized for max_model_len has.
    width = max(needed, default=0) + 1
    table = torch.full((len(lens), width), pad_value, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(needed):
        table[i, :n] = order[taken : taken + n].to(torch.int32)
        taken += n
    return PagedKV(kv_cache, layer, table.to(device), list(lens))


def naive_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, q_offset: int) -> Tensor:
    """Causal GQA attention of one sequence in float64; query j sits at position q_offset + j."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = q_offset + torch.arange(q.shape[0])
    allowed = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def cu_seqlens(lens: list[int], device: str = "cpu") -> Tensor:
    """[B+1] int32 prefix sums of the sequence lengths, starting at 0."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lens, dtype=torch.int32), dim=0, out=out[1:])
    return out.to(device)
