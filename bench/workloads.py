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
- :func:`sessions_trace` - sessions: a user (or a browsing context) drawn from a Zipf population
  makes a run of accesses of varying length, interleaved with other live sessions, as in click
  logs sorted by time. Recency is the signal: a key just seen will be seen again soon, then
  not for long.
- :func:`loop_trace` - a Zipf background mixed with a loop over a set of keys larger than the
  cache (an epoch over a table, a periodic batch job), where LRU keeps nothing of the loop.
- :func:`switching_trace` - the regimes above one after the other, so a policy tuned to one
  must re-tune mid-run.
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
    "loop_trace",
    "scan_mix_trace",
    "sessions_trace",
    "switching_trace",
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


def sessions_trace(
    n_accesses: int,
    n_keys: int,
    alpha: float = 1.0,
    mean_session: float = 20.0,
    items_per_session: float = 1.0,
    interleave: int = 256,
    seed: int = 0,
) -> np.ndarray:
    """Sessions over a Zipf population: runs of accesses to a few keys, interleaved.

    Each session draws its owner from Zipf(alpha) over the keys (a popular user has many
    sessions) and a length from a geometric law of mean ``mean_session``. With
    ``items_per_session`` = 1 a session repeats its owner's key (a user's id in every click of a
    visit); above 1 it draws ``1 + Poisson(items_per_session - 1)`` keys from Zipf(alpha) (the
    items a visit looks at, revisited in it) and each access picks one of them uniformly.
    Sessions are laid end to end and then interleaved: each access moves by a uniform jitter of
    up to ``interleave`` positions, so about ``interleave / mean_session`` sessions are live at
    once.

    Args:
        n_accesses: trace length.
        n_keys: size of the key space.
        alpha: skew exponent of the population (>= 0).
        mean_session: mean accesses per session (>= 1).
        items_per_session: mean distinct keys per session (>= 1).
        interleave: jitter of each access, in positions (>= 0).
        seed: seed of the trace.

    Returns:
        int64 keys of shape ``(n_accesses,)``, each in ``[0, n_keys)``.

    Raises:
        ValueError: on an argument outside the ranges above.
    """
    if mean_session < 1 or items_per_session < 1 or interleave < 0:
        raise ValueError(f"need mean_session >= 1, items_per_session >= 1, interleave >= 0; got "
                         f"{mean_session}, {items_per_session}, {interleave}")
    rng = np.random.default_rng(seed)
    rank_to_key = rng.permutation(n_keys).astype(np.int64)
    if n_accesses == 0:
        return np.empty(0, dtype=np.int64)
    n_sessions = int(n_accesses / mean_session * 1.2) + 16
    lengths = rng.geometric(1.0 / mean_session, size=n_sessions)
    while lengths.sum() < n_accesses:  # rare: draw more sessions
        lengths = np.concatenate([lengths, rng.geometric(1.0 / mean_session, size=n_sessions)])
    n_sessions = int(np.searchsorted(np.cumsum(lengths), n_accesses)) + 1
    lengths = lengths[:n_sessions]
    session = np.repeat(np.arange(n_sessions), lengths)[:n_accesses]
    if items_per_session <= 1:
        owners = rank_to_key[zipf_ranks(n_sessions, n_keys, alpha, rng)]
        trace = owners[session]
    else:
        n_items = 1 + rng.poisson(items_per_session - 1, size=n_sessions)
        starts = np.concatenate([[0], np.cumsum(n_items)[:-1]])
        pool = rank_to_key[zipf_ranks(int(n_items.sum()), n_keys, alpha, rng)]
        pick = (rng.random(n_accesses) * n_items[session]).astype(np.int64)
        trace = pool[starts[session] + pick]
    if interleave:
        order = np.argsort(np.arange(n_accesses) + rng.random(n_accesses) * interleave, kind="stable")
        trace = trace[order]
    return trace


