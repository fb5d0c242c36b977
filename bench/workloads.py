"""Seeded key-trace generators for the eviction-policy benchmark.

Every generator returns a 1-D ``numpy.int64`` array of keys (one entry per access) and is a
pure function of its arguments: the same arguments and ``seed`` give the same trace. All of
them are vectorized (no per-access Python), so a trace of millions of accesses takes well under
a second.

Popularity follows a Zipf law: the key of rank ``r`` (0-based) is drawn with probability
proportional to ``(r + 1) ** -alpha``. Any ``alpha >= 0`` works, including ``alpha < 1``
(``numpy.random.Generator.zipf`` needs ``alpha > 1`` and an unbounded support, so ranks are
drawn by inverse CDF over the precomputed cumulative weights instead). Ranks map to keys through
a fixed random permutation of ``range(n_keys)``, so hot keys are scattered over the key space
rather than packed at small ids (which would flatter range-partitioned structures).

The workloads:

- :func:`zipf_trace` - stationary skew, where frequency (LFU) is the right signal.
- :func:`drifting_trace` - the hot set is partly replaced every phase (new items and users
  appear, old ones fade), so stale frequencies must age out.
- :func:`bursty_trace` - a stationary background plus short bursts in which a few cold keys
  become very hot and then vanish, so recency matters.
- :func:`scan_mix_trace` - a stationary background interleaved with scans of keys that are
  used once and never again, where admission matters and plain LRU is polluted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "WORKLOADS",
    "Workload",
    "bursty_trace",
    "drifting_trace",
    "scan_mix_trace",
    "zipf_ranks",
    "zipf_trace",
    "zipf_weights",
]


def zipf_weights(n_keys: int, alpha: float) -> np.ndarray:
    """Cumulative Zipf probabilities of ranks ``0 .. n_keys-1``.

    Args:
        n_keys: number of ranks (>= 1).
        alpha: skew exponent (>= 0); ``0`` is uniform.

    Returns:
        float64 array ``cdf`` of shape ``(n_keys,)``, nondecreasing, with ``cdf[-1] == 1``.

    Raises:
        ValueError: if ``n_keys < 1`` or ``alpha < 0``.
    """
    if n_keys < 1:
        raise ValueError(f"n_keys must be >= 1, got {n_keys}")
    if not alpha >= 0.0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    weights = np.arange(1, n_keys + 1, dtype=np.float64) ** -float(alpha)
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    return cdf


def zipf_ranks(n_accesses: int, n_keys: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Draw ``n_accesses`` Zipf(alpha) ranks in ``[0, n_keys)`` by inverse CDF.

    Args:
        n_accesses: number of draws (>= 0).
        n_keys: number of ranks (>= 1).
        alpha: skew exponent (>= 0).
        rng: the generator to draw from (advanced in place).

    Returns:
        int64 array of shape ``(n_accesses,)``; rank 0 is the most popular.

    Raises:
        ValueError: on a negative ``n_accesses`` or a bad ``n_keys``/``alpha``.
    """
    if n_accesses < 0:
        raise ValueError(f"n_accesses must be >= 0, got {n_accesses}")
    cdf = zipf_weights(n_keys, alpha)
    ranks = np.searchsorted(cdf, rng.random(n_accesses), side="right")
    # random() < 1 == cdf[-1], so ranks < n_keys; the clip only guards float rounding.
    return np.minimum(ranks, n_keys - 1).astype(np.int64, copy=False)


def zipf_trace(n_accesses: int, n_keys: int, alpha: float, seed: int = 0) -> np.ndarray:
    """Stationary Zipf(alpha) trace over the keys ``0 .. n_keys-1``.

    Args:
        n_accesses: trace length.
        n_keys: size of the key space.
        alpha: skew exponent (>= 0; e.g. 0.8, 1.05, 1.2).
        seed: seed of the trace (the rank permutation and the draws).

    Returns:
        int64 keys of shape ``(n_accesses,)``, each in ``[0, n_keys)``.

    Raises:
        ValueError: on a negative length, ``n_keys < 1`` or ``alpha < 0``.
    """
    rng = np.random.default_rng(seed)
    rank_to_key = rng.permutation(n_keys).astype(np.int64)
    return rank_to_key[zipf_ranks(n_accesses, n_keys, alpha, rng)]


