"""Plain-torch twin of the batched LoRA op (``ops.lora_delta``): the CPU production path and
the oracle of ``triton_lora``.

Every token of the flat batch names a slot of the stacked adapters (slot 0 holds zeros: the
base model). Rather than gathering each token's A and B (a [T, R, K] copy per layer), the twin
runs the shrink against every slot's A at once, zeroes the columns of the slots a token does not
use, and expands against every slot's B: two dense matmuls whose cost grows with the slot count
(a handful) and the rank (16 or so), never with the number of sequences, and no Python loop.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lora_delta(x: Tensor, a: Tensor, b: Tensor, slots: Tensor) -> Tensor:
    """x [T, K], a [S, R, K], b [S, R, N] (the scaling folded in; slot 0 zeros), slots [T] int
    -> [T, N], row t being x[t] @ a[slots[t]].T @ b[slots[t]], in x's dtype (at least fp32)."""
    # slot 0 (the base model) is zeros by contract: only slots 1.. are multiplied
    a, b = a[1:], b[1:]
    num_slots, rank, k = a.shape
    cdt = torch.promote_types(x.dtype, torch.float32)
    h = x.to(cdt) @ a.reshape(num_slots * rank, k).to(cdt).T  # [T, (S - 1) * R]
    own = slots[:, None] == torch.arange(1, num_slots + 1, device=slots.device)[None, :]
    h = (h.view(-1, num_slots, rank) * own[..., None]).view(-1, num_slots * rank)
    return (h @ b.reshape(num_slots * rank, -1).to(cdt)).to(x.dtype)
