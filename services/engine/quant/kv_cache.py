"""The paged KV cache's storage: float, or quantized values with per-token-head scales.

A float cache is the engine's ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]`` tensor.
A quantized one (int8 or float8_e4m3fn, ``--kv-cache-dtype``) is one byte buffer
``[num_blocks, block_bytes]``: each block row holds its values ``[layers, 2, block_size, kv_heads,
head_dim]`` and then their float32 scales ``[layers, 2, block_size, kv_heads]``, both strided views
of the buffer. Keeping the scales inside the block means everything that moves or copies blocks as
bytes (the UCX KV transfer, fork copies, the doctor's probe) carries them with no change, and a
pull moves exactly the quantized bytes plus 4 bytes per token-head vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.services.engine.huge_pages import huge_zeros

# --kv-cache-dtype -> the element type stored (auto: the model's dtype, unquantized)
KV_ELEMENT_TYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry and element type of one engine's paged KV cache."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # what the values are stored as
    quantized: bool

    @property
    def values_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def scales_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads if self.quantized else 0

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        scale = torch.empty(0, dtype=SCALE_DTYPE).element_size()
        return self.values_per_block * elem + self.scales_per_block * scale

    def allocate(
        self, num_blocks: int, device: torch.device | str, huge_pages: bool = False
    ) -> Tensor:
        """The cache's storage, zeroed: what the KV transfer moves, block i being row i.
        ``huge_pages``: on a CPU, in a region that asks for transparent huge pages
        (huge_pages.huge_zeros says why)."""
        if not self.quantized:
            geometry = (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
            shape, dtype = (num_blocks, *geometry), self.dtype
        else:
            shape, dtype = (num_blocks, self.bytes_per_block), torch.uint8
        if huge_pages and torch.device(device).type == "cpu":
            return huge_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    def split(self, storage: Tensor) -> tuple[Tensor, Tensor | None]:
        """(values [blocks, layers, 2, block_size, kv_heads, head_dim], scales [blocks, layers, 2,
        block_size, kv_heads, 1] float32 or None): views of ``storage``, no copy."""
        if not self.quantized:
            return storage, None
        num_blocks = storage.shape[0]
        geometry = (self.num_layers, 2, self.block_size, self.num_kv_heads)
        value_bytes = self.values_per_block  # one byte per int8 / fp8 value
        values = storage[:, :value_bytes].view(self.dtype)
        values = values.view(num_blocks, *geometry, self.head_dim)
        scales = storage[:, value_bytes:].view(SCALE_DTYPE).view(num_blocks, *geometry, 1)
        return values, scales

    def fingerprint(self) -> dict[str, object]:
        """What a KV puller must match besides the model geometry: the stored element type and
        where (and whether) the scales sit."""
        scales = "per_token_head_f32_after_values" if self.quantized else "none"
        return {"kv_dtype": str(self.dtype).removeprefix("torch."), "kv_scales": scales}


def kv_cache_spec(
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
) -> KVCacheSpec:
    """The spec of ``--kv-cache-dtype`` (auto: the model's dtype, unquantized)."""
    element = KV_ELEMENT_TYPES.get(kv_cache_dtype)
    dtype = model_dtype if element is None else element
    return KVCacheSpec(
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        quantized=element is not None,
    )
