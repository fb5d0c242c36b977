"""Exact sequential cache simulators: the reference policies embcache is measured against (and sized with).

Each simulator replays a key trace (1-D integer array, one entry per access) through a cache
that holds at most ``capacity`` keys and counts hits. The reference policies below are exact (no
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
- ``OPT``: Belady's MIN with bypass, the offline optimum and so an upper bound for all others.

All policies are demand-fetch: only the accessed key can enter the cache, on a miss. Keys are
arbitrary int64 values; they are remapped to dense ids before simulation.

References:
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

import numba
import numpy as np

from ._bits import M1, M2, next_pow2
from .policy import DEFAULT_IDLE_HALVING, default_halflife

__all__ = [
    "REFERENCE_POLICIES",
    "SKETCH_SEEDS",
    "HitRatioFn",
    "LrfuSim",
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

# Per-row seeds of the count-min sketch (the constants of Caffeine 2.x's FrequencySketch).
SKETCH_SEEDS = np.array(
    [0xC3A5C85C97CB3127, 0xB492B66FBE98F273, 0x9AE16A3B2F90404F, 0xCBF29CE484222325],
    dtype=np.uint64,
)
_SKETCH_DEPTH = 4
_COUNTER_MAX = 15  # 4-bit counters
_MIX_C1 = np.uint64(M1)
_MIX_C2 = np.uint64(M2)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
# Caffeine's hill climber (BoundedLocalCache): step 6.25% of the capacity, restart the step when
# the hit rate moves by 5 points, otherwise decay it by 0.98; at most 1000 rows moved at a time.
_CLIMB_STEP = 0.0625
_CLIMB_RESTART = 0.05
_CLIMB_DECAY = 0.98
_TRANSFER_LIMIT = 1000


# ---------------------------------------------------------------------------------------------
# Input handling


def _dense(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate ``trace``; return its keys as dense ids ``0 .. n_ids-1`` and the sorted keys."""
    keys = np.asarray(trace)
    if keys.ndim != 1 or not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"trace must be a 1-D integer array, got {keys.dtype} of shape {keys.shape}")
    uniq, inverse = np.unique(keys, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64, copy=False), uniq


def _check_capacity(capacity: int) -> int:
    cap = int(capacity)
    if cap != capacity or cap < 0:
        raise ValueError(f"capacity must be a non-negative integer, got {capacity!r}")
    return cap


# ---------------------------------------------------------------------------------------------
# Intrusive circular doubly linked lists over arrays. Node ``s`` (a sentinel) heads a list;
# nxt[s] is its LRU end, prv[s] its MRU end.


@numba.njit(cache=True)
def _init_list(prv: np.ndarray, nxt: np.ndarray, s: int) -> None:
    prv[s] = s
    nxt[s] = s


@numba.njit(cache=True)
def _unlink(prv: np.ndarray, nxt: np.ndarray, k: int) -> None:
    p = prv[k]
    n = nxt[k]
    nxt[p] = n
    prv[n] = p


@numba.njit(cache=True)
def _push_mru(prv: np.ndarray, nxt: np.ndarray, s: int, k: int) -> None:
    last = prv[s]
    nxt[last] = k
    prv[k] = last
    nxt[k] = s
    prv[s] = k


# ---------------------------------------------------------------------------------------------
# LRU


@numba.njit(cache=True)
def _lru_kernel(ids: np.ndarray, n_ids: int, capacity: int) -> int:
    s = n_ids
    prv = np.empty(n_ids + 1, dtype=np.int64)
    nxt = np.empty(n_ids + 1, dtype=np.int64)
    cached = np.zeros(n_ids, dtype=np.bool_)
    _init_list(prv, nxt, s)
    size = 0
    hits = 0
    for k in ids:
        if cached[k]:
            hits += 1
            _unlink(prv, nxt, k)
            _push_mru(prv, nxt, s, k)
        elif capacity > 0:
            if size == capacity:
                victim = nxt[s]
                _unlink(prv, nxt, victim)
                cached[victim] = False
                size -= 1
            _push_mru(prv, nxt, s, k)
            cached[k] = True
            size += 1
    return hits


