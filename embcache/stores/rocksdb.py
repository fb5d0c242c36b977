"""RocksDB backend (via rocksdict): one column family per table, tuned for small values and point reads.

Durability: every write goes to the write-ahead log (WAL) without fsync. A write that returned
is therefore in the OS page cache and survives the process being killed (kill -9, OOM); it
survives an OS crash or power loss once :meth:`Store.flush` (``flush_wal(sync=True)``) has
returned. Each ``put_many`` / ``delete_many`` is one ``WriteBatch``: the WAL holds it whole or
not at all, so recovery never sees half a batch.

Only one process may open a path: RocksDB takes a file lock, and a second opener gets
:class:`StoreLockedError`.
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import islice
from typing import Any, cast

import numpy as np
import rocksdict

from ..errors import StoreError, StoreFullError, StoreLockedError
from .base import TABLE_PREFIX, Store

__all__ = ["RocksDBStore"]

# Large reads are split into contiguous ranges of their sorted keys, read by several threads at
# once: MultiGet releases the GIL, and many reads in flight keep a disk's queue busy. Measured
# here, 65,536 random keys from a cold 1.6 GB store: 11K rows/s with one reader, 17K with 4,
# 29K with 16, 36K with 32 (bench_big staged a pass from its cold 46 GB store at ~10K rows/s).
_READ_THREADS = 16
_PARALLEL_READ_MIN = 4096
_META_CF = "__meta__"
_DEFAULT_CF = "default"


class RocksDBStore(Store):
    """A :class:`Store` on RocksDB; tables are column families, meta blobs live in ``__meta__``."""

    kind = "rocksdb"

    def __init__(
        self,
        path: str,
        *,
        block_cache_bytes: int = 256 << 20,
        write_buffer_bytes: int = 64 << 20,
        bloom_bits_per_key: int = 10,
        max_background_jobs: int = 4,
        max_total_wal_bytes: int = 1 << 30,
    ) -> None:
        """Open or create a RocksDB store at ``path``.

        Args:
            path: database directory; created if missing.
            block_cache_bytes: LRU cache of uncompressed blocks shared by all tables (default 256 MiB).
            write_buffer_bytes: size of each memtable per table (default 64 MiB; up to 3 per table).
            bloom_bits_per_key: bloom filter bits per key, so reads of absent keys rarely touch
                disk (default 10, about 1% false positives).
            max_background_jobs: threads for flushes and compactions (default 4).
            max_total_wal_bytes: WAL size at which the tables holding the oldest log are
                flushed (default 1 GiB); bounds the WAL when some tables are rarely written.

        Raises:
            StoreLockedError: another process (or another store in this process) holds ``path``.
            StoreError: RocksDB could not open or create the database.
        """
        self._options = _make_options(
            block_cache_bytes, write_buffer_bytes, bloom_bits_per_key, max_background_jobs, max_total_wal_bytes
        )
        self._write_opts = rocksdict.WriteOptions()
        self._write_opts.sync = False  # the WAL is still written; flush() fsyncs it
        self._sync_opts = rocksdict.WriteOptions()
        self._sync_opts.sync = True
        # The stub declares fill_cache() without its bool argument; the binding takes one.
        self._scan_opts = rocksdict.ReadOptions()
        cast(Any, self._scan_opts).fill_cache(False)  # a full scan must not evict the hot blocks of point reads
        self._db: rocksdict.Rdict | None = None
        # Any: rocksdict's stubs type keys and values as str | int | float | bytes | bool; raw mode gives bytes.
        self._meta: Any = None
        self._cfs: dict[str, Any] = {}
        self._handles: dict[str, rocksdict.ColumnFamily] = {}
        self._readers: ThreadPoolExecutor | None = None  # large reads in parallel (see _multi_get)
        # After a failed write for lack of space RocksDB stops accepting writes (a sticky
        # background error) even once space is freed, and rocksdict cannot call DB::Resume:
        # the next operation reopens the database instead, replaying its WAL (nothing is lost).
        self._needs_reopen = False
        self._reopen_free_bytes = 2 * write_buffer_bytes
        super().__init__(path)

    def _recover(self, write: bool) -> None:
        """Reopen the database if an earlier out-of-space error left it refusing writes.

        Reads go on from the database in its error state; a write reopens it once the disk has
        room for a memtable again (else StoreFullError, and the next write tries again).
        """
        if not self._needs_reopen:
            return
        if self._db is not None:
            if not write:
                return
            free = shutil.disk_usage(self.path).free
            if free < self._reopen_free_bytes:
                raise StoreFullError(
                    f"rocksdb store at {self.path!r}: the disk is still full ({free} bytes free); "
                    "free space and retry")
            try:
                self._close()
            except Exception:  # closing a database in the error state may report the error again
                self._db = None
        self._open()
        self._needs_reopen = False

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Reopen first if needed; after an out-of-space failure, reopen before the next write."""
        self._recover(write=True)
        try:
            yield
        except Exception as exc:
            if self._error_class(exc) is not StoreError:
                self._needs_reopen = True
            raise

    def _open(self) -> None:
        if os.path.exists(os.path.join(self.path, "data.mdb")):
            raise StoreError(f"rocksdb store at {self.path!r}: the directory holds an LMDB database; open it as 'lmdb'")
        names = [_DEFAULT_CF]
        if os.path.exists(os.path.join(self.path, "CURRENT")):
            # RocksDB refuses to open a database unless every existing column family is named.
            try:
                names = rocksdict.Rdict.list_cf(self.path, self._options)
            except Exception as exc:
                raise StoreError(f"rocksdb store at {self.path!r}: listing column families failed: {exc}") from exc
        column_families = {name: self._options for name in names if name != _DEFAULT_CF}
        column_families.setdefault(_META_CF, self._options)
        try:
            self._db = rocksdict.Rdict(self.path, self._options, column_families=column_families)
        except Exception as exc:
            text = str(exc)
            if "lock" in text.lower():
                raise StoreLockedError(
                    f"rocksdb store at {self.path!r} is held by another process (or another open store): {text}"
                ) from exc
            raise self._error_class(exc)(f"rocksdb store at {self.path!r}: open failed: {text}") from exc
        try:
            self._meta = self._db.get_column_family(_META_CF)
            for name in column_families:
                if name != _META_CF:
                    self._cfs[name] = self._db.get_column_family(name)
                    self._handles[name] = self._db.get_column_family_handle(name)
            # The registry is tiny (one entry per table): a Python loop over it is fine.
            for key, value in self._meta.items(from_key=TABLE_PREFIX):
                if not key.startswith(TABLE_PREFIX):
                    break
                table = key[len(TABLE_PREFIX) :].decode()
                if table not in self._cfs:
                    raise StoreError(f"rocksdb store at {self.path!r}: table {table!r} is registered but has no data")
                self._widths[table] = int(value)
        except Exception as exc:
            self._close()
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"rocksdb store at {self.path!r}: reading the table registry failed: {exc}") from exc

    def _create_table(self, table: str, record_bytes: int) -> None:
        assert self._db is not None and self._meta is not None
        # A crash between these two steps leaves a column family without a registry entry;
        # reopening opens it anyway and open_table then adopts it instead of creating it again.
        if table not in self._cfs:
            self._cfs[table] = self._db.create_column_family(table, self._options)
            self._handles[table] = self._db.get_column_family_handle(table)
        # Synced: a table whose creation returned must not vanish in a power loss.
        self._meta.put(TABLE_PREFIX + table.encode(), str(record_bytes).encode(), self._sync_opts)

    def _multi_get(self, table: str, keys: list[bytes]) -> tuple[np.ndarray, bytes]:
        self._recover(write=False)
        cf = self._cfs[table]
        if len(keys) >= _PARALLEL_READ_MIN:
            step = -(-len(keys) // _READ_THREADS)
            parts = [keys[i:i + step] for i in range(0, len(keys), step)]
            values = [v for part in self._read_pool().map(cf.get, parts) for v in part]
        else:
            values = cf.get(keys)  # one batched MultiGet; None where absent
        # Records are never empty, so truthiness is exactly "found".
        found = np.fromiter(map(bool, values), dtype=np.bool_, count=len(keys))
        return found, b"".join(filter(None, values))

    def _write(self, table: str, keys: list[bytes], values: list[bytes] | None) -> None:
        with self._writing():
            assert self._db is not None
            batch = rocksdict.WriteBatch(raw_mode=True)
            batch.set_default_column_family(self._handles[table])
            # deque(map(...), maxlen=0) drives the C-level iterator without a Python-level loop body.
            if values is None:
                deque(map(batch.delete, keys), maxlen=0)
            else:
                deque(map(batch.put, keys, values), maxlen=0)
            try:
                self._db.write(batch, self._write_opts)
            except Exception:
                # The batch refers to a column-family handle, which keeps the database (and its
                # LOCK) alive as long as the traceback holds this frame: drop it so a reopen works.
                del batch
                raise

    def _scan_batch(self, table: str, start: bytes, limit: int) -> tuple[bytes, bytes, int]:
        # A fresh iterator per batch: an iterator alive across yields would keep the database
        # open (and locked) after close(), since rocksdict closes only when nothing refers to it.
        items = list(islice(self._cfs[table].items(from_key=start, read_opt=self._scan_opts), limit))
        if not items:
            return b"", b"", 0
        keys, values = zip(*items, strict=True)
        return b"".join(keys), b"".join(values), len(items)

    def _count(self, table: str) -> int:
        last = deque(enumerate(self._cfs[table].keys(read_opt=self._scan_opts), 1), maxlen=1)
        return int(last[0][0]) if last else 0

    def _get_meta(self, key: bytes) -> bytes | None:
        assert self._meta is not None
        value = self._meta.get(key)
        return None if value is None else bytes(value)

    def _put_meta(self, key: bytes, value: bytes) -> None:
        with self._writing():
            assert self._meta is not None
            self._meta.put(key, value, self._write_opts)

    def _flush(self) -> None:
        with self._writing():
            assert self._db is not None
            self._db.flush_wal(True)

    def _compact(self) -> None:
        for cf in self._cfs.values():
            cf.compact_range(None, None)
        assert self._db is not None
        self._db.compact_range(None, None)

    def _checkpoint(self, directory: str) -> None:
        assert self._db is not None
        # RocksDB creates the directory itself and refuses an existing one; the caller checked it is empty.
        os.rmdir(directory)
        rocksdict.Checkpoint(self._db).create_checkpoint(directory)

    def _read_pool(self) -> ThreadPoolExecutor:
        if self._readers is None:
            self._readers = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="embcache-store-read")
        return self._readers

    def _close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None
        # rocksdict keeps the database (and its LOCK) open while any column-family object or
        # handle refers to it, even after close(); drop them all before closing.
        cfs = [*self._cfs.values(), *([self._meta] if self._meta is not None else [])]
        self._cfs.clear()
        self._handles.clear()
        self._meta = None
        db, self._db = self._db, None
        for cf in cfs:
            cf.close()
        del cfs
        if db is not None:
            db.close()


