"""LMDB backend: one named sub-database per table in a single memory-mapped file.

Durability: by default the environment is opened with ``sync=False, metasync=False`` (and
``writemap=False``), so a commit writes its pages with ``write()`` but does not fsync.

* kill -9 / OOM: every committed transaction survives, because its pages are already in the
  OS page cache, which outlives the process.
* OS crash or power loss: what :meth:`Store.flush` (``env.sync(True)``) made durable survives
  only if nothing was committed after it; LMDB documents that with ``sync=False`` a system
  crash can lose the last transactions *or corrupt the database*, because it may reuse pages
  that the last durable state still points to. Pass ``durable_commits=True`` (fsync on every
  commit, much slower writes) or keep checkpoints if that matters.

Each ``put_many`` / ``delete_many`` is one write transaction: all of it commits or none.
LMDB is multi-process by design: several processes may open the same path (writers take
turns on LMDB's writer lock); only a second open within one process is refused, because
LMDB's per-process locks would silently break.
"""

from __future__ import annotations

import os
from collections import deque
from itertools import islice
from typing import Any

import lmdb
import numpy as np

from ..errors import StoreError, StoreFullError
from .base import TABLE_PREFIX, Store, fsync_dir

__all__ = ["LMDBStore"]

_META_DB = b"__meta__"
_DATA_FILE = "data.mdb"


