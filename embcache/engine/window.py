"""The window in front of HBM: the rows that entered last, oldest first (W-TinyLFU's window).

Without a window, a row coming up from below must beat HBM's lowest row on its counts to enter.
A key that arrives in a run (a user's session: dozens of accesses within a few batches) has no
counts yet at its first miss, so it stays out and misses again for the whole run. With a window
(a tuned setting: :class:`embcache.sim.tuner.Setting` ``window``), every row coming up enters it;
when the window is full, its oldest rows are pushed out and compete with the main region's
lowest rows (:func:`embcache.engine.placement.admit_windowed`): the better of each pair stays. A run's
row then hits from its second batch on and, if its run went on, has the counts to stay.

The window is a FIFO of (slot, key) pairs; a row is in the window while an entry names its slot
and the slot still holds its key. Rows the window's own planning did not move (a pass's
eviction, expiry, a failed read) fall out by themselves: their entries stop matching and are
dropped the next time the window is read, so no other path needs to know about it.
"""

from __future__ import annotations

import torch

from ..tier import OCCUPIED, MemoryTier, to_device

__all__ = ["Window"]


class Window:
    """The window of a tier: at most ``rows`` of its rows, in the order they entered.

    Args:
        rows: the window's size in rows (> 0).
        device: the tier's device (where its slots and keys are kept).
    """

    def __init__(self, rows: int, device: torch.device) -> None:
        if rows <= 0:
            raise ValueError(f"a window needs at least one row, got {rows}")
        self.rows = rows
        self._slots = torch.empty(0, dtype=torch.int64, device=device)
        self._keys = torch.empty(0, dtype=torch.int64, device=device)

    @classmethod
    def of_share(cls, share: float, capacity: int, device: torch.device) -> Window | None:
        """The window of ``share`` of a tier of ``capacity`` rows (at least one row), or None when
        ``share`` is 0 or the tier holds nothing."""
        if share <= 0 or capacity == 0:
            return None
        return cls(max(1, round(share * capacity)), device)

    def live(self, tier: MemoryTier) -> torch.Tensor:
        """Slots (int64, on ``tier``'s device) of the window's rows still in ``tier``, oldest first;
        entries whose row left are dropped."""
        if self._slots.numel() == 0:
            return self._slots
        held = ((tier.keys.index_select(0, self._slots) == self._keys)
                & ((tier.flags.index_select(0, self._slots) & OCCUPIED) != 0))
        if not bool(held.all()):
            self._slots, self._keys = self._slots[held], self._keys[held]
        return self._slots

    def advance(self, tier: MemoryTier, pushed: int, entering: torch.Tensor) -> None:
        """The ``pushed`` oldest rows left the window (into the main region, or out of ``tier``), and
        the rows of ``entering`` (keys, in order, in ``tier`` now) entered it."""
        keys = to_device(entering, tier.device)
        slots = tier.find(keys)
        placed = slots >= 0  # a row whose read failed was taken out again
        self._slots = torch.cat([self._slots[pushed:], slots[placed]])[-self.rows:]
        self._keys = torch.cat([self._keys[pushed:], keys[placed]])[-self.rows:]

    def __len__(self) -> int:
        return int(self._slots.numel())
