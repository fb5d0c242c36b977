"""A tier's per-row bytes are what row_bytes() counts; its packed flags (occupied, dirty, pins) and
its batch-sized scratch (the eviction sample's filter, the fused update) behave as the per-row
arrays they replaced."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from embcache import EmbeddingCache
from embcache.fused import fused_available, fused_update
from embcache.optim import OptimizerParams, state_width
from embcache.sample_filter import distinct_evictable, distinct_evictable_torch
from embcache.slot_table import SlotTable
from embcache.tier import _BOOKKEEPING_BYTES, DIRTY, OCCUPIED, MemoryTier, RowBatch, index_row_bytes
from embcache.types import Tier

_ROOT = Path(__file__).resolve().parent.parent


def _per_row_arrays(tier: MemoryTier) -> list[Any]:
    """Every tensor or numpy array the tier holds whose first dimension is its capacity."""
    found = []
    for value in vars(tier).values():
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim and value.shape[0] == tier.capacity:
            found.append(value)
    return found


def _ptr(a: Any) -> int:
    # the memory an array lives in (a view's is its base's: keys, last, freq and flags are views of meta)
    return int(a.untyped_storage().data_ptr()) if isinstance(a, torch.Tensor) else int(a.ctypes.data)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_a_tier_allocates_exactly_the_bookkeeping_row_bytes_counts(device: str, make_cache: Any,
                                                                   optimizer: str) -> None:
    from embcache import TableConfig

    dim = 8
    cache: EmbeddingCache = make_cache(hbm_rows=512, ddr_rows=1024, device=device,
                                       tables=[TableConfig(name="t", dim=dim, optimizer=optimizer, lr=0.1)])
    t = cache._tables["t"]
    keys = torch.arange(48)
    cache.lookup("t", keys)
    cache.apply_gradients("t", keys, torch.ones(48, dim))  # all in HBM: the fused update (CPU)
    scratch = t.hbm._fused_scratch
    if scratch is not None:  # its scratch is sized by the batch (48 keys), not by the tier (512 rows)
        assert t.hbm.device.type == "cpu" and scratch.table is t.hbm._table
        sizes = [a.shape[0] for a in (*vars(scratch).values(), *vars(scratch.table).values())
                 if isinstance(a, np.ndarray)]
        assert len(sizes) == 3 and max(sizes) <= 128, sizes
    cache.lookup("t", torch.arange(1000, 1700))  # HBM full, the rest to DDR, evictions sampled
    cache.begin_pass({"t": torch.arange(100, 140)})
    cache.lookup("t", torch.arange(100, 140))
    cache.end_pass().result(timeout=30)
    per_row_state = 4 * state_width(optimizer, dim)
    for tier in (t.hbm, t.ddr):
        assert tier.capacity > 0 and len(tier) > 0
        allocated = sum(a.numel() * a.element_size() for a in tier.arrays())
        assert allocated == tier.capacity * (4 * dim + per_row_state + _BOOKKEEPING_BYTES)
        assert tier.row_bytes == 4 * dim + per_row_state + _BOOKKEEPING_BYTES + index_row_bytes(tier.device)
        if tier.device.type == "cpu":  # NumbaIndex: exactly its 8 bytes per row (TorchIndex: tests/test_index.py)
            assert tier.index.nbytes == index_row_bytes(tier.device) * tier.capacity
        # nothing per row outside arrays(): a new array would have to be listed (and counted)
        listed = {_ptr(a) for a in tier.arrays()}
        for a in _per_row_arrays(tier):
            assert _ptr(a) in listed, (tier.tier, a.dtype, a.shape)
    if device == "cpu" and fused_available(t.hbm.weights):
        assert t.hbm._fused_scratch is not None  # the update above went through the fused kernel


def test_the_docs_state_the_bookkeeping_bytes() -> None:
    for page in ("docs/concepts/tiers.md", "embcache/sizing.py"):
        text = (_ROOT / page).read_text()
        stated = {int(n) for n in re.findall(r"(\d+) bytes of bookkeeping", text)}
        assert stated == {_BOOKKEEPING_BYTES}, page


def _rows(keys: torch.Tensor, dirty: list[bool], pins: list[int], dim: int = 4) -> RowBatch:
    n = keys.numel()
    return RowBatch(keys, torch.randn(n, dim), torch.zeros(n, 1), torch.arange(n, dtype=torch.float64),
                    torch.zeros(n, dtype=torch.int64), torch.tensor(dirty), torch.tensor(pins, dtype=torch.int32))


def test_packed_flags_keep_occupied_dirty_and_pins_apart() -> None:
    tier = MemoryTier(Tier.HBM, 8, 4, 1, torch.float32, torch.device("cpu"))
    keys = torch.tensor([10, 11, 12, 13])
    slots = tier.insert(_rows(keys, [True, False, True, False], [0, 3, 1, 0]))
    back = tier.read(slots)
    assert back.dirty.tolist() == [True, False, True, False] and back.pins.tolist() == [0, 3, 1, 0]
    assert back.pins.dtype == torch.int32 and back.dirty.dtype == torch.bool
    assert sorted(tier.dirty_slots().tolist()) == sorted(slots[[0, 2]].tolist())
    assert sorted(tier.occupied_slots().tolist()) == sorted(slots.tolist())
    assert tier.pinned_count() == 2
    # a count below 0 stops at 0 and leaves the row's other bits alone
    tier.add_pins(slots, -2)
    assert tier.pins_at(slots).tolist() == [0, 1, 0, 0]
    assert tier.dirty_at(slots).tolist() == [True, False, True, False] and len(tier.occupied_slots()) == 4
    # masked: only where True (the others may be -1, as a GPU caller passes them)
    tier.add_pins(torch.tensor([int(slots[0]), -1, int(slots[3])]), 5, where=torch.tensor([True, False, True]))
    assert tier.pins_at(slots).tolist() == [5, 1, 0, 5]
    tier.set_dirty(slots, torch.tensor([False, True, False, True]))
    assert tier.dirty_at(slots).tolist() == [False, True, False, True] and tier.pins_at(slots).tolist() == [5, 1, 0, 5]
    tier.write(slots[:1], torch.ones(1, 4), torch.ones(1, 1))
    assert tier.dirty_at(slots).tolist() == [True, True, False, True]
    # eviction sees pins: only slot 2 (no pins) can go
    victims, _ = tier.lowest(4, lambda s: tier.freq.index_select(0, s), sample=8)
    assert victims.tolist() == [int(slots[2])]
    assert tier.evictable_mask().nonzero().flatten().tolist() == [int(slots[2])]
    tier.remove(slots[2:3])
    assert int(tier.flags[slots[2]]) == 0 and tier.pinned_count() == 3 and len(tier) == 3
    # the freed slot comes back with no stale bits
    again = tier.insert(_rows(torch.tensor([99]), [False], [0]))
    assert tier.read(again).dirty.tolist() == [False] and tier.read(again).pins.tolist() == [0]


def _marks_reference(cand: torch.Tensor, exclude: torch.Tensor | None, flags: torch.Tensor) -> torch.Tensor:
    """The filter as the tier ran it before, with an int32 mark per slot: the last draw of a slot
    wins (a serial index_copy_), excluded slots are unmarked, then occupied and unpinned only."""
    mark = torch.full(flags.shape, -1, dtype=torch.int32)
    idx = torch.arange(cand.numel(), dtype=torch.int32)
    mark.index_copy_(0, cand, idx)
    if exclude is not None:
        mark.index_fill_(0, exclude, -1)
    ok = (mark.index_select(0, cand) == idx) & ((flags.index_select(0, cand) & ~DIRTY) == OCCUPIED)
    return torch.masked_select(cand, ok)


@pytest.mark.parametrize(("capacity", "n", "n_exclude"), [(50, 20, 0), (1000, 400, 50), (100_000, 16_384, 4_000),
                                                          (64, 500, 64)])
def test_the_eviction_filter_keeps_what_the_slot_marks_kept(capacity: int, n: int, n_exclude: int) -> None:
    gen = torch.Generator().manual_seed(n)
    flags = torch.randint(0, 16, (capacity,), dtype=torch.int32, generator=gen)  # all combinations of bits
    cand = torch.randint(0, capacity, (n,), generator=gen)
    exclude = torch.randint(0, capacity, (n_exclude,), generator=gen) if n_exclude else None
    with torch.inference_mode():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the reference's index_copy_ is serial (last draw wins) on one thread
        try:
            want = _marks_reference(cand, exclude, flags)
        finally:
            torch.set_num_threads(threads)
    table = SlotTable()
    for _ in range(2):  # the table is reused as the tier reuses it
        assert torch.equal(distinct_evictable(cand, exclude, flags, ~DIRTY, OCCUPIED, table), want)
    assert torch.equal(distinct_evictable_torch(cand, exclude, flags, ~DIRTY, OCCUPIED), want)


def test_a_fused_update_right_after_an_eviction_sample_sums_duplicates_right() -> None:
    # the eviction sample's filter and the fused update share the tier's batch-sized slot table
    cap, dim = 4096, 4
    tier = MemoryTier(Tier.HBM, cap, dim, 1, torch.float32, torch.device("cpu"))
    n = 3000
    slots = tier.insert(RowBatch(torch.arange(n), torch.zeros(n, dim), torch.zeros(n, 1),
                                 torch.rand(n, dtype=torch.float64), torch.zeros(n, dtype=torch.int64),
                                 torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.int32)))
    gen = torch.Generator().manual_seed(1)
    victims, _ = tier.lowest(64, lambda s: tier.freq.index_select(0, s), sample=8, exclude=slots[:500],
                             generator=gen)  # 512 sampled of 4,096 slots: the sampled path
    assert victims.numel() == 64 and not bool(torch.isin(victims, slots[:500]).any())
    assert int(victims.unique().numel()) == 64
    if fused_available(tier.weights):
        upd = slots[:10].repeat(2)
        fused_update("sgd", OptimizerParams(lr=1.0, eps=1e-8, beta1=0.9, beta2=0.999), tier.weights, tier.state,
                     tier.flags, DIRTY, upd, torch.ones(20, dim), tier.fused_scratch())
        assert torch.equal(tier.weights.index_select(0, slots[:10]), torch.full((10, dim), -2.0))
        assert torch.equal(tier.weights.index_select(0, slots[10:]), torch.zeros(n - 10, dim))
        assert tier.dirty_at(slots[:10]).all() and not tier.dirty_at(slots[10:]).any()


def test_the_gpu_path_of_the_eviction_sample_picks_the_victims_the_cpu_kernel_picks(fakecuda: Any,
                                                                                     monkeypatch: Any) -> None:
    # On "cuda" the sample's filter is torch operations (sort, searchsorted); on the CPU a compiled
    # kernel. The same draws (same seed) must give the same victims, with no host sync in the
    # filter beyond the final selection's.
    n, cap = 3000, 4096
    victims = []
    if not fakecuda.stand_in:  # a real GPU's generator draws other numbers from the same seed: draw on the host
        host_randint = torch.randint

        def randint(low: int, high: int, size: tuple[int, ...], *, device: Any = None,
                    generator: Any = None) -> torch.Tensor:
            drawn = host_randint(low, high, size, generator=torch.Generator().manual_seed(generator.initial_seed()))
            return drawn.pin_memory().to(device, non_blocking=True)  # from pinned memory: no sync

        monkeypatch.setattr(torch, "randint", randint)
    for device in ("cpu", "cuda"):
        tier = MemoryTier(Tier.HBM, cap, 4, 1, torch.float32, torch.device(device))
        freq = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        pins = (torch.arange(n) % 7 == 0).to(torch.int32)  # some rows pinned
        slots = tier.insert(RowBatch(torch.arange(n), torch.zeros(n, 4), torch.zeros(n, 1), freq,
                                     torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.bool), pins))
        gen = torch.Generator(device=device).manual_seed(3)
        with fakecuda.count() as c:
            v, _ = tier.lowest(64, lambda s, t=tier: t.freq.index_select(0, s), sample=8, exclude=slots[:700],
                               generator=gen)
        if device == "cuda":
            assert len(c.syncs) <= 1, c.syncs  # the masked_select of the kept draws
        victims.append(v.cpu())
    assert victims[0].numel() == 64 and torch.equal(victims[0], victims[1])