def _make_options(
    block_cache_bytes: int,
    write_buffer_bytes: int,
    bloom_bits_per_key: int,
    max_background_jobs: int,
    max_total_wal_bytes: int,
) -> rocksdict.Options:
    """RocksDB options for 100-300 byte values under 8-byte keys, read mostly by point lookups."""
    for name, value in (
        ("block_cache_bytes", block_cache_bytes),
        ("write_buffer_bytes", write_buffer_bytes),
        ("max_background_jobs", max_background_jobs),
        ("max_total_wal_bytes", max_total_wal_bytes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(bloom_bits_per_key, bool) or not isinstance(bloom_bits_per_key, int) or bloom_bits_per_key < 0:
        raise ValueError(
            f"bloom_bits_per_key must be an integer >= 0 (0 disables the filter), got {bloom_bits_per_key!r}"
        )
    opts = rocksdict.Options(raw_mode=True)  # values are our bytes, not pickles
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    opts.increase_parallelism(max(2, os.cpu_count() or 2))
    opts.set_max_background_jobs(max_background_jobs)
    opts.set_write_buffer_size(write_buffer_bytes)
    opts.set_max_write_buffer_number(3)
    opts.set_max_total_wal_size(max_total_wal_bytes)
    opts.set_level_compaction_dynamic_level_bytes(True)
    opts.set_bytes_per_sync(1 << 20)  # write back SST files gradually instead of in one burst
    opts.set_keep_log_file_num(5)
    # Float weights barely compress; LZ4 is cheap enough to keep for the zero-heavy optimizer state.
    opts.set_compression_type(rocksdict.DBCompressionType.lz4())
    table = rocksdict.BlockBasedOptions()
    table.set_block_cache(rocksdict.Cache(block_cache_bytes))
    if bloom_bits_per_key:
        table.set_bloom_filter(bloom_bits_per_key, False)  # full (not block-based) filters
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    # Hash index inside data blocks: point lookups skip the binary search within a block.
    table.set_data_block_index_type(rocksdict.DataBlockIndexType.binary_and_hash())
    table.set_format_version(5)
    opts.set_block_based_table_factory(table)
    return opts