class LMDBStore(Store):
    """A :class:`Store` on LMDB; tables are named sub-databases, meta blobs live in ``__meta__``."""

    kind = "lmdb"

    def __init__(
        self,
        path: str,
        *,
        map_size: int = 1 << 40,
        max_dbs: int = 1024,
        max_readers: int = 256,
        durable_commits: bool = False,
    ) -> None:
        """Open or create an LMDB store at ``path``.

        Args:
            path: database directory; created if missing.
            map_size: largest size the data file may reach, in bytes (default 1 TiB). It is
                address space, not disk: the file grows only as it is filled. Writes beyond it
                fail with StoreFullError.
            max_dbs: most tables (plus one for meta) the store can hold (default 1024).
            max_readers: most concurrent read transactions across threads and processes (default 256).
            durable_commits: fsync on every commit, so each write survives power loss without
                flush() (default False: only flush() syncs).

        Raises:
            StoreLockedError: ``path`` is already open in this process.
            StoreError: LMDB could not open or create the environment (e.g. map_size exceeds address space).
        """
        for name, value in (("map_size", map_size), ("max_dbs", max_dbs), ("max_readers", max_readers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._map_size = map_size
        self._max_dbs = max_dbs
        self._max_readers = max_readers
        self._durable = bool(durable_commits)
        self._env: Any = None
        self._meta: Any = None
        self._dbs: dict[str, Any] = {}
        super().__init__(path)

    def _error_class(self, exc: BaseException) -> type[StoreError]:
        # MDB_MAP_FULL: the map_size is reached; DiskError: LMDB's name for ENOSPC (a full disk),
        # whatever the locale made of its message.
        if isinstance(exc, (lmdb.MapFullError, lmdb.DiskError)):
            return StoreFullError
        return super()._error_class(exc)

    def _open(self) -> None:
        if os.path.exists(os.path.join(self.path, "CURRENT")):
            raise StoreError(
                f"lmdb store at {self.path!r}: the directory holds a RocksDB database; open it as 'rocksdb'"
            )
        try:
            self._env = lmdb.open(
                self.path,
                map_size=self._map_size,
                max_dbs=self._max_dbs + 1,  # + the meta database
                max_readers=self._max_readers,
                subdir=True,
                sync=self._durable,
                metasync=self._durable,
                # writemap=True would grow the file to the full map_size at once (sparse, yet
                # 1 TiB to ls and backup tools, and allocated where files cannot be sparse).
                writemap=False,
                # Rows are read at random; readahead would fill the page cache with neighbours.
                readahead=False,
                lock=True,
            )
        except Exception as exc:
            raise self._error_class(exc)(f"lmdb store at {self.path!r}: open failed: {exc}") from exc
        try:
            with self._env.begin(write=True) as txn:
                self._meta = self._env.open_db(_META_DB, txn=txn, create=True)
                cursor = txn.cursor(db=self._meta)
                found = cursor.set_range(TABLE_PREFIX)
                tables: dict[str, int] = {}
                # The registry is tiny (one entry per table): a Python loop over it is fine.
                while found and cursor.key().startswith(TABLE_PREFIX):
                    tables[cursor.key()[len(TABLE_PREFIX) :].decode()] = int(cursor.value())
                    found = cursor.next()
                for table in tables:
                    self._dbs[table] = self._env.open_db(table.encode(), txn=txn, create=False)
            self._widths.update(tables)
        except Exception as exc:
            self._close()
            message = f"lmdb store at {self.path!r}: reading the table registry failed: {exc}"
            raise self._error_class(exc)(message) from exc

    def _create_table(self, table: str, record_bytes: int) -> None:
        # LMDB allows only one transaction at a time in the process to open databases; the
        # base class holds self._lock here. Namespace and registry entry commit together.
        with self._env.begin(write=True) as txn:
            dbi = self._env.open_db(table.encode(), txn=txn, create=True)
            txn.put(TABLE_PREFIX + table.encode(), str(record_bytes).encode(), db=self._meta)
        self._dbs[table] = dbi  # a handle opened in a transaction is usable once it has committed

    def _multi_get(self, table: str, keys: list[bytes]) -> tuple[np.ndarray, bytes]:
        # buffers=False on purpose: for ~300-byte values py-lmdb's memoryview objects cost more
        # than copying the bytes (measured 2-4x slower getmulti with buffers=True).
        with self._env.begin(db=self._dbs[table], buffers=False) as txn:
            pairs = txn.cursor().getmulti(keys)  # only the found (key, value) pairs, in input order
            if not pairs:
                return np.zeros(len(keys), dtype=bool), b""
            found_keys, values = zip(*pairs, strict=True)
            joined_keys = b"".join(found_keys)
            joined_values = b"".join(values)
        # Both key lists are sorted byte strings of 8 bytes: compare them as big-endian uint64.
        wanted = np.frombuffer(b"".join(keys), dtype=">u8")
        positions = np.searchsorted(wanted, np.frombuffer(joined_keys, dtype=">u8"))
        found = np.zeros(len(keys), dtype=bool)
        found[positions] = True
        return found, joined_values

    def _write(self, table: str, keys: list[bytes], values: list[bytes] | None) -> None:
        with self._env.begin(write=True, db=self._dbs[table]) as txn:
            if values is None:
                # deque(map(...), maxlen=0) drives the C-level iterator without a Python-level loop body.
                deque(map(txn.delete, keys), maxlen=0)
            else:
                consumed, _added = txn.cursor().putmulti(zip(keys, values, strict=True), overwrite=True)
                if consumed != len(keys):  # leaving the block by exception aborts the transaction
                    raise StoreError(
                        f"lmdb store at {self.path!r}: put_many on table {table!r} wrote {consumed} of "
                        f"{len(keys)} records; nothing was committed"
                    )

    def _scan_batch(self, table: str, start: bytes, limit: int) -> tuple[bytes, bytes, int]:
        # A short read transaction per batch: a reader held across yields would stop LMDB from
        # reusing freed pages, and the file would grow for as long as the scan is paused.
        with self._env.begin(db=self._dbs[table], buffers=False) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(start):
                return b"", b"", 0
            items = list(islice(cursor.iternext(), limit))
            keys, values = zip(*items, strict=True)
            return b"".join(keys), b"".join(values), len(items)

    def _count(self, table: str) -> int:
        with self._env.begin() as txn:
            return int(txn.stat(self._dbs[table])["entries"])

    def _get_meta(self, key: bytes) -> bytes | None:
        with self._env.begin(db=self._meta) as txn:
            value = txn.get(key)
        return None if value is None else bytes(value)

    def _put_meta(self, key: bytes, value: bytes) -> None:
        with self._env.begin(write=True, db=self._meta) as txn:
            txn.put(key, value)

    def _flush(self) -> None:
        self._env.sync(True)
        # A new store's data file must also be reachable from its directory after a crash.
        fsync_dir(self.path)

    def _compact(self) -> None:
        pass  # a B+tree is always in its read-optimal shape; checkpoint(compact=True) defragments

    def _checkpoint(self, directory: str) -> None:
        # compact=True copies only live pages (the copy is also defragmented); the copy runs in
        # one read transaction, so it is consistent while writers continue.
        self._env.copy(directory, compact=True)
        fd = os.open(os.path.join(directory, _DATA_FILE), os.O_RDONLY)
        try:
            os.fsync(fd)  # mdb_env_copy does not promise the copy is on disk
        finally:
            os.close(fd)

    def _close(self) -> None:
        env, self._env = self._env, None
        self._dbs.clear()
        self._meta = None
        if env is not None:
            env.close()
