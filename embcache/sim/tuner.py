"""Online tuning of embcache's policy by miniature simulations (Waldspurger et al., "Cache Modeling
and Optimization using Miniature Simulations", USENIX ATC 2017).

The right memory for a workload differs: a stationary Zipf wants a long half-life and plain
aged frequency, sessions (a user's many consecutive accesses) a short half-life, a loop larger
than the cache strict admission. Instead of climbing one knob by trial on the real cache (as
Caffeine's hill climber does with its window, which is noisy at small samples), a :class:`Tuner`
replays a spatial sample of the keys (every access of a sampled key; see
:mod:`embcache.mrc`) through one small :class:`~embcache.sim.LrfuSim` per candidate setting of
``GRID``, each holding the sample's share of the cache's rows, and names the setting whose
miniature hit most over a recent window. The cache (and :class:`AdaptiveLrfuSim`) switches to it.

The grid: half-lives of 4, 16 and 64 times the rows, with and without the idle discount (2.5),
with and without strict admission: 12 settings; and two with a window of 1% of the rows in
front of the rest and a row's accesses at one tick (a lookup batch's repeats) counted once
(half-life 64 times the rows, idle discount on or off): 14 in all. The window is what sessions
want (a user's run of accesses enters at its first miss, where counts alone would keep it out
until it had outscored the main region's lowest row); counting once keeps a run's dozens of
repeats inside one batch from making its row look hot for a half-life after it ended. Replayed
as the cache places rows (batches of 256; 1M keys, 2M accesses), against W-TinyLFU counted per
batch: item sessions at 0.25% from -3.35 points to +0.75, user sessions at 1% from -0.74 to
+0.01, switching at 0.25% from -0.62 to +0.57. Window settings with a 16x half-life were
tried too: their miniatures led now and then where the cache did worse with them (item
sessions at 0.25%: 0.711 held fixed against 0.738 for 64x), so they are left out.

The miniatures replay the sampled batches as the cache serves them
(:meth:`LrfuSim.access_batches` with ``as_cache``): replayed key by key, a missed key placed at
once hit at its next occurrence in the same batch, which the cache cannot, and the miniatures
ranked a 4x half-life without a window level with the window. With it, the cache through the
tuner: item sessions at 0.25% 0.7243 (W-TinyLFU per batch 0.7304), user sessions 0.7436
(0.7540); before, 0.7117 and 0.7422. Asking a new setting to lead by 1% before switching
(fewer flips) gained 0.1-0.2 points there but cost a loop over 8% of the keys 4.5 points.
Tried too and dropped (the cache through the tuner, 1M keys, 2M accesses):

- holding the first setting until the scores had seen two windows: a loop over 8% of the keys
  fell from 0.6243 to 0.5807 (strict admission came late, after a churned population had
  formed, and froze it);
- starting from the loop's best fixed setting (64x, no idle discount, strict) instead of
  ``GRID[0]``: 0.6107 there, and no gain elsewhere (the first decision comes after a few
  batches whatever the start);
- half-lives of 1x the rows: held fixed, the switching workload at 16% reaches 0.7633 (LRU per
  batch 0.7639, the 4x half-life 0.7514), but tuned they led only in its third quarter (0.7430).

The 12 settings before the window, measured with ``bench/bench_policy.py --quick`` (100k keys,
250k accesses, seven workloads at 0.25%, 1% and 4%; ``bench/results/policy-quick.md``):
the tuned policy is within 0.70 points of the best of LRU, LFU, ARC, W-TinyLFU and
W-TinyLFU-adaptive in every cell, where the fixed default loses up to 14 points (item sessions).
Replayed over all ten workloads of ``bench/workloads.py`` at the same sizes (30 cells), every
fixed setting of the grid lost 2 to 30 points somewhere, the tuned policy at most 0.70; grids of
4 or 6 settings lost up to 7 points on the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from .lrfu import LrfuSim

__all__ = ["GRID", "RATE_BITS", "WINDOW_SHARE", "AdaptiveLrfuSim", "Setting", "Tuner", "adaptive_lrfu_hit_ratio",
           "sample_keys", "sample_threshold", "spatial_sample"]


@dataclass(frozen=True)
class Setting:
    """One point of the policy's tuning space."""

    halflife_rows: float  # half-life in ticks, per row of the tier's capacity
    idle_halving: float  # missed accesses that halve a score (math.inf: no idle discount)
    strict: bool  # strict admission (see LrfuSim)
    window: float = 0.0  # share of the rows that is a window in front of the rest (see LrfuSim)
    once: bool = False  # a row's accesses at one tick (a batch's repeats) count once

    def to_dict(self) -> dict[str, float | bool]:
        """JSON-ready form (``idle_halving`` inf as the string "inf")."""
        return {"halflife_rows": self.halflife_rows,
                "idle_halving": "inf" if math.isinf(self.idle_halving) else self.idle_halving,  # type: ignore[dict-item]
                "strict": self.strict, "window": self.window, "once": self.once}


