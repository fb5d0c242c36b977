"""Rows to and from the store: the record format, counted reads and writes, the write log.

Every row a table reads from or writes to the store passes through its :class:`StoreRows`,
which counts it (``stats()[table]["ssd"]``), so no path reads or writes uncounted. A record is
the row's weights in the table's dtype followed by its float32 optimizer state
(:func:`record_bytes` wide); a key the store lacks gets its initializer's row.

The store's metadata names (the table definitions, each table's frequency sketch and clock)
are defined here too, once, and so is the name of a table's side namespace of last touches
(``~touch/<table>``: key -> int64 tick, kept only for a table whose rows expire; see
:mod:`.expiry`), which :class:`StoreRows` reads, writes and deletes beside the rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..config import TableConfig
from ..init import init_rows
from ..optim import initial_state
from ..stores import Store
from ..tier import RowBatch
from .changes import Changes, export_meta
from .stats import SsdStats

__all__ = ["META_TABLES", "TOUCH_BYTES", "Read", "ReaderPool", "RecordCodec", "StagedRead", "StoreRows",
           "admission_meta", "clean_rows", "clock_meta", "expiry_meta", "merge_in_order", "record_bytes",
           "sketch_meta", "steps_meta", "table_meta_names", "touch_owner", "touch_table"]

META_TABLES = "tables"  # the JSON list of every table's definition


def sketch_meta(table: str) -> str:
    """Metadata name of ``table``'s saved frequency sketch."""
    return f"sketch/{table}"


def admission_meta(table: str) -> str:
    """Metadata name of ``table``'s saved admission counts (``TableConfig.admit_after``)."""
    return f"admission/{table}"


def clock_meta(table: str) -> str:
    """Metadata name of ``table``'s saved aging clock."""
    return f"clock/{table}"


def expiry_meta(table: str) -> str:
    """Metadata name of ``table``'s saved expiry state (clock at the last flush, tick times, adoption)."""
    return f"expiry/{table}"


_TOUCH_PREFIX = "~touch/"
TOUCH_BYTES = 8  # a touch record: the int64 tick of the row's last touch


def touch_table(table: str) -> str:
    """Name of the store table holding ``table``'s last touches (the side namespace of expiry)."""
    return _TOUCH_PREFIX + table


def touch_owner(store_table: str) -> str | None:
    """The table whose touches ``store_table`` holds, or None if it is not a touch table."""
    return store_table[len(_TOUCH_PREFIX):] if store_table.startswith(_TOUCH_PREFIX) else None


def steps_meta(table: str) -> str:
    """Metadata name of ``table``'s saved count of updates (the step of stochastic rounding)."""
    return f"steps/{table}"


def table_meta_names(tables: Iterable[str]) -> Iterator[str]:
    """Every metadata name a store holds for ``tables`` (what a copy of the store must carry)."""
    yield META_TABLES
    for name in tables:
        yield sketch_meta(name)
        yield clock_meta(name)
        yield admission_meta(name)
        yield export_meta(name)
        yield expiry_meta(name)
        yield steps_meta(name)


def record_bytes(dim: int, dtype: torch.dtype, state_width: int) -> int:
    """Bytes of one row's record in the store: its weights in ``dtype`` and its float32 optimizer state."""
    return dim * torch.empty(0, dtype=dtype).element_size() + 4 * state_width


def clean_rows(keys: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, freq: torch.Tensor,
               now: int) -> RowBatch:
    """A batch of clean, unpinned rows of ``keys`` last touched at ``now``."""
    n = keys.numel()
    return RowBatch(keys, weights, state, freq, torch.full((n,), now, dtype=torch.int64),
                    torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.int32))


def merge_in_order(first: RowBatch, rest: RowBatch, from_first: torch.Tensor) -> RowBatch:
    """Rows in the order ``from_first`` (bool [n]) gives: where it is True the next row of
    ``first``, elsewhere the next row of ``rest``. When ``first``'s rows all come first, no
    permutation is needed."""
    rows = RowBatch.cat([first, rest])
    if bool(from_first[:len(first)].all()):
        return rows
    order = torch.cat([torch.nonzero(from_first).flatten(), torch.nonzero(~from_first).flatten()])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return rows.select(inverse)


@dataclass
class Read:
    """Rows read from the store (or created where absent): what a reader thread hands back."""

    found: np.ndarray  # bool [n]: the store had the row
    weights: torch.Tensor
    state: torch.Tensor
    fmask: torch.Tensor  # ``found`` as a tensor
    seconds: float  # time in the store


@dataclass
class StagedRead:
    """Staged rows whose values a reader thread is still reading; their keys and counts are known,
    which is all planning needs. :meth:`TableEngine.complete` fills them in (once)."""

    rows: RowBatch
    counts: torch.Tensor
    future: Future[Read]
    done: bool = False


