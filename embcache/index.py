"""Key -> slot index of one memory tier: batched, every operation takes tensors, none loops in Python.

A tier holds up to ``capacity`` rows in preallocated tensors; the index maps int64 keys to slot
numbers in ``[0, capacity)``. Keys may be *any* int64 value (negative, int64 min/max, beyond
2**53), so no key value can mean "empty": an entry is empty when its *slot* is -1.

Both implementations hash with the splitmix64 finalizer (:func:`mix64`), a bijection of the 64-bit
patterns: distinct keys never share a full hash, and patterned keys (consecutive ids, multiples of
a large power of two) spread evenly. :func:`unmix64` inverts it, which lets tests build colliding
keys on purpose.

:class:`NumbaIndex` (CPU, the hot path): open addressing with linear probing in a table of
``next_pow2(2 * capacity)`` entries (load <= 50%: ~1.5 probes per hit, ~2.5 per miss), stored as
one ``int64 [T, 2]`` array of ``(key, slot)`` pairs so that a probe reads a single cache line.
Deletion shifts the rest of the cluster back (no tombstones, so probe lengths do not degrade under
churn), and at most ``capacity`` of the >= ``2 * capacity`` entries are used, so inserts cannot
fail. The kernels are numba ``@njit(cache=True, nogil=True)`` functions on numpy views of the
torch tensors (no copies). The table is far larger than the caches, so a probe is a cache miss:
the kernels hash a group of keys and prefetch their lines before probing any of them, which keeps
many misses in flight (2-3x the rate of probing key by key), and the table sits on transparent
huge pages (``embcache/hostmem.py``) so that probes do not miss the TLB too. Large ``find``
batches are shared, in chunks, between the calling thread and helper threads (see
:class:`_Helpers` for why not ``prange``). The lookup's hot path, ``find_touch_gather``, goes one
step further on one torch thread: a rolling pipeline hashes one key, probes an earlier one and
prefetches its row and counters, and counts and copies a still earlier one, all in one pass.

:class:`TorchIndex` (any device, the CUDA path; also the CPU fallback without numba): bucketed
two-choice hashing. ``nb`` buckets (a power of two) of ``B = 8`` entries, ``keys`` and ``slots``
each an ``int64 [nb, B]`` tensor, sized for <= 50% load (<= 55% where a power of two of buckets
at 50% would pass the tiers' 64 bytes of index per row). Key ``k`` may live in bucket
``h1 = mix64(k) mod nb`` or ``h2 = (mix64(k) >> 32) mod nb``:

- Inserts fill ``h1`` first and use ``h2`` only when ``h1`` is full, so ~98% of keys sit in
  ``h1``; ``find`` on CPU reads one 64-byte bucket per key and a second one only for the keys it
  did not find there (misses, mostly). On CUDA it reads both in one gather instead, trading
  bandwidth for not synchronizing with the host.
- Keys whose two buckets are both full go to a small sorted *stash* (~0.1% of keys at full load
  with ``B = 8``), searched with ``searchsorted``. Only a full stash (``capacity / 256`` keys)
  doubles ``nb`` and rebuilds; each doubling adds a hash bit, and full hashes of distinct keys
  differ, so growth ends.
- Empty entries of bucket ``b`` hold a *filler* key whose two buckets are both ``b ^ 1``; a key
  probing ``b`` therefore never equals it, so a key match is always a live entry and ``find``
  compares keys only, then reads one slot per key.
- Keys of one insert batch that target the same bucket are sorted by bucket; the key of rank
  ``r`` in its bucket takes the bucket's ``r``-th free entry.

Neither class is thread-safe: the caller serializes access to an index (the cache holds a lock per
table). Concurrent ``find`` calls only read and are safe; nothing may run concurrently with an
``insert``, ``erase`` or ``clear`` of the same index.
"""

from __future__ import annotations

import abc
import itertools
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ._bits import M1, M2, mix64, next_pow2, unmix64
from .hostmem import huge_page_zeros

__all__ = ["KeyIndex", "NumbaIndex", "TorchIndex", "make_index", "mix64", "numba_available", "unmix64"]

# The splitmix64 multipliers, here for the tests that recompute mix64 with Python ints.
_M1, _M2 = M1, M2
# Byte k of this is 7 - k, so for a word with only byte i set (the value 1 << 8i), the top byte of
# word * _BYTE_INDEX is i: the index of the set byte without a loop or a reduction.
_BYTE_INDEX = 0x0001020304050607
_BIG_ENDIAN = sys.byteorder == "big"  # bool -> bytes views put column 0 in the top byte there

# NumbaIndex.find splits batches of at least two chunks of this many keys over helper threads.
_CHUNK = 16384