# The window's share where it is on (W-TinyLFU's default of 1%).
WINDOW_SHARE = 0.01
GRID: tuple[Setting, ...] = (
    tuple(Setting(m, ih, st) for m in (4.0, 16.0, 64.0) for ih in (2.5, math.inf) for st in (False, True))
    + tuple(Setting(64.0, ih, False, WINDOW_SHARE, True) for ih in (2.5, math.inf)))
# The score window: hits decay by half every this many sampled accesses per row of a miniature,
# and never fewer than _MIN_SCORE_WINDOW (see Tuner).
_WINDOW_ROWS = 4.0
_MIN_SCORE_WINDOW = 4096
_MIN_MINI_ROWS = 256


RATE_BITS = 32  # a key is sampled when the top RATE_BITS bits of its hash are below the threshold


def sample_threshold(rate: float) -> int:
    """The :func:`spatial_sample` threshold of a sample of ``rate`` (in (0, 1]) of the keys."""
    return min(int(rate * 2**RATE_BITS), 2**RATE_BITS)


@numba.njit(cache=True, nogil=True)
def spatial_sample(keys: np.ndarray, threshold: int) -> np.ndarray:
    """Keys whose 32-bit hash is below ``threshold`` (spatial sampling; the same key always agrees).

    Two passes: the hashes and comparisons first, branch-free so that they vectorize (2-4x faster
    than testing each key as it is hashed), then the rare sampled keys are copied out.
    """
    n = keys.shape[0]
    take = np.empty(n, dtype=np.bool_)
    bound = np.uint64(threshold)
    for i in range(n):
        x = np.uint64(keys[i]) ^ np.uint64(0x2545F4914F6CDD1D)
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xFF51AFD7ED558CCD)
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xC4CEB9FE1A85EC53)
        x ^= x >> np.uint64(33)
        take[i] = (x >> np.uint64(64 - RATE_BITS)) < bound
    out = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        if take[i]:
            out[m] = keys[i]
            m += 1
    return out[:m]


def sample_keys(keys: np.ndarray, rate: float) -> np.ndarray:
    """The keys of ``keys`` in a spatial sample of ``rate`` (a key is in it or not, always): the
    sample the cache's miss-ratio estimator and tuner take (:func:`spatial_sample`)."""
    if rate >= 1.0:
        return keys
    return spatial_sample(np.ascontiguousarray(keys, dtype=np.int64), sample_threshold(rate))