def lru_hits(trace: np.ndarray, capacity: int) -> int:
    """Hits of an LRU cache of ``capacity`` keys over ``trace``.

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
    return int(_lru_kernel(ids, n_ids, cap))


# ---------------------------------------------------------------------------------------------
# LFU: O(1) frequency buckets (one LRU list per count), the minimum count tracked.


@numba.njit(cache=True)
def _lfu_kernel(ids: np.ndarray, n_ids: int, max_count: int, capacity: int) -> int:
    # Node n_ids + c heads the list of cached keys with count c (1 <= c <= max_count). A key
    # enters list c at the access that gives it count c, so each list is in recency order and
    # its LRU end is the LRU key among those with that count.
    base = n_ids
    prv = np.empty(n_ids + max_count + 1, dtype=np.int64)
    nxt = np.empty(n_ids + max_count + 1, dtype=np.int64)
    for c in range(max_count + 1):
        _init_list(prv, nxt, base + c)
    count = np.zeros(n_ids, dtype=np.int64)  # 0 = not cached
    size = 0
    min_count = 0
    hits = 0
    for k in ids:
        c = count[k]
        if c > 0:
            hits += 1
            _unlink(prv, nxt, k)
            if c == min_count and nxt[base + c] == base + c:
                min_count = c + 1
            count[k] = c + 1
            _push_mru(prv, nxt, base + c + 1, k)
        elif capacity > 0:
            if size == capacity:
                victim = nxt[base + min_count]
                _unlink(prv, nxt, victim)
                count[victim] = 0
                size -= 1
            count[k] = 1
            _push_mru(prv, nxt, base + 1, k)
            size += 1
            min_count = 1
    return hits


def lfu_hits(trace: np.ndarray, capacity: int) -> int:
    """Hits of an admission-free LFU cache of ``capacity`` keys over ``trace``.

    A key's count is the number of its accesses since it was last inserted (in-cache LFU). On a
    miss with the cache full, the key with the smallest count is evicted, the least recently
    used of those on a tie, and the missed key is always inserted with count 1.

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
    max_count = int(np.bincount(ids).max()) if ids.size else 0
    return int(_lfu_kernel(ids, n_ids, max_count, cap))


# ---------------------------------------------------------------------------------------------
# OPT (Belady's MIN with bypass)


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


# ---------------------------------------------------------------------------------------------
# W-TinyLFU


def sketch_hash(key: int, row: int) -> int:
    """Hash of ``key`` for row ``row`` of the count-min sketch (pure Python, for tests/docs).

    ``key`` is taken as its 64-bit two's complement; the hash is ``mix64(key ^ SKETCH_SEEDS[row])``
    with splitmix64's finalizer, and the counter index is that hash modulo the (power-of-two)
    row width.
    """
    mask = (1 << 64) - 1
    x = (key & mask) ^ int(SKETCH_SEEDS[row])
    x ^= x >> 30
    x = (x * M1) & mask
    x ^= x >> 27
    x = (x * M2) & mask
    x ^= x >> 31
    return x


def _sketch_slots(raw_keys: np.ndarray, width: int) -> np.ndarray:
    """Counter index [row, i] of the i-th key (uint64) in each sketch row (vectorized mix64)."""
    x = raw_keys[None, :] ^ SKETCH_SEEDS[:, None]  # uint64 arithmetic wraps, as intended
    x ^= x >> _S30
    x *= _MIX_C1
    x ^= x >> _S27
    x *= _MIX_C2
    x ^= x >> _S31
    return (x & np.uint64(width - 1)).astype(np.int64)


@numba.njit(cache=True)
def _sketch_estimate(table: np.ndarray, slots: np.ndarray, k: int) -> int:
    est = _COUNTER_MAX
    for r in range(_SKETCH_DEPTH):
        c = table[r, slots[r, k]]
        if c < est:
            est = c
    return est


