"""Weights moved into a huge-page region keep their values, layouts and sharing; the KV cache
allocated in one is what an ordinary allocation would be."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pdserve.services.engine.huge_pages import (
    ALIGN,
    HUGE_PAGE,
    huge_region,
    huge_zeros,
    move_to_huge_pages,
    thp_mode,
)
from pdserve.services.engine.quant.kv_cache import kv_cache_spec


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's LM head
        self.proj = nn.Linear(32, 48)
        # column-major, as model_setup.lay_out_for_gemv stores float32 linears on a CPU
        self.proj.weight.data = self.proj.weight.data.t().contiguous().t()
        self.register_buffer("table", torch.arange(40.0).view(8, 5)[:, 1:])  # a strided view
        self.small = nn.Parameter(torch.ones(3))


def test_a_region_is_aligned_to_a_huge_page() -> None:
    storage, start = huge_region(3 * 4096)
    assert (storage.data_ptr() + start) % HUGE_PAGE == 0
    assert storage.nbytes() >= start + 3 * 4096


def test_moved_tensors_keep_values_strides_and_sharing() -> None:
    torch.manual_seed(0)
    model = _Tied()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    strides = {name: t.stride() for name, t in model.state_dict().items()}
    small_ptr = model.small.data_ptr()
    large = (model.embed.weight, model.proj.weight, model.proj.bias, model.table)
    old_offsets = [t.storage_offset() for t in large]
    old_bytes = sum(t.untyped_storage().nbytes() for t in large)

    moved = move_to_huge_pages(model, min_bytes=128)

    state = model.state_dict()
    for name, t in state.items():
        torch.testing.assert_close(t, before[name], rtol=0, atol=0)
        assert t.stride() == strides[name], name
    assert model.head.weight is model.embed.weight
    assert model.proj.weight.t().is_contiguous()
    region = model.embed.weight.untyped_storage().data_ptr()
    for t, old_offset in zip(large, old_offsets, strict=True):
        assert t.untyped_storage().data_ptr() == region  # one region for every large storage
        assert (t.data_ptr() - old_offset * t.element_size()) % ALIGN == 0  # its old storage's
    assert model.small.data_ptr() == small_ptr  # under min_bytes: left where it was
    assert old_bytes <= moved < old_bytes + len(large) * ALIGN
    # the module still computes what it did
    x = torch.randn(2, 32)
    torch.testing.assert_close(model.proj(x), x @ before["proj.weight"].T + before["proj.bias"])


def test_a_model_with_nothing_large_is_left_alone() -> None:
    model = nn.Linear(4, 4)
    ptr = model.weight.data_ptr()
    assert move_to_huge_pages(model) == 0
    assert model.weight.data_ptr() == ptr


def test_a_kernel_without_thp_keeps_ordinary_pages(monkeypatch) -> None:
    """madvise(MADV_HUGEPAGE) fails with EINVAL on a kernel built without THP: the weights
    still move, into ordinary pages, and the model loads."""
    import mmap

    class _NoThp(mmap.mmap):
        def madvise(self, *args) -> None:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", _NoThp)
    model = nn.Linear(512, 512)
    before = model.weight.detach().clone()
    assert move_to_huge_pages(model, min_bytes=1024) >= before.numel() * 4
    torch.testing.assert_close(model.weight, before, rtol=0, atol=0)


def _thp_eligible(t: torch.Tensor) -> bool:
    """Whether the kernel marks the mapping holding ``t`` as huge-page eligible (smaps)."""
    address = t.data_ptr()
    eligible = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            eligible = False if start <= address < end else None
        elif eligible is False and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_kv_cache_can_live_in_huge_pages(kv_dtype: str) -> None:
    """The engine's KV cache (float, or quantized bytes) in a huge-page region: the same shape
    and dtype as an ordinary allocation, zeroed, writable, on a 2 MiB boundary, and marked for
    huge pages where THP waits for madvise."""
    spec = kv_cache_spec(kv_dtype, torch.float32, 8, 16, 4, 64)  # 256 or 80 KiB a block
    blocks = 40  # over 2 MiB: smaller regions hold no whole huge page
    plain = spec.allocate(blocks, torch.device("cpu"))
    huge = spec.allocate(blocks, torch.device("cpu"), huge_pages=True)
    assert huge.shape == plain.shape and huge.dtype == plain.dtype and huge.is_contiguous()
    assert huge.data_ptr() % HUGE_PAGE == 0
    assert not huge.any()
    huge[2].fill_(3)
    assert int(huge.count_nonzero()) == huge[2].numel()
    if thp_mode() == "madvise":
        assert _thp_eligible(huge) and not _thp_eligible(plain)


def test_huge_zeros_of_any_shape() -> None:
    t = huge_zeros((7, 3), torch.bfloat16)
    assert t.shape == (7, 3) and t.dtype == torch.bfloat16 and not t.any()
    assert t.untyped_storage().nbytes() >= 7 * 3 * 2
