"""ARC (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003) as an
exact sequential simulator: the classic adaptive balance of recency and frequency, a reference
for :class:`~embcache.sim.LrfuSim`'s own adaptation.

ARC keeps two LRU lists of cached keys, ``T1`` (seen once recently) and ``T2`` (seen at least
twice), and two ghost lists of keys recently evicted from them, ``B1`` and ``B2`` (keys only, no
rows). A hit in ``B1`` says recency was undervalued and grows the target size ``p`` of ``T1``; a
hit in ``B2`` shrinks it. Every miss is admitted (ARC has no admission filter).
"""

from __future__ import annotations

import numba
import numpy as np

from .list_policies import _check_batch, _init_list, _push_mru, _unlink
from .trace import _check_capacity, _dense, _ratio

__all__ = ["arc_hit_ratio", "arc_hits"]

_NONE, _T1, _T2, _B1, _B2 = 0, 1, 2, 3, 4


@numba.njit(cache=True)
def _arc_kernel(ids: np.ndarray, n_ids: int, c: int, batch: int) -> int:
    # Nodes n_ids + 1 .. n_ids + 4 head the lists T1, T2, B1, B2; nxt[head] is the LRU end.
    prv = np.empty(n_ids + 5, dtype=np.int64)
    nxt = np.empty(n_ids + 5, dtype=np.int64)
    for lst in range(1, 5):
        _init_list(prv, nxt, n_ids + lst)
    where = np.zeros(n_ids, dtype=np.int8)
    entered = np.zeros(n_ids, dtype=np.int64)  # access index at which each key last entered T1 or T2
    size = np.zeros(5, dtype=np.int64)
    p = 0.0
    hits = 0
    if c <= 0:
        return 0

    for i in range(ids.shape[0]):
        k = ids[i]
        w = where[k]
        if w == _T1 or w == _T2:
            if entered[k] < i - i % batch:  # cached when its batch began (batch 1: any earlier access)
                hits += 1
            _unlink(prv, nxt, k)
            size[w] -= 1
            _push_mru(prv, nxt, n_ids + _T2, k)
            where[k] = _T2
            size[_T2] += 1
            continue
        if w == _B1:
            p = min(float(c), p + max(size[_B2] / size[_B1], 1.0))
        elif w == _B2:
            p = max(0.0, p - max(size[_B1] / size[_B2], 1.0))
        elif size[_T1] + size[_B1] == c:  # a new key, L1 full
            if size[_T1] < c:
                v = nxt[n_ids + _B1]
                _unlink(prv, nxt, v)
                where[v] = _NONE
                size[_B1] -= 1
            else:  # B1 is empty: evict T1's LRU key outright
                v = nxt[n_ids + _T1]
                _unlink(prv, nxt, v)
                where[v] = _NONE
                size[_T1] -= 1
        elif size[_T1] + size[_T2] + size[_B1] + size[_B2] >= c:
            if size[_T1] + size[_T2] + size[_B1] + size[_B2] == 2 * c:
                v = nxt[n_ids + _B2]
                _unlink(prv, nxt, v)
                where[v] = _NONE
                size[_B2] -= 1
        # REPLACE when the cache is full: move T1's or T2's LRU key to its ghost list
        if size[_T1] + size[_T2] >= c:
            if size[_T1] >= 1 and ((w == _B2 and size[_T1] == p) or size[_T1] > p):
                src, dst = _T1, _B1
            else:
                src, dst = _T2, _B2
            v = nxt[n_ids + src]
            _unlink(prv, nxt, v)
            size[src] -= 1
            _push_mru(prv, nxt, n_ids + dst, v)
            where[v] = dst
            size[dst] += 1
        if w == _B1 or w == _B2:
            _unlink(prv, nxt, k)
            size[w] -= 1
            target = _T2
        else:
            target = _T1
        _push_mru(prv, nxt, n_ids + target, k)
        where[k] = target
        entered[k] = i
        size[target] += 1
    return hits


def arc_hits(trace: np.ndarray, capacity: int, batch: int = 1) -> int:
    """Hits of an ARC cache of ``capacity`` keys over ``trace`` (1-D integer array, one key per access).

    ``batch``: count a hit only if the key was cached when its batch of ``batch`` accesses began
    (see :func:`~embcache.sim.wtinylfu_hits`); 1 = every access is its own batch.

    Raises:
        ValueError: if ``trace`` is not a 1-D integer array or ``capacity`` is negative.
    """
    cap = _check_capacity(capacity)
    ids, uniq = _dense(trace)
    return int(_arc_kernel(ids, int(uniq.size), cap, _check_batch(batch)))


def arc_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`arc_hits`."""
    return _ratio(arc_hits(trace, capacity), trace)