def drifting_trace(
    n_accesses: int,
    n_keys: int,
    alpha: float = 1.0,
    n_phases: int = 20,
    hot_fraction: float = 0.05,
    drift: float = 0.3,
    seed: int = 0,
) -> np.ndarray:
    """Zipf trace whose popularity ranking drifts: new keys keep entering the hot set.

    The trace is cut into ``n_phases`` equal phases. Within a phase popularity is a stationary
    Zipf(alpha) over ranks; between phases a random ``drift`` fraction of the hot ranks (the top
    ``hot_fraction * n_keys``) is handed to keys drawn from the cold ranks, and those displaced
    hot keys take the cold ranks. So each phase new items appear at random hot ranks (including
    the very top) and old hot items fade into the tail: frequencies learned in earlier phases go
    stale and must age out.

    Args:
        n_accesses: trace length.
        n_keys: size of the key space.
        alpha: skew exponent of each phase (>= 0).
        n_phases: number of phases (>= 1); the ranking changes ``n_phases - 1`` times.
        hot_fraction: share of ranks that form the hot set, in ``(0, 1)``.
        drift: share of the hot set replaced at each phase boundary, in ``[0, 1]``.
        seed: seed of the trace.

    Returns:
        int64 keys of shape ``(n_accesses,)``, each in ``[0, n_keys)``.

    Raises:
        ValueError: on an argument outside the ranges above.
    """
    if n_phases < 1:
        raise ValueError(f"n_phases must be >= 1, got {n_phases}")
    if not 0.0 < hot_fraction < 1.0:
        raise ValueError(f"hot_fraction must be in (0, 1), got {hot_fraction}")
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"drift must be in [0, 1], got {drift}")
    rng = np.random.default_rng(seed)
    rank_to_key = rng.permutation(n_keys).astype(np.int64)
    ranks = zipf_ranks(n_accesses, n_keys, alpha, rng)
    n_hot = min(max(1, round(hot_fraction * n_keys)), n_keys)
    n_swap = min(round(drift * n_hot), n_keys - n_hot)
    bounds = np.linspace(0, n_accesses, n_phases + 1).astype(np.int64)
    trace = np.empty(n_accesses, dtype=np.int64)
    for phase in range(n_phases):
        if phase > 0 and n_swap > 0:
            hot = rng.choice(n_hot, size=n_swap, replace=False)
            cold = n_hot + rng.choice(n_keys - n_hot, size=n_swap, replace=False)
            rank_to_key[hot], rank_to_key[cold] = rank_to_key[cold], rank_to_key[hot]
        lo, hi = bounds[phase], bounds[phase + 1]
        trace[lo:hi] = rank_to_key[ranks[lo:hi]]
    return trace