def loop_trace(
    n_accesses: int,
    n_keys: int,
    alpha: float = 1.0,
    loop_fraction: float = 0.1,
    loop_share: float = 0.5,
    seed: int = 0,
) -> np.ndarray:
    """A Zipf background mixed with a loop over ``loop_fraction * n_keys`` keys.

    Each access is, with probability ``loop_share``, the loop's next key (the loop's keys in a
    fixed order, over and over), otherwise a Zipf(alpha) draw over the remaining keys. A loop
    longer than the cache defeats LRU entirely (each loop key is evicted just before it comes
    back); keeping a fixed part of the loop (what LFU, OPT and a frequency filter do) hits it
    once per round.

    Args:
        n_accesses: trace length.
        n_keys: size of the key space.
        alpha: skew exponent of the background (>= 0).
        loop_fraction: share of the keys in the loop, in ``(0, 1)``.
        loop_share: share of the accesses that go to the loop, in ``[0, 1]``.
        seed: seed of the trace.

    Returns:
        int64 keys of shape ``(n_accesses,)``, each in ``[0, n_keys)``.

    Raises:
        ValueError: on an argument outside the ranges above.
    """
    if not 0.0 < loop_fraction < 1.0 or not 0.0 <= loop_share <= 1.0:
        raise ValueError(f"need loop_fraction in (0, 1) and loop_share in [0, 1]; got {loop_fraction}, {loop_share}")
    rng = np.random.default_rng(seed)
    rank_to_key = rng.permutation(n_keys).astype(np.int64)
    n_loop = max(1, min(n_keys - 1, round(loop_fraction * n_keys)))
    loop_keys, rest = rank_to_key[:n_loop], rank_to_key[n_loop:]
    trace = rest[zipf_ranks(n_accesses, rest.size, alpha, rng)]
    in_loop = rng.random(n_accesses) < loop_share
    trace[in_loop] = loop_keys[np.arange(int(in_loop.sum())) % n_loop]
    return trace


def switching_trace(n_accesses: int, n_keys: int, seed: int = 0) -> np.ndarray:
    """Four regimes one after the other, a quarter of the trace each: stationary Zipf 1.05,
    user sessions, a loop over 10% of the keys mixed with Zipf, and Zipf 1.05 again (over a
    fresh ranking, so the first quarter's frequencies are stale).

    Args:
        n_accesses: trace length.
        n_keys: size of the key space.
        seed: seed of the trace.

    Returns:
        int64 keys of shape ``(n_accesses,)``, each in ``[0, n_keys)``.
    """
    b = np.linspace(0, n_accesses, 5).astype(np.int64)
    parts = [
        zipf_trace(int(b[1] - b[0]), n_keys, 1.05, seed=seed),
        sessions_trace(int(b[2] - b[1]), n_keys, alpha=1.0, mean_session=20.0, seed=seed + 1),
        loop_trace(int(b[3] - b[2]), n_keys, alpha=1.0, seed=seed + 2),
        zipf_trace(int(b[4] - b[3]), n_keys, 1.05, seed=seed + 3),
    ]
    return np.concatenate(parts)


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
    Workload(
        "sessions-users",
        "Zipf 1.0 users; sessions of geometric length (mean 20) repeating the user's key, ~13 live at once",
        lambda n, k, s: sessions_trace(n, k, alpha=1.0, mean_session=20.0, seed=s),
    ),
    Workload(
        "sessions-items",
        "Zipf 1.0 items; sessions (mean 30 accesses) revisiting ~5 items each, ~9 live at once",
        lambda n, k, s: sessions_trace(n, k, alpha=1.0, mean_session=30.0, items_per_session=5.0, seed=s),
    ),
    Workload(
        "loop",
        "Zipf 1.0 background; half the accesses loop over 10% of the keys",
        lambda n, k, s: loop_trace(n, k, alpha=1.0, loop_fraction=0.1, loop_share=0.5, seed=s),
    ),
    Workload(
        "switching",
        "quarters of Zipf 1.05, user sessions, loop, Zipf 1.05 (new ranking)",
        lambda n, k, s: switching_trace(n, k, seed=s),
    ),
)
