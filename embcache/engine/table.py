"""TableEngine: one table's state (lock, tiers, clock, sketch, recent rows) and its operations.

Each row of a table lives in exactly one memory tier (HBM or DDR) or in none; the store holds
every row ever written. A row in memory is authoritative; a dirty row is written back when it
leaves memory (or at a flush). A row never written comes from the table's initializer, a pure
function of (seed, key).

A lookup probes HBM, then DDR, then reads the store (:mod:`.rows`); every access is counted
(aged frequencies, :mod:`embcache.policy`), and the rows found below HBM then compete for the
tiers (:mod:`.placement`). A lookup that misses memory for many keys reads them on a reader
thread while it plans their placement, and waits for them only to commit. An update applies
the optimizer where each row lives (:mod:`.update`); rows below memory are staged, changed and
placed like a lookup's.

Every method here expects the caller to hold ``lock`` (the facade takes it), except where it
says otherwise.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch

from .._bits import next_pow2
from ..config import CacheConfig, TableConfig
from ..errors import StoreError
from ..keyset import Keyset
from ..mrc import MissRatioEstimator
from ..optim import OptimizerParams, state_width
from ..policy import Clock, FrequencySketch, Policy, default_halflife, make_policy
from ..sim.tuner import Setting
from ..stores import Store
from ..tier import MemoryTier, RowBatch, ScoreOf, release_cached_memory, to_device, to_host
from ..types import Tier
from ..validate import check_open
from . import admission, expiry, placement
from .found import FoundSlots
from .lock import TableLock
from .rows import (
    Read,
    ReaderPool,
    RecordCodec,
    StagedRead,
    StoreRows,
    admission_meta,
    clean_rows,
    clock_meta,
    merge_in_order,
    sketch_meta,
    steps_meta,
)
from .stats import TableStats
from .window import Window

__all__ = ["STAGE_CHUNK", "RowUpdate", "TableEngine"]

_MIN_SKETCH_WIDTH = 4096
_MAX_SKETCH_WIDTH = 1 << 23  # 4 rows of float32: at most 128 MiB per table
STAGE_CHUNK = 65536  # rows staged (or written back) per step of a pass, prefetch or resize
# A lookup that misses memory for at least this many distinct keys reads them from the store on a
# reader thread while it plans their placement (see _below_hbm); fewer are read inline,
# where a thread hand-off (~50-100 us) would cost more than the overlap saves.
_OVERLAP_READ_MIN = 64
# A lookup keeps the rows it read but did not cache for the update that usually follows, up to this
# many (at most _RECENT_MAX_ROWS x record bytes of memory per table, until the next lookup or update).
_RECENT_MAX_ROWS = 65536
# Resident rows raised into the sketch per step when it is saved: the hash cells of all of a big
# table's rows at once (4 x 8 bytes a row, and as much again for the hash's temporaries) were
# the peak of a close (bench_big: 8.5M resident rows, ~0.5 GiB above the budget).
_SAVE_CHUNK = 1 << 20

# A change of rows: ``(weights, state, index) -> (weights, state)``, ``index`` the positions of the
# rows among the unique keys being changed.
RowUpdate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


class TableEngine:
    """One table: its tiers, policy state, counters and store rows, guarded by ``lock``."""

    def __init__(self, cfg: TableConfig, hbm_rows: int, ddr_rows: int, config: CacheConfig, policy: Policy,
                 store: Store, readers: ReaderPool) -> None:
        self.cfg = cfg
        self.config = config
        self.device = config.torch_device
        self.lock = TableLock(self.device)
        self.policy = policy
        self.readers = readers
        self.closed = False  # set by the cache when it closes; checked under the lock
        self.state_width = state_width(cfg.optimizer, cfg.dim)
        self.hbm, self.ddr = self._tiers(hbm_rows, ddr_rows)
        self.found = FoundSlots()  # the slots of the last all-HBM lookup, for the update after it
        memory_rows = hbm_rows + ddr_rows
        halflife = config.halflife if config.halflife is not None else default_halflife(memory_rows)
        self.clock = Clock(halflife if policy.aging else math.inf)
        width = config.sketch_width or min(max(next_pow2(8 * memory_rows), _MIN_SKETCH_WIDTH), _MAX_SKETCH_WIDTH)
        self.sketch = FrequencySketch(width, device=torch.device("cpu"))
        # admission (admit_after > 1): how often each key not yet stored was looked up (raw counts)
        self.admission = FrequencySketch(width, device=torch.device("cpu")) if cfg.admit_after > 1 else None
        # CacheConfig.lookups_create_rows=False: a lookup places stored rows only; keys the store
        # lacks get the ``unadmitted`` row, as if never admitted (see admission.stage_admitting)
        self.stored_only = not config.lookups_create_rows
        self.params = OptimizerParams(lr=cfg.lr, eps=float(cfg.eps or 0.0), beta1=cfg.beta1, beta2=cfg.beta2,
                                      weight_decay=cfg.weight_decay)
        # Eviction sampling draws from seeded generators of its own, one per device (a CUDA
        # cache's DDR tier is on the host): never from torch's global generators, which are
        # unseeded here and are the user's random stream.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(cfg.seed & 0x7FFFFFFF)
        self.host_generator = self.generator
        if self.device.type != "cpu":
            self.host_generator = torch.Generator()
            self.host_generator.manual_seed(cfg.seed & 0x7FFFFFFF)
        # victims each tier gave up in its last admission (the first guess of the next; see placement.admit)
        self.last_swaps: dict[Tier, int] = {}
        self.stats = TableStats()
        # updates applied to the table so far (saved with the frequencies): the step that seeds
        # stochastic rounding (embcache/rounding.py), so that a resumed run rounds as an unbroken one
        self.update_steps = 0
        self.codec = RecordCodec(cfg, self.state_width)
        self.rows = StoreRows(store, cfg, self.codec, self.stats.ssd)
        # The rows the last lookup read from the store but did not cache, as of store write
        # ``recent_writes``: a training step's update of the same keys takes them from here
        # instead of reading them again (see _stage_for_update).
        self.recent: RowBatch | None = None
        self.recent_writes = -1
        self.mrc: MissRatioEstimator | None = None
        # the policy's tuned setting (None: the configured one), strict admission (placement.admit),
        # HBM's window (engine/window.py) and counting a row once per tick (a batch's repeats)
        self.setting: Setting | None = None
        self.strict = False
        self.window: Window | None = None
        self.once = False
        # whether something other than a lookup stamped the current tick as a row's last access
        # (a prefetch staging rows, an update's touch): a lookup counting once per tick then
        # moves the clock on first, so that it does not take those rows as counted already
        self.tick_stamped = False
        self.reset_mrc()
        self.pass_keyset: Keyset | None = None
        self.pass_pinned = torch.empty(0, dtype=torch.int64)
        # expiry (ttl_steps / ttl_seconds): the state the sweeper and the touch writes keep (.expiry)
        self.expiry = expiry.Expiry(cfg.ttl_steps, cfg.ttl_seconds) if cfg.expires else None

    # ------------------------------------------------------------------ state
    def _tiers(self, hbm_rows: int, ddr_rows: int) -> tuple[MemoryTier, MemoryTier]:
        cfg, dtype = self.cfg, self.cfg.torch_dtype
        return (MemoryTier(Tier.HBM, hbm_rows, cfg.dim, self.state_width, dtype, self.device),
                MemoryTier(Tier.DDR, ddr_rows, cfg.dim, self.state_width, dtype, torch.device("cpu"),
                           pinned_reads=self.device.type == "cuda"))

    @property
    def record_bytes(self) -> int:
        """Bytes of one row's record in the store."""
        return self.codec.record_bytes

    def load_saved(self) -> None:
        """Take up the frequency sketch, clock, admission counts and expiry state the store saved for
        this table, if any."""
        store, name = self.rows.store, self.cfg.name
        sketch = store.get_meta(sketch_meta(name))
        if sketch:
            self.sketch.load_bytes(sketch)
        clock = store.get_meta(clock_meta(name))
        if clock:
            self.clock.load(json.loads(clock))
        counts = store.get_meta(admission_meta(name))
        if counts and self.admission is not None:
            self.admission.load_bytes(counts)
        expiry.load(self)
        steps = store.get_meta(steps_meta(name))
        if steps:
            self.update_steps = int(steps)

    def save_frequencies(self) -> None:
        """Save the frequency state (resident rows' counts into the sketch, then sketch, clock and
        admission counts)."""
        for tier in (self.hbm, self.ddr):
            occupied = tier.occupied_mask()
            for start in range(0, tier.capacity, _SAVE_CHUNK):
                slots = torch.nonzero(occupied[start:start + _SAVE_CHUNK]).flatten() + start
                if slots.numel():
                    self.sketch.raise_to(tier.keys.index_select(0, slots).cpu(),
                                         tier.freq.index_select(0, slots).cpu())
        store, name = self.rows.store, self.cfg.name
        store.put_meta(sketch_meta(name), self.sketch.to_bytes())
        store.put_meta(clock_meta(name), json.dumps(self.clock.state()).encode())
        if self.admission is not None:
            store.put_meta(admission_meta(name), self.admission.to_bytes())
        store.put_meta(steps_meta(name), str(self.update_steps).encode())

    def reset_mrc(self) -> None:
        """(Re)start the miss-ratio-curve estimator for the current tier capacities."""
        if self.mrc is not None:
            self.mrc.close()
            self.mrc = None
        rows = (self.hbm.capacity, self.ddr.capacity)
        config = self.config
        if config.mrc_sample_rate != 0 and self.policy.name in ("lrfu", "lfu") and sum(rows) > 0:
            tune = config.tune_policy and self.policy.name == "lrfu" and config.halflife is None
            self.mrc = MissRatioEstimator(*rows, halflife=config.halflife if self.policy.aging else math.inf,
                                          rate=config.mrc_sample_rate, idle_halving=config.idle_halving, tune=tune)

    def release(self) -> None:
        """Free the tiers and the estimator (the cache is closing; dirty rows were written)."""
        self.closed = True
        if self.mrc is not None:
            self.mrc.close()
        self.hbm.release()
        self.ddr.release()

    def check_open(self) -> None:
        """Raise CacheClosedError once the cache closed (e.g. while the caller waited for the lock)."""
        check_open(self.closed)

    def scores_of(self, tier: MemoryTier) -> ScoreOf:
        """The policy's scores of resident rows of ``tier`` at ``slots``."""
        def score(slots: torch.Tensor) -> torch.Tensor:
            return self.policy.score_at(tier.freq, tier.last, slots, self.clock)
        return score

    def generator_for(self, tier: MemoryTier) -> torch.Generator:
        """The table's seeded generator on ``tier``'s device (for eviction sampling)."""
        return self.generator if tier.device == self.device else self.host_generator

    def advance_clock(self, n: int) -> None:
        """Advance the aging clock by ``n`` accesses, halving every count when a half-life passes."""
        self.tick_stamped = False
        factor = self.clock.advance(n)
        if factor is not None:
            self._scale_frequencies(factor)

    def _scale_frequencies(self, factor: float) -> None:
        """Multiply every aged frequency (resident rows' and the sketch's) by ``factor``."""
        self.hbm.scale_freq(factor)
        self.ddr.scale_freq(factor)
        self.sketch.scale(factor)

    # ------------------------------------------------------------------ lookup
    def lookup(self, given: torch.Tensor, keys: torch.Tensor, out: torch.Tensor, raw: object = None) -> torch.Tensor:
        """Rows of ``keys`` (on the cache's device; ``given``: as the caller gave them, checked) into
        ``out``; ``raw``: the caller's own keys object, by which an update of the same keys finds
        the slots found here (:class:`~embcache.engine.found.FoundSlots`)."""
        n = keys.numel()
        t0 = time.perf_counter()
        if self.once and self.tick_stamped:
            self.advance_clock(1)
        now, inc = self.clock.now, self.clock.increment()
        # probe, count the hits and their accesses, copy their rows into out: one pass
        slots, n_hit = self.hbm.find_touch_gather(keys, inc, now, out, self.once)
        self.stats.hbm.seconds += time.perf_counter() - t0
        if n_hit == n:
            self.found.remember(raw, self.hbm, slots)
        else:
            self.found.forget()
        if n_hit < n and self.device.type == "cpu":
            miss_pos = torch.nonzero(slots < 0).flatten()
            ukeys, inverse, counts = torch.unique(keys.index_select(0, miss_pos), return_inverse=True,
                                                  return_counts=True)
            values = self._below_hbm(ukeys, counts, inc, now)
            out.index_copy_(0, miss_pos, values.index_select(0, inverse))
        elif n_hit < n:
            # On a GPU, one host sync for the missed keys: the host knows how many missed, so
            # their positions come from a stable sort of the hit mask (no nonzero), and the
            # keys, which the host needs anyway (DDR, the store), are deduplicated there
            # (torch.unique on the GPU would sync to size its output, then again to copy).
            miss_pos = torch.argsort((slots >= 0).to(torch.uint8), stable=True)[:n - n_hit]
            (miss_keys,) = to_host(keys.index_select(0, miss_pos))
            ukeys, inverse, counts = torch.unique(miss_keys, return_inverse=True, return_counts=True)
            values = self._below_hbm(ukeys, counts, inc, now)
            out.index_copy_(0, miss_pos, values.index_select(0, to_device(inverse, self.device)))
        self.stats.lookups += n
        self.stats.hbm.hits += n_hit
        if self.mrc is not None:
            self.mrc.observe(given)  # host keys when the caller gave them: no copy back from the GPU
            if self.mrc.tuner is not None:
                self.retune(self.mrc.tuner.best())
        self.advance_clock(n)
        if self.expiry is not None and self.cfg.ttl_seconds > 0:
            self.expiry.times.note(self.clock.now, time.time())
        return out

    def retune(self, setting: Setting) -> None:
        """Switch the policy to ``setting`` (the tuner's choice; nothing to do when it is current)."""
        if setting == self.setting:
            return
        memory_rows = self.hbm.capacity + self.ddr.capacity
        self._scale_frequencies(self.clock.retune(default_halflife(memory_rows, setting.halflife_rows)))
        self.policy = make_policy("lrfu", self.policy.admission, setting.idle_halving)
        self.strict = setting.strict
        self.once = setting.once
        if self.setting is None or setting.window != self.setting.window:
            self.window = self._new_window(setting)
        self.setting = setting
        self.stats.policy_switches += 1

    def _new_window(self, setting: Setting | None) -> Window | None:
        """An empty window of ``setting``'s share of HBM (None without a setting or a window)."""
        return Window.of_share(setting.window if setting else 0.0, self.hbm.capacity, self.hbm.device)

    def access_amounts(self, counts: torch.Tensor, inc: float) -> torch.Tensor:
        """What the accesses of unique keys looked up ``counts`` times add to their frequencies
        (float64): ``inc`` each, or once per key when counting once per tick."""
        if self.once:
            return torch.full(counts.shape, inc, dtype=torch.float64)
        return counts.to(torch.float64) * inc

    def _below_hbm(self, ukeys: torch.Tensor, counts: torch.Tensor, inc: float, now: int) -> torch.Tensor:
        """Values (float32 [u, dim], cache device) of unique keys missing from HBM; places them."""
        t1 = time.perf_counter()
        cpu_keys, cpu_counts = to_host(ukeys, counts)
        if self.pass_keyset is not None:
            self.stats.outside_keyset += int(cpu_counts[~self.pass_keyset.contains(cpu_keys)].sum())
        dslots = self.ddr.find(cpu_keys)
        in_ddr = dslots >= 0
        d_pos = torch.nonzero(in_ddr).flatten()
        s_pos = torch.nonzero(~in_ddr).flatten()
        s_keys, s_counts = cpu_keys.index_select(0, s_pos), cpu_counts.index_select(0, s_pos)
        overlap = self.admission is None and not self.stored_only and s_keys.numel() >= _OVERLAP_READ_MIN
        # The store read runs on a reader thread (the store bindings release the GIL), started
        # first: this one copies the DDR hits, plans the placement and makes the moves meanwhile,
        # which need the rows' keys and counts but not their values (placement.commit).
        future = self.readers.submit(self.rows, s_keys) if overlap else None
        values = torch.empty(ukeys.numel(), self.cfg.dim, dtype=torch.float32,
                             pin_memory=self.device.type == "cuda")
        d_hits = 0  # counted once the lookup cannot fail any more (a failed one counts no hits)
        d_slots = dslots.index_select(0, d_pos)
        if d_slots.numel():
            values.index_copy_(0, d_pos, self.ddr.weights.index_select(0, d_slots).to(torch.float32))
            d_counts = cpu_counts.index_select(0, d_pos)
            self.ddr.touch(d_slots, self.access_amounts(d_counts, inc), now)
            d_hits = int(d_counts.sum())
        self.stats.ddr.seconds += time.perf_counter() - t1
        read: StagedRead | None = None
        s_values: torch.Tensor | None = None  # the rows returned for s_keys, where not the staged ones
        if future is not None:
            n_s = s_keys.numel()  # placeholder values until the read is done
            staged = self.stage_meta(s_keys, s_counts, inc, now,
                                     torch.empty(n_s, self.cfg.dim, dtype=self.cfg.torch_dtype),
                                     torch.empty(n_s, self.state_width, dtype=torch.float32))
            read = StagedRead(staged, s_counts, future)
        elif (self.admission is not None or self.stored_only) and s_keys.numel():
            staged, s_values = admission.stage_admitting(self, s_keys, s_counts, inc, now)
        else:
            staged = self.stage(s_keys, s_counts, inc, now)
        failed: StoreError | None = None
        self.recent = None
        try:
            uncached = self._place(d_slots, staged, read)
        except StoreError as exc:
            failed = exc
        if read is not None:
            self.complete(read)  # a failed read raises here: the lookup fails, its rows are not cached
        if failed is None and 0 < len(uncached) <= _RECENT_MAX_ROWS:
            self.recent, self.recent_writes = uncached, self.rows.writes
        if failed is not None:
            # A lookup's rows are already served; only their caching failed (e.g. a full disk
            # refused the write-back of a displaced dirty row). Nothing moved: keep serving.
            self.stats.placement_errors += 1
            if self.stats.placement_errors == 1:
                warnings.warn(f"embcache: table {self.cfg.name!r}: rows could not be cached: {failed}", stacklevel=4)
        values.index_copy_(0, s_pos, (staged.weights if s_values is None else s_values).to(torch.float32))
        self.stats.ddr.hits += d_hits
        return to_device(values, self.device)

    def _place(self, ddr_cands: torch.Tensor, staged: RowBatch, read: StagedRead | None = None) -> RowBatch:
        """Plan and commit the moves after an access (:func:`placement.plan_access`); the staged
        rows that stayed out of memory."""
        if ddr_cands.numel() == 0 and len(staged) == 0:
            return staged
        return placement.commit(self, placement.plan_access(self, ddr_cands, staged), read)

    # ------------------------------------------------------------------ staging rows from the store
    def stage(self, keys: torch.Tensor, counts: torch.Tensor | None, inc: float, now: int) -> RowBatch:
        """Rows of (unique, CPU) ``keys`` not in memory: read from the store or created.

        With ``counts``, the accesses are counted (sketch and ssd hits); without, nothing is counted.
        """
        if keys.numel() == 0:
            return self.stage_meta(keys, None, inc, now, torch.empty(0, self.cfg.dim, dtype=self.cfg.torch_dtype),
                                   torch.empty(0, self.state_width, dtype=torch.float32))
        read = self.rows.read(keys)
        rows = self.stage_meta(keys, counts, inc, now, read.weights, read.state)
        self.count_stage(counts, read)
        return rows

    def stage_meta(self, keys: torch.Tensor, counts: torch.Tensor | None, inc: float, now: int,
                   weights: torch.Tensor, state: torch.Tensor) -> RowBatch:
        """Clean rows of ``keys`` with ``weights`` and ``state``, their frequencies from the sketch
        (with ``counts``, this access is added first)."""
        self.tick_stamped = True  # the rows' last access is ``now``
        if keys.numel() and counts is not None:
            freq = self.sketch.add_and_estimate(keys, self.access_amounts(counts, inc))
        else:
            freq = self.sketch.estimate(keys) if keys.numel() else torch.empty(0, dtype=torch.float64)
        return clean_rows(keys, weights, state, freq, now)

    def count_stage(self, counts: torch.Tensor | None, read: Read, not_made: int = 0) -> None:
        """Count a staging read (and, with ``counts``, its hits and the rows created, less
        ``not_made`` rows the initializer made for keys not admitted)."""
        self.rows.count(read)
        if counts is not None:
            n_found = int(counts[read.fmask].sum())
            self.stats.ssd.hits += n_found
            self.stats.ssd.created += int(counts.sum()) - n_found
            self.stats.ssd.created_rows += int(read.fmask.numel()) - int(read.found.sum()) - not_made

    def complete(self, read: StagedRead) -> None:
        """Give the staged rows of ``read`` their values, once (a failed read raises every time)."""
        if read.done:
            return
        r = read.future.result()
        read.rows.weights, read.rows.state = r.weights, r.state
        self.count_stage(read.counts, r)
        read.done = True

    def _stage_for_update(self, keys: torch.Tensor, now: int) -> RowBatch:
        """Rows of non-resident ``keys`` about to change: from the last lookup's uncached rows where
        the store has not been written since (a training step updates the rows it just looked up),
        else staged. The kept rows serve this one update and are dropped."""
        recent, self.recent = self.recent, None
        if recent is None or self.recent_writes != self.rows.writes:
            return self.stage(keys, None, 0.0, now)
        pool = self.stage_meta(recent.keys, None, 0.0, now, recent.weights, recent.state)
        return self.pool_or_stage(keys, pool, now)

    def pool_or_stage(self, keys: torch.Tensor, pool: RowBatch | None, now: int) -> RowBatch:
        """Rows of non-resident ``keys`` (in order): from ``pool`` where it has them, else staged (not counted)."""
        if pool is None or len(pool) == 0 or keys.numel() == 0:
            return self.stage(keys, None, 0.0, now)
        sorted_keys, order = torch.sort(pool.keys)
        pos = torch.searchsorted(sorted_keys, keys).clamp_(max=sorted_keys.numel() - 1)
        hit = sorted_keys[pos] == keys
        return merge_in_order(pool.select(order[pos[hit]]), self.stage(keys[~hit], None, 0.0, now), hit)

    # ------------------------------------------------------------------ changing rows
    def modify(self, ukeys: torch.Tensor, fn: RowUpdate, read_store: bool = True,
               hslots: torch.Tensor | None = None) -> None:
        """Replace rows of unique ``ukeys`` by ``fn(weights, state, index) -> (weights, state)``.

        Resident rows change in place; the rest are staged (read, or with ``read_store=False``
        left empty for ``fn`` to fill), changed and placed. On a store failure the resident rows
        are restored and the error re-raised.
        """
        if hslots is None:
            hslots = self.hbm.find(ukeys)
        in_h = hslots >= 0
        if hslots.device.type == "cpu":
            h_idx = torch.nonzero(in_h).flatten()
            h_slots = hslots[h_idx]
            rest_idx, all_keys = to_host(torch.nonzero(~in_h).flatten(), ukeys)
        else:  # one host sync: the mask and the keys to the host together, positions found there
            in_h_host, all_keys = to_host(in_h, ukeys)
            h_idx = torch.nonzero(in_h_host).flatten()
            h_slots = hslots.index_select(0, to_device(h_idx, hslots.device))
            rest_idx = torch.nonzero(~in_h_host).flatten()
        rest_keys = all_keys[rest_idx]
        dslots = self.ddr.find(rest_keys)
        in_d = dslots >= 0
        d_idx, d_slots = rest_idx[in_d], dslots[in_d]
        s_idx = rest_idx[~in_d]
        undo = []
        for tier, slots, idx in ((self.hbm, h_slots, h_idx), (self.ddr, d_slots, d_idx)):
            if slots.numel():
                # advanced indexing copies: these are the old rows, kept to undo a failed placement
                old = (tier.weights[slots], tier.state[slots], tier.dirty_at(slots))
                w, s = fn(old[0], old[1], idx)
                tier.write(slots, w, s)
                expiry.touch_resident(self, tier, slots)
                undo.append((tier, slots, old))
        skeys = rest_keys[~in_d]
        if self.admission is not None and read_store and skeys.numel():
            # gradients of keys not admitted yet are dropped (assign, read_store=False, admits)
            ok = admission.admitted(self, skeys)
            self.stats.dropped_updates += int((~ok).sum())
            skeys, s_idx = skeys[ok], s_idx[ok]
        if skeys.numel() == 0:  # every row was in memory: nothing to stage or place
            return
        now = self.clock.now
        if read_store:
            staged = self._stage_for_update(skeys, now)
        else:
            n = skeys.numel()
            staged = self.stage_meta(skeys, None, 0.0, now, torch.empty(n, self.cfg.dim, dtype=self.cfg.torch_dtype),
                                     torch.empty(n, self.state_width))
        w, s = fn(staged.weights, staged.state, s_idx)
        w, s = to_host(w, s)
        staged.weights, staged.state = w.to(self.cfg.torch_dtype), s
        staged.dirty = torch.ones(len(staged), dtype=torch.bool)
        try:
            self._place(torch.empty(0, dtype=torch.int64), staged)
        except BaseException:
            for tier, slots, (w, s, d) in undo:
                tier.weights[slots] = w
                tier.state[slots] = s
                tier.set_dirty(slots, d)
            raise

    # ------------------------------------------------------------------ arranging for passes
    def arrange(self, keys_h: torch.Tensor, keys_d: torch.Tensor, pool: RowBatch | None = None,
                pin: bool = False, wanted: Keyset | None = None) -> torch.Tensor:
        """Move the rows of ``keys_h`` into HBM and of ``keys_d`` into DDR (:func:`placement.plan_arrange`).

        Args:
            pool: rows already read for some non-resident targets (the prefetcher's), used
                instead of reading the store.
            pin: pin every target row that ends resident.
            wanted: a keyset whose rows are evicted last and demoted to DDR first (begin_pass).

        Returns:
            The target keys now resident (pinned with ``pin``).

        Raises:
            StoreError: writing back rows that leave memory failed; nothing changed.
        """
        now = self.clock.now
        if self.admission is not None:  # a keyset's keys not admitted yet stay out of memory
            keys_h, keys_d = admission.admissible(self, keys_h), admission.admissible(self, keys_d)
        plan = placement.plan_arrange(self, keys_h, keys_d, lambda keys: self.pool_or_stage(keys, pool, now), wanted)
        placement.commit(self, plan)
        targets = torch.cat([keys_h, keys_d])
        hs = self.hbm.find(targets)
        (hs_host,) = to_host(hs)  # the one host sync of this step (on a GPU)
        placed = targets[(hs_host >= 0) | (self.ddr.find(targets) >= 0)]
        if pin:  # the resident targets: those placed
            self.pin(targets, 1, hs, hs_host)
        return placed

    def pin(self, keys: torch.Tensor, delta: int, hs: torch.Tensor | None = None,
            hs_host: torch.Tensor | None = None) -> None:
        """Add ``delta`` to the pins of the resident rows of unique CPU ``keys``; ``hs`` (and its
        host copy ``hs_host``): their HBM slots where the caller has them."""
        if keys.numel() == 0:
            return
        if hs is None:
            hs = self.hbm.find(keys)
        if hs.device.type == "cpu":
            in_h = hs >= 0
            self.hbm.add_pins(hs[in_h], delta)
            ds = self.ddr.find(keys[~in_h])
        else:  # masked on the GPU (a boolean-mask selection there is a host sync); one copy back
            self.hbm.add_pins(hs, delta, where=hs >= 0)
            if hs_host is None:
                (hs_host,) = to_host(hs)
            ds = self.ddr.find(keys[hs_host < 0])
        self.ddr.add_pins(ds[ds >= 0], delta)

    def resident(self, keys: torch.Tensor) -> torch.Tensor:
        """Bool [n] (CPU): which of the CPU ``keys`` are in HBM or DDR."""
        return (self.hbm.find(keys).cpu() >= 0) | (self.ddr.find(keys) >= 0)

    def pinned_rows(self) -> int:
        """Rows pinned in either tier (by a pass, a prefetch or a lease)."""
        return self.hbm.pinned_count() + self.ddr.pinned_count()

    # ------------------------------------------------------------------ resizing
    def resize(self, hbm_rows: int, ddr_rows: int) -> None:
        """Give the tiers new capacities, keeping the highest-scored rows (the rest written back).

        The kept rows wait in ordinary host memory while the old tiers are released and the new
        ones allocated, so old and new tiers never coexist (on a GPU, the old HBM tier is handed
        back to the driver before the new one is allocated); the rows are inserted in chunks, so
        the pinned staging of their copy to the GPU stays bounded, and is freed after.
        """
        if (hbm_rows, ddr_rows) == (self.hbm.capacity, self.ddr.capacity):
            return
        hbm_part = self.hbm.read(self.hbm.occupied_slots())
        rows = RowBatch.cat([RowBatch(*(c.cpu() for c in hbm_part._fields())),
                             self.ddr.read(self.ddr.occupied_slots(), pinned=False)])
        del hbm_part
        order = torch.argsort(self.policy.score(rows.freq, rows.last, self.clock), descending=True, stable=True)
        rows = rows.select(order)
        n_keep = min(hbm_rows + ddr_rows, len(rows))
        leaving = rows.select(torch.arange(n_keep, len(rows)))
        placement.write_leaving(self, leaving)  # may raise: nothing changed yet
        rows = rows.select(torch.arange(n_keep))
        self.hbm.release()
        self.ddr.release()
        release_cached_memory(self.device)
        try:
            hbm, ddr = self._tiers(hbm_rows, ddr_rows)
            n_h = min(hbm_rows, n_keep)
            for start in range(0, n_h, STAGE_CHUNK):
                hbm.insert(rows.select(torch.arange(start, min(start + STAGE_CHUNK, n_h))))
            ddr.insert(rows.select(torch.arange(n_h, n_keep)))
        except BaseException:
            # The new tiers did not fit (the old ones are gone): the table goes on with empty
            # tiers, serving from the store, and no update is lost.
            placement.write_leaving(self, rows)
            raise
        finally:
            release_cached_memory(self.device)  # the staging of the inserts
        self.hbm, self.ddr = hbm, ddr
        self.window = self._new_window(self.setting)
        self.reset_mrc()
        placement.forget_leaving(self, leaving.keys, leaving.freq)

    # ------------------------------------------------------------------ rows to the store
    def write_dirty_chunk(self, tier: MemoryTier) -> int:
        """Write up to ``STAGE_CHUNK`` dirty rows of ``tier`` to the store; how many.

        Chunks bound the memory a write-back needs (a copy of the rows, their records and
        RocksDB's write batch) to about three times ``STAGE_CHUNK`` rows, whatever the tiers hold.
        """
        slots = tier.dirty_slots()[:STAGE_CHUNK]
        if slots.numel() == 0:
            return 0
        rows = tier.read(slots)
        expiry.write_leaving_touches(self, rows)  # a stored row always has its touch
        self.rows.write(rows)
        tier.set_dirty(slots, False)
        return int(slots.numel())

    def write_dirty(self) -> None:
        """Write every dirty row to the store (in chunks)."""
        for tier in (self.hbm, self.ddr):
            while self.write_dirty_chunk(tier):
                pass

    def freq_of(self, keys: torch.Tensor) -> torch.Tensor:
        """Aged access frequencies (float32, CPU) of CPU ``keys``: resident rows' own, else the sketch's."""
        freq = self.sketch.estimate(keys).to(torch.float32)
        for tier in (self.hbm, self.ddr):
            slots = tier.find(keys).cpu()
            hit = slots >= 0
            if bool(hit.any()):
                freq[hit] = tier.freq.index_select(0, slots[hit].to(tier.device)).cpu().to(torch.float32)
        return freq

    def _drop_resident(self, keys: torch.Tensor) -> None:
        """Forget memory copies of ``keys`` (unique) without writing them back."""
        for tier in (self.hbm, self.ddr):
            slots = tier.find(keys)
            tier.remove(slots[slots >= 0])
        self.recent = None  # the rows a lookup kept aside may be of these keys

    def _refresh_resident(self, keys: torch.Tensor, records: np.ndarray) -> None:
        """Give the memory copies of ``keys`` (unique) the values of their store ``records``, clean."""
        weights = state = None
        for tier in (self.hbm, self.ddr):
            slots = to_host(tier.find(keys))[0]
            pos = torch.nonzero(slots >= 0).flatten()
            if pos.numel() == 0:
                continue
            if weights is None or state is None:
                weights, state = self.codec.decode(np.ascontiguousarray(records))
            at = slots.index_select(0, pos)
            tier.write(at, weights.index_select(0, pos), state.index_select(0, pos))
            tier.set_dirty(at, False)
        self.recent = None  # the rows a lookup kept aside may be of these keys

    def import_records(self, keys: torch.Tensor, records: np.ndarray, freq: np.ndarray | None,
                       refresh: bool = False) -> None:
        """Replace the rows of unique CPU ``keys`` by store ``records``: memory copies are dropped,
        or with ``refresh`` overwritten in place (clean, as the store now holds them); an imported
        row counts as touched now."""
        self.rows.write_touches(keys.numpy(), np.full(keys.numel(), self.clock.now, dtype=np.int64))
        self.rows.put(keys.numpy(), records)
        if refresh:
            self._refresh_resident(keys, records)
        else:
            self._drop_resident(keys)
        if freq is not None and keys.numel():
            self.sketch.raise_to(keys, torch.as_tensor(np.asarray(freq, dtype=np.float32)))

    def delete(self, keys: torch.Tensor, count: bool = True) -> int:
        """Delete the rows of unique CPU ``keys`` from every tier (pinned ones too), the store and
        the side namespace of touches; how many of them existed (resident or stored; with
        ``count=False`` the store is not read to tell, and 0 is returned)."""
        if keys.numel() == 0:
            return 0
        existed = int((self.rows.stored(keys) | self.resident(keys)).sum()) if count else 0
        expiry.delete_keys(self, keys)
        self.stats.expiry.deleted += existed
        return existed

    def resident_keys(self, tier: Tier) -> torch.Tensor:
        """Keys (int64, CPU) resident in ``tier``."""
        mt = self.hbm if tier is Tier.HBM else self.ddr
        return mt.keys[mt.occupied_slots()].cpu()
