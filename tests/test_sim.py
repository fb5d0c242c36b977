"""Tests of embcache/sim.py (the exact cache simulators) and bench/workloads.py.

The compiled simulators are checked against small pure-Python brute-force implementations on
random traces: exact hit counts for LRU, LFU, OPT and W-TinyLFU (the brute-force W-TinyLFU
uses the same sketch hash), plus sanity orderings (OPT bounds everything; W-TinyLFU beats LRU
when scans pollute it).
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

# bench/ is a directory of scripts beside the tests, not part of the installed package.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench import workloads as wl  # noqa: E402
from embcache import sim as rp  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Brute-force references (quadratic, obviously correct)


def brute_lru(trace: list[int], capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in trace:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        elif capacity > 0:
            if len(cache) == capacity:
                cache.popitem(last=False)
            cache[k] = None
    return hits


def brute_lfu(trace: list[int], capacity: int) -> int:
    count: dict[int, int] = {}
    last: dict[int, int] = {}
    hits = 0
    for t, k in enumerate(trace):
        if k in count:
            hits += 1
            count[k] += 1
        elif capacity > 0:
            if len(count) == capacity:
                victim = min(count, key=lambda x: (count[x], last[x]))
                del count[victim], last[victim]
            count[k] = 1
        else:
            continue
        last[k] = t
    return hits


def brute_opt(trace: list[int], capacity: int) -> int:
    def next_use(key: int, t: int) -> int:
        for u in range(t + 1, len(trace)):
            if trace[u] == key:
                return u
        return len(trace) + 1

    cache: set[int] = set()
    hits = 0
    for t, k in enumerate(trace):
        if k in cache:
            hits += 1
        elif capacity > 0:
            cache.add(k)
            if len(cache) > capacity:
                cache.remove(max(cache, key=lambda x: next_use(x, t)))
    return hits


class BruteSketch:
    """4 x width 4-bit count-min sketch with Caffeine's halving, in plain Python."""

    def __init__(self, width: int, sample_size: int) -> None:
        self.width = width
        self.sample_size = sample_size
        self.table = [[0] * width for _ in range(4)]
        self.additions = 0

    def _slots(self, key: int) -> list[int]:
        return [rp.sketch_hash(key, r) % self.width for r in range(4)]

    def increment(self, key: int) -> None:
        added = False
        for r, j in enumerate(self._slots(key)):
            if self.table[r][j] < 15:
                self.table[r][j] += 1
                added = True
        if added:
            self.additions += 1
            if self.additions >= self.sample_size:
                odd = sum(c & 1 for row in self.table for c in row)
                self.table = [[c >> 1 for c in row] for row in self.table]
                self.additions = (self.additions - odd // 4) // 2

    def estimate(self, key: int) -> int:
        return min(self.table[r][j] for r, j in enumerate(self._slots(key)))


def brute_wtinylfu(trace: list[int], capacity: int, adaptive: bool = False) -> int:
    max_main = int(capacity * 0.99)
    max_window = capacity - max_main
    max_protected = int(max_main * 0.8)
    pow2 = 1
    while pow2 < capacity:
        pow2 *= 2
    sample = 10 * max(capacity, 1)
    sketch = BruteSketch(4 * max(pow2, 8), sample)
    window: OrderedDict[int, None] = OrderedDict()
    probation: OrderedDict[int, None] = OrderedDict()
    protected: OrderedDict[int, None] = OrderedDict()
    hits = 0
    sample_hits = sample_misses = 0
    prev_rate = 0.0
    step = -0.0625 * capacity
    adjustment = 0

    def demote_protected(limit: int = 1000) -> None:
        while len(protected) > max_protected and limit > 0:
            demoted, _ = protected.popitem(last=False)
            probation[demoted] = None
            limit -= 1

    for k in trace:
        sketch.increment(k)
        hit = True
        if k in window:
            window.move_to_end(k)
        elif k in probation:
            del probation[k]
            protected[k] = None
            demote_protected(1)
        elif k in protected:
            protected.move_to_end(k)
        else:
            hit = False
            if capacity > 0:
                window[k] = None
                while len(window) > max_window:
                    candidate, _ = window.popitem(last=False)
                    probation[candidate] = None
                    if len(window) + len(probation) + len(protected) > capacity:
                        victim = next(iter(probation))
                        admit = sketch.estimate(candidate) > sketch.estimate(victim)
                        del probation[victim if admit and victim != candidate else candidate]
        hits += hit
        if not adaptive:
            continue
        # Caffeine's climb(): determineAdjustment, demoteFromMainProtected, increase/decreaseWindow
        sample_hits += hit
        sample_misses += not hit
        if sample_hits + sample_misses >= sample:
            rate = sample_hits / (sample_hits + sample_misses)
            change = rate - prev_rate
            amount = step if change >= 0 else -step
            step = 0.0625 * capacity * (1 if amount >= 0 else -1) if abs(change) >= 0.05 else 0.98 * amount
            prev_rate, adjustment = rate, int(amount)
            sample_hits = sample_misses = 0
        demote_protected()
        if adjustment > 0 and max_protected > 0:
            quota = min(adjustment, max_protected)
            max_protected -= quota
            max_window += quota
            demote_protected()
            for _ in range(1000):
                source = probation or protected
                if quota == 0 or not source:
                    break
                node, _ = source.popitem(last=False)
                window[node] = None
                quota -= 1
            max_protected += quota
            max_window -= quota
            adjustment = quota
        elif adjustment < 0 and max_window > 1:
            quota = min(-adjustment, max_window - 1)
            max_protected += quota
            max_window -= quota
            for _ in range(1000):
                if quota == 0 or not window:
                    break
                node, _ = window.popitem(last=False)
                probation[node] = None
                quota -= 1
            max_protected -= quota
            max_window += quota
            adjustment = -quota
    return hits


# ---------------------------------------------------------------------------------------------
# Traces


def random_traces() -> list[tuple[np.ndarray, int]]:
    """Small random traces (uniform and skewed, odd key values) with a spread of capacities."""
    rng = np.random.default_rng(1234)
    cases: list[tuple[np.ndarray, int]] = []
    for i in range(24):
        n = int(rng.integers(1, 400))
        n_keys = int(rng.integers(1, 60))
        if i % 2:
            trace = wl.zipf_trace(n, n_keys, float(rng.uniform(0.5, 1.5)), seed=i)
        else:
            trace = rng.integers(0, n_keys, size=n)
        trace = trace * 7919 - 50_000  # keys need not be dense or non-negative
        capacity = int(rng.integers(0, n_keys + 3))
        cases.append((trace.astype(np.int64), capacity))
    return cases


CASES = random_traces()


def brute_lrfu(trace: list[int], capacity: int, halflife: float, batch: int | None = None,
               idle_halving: float = 2.5, window: float = 0.0, once: bool = False, as_cache: bool = False) -> int:
    """LRFU with count-min admission and the idle discount, as LrfuSim with ``sample=None``.

    A resident's score is its aged frequency halved per ``idle_halving`` missed accesses
    (``missed = freq / increment * ln 2 / halflife * idle``); the exact minimum is the victim.
    The sketch is 8x the capacity wide and updated conservatively: a key's counters rise to
    min(counters) + increment, no further. With ``window``, keys entering take a place in a
    FIFO window of ``round(window * capacity)`` rows; a full window's oldest key, pushed out,
    stays only if it scores above the exact minimum of the keys outside the window. With
    ``once``, a resident's accesses at one tick count once. With ``as_cache`` (and ``batch``), a
    key hits only if resident when its batch began, and the batch's missed keys are placed after
    it, each once, highest estimate first (ties: the smaller key).
    """
    w_rows = max(1, round(window * capacity)) if window > 0 else 0
    fifo: list[int] = []  # the window's keys, oldest first
    width = 1
    while width < max(8 * capacity, 64):
        width *= 2
    sketch = [[0.0] * width for _ in range(4)]
    freq: dict[int, float] = {}
    last: dict[int, int] = {}

    def estimate(k: int, amount: float) -> float:
        cells = [rp.sketch_hash(k, r) % width for r in range(4)]
        est = min(sketch[r][c] for r, c in enumerate(cells)) + amount
        for r, c in enumerate(cells):
            sketch[r][c] = max(sketch[r][c], est)
        return est

    def place(k: int, est: float, inc: float, tick: int) -> None:
        if not capacity:
            return
        if len(freq) < capacity:
            freq[k], last[k] = est, tick
            if len(fifo) < w_rows:
                fifo.append(k)
            return

        def score(key: int) -> float:
            missed = freq[key] / inc * math.log(2.0) / halflife * (tick - last[key])
            return freq[key] * 2.0 ** (-missed / idle_halving)
        main = [key for key in freq if key not in fifo]
        victim = min(main, key=score) if main else None
        if w_rows and len(fifo) >= w_rows:
            pushed = fifo.pop(0)
            leaving = victim if victim is not None and score(pushed) > score(victim) else pushed
        elif victim is not None and est > score(victim):
            leaving = victim
        else:
            return
        vs = freq.pop(leaving)
        del last[leaving]
        for r in range(4):
            c = rp.sketch_hash(leaving, r) % width
            sketch[r][c] = max(sketch[r][c], vs)
        freq[k], last[k] = est, tick
        if len(fifo) < w_rows:
            fifo.append(k)

    hits = 0
    if as_cache:
        assert batch is not None
        for lo in range(0, len(trace), batch):
            tick, part = lo, trace[lo:lo + batch]
            inc = 2.0 ** (tick / halflife)
            missed: dict[int, float] = {}
            for k in part:
                if k in freq:
                    hits += 1
                    if not (once and last[k] == tick):
                        freq[k] += inc
                    last[k] = tick
                else:
                    missed[k] = inc if once else missed.get(k, 0.0) + inc
            ests = {k: estimate(k, amount) for k, amount in sorted(missed.items())}
            for k in sorted(ests, key=lambda key: (-ests[key], key)):
                place(k, ests[k], inc, tick)
        return hits
    for i, k in enumerate(trace):
        tick = i if batch is None else (i // batch) * batch
        inc = 2.0 ** (tick / halflife)
        if k in freq:
            hits += 1
            if not (once and last[k] == tick):
                freq[k] += inc
            last[k] = tick
            continue
        place(k, estimate(k, inc), inc, tick)
    return hits


@pytest.mark.parametrize(("window", "once"), [(0.0, False), (0.0, True), (0.25, True)])
def test_lrfu_as_cache_matches_brute_force(window: float, once: bool) -> None:
    # batches served as the cache serves lookups: hits only for rows resident at a batch's start
    total = 0
    for trace, capacity in CASES:
        sim = rp.LrfuSim(capacity, halflife=50.0, sample=None, window=window, once=once)
        bounds = np.arange(0, len(trace) + 7, 7).clip(max=len(trace))
        hits = int(sim.access_batches(trace, np.unique(bounds), as_cache=True).sum())
        want = brute_lrfu(trace.tolist(), capacity, 50.0, 7, window=window, once=once, as_cache=True)
        assert abs(hits - want) <= max(2, 0.02 * len(trace)), (trace, capacity)
        total += hits
    assert total > 0
    sim = rp.LrfuSim(4, halflife=50.0)  # a repeat of a missed key in its own batch never hits
    assert sim.access_batches(np.array([3, 3, 3]), np.array([0, 3]), as_cache=True).tolist() == [0]
    assert sim.access_batches(np.array([3, 3]), np.array([0, 2]), as_cache=True).tolist() == [2]


@pytest.mark.parametrize("batch", [None, 7])
def test_lrfu_matches_brute_force(batch: int | None) -> None:
    total = 0
    for trace, capacity in CASES:
        sim = rp.LrfuSim(capacity, halflife=50.0, sample=None)
        if batch is None:
            hits = sim.access(trace)
        else:
            hits = sum(sim.access(trace[i:i + batch], batch_ticks=len(trace[i:i + batch]))
                       for i in range(0, len(trace), batch))
        want = brute_lrfu(trace.tolist(), capacity, 50.0, batch)
        # equal scores (a batch shares one tick) tie, and the two break ties their own ways
        assert abs(hits - want) <= (0 if batch is None else max(2, 0.02 * len(trace))), (trace, capacity)
        total += hits
    assert total > 0
    trace = wl.zipf_trace(50_000, 5_000, 1.05, seed=9)
    assert rp.lrfu_hit_ratio(trace, 100) > rp.lru_hit_ratio(trace, 100)  # frequency beats recency on skew


@pytest.mark.parametrize(("window", "once", "batch"), [(0.1, False, None), (0.25, False, 7), (0.1, True, 7),
                                                      (0.0, True, 7)])
def test_lrfu_window_and_once_match_brute_force(window: float, once: bool, batch: int | None) -> None:
    total = 0
    for trace, capacity in CASES:
        sim = rp.LrfuSim(capacity, halflife=50.0, sample=None, window=window, once=once)
        if batch is None:
            hits = sim.access(trace)
        else:
            hits = sum(sim.access(trace[i:i + batch], batch_ticks=len(trace[i:i + batch]))
                       for i in range(0, len(trace), batch))
        want = brute_lrfu(trace.tolist(), capacity, 50.0, batch, window=window, once=once)
        assert abs(hits - want) <= (0 if batch is None else max(2, 0.02 * len(trace))), (trace, capacity)
        assert int(sim._rw.sum()) == int(sim._state[8]) <= int(sim._state[4])  # the window's count is true
        total += hits
    assert total > 0


def test_a_window_gives_recent_keys_a_place_that_admission_alone_refuses() -> None:
    # hot keys earn high frequencies; then a scan of new keys, each seen twice in a row. Admission
    # alone keeps every scanned key out (its estimate never beats a hot key's); a window of 10%
    # holds the latest of them, so their second access hits, and the hot keys stay in the main region
    hot = np.tile(np.arange(100, dtype=np.int64), 50)
    scan = np.repeat(np.arange(1_000, 3_000, dtype=np.int64), 2)
    plain = rp.LrfuSim(100, halflife=1e6, sample=None)
    windowed = rp.LrfuSim(100, halflife=1e6, sample=None, window=0.1)
    for sim in (plain, windowed):
        sim.access(hot)
    assert plain.access(scan) == 0 and windowed.access(scan) == scan.size // 2
    assert windowed.access(np.arange(100, dtype=np.int64)) >= 90  # the main region kept the hot keys


def test_once_counts_a_batchs_repeats_once() -> None:
    for once, want in ((False, 5.0), (True, 1.0)):
        sim = rp.LrfuSim(10, halflife=math.inf, sample=None, once=once)
        sim.access(np.array([7], dtype=np.int64), batch_ticks=1)  # enters with frequency 1
        sim.access(np.full(5, 7, dtype=np.int64), batch_ticks=5)  # five repeats in one batch
        assert sim._rf[0] == 1.0 + want


def test_retuning_the_window_starts_it_empty() -> None:
    sim = rp.LrfuSim(50, sample=None, window=0.2)
    sim.access(np.arange(200, dtype=np.int64))
    assert int(sim._state[8]) == 10
    sim.retune(1e4, 2.5, False, window=0.1)
    assert int(sim._state[8]) == 0 and not sim._rw.any() and int(sim._state[4]) == 5
    sim.access(np.arange(1_000, 1_100, dtype=np.int64))
    assert int(sim._rw.sum()) == int(sim._state[8]) == 5
    with pytest.raises(ValueError):
        rp.LrfuSim(10, window=1.0)


def test_sampled_lrfu_victims_stay_close_to_the_exact_minimum() -> None:
    # 64 sampled residents per victim (the default) against the exact minimum: measured within
    # 0.03 points on the policy benchmark's workloads; here a bursty trace at 1% and 4%
    trace = wl.bursty_trace(100_000, 20_000, seed=4)
    for capacity in (200, 800):
        exact = rp.LrfuSim(capacity, sample=None).access(trace)
        sampled = rp.LrfuSim(capacity).access(trace)
        assert abs(sampled - exact) <= 0.003 * len(trace), (capacity, sampled, exact)


def test_the_idle_discount_beats_plain_aged_frequency_on_bursts() -> None:
    # bursts of cold keys that end: the discount frees their slots, plain aged frequency keeps them
    trace = wl.bursty_trace(100_000, 20_000, seed=5)
    for capacity in (200, 800):
        with_discount = rp.LrfuSim(capacity).access(trace)
        plain = rp.LrfuSim(capacity, idle_halving=math.inf).access(trace)
        assert with_discount > plain + 0.005 * len(trace), (capacity, with_discount, plain)


def test_wtinylfu_batches_count_hits_from_the_batch_start() -> None:
    # 0 1 | 0 0: access 1 is a miss either way; in batches of 2, access 3 (key 0, cached during
    # batch 0) hits, but with key 2 entering mid-batch its repeat in the same batch does not
    trace = np.array([0, 1, 0, 0, 2, 2, 2, 1])
    assert rp.wtinylfu_hits(trace, 4) == 5  # sequential: 0, 0, 2, 2, 1 hit
    assert rp.wtinylfu_hits(trace, 4, batch=2) == 4  # batch [2, 2]: the second 2 came in the same batch
    assert rp.wtinylfu_hits(trace, 4, batch=len(trace)) == 0  # one batch: nothing was cached at its start
    zipf = wl.zipf_trace(20_000, 2_000, 1.05, seed=3)
    assert rp.wtinylfu_hits(zipf, 50, batch=256) < rp.wtinylfu_hits(zipf, 50)
    with pytest.raises(ValueError, match="batch"):
        rp.wtinylfu_hits(trace, 4, batch=0)


@pytest.mark.parametrize(
    ("fast", "brute"),
    [
        (rp.lru_hits, brute_lru),
        (rp.lfu_hits, brute_lfu),
        (rp.opt_hits, brute_opt),
        (rp.wtinylfu_hits, brute_wtinylfu),
    ],
    ids=["lru", "lfu", "opt", "wtinylfu"],
)
def test_simulator_matches_brute_force(
    fast: Callable[[np.ndarray, int], int], brute: Callable[[list[int], int], int]
) -> None:
    total_hits = 0
    for trace, capacity in CASES:
        hits = fast(trace, capacity)
        assert hits == brute(trace.tolist(), capacity), (trace, capacity)
        total_hits += hits
    assert total_hits > 0


@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
def test_wtinylfu_matches_brute_force_across_resets_and_climbs(adaptive: bool) -> None:
    # Long enough for several sketch halvings and climber samples (both every 10 * capacity
    # accesses), a multi-slot window, and a phase change that makes the climber turn.
    a = wl.scan_mix_trace(2500, 400, alpha=0.9, scan_fraction=0.2, scan_len=50, seed=3)
    b = wl.bursty_trace(2500, 2000, alpha=1.1, n_bursts=6, burst_len=400, burst_keys=30, seed=4)
    trace = np.concatenate([a, b + 10_000])
    climbed = False
    for capacity in (1, 37, 120, 250):
        got = rp.wtinylfu_hits(trace, capacity, adaptive=adaptive)
        assert got == brute_wtinylfu(trace.tolist(), capacity, adaptive=adaptive), capacity
        climbed |= got != rp.wtinylfu_hits(trace, capacity)
    assert climbed == adaptive  # the trace does make the climber move the window


def test_adaptive_climber_moves_the_window() -> None:
    # A recency-heavy trace: the static 1% window loses to LRU; growing the window helps.
    trace = wl.drifting_trace(200_000, 20_000, alpha=1.0, n_phases=40, drift=0.5, seed=6)
    static = rp.wtinylfu_hit_ratio(trace, 1000)
    adaptive = rp.wtinylfu_adaptive_hit_ratio(trace, 1000)
    assert adaptive > static + 0.005


def test_lfu_keeps_frequent_key_that_lru_drops() -> None:
    trace = np.array([1, 1, 1, 2, 3, 1, 4, 5, 1])
    assert rp.lfu_hits(trace, 2) == 4  # key 1 is never evicted
    assert rp.lru_hits(trace, 2) == 2  # scans of 2 new keys push key 1 out twice


def test_opt_bounds_every_policy() -> None:
    traces = [
        wl.zipf_trace(20_000, 2_000, 0.8, seed=1),
        wl.drifting_trace(20_000, 2_000, alpha=1.0, n_phases=5, seed=2),
        wl.bursty_trace(20_000, 2_000, alpha=0.9, n_bursts=10, burst_len=500, seed=3),
        wl.scan_mix_trace(20_000, 2_000, alpha=1.0, scan_len=200, seed=4),
    ]
    for trace in traces:
        for capacity in (5, 40, 200):
            best = rp.opt_hits(trace, capacity)
            for name, fn in rp.REFERENCE_POLICIES.items():
                assert fn(trace, capacity) * trace.size <= best + 1e-9, (name, capacity)


def test_wtinylfu_resists_scans() -> None:
    trace = wl.scan_mix_trace(50_000, 5_000, alpha=1.0, scan_fraction=0.3, scan_len=500, seed=5)
    for capacity in (50, 250):
        assert rp.wtinylfu_hit_ratio(trace, capacity) > rp.lru_hit_ratio(trace, capacity)


def test_edge_cases() -> None:
    empty = np.zeros(0, dtype=np.int64)
    for fn in rp.REFERENCE_POLICIES.values():
        assert fn(empty, 10) == 0.0
        assert fn(np.array([5, 5, 5]), 0) == 0.0
        assert fn(np.array([5, 5, 5]), 1) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="capacity"):
        rp.lru_hits(np.array([1, 2]), -1)
    with pytest.raises(ValueError, match="1-D integer"):
        rp.lru_hits(np.array([1.0, 2.0]), 1)
    curve = rp.hit_ratio_curve(rp.lru_hit_ratio, np.array([1, 2, 1, 2]), [0, 1, 2])
    np.testing.assert_allclose(curve, [0.0, 0.0, 0.5])


# ---------------------------------------------------------------------------------------------
# Workloads


def test_workloads_are_seeded_and_in_range() -> None:
    makers = {
        "zipf": lambda s: wl.zipf_trace(5000, 1000, 0.8, seed=s),
        "drift": lambda s: wl.drifting_trace(5000, 1000, seed=s),
        "bursty": lambda s: wl.bursty_trace(5000, 1000, n_bursts=5, seed=s),
        "scan": lambda s: wl.scan_mix_trace(5000, 1000, seed=s),
    }
    for name, make in makers.items():
        a, b, c = make(7), make(7), make(8)
        assert a.dtype == np.int64 and a.shape == (5000,), name
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c), name
        assert a.min() >= 0, name
        if name != "scan":
            assert a.max() < 1000, name


def test_zipf_trace_follows_the_law() -> None:
    alpha, n_keys = 0.8, 100
    trace = wl.zipf_trace(200_000, n_keys, alpha, seed=0)
    freq = np.sort(np.bincount(trace, minlength=n_keys))[::-1] / trace.size
    expected = np.arange(1, n_keys + 1) ** -alpha
    expected /= expected.sum()
    np.testing.assert_allclose(freq[:10], expected[:10], rtol=0.05)


def test_drifting_trace_replaces_hot_keys() -> None:
    trace = wl.drifting_trace(40_000, 1000, alpha=1.2, n_phases=4, hot_fraction=0.05, drift=0.5)
    first, last = trace[:10_000], trace[-10_000:]
    top_first = set(np.argsort(np.bincount(first, minlength=1000))[-20:].tolist())
    top_last = set(np.argsort(np.bincount(last, minlength=1000))[-20:].tolist())
    assert len(top_first & top_last) < 15


def test_scan_keys_are_one_hit_wonders() -> None:
    trace = wl.scan_mix_trace(10_000, 500, scan_fraction=0.5, scan_len=100, seed=1)
    scans = trace[trace >= 500]
    assert scans.size > 1000
    assert np.unique(scans).size == scans.size
