"""A memory tier of one table: rows, optimizer state, frequencies, dirty bits and a key index.

Storage is preallocated at the tier's capacity (in rows) on its device; nothing grows during
training. Slots are handed out from a stack of free slots; the index maps keys to slots. All
methods take and return batches as tensors; none loops over keys in Python. The caller (the
cache) serializes access with the table's lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import ConfigError
from .free_slots import FreeSlots
from .fused import FusedScratch
from .hostmem import host_zeros
from .index import NumbaIndex, index_kind, make_index
from .sample_filter import distinct_evictable
from .slot_table import SlotTable
from .types import Tier

__all__ = ["DIRTY", "MAX_TIER_ROWS", "OCCUPIED", "PIN", "MemoryTier", "RowBatch", "ScoreOf", "index_row_bytes",
           "release_cached_memory", "resident_row_bytes", "to_device", "to_host"]

# Per-row bookkeeping besides weights and state: one record of 24 bytes per row (MemoryTier.meta,
# int64 [capacity, 3]) that holds the row's key (int64), its last access tick (int64), its aged
# frequency (float32) and its flags (int32: occupied, dirty and the pin count packed). A lookup
# reads the key (to confirm the index's probe), adds to the frequency and stamps the tick of one
# row: one record, one cache line in 3 of 4 cases (two where the record straddles a line), where
# three arrays took three. The clock (ticks = key occurrences looked up) is never rebased, so
# it stays int64. The frequency is float32: an access adds the current increment (at most 2**40
# times the oldest; Clock renormalizes), and 24 bits of mantissa rank rows as well as 53 did
# (increments are lost only once a row's count passes 2**24 of them within a half-life). Free
# slots need no array per row (embcache/free_slots.py). The scratch of the fused update and of
# the eviction sample is sized by the batch (embcache/slot_table.py), not per row.
_BOOKKEEPING_BYTES = 24


# The bits of MemoryTier.flags: a row is there, it differs from its stored copy, and its pin count
# in steps of PIN (up to 2**29 - 1 holders).
OCCUPIED = 1
DIRTY = 2
_PIN_SHIFT = 2
PIN = 1 << _PIN_SHIFT

# Slots are int32 in the free-slot stack: a tier holds at most 2**31 - 1 rows.
MAX_TIER_ROWS = 2**31 - 1


def index_row_bytes(device: torch.device | str) -> int:
    """Bytes of key index per row of a tier on ``device`` (the index :func:`make_index` builds there):
    NumbaIndex (the CPU's) 8, TorchIndex (the GPU's, and the CPU's without numba) 24."""
    return index_kind(device).ROW_BYTES


def resident_row_bytes(dim: int, dtype: torch.dtype, state_width: int, device: torch.device | str) -> int:
    """Bytes one resident row costs in a memory tier on ``device``: weights, optimizer state,
    bookkeeping, key index.

    ``device`` has no default: a row costs more on a GPU (its key index is larger), and a budget
    sized with the host's figure for a GPU tier holds fewer rows than planned.

    A tier of ``budget`` bytes holds ``budget // resident_row_bytes(...)`` rows and, with
    everything it allocates counted, stays within the budget.
    """
    return (dim * torch.empty(0, dtype=dtype).element_size() + 4 * state_width + _BOOKKEEPING_BYTES
            + index_row_bytes(device))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. Host to GPU goes through pinned memory, asynchronously (the caching host
    allocator keeps a pinned block until the copies reading it have run): a copy from pageable
    memory runs at a fraction of the bandwidth and blocks the host. Other moves are torch's."""
    if device.type == "cuda" and t.device.type == "cpu" and t.numel():
        if not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=True)
    return t.to(device)


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the host, those on a GPU with one host sync for all: each is copied into
    pinned memory asynchronously, then the stream is waited for once (``.cpu()`` on each would
    block once per tensor). Host tensors are returned as they are."""
    if not any(t.device.type == "cuda" for t in tensors):
        return tuple(t.cpu() for t in tensors)
    out = []
    for t in tensors:
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t = host
        out.append(t)
    torch.cuda.current_stream().synchronize()
    return tuple(out)


def release_cached_memory(device: torch.device) -> None:
    """Hand the free blocks of torch's caching allocators back after tiers were dropped (a resize,
    close): the GPU's (old HBM tiers), and the pinned host blocks that staged copies (torch keeps
    each, rounded up to a power of two, for reuse; a block whose copy is still pending is freed
    once it has run). No-op on the CPU."""
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds only
    if host_empty_cache is not None:
        host_empty_cache()


@dataclass
class RowBatch:
    """Rows in transit between tiers: keys [n], weights [n, dim], state [n, S], freq, last, dirty, pins [n].

    ``pins`` (int32) counts the holders (a pass, a prefetch, a batch lease) that keep a row in
    memory; it moves with the row.
    """

    keys: torch.Tensor
    weights: torch.Tensor
    state: torch.Tensor
    freq: torch.Tensor
    last: torch.Tensor
    dirty: torch.Tensor
    pins: torch.Tensor

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def to(self, device: torch.device) -> RowBatch:
        """The same rows on ``device`` (to a GPU asynchronously from pinned memory, back with one sync)."""
        if device.type == "cpu":
            return RowBatch(*to_host(*self._fields()))
        return RowBatch(*(to_device(t, device) for t in self._fields()))

    def select(self, index: torch.Tensor) -> RowBatch:
        """Rows picked by a bool mask or an index tensor.

        A mask becomes positions once, and every field is gathered with ``index_select``:
        advanced indexing (``t[index]``) took 4-6x longer per field on CPU.
        """
        if index.dtype == torch.bool:
            index = torch.nonzero(index).flatten()
        index = to_device(index, self.keys.device)
        return RowBatch(*(t.index_select(0, index) for t in self._fields()))

    @staticmethod
    def cat(batches: list[RowBatch]) -> RowBatch:
        """Concatenate batches (all on one device)."""
        parts = [b._fields() for b in batches]
        return RowBatch(*(torch.cat([p[i] for p in parts]) for i in range(7)))

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.weights, self.state, self.freq, self.last, self.dirty, self.pins)


class MemoryTier:
    """Fixed-capacity row storage with a key index.

    Args:
        tier: which tier this is (HBM or DDR), for stats and messages.
        capacity: rows it can hold (0 disables it).
        dim: embedding dimension.
        state_width: float32 optimizer-state values per row.
        dtype: storage dtype of the weights.
        device: where the rows live.
        pinned_reads: gather reads into pinned memory, for a copy to the GPU (DDR with CUDA present).
    """

    def __init__(self, tier: Tier, capacity: int, dim: int, state_width: int, dtype: torch.dtype,
                 device: torch.device, pinned_reads: bool = False) -> None:
        if capacity > MAX_TIER_ROWS:
            raise ConfigError(f"{tier.value} tier: {capacity} rows exceed the {MAX_TIER_ROWS} a tier can hold "
                              "(slots are int32); give the table less memory or split it")
        self.tier = tier
        self.dim = dim
        self.device = device
        self._state_width = state_width
        self._dtype = dtype
        # Reads of a CUDA cache's DDR tier go to the GPU: they are gathered straight into pinned
        # staging buffers. The tier itself is ordinary host memory of exactly its budget (huge
        # pages where offered), as on a CPU cache: nothing copies from it to the GPU directly
        # (every read is a gather first), so pinning it only locked memory, rounded up to a power
        # of two by torch's pinned allocator (up to 2x ``ddr_bytes``) and committed all of it at once.
        self.pinned_reads = pinned_reads and device.type == "cpu" and torch.cuda.is_available()
        self.placement = 0  # bumped before every change of which key is in which slot
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        device = self.device
        self._placed()

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            # The arrays that lookups and evictions read at random: on huge pages in host memory
            # (see embcache/hostmem.py); on a GPU as torch makes them.
            if device.type == "cpu":
                return host_zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        self.capacity = capacity
        self.weights = zeros((capacity, self.dim), self._dtype)
        self.state = zeros((capacity, self._state_width), torch.float32)
        # One 24-byte record per row (see _BOOKKEEPING_BYTES): key, last, then freq and flags in
        # the third int64's halves. The four are strided views of it; occupied (bit 0), dirty
        # (bit 1) and pins (the rest: holders keeping a row resident, in steps of PIN) share the
        # flags: read and change them through the methods below.
        self.meta = zeros((capacity, 3), torch.int64)
        self.keys = self.meta[:, 0]
        self.last = self.meta[:, 1]
        self.freq = self.meta.view(torch.float32)[:, 4]
        self.flags = self.meta.view(torch.int32)[:, 5]
        self.index = make_index(max(capacity, 1), device, slot_keys=self.keys if capacity else None)
        # a NumbaIndex writes the keys column itself (it reads it to confirm a probe): once is enough
        self._keys_by_index = isinstance(self.index, NumbaIndex) and self.index.slot_keys is self.keys
        # Batch-sized scratch of the compiled CPU kernels (the fused update, the eviction sample's
        # filter), nothing per row; they run under the table's lock, one call at a time.
        self._table = SlotTable()
        self._fused_scratch: FusedScratch | None = None
        self._free = FreeSlots(capacity, device, self.occupied_mask)

    def _placed(self) -> None:
        # Which key is in which slot changed (insert, remove, clear, a new allocation): what
        # remembers slots across calls (engine/found.py) compares this version.
        self.placement += 1

    def release(self) -> None:
        """Give this tier's memory back now (a resize replaced it, or the cache closed): every array
        is replaced by an empty one, so the memory goes even where something still refers to the
        tier; the tier is left with capacity 0. The caller has written dirty rows back."""
        self._allocate(0)

    def arrays(self) -> tuple[torch.Tensor, ...]:
        """Every per-row array the tier allocated (the key index apart; ``keys``, ``last``, ``freq``
        and ``flags`` are views of ``meta``)."""
        return (self.weights, self.state, self.meta)

    # -- sizes ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.capacity - self._free.n_free

    @property
    def free(self) -> int:
        """Free slots."""
        return self._free.n_free

    @property
    def free_list_bytes(self) -> int:
        """Bytes the list of recently freed slots holds now (not per row: 256 KiB at most)."""
        return self._free.nbytes

    @property
    def row_bytes(self) -> int:
        """Bytes one resident row costs (weights, state, bookkeeping and key index)."""
        return resident_row_bytes(self.dim, self.weights.dtype, self.state.shape[1], self.device)

    # -- lookup --------------------------------------------------------------------------------
    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots (int64 [n], -1 where absent) of ``keys`` (int64 [n], any device)."""
        if self.capacity == 0:
            return torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
        return self.index.find(to_device(keys, self.device))

    def find_touch(self, keys: torch.Tensor, increment: float, now: int,
                   once: bool = False) -> tuple[torch.Tensor, int]:
        """Slots of ``keys`` (int64 [n], -1 where absent) and how many were found; each found
        occurrence counts one access of weight ``increment`` (``freq += increment``, ``last = now``), in one pass;
        with ``once``, a row counts one access per tick (its repeats in ``keys`` add nothing)."""
        if self.capacity == 0:
            return torch.full(keys.shape, -1, dtype=torch.int64, device=self.device), 0
        return self.index.find_touch(to_device(keys, self.device), self.freq, self.last, increment, now, once)

    def find_touch_gather(self, keys: torch.Tensor, increment: float, now: int, out: torch.Tensor,
                          once: bool = False) -> tuple[torch.Tensor, int]:
        """:meth:`find_touch`, and the weights of every found key copied into ``out`` (float32 [n, dim]
        on this tier's device; the rows of absent keys are left as they were)."""
        if self.capacity == 0:
            return self.find_touch(keys, increment, now, once)
        return self.index.find_touch_gather(to_device(keys, self.device), self.freq, self.last, increment, now,
                                            self.weights, out, once)

    def fused_scratch(self) -> FusedScratch:
        """Scratch buffers of the fused update kernel for this tier (made on first use)."""
        if self._fused_scratch is None:
            self._fused_scratch = FusedScratch(self._table)
        return self._fused_scratch

    def touch(self, slots: torch.Tensor, amounts: torch.Tensor, now: int) -> None:
        """Add ``amounts`` (float [n]) to the aged frequencies of ``slots`` (int64 [n], may repeat)."""
        self.freq.index_add_(0, slots, to_device(amounts.to(self.freq.dtype), self.device))
        self.last.index_fill_(0, slots, now)

    def read(self, slots: torch.Tensor, pinned: bool = True) -> RowBatch:
        """Copies of the rows at ``slots`` (no change to the tier); ``pinned=False`` keeps a CUDA
        cache's DDR reads out of pinned memory (rows that stay on the host)."""
        slots = to_device(slots, self.device)
        n = slots.numel()
        flags = self.flags.index_select(0, slots)
        if self.pinned_reads and pinned:  # gathered straight into pinned memory: the copy to the GPU needs no staging
            def out(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            cols = [torch.index_select(t, 0, slots, out=out((n, *t.shape[1:]), t.dtype)) for t in self._columns()]
            dirty = torch.ne(flags & DIRTY, 0, out=out((n,), torch.bool))
            pins = torch.bitwise_right_shift(flags, _PIN_SHIFT, out=out((n,), torch.int32))
        else:
            cols = [t.index_select(0, slots) for t in self._columns()]
            dirty, pins = (flags & DIRTY) != 0, flags >> _PIN_SHIFT
        keys, weights, state, freq, last = cols
        return RowBatch(keys, weights, state, freq, last, dirty, pins)

    def _columns(self) -> tuple[torch.Tensor, ...]:
        # The per-row tensors of RowBatch's first fields (its dirty and pins are in ``flags``).
        return (self.keys, self.weights, self.state, self.freq, self.last)

    # -- flags: occupied, dirty, pins ------------------------------------------------------------
    def occupied_mask(self) -> torch.Tensor:
        """Bool [capacity]: which slots hold rows."""
        return (self.flags & OCCUPIED) != 0

    def evictable_mask(self) -> torch.Tensor:
        """Bool [capacity]: which slots hold rows that no one pins."""
        return (self.flags & ~DIRTY) == OCCUPIED

    def dirty_slots(self) -> torch.Tensor:
        """Slots of resident rows that differ from their stored copy."""
        return torch.nonzero((self.flags & (OCCUPIED | DIRTY)) == (OCCUPIED | DIRTY)).flatten()

    def occupied_slots(self) -> torch.Tensor:
        """Slots holding rows."""
        return torch.nonzero(self.occupied_mask()).flatten()

    def dirty_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool [n]: the dirty bits of ``slots`` (int64 [n])."""
        return (self.flags.index_select(0, to_device(slots, self.device)) & DIRTY) != 0

    def pins_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Int32 [n]: the pin counts of ``slots`` (int64 [n])."""
        return self.flags.index_select(0, to_device(slots, self.device)) >> _PIN_SHIFT

    def set_dirty(self, slots: torch.Tensor, dirty: bool | torch.Tensor) -> None:
        """Set the dirty bits of ``slots`` (int64 [n]) to ``dirty`` (a bool or bool [n])."""
        if slots.numel() == 0:
            return
        slots = to_device(slots, self.device)
        f = self.flags.index_select(0, slots) & ~DIRTY
        if isinstance(dirty, torch.Tensor):
            f |= dirty.to(device=f.device, dtype=torch.int32) * DIRTY
        elif dirty:
            f |= DIRTY
        self.flags.index_copy_(0, slots, f)

    # -- change --------------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Overwrite weights and state of resident rows and mark them dirty."""
        slots = to_device(slots, self.device)
        self.weights[slots] = to_device(weights.to(self.weights.dtype), self.device)
        self.state[slots] = to_device(state, self.device)
        self.set_dirty(slots, True)

    def fill(self, slots: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Set weights and state of resident rows at ``slots`` without marking them dirty (the
        values that rows inserted ahead of them, as placeholders, have in the store)."""
        if slots.numel() == 0:
            return
        slots = to_device(slots, self.device)
        self.weights.index_copy_(0, slots, to_device(weights.to(self.weights.dtype), self.device))
        self.state.index_copy_(0, slots, to_device(state, self.device))

    def insert(self, rows: RowBatch) -> torch.Tensor:
        """Place ``rows`` (keys unique and absent) in free slots; returns their slots.

        Raises:
            RuntimeError: more rows than free slots (a bug in the caller's planning).
        """
        n = len(rows)
        if n > self._free.n_free:
            raise RuntimeError(f"{self.tier.value} tier: {n} rows do not fit in {self._free.n_free} free slots")
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        self._placed()  # first: a failure half-way must not leave remembered slots valid
        slots = self._free.take(n)
        rows = rows.to(self.device)
        for column, values in zip(self._columns(), rows._fields()[:5], strict=True):
            if column is not self.keys or not self._keys_by_index:
                column.index_copy_(0, slots, values.to(column.dtype))
        flags = (rows.pins.to(torch.int32) << _PIN_SHIFT) | (rows.dirty.to(torch.int32) * DIRTY) | OCCUPIED
        self.flags.index_copy_(0, slots, flags)
        self.index.insert(rows.keys, slots)
        return slots

    def remove(self, slots: torch.Tensor) -> None:
        """Free the (unique, occupied) ``slots``; their rows are gone from this tier."""
        if slots.numel() == 0:
            return
        self._placed()
        slots = to_device(slots, self.device)
        self.index.erase(self.keys.index_select(0, slots))
        self.flags.index_fill_(0, slots, 0)
        self._free.give(slots)

    def add_pins(self, slots: torch.Tensor, delta: int, where: torch.Tensor | None = None) -> None:
        """Add ``delta`` to the pin counts of ``slots`` (unique; a count never drops below 0); with
        ``where`` (bool, like ``slots``), only to those slots where it is True (the others may be
        -1: a GPU caller masks instead of selecting, which would cost a host sync)."""
        if slots.numel() == 0 or self.capacity == 0:
            return
        slots = to_device(slots, self.device)
        if where is None:
            amounts = torch.full(slots.shape, delta * PIN, dtype=torch.int32, device=self.device)
        else:
            amounts = where.to(torch.int32) * (delta * PIN)
            slots = slots.clamp(min=0)  # masked-out slots add 0 to slot 0
        self.flags.index_add_(0, slots, amounts)
        # A count below 0 goes back to 0: its flag bits are intact (steps of PIN leave them), and
        # then f & (PIN - 1) > f.
        f = self.flags.index_select(0, slots)
        self.flags.index_copy_(0, slots, torch.maximum(f, f & (PIN - 1)))

    def pinned_count(self) -> int:
        """Resident rows held by at least one pin."""
        return int(((self.flags >= PIN) & ((self.flags & OCCUPIED) != 0)).sum())

    def scale_freq(self, factor: float) -> None:
        """Multiply every frequency by ``factor`` (clock renormalization)."""
        self.freq.mul_(factor)

    def clear(self) -> None:
        """Drop every row (the caller has written dirty ones back)."""
        self._placed()
        self.index.clear()
        self.flags.zero_()
        self._free.clear()

    # -- eviction ------------------------------------------------------------------------------
    def lowest(self, k: int, scores_of: ScoreOf, sample: int, exclude: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` (or fewer) evictable resident rows with the lowest scores, ascending.

        Args:
            k: victims wanted.
            scores_of: ``fn(slots) -> float64 scores`` (the policy's score of those rows).
            sample: consider ``sample * k`` random slots (all rows when that is at least half the
                tier): sampled eviction keeps the cost per batch O(k), not O(capacity). Only the
                sampled slots are tested for being occupied, unpinned and not excluded; a
                capacity-sized mask cost 7 ms per batch at 1M rows (10-80 ms at 10M).
            exclude: int64 slots that must stay (e.g. rows in use by this batch); repeats allowed.
            generator: random source for sampling (seeded per table for repeatability).

        Returns:
            (slots int64 [m], scores float64 [m]) with m <= k, lowest score first.
        """
        empty = torch.empty(0, device=self.device)
        if k <= 0 or self.capacity == 0:
            return empty.to(torch.int64), empty.to(torch.float64)
        if exclude is not None:
            exclude = to_device(exclude, self.device)
        n_cand = sample * k
        cand = None
        if n_cand * 2 < self.capacity:
            cand = torch.randint(0, self.capacity, (n_cand,), device=self.device, generator=generator)
            # One occurrence per sampled slot, excluded slots dropped, occupied and unpinned only
            cand = distinct_evictable(cand, exclude, self.flags, ~DIRTY, OCCUPIED, self._table)
        if cand is None or cand.numel() < k:  # small tier, or a mostly pinned one the sample missed
            evictable = self.evictable_mask()
            if exclude is not None:
                evictable.index_fill_(0, exclude, False)
            cand = torch.nonzero(evictable).flatten()
        if cand.numel() == 0:
            return empty.to(torch.int64), empty.to(torch.float64)
        scores = scores_of(cand)
        k = min(k, cand.numel())
        # an unsorted top-k, then a sort of those k: 2.6x faster on CPU than a sorted top-k
        vals, pos = torch.topk(scores, k, largest=False, sorted=False)
        vals, order = torch.sort(vals, stable=True)
        return cand.index_select(0, pos.index_select(0, order)), vals


class ScoreOf(Protocol):
    """The scoring callback: policy scores (float64) of the rows at ``slots``."""

    def __call__(self, slots: torch.Tensor) -> torch.Tensor: ...
