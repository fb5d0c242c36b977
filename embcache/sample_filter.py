"""The eviction sample's filter: one occurrence of each sampled slot, excluded slots dropped, only
rows whose flags say evictable.

:meth:`embcache.tier.MemoryTier.lowest` draws ``sample * k`` random slots (with repeats) and keeps
those that are distinct, not excluded (rows in use by the batch) and evictable (occupied, no pins).
Of a slot drawn several times the *last* draw is kept, in draw order: the order decides which of
two equal scores goes first, and it is the one the tier's earlier slot-indexed marks gave, so
victims (and hit ratios) are what they were.

Two implementations with the same result: a compiled CPU kernel over a batch-sized hash table
(:class:`~embcache.slot_table.SlotTable`; three serial passes, no sort), and torch operations for
other devices (a stable sort finds the last draw of each slot, a binary search the excluded ones;
no host sync before the final selection, which has a data-dependent size).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .slot_table import GOLDEN, SlotTable

__all__ = ["distinct_evictable", "distinct_evictable_torch"]

_KERNEL: dict[str, Any] = {}
_EXCLUDED = 0xFFFFFFFF  # the value of an excluded slot (a draw's is its position, below 2**32 - 1)


def _filter_py(cand: Any, exclude: Any, flags: Any, mask_bits: int, want: int,  # pragma: no cover - compiled
               table: Any, shift: Any, out: Any) -> int:
    size_mask = table.shape[0] - 1
    for h in range(size_mask + 1):
        table[h] = -1
    for i in range(exclude.shape[0]):
        s = exclude[i]
        h = np.int64((np.uint64(s) * GOLDEN) >> shift)
        while table[h] >= 0 and (table[h] >> 32) != s:
            h = (h + 1) & size_mask
        table[h] = (s << 32) | _EXCLUDED
    for i in range(cand.shape[0]):  # the last draw of each slot
        s = cand[i]
        h = np.int64((np.uint64(s) * GOLDEN) >> shift)
        e = table[h]
        while e >= 0 and (e >> 32) != s:
            h = (h + 1) & size_mask
            e = table[h]
        if e < 0 or (e & 0xFFFFFFFF) != _EXCLUDED:
            table[h] = (s << 32) | i
    m = 0
    for i in range(cand.shape[0]):
        s = cand[i]
        h = np.int64((np.uint64(s) * GOLDEN) >> shift)
        while (table[h] >> 32) != s:
            h = (h + 1) & size_mask
        if (table[h] & 0xFFFFFFFF) == i and (flags[s] & mask_bits) == want:
            out[m] = s
            m += 1
    return m


def _kernel() -> Any:
    """The compiled filter, or None without numba."""
    if "filter" not in _KERNEL:
        try:
            import numba

            _KERNEL["filter"] = numba.njit(nogil=True, cache=True)(_filter_py)
        except ImportError:
            _KERNEL["filter"] = None
    return _KERNEL["filter"]


def distinct_evictable(cand: torch.Tensor, exclude: torch.Tensor | None, flags: torch.Tensor, mask: int,
                       want: int, table: SlotTable) -> torch.Tensor:
    """The slots of ``cand`` to score: each slot once (its last draw, in draw order), none of
    ``exclude``, only those with ``flags[slot] & mask == want``.

    Args:
        cand: int64 [n] sampled slots (repeats allowed), on ``flags``' device.
        exclude: int64 slots to drop (repeats allowed), or None.
        flags: the tier's int32 [capacity] flags.
        mask, want: the evictable test on a slot's flags.
        table: the tier's batch-sized scratch (CPU kernel only).
    """
    kernel = _kernel() if flags.device.type == "cpu" else None
    if kernel is None:
        return distinct_evictable_torch(cand, exclude, flags, mask, want)
    ex = exclude.to(torch.int64).contiguous().numpy() if exclude is not None else np.empty(0, dtype=np.int64)
    arr, shift = table.arrays(cand.numel() + ex.shape[0])
    out = torch.empty(cand.numel(), dtype=torch.int64)
    m = kernel(cand.contiguous().numpy(), ex, flags.numpy(), mask, want, arr, shift, out.numpy())
    return out[:m]


def distinct_evictable_torch(cand: torch.Tensor, exclude: torch.Tensor | None, flags: torch.Tensor, mask: int,
                             want: int) -> torch.Tensor:
    """:func:`distinct_evictable` in torch operations (any device)."""
    n = cand.numel()
    if n == 0:
        return cand
    ordered, order = torch.sort(cand, stable=True)  # a slot's draws together, in draw order
    last = torch.ones(n, dtype=torch.bool, device=cand.device)
    last[:-1] = ordered[1:] != ordered[:-1]
    keep = torch.empty_like(last).index_copy_(0, order, last)
    if exclude is not None and exclude.numel():
        ex = torch.sort(exclude.to(cand.dtype)).values
        at = torch.searchsorted(ex, cand).clamp_(max=ex.numel() - 1)
        keep &= ex.index_select(0, at) != cand
    keep &= (flags.index_select(0, cand) & mask) == want
    return torch.masked_select(cand, keep)
