"""Exact sequential cache simulators: the reference policies embcache is measured against (and sized with).

Each simulator replays a key trace (1-D integer array, one entry per access) through a cache
that holds at most ``capacity`` keys and counts hits. The reference policies are exact (no
sampling, no approximation beyond what the policy itself prescribes) and numba-compiled: a
2M-access trace takes well under a second each once compiled (compiled code is cached on disk).
:class:`LrfuSim`, embcache's own policy, picks its victims among sampled residents as the cache
does (``sample=None`` makes it exact).

Policies (``REFERENCE_POLICIES`` maps a display name to a ``(trace, capacity) -> hit ratio``
function):

- ``LRU``: evict the least recently used key.
- ``LFU``: evict the key with the smallest in-cache access count (counted since it was last
  inserted), ties broken by LRU; every miss is inserted (no admission filter).
- ``W-TinyLFU``: Caffeine's design (window LRU + TinyLFU admission + segmented-LRU main), with
  the static 1% window of the TinyLFU paper and Caffeine's simulator.
- ``W-TinyLFU-adaptive``: the same plus Caffeine's hill climber, which resizes the window at
  run time (what Caffeine's cache itself does).
- ``ARC``: Megiddo and Modha's adaptive replacement cache (recency and frequency lists whose
  balance moves with hits in their ghost lists).
- ``OPT``: Belady's MIN with bypass, the offline optimum and so an upper bound for all others.

All policies are demand-fetch: only the accessed key can enter the cache, on a miss. Keys are
arbitrary int64 values; they are remapped to dense ids before simulation.

Modules: :mod:`~embcache.sim.list_policies` (LRU, LFU, W-TinyLFU), :mod:`~embcache.sim.arc` (ARC),
:mod:`~embcache.sim.opt` (OPT), :mod:`~embcache.sim.lrfu` (:class:`LrfuSim`),
:mod:`~embcache.sim.tuner` (:class:`AdaptiveLrfuSim`, the policy tuned online as the cache tunes it)
and :mod:`~embcache.sim.trace` (the input checks they
share); this package re-exports their public names and maps the reference policies.

References:
    N. Megiddo, D. S. Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003.
    C. Waldspurger, T. Saemundsson, I. Ahmad, N. Park, "Cache Modeling and Optimization using
    Miniature Simulations", USENIX ATC 2017 (the tuner's miniatures).
    L. A. Belady, "A study of replacement algorithms for a virtual-storage computer",
    IBM Systems Journal 5(2), 1966.
    G. Einziger, R. Friedman, B. Manes, "TinyLFU: A Highly Efficient Cache Admission Policy",
    ACM Transactions on Storage 13(4), 2017.
    B. Manes, Caffeine design: https://github.com/ben-manes/caffeine/wiki/Efficiency and
    ``com.github.benmanes.caffeine.cache.FrequencySketch`` / the simulator's
    ``WindowTinyLfuPolicy``.
    G. Einziger, O. Eytan, R. Friedman, B. Manes, "Adaptive Software Cache Management",
    Middleware 2018 (the hill climber; Caffeine's ``BoundedLocalCache.climb``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .arc import arc_hit_ratio, arc_hits
from .list_policies import (
    SKETCH_SEEDS,
    lfu_hit_ratio,
    lfu_hits,
    lru_hit_ratio,
    lru_hits,
    sketch_hash,
    wtinylfu_adaptive_hit_ratio,
    wtinylfu_hit_ratio,
    wtinylfu_hits,
)
from .lrfu import LrfuSim, lrfu_hit_ratio, lrfu_hits
from .opt import opt_hit_ratio, opt_hits
from .tuner import AdaptiveLrfuSim, adaptive_lrfu_hit_ratio

__all__ = [
    "REFERENCE_POLICIES",
    "SKETCH_SEEDS",
    "AdaptiveLrfuSim",
    "HitRatioFn",
    "LrfuSim",
    "adaptive_lrfu_hit_ratio",
    "arc_hit_ratio",
    "arc_hits",
    "hit_ratio_curve",
    "lfu_hit_ratio",
    "lfu_hits",
    "lrfu_hit_ratio",
    "lrfu_hits",
    "lru_hit_ratio",
    "lru_hits",
    "opt_hit_ratio",
    "opt_hits",
    "sketch_hash",
    "wtinylfu_adaptive_hit_ratio",
    "wtinylfu_hit_ratio",
    "wtinylfu_hits",
]

HitRatioFn = Callable[[np.ndarray, int], float]


REFERENCE_POLICIES: dict[str, HitRatioFn] = {
    "LRU": lru_hit_ratio,
    "LFU": lfu_hit_ratio,
    "W-TinyLFU": wtinylfu_hit_ratio,
    "W-TinyLFU-adaptive": wtinylfu_adaptive_hit_ratio,
    "ARC": arc_hit_ratio,
    "OPT": opt_hit_ratio,
}


def hit_ratio_curve(sim: HitRatioFn, trace: np.ndarray, capacities: Sequence[int]) -> np.ndarray:
    """Hit ratio of ``sim`` on ``trace`` at each capacity.

    Args:
        sim: a ``(trace, capacity) -> hit ratio`` function, e.g. a value of
            ``REFERENCE_POLICIES``.
        trace: 1-D integer array of keys.
        capacities: cache sizes in keys.

    Returns:
        float64 array of hit ratios, one per capacity, in order.
    """
    return np.array([sim(trace, int(c)) for c in capacities], dtype=np.float64)
