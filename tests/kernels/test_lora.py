"""Batched multi-LoRA (``ops.lora_delta``): the Triton BGMV kernels against the plain-torch twin,
and the twin against a per-token loop over the adapters (the naive definition)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import ops
from pdserve.kernels.reference_lora import lora_delta
from tests.kernels.helpers import TEST_DEVICE, TEST_DTYPE, assert_close


def stacked(num_slots: int, rank: int, k: int, n: int, gen: torch.Generator):
    """Stacked adapters with slot 0 zeros, as the engine holds them."""
    a = torch.randn(num_slots, rank, k, generator=gen) * 0.1
    b = torch.randn(num_slots, rank, n, generator=gen) * 0.1
    a[0], b[0] = 0, 0
    return a, b


def naive(x, a, b, slots):
    return torch.stack([x[t] @ a[s].T @ b[s] for t, s in enumerate(slots.tolist())])


@pytest.mark.parametrize("shape", [(1, 64, 96, 8), (7, 130, 33, 16), (19, 256, 200, 48)])
def test_twin_is_the_per_token_product(shape) -> None:
    tokens, k, n, rank = shape
    gen = torch.Generator().manual_seed(tokens + k)
    a, b = stacked(5, rank, k, n, gen)
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64)
    slots = torch.randint(0, 5, (tokens,), generator=gen)
    got = lora_delta(x, a.double(), b.double(), slots)
    torch.testing.assert_close(got, naive(x, a.double(), b.double(), slots))
    # a base-model token gets nothing from any adapter
    assert not got[slots == 0].any()


@pytest.mark.parametrize("shape", [(1, 64, 96, 8), (7, 130, 33, 16), (19, 256, 200, 48)])
def test_triton_matches_twin(kernel_backend, shape) -> None:
    tokens, k, n, rank = shape
    gen = torch.Generator().manual_seed(tokens * k + n)
    a, b = stacked(5, rank, k, n, gen)
    x = torch.randn(tokens, k, generator=gen)
    slots = torch.randint(0, 5, (tokens,), generator=gen)
    slots[0] = 0  # a base-model row among adapter rows
    kernel_backend("triton")
    got = ops.lora_delta(
        x.to(TEST_DEVICE, TEST_DTYPE),
        a.to(TEST_DEVICE, TEST_DTYPE),
        b.to(TEST_DEVICE, TEST_DTYPE),
        slots.to(TEST_DEVICE),
    )
    expected = lora_delta(x.double(), a.double(), b.double(), slots)
    assert_close(got.double().cpu(), expected, TEST_DTYPE)
