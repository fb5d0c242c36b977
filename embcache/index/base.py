"""The interface of a key index (:class:`KeyIndex`), with what every index inherits.

An index maps int64 keys to int64 slots of one tier, in batches. Besides ``find``, ``insert``,
``erase`` and ``clear``, which each implementation writes, :class:`KeyIndex` gives every index the
lookup's two combined steps in torch ops: ``find_touch`` (find, and count one access per found
key in the tier's per-slot counters) and ``find_touch_gather`` (that, and copy the found rows
out), each with a CPU path and a GPU path that avoids host syncs. :class:`~embcache.index.NumbaIndex`
overrides both with compiled passes.
"""

from __future__ import annotations

import abc

import torch


class KeyIndex(abc.ABC):
    """Batched map from int64 keys to int64 slots of one tier.

    Args:
        capacity: the most keys it must hold at once (>= 1).
        device: where the keys, slots and the index itself live.
    """

    capacity: int
    device: torch.device
    # Bytes of index per row at capacity, what a tier's budget counts (embcache/tier.py)
    ROW_BYTES: int

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self._len = 0

    @abc.abstractmethod
    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots of ``keys``.

        Args:
            keys: int64 [n] on ``self.device``; duplicates allowed.

        Returns:
            int64 [n] slots on ``self.device``, -1 where a key is absent.
        """

    def find_touch(self, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float,
                   now: int, once: bool = False) -> tuple[torch.Tensor, int]:
        """:meth:`find`, and count one access per found key: ``freq[slot] += inc``, ``last[slot] = now``.

        Args:
            keys: int64 [n] on ``self.device``; duplicates allowed (each occurrence counts).
            freq, last: float32 and int64 [capacity] per-slot counters on ``self.device`` (any stride;
                another float dtype takes the torch ops).
            inc: weight of one access; now: the current tick.
            once: a row counts at most one access per tick: only where ``last[slot] != now`` before
                this call (its repeats in the batch, and a row already counted at ``now``, add nothing).

        Returns:
            (slots int64 [n], -1 where absent; how many keys were found).
        """
        slots = self.find(keys)
        if once:
            return slots, self._touch_once(slots, freq, last, inc, now)
        if self.device.type != "cpu":
            # On a GPU: no nonzero (a host sync to size its output); the count is the one sync
            # (the caller must know whether anything missed). Misses add 0 to slot 0's frequency
            # and leave its ``last`` as it was (amax with int64 min; ``now`` never goes back).
            found = slots >= 0
            at = slots.clamp(min=0)
            freq.index_add_(0, at, found.to(freq.dtype) * inc)
            stamp = torch.where(found, now, torch.iinfo(torch.int64).min).to(last.dtype)
            last.scatter_reduce_(0, at, stamp, reduce="amax")
            return slots, int(found.sum())
        hit = torch.nonzero(slots >= 0).flatten()
        if hit.numel():
            hs = slots.index_select(0, hit)
            freq.index_add_(0, hs, torch.full(hs.shape, inc, dtype=freq.dtype, device=freq.device))
            last.index_fill_(0, hs, now)
        return slots, int(hit.numel())

    @staticmethod
    def _touch_once(slots: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float, now: int) -> int:
        """The touch of :meth:`find_touch` with ``once``; returns how many were found.

        Every occurrence of a slot reads the same old ``last`` and ``freq`` (gathered before any
        write), so all its hits write the same new values, and ``amax`` keeps them over a miss's
        (misses are masked to slot 0 and write its old values, which are never larger: ``inc`` >
        0, ``now`` never goes back). No unique (on a GPU that would cost a host sync), and the
        result does not depend on the order of the writes.
        """
        found = slots >= 0
        at = slots.clamp(min=0)
        old_last = last.index_select(0, at)
        add = (found & (old_last != now)).to(freq.dtype) * inc
        freq.scatter_reduce_(0, at, freq.index_select(0, at) + add, reduce="amax")
        last.scatter_reduce_(0, at, torch.where(found, torch.full_like(old_last, now), old_last), reduce="amax")
        return int(found.sum())

    def find_touch_gather(self, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float, now: int,
                          rows: torch.Tensor, out: torch.Tensor, once: bool = False) -> tuple[torch.Tensor, int]:
        """:meth:`find_touch`, and the row of every found key copied into ``out``.

        Args:
            keys, freq, last, inc, now, once: as for :meth:`find_touch`.
            rows: [capacity, dim] per-slot rows on ``self.device`` (any float dtype).
            out: float32 [n, dim] on ``self.device``: ``out[i] = rows[slot of keys[i]]`` where found;
                the rows of absent keys are left as they were.

        Returns:
            As :meth:`find_touch`.
        """
        slots, hits = self.find_touch(keys, freq, last, inc, now, once)
        if hits == slots.numel() and rows.dtype == out.dtype:
            torch.index_select(rows, 0, slots, out=out)  # all found: one gather straight into out
        elif hits and self.device.type != "cpu":
            # On a GPU: every key's row gathered (slot 0 for misses) and kept where found, no
            # nonzero (a host sync to size its output)
            found = (slots >= 0)[:, None]
            out.copy_(torch.where(found, rows.index_select(0, slots.clamp(min=0)).to(out.dtype), out))
        elif hits:
            # index_select / index_copy_: several times faster on CPU than out[pos] = ... (index_put_)
            pos = torch.nonzero(slots >= 0).flatten()
            out.index_copy_(0, pos, rows.index_select(0, slots.index_select(0, pos)).to(out.dtype))
        return slots, hits

    @abc.abstractmethod
    def insert(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Map ``keys[i]`` to ``slots[i]``.

        Never fails while ``len(self) + n <= capacity`` (the index rehashes internally if it must).

        Args:
            keys: int64 [n] on ``self.device``, unique and currently absent (not checked).
            slots: int64 [n] on ``self.device``.

        Raises:
            RuntimeError: if ``len(self) + n > capacity`` (nothing is changed).
        """

    @abc.abstractmethod
    def erase(self, keys: torch.Tensor) -> None:
        """Remove ``keys``.

        Args:
            keys: int64 [n] on ``self.device``, unique and present (absent ones are ignored).
        """

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every key."""

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"{type(self).__name__}(len={self._len}, capacity={self.capacity}, device={self.device})"

    def _check_room(self, n: int) -> None:
        if self._len + n > self.capacity:
            raise RuntimeError(f"{type(self).__name__}: inserting {n} keys into {self._len} of "
                               f"capacity {self.capacity} would exceed it")
