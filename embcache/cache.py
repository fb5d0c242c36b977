"""EmbeddingCache: embedding tables kept in HBM, DDR and an on-disk store, placed by frequency.

This module is the facade: each public method checks its arguments (:mod:`embcache.validate`),
takes the table's lock and hands over to the table's engine. The rooms behind it:

- :mod:`embcache.engine.table`: one table's state and its lookup path (``TableEngine``);
- :mod:`embcache.engine.update`: the optimizer applied where each row lives, and ``assign``;
- :mod:`embcache.engine.placement`: moves between tiers, planned as data and committed once;
- :mod:`embcache.engine.rows`: rows to and from the store (record format, counted reads/writes);
- :mod:`embcache.engine.passes`: prefetch, leases, ``begin_pass``/``end_pass``;
- :mod:`embcache.engine.durability`: write-back, flush, checkpoints, restore;
- :mod:`embcache.engine.catalog`, :mod:`embcache.engine.stats`, :mod:`embcache.engine.lock`.

Concurrency model. One re-entrant lock per table serializes that table's operations, store
I/O included (a lookup's overlapped read runs on a reader thread but is joined before the lock
is released); different tables proceed in parallel (torch, numba and the store bindings release
the GIL in their heavy parts). Whole-cache operations (flush, checkpoint, close) take every
table lock in name order. The store itself is shared and thread-safe. On CUDA a table lock
also orders the GPU work of its holders (see :class:`~embcache.engine.lock.TableLock`):
background jobs run on the cache's own stream, and each holder's stream waits for the previous
holder's last event.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from .config import CacheConfig, TableConfig
from .engine import catalog, durability, export, update
from .engine.expiry import Sweeper
from .engine.passes import Passes, all_locked
from .engine.rows import TOUCH_BYTES, ReaderPool
from .engine.stats import table_report
from .engine.table import TableEngine
from .errors import (
    ConfigError,
    InvalidGradientError,
    InvalidRowsError,
    PassStateError,
    TableConflictError,
    UnknownTableError,
)
from .export.format import check_directory, load_model
from .keyset import Keyset, as_keysets
from .policy import make_policy
from .prefetch import PrefetchFuture
from .stores import Store, open_store
from .tier import release_cached_memory, to_device
from .types import Tier, memory_tier
from .validate import all_finite, check_open, checked_keys, checked_rows, nonfinite_gradients, unique_keys

__all__ = ["EmbeddingCache"]

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


def _assign(t: TableEngine, keys: torch.Tensor, rows: torch.Tensor, given: object) -> None:
    update.assign(t, keys, rows)  # the caller's keys object only serves updates (engine/found.py)


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
        self._store: Store | None = None
        os.makedirs(config.path, exist_ok=True)
        self._path_lock = durability.PathLock(config.path)
        try:
            self._store = open_store(config.store, os.path.join(config.path, durability.STORE_DIR),
                                     **dict(config.store_options))
            self._tables: dict[str, TableEngine] = {}
            self._global_lock = threading.RLock()
            self._device = config.torch_device
            self._policy = make_policy(config.policy, config.admission, config.idle_halving)
            self._readers = ReaderPool()  # store reads overlapped with placement
            self._export_lock = threading.Lock()  # one export at a time (each closes an epoch)
            self._passes = Passes(self._tables, self._global_lock, self._device)
            self._sweeper = Sweeper(self._tables, config.expiry_interval)  # started once a table expires rows
            configs = catalog.merged_definitions(self._store, list(tables))
            for cfg in configs:
                self._add_table(cfg, *catalog.tier_rows(config, cfg, configs))
            catalog.save_definitions(self._store, configs)
        except BaseException:
            self._release()
            raise
        self._closed = False
        _OPEN_CACHES.add(self)
        if any(cfg.expires for cfg in configs):
            self._sweeper.start()

    # ------------------------------------------------------------------ opening and closing
    def _release(self) -> None:
        try:
            if self._store is not None:
                store, self._store = self._store, None
                store.close()
        finally:
            self._path_lock.release()

    def _add_table(self, cfg: TableConfig, hbm_rows: int, ddr_rows: int) -> None:
        assert self._store is not None
        t = TableEngine(cfg, hbm_rows, ddr_rows, self._config, self._policy, self._store, self._readers)
        self._store.open_table(cfg.name, t.record_bytes)
        if t.rows.touches is not None:
            self._store.open_table(t.rows.touches, TOUCH_BYTES)
        t.load_saved()
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
            check_open(self._closed)
            old = self._tables.get(cfg.name)
            if not catalog.check_new(old.cfg if old is not None else None, cfg):
                return False
            if any(t.pinned_rows() for t in self._tables.values()):
                raise PassStateError("tables cannot be added while rows are pinned; end the pass and release "
                                     "prefetches and leases first")
            assert self._store is not None
            configs = [*(t.cfg for t in self._tables.values()), cfg]
            for t in list(self._tables.values()):
                t.resize(*catalog.tier_rows(self._config, t.cfg, configs))
            self._add_table(cfg, *catalog.tier_rows(self._config, cfg, configs))
            catalog.save_definitions(self._store, configs)
        if cfg.expires:
            self._sweeper.start()
        return True

    def close(self) -> None:
        """Write every dirty row and the frequency state back, then release the store. Idempotent."""
        if self._closed:
            return
        self._passes.stop()
        self._sweeper.stop()  # before the locks: a sweep takes a table lock per chunk
        with self._all_tables():
            if self._closed:
                return
            try:
                assert self._store is not None
                durability.flush(self._tables, self._store, save_frequencies=True)
            finally:
                self._closed = True
                self._passes.closed = True
                _OPEN_CACHES.discard(self)
                for t in self._tables.values():
                    t.release()  # flushed: the memory goes now, not when the cache is collected
                release_cached_memory(self._device)
                self._readers.shutdown()  # idle: every read is joined under its table's lock
                self._release()

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

    # ------------------------------------------------------------------ arguments
    def _table(self, name: str) -> TableEngine:
        check_open(self._closed)
        try:
            return self._tables[name]
        except (KeyError, TypeError):
            raise UnknownTableError(f"unknown table {name!r}; tables: {sorted(self._tables)}") from None

    def _keys_both(self, keys: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The checked keys as given (host or device) and on the cache's device.

        The copy to a GPU is asynchronous; a caller's pinned buffer may be reused once the call
        returns, as every public call synchronizes with the device after it (a lookup's hit
        count, an update's finite check or ``unique``) before returning.
        """
        keys = checked_keys(keys, self._config.max_batch_keys, self._device)
        return keys, to_device(keys, self._device)

    def _shaped(self, table: str, keys: Any, values: Any, what: str,
                err: type[InvalidGradientError] | type[InvalidRowsError]
                ) -> tuple[TableEngine, torch.Tensor, torch.Tensor]:
        """The table, and ``keys`` and float32 ``values`` [n, dim] checked and on the cache's device."""
        t = self._table(table)
        keys = self._keys_both(keys)[1]
        rows = checked_rows(what, values, keys.numel(), t.cfg.dim, err, self._device)
        return t, keys, to_device(rows, self._device)

    def _gradient_shapes(self, table: str, keys: Any, grads: Any) -> tuple[TableEngine, torch.Tensor, torch.Tensor]:
        return self._shaped(table, keys, grads, "gradients", InvalidGradientError)

    def _checked_gradients(self, table: str, keys: Any, grads: Any) -> tuple[TableEngine, torch.Tensor, torch.Tensor]:
        t, keys, grads = self._gradient_shapes(table, keys, grads)
        if self._config.reject_nonfinite and not all_finite(grads):
            raise nonfinite_gradients(table)
        return t, keys, grads

    def _checked_rows(self, table: str, keys: Any, rows: Any) -> tuple[TableEngine, torch.Tensor, torch.Tensor]:
        t, keys, rows = self._shaped(table, keys, rows, "rows", InvalidRowsError)
        if not all_finite(rows):
            raise InvalidRowsError(f"rows of table {table!r} contain NaN or inf; nothing was assigned")
        return t, keys, rows

    def _checked_keysets(self, keysets: Mapping[str, Any]) -> dict[str, Keyset]:
        check_open(self._closed)
        ks = as_keysets(keysets)
        for name in ks:
            self._table(name)
        return ks

    def _write(self, updates: Mapping[str, tuple[Any, Any]],
               check: Callable[[str, Any, Any], tuple[TableEngine, torch.Tensor, torch.Tensor]],
               fn: Callable[[TableEngine, torch.Tensor, torch.Tensor, Any], None]) -> None:
        """Check every table's ``(keys, values)``, then run ``fn(t, keys, values, given)`` per table
        under its lock (``given``: the caller's keys object; nothing for an empty batch): one
        table's bad input changes no table."""
        checked = [(*check(name, k, v), k) for name, (k, v) in updates.items()]
        for t, keys, values, given in checked:
            if keys.numel() == 0:
                continue
            with t.lock:
                t.check_open()  # closed while waiting for the lock?
                fn(t, keys, values, given)

    # ------------------------------------------------------------------ lookup and update
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
        keys_arg = keys
        given, keys = self._keys_both(keys)
        n, dim = keys.numel(), t.cfg.dim
        if out is None:
            out = torch.empty(n, dim, dtype=torch.float32, device=self._device)
        elif out.shape != (n, dim) or out.dtype != torch.float32 or out.device != self._device:
            raise InvalidRowsError(f"out must be float32 [{n}, {dim}] on {self._device}")
        if n == 0:
            return out
        with t.lock:
            t.check_open()  # closed while waiting for the lock?
            return t.lookup(given, keys, out, raw=keys_arg)

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
        # The finite check runs under the lock, before anything changes: on the CPU inside the
        # fused kernel, which reads every gradient anyway; on a GPU read back with the update's
        # own check of which rows are in HBM (one host sync fewer). See update.apply_gradients.
        t, checked, g = self._gradient_shapes(table, keys, grads)
        if checked.numel() == 0:
            return
        with t.lock:
            t.check_open()  # closed while waiting for the lock?
            update.apply_gradients(t, checked, g, keys, self._config.reject_nonfinite)

    def apply_gradients_many(self, updates: Mapping[str, tuple[Any, torch.Tensor]]) -> None:
        """Apply gradients to several tables: ``{table: (keys [n], grads [n, dim])}``.

        Every table's input is validated before any is changed; each table's update is atomic.

        Raises:
            The errors of :meth:`apply_gradients`.
        """
        self._write(updates, self._checked_gradients, update.apply_gradients)  # each table checked first

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
        self._write({table: (keys, rows)}, self._checked_rows, _assign)

    def assign_many(self, updates: Mapping[str, tuple[Any, torch.Tensor]]) -> None:
        """Assign rows of several tables: ``{table: (keys [n], rows [n, dim])}``.

        Every table's input is validated before any is changed; each table's assignment is atomic.

        Raises:
            The errors of :meth:`assign`.
        """
        self._write(updates, self._checked_rows, _assign)

    # ------------------------------------------------------------------ passes and prefetch
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
        return self._passes.prefetch(self._checked_keysets(keysets), lease=False)

    def prefetch_batch(self, keysets: Mapping[str, Any]) -> PrefetchFuture:
        """Stage the rows one upcoming batch will look up, and lease them until ``release()``.

        Like :meth:`prefetch`, but the pins are held until the returned future's ``release()``
        or ``cancel()`` (not adopted by ``begin_pass``). :class:`~embcache.prefetch.LookAhead`
        manages these leases for a data loader.

        Raises:
            UnknownTableError, InvalidKeysError, CacheClosedError.
        """
        return self._passes.prefetch(self._checked_keysets(keysets), lease=True)

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
        return self._passes.begin(self._checked_keysets(keysets))

    def end_pass(self) -> Future[int]:
        """Unpin the pass's rows and write dirty rows back in the background.

        Returns:
            A future of the number of rows written back (errors, e.g. StoreError, surface there;
            rows that failed to write stay dirty in memory, nothing is lost).

        Raises:
            PassStateError: no pass is active.
            CacheClosedError.
        """
        return self._passes.end()

    # ------------------------------------------------------------------ persistence
    def _all_tables(self) -> AbstractContextManager[None]:
        return all_locked(self._global_lock, self._tables)

    def flush(self) -> None:
        """Write every dirty row to the store and make it durable (survives kill -9 and power loss).

        Raises:
            CacheClosedError, StoreError (rows stay dirty in memory; retry later).
        """
        check_open(self._closed)
        with self._all_tables():
            check_open(self._closed)
            assert self._store is not None
            durability.flush(self._tables, self._store, save_frequencies=False)

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
        durability.check_checkpoint_target(directory)
        check_open(self._closed)
        with self._all_tables():
            check_open(self._closed)
            assert self._store is not None
            durability.flush(self._tables, self._store, save_frequencies=True)
            durability.write_checkpoint(directory, self._store, self._config, self._tables)

    @classmethod
    def restore(cls, directory: str | os.PathLike[str], config: CacheConfig,
                tables: Sequence[TableConfig] = ()) -> EmbeddingCache:
        """Open a cache at ``config.path`` holding the checkpoint in ``directory``.

        The capacities and policy come from ``config`` (any sizes); a checkpoint made with one
        store backend can be restored into the other.

        Raises:
            ConfigError: ``directory`` holds no checkpoint, or ``config.path`` already holds a store.
        """
        durability.restore_store(os.fspath(directory), config)
        return cls(config, tables)

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
        with t.lock:
            t.write_dirty()
        for found, records in t.rows.scan(batch_rows, keys):
            mask = np.asarray(select(found), dtype=bool)
            if not mask.any():
                continue
            with t.lock:
                freq = t.freq_of(torch.from_numpy(found[mask]))
            yield found[mask], records[mask], freq.numpy()

    def import_rows(self, table: str, keys: Any, records: np.ndarray, freq: np.ndarray | None = None, *,
                    refresh: bool = False) -> None:
        """Replace the rows of ``keys`` with ``records`` (from another cache's :meth:`export_rows`).

        Memory copies of those keys are dropped (not written back) and the records written to
        the store; their frequencies are raised to ``freq``.

        Args:
            table: table name (same dim, optimizer and dtype as the exporting table).
            keys: int64 [n], unique.
            records: uint8 [n, record_bytes].
            freq: float [n] aged access frequencies (optional).
            refresh: memory copies take the records' values in place (clean) instead of being
                dropped: hot rows stay resident (serving mode's version switch).

        Raises:
            UnknownTableError, InvalidKeysError (duplicates), InvalidRowsError (record shape),
            CacheClosedError, StoreFullError, StoreError.
        """
        t = self._table(table)
        k = checked_keys(keys, self._config.max_batch_keys)
        unique_keys(k, f"import_rows: table {table!r}")
        records = np.ascontiguousarray(records, dtype=np.uint8)
        if records.shape != (k.numel(), t.record_bytes):
            raise InvalidRowsError(f"import_rows: records of table {table!r} must be uint8 [{k.numel()}, "
                                   f"{t.record_bytes}], got {list(records.shape)}; nothing was imported")
        if freq is not None and np.shape(freq) != (k.numel(),):
            raise InvalidRowsError(f"import_rows: freq must have shape [{k.numel()}], got {list(np.shape(freq))}")
        with t.lock:
            t.check_open()
            t.import_records(k, records, freq, refresh)

    def delete(self, table: str, keys: Any) -> int:
        """Delete the rows of ``keys`` from every tier (rows pinned by a pass, prefetch or lease
        too), from the store, and their last touches (expiry); a later lookup of such a key
        gets its initializer's row afresh.

        Args:
            table: table name.
            keys: int64 [n] (duplicates allowed; keys without a row are ignored).

        Returns:
            How many of the distinct keys had a row (resident or stored).

        Raises:
            UnknownTableError, InvalidKeysError, BatchTooLargeError, CacheClosedError,
            StoreError (nothing was dropped from memory).
        """
        t = self._table(table)
        k = torch.unique(checked_keys(keys, self._config.max_batch_keys))
        with t.lock:
            t.check_open()
            return t.delete(k)

    def delete_rows(self, table: str, keys: Any) -> None:
        """:meth:`delete` without the count (the store is not read to tell which keys had rows),
        e.g. after the rows moved to another shard.

        Raises:
            UnknownTableError, InvalidKeysError, CacheClosedError, StoreError.
        """
        t = self._table(table)
        k = torch.unique(checked_keys(keys, self._config.max_batch_keys))
        with t.lock:
            t.check_open()
            t.delete(k, count=False)

    def expire_now(self) -> None:
        """Run one expiry sweep of every table whose rows expire, now, and wait for it (the
        background sweeper runs one every ``CacheConfig.expiry_interval`` seconds).

        Raises:
            CacheClosedError, StoreError.
        """
        check_open(self._closed)
        self._sweeper.sweep_all()

    # ------------------------------------------------------------------ exports
    def _engines(self, tables: Sequence[str] | None) -> dict[str, TableEngine]:
        check_open(self._closed)
        names = sorted(self._tables) if tables is None else list(dict.fromkeys(tables))
        return {name: self._table(name) for name in names}

    def export_delta(self, directory: str | os.PathLike[str], *, with_state: bool = False,
                     tables: Sequence[str] | None = None, full: bool = False) -> export.ExportResult:
        """Write the rows changed and the keys deleted since the previous export as the next
        version under ``directory`` (the open format of :mod:`embcache.export`).

        The first export of a table (or one into a directory whose newest version is not this
        cache's last export) writes a *full* version, every stored row; later ones write
        *deltas*. Dirty resident rows are written back first (they stay resident). From the first
        export on, every store write of a table is marked before it is made, so no change is
        missed, not even across a crash and a restart; marks are dropped only once the version
        holding them is durable. Training may go on meanwhile (writes made during the export
        come again in the next one).

        Args:
            directory: the export directory (created if missing).
            with_state: write each row's optimizer state too (default: weights only).
            tables: the tables to export (default: all).
            full: write a full version even when a delta could follow.

        Returns:
            An :class:`~embcache.engine.export.ExportResult`: version number, kind, rows, deleted keys.

        Raises:
            ExportFormatError: ``directory`` is not a directory, or holds another format.
            UnknownTableError, CacheClosedError, StoreError, OSError (nothing committed: the next
            export includes every change this one would have).
        """
        path = check_directory(directory)
        engines = self._engines(tables)
        with self._export_lock:
            assert self._store is not None
            return export.export_tables(engines, self._store, path, with_state=with_state, force_full=full)

    def begin_export(self, chain: str, base_version: int, *, tables: Sequence[str] | None = None,
                     full: bool = False) -> export.PendingExport:
        """The first half of :meth:`export_delta`, for a writer elsewhere (the parameter server's
        client writes one version of the whole fleet): dirty rows written back, the epoch closed.

        The export is a delta when every table's last committed export was version
        ``base_version`` of ``chain`` (``full`` off), else full. Read its rows with
        ``batches()``; once a version holding them is durable, ``commit(chain, version)`` drops
        the marks it covered. An export never committed leaves the marks: the next one
        includes its rows again.

        Raises:
            UnknownTableError, CacheClosedError, StoreError.
        """
        engines = self._engines(tables)
        with self._export_lock:
            assert self._store is not None
            return export.begin(engines, self._store, chain, base_version, full)

    def import_version(self, directory: str | os.PathLike[str], version: int | None = None, *,
                       with_state: bool = True, tables: Sequence[str] | None = None) -> dict[str, int]:
        """Load the rows of an exported version (a full version with its deltas folded in) into this cache.

        Tables the cache lacks are created from the version's definitions. Each row is written
        to the store with its optimizer state when the version carries it (and ``with_state``),
        else with the optimizer's initial state; memory copies of those keys are dropped. Rows
        the version does not hold are left as they are.

        Args:
            directory: an export directory (e.g. from :meth:`export_delta`, ``embcache export``
                or :func:`embcache.export.from_tensor`).
            version: the version to load (default: the newest complete one).
            with_state: take the optimizer state when present.
            tables: the tables to load (default: all the version holds).

        Returns:
            ``{table: rows written}``.

        Raises:
            ExportFormatError: no such version, or a broken chain.
            TableConflictError: a table exists here with another layout (dim, optimizer, dtype,
                initializer); nothing was written.
            CacheClosedError, StoreError.
        """
        check_open(self._closed)
        _, model = load_model(check_directory(directory), version, tables=tables, with_state=with_state)
        configs = {name: TableConfig.from_dict(rows.config) for name, rows in model.items()}
        for name, cfg in configs.items():
            old = self._tables.get(name)
            if old is not None and old.cfg.layout_conflicts(cfg):
                diffs = ", ".join(f"{f}: here {getattr(old.cfg, f)!r}, exported {getattr(cfg, f)!r}"
                                  for f in old.cfg.layout_conflicts(cfg))
                raise TableConflictError(f"import: table {name!r} conflicts with the exported one ({diffs}); "
                                         "nothing was imported")
        for name, cfg in configs.items():
            if name not in self._tables:
                self.create_table(cfg)
        written: dict[str, int] = {}
        chunk = min(self._config.max_batch_keys, 1 << 20)
        for name, rows in model.items():
            t = self._table(name)
            for start in range(0, rows.keys.shape[0], chunk):
                stop = start + chunk
                records = export.import_records(t.cfg, rows.weights[start:stop],
                                                None if rows.state is None else rows.state[start:stop])
                with t.lock:
                    t.check_open()
                    t.import_records(torch.from_numpy(rows.keys[start:stop].copy()), records, None)
            written[name] = int(rows.keys.shape[0])
        return written

    # ------------------------------------------------------------------ inspection
    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters and occupancy per table and tier (plain dicts; see docs/operations/metrics.md).

        ``lookups`` = hbm hits + ddr hits + ssd hits + ssd created (per key occurrence).
        Each tier's ``misses`` are the key occurrences that reached it and were not served there:
        ``hbm`` = lookups - hbm hits; ``ddr`` = occurrences that went on to the store (ssd hits +
        created); ``ssd`` = rows created on first touch. So a tier's hits + misses = the misses of
        the tier above (``lookups`` for HBM). Each is a sum of counters that only grow.
        """
        running = self._passes.running_seconds(time.monotonic())
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(self._tables):
            t = self._tables[name]
            with t.lock:
                out[name] = table_report(t, running.get(name, 0.0))
        return out

    def resident_keys(self, table: str, tier: str) -> torch.Tensor:
        """Keys (int64, CPU) of ``table`` resident in ``tier`` ("hbm" or "ddr"), for inspection.

        Raises:
            ConfigError: ``tier`` is not "hbm" or "ddr". UnknownTableError, CacheClosedError.
        """
        which = memory_tier(tier)
        t = self._table(table)
        with t.lock:
            return t.resident_keys(Tier.HBM if which is Tier.HBM else Tier.DDR)
