"""Expiry of rows (``TableConfig.ttl_steps`` / ``ttl_seconds``), explicit deletion, and the sweeper.

A row is *touched* when it is looked up or updated (or assigned, imported). A step is one tick of
the table's clock (:class:`embcache.policy.Clock`): one key occurrence looked up in the table (and,
with ``ttl_seconds``, one per sweep, so that the updates since the last lookup can be dated). A
row expires when it was last touched more than ``ttl_steps`` ticks ago, or (``ttl_seconds``) more
than that many seconds ago; everything is decided in ticks: the wall time of the clock's ticks is
sampled (:class:`TickTimes`, at most ~256 samples per ``ttl_seconds``), so a time cutoff becomes
a tick cutoff, rounded towards keeping the row.

Where the last touch lives:

- a resident row: its tier's ``last`` (the tick the policy scores by; updates set it too when the
  table expires rows). No byte per row is added.
- a row in the store: the side namespace ``~touch/<table>`` (key -> int64 tick, a store table of
  its own, so copies and checkpoints of the store carry it). Touches are written in batches, only
  for tables whose rows expire: for the rows that leave memory (:func:`write_leaving_touches`,
  before the rows themselves, so a stored row always has a touch), and at a flush for the resident
  rows touched since the previous flush (:func:`flush_touches`). Like rows, touches are durable at
  a flush: after a crash, a row's touch is at least the one the last flush saw, never newer than
  its real last touch, so no row expires earlier than its last durable touch says. The clock's
  tick at each flush is saved with the tick times (``expiry/<table>`` metadata), so the clock
  never restarts below a saved touch.

Rows stored before expiry was turned on (or while it was off) have no (or a stale) touch: the
first sweep *adopts* them (touch = now, every stored row) before it deletes anything from the
store; the adoption is saved, and undone when the table is opened without a TTL.

The :class:`Sweeper` (a daemon thread per cache, started when a table expires rows) runs
:func:`sweep` every ``CacheConfig.expiry_interval`` seconds: (1) expired, unpinned resident rows
are dropped from the tiers (and their stored copies and touches deleted), vectorized, in chunks;
(2) stored rows whose last touch has expired are deleted from the row store
(:meth:`StoreRows.delete`, the one path that deletes rows) and the side namespace,
``DELETE_CHUNK`` keys per lock hold, if they are not resident.

Step 2 costs what expires, not what is stored: every touch written is also noted in memory
(:class:`DueTouches`: its key, in a bucket of 1/16 of ``ttl_steps`` ticks, or of one sweep
interval for ``ttl_seconds`` alone, that knows its newest tick), and a sweep looks only at the keys
of the buckets whose newest tick has expired, reading their current touches (``get_many``) to
skip those touched again since. A stored row therefore expires at most a bucket late (1/16 of
``ttl_steps``, or one sweep interval), plus the wait for the next sweep. The buckets hold 8
bytes per touch written within the TTL; beyond
``DUE_MAX_KEYS`` they are dropped, and so they are at a restart (the touches written before it
are in no bucket): the next sweep then *walks* the whole side namespace with a cursor, in chunks
of ``SWEEP_CHUNK`` read without the lock (touches written meanwhile are logged and spare their
keys), and notes the live touches it reads, after which sweeps use the buckets again. The walk
reads every stored touch (about 4 us each through RocksDB's Python iterator: 40 s of a core per
10M rows), which is why it is the fallback.
"""

from __future__ import annotations

import bisect
import json
import threading
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import CacheClosedError, StoreError
from ..tier import MemoryTier, RowBatch
from .rows import expiry_meta

if TYPE_CHECKING:
    from .table import TableEngine

__all__ = ["BUCKETS_PER_TTL", "DELETE_CHUNK", "DUE_MAX_KEYS", "SWEEP_CHUNK", "DueTouches", "Expiry", "Sweeper",
           "TickTimes", "delete_keys", "flush_touches", "load", "save", "sweep", "threshold", "touch_resident",
           "write_leaving_touches"]

