"""NumbaIndex: open addressing with linear probing in numba kernels (CPU only, the hot path).

The table has ``ceil(capacity / LOAD)`` entries (:data:`LOAD` = 0.5: ~1.5 probes per hit, ~2.5
per miss), stored as one ``int32 [T, 3]`` array of ``(key's low half, key's high half, slot)``
triples: 12 bytes an entry, 24 per row (a power of two of 16-byte entries took 32 to 64). A key's
home entry is its hash's high 32 bits times ``T``, shifted down by 32 (multiply-shift range
reduction), so ``T`` need not be a power of two; probes wrap around the end. A probe reads one
cache line, or two where the entry straddles them (2 entries in 16); the kernels prefetch both.
Deletion shifts the rest of the cluster back (no tombstones, so probe lengths do not degrade
under churn), and at most ``capacity`` of the > ``capacity`` entries are used, so inserts
cannot fail. The kernels are numba ``@njit(cache=True, nogil=True)`` functions on
numpy views of the torch tensors (no copies), compiled on first use so that numba stays optional.
The table is far larger than the caches, so a probe is a cache miss: the kernels hash a group of
keys and prefetch their lines before probing any of them, which keeps many misses in flight (2-3x
the rate of probing key by key), and the table sits on transparent huge pages
(``embcache/hostmem.py``) so that probes do not miss the TLB too. Large ``find`` batches are
shared, in chunks, between the calling thread and helper threads (see :class:`_Helpers` for why
not ``prange``). The lookup's hot path, ``find_touch_gather``, goes one step further on one torch
thread: a rolling pipeline hashes one key, probes an earlier one and prefetches its row and
counters, and counts and copies a still earlier one, all in one pass.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .._bits import M1, M2
from ..hostmem import huge_page_zeros
from .base import KeyIndex

# NumbaIndex.find splits batches of at least two chunks of this many keys over helper threads.
_CHUNK = 16384

# The NumbaIndex kernels are plain functions here, compiled on first use by _numba_kernels() so
# that numba stays optional and is imported only when a NumbaIndex is built. They are module-level
# (not closures) because numba keys its on-disk cache on closure contents, and a closure over
# another jitted function would miss the cache in every new process. The names they call
# (_home, _lookup, _prefetch, _hash_group) are globals that _numba_kernels() rebinds to their
# numba versions before compiling the entry points.
_M1_U64 = np.uint64(M1)
_M2_U64 = np.uint64(M2)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_ONE, _ZERO = np.uint64(1), np.uint64(0)
_LOW32 = np.int64(0xFFFFFFFF)
# The most entries a table may have: the home's range reduction multiplies a 32-bit hash by it.
_MAX_ENTRIES = 1 << 32
# Keys per table entry at capacity: 2 entries of 12 bytes, 24 bytes of index per row. At 0.6
# (20 bytes) finds of resident keys ran 10-15% slower (bench/bench_index.py, see the commit).
LOAD = 0.5
# Keys hashed and prefetched ahead of probing. A probe is a random access into a table much
# larger than the caches; issuing the loads of a whole group first keeps many cache misses in
# flight instead of one per mispredicted probe loop (2-3x the find rate). 128 lines = 8 KiB,
# well inside L1.
_GROUP = 128
# The gather kernel's pipeline distance in keys (see _find_gather_py); each key in flight adds its
# row's 4-8 lines and two counter lines. _RING (> 2 * _AHEAD) holds the hashed homes in flight.
_AHEAD = 16
_RING = 64


def _home_py(k: int, size: Any) -> Any:
    # mix64 in uint64 (mixing int64 with uint64 in numba would promote to float64; identical bits
    # to embcache._bits.mix64()), then the table index by multiply-shift range reduction
    # ("fastrange"): the high 32 bits of the hash times size (< 2**32), shifted down by 32, fall
    # evenly in [0, size) for any size, so the table need not be a power of two.
    x = np.uint64(k)
    x = (x ^ (x >> _S30)) * _M1_U64
    x = (x ^ (x >> _S27)) * _M2_U64
    x = x ^ (x >> _S31)
    return ((x >> _S32) * size) >> _S32


def _key_py(tab: Any, j: Any) -> Any:
    # The key of entry j, from its two 32-bit halves.
    return (np.int64(tab[j, 1]) << 32) | (np.int64(tab[j, 0]) & _LOW32)


def _next_py(j: Any, size: Any) -> Any:
    # The entry after j, wrapping around the end of the table.
    j += _ONE
    return _ZERO if j == size else j


def _prefetch_py(ary: Any, idx: Any) -> None:
    # Fallback when the LLVM prefetch intrinsic cannot be built: prefetching is only a hint.
    pass


def _lookup_py(tab: Any, k: int, j: Any, size: Any) -> Any:
    while True:
        s = np.int64(tab[j, 2])
        if s < 0 or _key(tab, j) == k:
            # A hit returns its slot; an empty entry (slot -1) ends the cluster: a miss.
            return s
        j = _next(j, size)


def _hash_group_py(tab: Any, keys: Any, lo: int, hi: int, homes: Any, size: Any) -> None:
    # The home entries of keys[lo:hi] into homes[:hi - lo], each entry's line prefetched, so that
    # the group's probes that follow find their lines in flight or cached.
    for i in range(lo, hi):
        h = _home(keys[i], size)
        homes[i - lo] = h
        _prefetch(tab, (h, 0))
        _prefetch(tab, (h, 2))  # the entry's other line, where it straddles two (2 in 16 do)


def _find_py(tab: Any, keys: Any, out: Any) -> None:
    size = np.uint64(tab.shape[0])
    n = keys.shape[0]
    homes = np.empty(_GROUP, np.uint64)
    for lo in range(0, n, _GROUP):
        hi = min(lo + _GROUP, n)
        _hash_group(tab, keys, lo, hi, homes, size)
        for i in range(lo, hi):
            out[i] = _lookup(tab, keys[i], homes[i - lo], size)


def _find_touch_py(tab: Any, keys: Any, out: Any, freq: Any, last: Any, inc: float, now: int) -> int:
    # _find_py, and each hit counts one access of its row (freq += inc, last = now) as it is
    # found: one pass instead of find, a hit count and a touch (the all-hit lookup's hot path).
    size = np.uint64(tab.shape[0])
    n = keys.shape[0]
    homes = np.empty(_GROUP, np.uint64)
    hits = 0
    for lo in range(0, n, _GROUP):
        hi = min(lo + _GROUP, n)
        _hash_group(tab, keys, lo, hi, homes, size)
        for i in range(lo, hi):
            s = _lookup(tab, keys[i], homes[i - lo], size)
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
    size = np.uint64(tab.shape[0])
    n, dim = keys.shape[0], rows.shape[1]
    homes = np.empty(_RING, np.uint64)
    hits = 0
    for j in range(min(_AHEAD, n)):  # the loop's first step hashes key _AHEAD
        h = _home(keys[j], size)
        homes[j % _RING] = h
        _prefetch(tab, (h, 0))
        _prefetch(tab, (h, 2))
    for i in range(-_AHEAD, n):
        j = i + 2 * _AHEAD
        if j < n:
            h = _home(keys[j], size)
            homes[j % _RING] = h
            _prefetch(tab, (h, 0))
            _prefetch(tab, (h, 2))
        j = i + _AHEAD
        if j < n:
            s = _lookup(tab, keys[j], homes[j % _RING], size)
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
    # Sequential: keys of one batch may share clusters. The table has more entries than keys, so
    # the probe always reaches a free entry.
    size = np.uint64(tab.shape[0])
    n = keys.shape[0]
    homes = np.empty(_GROUP, np.uint64)
    for lo in range(0, n, _GROUP):
        hi = min(lo + _GROUP, n)
        _hash_group(tab, keys, lo, hi, homes, size)
        for i in range(lo, hi):
            j = homes[i - lo]
            while tab[j, 2] >= 0:
                j = _next(j, size)
            k = keys[i]
            tab[j, 0] = k & _LOW32  # stored as int32: the low half's bits
            tab[j, 1] = k >> 32
            tab[j, 2] = slots[i]


def _erase_py(tab: Any, keys: Any) -> int:
    size = np.uint64(tab.shape[0])
    n = keys.shape[0]
    homes = np.empty(_GROUP, np.uint64)
    removed = 0
    for lo in range(0, n, _GROUP):
        hi = min(lo + _GROUP, n)
        _hash_group(tab, keys, lo, hi, homes, size)
        for i in range(lo, hi):
            k = keys[i]
            j = homes[i - lo]
            while tab[j, 2] >= 0 and _key(tab, j) != k:
                j = _next(j, size)
            if tab[j, 2] < 0:
                continue  # absent
            removed += 1
            # Backward-shift deletion: walk the rest of the cluster and move back every entry
            # whose home is not cyclically inside (hole, j], so each key stays reachable from
            # its home and no tombstones accumulate. Distances are cyclic: the cluster may wrap
            # around the end of the table, whose size need not be a power of two.
            hole = j
            while True:
                j = _next(j, size)
                if tab[j, 2] < 0:
                    break
                h = _home(_key(tab, j), size)
                from_home = j - h if j >= h else j + size - h
                from_hole = j - hole if j >= hole else j + size - hole
                if from_home >= from_hole:
                    tab[hole, 0] = tab[j, 0]
                    tab[hole, 1] = tab[j, 1]
                    tab[hole, 2] = tab[j, 2]
                    hole = j
            tab[hole, 2] = -1
    return removed


_home: Any = _home_py
_key: Any = _key_py
_next: Any = _next_py
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
    global _home, _key, _next, _prefetch, _lookup, _hash_group
    if _KERNELS:
        return _KERNELS
    import numba

    inline = numba.njit(cache=True, nogil=True, inline="always")
    tab_keys_out = "void(int32[:, ::1], int64[::1], int64[::1])"

    def build(prefetch: Any) -> dict[str, Any]:
        global _home, _key, _next, _prefetch, _lookup, _hash_group
        _home, _key, _next, _prefetch = inline(_home_py), inline(_key_py), inline(_next_py), prefetch
        _lookup = inline(_lookup_py)  # after _key and _next: it calls them
        _hash_group = inline(_hash_group_py)  # after _home and _prefetch: it calls them
        kernels: dict[str, Any] = {
            "find": numba.njit(tab_keys_out, cache=True, nogil=True)(_find_py),
            "insert": numba.njit(tab_keys_out, cache=True, nogil=True)(_insert_py),
            "erase": numba.njit("int64(int32[:, ::1], int64[::1])", cache=True, nogil=True)(_erase_py),
            "find_touch": numba.njit("int64(int32[:, ::1], int64[::1], int64[::1], float64[::1], int64[::1], "
                                     "float64, int64)", cache=True, nogil=True)(_find_touch_py),
            "touch": numba.njit("int64(int64[::1], float64[::1], int64[::1], float64, int64)",
                                cache=True, nogil=True)(_touch_py),
            "find_gather": numba.njit("int64(int32[:, ::1], int64[::1], int64[::1], float64[::1], int64[::1], "
                                      "float64, int64, float32[:, ::1], float32[:, ::1])",
                                      cache=True, nogil=True)(_find_gather_py),
        }
        # Compile-or-load now, so that a failure surfaces here rather than mid-training.
        tab = np.full((17, 3), -1, np.int32)
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
        capacity: the most keys it must hold at once (1 to 2**31 - 1: slots are stored as int32).
        device: must be a CPU device.
        load: keys per entry at capacity, in (0, 1) (the table has ``ceil(capacity / load)``
            entries of 12 bytes); the default :data:`LOAD` is what the tiers count.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu", load: float = LOAD) -> None:
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
        self._k = _numba_kernels()
        # (low half of the key, high half, slot) as int32 triples; slot -1 marks an empty entry.
        # The kernels see it through .numpy().
        self._tab = huge_page_zeros(size * 12).view(np.int32).reshape(size, 3)
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
    def nbytes(self) -> int:
        """Bytes of the table (12 per entry)."""
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
            slots: int64 [n] CPU tensor, each in ``[0, 2**31)`` (stored as int32; not checked).

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
        self._table[:, 2].fill_(-1)
        self._len = 0