class KeyIndex(abc.ABC):
    """Batched map from int64 keys to int64 slots of one tier.

    Args:
        capacity: the most keys it must hold at once (>= 1).
        device: where the keys, slots and the index itself live.
    """

    capacity: int
    device: torch.device

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
                   now: int) -> tuple[torch.Tensor, int]:
        """:meth:`find`, and count one access per found key: ``freq[slot] += inc``, ``last[slot] = now``.

        Args:
            keys: int64 [n] on ``self.device``; duplicates allowed (each occurrence counts).
            freq, last: float64 and int64 [capacity] per-slot counters on ``self.device``.
            inc: weight of one access; now: the current tick.

        Returns:
            (slots int64 [n], -1 where absent; how many keys were found).
        """
        slots = self.find(keys)
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

    def find_touch_gather(self, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float, now: int,
                          rows: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, int]:
        """:meth:`find_touch`, and the row of every found key copied into ``out``.

        Args:
            keys, freq, last, inc, now: as for :meth:`find_touch`.
            rows: [capacity, dim] per-slot rows on ``self.device`` (any float dtype).
            out: float32 [n, dim] on ``self.device``: ``out[i] = rows[slot of keys[i]]`` where found;
                the rows of absent keys are left as they were.

        Returns:
            As :meth:`find_touch`.
        """
        slots, hits = self.find_touch(keys, freq, last, inc, now)
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


# ------------------------------------------------------------------------------------------------
# TorchIndex
# ------------------------------------------------------------------------------------------------


