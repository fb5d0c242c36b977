"""FreeSlots: a tier's free slots without an array per row, against the stack it replaced."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embcache import free_slots
from embcache.free_slots import FreeSlots


class StackReference:
    """The former free-slot stack: int32 [capacity], popped from the end, freed slots pushed back."""

    def __init__(self, capacity: int) -> None:
        self.stack = list(range(capacity - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        out = self.stack[len(self.stack) - n:]
        del self.stack[len(self.stack) - n:]
        return out

    def give(self, slots: list[int]) -> None:
        self.stack.extend(slots)


class Tier:
    """The occupied bits a tier keeps, fed by the same takes and gives."""

    def __init__(self, capacity: int) -> None:
        self.occupied = torch.zeros(capacity, dtype=torch.bool)
        self.free = FreeSlots(capacity, torch.device("cpu"), lambda: self.occupied)

    def take(self, n: int) -> list[int]:
        slots = self.free.take(n)
        assert slots.dtype == torch.int64 and slots.numel() == n
        assert not bool(self.occupied[slots].any()), "handed out a slot that holds a row"
        assert torch.unique(slots).numel() == n, "handed out a slot twice"
        self.occupied[slots] = True
        return slots.tolist()

    def give(self, slots: list[int]) -> None:
        t = torch.tensor(slots, dtype=torch.int64)
        self.occupied[t] = False
        self.free.give(t)


def test_slots_come_out_in_the_order_the_stack_gave_them() -> None:
    rng = np.random.default_rng(0)
    capacity = 500
    tier, ref = Tier(capacity), StackReference(capacity)
    for _ in range(300):
        n_used = capacity - tier.free.n_free
        if rng.random() < 0.5 and tier.free.n_free:
            n = int(rng.integers(1, tier.free.n_free + 1))
            assert tier.take(n) == ref.take(n)
        elif n_used:
            used = torch.nonzero(tier.occupied).flatten().numpy()
            gone = rng.permutation(used)[: int(rng.integers(1, n_used + 1))].tolist()
            tier.give(gone)
            ref.give(gone)
        assert tier.free.n_free == len(ref.stack)


def test_freed_slots_beyond_the_list_are_found_again_by_a_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(free_slots, "PENDING_MAX", 16)
    capacity = 200
    tier = Tier(capacity)
    tier.take(150)
    gone = list(range(3, 150, 2))  # 74 freed at once: 58 more than the list keeps
    tier.give(gone)
    assert tier.free.nbytes == 4 * 16 and tier.free.n_free == 50 + 74
    got = tier.take(16 + 50 + 30)  # the list, the 50 never used, then 30 found by a scan
    assert got[-16:] == gone[-16:]  # the newest freed, last in the stack's order
    assert got[30:80] == list(range(199, 149, -1))  # then the never used ones
    assert set(got[:30]) <= set(gone[:-16])  # then those the scan found again
    rest = tier.take(tier.free.n_free)  # every one of the others, and nothing more
    assert sorted(got[:30] + got[-16:] + rest) == sorted(gone)
    assert bool(tier.occupied.all())
    with pytest.raises(RuntimeError, match="1 slots wanted, 0 free"):
        tier.free.take(1)


def test_clear_frees_everything_and_starts_from_slot_zero() -> None:
    tier = Tier(10)
    tier.take(7)
    tier.give([2, 5])
    tier.occupied.zero_()
    tier.free.clear()
    assert tier.free.n_free == 10 and tier.free.nbytes == 0
    assert tier.take(3) == [2, 1, 0]
