"""Durability: the store path's lock, write-back, flush, checkpoints (manifest and copy), restore.

A row in memory is authoritative until written back; :func:`write_back` (end of a pass, in
chunks, the lock taken per chunk) and :func:`flush` (every table, then the store's own flush:
durable against kill -9 and power loss) write dirty rows. A checkpoint is a copy of the store
(RocksDB's checkpoint or an LMDB copy) beside a ``manifest.json`` naming the format, backend,
table definitions and clocks; restoring copies it back, into the other backend if asked.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

from tqdm import tqdm

from ..config import CacheConfig, TableConfig
from ..errors import CheckpointExistsError, ConfigError, StoreLockedError
from ..hostmem import trim_heap
from ..optim import state_width
from ..stores import Store, open_store
from . import expiry
from .changes import MARK_BYTES, marks_table
from .rows import TOUCH_BYTES, record_bytes, table_meta_names, touch_table
from .table import TableEngine

__all__ = ["STORE_DIR", "PathLock", "check_checkpoint_target", "flush", "read_manifest", "restore_store",
           "write_back", "write_checkpoint"]

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
LOCK_FILE = "embcache.lock"
STORE_DIR = "store"


class PathLock:
    """The exclusive lock of a cache's path: one open cache per path, across processes."""

    def __init__(self, path: str) -> None:
        self.path = path
        lock = os.path.join(path, LOCK_FILE)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(
                f"store path {path!r} is held by another process or open cache (pid {holder}); "
                "close it first or use another path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor drops the flock). Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_back(t: TableEngine) -> int:
    """Write one table's dirty rows to the store in chunks, taking the lock per chunk; how many."""
    written = 0
    for tier in (t.hbm, t.ddr):
        while True:
            with t.lock:
                if t.closed:
                    return written
                n = t.write_dirty_chunk(tier)
            if n == 0:
                break
            written += n
    return written


def flush(tables: Mapping[str, TableEngine], store: Store, save_frequencies: bool) -> None:
    """Write every dirty row (and, with ``save_frequencies``, the frequency state), then make the
    store durable (every table lock held)."""
    for name in sorted(tables):
        t = tables[name]
        expiry.flush_touches(t)  # touches since the last flush, before the rows (rows expiring only)
        t.write_dirty()
        if save_frequencies:
            t.save_frequencies()
    store.flush()
    trim_heap()


def check_checkpoint_target(directory: str) -> None:
    """Refuse a checkpoint directory that exists and is not empty."""
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise CheckpointExistsError(f"checkpoint directory {directory!r} exists and is not empty; "
                                    "pass a new or empty directory")


def write_checkpoint(directory: str, store: Store, config: CacheConfig, tables: Mapping[str, TableEngine]) -> None:
    """Copy the (flushed) store into ``directory`` and write its manifest last, atomically."""
    os.makedirs(directory, exist_ok=True)
    store.checkpoint(os.path.join(directory, STORE_DIR))
    manifest = {
        "format": FORMAT_VERSION,
        "store": config.store,
        "tables": [tables[n].cfg.to_dict() for n in sorted(tables)],
        "clocks": {n: tables[n].clock.state() for n in sorted(tables)},
        "created_unix": time.time(),
    }
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))


def read_manifest(directory: str) -> dict[str, Any]:
    """A checkpoint's manifest.

    Raises:
        ConfigError: ``directory`` holds no checkpoint, or one of another format.
    """
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{directory!r} holds no embcache checkpoint ({MANIFEST} missing)") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint format {manifest.get('format')!r} is not supported (want {FORMAT_VERSION})")
    return manifest


def restore_store(directory: str, config: CacheConfig) -> None:
    """Put the checkpoint in ``directory`` at ``config.path`` (converted to ``config.store``'s backend).

    Raises:
        ConfigError: no checkpoint there, or ``config.path`` already holds a store.
    """
    manifest = read_manifest(directory)
    target = os.path.join(config.path, STORE_DIR)
    if os.path.exists(target) and os.listdir(target):
        raise ConfigError(f"restore target {config.path!r} already holds a store; pass an empty path")
    source = os.path.join(directory, STORE_DIR)
    os.makedirs(config.path, exist_ok=True)
    if manifest["store"] == config.store:
        shutil.copytree(source, target, dirs_exist_ok=True)
    else:
        _copy_store(manifest, source, config, target)


def _copy_store(manifest: dict[str, Any], source: str, config: CacheConfig, target: str) -> None:
    """Copy a checkpoint's store into a store of another backend (row batches, via scan)."""
    src = open_store(manifest["store"], source)
    dst = open_store(config.store, target, **dict(config.store_options))
    try:
        present = set(src.tables())
        for d in manifest["tables"]:
            tcfg = TableConfig.from_dict(d)
            copies = [(tcfg.name, record_bytes(tcfg.dim, tcfg.torch_dtype, state_width(tcfg.optimizer, tcfg.dim))),
                      (marks_table(tcfg.name), MARK_BYTES),  # the change marks of delta exports, if any
                      (touch_table(tcfg.name), TOUCH_BYTES)]  # the last touches of an expiring table
            for table, width in copies:
                if table not in present:
                    continue
                dst.open_table(table, width)
                with tqdm(desc=f"restoring {table}", unit="rows", unit_scale=True, leave=False) as bar:
                    for keys, records in src.scan(table):
                        dst.put_many(table, keys, records)
                        bar.update(len(keys))
        for name in table_meta_names(d["name"] for d in manifest["tables"]):
            value = src.get_meta(name)
            if value is not None:
                dst.put_meta(name, value)
        dst.flush()
    finally:
        src.close()
        dst.close()
