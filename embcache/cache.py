"""EmbeddingCache: embedding tables kept in HBM, DDR and an on-disk store, placed by frequency.

Each row of a table lives in exactly one memory tier (HBM or DDR) or in none; the store holds
every row ever written. A row in memory is authoritative; a dirty row is written back when it
leaves memory (or on :meth:`EmbeddingCache.flush`). A row never written comes from the table's
initializer, a pure function of (seed, key).

Placement. Every lookup counts accesses (aged frequencies, see :mod:`embcache.policy`). Rows
found below HBM are candidates for promotion: they fill free HBM slots, then replace the
lowest-scored HBM rows whose score they beat (admission). Displaced HBM rows and rejected
candidates compete the same way for DDR; what loses there leaves memory. All of this is
planned on scores first, then dirty rows leaving memory are written to the store in one atomic
batch, and only then is memory changed: a failing write (e.g. a full disk) changes nothing.
Planning needs the missed rows' keys and counts, not their values: a lookup that misses memory
for many keys reads them on a reader thread while it plans, and waits for them only to commit
(a failed read fails the lookup before anything moves).

Concurrency model. One re-entrant lock per table serializes that table's operations, store
I/O included (a lookup's overlapped read runs on a reader thread but is joined before the lock
is released); different tables proceed in parallel (torch, numba and the store bindings release
the GIL in their heavy parts). Whole-cache operations (flush, checkpoint, close) take every
table lock in name order. The store itself is shared and thread-safe. On CUDA a table lock
also orders the GPU work of its holders (see ``_TableLock``): background jobs run on the
cache's own stream, and each holder's stream waits for the previous holder's last event.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import math
import os
import shutil
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .config import CacheConfig, TableConfig
from .errors import (
    CacheClosedError,
    CheckpointExistsError,
    ConfigError,
    InvalidGradientError,
    InvalidKeysError,
    InvalidRowsError,
    NonFiniteGradientError,
    PassStateError,
    StoreError,
    StoreLockedError,
    TableConflictError,
    UnknownTableError,
)
from .fused import fused_available, fused_update
from .init import init_rows
from .keys import as_key_tensor
from .keyset import Keyset, as_keysets
from .metrics import LatencyHistogram
from .mrc import MissRatioEstimator
from .optim import OptimizerParams, apply_update, initial_state, state_width
from .policy import Clock, FrequencySketch, Policy, default_halflife, make_policy
from .prefetch import PrefetchFuture
from .stores import Store, open_store
from .tier import MemoryTier, RowBatch, release_cached_memory, resident_row_bytes, to_device, to_host
from .types import Tier, memory_tier

__all__ = ["EmbeddingCache"]

_MANIFEST = "manifest.json"
_FORMAT_VERSION = 1
_LOCK_FILE = "embcache.lock"
_STORE_DIR = "store"
_MIN_SKETCH_WIDTH = 4096
_MAX_SKETCH_WIDTH = 1 << 23  # 4 rows of float32: at most 128 MiB per table
_STAGE_CHUNK = 65536  # rows staged (or written back) per step of a pass or prefetch
# Scores of rows a pass wants (begin_pass): above any policy score, ordered by the pass's counts.
_WANTED_SCORE, _WANTED_STEP = 1e30, 1e15


# Caches still open at interpreter exit are closed (dirty rows written) by an atexit hook, which
# runs before finalization: torch cannot safely make tensors from __del__ while finalizing.
_OPEN_CACHES: weakref.WeakSet[EmbeddingCache] = weakref.WeakSet()


@atexit.register
def _close_open_caches() -> None:
    for cache in list(_OPEN_CACHES):
        try:
            cache.close()
        except Exception as exc:  # pragma: no cover - reported, exit goes on
            print(f"embcache: closing {cache.config.path!r} at exit failed: {exc}", file=sys.stderr)


# the fewest victims _admit asks a tier for at first
_MIN_VICTIMS = 64
# A lookup that misses memory for at least this many distinct keys reads them from the store on a
# reader thread while it plans their placement (see _lookup_below_hbm); fewer are read inline,
# where a thread hand-off (~50-100 us) would cost more than the overlap saves.
_OVERLAP_READ_MIN = 64
# A lookup keeps the rows it read but did not cache for the update that usually follows, up to this
# many (at most _RECENT_MAX_ROWS x record bytes of memory per table, until the next lookup or update).
_RECENT_MAX_ROWS = 65536
_READER_THREADS = 4


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class _Read:
    """Rows read from the store (or created where absent): what a reader thread hands back."""

    found: np.ndarray  # bool [n]: the store had the row
    weights: torch.Tensor
    state: torch.Tensor
    fmask: torch.Tensor  # ``found`` as a tensor
    seconds: float  # time in the store


@dataclass
class _TierStats:
    hits: int = 0
    promotions: int = 0
    demotions: int = 0
    write_backs: int = 0
    seconds: float = 0.0


@dataclass
class _SsdStats:
    hits: int = 0
    created: int = 0
    reads: int = 0
    read_rows: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_rows: int = 0
    write_bytes: int = 0
    seconds: float = 0.0
    read_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    write_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


@dataclass
class _TableStats:
    lookups: int = 0
    updates: int = 0
    assigns: int = 0
    placement_errors: int = 0
    outside_keyset: int = 0
    prefetch_rows: int = 0
    prefetch_seconds: float = 0.0
    passes: int = 0
    pass_wait_seconds: float = 0.0
    hbm: _TierStats = field(default_factory=_TierStats)
    ddr: _TierStats = field(default_factory=_TierStats)
    ssd: _SsdStats = field(default_factory=_SsdStats)


class _TableLock:
    """A table's re-entrant lock, ordered on the GPU as well as on the host.

    The lock orders when GPU work is issued, not when it runs: the background worker (prefetch,
    end-of-pass write-back, on the cache's side stream) and a caller training on a stream of its
    own would otherwise run their kernels on the same rows in any order. On CUDA the outermost
    holder's current stream waits (on the device: no host sync) for an event recorded on the
    previous holder's stream when it left, and records one when it leaves. On the CPU it is a
    plain ``threading.RLock``.
    """

    def __init__(self, device: torch.device) -> None:
        self._lock = threading.RLock()
        self._cuda = device.type == "cuda"
        self._depth = 0  # changed only by the holder
        self._event: Any = None  # torch.cuda.Event recorded by the last holder

    def __enter__(self) -> _TableLock:
        self._lock.acquire()
        self._depth += 1
        if self._cuda and self._depth == 1 and self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._cuda and self._depth == 1:
                event = torch.cuda.Event()
                event.record()  # on this holder's current stream
                self._event = event
        finally:
            self._depth -= 1
            self._lock.release()


class _Table:
    """One table's tiers, policy state and counters (guarded by ``lock``)."""

    def __init__(self, cfg: TableConfig, hbm_rows: int, ddr_rows: int, device: torch.device,
                 config: CacheConfig, policy: Policy) -> None:
        self.cfg = cfg
        self.lock = _TableLock(device)
        self.device = device
        self.policy = policy
        self.state_width = state_width(cfg.optimizer, cfg.dim)
        dtype = cfg.torch_dtype
        self.hbm = MemoryTier(Tier.HBM, hbm_rows, cfg.dim, self.state_width, dtype, device)
        self.ddr = MemoryTier(Tier.DDR, ddr_rows, cfg.dim, self.state_width, dtype, torch.device("cpu"),
                              pinned_reads=device.type == "cuda")
        memory_rows = hbm_rows + ddr_rows
        halflife = config.halflife if config.halflife is not None else default_halflife(memory_rows)
        self.clock = Clock(halflife if policy.aging else math.inf)
        width = config.sketch_width or min(max(_next_pow2(8 * memory_rows), _MIN_SKETCH_WIDTH), _MAX_SKETCH_WIDTH)
        self.sketch = FrequencySketch(width, device=torch.device("cpu"))
        self.weight_bytes = cfg.dim * torch.empty(0, dtype=dtype).element_size()
        self.record_bytes = self.weight_bytes + 4 * self.state_width
        self.params = OptimizerParams(lr=cfg.lr, eps=float(cfg.eps or 0.0), beta1=cfg.beta1, beta2=cfg.beta2,
                                      weight_decay=cfg.weight_decay)
        # Eviction sampling draws from seeded generators of its own, one per device (a CUDA
        # cache's DDR tier is on the host): never from torch's global generators, which are
        # unseeded here and are the user's random stream.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(cfg.seed & 0x7FFFFFFF)
        self.host_generator = self.generator
        if device.type != "cpu":
            self.host_generator = torch.Generator()
            self.host_generator.manual_seed(cfg.seed & 0x7FFFFFFF)
        # victims each tier gave up in its last admission (the first guess of the next; see _admit)
        self.last_swaps: dict[Tier, int] = {}
        self.stats = _TableStats()
        # keys written to the store while a prefetch reads it outside the lock (see _prefetch_table)
        self.write_log: list[torch.Tensor] = []
        # Store writes of this table so far, and the rows the last lookup read from the store but
        # did not cache, as of write ``recent_writes``: a training step's update of the same keys
        # takes them from here instead of reading them again (see _stage_for_update).
        self.store_writes = 0
        self.recent: RowBatch | None = None
        self.recent_writes = -1
        self.log_watchers = 0
        self.mrc: MissRatioEstimator | None = None
        self.reset_mrc(config)
        self.pass_keyset: Keyset | None = None
        self.pass_pinned = torch.empty(0, dtype=torch.int64)

    def reset_mrc(self, config: CacheConfig) -> None:
        """(Re)start the miss-ratio-curve estimator for the current tier capacities."""
        if self.mrc is not None:
            self.mrc.close()
            self.mrc = None
        rows = (self.hbm.capacity, self.ddr.capacity)
        if config.mrc_sample_rate != 0 and self.policy.name in ("lrfu", "lfu") and sum(rows) > 0:
            self.mrc = MissRatioEstimator(*rows, halflife=config.halflife if self.policy.aging else math.inf,
                                          rate=config.mrc_sample_rate, idle_halving=config.idle_halving)

    def scores_of(self, tier: MemoryTier) -> Any:
        """A callback giving the policy's scores of resident rows of ``tier`` at ``slots``."""
        def score(slots: torch.Tensor) -> torch.Tensor:
            return self.policy.score(tier.freq.index_select(0, slots), tier.last.index_select(0, slots),
                                     self.clock)
        return score

    def encode(self, rows: RowBatch) -> tuple[np.ndarray, np.ndarray]:
        """Keys (int64 [n]) and store records (uint8 [n, record_bytes]) of ``rows``."""
        n = len(rows)
        w = rows.weights.detach().to("cpu").contiguous().view(torch.uint8).reshape(n, self.weight_bytes)
        s = rows.state.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).reshape(n, -1)
        return rows.keys.cpu().numpy(), torch.cat([w, s], dim=1).numpy()

    def decode(self, records: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights (storage dtype [n, dim]) and state (float32 [n, S]) from store records."""
        rec = torch.from_numpy(records)
        n = rec.shape[0]
        w = rec[:, :self.weight_bytes].contiguous().view(self.cfg.torch_dtype).reshape(n, self.cfg.dim)
        s = rec[:, self.weight_bytes:].contiguous().view(torch.float32).reshape(n, self.state_width)
        return w, s


class EmbeddingCache:
    """Embedding tables in a hierarchy of HBM, DDR and an on-disk store.

    Args:
        config: tiers, store and policy (see :class:`~embcache.CacheConfig`).
        tables: tables to serve. Tables already in the store at ``config.path`` are reopened;
            a table given here must agree with its stored definition in dim, optimizer, dtype
            and initializer (learning rate and other hyper-parameters may change).

    Raises:
        ConfigError: a table is given twice, or the configuration is invalid.
        TableConflictError: a table conflicts with its stored definition.
        StoreLockedError: another process (or open cache) holds ``config.path``.
        StoreError: the store could not be opened.
    """

    def __init__(self, config: CacheConfig, tables: Sequence[TableConfig] = ()) -> None:
        self._config = config
        self._closed = True
        self._lock_fd: int | None = None
        self._store: Store | None = None
        os.makedirs(config.path, exist_ok=True)
        self._acquire_path_lock()
        try:
            self._store = open_store(config.store, os.path.join(config.path, _STORE_DIR), **dict(config.store_options))
            self._tables: dict[str, _Table] = {}
            self._global_lock = threading.RLock()
            self._device = config.torch_device
            self._policy = make_policy(config.policy, config.admission, config.idle_halving)
            self._worker: ThreadPoolExecutor | None = None
            self._side_stream: Any = None  # the worker's CUDA stream (made on first use)
            self._readers: ThreadPoolExecutor | None = None  # store reads overlapped with placement
            self._reader_lock = threading.Lock()
            self._prefetches: list[PrefetchFuture] = []  # pass prefetches the next begin_pass adopts
            # unfinished prefetches: when each was submitted (monotonic seconds) and its tables
            self._live: dict[PrefetchFuture, tuple[float, frozenset[str]]] = {}
            self._pass_active = False
            self._open_tables(list(tables))
        except BaseException:
            self._release()
            raise
        self._closed = False
        _OPEN_CACHES.add(self)

    # ------------------------------------------------------------------ opening and closing
    def _acquire_path_lock(self) -> None:
        path = os.path.join(self._config.path, _LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(
                f"store path {self._config.path!r} is held by another process or open cache (pid {holder}); "
                "close it first or use another path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _release(self) -> None:
        try:
            if self._store is not None:
                store, self._store = self._store, None
                store.close()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # closing the descriptor drops the flock
                self._lock_fd = None

    def _open_tables(self, given: list[TableConfig]) -> None:
        assert self._store is not None
        names = [t.name for t in given]
        if len(set(names)) != len(names):
            raise ConfigError(f"table names must be unique, got {names}")
        raw = self._store.get_meta("tables")
        stored = {d["name"]: TableConfig.from_dict(d) for d in json.loads(raw)} if raw else {}
        merged = dict(stored)
        for cfg in given:
            old = stored.get(cfg.name)
            if old is not None and old.layout_conflicts(cfg):
                diffs = ", ".join(f"{f}: stored {getattr(old, f)!r}, given {getattr(cfg, f)!r}"
                                  for f in old.layout_conflicts(cfg))
                raise TableConflictError(f"table {cfg.name!r} conflicts with its stored definition ({diffs})")
            merged[cfg.name] = cfg
        configs = [merged[n] for n in sorted(merged)]
        for cfg in configs:
            hbm_rows, ddr_rows = self._tier_rows(cfg, configs)
            self._add_table(cfg, hbm_rows, ddr_rows)
        self._store.put_meta("tables", json.dumps([c.to_dict() for c in configs]).encode())

    def _tier_rows(self, cfg: TableConfig, configs: Sequence[TableConfig]) -> tuple[int, int]:
        """HBM and DDR rows of ``cfg`` when the tiers' bytes are divided among ``configs`` by memory_share."""
        shares = sum(c.memory_share for c in configs) or 1.0
        row_bytes = resident_row_bytes(cfg.dim, cfg.torch_dtype, state_width(cfg.optimizer, cfg.dim))
        frac = cfg.memory_share / shares
        return (int(self._config.resolved_hbm_bytes() * frac) // row_bytes,
                int(self._config.resolved_ddr_bytes() * frac) // row_bytes)

    def _add_table(self, cfg: TableConfig, hbm_rows: int, ddr_rows: int) -> None:
        assert self._store is not None
        t = _Table(cfg, hbm_rows, ddr_rows, self._device, self._config, self._policy)
        self._store.open_table(cfg.name, t.record_bytes)
        sketch = self._store.get_meta(f"sketch/{cfg.name}")
        if sketch:
            t.sketch.load_bytes(sketch)
        clock = self._store.get_meta(f"clock/{cfg.name}")
        if clock:
            t.clock.load(json.loads(clock))
        self._tables[cfg.name] = t

    def create_table(self, cfg: TableConfig) -> bool:
        """Add a table while the cache runs; the tiers' memory is divided again among all tables.

        Idempotent: an equal definition under the same name changes nothing. The definition is
        stored, so the table is there when the store is reopened. Rows of other tables that no
        longer fit their smaller share are written back to the store (the least used first).

        Returns:
            True if the table was created, False if an equal one exists.

        Raises:
            TableConflictError: a table of that name exists with another definition.
            PassStateError: rows are pinned (a pass, prefetch or lease is active).
            ConfigError: ``cfg`` is not a TableConfig.
            CacheClosedError, StoreError (nothing changed).
        """
        if not isinstance(cfg, TableConfig):
            raise ConfigError(f"create_table takes a TableConfig, got {type(cfg).__name__}")
        with self._all_tables():
            if self._closed:
                raise CacheClosedError("the cache is closed")
            old = self._tables.get(cfg.name)
            if old is not None:
                if old.cfg == cfg:
                    return False
                diffs = ", ".join(f"{f.name}: existing {getattr(old.cfg, f.name)!r}, given {getattr(cfg, f.name)!r}"
                                  for f in dataclasses.fields(cfg) if getattr(old.cfg, f.name) != getattr(cfg, f.name))
                raise TableConflictError(f"table {cfg.name!r} exists with another definition ({diffs})")
            if any(t.hbm.pinned_count() or t.ddr.pinned_count() for t in self._tables.values()):
                raise PassStateError("tables cannot be added while rows are pinned; end the pass and release "
                                     "prefetches and leases first")
            assert self._store is not None
            configs = [*(t.cfg for t in self._tables.values()), cfg]
            for t in list(self._tables.values()):
                self._resize(t, *self._tier_rows(t.cfg, configs))
            self._add_table(cfg, *self._tier_rows(cfg, configs))
            self._store.put_meta("tables", json.dumps([c.to_dict() for c in sorted(configs, key=lambda c: c.name)])
                                 .encode())
        return True

    def _resize(self, t: _Table, hbm_rows: int, ddr_rows: int) -> None:
        """Give a table's tiers new capacities, keeping its highest-scored rows (the rest written back).

        The kept rows wait in ordinary host memory while the old tiers are released and the new
        ones allocated, so old and new tiers never coexist (on a GPU, the old HBM tier is handed
        back to the driver before the new one is allocated); the rows are inserted in chunks, so
        the pinned staging of their copy to the GPU stays bounded, and is freed after.
        """
        if (hbm_rows, ddr_rows) == (t.hbm.capacity, t.ddr.capacity):
            return
        cpu = torch.device("cpu")
        hbm_part = t.hbm.read(t.hbm.occupied_slots())
        rows = RowBatch.cat([RowBatch(*(c.cpu() for c in hbm_part._fields())),
                             t.ddr.read(t.ddr.occupied_slots(), pinned=False)])
        del hbm_part
        order = torch.argsort(t.policy.score(rows.freq, rows.last, t.clock), descending=True, stable=True)
        rows = rows.select(order)
        n_keep = min(hbm_rows + ddr_rows, len(rows))
        leaving = rows.select(torch.arange(n_keep, len(rows)))
        self._write_store(t, leaving.select(leaving.dirty))  # may raise: nothing changed yet
        rows = rows.select(torch.arange(n_keep))
        t.hbm.release()
        t.ddr.release()
        release_cached_memory(t.device)
        try:
            hbm = MemoryTier(Tier.HBM, hbm_rows, t.cfg.dim, t.state_width, t.cfg.torch_dtype, t.device)
            ddr = MemoryTier(Tier.DDR, ddr_rows, t.cfg.dim, t.state_width, t.cfg.torch_dtype, cpu,
                             pinned_reads=t.device.type == "cuda")
            n_h = min(hbm_rows, n_keep)
            for start in range(0, n_h, _STAGE_CHUNK):
                hbm.insert(rows.select(torch.arange(start, min(start + _STAGE_CHUNK, n_h))))
            ddr.insert(rows.select(torch.arange(n_h, n_keep)))
        except BaseException:
            # The new tiers did not fit (the old ones are gone): the table goes on with empty
            # tiers, serving from the store, and no update is lost.
            self._write_store(t, rows.select(rows.dirty))
            raise
        finally:
            release_cached_memory(t.device)  # the staging of the inserts
        t.hbm, t.ddr = hbm, ddr
        t.reset_mrc(self._config)
        if len(leaving):
            t.sketch.raise_to(leaving.keys, leaving.freq)

    def close(self) -> None:
        """Write every dirty row and the frequency state back, then release the store. Idempotent."""
        if self._closed:
            return
        self._stop_worker()
        with self._all_tables():
            if self._closed:
                return
            try:
                self._flush_locked(save_frequencies=True)
            finally:
                self._closed = True
                _OPEN_CACHES.discard(self)
                for t in self._tables.values():
                    if t.mrc is not None:
                        t.mrc.close()
                    t.hbm.release()  # flushed: the memory goes now, not when the cache is collected
                    t.ddr.release()
                release_cached_memory(self._device)
                if self._readers is not None:  # idle: every read is joined under its table's lock
                    self._readers.shutdown(wait=True)
                    self._readers = None
                self._release()

    def _stop_worker(self) -> None:
        """Cancel staging jobs and wait for the worker (queued write-backs still run)."""
        with self._global_lock:
            live, worker, self._worker = list(self._live), self._worker, None
        for fut in live:
            fut.cancel()
        if worker is not None:
            worker.shutdown(wait=True)

    def __enter__(self) -> EmbeddingCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten close must not leave the path locked in this process
        if getattr(self, "_closed", True) is False and not sys.is_finalizing():
            try:
                self.close()
            except Exception:
                pass

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def config(self) -> CacheConfig:
        """The configuration this cache runs with."""
        return self._config

    @property
    def device(self) -> torch.device:
        """Device of the HBM tier; lookups return rows there."""
        return self._device

    def tables(self) -> dict[str, TableConfig]:
        """The tables this cache serves, by name."""
        return {name: t.cfg for name, t in self._tables.items()}

    def row_bytes(self, table: str) -> int:
        """Bytes of memory one resident row of ``table`` costs (weights, optimizer state, bookkeeping, key index)."""
        return self._table(table).hbm.row_bytes

    def capacity_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` each memory tier can hold: ``{"hbm": n, "ddr": m}``."""
        t = self._table(table)
        return {"hbm": t.hbm.capacity, "ddr": t.ddr.capacity}

    # ------------------------------------------------------------------ validation
    def _table(self, name: str) -> _Table:
        if self._closed:
            raise CacheClosedError("the cache is closed; open a new EmbeddingCache on the same path to continue")
        try:
            return self._tables[name]
        except (KeyError, TypeError):
            raise UnknownTableError(f"unknown table {name!r}; tables: {sorted(self._tables)}") from None

    def _keys(self, keys: Any) -> torch.Tensor:
        return self._keys_both(keys)[1]

    def _keys_both(self, keys: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The checked keys as given (host or device) and on the cache's device.

        The copy to a GPU is asynchronous; a caller's pinned buffer may be reused once the call
        returns, as every public call synchronizes with the device after it (a lookup's hit
        count, an update's finite check or ``unique``) before returning.
        """
        keys = as_key_tensor(keys, self._config.max_batch_keys)
        if keys.device.type not in ("cpu", self._device.type):
            raise InvalidKeysError(f"keys are on {keys.device}; allowed: cpu or {self._device}")
        return keys, to_device(keys, self._device)

    def _rows_arg(self, what: str, values: Any, n: int, dim: int,
                  err: type[InvalidGradientError] | type[InvalidRowsError]) -> torch.Tensor:
        if not isinstance(values, torch.Tensor):
            if isinstance(values, np.ndarray):
                values = torch.from_numpy(values)
            else:
                raise err(f"{what} must be a float tensor of shape [{n}, {dim}], got {type(values).__name__}")
        if not values.dtype.is_floating_point:
            raise err(f"{what} must be floating point (float32 preferred), got dtype {values.dtype}")
        if tuple(values.shape) != (n, dim):
            raise err(f"{what} must have shape [{n}, {dim}] (one row per key, dim {dim}), got {tuple(values.shape)}")
        if values.device.type not in ("cpu", self._device.type):
            raise err(f"{what} are on {values.device}; allowed: cpu or {self._device}")
        return to_device(values.to(torch.float32), self._device)

    # ------------------------------------------------------------------ lookup
    def lookup(self, table: str, keys: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``keys``: float32 [n, dim] on the cache's device.

        Args:
            table: table name.
            keys: int64 [n] (any integer dtype; tensor, numpy array or sequence); duplicates allowed.
            out: optional float32 [n, dim] tensor on the cache's device to write into (saves an
                allocation per batch).

        Raises:
            UnknownTableError, InvalidKeysError, BatchTooLargeError, CacheClosedError,
            StoreError (the store failed; nothing changed).
        """
        t = self._table(table)
        given, keys = self._keys_both(keys)
        n, dim = keys.numel(), t.cfg.dim
        if out is None:
            out = torch.empty(n, dim, dtype=torch.float32, device=self._device)
        elif out.shape != (n, dim) or out.dtype != torch.float32 or out.device != self._device:
            raise InvalidRowsError(f"out must be float32 [{n}, {dim}] on {self._device}")
        if n == 0:
            return out
        with t.lock:
            self._table(table)  # closed while waiting for the lock?
            t0 = time.perf_counter()
            now, inc = t.clock.now, t.clock.increment()
            # probe, count the hits and their accesses, copy their rows into out: one pass
            slots, n_hit = t.hbm.find_touch_gather(keys, inc, now, out)
            t.stats.hbm.seconds += time.perf_counter() - t0
            if n_hit < n and self._device.type == "cpu":
                miss_pos = torch.nonzero(slots < 0).flatten()
                ukeys, inverse, counts = torch.unique(keys.index_select(0, miss_pos), return_inverse=True,
                                                      return_counts=True)
                values = self._lookup_below_hbm(t, ukeys, counts, inc, now)
                out.index_copy_(0, miss_pos, values.index_select(0, inverse))
            elif n_hit < n:
                # On a GPU, one host sync for the missed keys: the host knows how many missed, so
                # their positions come from a stable sort of the hit mask (no nonzero), and the
                # keys, which the host needs anyway (DDR, the store), are deduplicated there
                # (torch.unique on the GPU would sync to size its output, then again to copy).
                miss_pos = torch.argsort((slots >= 0).to(torch.uint8), stable=True)[:n - n_hit]
                (miss_keys,) = to_host(keys.index_select(0, miss_pos))
                ukeys, inverse, counts = torch.unique(miss_keys, return_inverse=True, return_counts=True)
                values = self._lookup_below_hbm(t, ukeys, counts, inc, now)
                out.index_copy_(0, miss_pos, values.index_select(0, to_device(inverse, self._device)))
            t.stats.lookups += n
            t.stats.hbm.hits += n_hit
            if t.mrc is not None:
                t.mrc.observe(given)  # host keys when the caller gave them: no copy back from the GPU
            self._advance_clock(t, n)
        return out

    def lookup_many(self, keys: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Rows of several tables in one call: ``{table: keys [n]} -> {table: float32 [n, dim]}``.

        One round trip for a remote cache (:class:`embcache.Client`); here, one lookup per table.
        Every table is validated before any is read.

        Raises:
            The errors of :meth:`lookup`.
        """
        for name in keys:
            self._table(name)
        return {name: self.lookup(name, k) for name, k in keys.items()}

    def _lookup_below_hbm(self, t: _Table, ukeys: torch.Tensor, counts: torch.Tensor, inc: float,
                          now: int) -> torch.Tensor:
        """Values (float32 [u, dim], cache device) of unique keys missing from HBM; places them."""
        t1 = time.perf_counter()
        cpu_keys, cpu_counts = to_host(ukeys, counts)
        if t.pass_keyset is not None:
            t.stats.outside_keyset += int(cpu_counts[~t.pass_keyset.contains(cpu_keys)].sum())
        dslots = t.ddr.find(cpu_keys)
        in_ddr = dslots >= 0
        values = torch.empty(ukeys.numel(), t.cfg.dim, dtype=torch.float32, pin_memory=self._device.type == "cuda")
        d_hits = 0  # counted once the lookup cannot fail any more (a failed one counts no hits)
        d_pos = torch.nonzero(in_ddr).flatten()
        d_slots = dslots.index_select(0, d_pos)
        if d_slots.numel():
            values.index_copy_(0, d_pos, t.ddr.weights.index_select(0, d_slots).to(torch.float32))
            d_counts = cpu_counts.index_select(0, d_pos)
            t.ddr.touch(d_slots, d_counts.to(torch.float64) * inc, now)
            d_hits = int(d_counts.sum())
        t.stats.ddr.seconds += time.perf_counter() - t1
        s_pos = torch.nonzero(~in_ddr).flatten()
        s_keys, s_counts = cpu_keys.index_select(0, s_pos), cpu_counts.index_select(0, s_pos)
        complete: Callable[[], None] | None = None
        if s_keys.numel() >= _OVERLAP_READ_MIN:
            # The store read runs on a reader thread (the store bindings release the GIL) while
            # this one plans the placement, which needs the rows' keys and counts but not their
            # values; _place waits for the read only to commit. (Before: read, then plan.)
            read = self._reader_pool().submit(self._read_decode, t, s_keys)
            staged = self._stage_meta(t, s_keys, s_counts, inc, now, torch.empty(s_keys.numel(), 0),
                                      torch.empty(s_keys.numel(), 0))
            done = False

            def finish() -> None:  # idempotent; a failed read raises its StoreError every time
                nonlocal done
                if not done:
                    self._finish_stage(t, staged, s_counts, read.result())
                    done = True
            complete = finish
        else:
            staged = self._stage(t, s_keys, s_counts, inc, now)
        failed: StoreError | None = None
        t.recent = None
        try:
            uncached = self._place(t, d_slots, staged, complete)
        except StoreError as exc:
            failed = exc
        if complete is not None:
            complete()  # a failed read raises here: the lookup fails, and no row moved
        if failed is None and 0 < len(uncached) <= _RECENT_MAX_ROWS:
            t.recent, t.recent_writes = uncached, t.store_writes
        if failed is not None:
            # A lookup's rows are already served; only their caching failed (e.g. a full disk
            # refused the write-back of a displaced dirty row). Nothing moved: keep serving.
            t.stats.placement_errors += 1
            if t.stats.placement_errors == 1:
                warnings.warn(f"embcache: table {t.cfg.name!r}: rows could not be cached: {failed}", stacklevel=3)
        values.index_copy_(0, s_pos, staged.weights.to(torch.float32))
        t.stats.ddr.hits += d_hits
        return to_device(values, self._device)

    def _reader_pool(self) -> ThreadPoolExecutor:
        with self._reader_lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(_READER_THREADS, thread_name_prefix="embcache-read")
            return self._readers

    def _stage(self, t: _Table, keys: torch.Tensor, counts: torch.Tensor | None, inc: float,
               now: int) -> RowBatch:
        """Rows of (unique, CPU) ``keys`` not in memory: read from the store or created.

        With ``counts``, the accesses are counted (sketch and ssd hits); without, nothing is counted.
        """
        if keys.numel() == 0:
            return self._stage_meta(t, keys, None, inc, now, torch.empty(0, t.cfg.dim, dtype=t.cfg.torch_dtype),
                                    torch.empty(0, t.state_width, dtype=torch.float32))
        read = self._read_decode(t, keys)
        rows = self._stage_meta(t, keys, counts, inc, now, read.weights, read.state)
        self._finish_stage(t, rows, counts, read)
        return rows

    @staticmethod
    def _stage_meta(t: _Table, keys: torch.Tensor, counts: torch.Tensor | None, inc: float, now: int,
                    weights: torch.Tensor, state: torch.Tensor) -> RowBatch:
        """Clean rows of ``keys`` with ``weights`` and ``state``, their frequencies from the sketch
        (with ``counts``, this access is added first)."""
        n = keys.numel()
        if n and counts is not None:
            freq = t.sketch.add_and_estimate(keys, counts.to(torch.float64) * inc)
        else:
            freq = t.sketch.estimate(keys) if n else torch.empty(0, dtype=torch.float64)
        return RowBatch(keys, weights, state, freq, torch.full((n,), now, dtype=torch.int64),
                        torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.int32))

    def _finish_stage(self, t: _Table, rows: RowBatch, counts: torch.Tensor | None, read: _Read) -> None:
        """Give staged ``rows`` the values ``read`` and count the read (and, with ``counts``, the hits)."""
        rows.weights, rows.state = read.weights, read.state
        self._count_read(t, read.found, read.seconds)
        if counts is not None:
            n_found = int(counts[read.fmask].sum())
            t.stats.ssd.hits += n_found
            t.stats.ssd.created += int(counts.sum()) - n_found

    def _read_decode(self, t: _Table, keys: torch.Tensor) -> _Read:
        """Read (unique, CPU, non-empty) ``keys`` from the store and decode or create their rows.

        Touches no cache state (not even stats), so a reader thread may run it beside the
        thread that holds the table's lock.
        """
        found, records, seconds = self._get_records(t, keys)
        weights, state, fmask = self._decode_or_create(t, keys, found, records)
        return _Read(found, weights, state, fmask, seconds)

    @staticmethod
    def _decode_or_create(t: _Table, keys: torch.Tensor, found: np.ndarray,
                          records: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weights, state and found-mask of ``keys``: decoded where the store had them, else initialized.

        Pure (no table state touched), so the prefetcher runs it outside the table's lock.
        """
        n = keys.numel()
        found = np.asarray(found, dtype=bool)
        fmask = torch.from_numpy(found)
        n_found = int(found.sum())
        if n_found == n:  # the common case: decode copies the records into fresh tensors
            weights, state = t.decode(records)
            return weights, state, fmask
        weights = torch.empty(n, t.cfg.dim, dtype=t.cfg.torch_dtype)
        state = torch.empty(n, t.state_width, dtype=torch.float32)
        if n_found:
            f_pos = torch.nonzero(fmask).flatten()
            w, st = t.decode(records[found])
            weights.index_copy_(0, f_pos, w)
            state.index_copy_(0, f_pos, st)
        new_pos = torch.nonzero(~fmask).flatten()
        weights.index_copy_(0, new_pos, init_rows(t.cfg.initializer, float(t.cfg.init_scale or 0.0), t.cfg.seed,
                                                  keys.index_select(0, new_pos), t.cfg.dim, t.cfg.torch_dtype))
        state.index_copy_(0, new_pos, initial_state(t.cfg.optimizer, t.cfg.dim, n - n_found, torch.device("cpu"),
                                                    t.cfg.initial_accumulator_value))
        return weights, state, fmask

    def _read_store(self, t: _Table, keys: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        found, records, seconds = self._get_records(t, keys)
        self._count_read(t, found, seconds)
        return found, records

    def _get_records(self, t: _Table, keys: torch.Tensor) -> tuple[np.ndarray, np.ndarray, float]:
        assert self._store is not None
        t0 = time.perf_counter()
        found, records = self._store.get_many(t.cfg.name, keys.numpy())
        return np.asarray(found, dtype=bool), records, time.perf_counter() - t0

    @staticmethod
    def _count_read(t: _Table, found: np.ndarray, seconds: float) -> None:
        st = t.stats.ssd
        n_found = int(found.sum())
        st.reads += 1
        st.read_rows += n_found
        st.read_bytes += n_found * t.record_bytes
        st.seconds += seconds
        st.read_latency.observe(seconds)

    def _write_store(self, t: _Table, rows: RowBatch) -> None:
        if len(rows) == 0:
            return
        assert self._store is not None
        t0 = time.perf_counter()
        keys, records = t.encode(rows)
        t.store_writes += 1  # before the write: even a failed one may have changed what a cached read saw
        self._store.put_many(t.cfg.name, keys, records)
        if t.log_watchers:  # a prefetch is reading the store without the lock: tell it what changed
            t.write_log.append(torch.from_numpy(keys.copy()))
        st = t.stats.ssd
        st.writes += 1
        st.write_rows += len(rows)
        st.write_bytes += records.nbytes
        dt = time.perf_counter() - t0
        st.seconds += dt
        st.write_latency.observe(dt)

    def _advance_clock(self, t: _Table, n: int) -> None:
        factor = t.clock.advance(n)
        if factor is not None:
            t.hbm.scale_freq(factor)
            t.ddr.scale_freq(factor)
            t.sketch.scale(factor)

    # ------------------------------------------------------------------ placement
    def _admit(self, t: _Table, tier: MemoryTier, cand_scores: torch.Tensor, extra_free: int,
               exclude: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan which candidates enter ``tier``: (candidate indices admitted, victim slots displaced).

        Candidates fill free slots best-first, then replace the lowest-scored rows they beat.
        """
        n = cand_scores.numel()
        if n == 0 or tier.capacity == 0:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64, device=tier.device)
        order = torch.argsort(cand_scores, descending=True, stable=True)
        free = min(tier.free + extra_free, n)
        want = min(n - free, tier.capacity)
        victims = torch.empty(0, dtype=torch.int64, device=tier.device)
        swaps = 0
        if want > 0:
            # Few candidates beat a resident row (~1.5% of HBM's at 1% HBM on Zipf 1.1), so ask
            # first for about as many victims as last time, and for all ``want`` only when each
            # of those was beaten: choosing 2x the need instead of ``want`` halved lowest()'s cost.
            k = min(want, max(_MIN_VICTIMS, 2 * t.last_swaps.get(tier.tier, want))) if t.policy.admission else want
            while True:
                victims, vscores = tier.lowest(k, t.scores_of(tier), self._config.eviction_sample, exclude,
                                               t.generator if tier.device == t.device else t.host_generator)
                m = victims.numel()
                if t.policy.admission and m:
                    # candidates descend and victims ascend, so the winners form a prefix
                    beats = cand_scores[order[free:free + m]] > vscores.cpu()
                    swaps = int(beats.sum())
                else:
                    swaps = m
                if swaps < m or m < k or k == want:
                    break
                k = want
            t.last_swaps[tier.tier] = swaps
            victims = victims[:swaps]
        return order[:free + swaps], victims

    def _place(self, t: _Table, ddr_cands: torch.Tensor, staged: RowBatch,
               complete: Callable[[], None] | None = None) -> RowBatch:
        """Move rows between tiers after an access (see the module docstring).

        Args:
            ddr_cands: DDR slots (unique) of rows just accessed: candidates for promotion to HBM.
            staged: rows from below memory (CPU), candidates for HBM, then DDR.
            complete: when given, ``staged`` holds clean rows whose weights and state are still
                being read; planning uses only their keys and counts, and ``complete()`` fills
                the values in before anything moves.

        Returns:
            The staged rows that stayed out of memory (copies).

        Raises:
            StoreError: writing back rows that leave memory (or completing ``staged``) failed;
                nothing moved.
        """
        n_d = ddr_cands.numel()
        if n_d == 0 and len(staged) == 0:
            return staged
        if complete is not None and bool(staged.dirty.any()):
            raise RuntimeError("rows still being read cannot be dirty")  # a bug in the caller
        d_scores = t.policy.score(t.ddr.freq[ddr_cands], t.ddr.last[ddr_cands], t.clock)
        s_scores = t.policy.score(staged.freq, staged.last, t.clock)
        # 1. HBM: promote the best of (DDR rows accessed, staged rows)
        admitted_h, victims_h = self._admit(t, t.hbm, torch.cat([d_scores, s_scores]), 0, None)
        from_ddr = admitted_h[admitted_h < n_d]
        from_staged = admitted_h[admitted_h >= n_d] - n_d
        promote_slots = ddr_cands[from_ddr]
        staged_left = torch.ones(len(staged), dtype=torch.bool)
        staged_left[from_staged] = False
        rest = torch.nonzero(staged_left).flatten()  # staged rows HBM did not take
        # 2. DDR: rows displaced from HBM and staged rows HBM did not take, ranked on their counts
        hv_rows = t.hbm.read(victims_h).to(torch.device("cpu"))
        n_hv = len(hv_rows)
        c_scores = t.policy.score(torch.cat([hv_rows.freq, staged.freq.index_select(0, rest)]),
                                  torch.cat([hv_rows.last, staged.last.index_select(0, rest)]), t.clock)
        # rows leaving DDR for HBM make room but are not victims (slots, not a capacity-sized mask)
        exclude = promote_slots if promote_slots.numel() else None
        admitted_d, victims_d = self._admit(t, t.ddr, c_scores, promote_slots.numel(), exclude)
        cand_in = torch.zeros(n_hv + rest.numel(), dtype=torch.bool)
        cand_in[admitted_d] = True
        hv_in, rest_in = cand_in[:n_hv], cand_in[n_hv:]
        dv_rows = t.ddr.read(victims_d)
        hv_out, s_out = hv_rows.select(~hv_in), rest[~rest_in]
        # 3. persist what leaves memory dirty; a failure here leaves everything as it was
        out = [dv_rows, hv_out] if complete is not None else [dv_rows, hv_out, staged.select(s_out)]
        leaving = RowBatch.cat(out)
        self._write_store(t, leaving.select(leaving.dirty))
        if complete is not None:
            complete()  # the staged rows' values: the read ran while the lines above planned
        # 4. commit the moves
        p_rows = t.ddr.read(promote_slots)
        t.hbm.remove(victims_h)
        t.ddr.remove(torch.cat([promote_slots, victims_d]))
        t.hbm.insert(RowBatch.cat([p_rows, staged.select(from_staged)]))
        t.ddr.insert(RowBatch.cat([hv_rows.select(hv_in), staged.select(rest[rest_in])]))
        out_keys = torch.cat([dv_rows.keys, hv_out.keys, staged.keys.index_select(0, s_out)])
        if out_keys.numel():
            t.sketch.raise_to(out_keys, torch.cat([dv_rows.freq, hv_out.freq, staged.freq.index_select(0, s_out)]))
        t.stats.hbm.promotions += len(admitted_h)
        t.stats.hbm.demotions += n_hv
        t.stats.hbm.write_backs += int(hv_out.dirty.sum())
        t.stats.ddr.promotions += int(rest_in.sum())
        t.stats.ddr.demotions += len(dv_rows)
        t.stats.ddr.write_backs += int(dv_rows.dirty.sum())
        return staged.select(s_out)

    # ------------------------------------------------------------------ updates
    def apply_gradients(self, table: str, keys: Any, grads: torch.Tensor) -> None:
        """Apply the table's optimizer to the rows of ``keys``; gradients of duplicate keys are summed.

        Args:
            table: table name.
            keys: int64 [n] (duplicates allowed).
            grads: floating [n, dim] on the cache's device or the CPU.

        Raises:
            UnknownTableError, InvalidKeysError, InvalidGradientError,
            NonFiniteGradientError (NaN/inf, unless ``reject_nonfinite=False``), BatchTooLargeError,
            CacheClosedError, StoreError (nothing changed).
        """
        t, keys, grads = self._checked_gradients(table, keys, grads)
        self._apply_checked(t, keys, grads)

    def _checked_gradients(self, table: str, keys: Any, grads: Any) -> tuple[_Table, torch.Tensor, torch.Tensor]:
        t = self._table(table)
        keys = self._keys(keys)
        grads = self._rows_arg("gradients", grads, keys.numel(), t.cfg.dim, InvalidGradientError)
        if self._config.reject_nonfinite and not _all_finite(grads):
            raise NonFiniteGradientError(f"gradients of table {table!r} contain NaN or inf; nothing was applied "
                                         "(pass reject_nonfinite=False to allow)")
        return t, keys, grads

    def _apply_checked(self, t: _Table, keys: torch.Tensor, grads: torch.Tensor) -> None:
        if keys.numel() == 0:
            return
        with t.lock:
            self._table(t.cfg.name)
            hbm = t.hbm
            if hbm.capacity and fused_available(hbm.weights):
                # CPU: probe every key (no sort); when all are in HBM (a pass's steady state), one
                # fused kernel dedups, sums and updates in place (embcache/fused.py)
                slots = hbm.find(keys)
                if bool((slots >= 0).all()):
                    fused_update(t.cfg.optimizer, t.params, hbm.weights, hbm.state, hbm.dirty, slots,
                                 grads.to(torch.float32), hbm.fused_scratch())
                    t.stats.updates += keys.numel()
                    return
            if self._device.type == "cpu":
                ukeys, inverse = torch.unique(keys, return_inverse=True)
                gsum = torch.zeros(ukeys.numel(), t.cfg.dim, dtype=torch.float32, device=self._device)
                gsum.index_add_(0, inverse, grads)
            else:  # no atomics: the same sums on every run (see _segment_sum)
                ukeys, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
                gsum = _segment_sum(grads, inverse, counts)
            hslots = hbm.find(ukeys)
            if hbm.capacity and bool((hslots >= 0).all()):
                # every row in HBM: update in place, nothing to stage or place
                w = hbm.weights.index_select(0, hslots).to(torch.float32)
                new_w, new_s = apply_update(t.cfg.optimizer, t.params, w, hbm.state.index_select(0, hslots), gsum)
                hbm.weights.index_copy_(0, hslots, new_w.to(hbm.weights.dtype))
                hbm.state.index_copy_(0, hslots, new_s)
                hbm.dirty.index_fill_(0, hslots, True)
            else:
                def update(weights: torch.Tensor, state: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
                    # One rule for every tier: rows of DDR and from the store are updated where
                    # HBM's are (on a GPU: its torch ops, not the CPU kernel, which rounds
                    # differently), so a row's next value never depends on its tier.
                    dev = gsum.device
                    return apply_update(t.cfg.optimizer, t.params, to_device(weights.to(torch.float32), dev),
                                        to_device(state, dev), gsum[to_device(index, dev)])

                self._modify(t, ukeys, update, hslots=hslots)
            t.stats.updates += keys.numel()

    def apply_gradients_many(self, updates: Mapping[str, tuple[Any, torch.Tensor]]) -> None:
        """Apply gradients to several tables: ``{table: (keys [n], grads [n, dim])}``.

        Every table's input is validated before any is changed; each table's update is atomic.

        Raises:
            The errors of :meth:`apply_gradients`.
        """
        checked = [self._checked_gradients(name, k, g) for name, (k, g) in updates.items()]
        for t, k, g in checked:
            self._apply_checked(t, k, g)

    def assign(self, table: str, keys: Any, rows: torch.Tensor) -> None:
        """Overwrite the rows of ``keys`` and reset their optimizer state; the last duplicate wins.

        Args:
            table: table name.
            keys: int64 [n].
            rows: floating [n, dim], finite.

        Raises:
            UnknownTableError, InvalidKeysError, InvalidRowsError, BatchTooLargeError,
            CacheClosedError, StoreError (nothing changed).
        """
        t = self._table(table)
        keys = self._keys(keys)
        rows = self._rows_arg("rows", rows, keys.numel(), t.cfg.dim, InvalidRowsError)
        if not _all_finite(rows):
            raise InvalidRowsError("rows contain NaN or inf; nothing was assigned")
        if keys.numel() == 0:
            return
        ukeys, inverse = torch.unique(keys, return_inverse=True)
        position = torch.arange(keys.numel(), device=self._device)
        last = torch.zeros(ukeys.numel(), dtype=torch.int64, device=self._device)
        last.scatter_reduce_(0, inverse, position, reduce="amax", include_self=False)
        new_rows = rows[last]

        def overwrite(weights: torch.Tensor, state: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
            init = initial_state(t.cfg.optimizer, t.cfg.dim, index.numel(), state.device,
                                 t.cfg.initial_accumulator_value)
            return new_rows[to_device(index, new_rows.device)].to(weights.device), init

        with t.lock:
            self._table(table)
            self._modify(t, ukeys, overwrite, read_store=False)
            t.stats.assigns += keys.numel()

    def _modify(self, t: _Table, ukeys: torch.Tensor, fn: Any, read_store: bool = True,
                hslots: torch.Tensor | None = None) -> None:
        """Replace rows of unique ``ukeys`` by ``fn(weights, state, index) -> (weights, state)``.

        Resident rows change in place; the rest are staged (read or created), changed and placed.
        On a store failure the resident rows are restored and the error re-raised.
        """
        if hslots is None:
            hslots = t.hbm.find(ukeys)
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
        dslots = t.ddr.find(rest_keys)
        in_d = dslots >= 0
        d_idx, d_slots = rest_idx[in_d], dslots[in_d]
        s_idx = rest_idx[~in_d]
        undo = []
        for tier, slots, idx in ((t.hbm, h_slots, h_idx), (t.ddr, d_slots, d_idx)):
            if slots.numel():
                # advanced indexing copies: these are the old rows, kept to undo a failed placement
                old = (tier.weights[slots], tier.state[slots], tier.dirty[slots])
                w, s = fn(old[0], old[1], idx)
                tier.write(slots, w, s)
                undo.append((tier, slots, old))
        skeys = rest_keys[~in_d]
        if skeys.numel() == 0:  # every row was in memory: nothing to stage or place
            return
        now = t.clock.now
        if read_store:
            staged = self._stage_for_update(t, skeys, now)
        else:
            n = skeys.numel()
            staged = RowBatch(skeys, torch.empty(n, t.cfg.dim, dtype=t.cfg.torch_dtype),
                              torch.empty(n, t.state_width), t.sketch.estimate(skeys) if n else
                              torch.empty(0, dtype=torch.float64), torch.full((n,), now, dtype=torch.int64),
                              torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.int32))
        if len(staged):
            w, s = fn(staged.weights, staged.state, s_idx)
            w, s = to_host(w, s)
            staged.weights, staged.state = w.to(t.cfg.torch_dtype), s
            staged.dirty = torch.ones(len(staged), dtype=torch.bool)
        try:
            self._place(t, torch.empty(0, dtype=torch.int64), staged)
        except BaseException:
            for tier, slots, (w, s, d) in undo:
                tier.weights[slots] = w
                tier.state[slots] = s
                tier.dirty[slots] = d
            raise

    # ------------------------------------------------------------------ passes and prefetch
    def _worker_pool(self) -> ThreadPoolExecutor:
        with self._global_lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embcache-prefetch")
            return self._worker

    def _background(self) -> Any:
        """Context for the worker's jobs: on CUDA, the cache's side stream (ordered with callers
        by the table locks' events), not the stream the worker thread happens to have."""
        if self._device.type != "cuda":
            return contextlib.nullcontext()
        with self._global_lock:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self._device)
        return torch.cuda.stream(self._side_stream)

    def _checked_keysets(self, keysets: Mapping[str, Any]) -> dict[str, Keyset]:
        if self._closed:
            raise CacheClosedError("the cache is closed")
        ks = as_keysets(keysets)
        for name in ks:
            self._table(name)
        return ks

    def prefetch(self, keysets: Mapping[str, Any]) -> PrefetchFuture:
        """Stage the rows of the next pass in the background; returns a future.

        Rows of ``keysets`` not in memory are read from the store (or created) on a background
        worker, most frequent first, and placed in free HBM slots, then in DDR (evicting rows no
        pass or lease pins), then over unpinned HBM rows; whatever does not fit stays on disk.
        Staged and already-resident keyset rows are pinned until the next :meth:`begin_pass`
        (which adopts them) or until the future is cancelled or released. Lookups and updates go
        on meanwhile and stay correct: a row changed while it was being read is read again.

        Args:
            keysets: ``{table: Keyset or keys}`` (raw keys are counted; counts order the staging).

        Returns:
            A :class:`~embcache.prefetch.PrefetchFuture`; its result is
            ``{table: {"staged_rows", "leased_rows", "seconds"}}``; its error (e.g. StoreError)
            is raised again by the next ``begin_pass``.

        Raises:
            UnknownTableError, InvalidKeysError, CacheClosedError.
        """
        ks = self._checked_keysets(keysets)
        fut = self._submit_prefetch(ks)
        with self._global_lock:
            self._prefetches.append(fut)
        return fut

    def prefetch_batch(self, keysets: Mapping[str, Any]) -> PrefetchFuture:
        """Stage the rows one upcoming batch will look up, and lease them until ``release()``.

        Like :meth:`prefetch`, but the pins are held until the returned future's ``release()``
        or ``cancel()`` (not adopted by ``begin_pass``). :class:`~embcache.prefetch.LookAhead`
        manages these leases for a data loader.

        Raises:
            UnknownTableError, InvalidKeysError, CacheClosedError.
        """
        return self._submit_prefetch(self._checked_keysets(keysets))

    def _submit_prefetch(self, ks: dict[str, Keyset]) -> PrefetchFuture:
        fut = PrefetchFuture(self._release_prefetch)

        def job() -> None:
            out: dict[str, dict[str, float]] = {}
            try:
                with self._background():
                    for name, keyset in ks.items():
                        if fut.stopping:
                            break
                        out[name] = self._prefetch_table(self._tables[name], keyset, fut)
            except BaseException as exc:
                fut._finish(error=exc)
            else:
                fut._finish(out)
            finally:
                _trim_heap()

        with self._global_lock:
            self._live[fut] = (time.monotonic(), frozenset(ks))

        def forget(_: object) -> None:
            with self._global_lock:
                self._live.pop(fut, None)

        fut.add_done_callback(forget)
        self._worker_pool().submit(job)
        return fut

    def _release_prefetch(self, fut: PrefetchFuture) -> None:
        for t in self._tables.values():
            with t.lock:
                keys = fut.pinned.pop(t.cfg.name, [])
                if keys and not self._closed:
                    self._pin(t, torch.cat(keys), -1)

    def _pin(self, t: _Table, keys: torch.Tensor, delta: int, hs: torch.Tensor | None = None,
             hs_host: torch.Tensor | None = None) -> None:
        """Add ``delta`` to the pins of the resident rows of unique CPU ``keys``; ``hs`` (and its
        host copy ``hs_host``): their HBM slots where the caller has them."""
        if keys.numel() == 0:
            return
        if hs is None:
            hs = t.hbm.find(keys)
        if hs.device.type == "cpu":
            in_h = hs >= 0
            t.hbm.add_pins(hs[in_h], delta)
            ds = t.ddr.find(keys[~in_h])
        else:  # masked on the GPU (a boolean-mask selection there is a host sync); one copy back
            t.hbm.add_pins(hs, delta, where=hs >= 0)
            if hs_host is None:
                (hs_host,) = to_host(hs)
            ds = t.ddr.find(keys[hs_host < 0])
        t.ddr.add_pins(ds[ds >= 0], delta)

    @staticmethod
    def _resident(t: _Table, keys: torch.Tensor) -> torch.Tensor:
        """Bool [n] (CPU): which of the CPU ``keys`` are in HBM or DDR."""
        return (t.hbm.find(keys).cpu() >= 0) | (t.ddr.find(keys) >= 0)

    def _pin_for(self, fut: PrefetchFuture, t: _Table, keys: torch.Tensor) -> None:
        if keys.numel():
            self._pin(t, keys, 1)
            fut.pinned.setdefault(t.cfg.name, []).append(keys.clone())

    def _prefetch_table(self, t: _Table, ks: Keyset, fut: PrefetchFuture) -> dict[str, float]:
        """Stage one table's keyset in chunks; the store is read without the table's lock."""
        assert self._store is not None
        t0 = time.perf_counter()
        order = ks.hottest_first()
        with t.lock:
            if self._closed:
                raise CacheClosedError("the cache was closed during a prefetch")
            resident = self._resident(t, order)
            if fut.stopping:
                return {"staged_rows": 0, "leased_rows": 0, "seconds": 0.0}
            self._pin_for(fut, t, order[resident])
            room = t.hbm.capacity + t.ddr.capacity - t.hbm.pinned_count() - t.ddr.pinned_count()
            todo = order[~resident][:max(room, 0)]
        leased, staged = int(resident.sum()), 0
        for start in range(0, todo.numel(), _STAGE_CHUNK):
            chunk = todo[start:start + _STAGE_CHUNK]
            with t.lock:
                if fut.stopping or self._closed:
                    break
                t.log_watchers += 1
                mark = len(t.write_log)
            try:
                t_read = time.perf_counter()
                found, records = self._store.get_many(t.cfg.name, chunk.numpy())
                weights, state, fmask = self._decode_or_create(t, chunk, found, records)
                read_seconds = time.perf_counter() - t_read
            finally:
                with t.lock:
                    written = t.write_log[mark:]
                    t.log_watchers -= 1
                    if t.log_watchers == 0:
                        t.write_log.clear()
            with t.lock:
                if fut.stopping or self._closed:
                    break
                ssd = t.stats.ssd
                ssd.reads += 1
                ssd.read_rows += int(fmask.sum())
                ssd.read_bytes += int(fmask.sum()) * t.record_bytes
                ssd.seconds += read_seconds
                ssd.read_latency.observe(read_seconds)
                resident = self._resident(t, chunk)  # looked up or updated meanwhile: memory is authoritative
                self._pin_for(fut, t, chunk[resident])
                leased += int(resident.sum())
                keep = ~resident
                if written:  # written back while we read: our copy may be stale, read it again
                    stale = torch.isin(chunk, torch.cat(written)) & keep
                    if bool(stale.any()):
                        f2, r2 = self._read_store(t, chunk[stale])
                        w2, s2, _ = self._decode_or_create(t, chunk[stale], f2, r2)
                        weights[stale], state[stale] = w2, s2
                keys = chunk[keep]
                n = keys.numel()
                rows = self._stage_meta(t, keys, None, 0.0, t.clock.now, weights[keep], state[keep])
                # free HBM first, then DDR over unpinned rows, then HBM over unpinned rows
                a = min(n, t.hbm.free)
                b = min(n - a, t.ddr.capacity - t.ddr.pinned_count())
                c = min(n - a - b, t.hbm.capacity - t.hbm.pinned_count() - t.hbm.free)
                if a + b + c == 0:
                    break
                keys_h = torch.cat([keys[:a], keys[a + b:a + b + c]])
                placed = self._arrange(t, keys_h, keys[a:a + b], pool=rows, pin=True)
                if placed.numel():
                    fut.pinned.setdefault(t.cfg.name, []).append(placed)
                staged += placed.numel()
        seconds = time.perf_counter() - t0
        with t.lock:
            t.stats.prefetch_rows += staged
            t.stats.prefetch_seconds += seconds
        return {"staged_rows": staged, "leased_rows": leased, "seconds": seconds}

    def begin_pass(self, keysets: Mapping[str, Any]) -> dict[str, dict[str, int]]:
        """Make a pass's keyset resident (the most frequent rows in HBM) and pin it until :meth:`end_pass`.

        Waits for the outstanding :meth:`prefetch` jobs and adopts what they staged; keys they
        did not stage are read now (the slow path without prefetch). When the keyset is larger
        than the unpinned room of HBM and DDR, its most frequent keys are kept; lookups of the
        others, and of keys outside the keyset, still work (from disk) and are counted
        (``stats()[table]["pass"]["outside_keyset"]`` counts the latter).

        Args:
            keysets: ``{table: Keyset or keys}``.

        Returns:
            ``{table: {"keyset_rows": n, "pinned_rows": m}}``.

        Raises:
            PassStateError: a pass is already active.
            The error of a failed prefetch (its pins are released; calling again stages synchronously).
            UnknownTableError, InvalidKeysError, CacheClosedError, StoreError (nothing pinned).
        """
        ks = self._checked_keysets(keysets)
        with self._global_lock:
            if self._pass_active:
                raise PassStateError("a pass is already active; call end_pass() before begin_pass()")
            pending, self._prefetches = self._prefetches, []
        error: BaseException | None = None
        wait_from = time.perf_counter()
        for f in pending:
            try:
                f.result()
            except CancelledError:
                pass
            except BaseException as exc:
                error = error or exc
        waited = time.perf_counter() - wait_from
        if error is not None:
            for f in pending:
                f.release()
            raise error
        report: dict[str, dict[str, int]] = {}
        with self._all_tables():
            if self._closed:
                raise CacheClosedError("the cache is closed")
            if self._pass_active:
                raise PassStateError("a pass is already active; call end_pass() before begin_pass()")
            for f in pending:  # adopt: the pass pins these rows itself below
                f.release()
            try:
                for name, keyset in ks.items():
                    t = self._tables[name]
                    t.stats.passes += 1
                    t.stats.pass_wait_seconds += waited
                    t.pass_keyset = keyset
                    t.pass_pinned = self._begin_table(t, keyset)
                    report[name] = {"keyset_rows": len(keyset), "pinned_rows": int(t.pass_pinned.numel())}
            except BaseException:
                for t in self._tables.values():
                    self._pin(t, t.pass_pinned, -1)
                    t.pass_pinned, t.pass_keyset = torch.empty(0, dtype=torch.int64), None
                raise
            self._pass_active = True
        return report

    def _begin_table(self, t: _Table, ks: Keyset) -> torch.Tensor:
        """Arrange one table for a pass (hottest keys in HBM, the next in DDR) and pin; the keys pinned."""
        order = ks.hottest_first()
        h = max(t.hbm.capacity - t.hbm.pinned_count(), 0)
        d = max(t.ddr.capacity - t.ddr.pinned_count(), 0)
        order = order[:h + d]
        empty = torch.empty(0, dtype=torch.int64)
        pinned = [empty]
        try:
            for part, to_hbm in ((order[:h], True), (order[h:], False)):
                for start in range(0, part.numel(), _STAGE_CHUNK):
                    chunk = part[start:start + _STAGE_CHUNK]
                    pinned.append(self._arrange(t, chunk if to_hbm else empty, empty if to_hbm else chunk,
                                                pin=True, wanted=ks))
        except BaseException:
            self._pin(t, torch.cat(pinned), -1)
            raise
        return torch.cat(pinned)

    def end_pass(self) -> Future:  # type: ignore[type-arg]
        """Unpin the pass's rows and write dirty rows back in the background.

        Returns:
            A future of the number of rows written back (errors, e.g. StoreError, surface there;
            rows that failed to write stay dirty in memory, nothing is lost).

        Raises:
            PassStateError: no pass is active.
            CacheClosedError.
        """
        with self._all_tables():
            if self._closed:
                raise CacheClosedError("the cache is closed")
            if not self._pass_active:
                raise PassStateError("no pass is active; call begin_pass(keysets) first")
            for t in self._tables.values():
                self._pin(t, t.pass_pinned, -1)
                t.pass_pinned, t.pass_keyset = torch.empty(0, dtype=torch.int64), None
            self._pass_active = False
        fut: Future = Future()  # type: ignore[type-arg]

        def job() -> None:
            try:
                with self._background():
                    written = sum(self._write_back(t) for t in list(self._tables.values()))
                fut.set_result(written)
            except BaseException as exc:
                fut.set_exception(exc)
            finally:
                _trim_heap()

        self._worker_pool().submit(job)
        return fut

    def _write_back(self, t: _Table) -> int:
        """Write one table's dirty rows to the store in chunks, taking the lock per chunk."""
        written = 0
        for tier in (t.hbm, t.ddr):
            while True:
                with t.lock:
                    if self._closed:
                        return written
                    n = self._write_dirty_chunk(t, tier)
                if n == 0:
                    break
                written += n
        return written

    def _write_dirty_chunk(self, t: _Table, tier: MemoryTier) -> int:
        """Write up to ``_STAGE_CHUNK`` dirty rows of ``tier`` to the store (lock held); how many.

        Chunks bound the memory a write-back needs (a copy of the rows, their records and
        RocksDB's write batch) to about three times ``_STAGE_CHUNK`` rows, whatever the tiers hold.
        """
        slots = tier.dirty_slots()[:_STAGE_CHUNK]
        if slots.numel() == 0:
            return 0
        self._write_store(t, tier.read(slots))
        tier.dirty[slots] = False
        return int(slots.numel())

    def _boosted_scores(self, t: _Table, keys: torch.Tensor, freq: torch.Tensor, last: torch.Tensor,
                        wanted: Keyset | None) -> torch.Tensor:
        """Policy scores, with rows of ``wanted`` above every other row (ordered by their counts)."""
        scores = t.policy.score(freq, last, t.clock)
        if wanted is None or len(wanted) == 0 or keys.numel() == 0:
            return scores
        ckeys = keys.cpu()
        pos = torch.searchsorted(wanted.keys, ckeys).clamp_(max=len(wanted) - 1)
        member = to_device(wanted.keys[pos] == ckeys, scores.device)
        boost = to_device(_WANTED_SCORE + wanted.counts[pos].to(torch.float64) * _WANTED_STEP, scores.device)
        return torch.where(member, boost, scores)

    def _boosted_scores_of(self, t: _Table, tier: MemoryTier, wanted: Keyset | None) -> Any:
        """A callback (for :meth:`MemoryTier.lowest`) giving :meth:`_boosted_scores` of ``tier``'s rows at ``slots``."""
        def score(slots: torch.Tensor) -> torch.Tensor:
            return self._boosted_scores(t, tier.keys.index_select(0, slots), tier.freq.index_select(0, slots),
                                        tier.last.index_select(0, slots), wanted)
        return score

    def _arrange(self, t: _Table, keys_h: torch.Tensor, keys_d: torch.Tensor, pool: RowBatch | None = None,
                 pin: bool = False, wanted: Keyset | None = None) -> torch.Tensor:
        """Move the rows of ``keys_h`` into HBM and of ``keys_d`` into DDR, as far as unpinned room allows.

        Args:
            keys_h, keys_d: unique CPU keys, disjoint, each hottest first. When pinned rows leave
                too little room, HBM's coldest targets go to DDR instead, and DDR's stay on disk.
            pool: rows already read for some non-resident targets (the prefetcher's), used
                instead of reading the store.
            pin: pin every target row that ends resident.
            wanted: a keyset whose rows are evicted last and demoted to DDR first (begin_pass).

        Returns:
            The target keys now resident (pinned with ``pin``).

        Raises:
            StoreError: writing back rows that leave memory failed; nothing changed.
        """
        cpu = torch.device("cpu")
        hbm, ddr = t.hbm, t.ddr
        now = t.clock.now
        sample = self._config.eviction_sample
        # 1. HBM: make room for targets not there yet, evicting unpinned non-targets (lowest first)
        hs = hbm.find(keys_h).cpu()
        up = torch.nonzero(hs < 0).flatten()
        ds_up = ddr.find(keys_h[up])
        victims_h = torch.empty(0, dtype=torch.int64, device=hbm.device)
        evict_h = up.numel() - hbm.free
        over_keys = torch.empty(0, dtype=torch.int64)
        over_ds = over_keys
        if evict_h > 0:
            excl = hs[hs >= 0]  # targets already in HBM stay
            victims_h, _ = hbm.lowest(evict_h, self._boosted_scores_of(t, hbm, wanted), sample, excl,
                                      t.generator if hbm.device == t.device else None)
            keep = up.numel() - (evict_h - victims_h.numel())
            over_keys, over_ds = keys_h[up[keep:]], ds_up[keep:]
            up, ds_up = up[:keep], ds_up[:keep]
        from_d = ds_up >= 0
        d_slots_up = ds_up[from_d]
        stage_h = keys_h[up[~from_d]]
        # 2. DDR targets: HBM's overflow first (hotter), then keys_d not in HBM
        hs_d = hbm.find(keys_d).cpu()
        kd = keys_d[hs_d < 0]
        keys_d2 = torch.cat([over_keys, kd])
        ds2 = torch.cat([over_ds, ddr.find(kd)])
        stage_d = keys_d2[ds2 < 0]
        staged = self._pool_or_stage(t, torch.cat([stage_h, stage_d]), pool, now)
        n_sh = stage_h.numel()
        staged_h = staged.select(torch.arange(n_sh))
        staged_d = staged.select(torch.arange(n_sh, len(staged)))
        hv = hbm.read(victims_h).to(cpu)
        hv_req = torch.isin(hv.keys, keys_d) if len(hv) else torch.zeros(0, dtype=torch.bool)
        optional = hv.select(~hv_req)
        if len(optional):
            order = torch.argsort(self._boosted_scores(t, optional.keys, optional.freq, optional.last, wanted),
                                  descending=True, stable=True)
            optional = optional.select(order)
        n_req_hv = int(hv_req.sum())
        cands = RowBatch.cat([hv.select(hv_req), staged_d, optional])
        n_required = n_req_hv + len(staged_d)
        room = ddr.free + d_slots_up.numel()
        victims_d = torch.empty(0, dtype=torch.int64)
        if n_required > room:
            excl_d = torch.cat([d_slots_up, ds2[ds2 >= 0]])  # rows moving up, and DDR targets already there
            victims_d, _ = ddr.lowest(n_required - room, self._boosted_scores_of(t, ddr, wanted), sample, excl_d)
            room += victims_d.numel()
        n_in = min(room, len(cands))
        into_d = cands.select(torch.arange(n_in))
        dv = ddr.read(victims_d)
        leaving = RowBatch.cat([dv, cands.select(torch.arange(n_in, len(cands)))])
        # 3. persist what leaves memory dirty; a failure here leaves everything as it was
        self._write_store(t, leaving.select(leaving.dirty))
        # 4. commit the moves
        p_rows = ddr.read(d_slots_up)
        hbm.remove(victims_h)
        ddr.remove(torch.cat([d_slots_up, victims_d]))
        hbm.insert(RowBatch.cat([p_rows, staged_h]))
        ddr.insert(into_d)
        if len(leaving):
            t.sketch.raise_to(leaving.keys, leaving.freq)
        st = t.stats
        st.hbm.promotions += d_slots_up.numel() + len(staged_h)
        st.hbm.demotions += len(hv)
        st.ddr.promotions += max(0, min(n_in, n_required) - n_req_hv)
        st.ddr.demotions += len(dv)
        st.ddr.write_backs += int(dv.dirty.sum())
        st.hbm.write_backs += int(cands.dirty[n_in:].sum()) if len(cands) > n_in else 0
        # 5. pin
        targets = torch.cat([keys_h, keys_d])
        hs = t.hbm.find(targets)
        (hs_host,) = to_host(hs)  # the one host sync of this step (on a GPU)
        placed = targets[(hs_host >= 0) | (t.ddr.find(targets) >= 0)]
        if pin:  # the resident targets: those placed
            self._pin(t, targets, 1, hs, hs_host)
        return placed

    def _stage_for_update(self, t: _Table, keys: torch.Tensor, now: int) -> RowBatch:
        """Rows of non-resident ``keys`` about to change: from the last lookup's uncached rows where
        the store has not been written since (a training step updates the rows it just looked up),
        else staged. The kept rows serve this one update and are dropped."""
        recent, t.recent = t.recent, None
        if recent is None or t.recent_writes != t.store_writes:
            return self._stage(t, keys, None, 0.0, now)
        pool = self._stage_meta(t, recent.keys, None, 0.0, now, recent.weights, recent.state)
        return self._pool_or_stage(t, keys, pool, now)

    def _pool_or_stage(self, t: _Table, keys: torch.Tensor, pool: RowBatch | None, now: int) -> RowBatch:
        """Rows of non-resident ``keys`` (in order): from ``pool`` where it has them, else staged (not counted)."""
        if pool is None or len(pool) == 0 or keys.numel() == 0:
            return self._stage(t, keys, None, 0.0, now)
        sorted_keys, order = torch.sort(pool.keys)
        pos = torch.searchsorted(sorted_keys, keys).clamp_(max=sorted_keys.numel() - 1)
        hit = sorted_keys[pos] == keys
        merged = RowBatch.cat([pool.select(order[pos[hit]]), self._stage(t, keys[~hit], None, 0.0, now)])
        perm = torch.cat([torch.nonzero(hit).flatten(), torch.nonzero(~hit).flatten()])
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        return merged.select(inverse)

    # ------------------------------------------------------------------ persistence
    @contextmanager
    def _all_tables(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(self._global_lock)
            for name in sorted(self._tables):
                stack.enter_context(self._tables[name].lock)
            yield

    def _flush_locked(self, save_frequencies: bool) -> None:
        assert self._store is not None
        for name in sorted(self._tables):
            t = self._tables[name]
            for tier in (t.hbm, t.ddr):
                while self._write_dirty_chunk(t, tier):
                    pass
            if save_frequencies:
                for tier in (t.hbm, t.ddr):
                    slots = tier.occupied_slots()
                    if slots.numel():
                        t.sketch.raise_to(tier.keys[slots].cpu(), tier.freq[slots].cpu())
                self._store.put_meta(f"sketch/{name}", t.sketch.to_bytes())
                self._store.put_meta(f"clock/{name}", json.dumps(t.clock.state()).encode())
        self._store.flush()
        _trim_heap()

    def flush(self) -> None:
        """Write every dirty row to the store and make it durable (survives kill -9 and power loss).

        Raises:
            CacheClosedError, StoreError (rows stay dirty in memory; retry later).
        """
        if self._closed:
            raise CacheClosedError("the cache is closed")
        with self._all_tables():
            if self._closed:
                raise CacheClosedError("the cache is closed")
            self._flush_locked(save_frequencies=False)

    def checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Write a consistent snapshot of all tiers (rows, optimizer state, frequencies) to ``directory``.

        Args:
            directory: must not exist or be empty. It receives ``store/`` (a copy of the store:
                RocksDB's checkpoint or an LMDB copy) and ``manifest.json``.

        Raises:
            CheckpointExistsError: ``directory`` is not empty.
            CacheClosedError, StoreError.
        """
        directory = os.fspath(directory)
        if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
            raise CheckpointExistsError(f"checkpoint directory {directory!r} exists and is not empty; "
                                        "pass a new or empty directory")
        if self._closed:
            raise CacheClosedError("the cache is closed")
        with self._all_tables():
            if self._closed:
                raise CacheClosedError("the cache is closed")
            assert self._store is not None
            self._flush_locked(save_frequencies=True)
            os.makedirs(directory, exist_ok=True)
            self._store.checkpoint(os.path.join(directory, _STORE_DIR))
            manifest = {
                "format": _FORMAT_VERSION,
                "store": self._config.store,
                "tables": [self._tables[n].cfg.to_dict() for n in sorted(self._tables)],
                "clocks": {n: self._tables[n].clock.state() for n in sorted(self._tables)},
                "created_unix": time.time(),
            }
            tmp = os.path.join(directory, _MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(directory, _MANIFEST))

    @classmethod
    def restore(cls, directory: str | os.PathLike[str], config: CacheConfig,
                tables: Sequence[TableConfig] = ()) -> EmbeddingCache:
        """Open a cache at ``config.path`` holding the checkpoint in ``directory``.

        The capacities and policy come from ``config`` (any sizes); a checkpoint made with one
        store backend can be restored into the other.

        Raises:
            ConfigError: ``directory`` holds no checkpoint, or ``config.path`` already holds a store.
        """
        directory = os.fspath(directory)
        try:
            with open(os.path.join(directory, _MANIFEST)) as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{directory!r} holds no embcache checkpoint ({_MANIFEST} missing)") from None
        if manifest.get("format") != _FORMAT_VERSION:
            raise ConfigError(f"checkpoint format {manifest.get('format')!r} is not supported (want {_FORMAT_VERSION})")
        target = os.path.join(config.path, _STORE_DIR)
        if os.path.exists(target) and os.listdir(target):
            raise ConfigError(f"restore target {config.path!r} already holds a store; pass an empty path")
        source = os.path.join(directory, _STORE_DIR)
        os.makedirs(config.path, exist_ok=True)
        if manifest["store"] == config.store:
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            _copy_store(manifest, source, config, target)
        return cls(config, tables)

    # ------------------------------------------------------------------ stats
    # ------------------------------------------------------------------ moving rows between caches
    def export_rows(self, table: str, select: Callable[[np.ndarray], np.ndarray],
                    batch_rows: int = 65536, keys: np.ndarray | None = None
                    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every stored row of ``table`` whose key ``select`` picks, whole: records and frequencies.

        The table's dirty rows are written back first, so the store holds every row (a row that
        was never written holds its initializer's values, which any cache recreates alike). The
        caller keeps writes to the selected keys out until the iteration ends (the parameter
        server refuses them while it migrates them).

        Args:
            table: table name.
            select: ``keys (int64 [m]) -> bool [m]``: which keys to export.
            batch_rows: store rows scanned (or, with ``keys``, read) per batch.
            keys: read only these keys (int64, unique) instead of scanning the whole store.

        Yields:
            ``(keys int64 [k], records uint8 [k, record_bytes], freq float32 [k])`` (the store's
            record format: weights then optimizer state; freq: the aged access frequency).

        Raises:
            UnknownTableError, CacheClosedError, StoreError.
        """
        t = self._table(table)
        assert self._store is not None
        with t.lock:
            for tier in (t.hbm, t.ddr):
                while self._write_dirty_chunk(t, tier):
                    pass
        batches = self._store.scan(table, batch_rows) if keys is None else self._read_keys(table, keys, batch_rows)
        for found, records in batches:
            mask = np.asarray(select(found), dtype=bool)
            if not mask.any():
                continue
            picked = torch.from_numpy(found[mask])
            with t.lock:
                freq = t.sketch.estimate(picked).to(torch.float32)
                for tier in (t.hbm, t.ddr):
                    slots = tier.find(picked).cpu()
                    hit = slots >= 0
                    if bool(hit.any()):
                        freq[hit] = tier.freq.index_select(0, slots[hit].to(tier.device)).cpu().to(torch.float32)
            yield found[mask], records[mask], freq.numpy()

    def _read_keys(self, table: str, keys: np.ndarray,
                   batch_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The stored records of ``keys`` (those the store holds), in batches: a scan of just them."""
        assert self._store is not None
        keys = np.asarray(keys, dtype=np.int64)
        for start in range(0, keys.shape[0], batch_rows):
            part = keys[start:start + batch_rows]
            found, records = self._store.get_many(table, part)
            found = np.asarray(found, dtype=bool)
            if found.any():
                yield part[found], np.asarray(records)[found]

    def _drop_resident(self, t: _Table, keys: torch.Tensor) -> None:
        """Forget memory copies of ``keys`` (unique) without writing them back (lock held)."""
        for tier in (t.hbm, t.ddr):
            slots = tier.find(keys)
            tier.remove(slots[slots >= 0])
        t.store_writes += 1  # the rows a lookup kept aside (t.recent) may be of these keys

    def import_rows(self, table: str, keys: Any, records: np.ndarray, freq: np.ndarray | None = None) -> None:
        """Replace the rows of ``keys`` with ``records`` (from another cache's :meth:`export_rows`).

        Memory copies of those keys are dropped (not written back) and the records written to
        the store; their frequencies are raised to ``freq``.

        Args:
            table: table name (same dim, optimizer and dtype as the exporting table).
            keys: int64 [n], unique.
            records: uint8 [n, record_bytes].
            freq: float [n] aged access frequencies (optional).

        Raises:
            UnknownTableError, InvalidKeysError (duplicates), InvalidRowsError (record shape),
            CacheClosedError, StoreFullError, StoreError.
        """
        t = self._table(table)
        k = as_key_tensor(keys, self._config.max_batch_keys).cpu()
        if torch.unique(k).numel() != k.numel():
            raise InvalidKeysError(f"import_rows: keys of table {table!r} must be unique")
        records = np.ascontiguousarray(records, dtype=np.uint8)
        if records.shape != (k.numel(), t.record_bytes):
            raise InvalidRowsError(f"import_rows: records of table {table!r} must be uint8 [{k.numel()}, "
                                   f"{t.record_bytes}], got {list(records.shape)}; nothing was imported")
        if freq is not None and np.shape(freq) != (k.numel(),):
            raise InvalidRowsError(f"import_rows: freq must have shape [{k.numel()}], got {list(np.shape(freq))}")
        assert self._store is not None
        with t.lock:
            if self._closed:
                raise CacheClosedError("the cache is closed")
            self._store.put_many(table, k.numpy(), records)
            self._drop_resident(t, k)
            if t.log_watchers:
                t.write_log.append(k.clone())
            if freq is not None and k.numel():
                t.sketch.raise_to(k, torch.as_tensor(np.asarray(freq, dtype=np.float32)))

    def delete_rows(self, table: str, keys: Any) -> None:
        """Delete the rows of ``keys`` from every tier and the store (e.g. after they moved to another shard).

        A later lookup of such a key creates its row afresh.

        Raises:
            UnknownTableError, InvalidKeysError, CacheClosedError, StoreError.
        """
        t = self._table(table)
        k = torch.unique(as_key_tensor(keys, self._config.max_batch_keys).cpu())
        assert self._store is not None
        with t.lock:
            if self._closed:
                raise CacheClosedError("the cache is closed")
            self._store.delete_many(table, k.numpy())
            self._drop_resident(t, k)
            if t.log_watchers:
                t.write_log.append(k.clone())

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters and occupancy per table and tier (plain dicts; see DESIGN.md).

        ``lookups`` = hbm hits + ddr hits + ssd hits + ssd created (per key occurrence).
        Each tier's ``misses`` are the key occurrences that reached it and were not served there:
        ``hbm`` = lookups - hbm hits; ``ddr`` = occurrences that went on to the store (ssd hits +
        created); ``ssd`` = rows created on first touch. So a tier's hits + misses = the misses of
        the tier above (``lookups`` for HBM). Each is a sum of counters that only grow.
        """
        out: dict[str, dict[str, Any]] = {}
        now = time.monotonic()
        with self._global_lock:
            live = list(self._live.values())
        for name in sorted(self._tables):
            t = self._tables[name]
            # age of the oldest unfinished prefetch (queued or staging) that includes this table
            running = max((now - t0 for t0, names in live if name in names), default=0.0)
            with t.lock:
                s = t.stats
                # key occurrences not served by each tier (a failed lookup counts neither its
                # lookups nor any tier's hits, so these never go down)
                misses = {"hbm": s.lookups - s.hbm.hits, "ddr": s.ssd.hits + s.ssd.created}
                tiers: dict[str, Any] = {}
                for tier, ts in ((t.hbm, s.hbm), (t.ddr, s.ddr)):
                    tiers[tier.tier.value] = {
                        "hits": ts.hits, "misses": misses[tier.tier.value],
                        "resident_rows": len(tier), "resident_bytes": len(tier) * tier.row_bytes,
                        "capacity_rows": tier.capacity, "capacity_bytes": tier.capacity * tier.row_bytes,
                        "promotions": ts.promotions, "demotions": ts.demotions, "write_backs": ts.write_backs,
                        "pinned_rows": tier.pinned_count(), "seconds": ts.seconds,
                    }
                ssd = {"hits": s.ssd.hits, "misses": s.ssd.created, **vars(s.ssd)}
                ssd["read_latency"] = s.ssd.read_latency.snapshot()
                ssd["write_latency"] = s.ssd.write_latency.snapshot()
                out[name] = {"lookups": s.lookups, "updates": s.updates, "assigns": s.assigns,
                             "placement_errors": s.placement_errors, **tiers, "ssd": ssd,
                             "pass": {"active": t.pass_keyset is not None,
                                      "keyset_rows": len(t.pass_keyset) if t.pass_keyset is not None else 0,
                                      "pinned_rows": int(t.pass_pinned.numel()),
                                      "outside_keyset": s.outside_keyset,
                                      "started": s.passes, "wait_seconds": s.pass_wait_seconds},
                             "prefetch": {"staged_rows": s.prefetch_rows, "seconds": s.prefetch_seconds,
                                          "running_seconds": running},
                             "mrc": ({"sample_rate": t.mrc.rate, **t.mrc.hit_ratios()} if t.mrc is not None
                                     else None)}
        return out

    def resident_keys(self, table: str, tier: str) -> torch.Tensor:
        """Keys (int64, CPU) of ``table`` resident in ``tier`` ("hbm" or "ddr"), for inspection.

        Raises:
            ConfigError: ``tier`` is not "hbm" or "ddr". UnknownTableError, CacheClosedError.
        """
        hbm = memory_tier(tier) is Tier.HBM
        t = self._table(table)
        with t.lock:
            mt = t.hbm if hbm else t.ddr
            return mt.keys[mt.occupied_slots()].cpu()


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS soon (glibc's ``malloc_trim``; elsewhere nothing).

    Staging and write-back allocate and free chunk buffers from several threads; glibc keeps
    the freed pages in per-thread arenas, so the process's resident memory grew by their sum
    and stayed there (measured in ``bench/bench_big.py``). Called after each background job;
    trims at most once per ``_TRIM_INTERVAL`` seconds, and a request inside the interval is
    served when it ends. Trimming after every job cost a back-to-back pass pipeline a third of
    its speed (HBM 1% / DDR 10%, d64 B8K: 1.3-1.8 s per two-pass segment without trimming,
    1.8-2.7 s with): the next job page-faults the returned memory in again.
    """
    with _TRIM_LOCK:
        if _TRIM_STATE["timer"] is not None:
            return  # a trim is already due
        wait = _TRIM_STATE["last"] + _TRIM_INTERVAL - time.monotonic()
        if wait > 0:
            timer = threading.Timer(wait, _trim_now)
            timer.daemon = True
            _TRIM_STATE["timer"] = timer
            timer.start()
            return
        _TRIM_STATE["last"] = time.monotonic()
    _malloc_trim()


def _trim_now() -> None:
    with _TRIM_LOCK:
        _TRIM_STATE["timer"] = None
        _TRIM_STATE["last"] = time.monotonic()
    _malloc_trim()


def _malloc_trim() -> None:
    trim = _MALLOC_TRIM[0]
    if trim is None:
        try:
            trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            trim = False
        _MALLOC_TRIM[0] = trim
    if trim:
        trim(0)


_MALLOC_TRIM: list[Any] = [None]
_TRIM_INTERVAL = 5.0
_TRIM_LOCK = threading.Lock()
_TRIM_STATE: dict[str, Any] = {"last": -math.inf, "timer": None}


def _segment_sum(values: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Sums of the rows of ``values`` [n, d] by group: ``inverse`` [n] the group of each row
    (0..u-1), ``counts`` [u] the rows in each (all >= 1). Each group's rows are added one after
    the other in their order in the batch, from 0 (``0 + v0 + v1 + ...``): the bits of
    ``index_add_`` into zeros on the CPU, and the same bits on every run on a GPU, where
    ``index_add_`` adds with atomics in whatever order threads meet (float addition is not
    associative). A stable sort groups the rows; torch's segment reduction sums each group in
    one thread per column, in order. ``unsafe`` skips its check of the lengths (a host sync)."""
    order = torch.argsort(inverse, stable=True)
    return torch.segment_reduce(values.index_select(0, order), "sum", lengths=counts, unsafe=True)


def _all_finite(values: torch.Tensor) -> bool:
    """True when no element is NaN or inf (one reduction; the elementwise check only if the sum overflows)."""
    if bool(torch.isfinite(values.sum())):  # NaN or inf anywhere makes the sum NaN or inf
        return True
    return bool(torch.isfinite(values).all())


def _copy_store(manifest: dict[str, Any], source: str, config: CacheConfig, target: str) -> None:
    """Copy a checkpoint's store into a store of another backend (row by row batches, via scan)."""
    src = open_store(manifest["store"], source)
    dst = open_store(config.store, target, **dict(config.store_options))
    try:
        for table in src.tables():
            tcfg = next((TableConfig.from_dict(d) for d in manifest["tables"] if d["name"] == table), None)
            if tcfg is None:
                continue
            rb = tcfg.dim * torch.empty(0, dtype=tcfg.torch_dtype).element_size() + 4 * state_width(
                tcfg.optimizer, tcfg.dim)
            dst.open_table(table, rb)
            with tqdm(desc=f"restoring {table}", unit="rows", unit_scale=True, leave=False) as bar:
                for keys, records in src.scan(table):
                    dst.put_many(table, keys, records)
                    bar.update(len(keys))
        for name in _meta_names(manifest):
            value = src.get_meta(name)
            if value is not None:
                dst.put_meta(name, value)
        dst.flush()
    finally:
        src.close()
        dst.close()


def _meta_names(manifest: dict[str, Any]) -> Iterable[str]:
    yield "tables"
    for d in manifest["tables"]:
        yield f"sketch/{d['name']}"
        yield f"clock/{d['name']}"

