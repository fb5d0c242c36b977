"""Host memory on huge pages: zeroed, writable, right shape and dtype, and the tiers use it."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from embcache.hostmem import HUGE_PAGE, host_zeros, huge_page_zeros
from embcache.tier import MemoryTier, RowBatch
from embcache.types import Tier

_HUGE = hasattr(mmap, "MADV_HUGEPAGE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (5, 7), (300_000, 8)])
def test_host_zeros_is_a_zeroed_writable_contiguous_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = host_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert not bool(t.any())
    if t.numel():
        t.view(-1)[-1] = 3
        t.view(-1)[0] = 2
        assert float(t.view(-1)[-1]) == 3.0 and float(t.view(-1)[0]) == 2.0
        assert int((t != 0).sum()) == 2


@pytest.mark.skipif(not _HUGE, reason="no madvise(MADV_HUGEPAGE) here")
def test_big_arrays_are_aligned_to_huge_pages_and_small_ones_are_plain() -> None:
    big = huge_page_zeros(3 * HUGE_PAGE + 5)
    assert big.shape == (3 * HUGE_PAGE + 5,) and big.ctypes.data % HUGE_PAGE == 0 and not big.any()
    small = huge_page_zeros(4096)
    assert small.shape == (4096,) and not small.any()


@pytest.mark.skipif(not _HUGE, reason="no madvise(MADV_HUGEPAGE) here")
def test_a_cpu_tier_keeps_its_rows_counters_and_index_on_huge_pages() -> None:
    # 600K rows: every array checked is over the 4 MiB below which memory stays plain
    tier = MemoryTier(Tier.HBM, 600_000, 16, 1, torch.float32, torch.device("cpu"))
    for name in ("weights", "meta"):  # meta: the rows' records (key, last, freq, flags)
        assert getattr(tier, name).data_ptr() % HUGE_PAGE == 0, name
    for name in ("keys", "last", "freq", "flags"):
        assert getattr(tier, name).untyped_storage().data_ptr() == tier.meta.data_ptr(), name
    assert tier.index._tab.ctypes.data % HUGE_PAGE == 0  # type: ignore[attr-defined]
    # and it works as a tier: rows put in are found, counted and gathered
    n = 1000
    keys = torch.arange(n, dtype=torch.int64) * 7919 - 10**15
    weights = torch.randn(n, 16)
    slots = tier.insert(RowBatch(keys, weights, torch.zeros(n, 1), torch.zeros(n, dtype=torch.float64),
                                 torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.bool),
                                 torch.zeros(n, dtype=torch.int32)))
    out = torch.zeros(n, 16)
    found, hits = tier.find_touch_gather(keys.flip(0), 1.0, 5, out)
    assert hits == n and torch.equal(found, slots.flip(0)) and torch.equal(out, weights.flip(0))
    assert bool((tier.freq[slots] == 1.0).all()) and bool((tier.last[slots] == 5).all())


def test_huge_page_zeros_of_zero_bytes() -> None:
    assert huge_page_zeros(0).shape == (0,) and huge_page_zeros(0).dtype == np.uint8
