"""NumbaIndex: open addressing with linear probing in numba kernels (CPU only, the hot path).

The table has ``ceil(capacity / LOAD)`` entries (:data:`LOAD` = 0.5: ~1.5 probes per hit, ~2.5
per miss) of 4 bytes each, 8 bytes per row. An entry holds no key: it holds a row's *slot* in
its low ``b`` bits (``b = capacity.bit_length()``) and, in the other ``32 - b`` bits, a *tag*,
bits of the key's hash that the home position does not use. The key itself is kept once, in the
tier's per-slot key array (``slot_keys``), which a tier keeps anyway (eviction and write-back
read a slot's key). A probe compares tags; a matching tag is confirmed by reading
``slot_keys[slot]``, which a hit needs once and a miss almost never (a false match has odds
``2 ** -(32 - b)``: 1 in 4,096 at 1M rows, 1 in 16 at 2**27 rows). Before, entries held the key
(12 bytes, 24 per row) and the tier held it again: 16 bytes per row went to keeping each key twice.

A key's home entry is its hash's high 32 bits times the table size, shifted down by 32
(multiply-shift range reduction), so the size need not be a power of two; probes wrap around the
end. Entries are 4-byte aligned, so one never straddles two cache lines. Deletion shifts the rest
of the cluster back (no tombstones, so probe lengths do not degrade under churn), and at most
``capacity`` of the > ``capacity`` entries are used, so inserts cannot fail. The kernels are
numba ``@njit(cache=True, nogil=True)`` functions on numpy views of the torch tensors (no
copies), compiled on first use so that numba stays optional.

The table is far larger than the caches, so a probe is a cache miss, and so is the confirming
read of the key: the kernels work on groups of keys in phases (hash all and prefetch their
entries; find each one's first matching tag and prefetch that slot's key; confirm), which keeps
many misses in flight (2-3x the rate of probing key by key), and the table sits on transparent
huge pages (``embcache/hostmem.py``) so that probes do not miss the TLB too. Large ``find``
batches are shared, in chunks, between the calling thread and helper threads (see
:class:`_Helpers` for why not ``prange``). The lookup's hot path, ``find_touch_gather``, goes
one step further on one torch thread: a rolling pipeline hashes one key, finds the candidate of
an earlier one and prefetches its key, row and counters, and confirms, counts and copies a still
earlier one, all in one pass.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .._bits import M1, M2
from ..hostmem import host_zeros, huge_page_zeros
from .base import KeyIndex

# NumbaIndex.find splits batches of at least two chunks of this many keys over helper threads.
_CHUNK = 16384

# The NumbaIndex kernels are plain functions here, compiled on first use by _numba_kernels() so
# that numba stays optional and is imported only when a NumbaIndex is built. They are module-level
# (not closures) because numba keys its on-disk cache on closure contents, and a closure over
# another jitted function would miss the cache in every new process. The names they call
# (_hash, _home, ...) are globals that _numba_kernels() rebinds to their numba versions before
# compiling the entry points.
_M1_U64 = np.uint64(M1)
_M2_U64 = np.uint64(M2)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_ONE, _ZERO = np.uint64(1), np.uint64(0)
_EMPTY = -1  # an entry that holds nothing (its slot bits all ones: no slot is that large)
# The most entries a table may have: the home's range reduction multiplies a 32-bit hash by it.
_MAX_ENTRIES = 1 << 32
# Keys per table entry at capacity: 2 entries of 4 bytes, 8 bytes of index per row.
LOAD = 0.5
# Bytes of index per row at LOAD, what the tiers count (embcache/tier.py).
ROW_BYTES = 8
# The gather kernel's pipeline distance in keys (see _probe_py); each key in flight adds its
# row's 4-8 lines, its key's line and two counter lines.
_AHEAD = 16
# The find kernels' pipeline distance: their work per key is small, so more keys are in flight.
_FIND_AHEAD = 32
# The hashes and positions in flight (> 2 * the largest distance).
_RING = 128
# Keys an insert hashes and prefetches before placing any of them.
_GROUP = 128


def _hash_py(k: int) -> Any:
    # mix64 in uint64 (mixing int64 with uint64 in numba would promote to float64; identical bits
    # to embcache._bits.mix64()).
    x = np.uint64(k)
    x = (x ^ (x >> _S30)) * _M1_U64
    x = (x ^ (x >> _S27)) * _M2_U64
    return x ^ (x >> _S31)


def _home_py(h: Any, size: Any) -> Any:
    # The table index by multiply-shift range reduction ("fastrange"): the high 32 bits of the
    # hash times size (< 2**32), shifted down by 32, fall evenly in [0, size) for any size.
    return ((h >> _S32) * size) >> _S32


def _want_py(h: Any, b: int) -> Any:
    # The tag bits an entry of hash h carries, in place (int64): the hash's low 32 - b bits
    # (independent of the home, which uses the high 32), shifted above the b slot bits.
    return np.int64(h & np.uint64((1 << (32 - b)) - 1)) << b


def _next_py(j: Any, size: Any) -> Any:
    # The entry after j, wrapping around the end of the table.
    j += _ONE
    return _ZERO if j == size else j


def _prefetch_py(ary: Any, idx: Any) -> None:
    # Fallback when the LLVM prefetch intrinsic cannot be built: prefetching is only a hint.
    pass


def _candidate_py(tab: Any, j: Any, want: Any, b: int, size: Any) -> tuple[Any, Any]:
    # From entry j on, the first entry whose tag is ``want``: (its position, its slot), or (the
    # empty entry that ends the cluster, -1). An entry's bits, sign-extended: all ones is empty,
    # the low b are the slot, the next 32 - b the tag (masked: the sign extension sets the rest).
    tag_mask = np.int64((1 << 32) - (1 << b))
    while True:
        e = np.int64(tab[j])
        if e == _EMPTY:
            return j, np.int64(-1)
        if (e & tag_mask) == want:
            return j, e & np.int64((1 << b) - 1)
        j = _next(j, size)


def _confirm_py(tab: Any, skeys: Any, k: int, j: Any, s: Any, want: Any, b: int, size: Any) -> tuple[Any, Any]:
    # The candidate (j, s) confirmed: while its slot holds another key (a false tag match), the
    # next candidate after it. Returns (position, slot) of k's entry, or (the empty entry, -1).
    while s >= 0 and skeys[s] != k:
        j, s = _candidate(tab, _next(j, size), want, b, size)
    return j, s


def _lookup_py(tab: Any, skeys: Any, k: int, b: int, size: Any) -> tuple[Any, Any]:
    # (position, slot) of k's entry, or (the empty entry ending its cluster, -1): no prefetching.
    h = _hash(k)
    want = _want(h, b)
    j, s = _candidate(tab, _home(h, size), want, b, size)
    return _confirm(tab, skeys, k, j, s, want, b, size)


def _probe_py(tab: Any, skeys: Any, b: int, keys: Any, out: Any, freq: Any, last: Any, inc: float, now: int,
              once: bool, touch: bool, gather: bool, rows: Any, orows: Any, ahead: int) -> int:
    # The slots of keys into out (-1 where absent); with ``touch`` each hit counts one access of
    # its row (freq += inc in float32, last = now; with ``once`` only where last != now, so a
    # row counts once per tick) as it is confirmed, and with ``gather`` its row
    # of ``rows`` is copied into ``orows[i]`` too (a miss leaves orows[i] as it was). Returns the
    # hits. A rolling pipeline of three stages, ``ahead`` keys apart: key i + 2 * ahead is hashed
    # and its table entry prefetched; key i + ahead gets its candidate (the first entry with its
    # tag; the line has arrived) and the key at that slot is prefetched (with ``gather``, its row
    # and counters too); key i is confirmed, touched and copied. Cache misses stay in flight all
    # the time: in groups of 128 keys, one phase after another, each group waited out two round
    # trips (finds of resident keys took 1.2-1.4x as long), and probe-then-index_select waits for
    # every probe, then gathers rows the caches no longer hold. The stages are written out: as
    # inlined helpers they compiled 2.7x slower, and as one loop over the three offsets (no
    # prologue) 15% slower.
    size = np.uint64(tab.shape[0])
    n, dim = keys.shape[0], orows.shape[1]
    inc32 = np.float32(inc)
    hashes = np.empty(_RING, np.uint64)
    pos = np.empty(_RING, np.uint64)
    hits = 0
    for j in range(min(ahead, n)):  # the loop's first step hashes key ``ahead``
        h = _hash(keys[j])
        hashes[j % _RING] = h
        p = _home(h, size)
        pos[j % _RING] = p
        _prefetch(tab, (p,))
    for i in range(-ahead, n):
        j = i + 2 * ahead
        if j < n:
            h = _hash(keys[j])
            hashes[j % _RING] = h
            p = _home(h, size)
            pos[j % _RING] = p
            _prefetch(tab, (p,))
        j = i + ahead
        if j < n:
            p, s = _candidate(tab, pos[j % _RING], _want(hashes[j % _RING], b), b, size)
            pos[j % _RING] = p
            out[j] = s
            if s >= 0:
                _prefetch(skeys, (s,))
                if touch:
                    _prefetch(freq, (s,))
                if gather:
                    for c in range(0, dim, 16):  # 16 float32 = one 64-byte line
                        _prefetch(rows, (s, c))
                    _prefetch(rows, (s, dim - 1))  # a row that straddles one more line
                    _prefetch(last, (s,))
        if i < 0:
            continue
        s = out[i]
        if s >= 0 and skeys[s] != keys[i]:
            s = _confirm(tab, skeys, keys[i], pos[i % _RING], s, _want(hashes[i % _RING], b), b, size)[1]
            out[i] = s
        if s >= 0:
            hits += 1
            if touch:
                if not once or last[s] != now:
                    freq[s] += inc32
                last[s] = now
            if gather:
                for c in range(dim):
                    orows[i, c] = rows[s, c]
    return hits


def _find_py(tab: Any, skeys: Any, b: int, keys: Any, out: Any) -> None:
    none = np.empty((0, 0), np.float32)
    _probe(tab, skeys, b, keys, out, np.empty(0, np.float32), np.empty(0, np.int64), 0.0, 0, False, False, False,
           none, none, _FIND_AHEAD)


def _find_touch_py(tab: Any, skeys: Any, b: int, keys: Any, out: Any, freq: Any, last: Any, inc: float,
                   now: int, once: bool) -> int:
    # _find_py, and each hit counts one access of its row: one pass instead of find, a hit count
    # and a touch.
    none = np.empty((0, 0), np.float32)
    return _probe(tab, skeys, b, keys, out, freq, last, inc, now, once, True, False, none, none, _FIND_AHEAD)


def _find_gather_py(tab: Any, skeys: Any, b: int, keys: Any, slots: Any, freq: Any, last: Any, inc: float,
                    now: int, once: bool, rows: Any, out: Any) -> int:
    # _find_touch_py, and each hit's row of ``rows`` copied into ``out[i]``; keys closer together
    # in the pipeline, as each one in flight holds its row's lines too.
    return _probe(tab, skeys, b, keys, slots, freq, last, inc, now, once, True, True, rows, out, _AHEAD)


def _touch_py(slots: Any, freq: Any, last: Any, inc: float, now: int, once: bool) -> int:
    # The touch of _find_touch_py for slots found by a (parallel) find; returns the hits.
    inc32 = np.float32(inc)
    hits = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if s >= 0:
            if not once or last[s] != now:
                freq[s] += inc32
            last[s] = now
            hits += 1
    return hits


def _insert_py(tab: Any, skeys: Any, b: int, keys: Any, slots: Any) -> None:
    # Sequential: keys of one batch may share clusters. The table has more entries than keys, so
    # the probe always reaches a free entry. Each key is written to its slot of skeys too.
    size = np.uint64(tab.shape[0])
    n = keys.shape[0]
    hashes = np.empty(_GROUP, np.uint64)
    for lo in range(0, n, _GROUP):
        hi = min(lo + _GROUP, n)
        for i in range(lo, hi):
            h = _hash(keys[i])
            hashes[i - lo] = h
            _prefetch(tab, (_home(h, size),))
        for i in range(lo, hi):
            h = hashes[i - lo]
            j = _home(h, size)
            while tab[j] != _EMPTY:
                j = _next(j, size)
            s = slots[i]
            tab[j] = _want(h, b) | s  # stored as int32: the bits wrap
            skeys[s] = keys[i]


def _erase_py(tab: Any, skeys: Any, b: int, keys: Any) -> int:
    size = np.uint64(tab.shape[0])
    slot_mask = np.int64((1 << b) - 1)
    removed = 0
    for i in range(keys.shape[0]):
        j, s = _lookup(tab, skeys, keys[i], b, size)
        if s < 0:
            continue  # absent
        removed += 1
        # Backward-shift deletion: walk the rest of the cluster and move back every entry whose
        # home is not cyclically inside (hole, j], so each key stays reachable from its home and
        # no tombstones accumulate. An entry's home comes from the key at its slot (entries hold
        # no keys). Distances are cyclic: the cluster may wrap around the end of the table, whose
        # size need not be a power of two.
        hole = j
        while True:
            j = _next(j, size)
            e = np.int64(tab[j])
            if e == _EMPTY:
                break
            h = _home(_hash(skeys[e & slot_mask]), size)
            from_home = j - h if j >= h else j + size - h
            from_hole = j - hole if j >= hole else j + size - hole
            if from_home >= from_hole:
                tab[hole] = tab[j]
                hole = j
        tab[hole] = _EMPTY
    return removed


_hash: Any = _hash_py
_home: Any = _home_py
_want: Any = _want_py
_next: Any = _next_py
_prefetch: Any = _prefetch_py
_candidate: Any = _candidate_py
_confirm: Any = _confirm_py
_lookup: Any = _lookup_py
_probe: Any = _probe_py
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
    if _KERNELS:
        return _KERNELS
    import numba

    inline = numba.njit(cache=True, nogil=True, inline="always")
    # The table, the slots' keys, the slot bits. The keys, frequencies and ticks are any-layout
    # arrays: a tier's are strided views of its rows' records (embcache/tier.py).
    tab = "int32[::1], int64[:], int64"

    def build(prefetch: Any) -> dict[str, Any]:
        global _hash, _home, _want, _next, _prefetch, _candidate, _confirm, _lookup, _probe
        _hash, _home, _want, _next = inline(_hash_py), inline(_home_py), inline(_want_py), inline(_next_py)
        _prefetch = prefetch
        _candidate = inline(_candidate_py)  # after the helpers it calls
        _confirm = inline(_confirm_py)
        _lookup = inline(_lookup_py)
        # a call (compiled once, for any layout of freq and last), not inlined twice
        _probe = numba.njit(nogil=True, cache=True)(_probe_py)
        kernels: dict[str, Any] = {
            "find": numba.njit(f"void({tab}, int64[::1], int64[::1])", cache=True, nogil=True)(_find_py),
            "insert": numba.njit(f"void({tab}, int64[::1], int64[::1])", cache=True, nogil=True)(_insert_py),
            "erase": numba.njit(f"int64({tab}, int64[::1])", cache=True, nogil=True)(_erase_py),
            "find_touch": numba.njit(f"int64({tab}, int64[::1], int64[::1], float32[:], int64[:], float64, "
                                     "int64, boolean)", cache=True, nogil=True)(_find_touch_py),
            "touch": numba.njit("int64(int64[::1], float32[:], int64[:], float64, int64, boolean)",
                                cache=True, nogil=True)(_touch_py),
            "find_gather": numba.njit(f"int64({tab}, int64[::1], int64[::1], float32[:], int64[:], float64, "
                                      "int64, boolean, float32[:, ::1], float32[:, ::1])",
                                      cache=True, nogil=True)(_find_gather_py),
        }
        # Compile-or-load now, so that a failure surfaces here rather than mid-training.
        table = np.full(17, _EMPTY, np.int32)
        skeys = np.zeros(3, np.int64)
        keys = np.arange(3, dtype=np.int64)
        kernels["insert"](table, skeys, 2, keys, keys)
        kernels["find"](table, skeys, 2, keys, np.empty(3, np.int64))
        rows = np.zeros((3, 2), np.float32)
        kernels["find_gather"](table, skeys, 2, keys, np.empty(3, np.int64), np.zeros(3, np.float32),
                                np.zeros(3, np.int64), 1.0, 0, False, rows, np.empty((3, 2), np.float32))
        kernels["erase"](table, skeys, 2, keys)
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


def _shared_find(kernel: Callable[[Any, Any], None], keys: Any, out: Any) -> None:
    """Run ``kernel(keys, out)`` in chunks on the calling thread and any idle helpers."""
    n = keys.shape[0]
    pool = _Helpers.get() if n >= 2 * _CHUNK else None
    if pool is None:
        kernel(keys, out)
        return
    n_chunks = -(-n // _CHUNK)
    chunks = itertools.count()  # next() is atomic under the GIL: each chunk is taken once

    def work() -> None:
        while (c := next(chunks)) < n_chunks:
            lo, hi = c * _CHUNK, min((c + 1) * _CHUNK, n)
            kernel(keys[lo:hi], out[lo:hi])

    helpers = [pool.submit(work) for _ in range(min(_Helpers.n, n_chunks - 1))]
    work()
    for f in helpers:
        if not f.cancel():  # started: it holds at most one chunk; wait for it
            f.result()


class NumbaIndex(KeyIndex):
    """Linear-probing hash table with numba kernels (CPU only).

    Args:
        capacity: the most keys it must hold at once (1 to 2**31 - 1: slots are stored in 31 bits).
        device: must be a CPU device.
        load: keys per entry at capacity, in (0, 1) (the table has ``ceil(capacity / load)``
            entries of 4 bytes); the default :data:`LOAD` is what the tiers count.
        slot_keys: int64 [capacity] CPU tensor, the key of each slot: a tier's own key array,
            which the index reads to confirm a probe and writes on insert. ``None``: the index
            makes its own (a standalone index).

    Unlike :class:`~embcache.index.TorchIndex`, a slot holds one key at a time: inserted slots
    must be distinct and in ``[0, capacity)``, and a slot's key must not change while the key is
    in the index (a tier erases a key before it reuses the slot).
    """

    ROW_BYTES = ROW_BYTES  # 4-byte entries of slot and tag at LOAD (the key is the tier's)

    def __init__(self, capacity: int, device: torch.device | str = "cpu", load: float = LOAD,
                 slot_keys: torch.Tensor | None = None) -> None:
        super().__init__(capacity, device)
        if self.device.type != "cpu":
            raise ValueError(f"NumbaIndex runs on the CPU only, got device {self.device}")
        if not 0 < load < 1:
            raise ValueError(f"load must be in (0, 1), got {load}")
        # At least one more entry than keys, so that a probe always ends at an empty entry.
        size = max(self.capacity + 1, math.ceil(self.capacity / load))
        if self.capacity >= 1 << 31 or size >= _MAX_ENTRIES:
            raise ValueError(f"NumbaIndex holds fewer than 2**31 keys in fewer than 2**32 entries, got capacity "
                             f"{self.capacity} at load {load}")
        if slot_keys is None:
            slot_keys = host_zeros((self.capacity,), torch.int64)
        if (slot_keys.dtype != torch.int64 or slot_keys.device.type != "cpu" or slot_keys.dim() != 1
                or slot_keys.numel() < self.capacity):
            raise ValueError("slot_keys must be a 1-D int64 CPU tensor of at least capacity elements")
        self._k = _numba_kernels()
        # Slot bits: the largest slot (capacity - 1) fits, and all ones (an empty entry) is no slot.
        self._bits = self.capacity.bit_length()
        self.slot_keys = slot_keys
        self._skeys = slot_keys.numpy()
        # One int32 per entry: tag and slot, -1 where empty. The kernels see it through .numpy().
        self._tab = huge_page_zeros(size * 4).view(np.int32)
        self._tab.fill(_EMPTY)
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
    def nbytes(self) -> int:
        """Bytes of the table (4 per entry; the slots' keys are the tier's)."""
        return int(self._tab.nbytes)

    @property
    def table_size(self) -> int:
        """Entries in the open-addressing table (``ceil(capacity / load)``, at least ``capacity + 1``)."""
        return int(self._tab.shape[0])

    @staticmethod
    def _np(t: torch.Tensor) -> Any:
        # A contiguous int64 numpy view (no copy when the tensor already is one; then in one call,
        # not four: each torch call costs microseconds).
        if t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous():
            return t.numpy()
        return t.reshape(-1).to(torch.int64).contiguous().numpy()

    def _find_into(self, keys: Any, out: Any) -> None:
        self._k["find"](self._tab, self._skeys, self._bits, keys, out)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots of ``keys``.

        Args:
            keys: int64 [n] CPU tensor; duplicates allowed.

        Returns:
            int64 [n] slots, -1 where a key is absent.
        """
        k = self._np(keys)
        out = torch.empty(k.shape[0], dtype=torch.int64)
        _shared_find(self._find_into, k, out.numpy())
        return out

    def find_touch(self, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float,
                   now: int, once: bool = False) -> tuple[torch.Tensor, int]:
        """:meth:`KeyIndex.find_touch` in one compiled pass (CPU tensors; ``freq`` float32 and
        ``last`` int64, of any stride: a tier's are views of its rows' records).

        Batches large enough for :meth:`find`'s helper threads are found in parallel and touched
        after, on this thread (concurrent ``freq[s] += inc`` of a repeated slot would lose counts).
        """
        if freq.dtype != torch.float32 or last.dtype != torch.int64:
            return super().find_touch(keys, freq, last, inc, now, once)
        k = self._np(keys)
        o = np.empty(k.shape[0], dtype=np.int64)
        out = torch.from_numpy(o)
        f, la = self._arrays(freq, last)
        if k.shape[0] >= 2 * _CHUNK and _Helpers.get() is not None:
            _shared_find(self._find_into, k, o)
            return out, int(self._k["touch"](o, f, la, float(inc), int(now), bool(once)))
        return out, int(self._k["find_touch"](self._tab, self._skeys, self._bits, k, o, f, la, float(inc), int(now),
                                              bool(once)))

    def find_touch_gather(self, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, inc: float, now: int,
                          rows: torch.Tensor, out: torch.Tensor, once: bool = False) -> tuple[torch.Tensor, int]:
        """:meth:`KeyIndex.find_touch_gather`, in one compiled pass that probes, counts and copies
        when torch runs on one thread (and ``rows``, ``out`` are contiguous float32).

        On one thread the pass beats probe-then-``index_select``: measured through
        ``EmbeddingCache.lookup`` on 453K rows, Zipf keys, batches of 8,192 and 65,536, in two
        A/B runs: 1.09-1.19x at dim 64 and 1.13-1.26x at dim 128. With more threads ``index_select``
        spreads the copy over all of them and wins (2 threads on this 2-core VM: 0.92x for the
        pass, run alone or split over the helper threads), so there the base class's
        probe-then-gather runs. One torch thread per process is common in training: ``torchrun``
        sets ``OMP_NUM_THREADS=1`` for several ranks per machine.
        """
        fits = (freq.dtype == torch.float32 and last.dtype == torch.int64 and rows.dtype == out.dtype == torch.float32
                and rows.is_contiguous() and out.is_contiguous() and rows.dim() == out.dim() == 2)
        if torch.get_num_threads() > 1 or not fits:
            return super().find_touch_gather(keys, freq, last, inc, now, rows, out, once)
        k = self._np(keys)
        slots = np.empty(k.shape[0], dtype=np.int64)
        f, la, r = self._arrays(freq, last, rows)
        hits = self._k["find_gather"](self._tab, self._skeys, self._bits, k, slots, f, la, float(inc), int(now),
                                      bool(once), r, out.numpy())
        return torch.from_numpy(slots), int(hits)

    def insert(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Map ``keys[i]`` to ``slots[i]``.

        Args:
            keys: int64 [n] CPU tensor, unique and currently absent (not checked).
            slots: int64 [n] CPU tensor, distinct, free and in ``[0, capacity)`` (the range is
                checked, distinctness not).

        Raises:
            RuntimeError: if ``len(self) + n > capacity`` (nothing is changed).
            ValueError: a slot out of range, or as many keys as slots not given (nothing is changed).
        """
        k, s = self._np(keys), self._np(slots)
        if k.shape[0] != s.shape[0]:
            raise ValueError(f"{k.shape[0]} keys but {s.shape[0]} slots")
        self._check_room(k.shape[0])
        if k.shape[0] and (int(s.min()) < 0 or int(s.max()) >= self.capacity):
            raise ValueError(f"slots must be in [0, {self.capacity}), got [{int(s.min())}, {int(s.max())}]")
        self._k["insert"](self._tab, self._skeys, self._bits, k, s)
        self._len += int(k.shape[0])

    def erase(self, keys: torch.Tensor) -> None:
        """Remove ``keys``.

        Args:
            keys: int64 [n] CPU tensor, unique and present (absent ones are ignored).
        """
        self._len -= int(self._k["erase"](self._tab, self._skeys, self._bits, self._np(keys)))

    def clear(self) -> None:
        """Remove every key."""
        self._tab.fill(_EMPTY)
        self._len = 0
