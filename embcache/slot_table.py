"""A batch-sized hash table from slots to 32-bit values: scratch of the compiled tier kernels.

The fused update (:mod:`embcache.fused`) deduplicates a batch's slots, and the eviction sample
(:mod:`embcache.sample_filter`) keeps one occurrence of each sampled slot and drops excluded ones.
Both once used an int32 array of the tier's capacity (4 bytes per resident row) as a
slot-indexed map; this table holds what they need for one batch instead, sized by the batch
(open addressing, linear probing, at most half full), so a tier's memory per row does not
include it. Its array grows to the largest batch seen and is reused: nothing is allocated per
call once warm.

A kernel takes ``table`` (int64 [T], T a power of two; the kernel fills it with -1 first) and
``shift`` (64 - log2 T). An entry is ``slot << 32 | value`` (slots are below 2**31, values
32-bit), -1 when empty: one load per probe. The home of slot ``s`` is
``(s * 0x9E3779B97F4A7C15 mod 2**64) >> shift`` (Fibonacci hashing: the high bits of the
product, spread for any pattern of slots).
"""

from __future__ import annotations

import numpy as np

__all__ = ["GOLDEN", "SlotTable"]

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, odd


class SlotTable:
    """The grow-only array of a slot hash table (see the module docstring)."""

    def __init__(self) -> None:
        self._table = np.empty(0, dtype=np.int64)

    def arrays(self, n: int) -> tuple[np.ndarray, np.uint64]:
        """``(table, shift)`` of a table for up to ``n`` distinct slots (at most half full)."""
        size = 2
        while size < 2 * n:
            size *= 2
        if self._table.shape[0] < size:
            self._table = np.empty(size, dtype=np.int64)
        return self._table[:size], np.uint64(64 - (size.bit_length() - 1))
