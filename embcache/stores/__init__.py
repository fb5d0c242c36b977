"""The cold (SSD) tier: durable key-value stores holding every row of every table.

Use :func:`open_store` to get a :class:`Store` of a given kind; see :mod:`.base` for the
interface and :mod:`.rocksdb` / :mod:`.lmdb` for each backend's durability and locking.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..types import StoreKind
from .base import Store
from .lmdb import LMDBStore
from .rocksdb import RocksDBStore

__all__ = ["STORE_KINDS", "LMDBStore", "RocksDBStore", "Store", "open_store"]

#: Backends by name.
STORE_KINDS: dict[str, type[Store]] = {StoreKind.ROCKSDB.value: RocksDBStore, StoreKind.LMDB.value: LMDBStore}


def open_store(kind: str | StoreKind, path: str, **options: Any) -> Store:
    """Open (or create) a store of the given kind at ``path``.

    Args:
        kind: "rocksdb" or "lmdb" (or a :class:`~embcache.types.StoreKind`).
        path: database directory; created if missing.
        **options: backend options, e.g. ``block_cache_bytes=`` for RocksDB or ``map_size=``
            for LMDB; see :class:`RocksDBStore` and :class:`LMDBStore`.

    Raises:
        ValueError: unknown kind, or an option the backend does not take or whose value is invalid.
        StoreLockedError: the path is held by another process or another open store.
        StoreError: the backend could not open or create the database.
    """
    name = kind.value if isinstance(kind, StoreKind) else kind
    cls = STORE_KINDS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown store kind {kind!r}; allowed: {', '.join(sorted(STORE_KINDS))}")
    allowed = [p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {name} store; allowed: {', '.join(allowed)}")
    return cls(path, **options)