class RecordCodec:
    """A table's store record: encoding, decoding, and the initializer's rows for missing keys."""

    def __init__(self, cfg: TableConfig, state_width: int) -> None:
        self.cfg = cfg
        self.state_width = state_width
        self.weight_bytes = cfg.dim * torch.empty(0, dtype=cfg.torch_dtype).element_size()
        self.record_bytes = record_bytes(cfg.dim, cfg.torch_dtype, state_width)

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
        if not self.state_width:  # (an empty slice at an offset not a multiple of 4 cannot be viewed as float32)
            return w, torch.empty(n, 0, dtype=torch.float32)
        s = rec[:, self.weight_bytes:].contiguous().view(torch.float32).reshape(n, self.state_width)
        return w, s

    def decode_or_create(self, keys: torch.Tensor, found: np.ndarray,
                         records: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weights, state and found-mask of ``keys``: decoded where the store had them, else initialized.

        Pure (no table state touched), so reader threads and the prefetcher run it outside the lock.
        """
        cfg = self.cfg
        n = keys.numel()
        found = np.asarray(found, dtype=bool)
        fmask = torch.from_numpy(found)
        n_found = int(found.sum())
        if n_found == n:  # the common case: decode copies the records into fresh tensors
            weights, state = self.decode(records)
            return weights, state, fmask
        weights = torch.empty(n, cfg.dim, dtype=cfg.torch_dtype)
        state = torch.empty(n, self.state_width, dtype=torch.float32)
        if n_found:
            f_pos = torch.nonzero(fmask).flatten()
            w, st = self.decode(records[found])
            weights.index_copy_(0, f_pos, w)
            state.index_copy_(0, f_pos, st)
        new_pos = torch.nonzero(~fmask).flatten()
        weights.index_copy_(0, new_pos, init_rows(cfg.initializer, float(cfg.init_scale or 0.0), cfg.seed,
                                                  keys.index_select(0, new_pos), cfg.dim, cfg.torch_dtype))
        state.index_copy_(0, new_pos, initial_state(cfg.optimizer, cfg.dim, n - n_found, torch.device("cpu"),
                                                    cfg.initial_accumulator_value))
        return weights, state, fmask


class DueIndex(Protocol):
    """Where :meth:`StoreRows.write_touches` reports each touch it writes (see ``expiry.DueTouches``)."""

    def add(self, keys: np.ndarray, ticks: np.ndarray) -> None:
        """Note that the touches of ``keys`` were written with ``ticks``."""


class StoreRows:
    """One table's rows in the store: every read and write of them, counted, and the write log.

    The write log serves readers that run without the table's lock (the prefetcher): while one
    :meth:`watch` es, the keys of every write are logged, and :meth:`unwatch` hands back those
    written since its mark, whose copies it read may be stale. Callers hold the table's lock,
    except for :meth:`read`, which touches no state.
    """

    def __init__(self, store: Store, cfg: TableConfig, codec: RecordCodec, stats: SsdStats) -> None:
        self.store = store
        self.table = cfg.name
        # the side namespace of last touches, kept only when the table's rows expire
        self.touches: str | None = touch_table(cfg.name) if cfg.expires else None
        self._touch_log: list[np.ndarray] | None = None  # keys whose touches were written, while a sweep watches
        # every touch written, by sweep interval (.expiry.DueTouches): what a sweep must look at
        self.due: DueIndex | None = None
        self.codec = codec
        self.stats = stats
        # store writes of this table so far: a change tells a cached read it may be stale
        self.writes = 0
        self._log: list[torch.Tensor] = []
        self._watchers = 0
        # change marks for delta exports (on once the table was exported): every write and
        # delete below marks its keys first, so no change is missed (see engine/changes.py)
        self.changes = Changes(store, cfg.name)

    def read(self, keys: torch.Tensor) -> Read:
        """Read (unique, CPU, non-empty) ``keys`` and decode or create their rows; not counted yet
        (see :meth:`count`): touches no state, so a reader thread may run it beside the lock holder."""
        t0 = time.perf_counter()
        found, records = self.store.get_many(self.table, keys.numpy())
        found = np.asarray(found, dtype=bool)
        seconds = time.perf_counter() - t0
        weights, state, fmask = self.codec.decode_or_create(keys, found, records)
        return Read(found, weights, state, fmask, seconds)

    def count(self, read: Read) -> None:
        """Count a :meth:`read` in the table's store statistics."""
        st = self.stats
        n_found = int(read.found.sum())
        st.reads += 1
        st.read_rows += n_found
        st.read_bytes += n_found * self.codec.record_bytes
        st.seconds += read.seconds
        st.read_latency.observe(read.seconds)

    def stored(self, keys: torch.Tensor) -> torch.Tensor:
        """Bool [n]: which of the CPU ``keys`` the store holds (a counted read)."""
        t0 = time.perf_counter()
        found, _ = self.store.get_many(self.table, keys.numpy())
        found = np.asarray(found, dtype=bool)
        fmask = torch.from_numpy(found)
        self.count(Read(found, torch.empty(0), torch.empty(0), fmask, time.perf_counter() - t0))
        return fmask

    def read_counted(self, keys: torch.Tensor) -> Read:
        """:meth:`read` and :meth:`count` in one."""
        read = self.read(keys)
        self.count(read)
        return read

    def write(self, rows: RowBatch) -> None:
        """Write ``rows`` to the store in one atomic batch, counted and logged.

        Raises:
            StoreError (StoreFullError for a full disk): nothing was written.
        """
        if len(rows) == 0:
            return
        t0 = time.perf_counter()
        keys, records = self.codec.encode(rows)
        self.put(keys, records)
        st = self.stats
        st.writes += 1
        st.write_rows += len(rows)
        st.write_bytes += records.nbytes
        dt = time.perf_counter() - t0
        st.seconds += dt
        st.write_latency.observe(dt)

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Write raw records (another cache's export) to the store, logged; not counted as write-back."""
        self.writes += 1  # before the write: even a failed one may have changed what a cached read saw
        self.changes.mark(keys)  # before the write: a crash between the two over-reports, never misses
        self.store.put_many(self.table, keys, records)
        self._logged(keys)

    def delete(self, keys: np.ndarray) -> None:
        """Delete the rows of ``keys`` from the store, logged and marked (a delta export lists them as
        deleted), then their last touches (tables whose rows expire; a touch left by a crash in
        between only makes a later sweep delete an absent row)."""
        self.writes += 1
        self.changes.mark(keys)
        self.store.delete_many(self.table, keys)
        self._logged(keys)
        if self.touches is not None and len(keys):
            self.store.delete_many(self.touches, keys)

    # -- the side namespace of last touches (tables whose rows expire; see .expiry) ------------------
    def write_touches(self, keys: np.ndarray, ticks: np.ndarray) -> None:
        """Record the last touch (int64 ``ticks``) of ``keys`` in one atomic batch (no-op without expiry);
        logged for a sweep that watches (:meth:`watch_touches`)."""
        if self.touches is None or len(keys) == 0:
            return
        keys = np.asarray(keys, dtype=np.int64)
        records = np.ascontiguousarray(ticks, dtype="<i8").view(np.uint8).reshape(-1, TOUCH_BYTES)
        self.store.put_many(self.touches, keys, records)
        if self._touch_log is not None:
            self._touch_log.append(keys.copy())
        if self.due is not None:
            self.due.add(keys, ticks)

    def watch_touches(self) -> None:
        """Start logging the keys whose touches are written (a sweep reads touches without the lock)."""
        self._touch_log = []

    def touched_since_watch(self) -> np.ndarray:
        """The keys whose touches were written since :meth:`watch_touches` (sorted, unique); the log restarts."""
        log, self._touch_log = self._touch_log or [], []
        return np.unique(np.concatenate(log)) if log else np.zeros(0, dtype=np.int64)

    def unwatch_touches(self) -> None:
        """Stop logging touches."""
        self._touch_log = None

    def read_touches(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found bool [n], ticks int64 [n])`` of the last touches of ``keys`` (ticks 0 where not found)."""
        assert self.touches is not None
        found, records = self.store.get_many(self.touches, np.asarray(keys, dtype=np.int64))
        return np.asarray(found, dtype=bool), _ticks(records)

    def scan_touches(self, start: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` ``(keys, ticks)`` of the side namespace from key ``start`` on, ascending."""
        assert self.touches is not None
        keys, records = self.store.scan_from(self.touches, start, limit)
        return keys, _ticks(records)

    def _logged(self, keys: np.ndarray) -> None:
        if self._watchers:  # a prefetch is reading the store without the lock: tell it what changed
            self._log.append(torch.from_numpy(np.array(keys, dtype=np.int64)))

    def watch(self) -> int:
        """Start logging writes for a reader outside the lock; returns its mark."""
        self._watchers += 1
        return len(self._log)

    def unwatch(self, mark: int) -> torch.Tensor | None:
        """Stop watching; the keys written since ``mark`` (None if none)."""
        written = self._log[mark:]
        self._watchers -= 1
        if self._watchers == 0:
            self._log.clear()
        return torch.cat(written) if written else None

    def scan(self, batch_rows: int, keys: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The stored ``(keys, records)`` in batches: every row (a scan), or those of ``keys`` the store holds."""
        if keys is None:
            yield from self.store.scan(self.table, batch_rows)
            return
        keys = np.asarray(keys, dtype=np.int64)
        for start in range(0, keys.shape[0], batch_rows):
            part = keys[start:start + batch_rows]
            found, records = self.store.get_many(self.table, part)
            found = np.asarray(found, dtype=bool)
            if found.any():
                yield part[found], np.asarray(records)[found]


def _ticks(records: np.ndarray) -> np.ndarray:
    """int64 ticks of touch records (uint8 [n, TOUCH_BYTES])."""
    return np.ascontiguousarray(records).view("<i8").reshape(-1).astype(np.int64)


class ReaderPool:
    """Threads that read the store while the lookup that needs the rows plans their placement."""

    THREADS = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, rows: StoreRows, keys: torch.Tensor) -> Future[Read]:
        """Read ``keys`` (see :meth:`StoreRows.read`) on a reader thread."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="embcache-read")
            return self._pool.submit(rows.read, keys)

    def shutdown(self) -> None:
        """Wait for the readers and stop them (idle once every lookup joined its read)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
