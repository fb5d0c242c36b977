"""LRU, LFU and W-TinyLFU: the exact simulators built on intrusive linked lists over arrays.

Each keeps its cached keys (as dense ids) in circular doubly linked lists, so that an access is
O(1): one recency list for LRU, one list per access count for LFU, and the window, probation and
protected segments for W-TinyLFU, whose count-min sketch (:data:`SKETCH_SEEDS`,
:func:`sketch_hash`) is here too. The list helpers are numba functions the kernels call, kept in
this module: numba's disk cache (``cache=True``) notices changes to a kernel's own source file,
not to a callee's in another module.
"""

from __future__ import annotations

import numba
import numpy as np

from .._bits import M1, M2, next_pow2
from .trace import _check_capacity, _dense, _ratio

# Per-row seeds of the count-min sketch (the constants of Caffeine 2.x's FrequencySketch). LrfuSim's
# kernel (lrfu.py) has them compiled in; its numba disk cache sees changes to lrfu.py only, so a
# change here must clear embcache/sim/__pycache__ too.
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


def _check_batch(batch: int) -> int:
    if int(batch) != batch or batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return int(batch)


# ---------------------------------------------------------------------------------------------
# LRU


@numba.njit(cache=True)
def _lru_kernel(ids: np.ndarray, n_ids: int, capacity: int, batch: int) -> int:
    s = n_ids
    prv = np.empty(n_ids + 1, dtype=np.int64)
    nxt = np.empty(n_ids + 1, dtype=np.int64)
    cached = np.zeros(n_ids, dtype=np.bool_)
    entered = np.zeros(n_ids, dtype=np.int64)  # access index at which each key was last inserted
    _init_list(prv, nxt, s)
    size = 0
    hits = 0
    for i in range(ids.shape[0]):
        k = ids[i]
        if cached[k]:
            if entered[k] < i - i % batch:  # cached when its batch began (batch 1: any earlier access)
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
            entered[k] = i
            size += 1
    return hits


def lru_hits(trace: np.ndarray, capacity: int, batch: int = 1) -> int:
    """Hits of an LRU cache of ``capacity`` keys over ``trace``.

    Args:
        trace: 1-D integer array of keys, one per access.
        capacity: cache size in keys (>= 0).
        batch: count a hit only if the key was cached when its batch of ``batch`` accesses
            began (see :func:`wtinylfu_hits`); 1 = every access is its own batch.

    Returns:
        The number of accesses that found their key cached.

    Raises:
        ValueError: if ``trace`` is not a 1-D integer array or ``capacity`` is negative.
    """
    cap = _check_capacity(capacity)
    ids, uniq = _dense(trace)
    n_ids = int(uniq.size)
    return int(_lru_kernel(ids, n_ids, cap, _check_batch(batch)))


# ---------------------------------------------------------------------------------------------
# LFU: O(1) frequency buckets (one LRU list per count), the minimum count tracked.


@numba.njit(cache=True)
def _lfu_kernel(ids: np.ndarray, n_ids: int, max_count: int, capacity: int, batch: int) -> int:
    # Node n_ids + c heads the list of cached keys with count c (1 <= c <= max_count). A key
    # enters list c at the access that gives it count c, so each list is in recency order and
    # its LRU end is the LRU key among those with that count.
    base = n_ids
    prv = np.empty(n_ids + max_count + 1, dtype=np.int64)
    nxt = np.empty(n_ids + max_count + 1, dtype=np.int64)
    for c in range(max_count + 1):
        _init_list(prv, nxt, base + c)
    count = np.zeros(n_ids, dtype=np.int64)  # 0 = not cached
    entered = np.zeros(n_ids, dtype=np.int64)  # access index at which each key was last inserted
    size = 0
    min_count = 0
    hits = 0
    for i in range(ids.shape[0]):
        k = ids[i]
        c = count[k]
        if c > 0:
            if entered[k] < i - i % batch:
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
            entered[k] = i
            _push_mru(prv, nxt, base + 1, k)
            size += 1
            min_count = 1
    return hits


def lfu_hits(trace: np.ndarray, capacity: int, batch: int = 1) -> int:
    """Hits of an admission-free LFU cache of ``capacity`` keys over ``trace``.

    A key's count is the number of its accesses since it was last inserted (in-cache LFU). On a
    miss with the cache full, the key with the smallest count is evicted, the least recently
    used of those on a tie, and the missed key is always inserted with count 1.

    Args:
        trace: 1-D integer array of keys, one per access.
        capacity: cache size in keys (>= 0).
        batch: count a hit only if the key was cached when its batch of ``batch`` accesses
            began (see :func:`wtinylfu_hits`); 1 = every access is its own batch.

    Returns:
        The number of accesses that found their key cached.

    Raises:
        ValueError: if ``trace`` is not a 1-D integer array or ``capacity`` is negative.
    """
    cap = _check_capacity(capacity)
    ids, uniq = _dense(trace)
    n_ids = int(uniq.size)
    max_count = int(np.bincount(ids).max()) if ids.size else 0
    return int(_lfu_kernel(ids, n_ids, max_count, cap, _check_batch(batch)))


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
    _check_batch(batch)
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


def lru_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`lru_hits`."""
    return _ratio(lru_hits(trace, capacity), trace)


def lfu_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`lfu_hits`."""
    return _ratio(lfu_hits(trace, capacity), trace)


def wtinylfu_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`wtinylfu_hits` (static window)."""
    return _ratio(wtinylfu_hits(trace, capacity), trace)


def wtinylfu_adaptive_hit_ratio(trace: np.ndarray, capacity: int) -> float:
    """Hit ratio (hits / accesses, 0 for an empty trace) of :func:`wtinylfu_hits` with the hill climber."""
    return _ratio(wtinylfu_hits(trace, capacity, adaptive=True), trace)
