"""The free slots of a memory tier, without an array per row.

A tier hands out slots when rows come in and takes them back when rows leave. It used to keep
every free slot in an int32 stack of its capacity: 4 bytes per row, for a list that a full tier,
where rows are replaced batch by batch, holds only for a moment. :class:`FreeSlots` keeps:

- a *high-water mark*: slots at and above it have not been handed out since the tier was
  emptied (a new tier hands out ``0, 1, 2, ...``);
- the slots freed since, newest last, up to :data:`PENDING_MAX` of them (256 KiB per tier,
  whatever its size). An eviction frees at most a batch's worth, which the insert that follows
  takes straight back;
- a count of the free slots beyond that list (a tier that dropped more rows at once: an expiry
  sweep, a large ``discard``). When they are needed, one scan of the tier's occupied bits finds
  them again.

Slots come out in the order the stack gave them: the newest freed first, then fresh ones from
the mark up, so the same calls place the same rows in the same slots as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["PENDING_MAX", "FreeSlots"]

# Freed slots remembered for reuse (int32): more are found again by a scan when needed.
PENDING_MAX = 1 << 16


class FreeSlots:
    """Which slots of a tier of ``capacity`` rows are free.

    Args:
        capacity: the tier's rows.
        device: where slot tensors live.
        occupied: ``fn() -> bool [capacity]``, which slots hold rows (read only for a scan).
    """

    def __init__(self, capacity: int, device: torch.device, occupied: Callable[[], torch.Tensor]) -> None:
        self.capacity = capacity
        self.device = device
        self._occupied = occupied
        self.clear()

    def clear(self) -> None:
        """Every slot free."""
        self._high = 0
        self._pending: list[torch.Tensor] = []  # int32, below the mark, newest last
        self._n_pending = 0
        self.n_free = self.capacity

    @property
    def nbytes(self) -> int:
        """Bytes the list of freed slots holds now (at most 4 x :data:`PENDING_MAX`)."""
        return 4 * self._n_pending

    def take(self, n: int) -> torch.Tensor:
        """``n`` free slots (int64 [n]; ``n`` at most :attr:`n_free`), now taken."""
        if n > self.n_free:
            raise RuntimeError(f"{n} slots wanted, {self.n_free} free")
        parts: list[torch.Tensor] = []  # from the top of the former stack down
        need = n
        while need and self._pending:
            top = self._pending[-1]
            if top.numel() <= need:
                self._pending.pop()
                parts.append(top)
            else:
                parts.append(top[top.numel() - need:])
                self._pending[-1] = top[:top.numel() - need]
            need -= parts[-1].numel()
        self._n_pending -= n - need
        fresh = min(need, self.capacity - self._high)
        if fresh:
            parts.append(torch.arange(self._high + fresh - 1, self._high - 1, -1, dtype=torch.int32,
                                      device=self.device))
            self._high += fresh
            need -= fresh
        if need:  # freed slots the list let go of: found again
            parts.append(self._rescan(need, parts))
        self.n_free -= n
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts[::-1]).to(torch.int64)

    def give(self, slots: torch.Tensor) -> None:
        """Take back ``slots`` (unique, taken, on :attr:`device`)."""
        n = int(slots.numel())
        if n == 0:
            return
        self._pending.append(slots.to(torch.int32))
        self._n_pending += n
        self.n_free += n
        while self._n_pending > PENDING_MAX:  # the oldest are forgotten (found again by a scan)
            drop = min(self._pending[0].numel(), self._n_pending - PENDING_MAX)
            self._pending[0] = self._pending[0][drop:]
            if self._pending[0].numel() == 0:
                self._pending.pop(0)
            self._n_pending -= drop

    def _rescan(self, need: int, taken: list[torch.Tensor]) -> torch.Tensor:
        # The free slots below the mark that the list does not hold (it is empty here: take()
        # used it up), by one scan of the occupied bits, less those ``taken`` in this call (not
        # marked occupied yet); ``need`` of them are taken, up to PENDING_MAX more remembered.
        free = ~self._occupied()[:self._high]
        for part in taken:
            free.index_fill_(0, part.to(torch.int64), False)
        holes = torch.nonzero(free).flatten().to(torch.int32)
        if holes.numel() < need:
            raise RuntimeError(f"free-slot count is off: {need} more slots wanted, a scan found {holes.numel()}")
        keep = holes[:-need][-PENDING_MAX:]
        if keep.numel():
            self._pending.append(keep)
            self._n_pending += int(keep.numel())
        return holes[holes.numel() - need:]