class Tuner:
    """Miniature caches, one per setting of ``grid``, replaying a sampled key stream.

    Args:
        capacity: rows of the tier being tuned.
        rate: the sample's share of the keys (the caller samples; see :func:`sample_keys`);
            each miniature holds ``rate * capacity`` rows (at least one).
        grid: the settings to choose from (default :data:`GRID`).
    """

    def __init__(self, capacity: int, rate: float, grid: tuple[Setting, ...] = GRID) -> None:
        self.grid = grid
        self.rate = rate
        self.rows = max(1, round(capacity * rate))
        self.minis = [LrfuSim(self.rows, halflife=s.halflife_rows * self.rows, idle_halving=s.idle_halving,
                              strict=s.strict, window=s.window, once=s.once) for s in grid]
        self.scores = np.zeros(len(grid))
        # A score's noise shrinks with the sampled accesses it counts, not with the miniatures'
        # rows: a small tier's miniatures (a few hundred rows at a sample of 1/16) over 4x their
        # rows counted so few hits that the choice flipped every few dozen batches (52 switches
        # on item sessions at 0.25%, between the window and a 4x half-life); a floor of 4,096
        # keeps 10 switches and gains a point there (0.7236 to 0.7338) and 0.4 on user sessions
        # (0.7435 to 0.7470). A large tier's window (4x its 1,024-row miniatures) is unchanged.
        self._window = max(_WINDOW_ROWS * self.rows, float(_MIN_SCORE_WINDOW))
        self.observed = 0
        self._best = grid[0]  # chosen where the scores change, so that best() costs a lookup nothing

    def observe(self, sampled: np.ndarray, batch_ticks: bool = False) -> None:
        """Replay sampled accesses (int64, in order) through every miniature.

        Args:
            sampled: the sampled keys.
            batch_ticks: the keys are one lookup batch sharing a tick (as the cache counts), not
                one tick each.
        """
        step = max(1, int(self._window))
        for lo in range(0, sampled.shape[0], step):
            part = np.ascontiguousarray(sampled[lo:lo + step], dtype=np.int64)
            hits = np.array([m.access(part, part.shape[0] if batch_ticks else None) for m in self.minis], dtype=float)
            self.scores = self.scores * 0.5 ** (part.shape[0] / self._window) + hits
            self.observed += part.shape[0]
        self._choose()

    def observe_batches(self, keys: np.ndarray, bounds: np.ndarray) -> None:
        """Replay sampled lookup batches ``keys[bounds[b]:bounds[b + 1]]``, each sharing one tick
        (as the cache counts; see :meth:`LrfuSim.access_batches`)."""
        n = int(bounds[-1]) if bounds.shape[0] else 0
        if n == 0:
            return
        hits = np.array([float(m.access_batches(keys, bounds, as_cache=True).sum()) for m in self.minis])
        self.scores = self.scores * 0.5 ** (n / self._window) + hits
        self.observed += n
        self._choose()

    def _choose(self) -> None:
        # the best miniature, at once: a lead of 1% asked before switching kept a loop over 8%
        # of the keys on its first strict setting (0.5795 against 0.6243 without)
        self._best = self.grid[int(np.argmax(self.scores))]

    def best(self) -> Setting:
        """The setting whose miniature hit most over the recent window (the first on ties)."""
        return self._best


class AdaptiveLrfuSim:
    """:class:`LrfuSim` tuned online by a :class:`Tuner` on a spatial sample, as the cache tunes itself.

    Every ``period`` accesses (default four times the capacity) the sampled accesses run through
    the tuner, and the simulator switches to its best setting.

    Args:
        capacity: keys the cache holds.
        rate: the tuner's sample; default ``min(1, max(0.01, 256 / capacity))`` (miniatures of
            at least 256 rows where the cache allows).
        period: accesses between decisions.
    """

    def __init__(self, capacity: int, rate: float | None = None, period: int | None = None) -> None:
        self.capacity = capacity
        self.rate = rate if rate is not None else min(1.0, max(0.01, _MIN_MINI_ROWS / max(capacity, 1)))
        self.period = period or max(4 * capacity, 1000)
        self.tuner = Tuner(capacity, self.rate)
        self.setting: Setting | None = None  # None: the cache's defaults, until the first decision
        self.sim = LrfuSim(capacity)
        self.switches = 0

    def access(self, keys: np.ndarray) -> int:
        """Replay ``keys`` (one tick each); returns how many hit."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        hits = 0
        for lo in range(0, keys.shape[0], self.period):
            part = keys[lo:lo + self.period]
            hits += self.sim.access(part)
            self.tuner.observe(sample_keys(part, self.rate))
            best = self.tuner.best()
            if best != self.setting:
                self.setting = best
                self.switches += 1
                self.sim.retune(best.halflife_rows * self.capacity, best.idle_halving, best.strict, best.window,
                                best.once)
        return hits


def adaptive_lrfu_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio of :class:`AdaptiveLrfuSim` replaying ``trace`` (0 for an empty trace)."""
    keys = np.asarray(trace)
    return AdaptiveLrfuSim(int(capacity)).access(keys.astype(np.int64)) / keys.size if keys.size else 0.0