def bursty_trace(
    n_accesses: int,
    n_keys: int,
    alpha: float = 1.0,
    n_bursts: int = 100,
    burst_len: int | None = None,
    burst_keys: int | None = None,
    intensity: float = 0.5,
    seed: int = 0,
) -> np.ndarray:
    """Stationary Zipf background with short bursts of previously cold keys.

    ``n_bursts`` bursts start at random positions (they may overlap). During a burst, each
    access is, with probability ``intensity``, a uniform draw from that burst's own set of
    ``burst_keys`` keys; otherwise it follows the background. A burst's keys come from the
    cold half of the ranking and are used by no other burst, so they are cold before the burst
    and (nearly) unused after it: their high count is only worth keeping while the burst lasts.

    Args:
        n_accesses: trace length.
        n_keys: size of the key space.
        alpha: skew exponent of the background (>= 0).
        n_bursts: number of bursts (>= 0).
        burst_len: accesses per burst; default ``max(1000, n_accesses // 200)``.
        burst_keys: keys per burst; default ``max(10, n_keys // 5000)``.
        intensity: share of a burst's accesses that go to its keys, in ``[0, 1]``.
        seed: seed of the trace.

    Returns:
        int64 keys of shape ``(n_accesses,)``, each in ``[0, n_keys)``.

    Raises:
        ValueError: on an argument outside the ranges above, or if the cold half of the key
            space has fewer than ``n_bursts * burst_keys`` keys.
    """
    if burst_len is None:
        burst_len = max(1000, n_accesses // 200)
    if burst_keys is None:
        burst_keys = max(10, n_keys // 5000)
    if n_bursts < 0 or burst_len < 1 or burst_keys < 1:
        raise ValueError(
            f"need n_bursts >= 0, burst_len >= 1, burst_keys >= 1; got {n_bursts}, {burst_len}, {burst_keys}"
        )
    if not 0.0 <= intensity <= 1.0:
        raise ValueError(f"intensity must be in [0, 1], got {intensity}")
    n_cold = n_keys - n_keys // 2
    if n_bursts * burst_keys > n_cold:
        raise ValueError(
            f"{n_bursts} bursts of {burst_keys} keys need {n_bursts * burst_keys} cold keys; "
            f"the cold half of {n_keys} keys has {n_cold}"
        )
    rng = np.random.default_rng(seed)
    rank_to_key = rng.permutation(n_keys).astype(np.int64)
    trace = rank_to_key[zipf_ranks(n_accesses, n_keys, alpha, rng)]
    if n_bursts == 0 or n_accesses == 0:
        return trace
    burst_len = min(burst_len, n_accesses)
    pool = rank_to_key[n_keys // 2 + rng.choice(n_cold, n_bursts * burst_keys, replace=False)]
    pool = pool.reshape(n_bursts, burst_keys)
    starts = np.sort(rng.integers(0, n_accesses - burst_len + 1, size=n_bursts))
    # One vectorized pass: positions of all bursts (n_bursts x burst_len), overlaps resolved by
    # letting the later burst win (fancy assignment keeps the last write).
    pos = starts[:, None] + np.arange(burst_len)[None, :]
    hit = rng.random(pos.shape) < intensity
    pick = pool[np.arange(n_bursts)[:, None], rng.integers(0, burst_keys, size=pos.shape)]
    trace[pos[hit]] = pick[hit]
    return trace


def scan_mix_trace(
    n_accesses: int,
    n_keys: int,
    alpha: float = 1.0,
    scan_fraction: float = 0.3,
    scan_len: int | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Stationary Zipf trace interleaved with scans of one-hit-wonder keys.

    The trace is cut into blocks of ``scan_len`` accesses; each block is, with probability
    ``scan_fraction``, a scan: consecutive fresh keys ``n_keys, n_keys + 1, ...`` that never
    occur again. Other blocks follow Zipf(alpha) over ``[0, n_keys)``. An always-admit policy
    (LRU, admission-free LFU) lets every scan flush useful rows; an admission filter (TinyLFU)
    turns the scan away.

    Args:
        n_accesses: trace length.
        n_keys: size of the Zipf key space (scan keys lie above it).
        alpha: skew exponent of the background (>= 0).
        scan_fraction: expected share of blocks that are scans, in ``[0, 1]``.
        scan_len: accesses per block; default ``max(100, n_keys // 100)``.
        seed: seed of the trace.

    Returns:
        int64 keys of shape ``(n_accesses,)``; Zipf keys in ``[0, n_keys)``, scan keys
        ``>= n_keys`` (each used once).

    Raises:
        ValueError: on an argument outside the ranges above.
    """
    if scan_len is None:
        scan_len = max(100, n_keys // 100)
    if scan_len < 1:
        raise ValueError(f"scan_len must be >= 1, got {scan_len}")
    if not 0.0 <= scan_fraction <= 1.0:
        raise ValueError(f"scan_fraction must be in [0, 1], got {scan_fraction}")
    rng = np.random.default_rng(seed)
    rank_to_key = rng.permutation(n_keys).astype(np.int64)
    trace = rank_to_key[zipf_ranks(n_accesses, n_keys, alpha, rng)]
    n_blocks = -(-n_accesses // scan_len)
    is_scan = np.repeat(rng.random(n_blocks) < scan_fraction, scan_len)[:n_accesses]
    n_scan = int(is_scan.sum())
    trace[is_scan] = n_keys + np.arange(n_scan, dtype=np.int64)
    return trace


@dataclass(frozen=True)
class Workload:
    """A named trace generator: ``make(n_accesses, n_keys, seed) -> keys``."""

    name: str
    description: str
    make: Callable[[int, int, int], np.ndarray]


WORKLOADS: tuple[Workload, ...] = (
    Workload("zipf-0.8", "stationary Zipf, alpha 0.8", lambda n, k, s: zipf_trace(n, k, 0.8, seed=s)),
    Workload("zipf-1.05", "stationary Zipf, alpha 1.05", lambda n, k, s: zipf_trace(n, k, 1.05, seed=s)),
    Workload("zipf-1.2", "stationary Zipf, alpha 1.2", lambda n, k, s: zipf_trace(n, k, 1.2, seed=s)),
    Workload(
        "drifting",
        "Zipf 1.0; 20 phases, each replacing 30% of the top-5% ranks with cold keys",
        lambda n, k, s: drifting_trace(n, k, alpha=1.0, n_phases=20, hot_fraction=0.05, drift=0.3, seed=s),
    ),
    Workload(
        "bursty",
        "Zipf 1.0 background; 100 bursts of n/200 accesses, half of them to n_keys/5000 fresh cold keys",
        lambda n, k, s: bursty_trace(n, k, alpha=1.0, n_bursts=100, intensity=0.5, seed=s),
    ),
    Workload(
        "scan-mix",
        "Zipf 1.0; 30% of blocks of n_keys/100 accesses are scans of never-repeated keys",
        lambda n, k, s: scan_mix_trace(n, k, alpha=1.0, scan_fraction=0.3, seed=s),
    ),
)
