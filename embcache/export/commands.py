"""``embcache export`` and ``embcache import``: full dumps of a store into the export format, and loads back.

    embcache export STORE_DIR OUT_DIR [--with-state] [--table T ...]
    embcache import EXPORT_DIR STORE_DIR [--version N] [--no-with-state] [--store rocksdb|lmdb]

``export`` reads a closed cache's path (the directory given as ``CacheConfig.path``) or a
checkpoint directory, and writes every stored row as a new *full* version under ``OUT_DIR``; it
never changes the store. A path a running trainer holds is locked: stop it (or export from the
trainer with ``EmbeddingCache.export_delta``, or from a checkpoint). ``import`` opens (or
creates) a cache at ``STORE_DIR`` and loads a version into it (:meth:`EmbeddingCache.import_version`):
missing tables are created from the version's definitions, rows keep their optimizer state
when the version carries it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence

from ..config import CacheConfig, TableConfig
from ..engine.durability import STORE_DIR, PathLock, read_manifest
from ..engine.export import PartBuilder, decode_batch
from ..engine.rows import META_TABLES, RecordCodec
from ..errors import ConfigError, EmbcacheError, UnknownTableError
from ..optim import state_width
from ..stores import Store, open_store
from .format import TablePart, Version, check_directory, list_versions, write_version

__all__ = ["add_export_arguments", "add_import_arguments", "export_store", "run_export", "run_import",
           "store_kind"]


def store_kind(store_dir: str) -> str | None:
    """The backend of the store in ``store_dir`` ("rocksdb", "lmdb"), or None when it holds none."""
    if os.path.exists(os.path.join(store_dir, "CURRENT")):
        return "rocksdb"
    if os.path.exists(os.path.join(store_dir, "data.mdb")):
        return "lmdb"
    return None


def _table_parts(store: Store, configs: Sequence[TableConfig], with_state: bool) -> dict[str, TablePart]:
    parts: dict[str, TablePart] = {}
    for cfg in configs:
        codec = RecordCodec(cfg, state_width(cfg.optimizer, cfg.dim))
        out = PartBuilder(cfg, with_state)
        for keys, records in store.scan(cfg.name):
            out.add(*decode_batch(codec, keys, records, with_state))
        parts[cfg.name] = out.part()
    return parts


def export_store(source: str, out_dir: str, *, with_state: bool = False,
                 tables: Sequence[str] | None = None) -> Version:
    """Write every stored row of a closed cache path or a checkpoint as a new full version.

    Raises:
        StoreLockedError: a running cache holds ``source``.
        ConfigError: ``source`` holds no store. UnknownTableError: a table it lacks.
        ExportFormatError: ``out_dir`` is not a directory.
    """
    out_dir = check_directory(out_dir)
    lock: PathLock | None = None
    if os.path.exists(os.path.join(source, "manifest.json")):  # a checkpoint
        kind = str(read_manifest(source)["store"])
    else:
        if not os.path.isdir(os.path.join(source, STORE_DIR)):
            raise ConfigError(f"{source!r} holds no embcache store (no {STORE_DIR}/ and no checkpoint manifest)")
        lock = PathLock(source)  # a trainer holding the path makes this raise StoreLockedError
        found = store_kind(os.path.join(source, STORE_DIR))
        if found is None:
            lock.release()
            raise ConfigError(f"{os.path.join(source, STORE_DIR)!r} holds no RocksDB or LMDB store")
        kind = found
    try:
        store = open_store(kind, os.path.join(source, STORE_DIR))
        try:
            raw = store.get_meta(META_TABLES)
            configs = {d["name"]: TableConfig.from_dict(d) for d in json.loads(raw)} if raw else {}
            names = sorted(configs) if not tables else list(dict.fromkeys(tables))
            for name in names:
                if name not in configs:
                    raise UnknownTableError(f"{source!r} has no table {name!r} (tables: {sorted(configs)})")
            parts = _table_parts(store, [configs[n] for n in names], with_state)
        finally:
            store.close()
    finally:
        if lock is not None:
            lock.release()
    number = (list_versions(out_dir) or [0])[-1] + 1
    return write_version(out_dir, number, "full", parts,
                         covers={"chain": uuid.uuid4().hex, "time": time.time(), "source": os.path.abspath(source)})


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    """The ``export`` subcommand's options."""
    p.add_argument("store_dir", help="a closed cache's path (CacheConfig.path) or a checkpoint directory")
    p.add_argument("out_dir", help="the export directory (the version is numbered after the last one there)")
    p.add_argument("--with-state", action="store_true", help="export the optimizer state too (default: weights only)")
    p.add_argument("--table", action="append", dest="tables", metavar="T", help="export only T (repeatable)")


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    """The ``import`` subcommand's options."""
    p.add_argument("export_dir", help="an export directory (embcache export, export_delta, from_tensor)")
    p.add_argument("store_dir", help="the cache path to load into (created if missing)")
    p.add_argument("--version", type=int, default=None, help="the version to load (default: the newest complete)")
    p.add_argument("--with-state", action=argparse.BooleanOptionalAction, default=True,
                   help="take the optimizer state when the version carries it (default: yes)")
    p.add_argument("--store", choices=["rocksdb", "lmdb"], default=None,
                   help="backend of a new store (default: the existing store's, else rocksdb)")
    p.add_argument("--table", action="append", dest="tables", metavar="T", help="load only T (repeatable)")


def run_export(args: argparse.Namespace) -> int:
    """Run ``embcache export``."""
    try:
        v = export_store(args.store_dir, args.out_dir, with_state=args.with_state, tables=args.tables)
    except (EmbcacheError, OSError) as exc:
        print(f"embcache export: {exc}", file=sys.stderr)
        return 1
    rows = sum(int(e["rows"]) for e in v.tables.values())
    print(f"wrote version {v.version} (full) to {v.path}: {rows} rows of {len(v.tables)} table(s)")
    return 0


def run_import(args: argparse.Namespace) -> int:
    """Run ``embcache import``."""
    from ..cache import EmbeddingCache

    kind = store_kind(os.path.join(args.store_dir, STORE_DIR)) or args.store or "rocksdb"
    if args.store is not None and args.store != kind:
        print(f"embcache import: {args.store_dir!r} holds a {kind} store, not {args.store}", file=sys.stderr)
        return 1
    try:
        config = CacheConfig(path=args.store_dir, store=kind, device="cpu", hbm_bytes=0, ddr_bytes=0)
        with EmbeddingCache(config) as cache:
            written = cache.import_version(args.export_dir, args.version, with_state=args.with_state,
                                           tables=args.tables)
    except (EmbcacheError, OSError) as exc:
        print(f"embcache import: {exc}", file=sys.stderr)
        return 1
    print(f"imported {sum(written.values())} rows into {args.store_dir}: "
          + ", ".join(f"{t}: {n}" for t, n in sorted(written.items())))
    return 0