class TorchIndex(KeyIndex):
    """Bucketed two-choice hash table with a small stash, in plain torch ops (CPU or CUDA).

    Args:
        capacity: the most keys it must hold at once (>= 1).
        device: where the table lives.
        bucket_width: entries per bucket ``B``; one bucket of keys is ``B * 8`` bytes.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu", bucket_width: int = 8) -> None:
        super().__init__(capacity, device)
        if bucket_width < 8 or bucket_width % 8:
            raise ValueError(f"bucket_width must be a positive multiple of 8, got {bucket_width}")
        self.bucket_width = int(bucket_width)
        # First column of each 8-column word of a match row of up to two buckets.
        self._word_base = torch.arange(0, 2 * bucket_width, 8, dtype=torch.int64, device=self.device)
        # Keys whose two buckets are both full wait here (a few per million at 50% load) rather
        # than doubling the table; only a full stash forces growth.
        self.stash_capacity = max(64, self.capacity // 256)
        # <= 50% load at capacity; >= 2 buckets so that every bucket has a filler key (below).
        nb = max(2, next_pow2(-(-2 * self.capacity // self.bucket_width)))
        # The tiers count 64 bytes of index per row (tier.py). Where rounding up to a power of two
        # would pass that (up to ~68.5 bytes), take half the buckets: a load of 50-55%, where
        # two-choice buckets of 8 still stash about one key in a thousand.
        if nb > 2 and self._bytes(nb) > 64 * self.capacity and self.capacity <= 0.55 * (nb // 2) * self.bucket_width:
            nb //= 2
        self._nb0 = nb
        self._alloc(self._nb0)

    def _bytes(self, nb: int) -> int:
        """Bytes of the table at ``nb`` buckets with a full stash: keys and slots (16 per entry),
        a filler key (8) and a stash mark (1) per bucket, 16 per stash entry."""
        return nb * (16 * self.bucket_width + 9) + 16 * self.stash_capacity + 8 * self._word_base.numel() + 16

    @property
    def nbytes(self) -> int:
        """Bytes the index holds now, its stash counted full (it grows only past a full stash)."""
        return self._bytes(self._nb)

    def _alloc(self, nb: int) -> None:
        self._nb = nb
        b = torch.arange(nb, dtype=torch.int64, device=self.device)
        # The filler of bucket b: a key whose two buckets are both b ^ 1, never b. Empty entries
        # of bucket b hold it, so a key probing b (its h1 or h2 is b) cannot equal it: a key match
        # is always a live entry, and find compares keys only, then reads one slot per key.
        self._filler = unmix64((b ^ 1) | ((b ^ 1) << 32))
        # Flat tables of nb * B entries and one more, outside every bucket: where the GPU path's
        # masked writes put the entries it does not mean to write (a write to a position picked
        # out by a boolean mask would cost a host sync to learn how many there are).
        entries = nb * self.bucket_width
        self._dump = entries
        self._keys_flat = torch.cat((self._filler[:, None].repeat(1, self.bucket_width).view(-1),
                                     torch.zeros(1, dtype=torch.int64, device=self.device)))
        self._slots_flat = torch.full((entries + 1,), -1, dtype=torch.int64, device=self.device)  # -1: empty
        self._keys = self._keys_flat[:entries].view(nb, self.bucket_width)  # [nb, B]
        self._slots = self._slots_flat[:entries].view(nb, self.bucket_width)
        self._stash_keys = torch.empty(0, dtype=torch.int64, device=self.device)  # sorted
        self._stash_slots = torch.empty(0, dtype=torch.int64, device=self.device)
        # First buckets of stashed keys: a key whose first bucket is unmarked is not in the
        # stash, which spares nearly every miss the stash search on CPU.
        self._stash_mark = torch.zeros(nb, dtype=torch.bool, device=self.device)

    def _set_stash(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Replace the stash with ``keys`` -> ``slots`` (work proportional to the stash, not nb)."""
        self._stash_mark.index_fill_(0, self._bucket(mix64(self._stash_keys), False), False)
        order = torch.argsort(keys)
        self._stash_keys, self._stash_slots = keys[order], slots[order]
        self._stash_mark.index_fill_(0, self._bucket(mix64(self._stash_keys), False), True)

    @property
    def n_buckets(self) -> int:
        """Current number of buckets (doubles only when the stash overflows)."""
        return self._nb

    @property
    def n_stashed(self) -> int:
        """Keys in the stash (their two buckets were full when they were inserted)."""
        return int(self._stash_keys.numel())

    def _bucket(self, h: torch.Tensor, second: bool) -> torch.Tensor:
        # h1 takes the low bits, h2 bits 32..; the finalizer mixes both well.
        return ((h >> 32) if second else h) & (self._nb - 1)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots of ``keys``.

        Args:
            keys: int64 [n] on ``self.device``; duplicates allowed.

        Returns:
            int64 [n] slots, -1 where a key is absent.
        """
        keys = keys.reshape(-1)
        if keys.numel() == 0 or self._len == 0:
            return torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
        h = mix64(keys)
        if self.device.type == "cpu":
            return self._find_two_pass(keys, h)
        return self._find_one_pass(keys, h)

    def _find_one_pass(self, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # Both buckets in one gather and no host sync (the GPU path): bandwidth is cheap there,
        # a synchronization is not.
        b = torch.stack((self._bucket(h, False), self._bucket(h, True)), 1)  # [n, 2]
        hit, pos = self._match(keys, b)
        out = torch.where(hit, self._slots.view(-1).index_select(0, pos), -1)
        if self.n_stashed:
            out = torch.where(hit, out, self._stash_find(keys))
        return out

    def _find_two_pass(self, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # The CPU path. Inserts fill h1 first, so nearly every present key is in its first
        # bucket; the second bucket (and the stash) are searched only for the rest, mostly misses.
        slots = self._slots.view(-1)
        hit, pos = self._match(keys, self._bucket(h, False)[:, None])
        out = torch.where(hit, slots.index_select(0, pos), -1)
        rest = torch.nonzero(~hit).squeeze(1)
        if rest.numel():
            k = keys.index_select(0, rest)
            hr = h.index_select(0, rest)
            hit, pos = self._match(k, self._bucket(hr, True)[:, None])
            part = torch.where(hit, slots.index_select(0, pos), -1)
            if self.n_stashed:
                maybe = torch.nonzero(~hit & self._stash_mark.index_select(0, self._bucket(hr, False))).squeeze(1)
                if maybe.numel():
                    part.index_copy_(0, maybe, self._stash_find(k.index_select(0, maybe)))
            out.index_copy_(0, rest, part)
        return out

    def _match(self, keys: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``keys`` [n] sit in their candidate buckets ``b`` [n, c].

        Returns:
            (hit bool [n], flat entry index int64 [n] into the [nb * B] tables, valid where hit).
        """
        n, width = keys.shape[0], self.bucket_width
        # index_select copies whole contiguous rows; advanced indexing is ~10x slower on CPU.
        rows = self._keys.index_select(0, b.flatten()).view(n, -1)  # [n, c * B]
        # A bucket holds a key at most once, so each 8-column word of the bool match row has at
        # most one byte set. Read its column with a multiply (a byte-index de Bruijn trick)
        # instead of argmax + gather over the row, which cost ~3x more on CPU.
        words = (rows == keys[:, None]).view(torch.int64)  # [n, c * B / 8]
        byte = ((words * _BYTE_INDEX) >> 56) & 0xFF
        if _BIG_ENDIAN:
            byte = 7 - byte
        if words.shape[1] == 1:
            hit, col = words[:, 0] != 0, byte[:, 0]
        elif words.shape[1] == 2:
            v0 = words[:, 0]
            hit = (v0 | words[:, 1]) != 0
            col = torch.where(v0 != 0, byte[:, 0], byte[:, 1] + 8)
        else:
            col = torch.where(words != 0, byte + self._word_base, -1).amax(1)
            hit = col >= 0
            col = col.clamp_(min=0)
        if b.shape[1] == 1:
            return hit, b[:, 0] * width + col
        bucket = b.gather(1, torch.div(col, width, rounding_mode="floor")[:, None]).squeeze(1)
        return hit, bucket * width + col % width

    def _stash_find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots of ``keys`` [n] in the stash, -1 where not stashed."""
        last = self._stash_keys.numel() - 1
        pos = torch.searchsorted(self._stash_keys, keys).clamp_(max=last)
        return torch.where(self._stash_keys[pos] == keys, self._stash_slots[pos], -1)

    def insert(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Map ``keys[i]`` to ``slots[i]``.

        A key goes to the first free entry of its first bucket, else of its second, else to the
        stash; a full stash doubles the buckets (rebuilding the table).

        Args:
            keys: int64 [n] on ``self.device``, unique and currently absent (not checked).
            slots: int64 [n] on ``self.device``.

        Raises:
            RuntimeError: if ``len(self) + n > capacity`` (nothing is changed).
        """
        keys = keys.reshape(-1)
        slots = slots.reshape(-1).to(torch.int64)
        n = keys.numel()
        if slots.numel() != n:
            raise ValueError(f"{n} keys but {slots.numel()} slots")
        self._check_room(n)
        if n == 0:
            return
        k, s = keys, slots
        while True:
            k, s = self._place_both(k, s)
            if k.numel() == 0:
                self._len += n
                return
            if self.n_stashed + k.numel() <= self.stash_capacity:
                self._set_stash(torch.cat((self._stash_keys, k)), torch.cat((self._stash_slots, s)))
                self._len += n
                return
            # Rebuild at twice the buckets with every live entry, the stash and the leftovers;
            # each doubling adds a hash bit, and full hashes of distinct keys differ.
            live = self._slots >= 0
            k = torch.cat((self._keys[live], self._stash_keys, k))
            s = torch.cat((self._slots[live], self._stash_slots, s))
            self._alloc(self._nb * 2)

    def _place_both(self, k: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put each key in its first bucket, else its second; returns the keys and slots left over."""
        h = mix64(k)
        if self.device.type == "cpu":  # each pass on the keys still left (compacted)
            for second in (False, True):
                left = ~self._place(k, s, self._bucket(h, second))
                k, s, h = k[left], s[left], h[left]
                if k.numel() == 0:
                    break
            return k, s
        # The GPU path: both passes over every key, those already placed masked out, and one
        # host sync to learn whether any is left (almost never: then they are compacted).
        left = torch.ones(k.shape, dtype=torch.bool, device=self.device)
        for second in (False, True):
            left &= ~self._place(k, s, self._bucket(h, second), left)
        if not bool(left.any()):
            return k[:0], s[:0]
        return k[left], s[left]

    def _place(self, k: torch.Tensor, s: torch.Tensor, b: torch.Tensor,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """Put each key (of those ``active``, bool [m], if given) in a free entry of its bucket
        ``b``; returns bool [m]: placed."""
        order = torch.argsort(b, stable=True)
        bs = b[order]
        m = bs.numel()
        start = torch.ones(m, dtype=torch.bool, device=self.device)
        start[1:] = bs[1:] != bs[:-1]
        # Rank of each key among the batch's (active) keys for the same bucket.
        if active is None:
            pos = torch.arange(m, dtype=torch.int64, device=self.device)
            rank = pos - torch.where(start, pos, 0).cummax(0).values
        else:
            act = active.index_select(0, order)
            before = act.cumsum(0) - act.to(torch.int64)  # active keys before each, in bucket order
            rank = before - torch.where(start, before, 0).cummax(0).values
        cfree = (self._slots.index_select(0, bs) < 0).cumsum(1)  # [m, B] free entries so far
        ok_sorted = rank < cfree[:, -1]
        # The key of rank r takes the (r+1)-th free entry: its column is the number of columns
        # before the free count reaches r+1.
        col = (cfree <= rank[:, None]).sum(1)
        if active is None:
            flat = (bs * self.bucket_width + col)[ok_sorted]
            src = order[ok_sorted]
        else:  # no boolean-mask selection: the keys not placed write to the spare entry
            ok_sorted &= act
            flat = torch.where(ok_sorted, bs * self.bucket_width + col, self._dump)
            src = order
        self._keys_flat.index_copy_(0, flat, k.index_select(0, src))
        self._slots_flat.index_copy_(0, flat, s.index_select(0, src))
        ok = torch.empty(m, dtype=torch.bool, device=self.device)
        ok[order] = ok_sorted
        return ok

    def erase(self, keys: torch.Tensor) -> None:
        """Remove ``keys``.

        Args:
            keys: int64 [n] on ``self.device``, unique and present (absent ones are ignored).
        """
        keys = keys.reshape(-1)
        if keys.numel() == 0 or self._len == 0:
            return
        h = mix64(keys)
        if self.device.type != "cpu":
            self._erase_masked(keys, h)
            return
        for second in (False, True):
            b = self._bucket(h, second)
            hit, pos = self._match(keys, b[:, None])
            pos, b = pos[hit], b[hit]
            self._slots.view(-1).index_fill_(0, pos, -1)
            self._keys.view(-1).index_copy_(0, pos, self._filler.index_select(0, b))
            self._len -= int(pos.numel())
            keys, h = keys[~hit], h[~hit]
            if keys.numel() == 0:
                return
        self._erase_stashed(keys)

    def _erase_masked(self, keys: torch.Tensor, h: torch.Tensor) -> None:
        # The GPU path: both buckets searched for every key; the keys not found there (or found
        # in the first) write to the spare entry. One host sync, for the count removed.
        left = torch.ones(keys.shape, dtype=torch.bool, device=self.device)
        for second in (False, True):
            b = self._bucket(h, second)
            hit, pos = self._match(keys, b[:, None])
            hit &= left
            pos = torch.where(hit, pos, self._dump)
            self._slots_flat.index_fill_(0, pos, -1)
            self._keys_flat.index_copy_(0, pos, self._filler.index_select(0, b))
            left &= ~hit
        self._len -= int(keys.numel() - left.sum())
        if self.n_stashed:  # rare (a few keys per million): compacted, with the syncs that costs
            self._erase_stashed(keys[left])

    def _erase_stashed(self, keys: torch.Tensor) -> None:
        if self.n_stashed and keys.numel():
            keep = ~torch.isin(self._stash_keys, keys)
            self._set_stash(self._stash_keys[keep], self._stash_slots[keep])
            self._len -= int((~keep).sum())

    def clear(self) -> None:
        """Remove every key (and drop any growth, back to the initial size)."""
        if self._nb != self._nb0:
            self._alloc(self._nb0)
        else:
            self._keys.copy_(self._filler[:, None].expand_as(self._keys))
            self._slots.fill_(-1)
            self._set_stash(self._stash_keys[:0], self._stash_slots[:0])
        self._len = 0


# ------------------------------------------------------------------------------------------------
# NumbaIndex
# ------------------------------------------------------------------------------------------------

# The NumbaIndex kernels are plain functions here, compiled on first use by _numba_kernels() so
# that numba stays optional and is imported only when a NumbaIndex is built. They are module-level
# (not closures) because numba keys its on-disk cache on closure contents, and a closure over
# another jitted function would miss the cache in every new process. The names they call
# (_home, _lookup, _prefetch, _hash_group) are globals that _numba_kernels() rebinds to their
# numba versions before compiling the entry points.
_M1_U64 = np.uint64(M1)
_M2_U64 = np.uint64(M2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ONE = np.uint64(1)
# Keys hashed and prefetched ahead of probing. A probe is a random access into a table much
# larger than the caches; issuing the loads of a whole group first keeps many cache misses in
# flight instead of one per mispredicted probe loop (2-3x the find rate). 128 lines = 8 KiB,
# well inside L1.
_GROUP = 128
# The gather kernel's pipeline distance in keys (see _find_gather_py); each key in flight adds its
# row's 4-8 lines and two counter lines. _RING (> 2 * _AHEAD) holds the hashed homes in flight.
_AHEAD = 16
_RING = 64


def _home_py(k: int, mask: Any) -> Any:
    # mix64 in uint64 (mixing int64 with uint64 in numba would promote to float64), then the
    # table index. Identical bits to mix64() above.
    x = np.uint64(k)
    x = (x ^ (x >> _S30)) * _M1_U64
    x = (x ^ (x >> _S27)) * _M2_U64
    return (x ^ (x >> _S31)) & mask


def _prefetch_py(ary: Any, idx: Any) -> None:
    # Fallback when the LLVM prefetch intrinsic cannot be built: prefetching is only a hint.
    pass


def _lookup_py(tab: Any, k: int, j: Any, mask: Any) -> Any:
    while True:
        s = tab[j, 1]
        if s < 0 or tab[j, 0] == k:
            # A hit returns its slot; an empty entry (slot -1) ends the cluster: a miss.
            return s
        j = (j + _ONE) & mask


def _hash_group_py(tab: Any, keys: Any, lo: int, hi: int, homes: Any, mask: Any) -> None:
    # The home entries of keys[lo:hi] into homes[:hi - lo], each entry's line prefetched, so that
    # the group's probes that follow find their lines in flight or cached.
    for i in range(lo, hi):
        h = _home(keys[i], mask)
        homes[i - lo] = h
        _prefetch(tab, (h, 0))


def _find_py(tab: Any, keys: Any, out: Any) -> None:
    mask = np.uint64(tab.shape[0] - 1)
    n = keys.shape[0]
    homes = np.empty(_GROUP, np.uint64)
    for lo in range(0, n, _GROUP):
        hi = min(lo + _GROUP, n)
        _hash_group(tab, keys, lo, hi, homes, mask)
        for i in range(lo, hi):
            out[i] = _lookup(tab, keys[i], homes[i - lo], mask)


def _find_touch_py(tab: Any, keys: Any, out: Any, freq: Any, last: Any, inc: float, now: int) -> int:
    # _find_py, and each hit counts one access of its row (freq += inc, last = now) as it is
    # found: one pass instead of find, a hit count and a touch (the all-hit lookup's hot path).
    mask = np.uint64(tab.shape[0] - 1)
    n = keys.shape[0]
    homes = np.empty(_GROUP, np.uint64)
    hits = 0
    for lo in range(0, n, _GROUP):
        hi = min(lo + _GROUP, n)
        _hash_group(tab, keys, lo, hi, homes, mask)
        for i in range(lo, hi):
            s = _lookup(tab, keys[i], homes[i - lo], mask)
            out[i] = s
            if s >= 0:
                freq[s] += inc
                last[s] = now
                hits += 1
    return hits


def _find_gather_py(tab: Any, keys: Any, slots: Any, freq: Any, last: Any, inc: float, now: int, rows: Any,
                    out: Any) -> int:
    # _find_touch_py, and each hit's row of ``rows`` copied into ``out[i]`` (a miss leaves out[i]
    # as it was). A rolling software pipeline of three stages, _AHEAD keys apart: while key i is
    # counted and copied, key i + _AHEAD is probed (its table line has arrived) and its row and
    # counters prefetched, and key i + 2 * _AHEAD is hashed and its table line prefetched. Cache
    # misses stay in flight all the time, where probe-then-index_select waits for every probe and
    # then gathers rows the caches no longer hold, and where groups of keys (this pass before)
    # let them drain at the end of every group. Measured (585K rows on huge pages, Zipf keys,
    # median of 11): 0.76 -> 0.74 ms per 8,192 keys at dim 64, 9.5 -> 7.5 ms per 65,536 keys at
    # dim 128. The stages are written out: as an inlined helper they compiled 2.7x
    # slower, and as one loop over the three offsets (no prologue) 15% slower.
    mask = np.uint64(tab.shape[0] - 1)
    n, dim = keys.shape[0], rows.shape[1]
    homes = np.empty(_RING, np.uint64)
    hits = 0
    for j in range(min(_AHEAD, n)):  # the loop's first step hashes key _AHEAD
        h = _home(keys[j], mask)
        homes[j % _RING] = h
        _prefetch(tab, (h, 0))
    for i in range(-_AHEAD, n):
        j = i + 2 * _AHEAD
        if j < n:
            h = _home(keys[j], mask)
            homes[j % _RING] = h
            _prefetch(tab, (h, 0))
        j = i + _AHEAD
        if j < n:
            s = _lookup(tab, keys[j], homes[j % _RING], mask)
            slots[j] = s
            if s >= 0:
                for c in range(0, dim, 16):  # 16 float32 = one 64-byte line
                    _prefetch(rows, (s, c))
                _prefetch(rows, (s, dim - 1))  # a row that straddles one more line
                _prefetch(freq, (s,))
                _prefetch(last, (s,))
        if i < 0:
            continue
        s = slots[i]
        if s >= 0:
            hits += 1
            freq[s] += inc
            last[s] = now
            for c in range(dim):
                out[i, c] = rows[s, c]
    return hits


def _touch_py(slots: Any, freq: Any, last: Any, inc: float, now: int) -> int:
    # The touch of _find_touch_py for slots found by a (parallel) find; returns the hits.
    hits = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if s >= 0:
            freq[s] += inc
            last[s] = now
            hits += 1
    return hits


def _insert_py(tab: Any, keys: Any, slots: Any) -> None:
    # Sequential: keys of one batch may share clusters. Load stays <= 50%, so the probe always
    # reaches a free entry.
    mask = np.uint64(tab.shape[0] - 1)
    n = keys.shape[0]
    homes = np.empty(_GROUP, np.uint64)
    for lo in range(0, n, _GROUP):
        hi = min(lo + _GROUP, n)
        _hash_group(tab, keys, lo, hi, homes, mask)
        for i in range(lo, hi):
            j = homes[i - lo]
            while tab[j, 1] >= 0:
                j = (j + _ONE) & mask
            tab[j, 0] = keys[i]
            tab[j, 1] = slots[i]


def _erase_py(tab: Any, keys: Any) -> int:
    mask = np.uint64(tab.shape[0] - 1)
    n = keys.shape[0]
    homes = np.empty(_GROUP, np.uint64)
    removed = 0
    for lo in range(0, n, _GROUP):
        hi = min(lo + _GROUP, n)
        _hash_group(tab, keys, lo, hi, homes, mask)
        for i in range(lo, hi):
            k = keys[i]
            j = homes[i - lo]
            while tab[j, 1] >= 0 and tab[j, 0] != k:
                j = (j + _ONE) & mask
            if tab[j, 1] < 0:
                continue  # absent
            removed += 1
            # Backward-shift deletion: walk the rest of the cluster and move back every entry
            # whose home is not cyclically inside (hole, j], so each key stays reachable from
            # its home and no tombstones accumulate.
            hole = j
            while True:
                j = (j + _ONE) & mask
                if tab[j, 1] < 0:
                    break
                h = _home(tab[j, 0], mask)
                if ((j - h) & mask) >= ((j - hole) & mask):
                    tab[hole, 0] = tab[j, 0]
                    tab[hole, 1] = tab[j, 1]
                    hole = j
            tab[hole, 1] = -1
    return removed


_home: Any = _home_py
_prefetch: Any = _prefetch_py
_lookup: Any = _lookup_py
_hash_group: Any = _hash_group_py
_KERNELS: dict[str, Any] = {}


def _prefetch_intrinsic(numba: Any) -> Any:
    """A numba intrinsic ``prefetch(ary, idx)``: LLVM's prefetch (read, high locality) of ``&ary[idx]``
    (``idx`` a tuple of one index per dimension)."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[misc]
    def prefetch(typingctx: Any, ary: Any, idx: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            aryty, idxty = signature.args
            array = context.make_array(aryty)(context, builder, args[0])
            indices = [context.cast(builder, v, t, numba.types.intp)
                       for v, t in zip(cgutils.unpack_tuple(builder, args[1], len(idxty)), idxty, strict=True)]
            ptr = cgutils.get_item_pointer(context, builder, aryty, array, indices)
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return numba.types.void(ary, idx), codegen

    return prefetch


def _numba_kernels() -> dict[str, Any]:
    """The compiled NumbaIndex kernels (loaded from numba's disk cache after the first run)."""
    global _home, _prefetch, _lookup, _hash_group
    if _KERNELS:
        return _KERNELS
    import numba

    inline = numba.njit(cache=True, nogil=True, inline="always")
    tab_keys_out = "void(int64[:, ::1], int64[::1], int64[::1])"

    def build(prefetch: Any) -> dict[str, Any]:
        global _home, _prefetch, _lookup, _hash_group
        _home, _lookup, _prefetch = inline(_home_py), inline(_lookup_py), prefetch
        _hash_group = inline(_hash_group_py)  # after _home and _prefetch: it calls them
        kernels: dict[str, Any] = {
            "find": numba.njit(tab_keys_out, cache=True, nogil=True)(_find_py),
            "insert": numba.njit(tab_keys_out, cache=True, nogil=True)(_insert_py),
            "erase": numba.njit("int64(int64[:, ::1], int64[::1])", cache=True, nogil=True)(_erase_py),
            "find_touch": numba.njit("int64(int64[:, ::1], int64[::1], int64[::1], float64[::1], int64[::1], "
                                     "float64, int64)", cache=True, nogil=True)(_find_touch_py),
            "touch": numba.njit("int64(int64[::1], float64[::1], int64[::1], float64, int64)",
                                cache=True, nogil=True)(_touch_py),
            "find_gather": numba.njit("int64(int64[:, ::1], int64[::1], int64[::1], float64[::1], int64[::1], "
                                      "float64, int64, float32[:, ::1], float32[:, ::1])",
                                      cache=True, nogil=True)(_find_gather_py),
        }
        # Compile-or-load now, so that a failure surfaces here rather than mid-training.
        tab = np.full((16, 2), -1, np.int64)
        keys = np.arange(3, dtype=np.int64)
        kernels["insert"](tab, keys, keys)
        kernels["find"](tab, keys, np.empty(3, np.int64))
        rows = np.zeros((3, 2), np.float32)
        kernels["find_gather"](tab, keys, np.empty(3, np.int64), np.zeros(3), np.zeros(3, np.int64), 1.0, 0, rows,
                                np.empty((3, 2), np.float32))
        kernels["erase"](tab, keys)
        return kernels

    try:
        kernels = build(_prefetch_intrinsic(numba))
    except Exception:  # an LLVM without this intrinsic: same kernels, no prefetch
        kernels = build(inline(_prefetch_py))
    _KERNELS.update(kernels)
    return _KERNELS


def numba_available() -> bool:
    """Whether numba can be imported (NumbaIndex works)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


class _Helpers:
    """Threads that take chunks of large finds off the caller's thread (the kernels drop the GIL).

    Why not numba's ``parallel=True``/``prange``: a fork-join region waits for every thread of
    its team, so on a busy 2-core machine a find stalls until the OS schedules a descheduled
    worker (measured: 5.6 ms for a batch the serial kernel does in 0.7 ms). Here the caller
    works through the chunks itself while a helper that is running takes chunks from the same
    counter; a helper that has not started by the time the caller is done is cancelled. So the
    caller waits for a helper only once it has started a chunk (16K keys, ~0.1 ms of work), and
    on 2 idle cores a find is about as fast as with ``prange`` (~1.9x the serial kernel). It is
    also fork-safe: a child process gets a fresh pool.
    """

    pool: ThreadPoolExecutor | None = None
    n = 0  # helper threads
    pid = -1
    lock = threading.Lock()

    @classmethod
    def get(cls) -> ThreadPoolExecutor | None:
        if cls.pid != os.getpid():  # first use, or a forked child (whose threads are gone)
            with cls.lock:
                if cls.pid != os.getpid():
                    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
                    cls.n = min(cpus or 1, int(os.environ.get("NUMBA_NUM_THREADS", 1 << 30))) - 1
                    cls.pool = ThreadPoolExecutor(cls.n, thread_name_prefix="embcache-index") if cls.n > 0 else None
                    cls.pid = os.getpid()
        return cls.pool


def _shared_find(kernel: Any, tab: Any, keys: Any, out: Any) -> None:
    """Run ``kernel(tab, keys, out)`` in chunks on the calling thread and any idle helpers."""
    n = keys.shape[0]
    pool = _Helpers.get() if n >= 2 * _CHUNK else None
    if pool is None:
        kernel(tab, keys, out)
        return
    n_chunks = -(-n // _CHUNK)
    chunks = itertools.count()  # next() is atomic under the GIL: each chunk is taken once

    def work() -> None:
        while (c := next(chunks)) < n_chunks:
            lo, hi = c * _CHUNK, min((c + 1) * _CHUNK, n)
            kernel(tab, keys[lo:hi], out[lo:hi])

    helpers = [pool.submit(work) for _ in range(min(_Helpers.n, n_chunks - 1))]
    work()
    for f in helpers:
        if not f.cancel():  # started: it holds at most one chunk; wait for it
            f.result()


class NumbaIndex(KeyIndex):
    """Linear-probing hash table with numba kernels (CPU only).

    Args:
        capacity: the most keys it must hold at once (>= 1).
        device: must be a CPU device.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity, device)
        if self.device.type != "cpu":
            raise ValueError(f"NumbaIndex runs on the CPU only, got device {self.device}")
        self._k = _numba_kernels()
        size = max(16, next_pow2(2 * self.capacity))
        # (key, slot) pairs; slot -1 marks an empty entry. The kernels see it through .numpy().
        self._tab = huge_page_zeros(size * 16).view(np.int64).reshape(size, 2)
        self._tab.fill(-1)
        self._table = torch.from_numpy(self._tab)
        self._views: dict[int, tuple[torch.Tensor, Any]] = {}

    def _arrays(self, *tensors: torch.Tensor) -> tuple[Any, ...]:
        # numpy views of a tier's arrays, made once: torch's .numpy() costs ~4 us a call here, and
        # a lookup would make three per batch of the same tensors. Held with their tensors, so
        # an id is not reused while cached; a few at most (a tier passes the same ones each time).
        views = []
        for t in tensors:
            held = self._views.get(id(t))
            if held is None or held[0] is not t:
                if len(self._views) >= 8:
                    self._views.clear()
                held = self._views[id(t)] = (t, t.numpy())
            views.append(held[1])
        return tuple(views)

    @property
    def table_size(self) -> int:
        """Entries in the open-addressing table (a power of two >= 2 * capacity)."""
        return int(self._tab.shape[0])

    @staticmethod
    def _np(t: torch.Tensor) -> Any:
        # A contiguous int64 numpy view (no copy when the tensor already is one; then in one call,
        # not four: each torch call costs microseconds).
        if t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous():
            return t.numpy()
        return t.reshape(-1).to(torch.int64).contiguous().numpy()

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots of ``keys``.

        Args:
            keys: int64 [n] CPU tensor; duplicates allowed.

        Returns:
            int64 [n] slots, -1 where a key is absent.
        """
        k = self._np(keys)
        out = torch.empty(k.shape[0], dtype=torch.int64)
        _shared_find(self._k["find"], self._tab, k, out.numpy())
        return out

    def find_touch(self, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float,
                   now: int) -> tuple[torch.Tensor, int]:
        """:meth:`KeyIndex.find_touch` in one compiled pass (CPU tensors; ``freq``/``last`` contiguous).

        Batches large enough for :meth:`find`'s helper threads are found in parallel and touched
        after, on this thread (concurrent ``freq[s] += inc`` of a repeated slot would lose counts).
        """
        k = self._np(keys)
        o = np.empty(k.shape[0], dtype=np.int64)
        out = torch.from_numpy(o)
        f, la = self._arrays(freq, last)
        if k.shape[0] >= 2 * _CHUNK and _Helpers.get() is not None:
            _shared_find(self._k["find"], self._tab, k, o)
            return out, int(self._k["touch"](o, f, la, float(inc), int(now)))
        return out, int(self._k["find_touch"](self._tab, k, o, f, la, float(inc), int(now)))

    def find_touch_gather(self, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float, now: int,
                          rows: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, int]:
        """:meth:`KeyIndex.find_touch_gather`, in one compiled pass that probes, counts and copies
        when torch runs on one thread (and ``rows``, ``out`` are contiguous float32).

        On one thread the pass beats probe-then-``index_select``: measured through
        ``EmbeddingCache.lookup`` on 453K rows, Zipf keys, batches of 8,192 and 65,536, in two
        A/B runs: 1.09-1.19x at dim 64 and 1.13-1.26x at dim 128. With more threads ``index_select`` spreads the copy
        over all of them and wins (2 threads on this 2-core VM: 0.92x for the pass, run alone or
        split over the helper threads), so there the base class's probe-then-gather runs. One
        torch thread per process is common in training: ``torchrun`` sets ``OMP_NUM_THREADS=1``
        for several ranks per machine.
        """
        if torch.get_num_threads() > 1 or not (rows.dtype == out.dtype == torch.float32 and rows.is_contiguous()
                                                and out.is_contiguous() and rows.dim() == out.dim() == 2):
            return super().find_touch_gather(keys, freq, last, inc, now, rows, out)
        k = self._np(keys)
        slots = np.empty(k.shape[0], dtype=np.int64)
        f, la, r = self._arrays(freq, last, rows)
        hits = self._k["find_gather"](self._tab, k, slots, f, la, float(inc), int(now), r, out.numpy())
        return torch.from_numpy(slots), int(hits)

    def insert(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Map ``keys[i]`` to ``slots[i]``.

        Args:
            keys: int64 [n] CPU tensor, unique and currently absent (not checked).
            slots: int64 [n] CPU tensor.

        Raises:
            RuntimeError: if ``len(self) + n > capacity`` (nothing is changed).
        """
        k, s = self._np(keys), self._np(slots)
        if k.shape[0] != s.shape[0]:
            raise ValueError(f"{k.shape[0]} keys but {s.shape[0]} slots")
        self._check_room(k.shape[0])
        self._k["insert"](self._tab, k, s)
        self._len += int(k.shape[0])

    def erase(self, keys: torch.Tensor) -> None:
        """Remove ``keys``.

        Args:
            keys: int64 [n] CPU tensor, unique and present (absent ones are ignored).
        """
        self._len -= int(self._k["erase"](self._tab, self._np(keys)))

    def clear(self) -> None:
        """Remove every key."""
        self._table[:, 1].fill_(-1)
        self._len = 0


def make_index(capacity: int, device: torch.device | str) -> KeyIndex:
    """The best index for ``device``: NumbaIndex on CPU when numba imports, else TorchIndex.

    Args:
        capacity: the most keys it must hold at once (>= 1).
        device: where keys and slots live.
    """
    device = torch.device(device)
    if device.type == "cpu" and numba_available():
        try:
            return NumbaIndex(capacity, device)
        except Exception as e:  # numba present but unusable (e.g. its LLVM fails): still work
            warnings.warn(f"NumbaIndex unavailable ({e!r}); using TorchIndex", RuntimeWarning, stacklevel=2)
    return TorchIndex(capacity, device)