SWEEP_CHUNK = 65536  # touches read per step of a walk (without the lock)
DUE_MAX_KEYS = 1 << 23  # touches noted in DueTouches at most (64 MiB); past it, sweeps walk the side namespace
BUCKETS_PER_TTL = 16  # DueTouches' buckets per ttl_steps: a stored row expires at most 1/16 of it late
DELETE_CHUNK = 8192  # expired rows deleted per lock hold of a sweep
_TIME_SAMPLES = 256  # tick-time samples per ttl_seconds: a row expires at most ~1/256 of it late
_INT64_MAX = (1 << 63) - 1
_INT64_MIN = -(1 << 63)


class TickTimes:
    """Sampled wall times of a table's clock: ``(tick, unix time)`` pairs, each meaning "every tick
    below ``tick`` happened at or before ``time``". Kept for ``ttl_seconds`` back (plus one sample)."""

    def __init__(self, ttl_seconds: float) -> None:
        self.ttl = ttl_seconds
        self.resolution = ttl_seconds / _TIME_SAMPLES
        self.ticks: list[int] = []
        self.walls: list[float] = []

    def note(self, tick: int, wall: float) -> None:
        """Record that the clock was at ``tick`` at ``wall``. Within the resolution of the sample
        before the last, the last one is replaced: samples stay that far apart, the newest is exact."""
        if self.ttl <= 0:
            return
        if len(self.walls) >= 2 and wall - self.walls[-2] < self.resolution:
            self.ticks[-1], self.walls[-1] = tick, wall
            return
        self.ticks.append(tick)
        self.walls.append(wall)
        if len(self.walls) > 2 * _TIME_SAMPLES + 8:  # keep one sample at or before the cutoff
            cut = bisect.bisect_right(self.walls, wall - self.ttl) - 1
            if cut > 0:
                del self.ticks[:cut], self.walls[:cut]

    def tick_at(self, wall: float) -> int:
        """The largest sampled tick every touch below which happened at or before ``wall`` (0 if none)."""
        i = bisect.bisect_right(self.walls, wall) - 1
        return self.ticks[i] if i >= 0 else 0

    def state(self) -> list[list[float]]:
        """Serializable samples."""
        return [[k, w] for k, w in zip(self.ticks, self.walls, strict=True)]

    def load(self, samples: list[list[float]]) -> None:
        """Take up saved samples."""
        self.ticks = [int(k) for k, _ in samples]
        self.walls = [float(w) for _, w in samples]


class DueTouches:
    """The keys of the touches written, bucketed by tick (see the module docstring): with
    ``ttl_steps``, bucket ``i`` holds the touches of ticks ``[i * span, (i + 1) * span)``, span =
    ``ttl_steps / BUCKETS_PER_TTL``; with ``ttl_seconds`` alone, a bucket per sweep interval. Each
    knows its newest tick. ``complete`` while every stored touch's key is in a bucket."""

    def __init__(self, span: int) -> None:
        self.span = span  # ticks per bucket; 0: a bucket per sweep interval (seal() starts the next)
        self._keys: dict[int, list[np.ndarray]] = {}
        self._newest: dict[int, int] = {}
        self._generation = 0
        self.size = 0
        self.complete = False
        self.drops = 0  # times the buckets overflowed and were dropped

    def add(self, keys: np.ndarray, ticks: np.ndarray) -> None:
        """Note touches written: ``keys`` (int64) with ``ticks``."""
        if keys.size == 0:
            return
        if self.size + keys.size > DUE_MAX_KEYS:
            self.drop()
            return
        keys = np.array(keys, dtype=np.int64)
        ticks = np.asarray(ticks, dtype=np.int64)
        self.size += int(keys.size)
        if not self.span:
            self._put(self._generation, keys, int(ticks.max()))
            return
        ids = ticks // self.span
        lo, hi = int(ids.min()), int(ids.max())
        if lo == hi:  # the common case: a batch's touches fall in one bucket
            self._put(lo, keys, int(ticks.max()))
            return
        for i in np.unique(ids).tolist():  # a few buckets at most (touches of one batch are close)
            at = ids == i
            self._put(int(i), keys[at], int(ticks[at].max()))

    def _put(self, bucket: int, keys: np.ndarray, newest: int) -> None:
        self._keys.setdefault(bucket, []).append(keys)
        self._newest[bucket] = max(self._newest.get(bucket, _INT64_MIN), newest)

    def drop(self) -> None:
        """Forget every bucket: the next sweep walks the side namespace."""
        self._keys, self._newest, self.size = {}, {}, 0
        self.complete = False
        self.drops += 1

    def seal(self) -> None:
        """Close the current sweep interval's bucket (at the start of a sweep; buckets by tick need not)."""
        self._generation += 1

    def take_due(self, cut: int) -> list[np.ndarray]:
        """The keys of the buckets whose newest tick is below ``cut`` (sealed ones only, when buckets
        are by sweep interval), as noted (duplicates and all: the caller dedups, outside the lock);
        those buckets go."""
        due = [b for b, newest in self._newest.items() if newest < cut and (self.span or b < self._generation)]
        keys = [k for b in due for k in self._keys.pop(b)]
        for b in due:
            del self._newest[b]
        self.size -= sum(int(k.size) for k in keys)
        return keys