@numba.njit(cache=True)
def _wtinylfu_kernel(
    ids: np.ndarray,
    slots: np.ndarray,
    width: int,
    n_ids: int,
    capacity: int,
    max_window: int,
    max_protected: int,
    sample_size: int,
    adaptive: bool,
    batch: int,
) -> int:
    none_, window, probation, protected = 0, 1, 2, 3
    s_window, s_probation, s_protected = n_ids, n_ids + 1, n_ids + 2
    prv = np.empty(n_ids + 3, dtype=np.int64)
    nxt = np.empty(n_ids + 3, dtype=np.int64)
    _init_list(prv, nxt, s_window)
    _init_list(prv, nxt, s_probation)
    _init_list(prv, nxt, s_protected)
    status = np.zeros(n_ids, dtype=np.int8)
    entered = np.zeros(n_ids, dtype=np.int64)  # access index at which the key last entered the cache
    table = np.zeros((_SKETCH_DEPTH, width), dtype=np.uint8)
    additions = 0
    window_size = 0
    protected_size = 0
    size = 0
    hits = 0
    # hill climber state (Caffeine's BoundedLocalCache.climb)
    sample_hits = 0
    sample_misses = 0
    prev_hit_rate = 0.0
    step = -_CLIMB_STEP * capacity
    adjustment = 0
    for i in range(ids.shape[0]):
        k = ids[i]
        # Record the access in the frequency sketch (Caffeine records hits and misses alike).
        added = False
        for r in range(_SKETCH_DEPTH):
            j = slots[r, k]
            if table[r, j] < _COUNTER_MAX:
                table[r, j] += 1
                added = True
        if added:
            additions += 1
            if additions >= sample_size:
                # Aging: halve every counter. The odd counters each lost half a count; an
                # addition touched 4 counters, hence Caffeine's (size - odd/4) / 2.
                odd = 0
                for r in range(_SKETCH_DEPTH):
                    for j in range(width):
                        c = table[r, j]
                        odd += c & 1
                        table[r, j] = c >> 1
                additions = (additions - (odd >> 2)) >> 1

        st = status[k]
        # a hit needs the key cached when its batch began (batch 1: any earlier access)
        hit = st != none_ and entered[k] < i - i % batch
        if st == window:
            _unlink(prv, nxt, k)
            _push_mru(prv, nxt, s_window, k)
        elif st == probation:
            _unlink(prv, nxt, k)
            _push_mru(prv, nxt, s_protected, k)
            status[k] = protected
            protected_size += 1
            if protected_size > max_protected:
                demoted = nxt[s_protected]
                _unlink(prv, nxt, demoted)
                _push_mru(prv, nxt, s_probation, demoted)
                status[demoted] = probation
                protected_size -= 1
        elif st == protected:
            _unlink(prv, nxt, k)
            _push_mru(prv, nxt, s_protected, k)
        elif capacity > 0:
            _push_mru(prv, nxt, s_window, k)
            status[k] = window
            entered[k] = i
            window_size += 1
            size += 1
            while window_size > max_window:
                candidate = nxt[s_window]
                _unlink(prv, nxt, candidate)
                window_size -= 1
                _push_mru(prv, nxt, s_probation, candidate)
                status[candidate] = probation
                if size > capacity:
                    victim = nxt[s_probation]
                    evict = candidate
                    if victim != candidate and _sketch_estimate(table, slots, candidate) > _sketch_estimate(
                        table, slots, victim
                    ):
                        evict = victim
                    _unlink(prv, nxt, evict)
                    status[evict] = none_
                    size -= 1
        if hit:
            hits += 1
        if not adaptive:
            continue

        # Hill climbing: every sample_size requests, move the window/main split by a step in
        # the direction that last improved the hit rate (Einziger et al., Middleware 2018).
        if hit:
            sample_hits += 1
        else:
            sample_misses += 1
        requests = sample_hits + sample_misses
        if requests >= sample_size:
            hit_rate = sample_hits / requests
            change = hit_rate - prev_hit_rate
            amount = step if change >= 0 else -step
            if abs(change) >= _CLIMB_RESTART:
                step = _CLIMB_STEP * capacity * (1.0 if amount >= 0 else -1.0)
            else:
                step = _CLIMB_DECAY * amount
            prev_hit_rate = hit_rate
            adjustment = int(amount)
            sample_hits = 0
            sample_misses = 0
        # demoteFromMainProtected
        moved = 0
        while protected_size > max_protected and moved < _TRANSFER_LIMIT:
            demoted = nxt[s_protected]
            _unlink(prv, nxt, demoted)
            _push_mru(prv, nxt, s_probation, demoted)
            status[demoted] = probation
            protected_size -= 1
            moved += 1
        if adjustment > 0 and max_protected > 0:
            # increaseWindow: main's LRU rows (probation first) move to the window's MRU end
            quota = min(adjustment, max_protected)
            max_protected -= quota
            max_window += quota
            moved = 0
            while protected_size > max_protected and moved < _TRANSFER_LIMIT:
                demoted = nxt[s_protected]
                _unlink(prv, nxt, demoted)
                _push_mru(prv, nxt, s_probation, demoted)
                status[demoted] = probation
                protected_size -= 1
                moved += 1
            for _ in range(_TRANSFER_LIMIT):
                if quota == 0:
                    break
                node = nxt[s_probation]
                if node == s_probation:
                    node = nxt[s_protected]
                    if node == s_protected:
                        break
                    protected_size -= 1
                quota -= 1
                _unlink(prv, nxt, node)
                _push_mru(prv, nxt, s_window, node)
                status[node] = window
                window_size += 1
            max_protected += quota
            max_window -= quota
            adjustment = quota
        elif adjustment < 0 and max_window > 1:
            # decreaseWindow: the window's LRU rows move to probation's MRU end
            quota = min(-adjustment, max_window - 1)
            max_protected += quota
            max_window -= quota
            for _ in range(_TRANSFER_LIMIT):
                node = nxt[s_window]
                if quota == 0 or node == s_window:
                    break
                quota -= 1
                _unlink(prv, nxt, node)
                _push_mru(prv, nxt, s_probation, node)
                status[node] = probation
                window_size -= 1
            max_protected -= quota
            max_window += quota
            adjustment = -quota
    return hits


