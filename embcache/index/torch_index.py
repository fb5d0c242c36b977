"""TorchIndex: bucketed two-choice hashing in plain torch ops (any device: the CUDA path, and the
CPU fallback without numba).

``nb = ceil(capacity / (B * LOAD))`` buckets of ``B = 8`` entries (a load of at most
:data:`LOAD` = 55%), keys in an ``int64 [nb, B]`` tensor and slots in an ``int32 [nb, B]`` one:
12 bytes an entry, ~22 bytes per row with the stash marks (34-60 before: 16-byte entries in a
power of two of buckets). Key ``k`` may live in bucket ``h1``
or ``h2``, the high and the low 32 bits of ``mix64(k)`` each mapped to ``[0, nb)`` by
multiply-shift range reduction (``(x * nb) >> 32``, "fastrange"), so ``nb`` need not be a power
of two and the table is sized to the load, not rounded up:

- Inserts place keys in up to four passes: ``h1`` while it holds fewer than 7 keys, then ``h2``
  likewise, then ``h1`` and ``h2`` up to all 8. Filling ``h1`` to the brim first (as before)
  stashed up to ~0.3% of keys under churn at this load (a simulation of random erases and
  inserts; ~0.6% at 60% load), near the stash's 0.4%, past which the table doubles; keeping the
  last entry of each bucket for keys whose other bucket is crowded brings it to ~0.01%, and ~90%
  of keys still sit in ``h1``. ``find`` on CPU
  reads one 64-byte bucket of keys per key and a second one only for the keys it did not find
  there (misses, mostly). On CUDA it reads both in one gather instead, trading bandwidth for not
  synchronizing with the host.
- Keys whose candidate buckets are both full go to a small sorted *stash*, searched with
  ``searchsorted``. Only a full stash (``capacity / 256`` keys) doubles ``nb`` and rebuilds;
  each doubling splits every bucket by one more bit of each hash half, so colliding keys part.
- Empty entries of bucket ``b`` hold a *filler* key whose two buckets are both 0 (for
  ``b != 0``), or both 1 (for ``b = 0``); a key probing ``b`` therefore never equals it, so a key
  match is always a live entry and ``find`` compares keys only, then reads one slot per key.
  (Two keys for the whole table, not one stored per bucket.)
- Keys of one insert batch that target the same bucket are sorted by bucket; the key of rank
  ``r`` in its bucket takes the bucket's ``r``-th free entry.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from types import ModuleType
from typing import Any

import torch

from .._bits import mix64, unmix64
from .base import KeyIndex

# Byte k of this is 7 - k, so for a word with only byte i set (the value 1 << 8i), the top byte of
# word * _BYTE_INDEX is i: the index of the set byte without a loop or a reduction.
_BYTE_INDEX = 0x0001020304050607
_BIG_ENDIAN = sys.byteorder == "big"  # bool -> bytes views put column 0 in the top byte there
_LOW32 = 0xFFFFFFFF
# Keys per entry at capacity: the table has ceil(capacity / (B * LOAD)) buckets.
LOAD = 0.55
# Inserts put a key in a bucket holding fewer than this many keys before they fill any bucket
# to the brim (see the module docstring); with B = 8 the last entry waits for crowded keys.
_SPARE = 1


class TorchIndex(KeyIndex):
    """Bucketed two-choice hash table with a small stash, in plain torch ops (CPU or CUDA).

    Args:
        capacity: the most keys it must hold at once (>= 1).
        device: where the table lives.
        bucket_width: entries per bucket ``B``; one bucket of keys is ``B * 8`` bytes.
        fused: probe (and touch and gather) in one Triton kernel (:mod:`embcache.index.triton_probe`)
            rather than ~30 torch ops; None (the default): on a GPU when triton imports. True on the
            CPU runs the kernel under Triton's interpreter (tests). Should the kernel fail to build
            on this machine, the index warns once and goes on in torch ops.
    """

    # 8-entry buckets of (key, int32 slot) at load <= 0.55 and a stash: ~22 bytes a row (nbytes),
    # counted as 24, until a full stash makes it grow (adversarial keys; not seen at its load)
    ROW_BYTES = 24

    def __init__(self, capacity: int, device: torch.device | str = "cpu", bucket_width: int = 8,
                 fused: bool | None = None) -> None:
        super().__init__(capacity, device)
        if fused:
            mod = _triton_probe()
            if mod is None:
                raise ValueError("TorchIndex(fused=True) needs triton (pip install 'embcache[gpu]')")
            if self.device.type == "cpu" and not mod.interpreted():
                raise ValueError("TorchIndex(fused=True) on the CPU runs the kernel under Triton's interpreter: "
                                 "set TRITON_INTERPRET=1 before triton is imported")
        self.fused = (self.device.type == "cuda" and _triton_probe() is not None) if fused is None else bool(fused)
        if bucket_width < 8 or bucket_width % 8:
            raise ValueError(f"bucket_width must be a positive multiple of 8, got {bucket_width}")
        self.bucket_width = int(bucket_width)
        if self.capacity >= 1 << 31:
            raise ValueError(f"TorchIndex holds fewer than 2**31 keys (slots are int32), got capacity {capacity}")
        # First column of each 8-column word of a match row of up to two buckets.
        self._word_base = torch.arange(0, 2 * bucket_width, 8, dtype=torch.int64, device=self.device)
        # Keys whose two buckets are both full wait here (about one in 10,000 under churn at full
        # load) rather than doubling the table; only a full stash forces growth.
        self.stash_capacity = max(64, self.capacity // 256)
        # At most LOAD at capacity; >= 2 buckets so that every bucket has a filler key (below).
        self._nb0 = max(2, math.ceil(self.capacity / (self.bucket_width * LOAD)))
        self._alloc(self._nb0)

    def _bytes(self, nb: int) -> int:
        """Bytes of the table at ``nb`` buckets with a full stash: keys and slots (12 per entry)
        and a stash mark (1) per bucket, 12 per stash entry, the spare entry."""
        return nb * (12 * self.bucket_width + 1) + 12 * self.stash_capacity + 8 * self._word_base.numel() + 12

    @property
    def nbytes(self) -> int:
        """Bytes the index holds now, its stash counted full (it grows only past a full stash)."""
        return self._bytes(self._nb)

    def _filler(self, b: torch.Tensor) -> torch.Tensor:
        """The filler keys of buckets ``b``: the key whose two buckets are both 1 for bucket 0, the
        key whose two buckets are both 0 for the others. Empty entries of bucket b hold it, so a
        key probing b (its h1 or h2 is b) cannot equal it: a key match is always a live entry, and
        find compares keys only, then reads one slot per key."""
        return torch.where(b == 0, self._fill1, self._fill0)

    def _alloc(self, nb: int) -> None:
        if nb >= 1 << 31:  # (x * nb) >> 32 must not overflow int64
            raise RuntimeError(f"TorchIndex cannot grow past 2**31 buckets (capacity {self.capacity})")
        self._nb = nb
        # The least 32-bit x with (x * nb) >> 32 == c, as both halves of a hash, is a key whose
        # two buckets are both c (0 and 1 here; computed on the host, no device work).
        both = [(x << 32 | x) - ((x >> 31) << 64) for x in (0, -(-(1 << 32) // nb))]
        self._fill0, self._fill1 = unmix64(torch.tensor(both, dtype=torch.int64)).tolist()
        # Flat tables of nb * B entries and one more, outside every bucket: where the GPU path's
        # masked writes put the entries it does not mean to write (a write to a position picked
        # out by a boolean mask would cost a host sync to learn how many there are).
        entries = nb * self.bucket_width
        self._dump = entries
        fill = self._filler(torch.arange(nb, dtype=torch.int64, device=self.device))
        self._keys_flat = torch.cat((fill[:, None].expand(nb, self.bucket_width).reshape(-1),
                                     torch.zeros(1, dtype=torch.int64, device=self.device)))
        self._slots_flat = torch.full((entries + 1,), -1, dtype=torch.int32, device=self.device)  # -1: empty
        self._keys = self._keys_flat[:entries].view(nb, self.bucket_width)  # [nb, B]
        self._slots = self._slots_flat[:entries].view(nb, self.bucket_width)
        self._stash_keys = torch.empty(0, dtype=torch.int64, device=self.device)  # sorted
        self._stash_slots = torch.empty(0, dtype=torch.int32, device=self.device)
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
        # h1 from the high 32 bits of the hash, h2 from the low 32 (the finalizer mixes both
        # well), each mapped to [0, nb) by multiply-shift: < 2**32 * nb < 2**63, no overflow.
        x = (h & _LOW32) if second else ((h >> 32) & _LOW32)
        return (x * self._nb) >> 32

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
        found = self._fused_probe(keys)
        if found is not None:
            return found[0]
        h = mix64(keys)
        if self.device.type == "cpu":
            return self._find_two_pass(keys, h)
        return self._find_one_pass(keys, h)

    def find_touch(self, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float,
                   now: int, once: bool = False) -> tuple[torch.Tensor, int]:
        """As :meth:`KeyIndex.find_touch`; one kernel launch when :attr:`fused`."""
        keys = keys.reshape(-1)
        if keys.numel() and freq.dtype == torch.float32 and last.dtype == torch.int64:
            found = self._fused_probe(keys, freq, last, touch=(freq, last, inc, now, once), count=True)
            if found is not None:
                return found[0], int(found[1])  # type: ignore[arg-type]  # the one host sync
        return super().find_touch(keys, freq, last, inc, now, once)

    def find_touch_gather(self, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float, now: int,
                          rows: torch.Tensor, out: torch.Tensor, once: bool = False) -> tuple[torch.Tensor, int]:
        """As :meth:`KeyIndex.find_touch_gather`; one kernel launch when :attr:`fused`."""
        keys = keys.reshape(-1)
        if (keys.numel() and freq.dtype == torch.float32 and last.dtype == torch.int64 and rows.dim() == 2
                and rows.stride(1) == 1 and out.stride(1) == 1):
            found = self._fused_probe(keys, freq, last, rows, out, touch=(freq, last, inc, now, once),
                                      gather=(rows, out), count=True)
            if found is not None:
                return found[0], int(found[1])  # type: ignore[arg-type]  # the one host sync
        return super().find_touch_gather(keys, freq, last, inc, now, rows, out, once)

    def _fused_probe(self, keys: torch.Tensor, *tensors: torch.Tensor,
                     **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The Triton kernel's ``(slots, count)`` for ``keys`` (and the ``touch``/``gather``/``count`` of
        ``kw``); None where it does not apply (not :attr:`fused`, or a tensor subclass such as the
        test suite's CUDA stand-in, whose data the kernel cannot reach) or it failed to build."""
        if not self.fused or any(type(t) is not torch.Tensor for t in (keys, *tensors)):
            return None
        mod = _triton_probe()
        assert mod is not None
        try:
            return mod.probe(keys.contiguous(), self._keys_flat, self._slots_flat, self._nb, self.bucket_width,
                             self._stash_keys, self._stash_slots, **kw)
        except Exception as exc:  # e.g. no C compiler for Triton's launcher: the torch ops still work
            if mod.interpreted() or self.device.type == "cpu":
                raise  # a bug in the kernel, not a machine without the tools to build it
            self.fused = False
            warnings.warn(f"TorchIndex: the fused Triton probe failed to run ({exc!r}); using torch ops",
                          RuntimeWarning, stacklevel=3)
            return None

    def _find_one_pass(self, keys: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # Both buckets in one gather and no host sync (the GPU path): bandwidth is cheap there,
        # a synchronization is not. The buckets as _bucket computes them, in fewer kernels.
        b = ((torch.stack((h >> 32, h), 1) & _LOW32) * self._nb) >> 32  # [n, 2]
        hit, pos = self._match(keys, b)
        out = torch.where(hit, self._slots.view(-1).index_select(0, pos), -1)
        if self.n_stashed:
            out = torch.where(hit, out, self._stash_find(keys))
        return out.to(torch.int64)

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
        return out.to(torch.int64)

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
            slots: int64 [n] on ``self.device``, each in ``[0, 2**31)`` (stored as int32; not checked).

        Raises:
            RuntimeError: if ``len(self) + n > capacity`` (nothing is changed).
        """
        keys = keys.reshape(-1)
        slots = slots.reshape(-1).to(torch.int32)
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

    def _passes(self) -> tuple[tuple[bool, int], ...]:
        """(second bucket?, most keys a bucket may hold after the pass) of each placement pass."""
        full, spare = self.bucket_width, self.bucket_width - _SPARE
        return (False, spare), (True, spare), (False, full), (True, full)

    def _place_both(self, k: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put each key in one of its two buckets (the passes of :meth:`_passes`); returns the keys
        and slots left over."""
        h = mix64(k)
        if self.device.type == "cpu":  # each pass on the keys still left (compacted)
            for second, most in self._passes():
                left = ~self._place(k, s, self._bucket(h, second), most)
                k, s, h = k[left], s[left], h[left]
                if k.numel() == 0:
                    break
            return k, s
        # The GPU path: every pass over every key, those already placed masked out, and one
        # host sync to learn whether any is left (almost never: then they are compacted).
        left = torch.ones(k.shape, dtype=torch.bool, device=self.device)
        for second, most in self._passes():
            left &= ~self._place(k, s, self._bucket(h, second), most, left)
        if not bool(left.any()):
            return k[:0], s[:0]
        return k[left], s[left]

    def _place(self, k: torch.Tensor, s: torch.Tensor, b: torch.Tensor, most: int,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """Put each key (of those ``active``, bool [m], if given) in a free entry of its bucket
        ``b``, as long as the bucket then holds at most ``most`` keys; returns bool [m]: placed."""
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
        ok_sorted = rank < cfree[:, -1] - (self.bucket_width - most)
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
            self._keys.view(-1).index_copy_(0, pos, self._filler(b))
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
            self._keys_flat.index_copy_(0, pos, self._filler(b))
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
            b = torch.arange(self._nb, dtype=torch.int64, device=self.device)
            self._keys.copy_(self._filler(b)[:, None].expand_as(self._keys))
            self._slots.fill_(-1)
            self._set_stash(self._stash_keys[:0], self._stash_slots[:0])
        self._len = 0


_PROBE: list[ModuleType | None] = []


def _triton_probe() -> ModuleType | None:
    """:mod:`embcache.index.triton_probe`, or None where triton does not import (imported once)."""
    if not _PROBE:
        try:
            triton_probe = importlib.import_module(f"{__package__}.triton_probe")
        except ImportError:  # no triton: the torch ops
            _PROBE.append(None)
        except Exception as exc:  # a triton whose API this kernel does not fit (e.g. too old): the torch ops
            warnings.warn(f"TorchIndex: the fused Triton probe is unavailable ({exc!r}); using torch ops",
                          RuntimeWarning, stacklevel=2)
            _PROBE.append(None)
        else:
            _PROBE.append(triton_probe)
    return _PROBE[0]
