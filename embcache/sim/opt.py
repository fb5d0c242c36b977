"""OPT: Belady's MIN with bypass, the offline optimum and so an upper bound for every other policy.

A backward pass gives each access the time of its key's next access; the replay keeps the cached
keys in a max-heap of next-use times (invalidated lazily) and, on a miss with the cache full,
leaves out whichever of the cached keys and the missed key is needed last.
"""

from __future__ import annotations

import numba
import numpy as np

from .trace import _check_capacity, _dense, _ratio


@numba.njit(cache=True)
def _next_use(ids: np.ndarray, n_ids: int) -> np.ndarray:
    # nxt_use[t] = time of the next access to ids[t]; for a last access, n + t (unique and larger
    # than every real time, so "never again" sorts last and still identifies its key).
    n = ids.size
    nxt_use = np.empty(n, dtype=np.int64)
    last = np.full(n_ids, -1, dtype=np.int64)
    for t in range(n - 1, -1, -1):
        k = ids[t]
        nxt_use[t] = last[k] if last[k] >= 0 else n + t
        last[k] = t
    return nxt_use


@numba.njit(cache=True)
def _heap_push(heap: np.ndarray, size: int, v: int) -> int:
    i = size
    heap[i] = v
    while i > 0:
        parent = (i - 1) >> 1
        if heap[parent] >= v:
            break
        heap[i] = heap[parent]
        i = parent
    heap[i] = v
    return size + 1


@numba.njit(cache=True)
def _heap_pop(heap: np.ndarray, size: int) -> int:
    size -= 1
    v = heap[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and heap[child + 1] > heap[child]:
            child += 1
        if heap[child] <= v:
            break
        heap[i] = heap[child]
        i = child
    if size > 0:
        heap[i] = v
    return size


@numba.njit(cache=True)
def _opt_kernel(ids: np.ndarray, n_ids: int, capacity: int) -> int:
    n = ids.size
    nxt_use = _next_use(ids, n_ids)
    # Max-heap of next-use times, lazily invalidated: an entry v is live iff its key is cached
    # and due[key] == v. The key of v is ids[v] (v < n) or ids[v - n] (never used again).
    heap = np.empty(n + 1, dtype=np.int64)
    hsize = 0
    due = np.full(n_ids, -1, dtype=np.int64)  # -1 = not cached
    size = 0
    hits = 0
    for t in range(n):
        k = ids[t]
        v = nxt_use[t]
        if due[k] >= 0:
            hits += 1
            due[k] = v
            hsize = _heap_push(heap, hsize, v)
            continue
        if capacity == 0:
            continue
        if size == capacity:
            while True:  # drop stale entries until the top is live
                top = heap[0]
                owner = ids[top] if top < n else ids[top - n]
                if due[owner] == top:
                    break
                hsize = _heap_pop(heap, hsize)
            if v > top:
                continue  # the missed key is needed last of all: bypass it
            hsize = _heap_pop(heap, hsize)
            due[owner] = -1
            size -= 1
        due[k] = v
        hsize = _heap_push(heap, hsize, v)
        size += 1
    return hits


def opt_hits(trace: np.ndarray, capacity: int) -> int:
    """Hits of Belady's optimal offline policy (MIN) with bypass over ``trace``.

    On a miss with the cache full, among the cached keys and the missed key, the one whose next
    access is farthest in the future (or never) is left out: evicted, or never inserted. This
    maximizes hits over every policy that may decline to cache a key, so it bounds LRU, LFU,
    W-TinyLFU and embcache's policies from above.

    Args:
        trace: 1-D integer array of keys, one per access.
        capacity: cache size in keys (>= 0).

    Returns:
        The number of accesses that found their key cached.

    Raises:
        ValueError: if ``trace`` is not a 1-D integer array or ``capacity`` is negative.
    """
    cap = _check_capacity(capacity)
    ids, uniq = _dense(trace)
    n_ids = int(uniq.size)
    return int(_opt_kernel(ids, n_ids, cap))


def opt_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`opt_hits`."""
    return _ratio(opt_hits(trace, capacity), trace)