def wtinylfu_hits(
    trace: np.ndarray,
    capacity: int,
    window_fraction: float = 0.01,
    protected_fraction: float = 0.8,
    sample_factor: int = 10,
    adaptive: bool = False,
    batch: int = 1,
) -> int:
    """Hits of a W-TinyLFU cache (Caffeine's eviction policy) of ``capacity`` keys.

    The design of Einziger, Friedman & Manes (TinyLFU, 2017) as Caffeine implements it. By
    default the configuration is static, as in Caffeine's simulator ``WindowTinyLfuPolicy``;
    ``adaptive=True`` adds the hill climber of Caffeine's ``BoundedLocalCache`` (Einziger et
    al., "Adaptive Software Cache Management", Middleware 2018), which resizes the window:

    - A window LRU of ``capacity - floor(capacity * (1 - window_fraction))`` keys (1%) takes
      every missed key.
    - The main space (the rest) is a segmented LRU: a protected segment of
      ``floor(main * protected_fraction)`` keys (80%) and a probation segment. A hit in
      probation promotes to protected MRU; protected overflow demotes its LRU key to probation
      MRU.
    - When the window overflows, its LRU key (the candidate) moves to probation; if the cache is
      then over capacity, the candidate and probation's LRU key (the victim) are compared by
      their sketch estimates and the candidate stays only if its estimate is strictly larger
      (Caffeine's extra 1/128 random admission of warm candidates, a hash-flooding defence,
      is left out to keep the simulation deterministic).
    - Frequencies come from a count-min sketch recording every access: 4 rows of 4-bit
      saturating counters, each row ``4 * max(next_pow2(capacity), 8)`` counters wide (the
      counter count of Caffeine's ``FrequencySketch``), estimate = the minimum over rows. After
      ``sample_factor * capacity`` counted additions every counter is halved (aging). No
      doorkeeper (Caffeine has none).
    - Adaptive only: every ``sample_factor * capacity`` requests the hit rate of the sample is
      compared with the previous one and the window grows or shrinks (taking from or giving
      to the protected quota) by a step that starts at -6.25% of the capacity, keeps its
      direction while the hit rate does not drop, restarts at 6.25% when the hit rate moves
      by 5 points and otherwise decays by 0.98; at most 1000 keys move per adjustment, the
      rest is carried to the next access (Caffeine's ``climb``, run after every access).

    Args:
        trace: 1-D integer array of keys, one per access.
        capacity: cache size in keys (>= 0).
        window_fraction: share of the capacity given to the window, in ``[0, 1)``.
        protected_fraction: share of the main space given to the protected segment, in
            ``[0, 1]``.
        sample_factor: sketch additions between halvings, per unit of capacity (>= 1); also
            the climber's sample of requests.
        adaptive: resize the window by hill climbing (Caffeine's cache) instead of keeping
            ``window_fraction``.
        batch: count an access as a hit only if its key was cached when the access's batch
            (consecutive runs of ``batch`` accesses) began, as a cache serving whole batches
            counts them (a key missed earlier in the same batch is still being fetched); the
            policy itself runs access by access either way. 1 (default): every access is its
            own batch.

    Returns:
        The number of accesses that found their key cached.

    Raises:
        ValueError: on a bad trace, a negative capacity or a fraction/factor out of range.
    """
    cap = _check_capacity(capacity)
    if not 0.0 <= window_fraction < 1.0:
        raise ValueError(f"window_fraction must be in [0, 1), got {window_fraction}")
    if not 0.0 <= protected_fraction <= 1.0:
        raise ValueError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
    if sample_factor < 1:
        raise ValueError(f"sample_factor must be >= 1, got {sample_factor}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    ids, uniq = _dense(trace)
    n_ids = int(uniq.size)
    raw = uniq.astype(np.int64).view(np.uint64)
    width = 4 * max(next_pow2(cap), 8)
    slots = _sketch_slots(raw, width)
    max_main = int(cap * (1.0 - window_fraction))
    max_window = cap - max_main
    max_protected = int(max_main * protected_fraction)
    sample_size = sample_factor * max(cap, 1)
    return int(_wtinylfu_kernel(ids, slots, width, n_ids, cap, max_window, max_protected, sample_size, bool(adaptive),
                                int(batch)))


# ---------------------------------------------------------------------------------------------
# Hit ratios


def _ratio(hits: int, trace: np.ndarray) -> float:
    n = int(np.asarray(trace).size)
    return hits / n if n else 0.0


def lru_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`lru_hits`."""
    return _ratio(lru_hits(trace, capacity), trace)


def lfu_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`lfu_hits`."""
    return _ratio(lfu_hits(trace, capacity), trace)


def opt_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`opt_hits`."""
    return _ratio(opt_hits(trace, capacity), trace)


def wtinylfu_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`wtinylfu_hits` (static window)."""
    return _ratio(wtinylfu_hits(trace, capacity), trace)


def wtinylfu_adaptive_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`wtinylfu_hits` with the hill climber."""
    return _ratio(wtinylfu_hits(trace, capacity, adaptive=True), trace)


REFERENCE_POLICIES: dict[str, HitRatioFn] = {
    "LRU": lru_hit_ratio,
    "LFU": lfu_hit_ratio,
    "W-TinyLFU": wtinylfu_hit_ratio,
    "W-TinyLFU-adaptive": wtinylfu_adaptive_hit_ratio,
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


# ---------------------------------------------------------------------------------------------
# embcache's own policy (LRFU with admission), exact and incremental


_RENORM = 2.0**40


@numba.njit(cache=True, nogil=True, inline="always")
def _lrfu_cell(key: int, row: int, mask: int) -> int:
    x = np.uint64(key) ^ SKETCH_SEEDS_NB[row]
    x ^= x >> np.uint64(30)
    x *= _MIX_C1
    x ^= x >> np.uint64(27)
    x *= _MIX_C2
    x ^= x >> np.uint64(31)
    return np.int64(x & np.uint64(mask))


SKETCH_SEEDS_NB = SKETCH_SEEDS.copy()


# Key -> heap position of a shadow: open addressing with linear probing in an int64 [T, 2] array
# of (key, position) pairs, T = next_pow2(2 x capacity), position -1 = empty (any int64 is a key).
# A numba typed Dict did the same at ~4x the cost: a heap swap writes two positions, and a sift
# does up to log2(capacity) swaps, so these writes were most of a shadow's time per access.


@numba.njit(cache=True, nogil=True, inline="always")
def _pos_home(key: int, mask: int) -> int:
    x = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
    return np.int64((x ^ (x >> np.uint64(29))) & np.uint64(mask))


@numba.njit(cache=True, nogil=True, inline="always")
def _pos_find(pos: np.ndarray, key: int) -> int:
    """Entry of ``key`` in ``pos``, or -1."""
    mask = pos.shape[0] - 1
    j = _pos_home(key, mask)
    while pos[j, 1] >= 0:
        if pos[j, 0] == key:
            return j
        j = (j + 1) & mask
    return -1


@numba.njit(cache=True, nogil=True, inline="always")
def _pos_put(pos: np.ndarray, key: int, value: int) -> None:
    mask = pos.shape[0] - 1
    j = _pos_home(key, mask)
    while pos[j, 1] >= 0 and pos[j, 0] != key:
        j = (j + 1) & mask
    pos[j, 0] = key
    pos[j, 1] = value


@numba.njit(cache=True, nogil=True)
def _pos_delete(pos: np.ndarray, key: int) -> None:
    """Remove ``key``; the rest of its cluster shifts back (no tombstones)."""
    mask = pos.shape[0] - 1
    j = _pos_find(pos, key)
    if j < 0:
        return
    pos[j, 1] = -1
    i = j
    while True:
        i = (i + 1) & mask
        if pos[i, 1] < 0:
            return
        # the entry at i may fill the hole at j iff j lies on its probe path (home .. i)
        if ((i - _pos_home(pos[i, 0], mask)) & mask) >= ((i - j) & mask):
            pos[j, 0] = pos[i, 0]
            pos[j, 1] = pos[i, 1]
            pos[i, 1] = -1
            j = i


_LN2 = float(np.log(2.0))


@numba.njit(cache=True, nogil=True, inline="always")
def _xorshift(rng: np.ndarray) -> int:
    """The next value of a xorshift64* generator whose state is ``rng[0]`` (non-zero uint64)."""
    x = rng[0]
    x ^= x >> np.uint64(12)
    x ^= x << np.uint64(25)
    x ^= x >> np.uint64(27)
    rng[0] = x
    return np.int64((x * np.uint64(0x2545F4914F6CDD1D)) >> np.uint64(1))


@numba.njit(cache=True, nogil=True)
def _lrfu_victim(rf: np.ndarray, rl: np.ndarray, size: int, sample: int, now: float, a: float,
                 rng: np.ndarray) -> tuple[int, float]:
    """(index, log score) of the lowest-scored of ``sample`` random residents (all when ``sample``
    is 0 or at least ``size``); log score = log(freq) - a * freq * idle (see embcache.policy)."""
    n = size if sample <= 0 or sample >= size else sample
    best, best_i = np.inf, -1
    for j in range(n):
        i = j if n == size else _xorshift(rng) % size
        ls = np.log(rf[i]) - a * rf[i] * (now - rl[i])
        if ls < best:
            best, best_i = ls, i
    return best_i, best


@numba.njit(cache=True, nogil=True)
def _lrfu_kernel(keys: np.ndarray, tick_each: bool, batch_ticks: int, clock: np.ndarray, rk: np.ndarray,
                 rf: np.ndarray, rl: np.ndarray, pos: np.ndarray, state: np.ndarray, sketch: np.ndarray,
                 admission: bool, rng: np.ndarray) -> int:
    """Replay ``keys`` through an LRFU cache with the idle discount; returns the hits.

    ``clock`` = [now, t0, halflife, idle_halving] (ticks); ``state`` = [size, capacity, sample].
    Residents are ``rk`` (keys), ``rf`` (aged frequencies) and ``rl`` (last-access ticks) at
    ``[0, size)``; ``pos`` maps a key to its index. With ``tick_each`` every key advances the
    clock by one tick; otherwise the whole batch shares one tick and increment and the clock
    then advances by ``batch_ticks`` (what the cache does per lookup).
    """
    size, cap, sample = state[0], state[1], state[2]
    mask = sketch.shape[1] - 1
    hits = 0
    now = clock[0]
    inc = 2.0 ** ((clock[0] - clock[1]) / clock[2])
    for i in range(keys.shape[0]):
        k = keys[i]
        if tick_each:
            now = clock[0]
            inc = 2.0 ** ((clock[0] - clock[1]) / clock[2])
        e = _pos_find(pos, k)
        if e >= 0:
            idx = pos[e, 1]
            hits += 1
            rf[idx] += inc
            rl[idx] = now
        else:
            # conservative update, as the cache's FrequencySketch: raise the key's counters to min + inc
            est = np.inf
            for r in range(4):
                c = _lrfu_cell(k, r, mask)
                if sketch[r, c] < est:
                    est = sketch[r, c]
            est += inc
            for r in range(4):
                c = _lrfu_cell(k, r, mask)
                if sketch[r, c] < est:
                    sketch[r, c] = est
            if cap > 0:
                if size < cap:
                    v = size
                    size += 1
                else:
                    a = 0.0
                    if np.isfinite(clock[2]) and np.isfinite(clock[3]):
                        a = _LN2 * _LN2 / (clock[2] * clock[3] * inc)
                    v, vls = _lrfu_victim(rf, rl, size, sample, now, a, rng)
                    if admission and not np.log(est) > vls:
                        v = -1
                    else:
                        vk, vs = rk[v], rf[v]
                        _pos_delete(pos, vk)
                        for r in range(4):
                            c = _lrfu_cell(vk, r, mask)
                            if sketch[r, c] < vs:
                                sketch[r, c] = vs
                if v >= 0:
                    rk[v] = k
                    rf[v] = est
                    rl[v] = now
                    _pos_put(pos, k, v)
        if tick_each:
            clock[0] += 1.0
            if 2.0 ** ((clock[0] - clock[1]) / clock[2]) >= _RENORM:
                f = 1.0 / 2.0 ** ((clock[0] - clock[1]) / clock[2])
                rf[:size] *= f
                sketch *= f
                clock[1] = clock[0]
    if not tick_each:
        clock[0] += batch_ticks
        if 2.0 ** ((clock[0] - clock[1]) / clock[2]) >= _RENORM:
            f = 1.0 / 2.0 ** ((clock[0] - clock[1]) / clock[2])
            rf[:size] *= f
            sketch *= f
            clock[1] = clock[0]
    state[0] = size
    return hits


@numba.njit(cache=True, nogil=True)
def _lrfu_batches(keys: np.ndarray, bounds: np.ndarray, clock: np.ndarray, rk: np.ndarray, rf: np.ndarray,
                  rl: np.ndarray, pos: np.ndarray, state: np.ndarray, sketch: np.ndarray, admission: bool,
                  rng: np.ndarray, hits: np.ndarray) -> None:
    """:func:`_lrfu_kernel` over consecutive batches ``keys[bounds[b]:bounds[b + 1]]`` in one call.

    Each batch shares one tick and increment and then moves the clock by its length; ``hits[b]``
    gets its hits.
    """
    for b in range(bounds.shape[0] - 1):
        lo, hi = bounds[b], bounds[b + 1]
        hits[b] = _lrfu_kernel(keys[lo:hi], False, hi - lo, clock, rk, rf, rl, pos, state, sketch, admission, rng)


class LrfuSim:
    """embcache's default policy (``lrfu`` with admission and the idle discount) as an incremental simulator.

    The score of a resident is its aged frequency discounted by the accesses it is estimated to
    have missed (:mod:`embcache.policy`). As in the cache, the victim of a miss is the
    lowest-scored of ``sample`` random residents, and rows outside the cache keep their aged
    frequency in a count-min sketch eight times the capacity wide with conservative update. It
    runs one tier.

    The discount makes a score depend on the time, so no heap keeps the residents in score order;
    a sampled victim costs O(sample) per miss instead of a scan of every resident. Measured
    against the exact minimum (``sample=None``) on the six workloads of bench/bench_policy.py at
    0.25%, 1% and 4% of 100k keys: 64 samples change the hit ratio by at most 0.03 points, 16
    (the cache's factor per victim) by at most 0.15.

    Args:
        capacity: keys the cache holds.
        halflife: ticks after which an access counts half; None = the cache's default (40x the
            capacity), ``math.inf`` = plain LFU with admission.
        admission: a new key displaces the victim only if its frequency is higher.
        idle_halving: missed accesses that halve a score (``math.inf``: no discount).
        sample: residents considered per victim; None = all of them (the exact minimum).
        seed: seed of the sampling.
    """

    def __init__(self, capacity: int, halflife: float | None = None, admission: bool = True,
                 idle_halving: float = DEFAULT_IDLE_HALVING, sample: int | None = 64, seed: int = 1) -> None:
        cap = _check_capacity(capacity)
        if not idle_halving > 0:
            raise ValueError(f"idle_halving must be > 0, got {idle_halving}")
        if sample is not None and sample < 1:
            raise ValueError(f"sample must be None or >= 1, got {sample}")
        self.capacity = cap
        hl = halflife if halflife is not None else default_halflife(cap)
        self._clock = np.array([0.0, 0.0, hl, float(idle_halving)])
        self._rk = np.zeros(max(cap, 1), dtype=np.int64)
        self._rf = np.zeros(max(cap, 1), dtype=np.float64)
        self._rl = np.zeros(max(cap, 1), dtype=np.float64)
        self._pos = np.zeros((next_pow2(max(2 * cap, 16)), 2), dtype=np.int64)
        self._pos[:, 1] = -1
        self._state = np.array([0, cap, sample or 0], dtype=np.int64)
        self._sketch = np.zeros((4, next_pow2(max(8 * cap, 64))), dtype=np.float64)
        self._admission = admission
        self._rng = np.array([(seed * 0x9E3779B97F4A7C15 + 1) % (1 << 64) or 1], dtype=np.uint64)

    def access(self, keys: np.ndarray, batch_ticks: int | None = None) -> int:
        """Replay ``keys`` (int64 [n]); returns how many hit.

        Args:
            keys: the accesses, in order.
            batch_ticks: None = one tick per key (a sequential trace); otherwise all keys share
                the current tick and increment and the clock then moves ``batch_ticks`` on (a
                sampled batch).
        """
        k = np.ascontiguousarray(keys, dtype=np.int64)
        return int(_lrfu_kernel(k, batch_ticks is None, int(batch_ticks or 0), self._clock, self._rk, self._rf,
                                self._rl, self._pos, self._state, self._sketch, self._admission, self._rng))

    def access_batches(self, keys: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Replay sampled batches ``keys[bounds[b]:bounds[b + 1]]`` as ``access(batch, len(batch))`` each.

        One call for many batches (the per-call cost of a shadow is what the miss-ratio
        estimator pays per batch). Returns the hits of each batch, int64 [len(bounds) - 1].
        """
        k = np.ascontiguousarray(keys, dtype=np.int64)
        b = np.ascontiguousarray(bounds, dtype=np.int64)
        hits = np.zeros(max(b.shape[0] - 1, 0), dtype=np.int64)
        _lrfu_batches(k, b, self._clock, self._rk, self._rf, self._rl, self._pos, self._state, self._sketch,
                      self._admission, self._rng, hits)
        return hits

    def __len__(self) -> int:
        return int(self._state[0])


def lrfu_hits(trace: np.ndarray, capacity: int, halflife: float | None = None, sample: int | None = 64) -> int:
    """Hits of :class:`LrfuSim` (embcache's ``lrfu`` policy) replaying ``trace`` one access per tick."""
    keys = np.asarray(trace)
    if keys.ndim != 1 or not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"trace must be a 1-D integer array, got {keys.dtype} of shape {keys.shape}")
    return LrfuSim(capacity, halflife, sample=sample).access(keys.astype(np.int64, copy=False))


def lrfu_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`lrfu_hits`."""
    return _ratio(lrfu_hits(trace, capacity), trace)