class Expiry:
    """One table's expiry state (the table's lock guards it)."""

    def __init__(self, ttl_steps: int, ttl_seconds: float) -> None:
        self.ttl_steps = ttl_steps
        self.due = DueTouches(max(ttl_steps // BUCKETS_PER_TTL, 1) if ttl_steps > 0 else 0)
        self.times = TickTimes(ttl_seconds)
        self.flushed = 0  # clock tick at the last flush: resident rows' touches below it are stored
        self.adopted = False  # every stored row has a touch (see the module docstring)


def threshold(t: TableEngine, wall: float | None = None) -> int:
    """The tick below which a last touch has expired, now (``wall``: now's unix time)."""
    assert t.expiry is not None
    now = t.clock.now
    cut = now - t.expiry.ttl_steps if t.expiry.ttl_steps > 0 else 0
    if t.cfg.ttl_seconds > 0:
        wall = time.time() if wall is None else wall
        t.expiry.times.note(now, wall)
        cut = max(cut, t.expiry.times.tick_at(wall - t.cfg.ttl_seconds))
    return cut


# ---------------------------------------------------------------------- state: load, save, touches
def load(t: TableEngine) -> None:
    """Take up the saved expiry state (after the clock); without expiry, forget a past adoption."""
    raw = t.rows.store.get_meta(expiry_meta(t.cfg.name))
    saved: dict[str, Any] = json.loads(raw) if raw else {}
    if t.expiry is None:
        if saved.get("adopted"):  # rows touched while expiry is off get no touch: adopt again when it is on
            t.rows.store.put_meta(expiry_meta(t.cfg.name), json.dumps({**saved, "adopted": False}).encode())
        return
    t.clock.now = max(t.clock.now, int(saved.get("now", 0)))  # never below a touch a flush saved
    t.expiry.times.load(saved.get("times", []))
    # nothing to adopt in an empty table (a new one): every row it stores will have its touch
    empty = t.rows.store.scan_from(t.rows.table, _INT64_MIN, 1)[0].size == 0
    t.expiry.adopted = bool(saved.get("adopted", False)) or empty
    # the touches stored before this open are in no bucket: the first sweep walks them, unless none are
    t.expiry.due.complete = t.rows.scan_touches(_INT64_MIN, 1)[0].size == 0
    t.rows.due = t.expiry.due
    t.expiry.flushed = t.clock.now
    t.expiry.times.note(t.clock.now, time.time())


def save(t: TableEngine) -> None:
    """Save the expiry state (the clock's tick, tick times, adoption) in the store's metadata."""
    if t.expiry is None:
        return
    state = {"now": t.clock.now, "times": t.expiry.times.state(), "adopted": t.expiry.adopted}
    t.rows.store.put_meta(expiry_meta(t.cfg.name), json.dumps(state).encode())


def touch_resident(t: TableEngine, tier: MemoryTier, slots: torch.Tensor) -> None:
    """An update touched the resident rows at ``slots`` of ``tier`` (only when rows expire)."""
    if t.expiry is not None and slots.numel():
        tier.last.index_fill_(0, slots.to(tier.device), t.clock.now)
        t.tick_stamped = True


def write_leaving_touches(t: TableEngine, rows: RowBatch) -> None:
    """Store the touches of ``rows`` leaving memory (or written back) that the store lacks: those
    touched since the last flush. Written before the rows (may raise: nothing moved)."""
    if t.expiry is None or len(rows) == 0:
        return
    new = rows.last >= t.expiry.flushed
    if bool(new.any()):
        t.rows.write_touches(rows.keys[new].cpu().numpy(), rows.last[new].cpu().numpy())


def flush_touches(t: TableEngine) -> None:
    """Store the touches of resident rows touched since the last flush, then save the expiry state
    (lock held; part of a flush, before the store's own)."""
    if t.expiry is None:
        return
    for tier in (t.hbm, t.ddr):
        slots = torch.nonzero(tier.occupied_mask() & (tier.last >= t.expiry.flushed)).flatten()
        for start in range(0, slots.numel(), SWEEP_CHUNK):
            part = slots[start:start + SWEEP_CHUNK]
            t.rows.write_touches(tier.keys[part].cpu().numpy(), tier.last[part].cpu().numpy())
    t.expiry.flushed = t.clock.now
    save(t)


# ---------------------------------------------------------------------- deletion
def delete_keys(t: TableEngine, keys: torch.Tensor) -> None:
    """Delete the rows of unique CPU ``keys`` from the store and the side namespace, then from
    every tier (pins and all). The store goes first: if it fails, nothing was dropped."""
    k = keys.numpy()
    t.rows.delete(k)
    for tier in (t.hbm, t.ddr):
        slots = tier.find(keys)
        tier.remove(slots[slots >= 0])
    t.recent = None  # the rows a lookup kept aside may be of these keys


# ---------------------------------------------------------------------- the sweep
def sweep(t: TableEngine) -> None:
    """One sweep of table ``t`` (see the module docstring); takes the table's lock per chunk.

    Raises:
        CacheClosedError: the cache closed meanwhile. StoreError: the store failed (what was
            deleted stays deleted; the next sweep goes on).
    """
    assert t.expiry is not None
    t0 = time.perf_counter()
    if t.cfg.ttl_seconds > 0:
        with t.lock:
            t.check_open()
            # One tick on, and its time noted: touches made at the current tick (updates since the
            # last lookup) are then known to be older than this sweep, so an idle table expires too.
            t.advance_clock(1)
            t.expiry.times.note(t.clock.now, time.time())
    _sweep_memory(t)
    if not t.expiry.adopted:
        _adopt(t)
    due = t.expiry.due
    with t.lock:
        due.seal()
        walk, drops = not due.complete, due.drops
    if walk:
        _sweep_store(t)
        with t.lock:
            due.complete = due.drops == drops  # every live touch noted, unless the buckets overflowed meanwhile
        t.stats.expiry.walks += 1
    else:
        _sweep_due(t)
    st = t.stats.expiry
    st.sweeps += 1
    st.last_sweep_seconds = time.perf_counter() - t0
    st.sweep_seconds += st.last_sweep_seconds


def _sweep_memory(t: TableEngine) -> None:
    """Drop expired, unpinned resident rows (chunk by chunk, the lock held per chunk)."""
    for tier, field in ((t.hbm, "expired_hbm"), (t.ddr, "expired_ddr")):
        while True:
            with t.lock:
                t.check_open()
                if tier.capacity == 0:
                    break
                expired = tier.evictable_mask() & (tier.last < threshold(t))
                slots = torch.nonzero(expired).flatten()[:DELETE_CHUNK]
                if slots.numel() == 0:
                    break
                keys = tier.keys.index_select(0, slots).cpu()
                k = keys.numpy()
                t.rows.delete(k)  # a stored copy of the row goes too
                tier.remove(slots)
                t.recent = None
                setattr(t.stats.expiry, field, getattr(t.stats.expiry, field) + int(slots.numel()))


def _adopt(t: TableEngine) -> None:
    """Give every stored row a touch of now (rows stored without expiry on), then mark it done."""
    assert t.expiry is not None and t.rows.touches is not None
    start = _INT64_MIN
    while True:
        keys, _ = t.rows.store.scan_from(t.rows.table, start, SWEEP_CHUNK)
        if keys.size:
            with t.lock:
                t.check_open()
                t.rows.write_touches(keys, np.full(keys.size, t.clock.now, dtype=np.int64))
                t.stats.expiry.adopted_rows += int(keys.size)
        if keys.size < SWEEP_CHUNK or keys[-1] == _INT64_MAX:
            break
        start = int(keys[-1]) + 1
    with t.lock:
        t.check_open()
        t.expiry.adopted = True
        save(t)


def _sweep_due(t: TableEngine) -> None:
    """Delete the stored rows of the due buckets' keys whose last touch has expired and that are
    not resident (reading their touches under the lock, ``DELETE_CHUNK`` keys per lock hold)."""
    assert t.expiry is not None
    with t.lock:
        t.check_open()
        cut = threshold(t)
        due = t.expiry.due.take_due(cut)
    cand = np.unique(np.concatenate(due)) if due else np.zeros(0, dtype=np.int64)
    for start in range(0, cand.size, DELETE_CHUNK):
        part = cand[start:start + DELETE_CHUNK]
        with t.lock:
            t.check_open()
            found, ticks = t.rows.read_touches(part)
            dead = part[found & (ticks < cut)]
            if dead.size:
                dead = dead[~t.resident(torch.from_numpy(dead)).numpy()]
            if dead.size:
                t.rows.delete(dead)
                t.stats.expiry.expired_store += int(dead.size)


def _sweep_store(t: TableEngine) -> None:
    """Walk the side namespace; delete the expired rows that are not resident, in batches, and
    note the live touches in the due buckets.

    The touches are read without the lock, chunk by chunk; the keys whose touches are written
    meanwhile (touched since) are logged (:meth:`StoreRows.watch_touches`), and under the lock an
    expired candidate goes only if it was not touched since it was read and is not resident.
    """
    assert t.expiry is not None
    start = _INT64_MIN
    with t.lock:
        t.rows.watch_touches()
    try:
        while True:
            with t.lock:
                t.check_open()
                cut = threshold(t)
            keys, ticks = t.rows.scan_touches(start, SWEEP_CHUNK)  # without the lock: checked below
            live = ticks >= cut
            with t.lock:  # (a touch rewritten since is noted again by its write)
                t.expiry.due.add(keys[live], ticks[live])
            cand = keys[~live]
            fresh = np.zeros(0, dtype=np.int64)  # keys touched since (at most) this chunk was read
            for part in np.array_split(cand, -(-cand.size // DELETE_CHUNK)) if cand.size else ():
                with t.lock:  # held for one batch of deletes
                    t.check_open()
                    fresh = np.union1d(fresh, t.rows.touched_since_watch())
                    if fresh.size:  # touched after this chunk was read: kept (and checked again next sweep)
                        part = part[~np.isin(part, fresh, assume_unique=True)]
                    dead = part[~t.resident(torch.from_numpy(part)).numpy()] if part.size else part
                    if dead.size:
                        t.rows.delete(dead)
                        t.stats.expiry.expired_store += int(dead.size)
            if keys.size < SWEEP_CHUNK or keys[-1] == _INT64_MAX:
                return
            start = int(keys[-1]) + 1
    finally:
        with t.lock:
            t.rows.unwatch_touches()


class Sweeper:
    """The background sweeper of a cache: :func:`sweep` of every expiring table every ``interval`` s.

    Started on demand (:meth:`start`, when a table expires rows), stopped by :meth:`stop` (the
    cache closing; call it without holding table locks). :meth:`sweep_all` runs one sweep now.
    """

    def __init__(self, tables: Mapping[str, TableEngine], interval: float) -> None:
        self._tables = tables
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sweeping = threading.Lock()  # one sweep at a time (the thread's or expire_now's)
        self._warned = False

    def start(self) -> None:
        """Start the thread if it is not running."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="embcache-expiry", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread and wait for it (a sweep in progress ends at its next chunk)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def sweep_all(self) -> None:
        """One sweep of every table whose rows expire, now.

        Raises:
            CacheClosedError, StoreError (of the first table that failed; the others were swept).
        """
        failed: StoreError | None = None
        with self._sweeping:
            for name in sorted(self._tables):
                t = self._tables[name]
                if t.expiry is None:
                    continue
                try:
                    sweep(t)
                except StoreError as exc:  # counted; the other tables are swept, the next sweep tries again
                    t.stats.expiry.errors += 1
                    failed = failed or exc
        if failed is not None:
            raise failed

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sweep_all()
            except CacheClosedError:
                return
            except StoreError as exc:  # reported once; the next sweep tries again
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"embcache: expiry sweep failed: {exc}", stacklevel=1)
