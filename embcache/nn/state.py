"""The tables of the modules of :mod:`embcache.nn` in ``state_dict()`` and ``load_state_dict()``.

:class:`TableStateModule` is the base that gives a module one state_dict entry,
``<prefix>._extra_state`` (:data:`STATE_KEY`), for its tables, as ``persist`` says: the rows
themselves, exported from the cache (``"rows"``), the path of a cache checkpoint written for the
``state_dict()`` call (``"checkpoint"``), or nothing (``"none"``). Loading makes the tables hold
exactly the saved rows. The rules, warnings and errors are those of "Checkpoints" in
:mod:`embcache.nn`.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch
from torch import nn

from ..config import CacheConfig, TableConfig
from ..errors import ConfigError
from .lookup import CacheLike

__all__ = ["DEFAULT_MAX_STATE_BYTES", "PERSIST", "STATE_KEY", "TableStateModule"]

#: What a module's ``state_dict()`` holds of its tables (the ``persist`` argument): see "Checkpoints".
PERSIST: tuple[str, ...] = ("rows", "checkpoint", "none")

#: The state_dict key (after the module's prefix) of a module's tables: torch's name for non-tensor state.
STATE_KEY = "_extra_state"
_STATE_FORMAT = 1
_IMPORT_ROWS = 1 << 16  # rows per import_rows/delete_rows call on load
#: Default ``max_state_bytes``: above it, persist="rows" leaves the rows out of the state_dict (and warns).
DEFAULT_MAX_STATE_BYTES = 256 << 20

#: One batch of exported rows: keys int64 [n], records uint8 [n, record bytes], frequencies float32 [n].
_RowBatch = tuple[np.ndarray, np.ndarray, np.ndarray]


class _RowCache(Protocol):
    """What saving and loading rows use of a cache beyond :class:`CacheLike` (an EmbeddingCache has it)."""

    def export_rows(self, table: str, select: Callable[[np.ndarray], np.ndarray], /) -> Iterator[_RowBatch]:
        """Every stored row of ``table`` whose key ``select`` picks (a bool mask of a keys array)."""
        ...

    def import_rows(self, table: str, keys: torch.Tensor, records: np.ndarray, freq: np.ndarray, /) -> None:
        """Replace the rows of ``keys`` with exported ``records`` and raise their frequencies to ``freq``."""
        ...

    def delete_rows(self, table: str, keys: torch.Tensor, /) -> None:
        """Delete the rows of ``keys``."""
        ...


class _Checkpointing(Protocol):
    """A cache that writes checkpoints: an EmbeddingCache (returns None) or a Client (the servers' directories)."""

    def checkpoint(self, directory: str, /) -> list[str] | None:
        """Write a consistent checkpoint of all tables to ``directory``."""
        ...


if TYPE_CHECKING:  # checked by mypy only: the caches these protocols stand for have them
    from ..cache import EmbeddingCache
    from ..client import Client

    def _embedded_cache_has_rows(cache: EmbeddingCache) -> _RowCache:
        return cache

    def _caches_checkpoint(cache: EmbeddingCache, client: Client) -> tuple[_Checkpointing, _Checkpointing]:
        return cache, client


class TableStateModule(nn.Module):
    """Base of the modules: the state_dict entry of their tables (see "Checkpoints" in :mod:`embcache.nn`).

    A subclass sets ``cache``, calls :meth:`_init_persist` from its constructor and says which
    tables it holds (:meth:`_state_tables`).
    """

    cache: CacheLike
    persist: str
    checkpoint_dir: str | None
    max_state_bytes: int

    def _init_persist(self, persist: str, checkpoint_dir: str | os.PathLike[str] | None, max_state_bytes: int) -> None:
        if persist not in PERSIST:
            raise ConfigError(f"persist={persist!r} is not allowed; choose one of {', '.join(map(repr, PERSIST))}")
        if (persist == "checkpoint") != (checkpoint_dir is not None):
            raise ConfigError("checkpoint_dir is required with persist='checkpoint' and only allowed with it")
        if isinstance(max_state_bytes, bool) or not isinstance(max_state_bytes, int) or max_state_bytes < 0:
            raise ConfigError(f"max_state_bytes={max_state_bytes!r}: must be an int >= 0")
        self.persist = persist
        self.checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir)) if checkpoint_dir is not None else None
        self.max_state_bytes = max_state_bytes

    def _state_tables(self) -> list[str]:
        """The tables whose rows this module's state holds."""
        raise NotImplementedError

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.persist != "none":
            destination[prefix + STATE_KEY] = self._cache_state(destination)

    def _cache_state(self, destination: dict[str, Any]) -> dict[str, Any]:
        """The state_dict entry of this module's tables (see "Checkpoints" in :mod:`embcache.nn`)."""
        tables = self._state_tables()
        configs = self.cache.tables()
        state: dict[str, Any] = {"format": _STATE_FORMAT, "persist": self.persist,
                                 "configs": {t: configs[t].to_dict() for t in tables}}
        exportable = callable(getattr(self.cache, "export_rows", None))
        if self.persist == "checkpoint":
            directory, written = _checkpoint_once(destination, cast(_Checkpointing, self.cache), self.checkpoint_dir)
            state["directory"] = directory
            if not exportable:  # a remote Client: the servers wrote one directory per shard
                state["persist"] = "remote"
                state["directories"] = list(written or [])
                warnings.warn(f"{type(self).__name__}: the cache is remote; the servers checkpointed the tables "
                              f"{tables} to {state['directories']}, which load_state_dict cannot restore: "
                              f"restart the servers from those directories", RuntimeWarning, stacklevel=4)
            return state
        if not exportable:
            warnings.warn(f"{type(self).__name__}: the cache ({type(self.cache).__name__}) cannot export rows, so "
                          f"this state_dict does NOT hold the tables {tables}; checkpoint the servers "
                          f"(Client.checkpoint) or build the module with persist='none' to silence this",
                          RuntimeWarning, stacklevel=4)
            state["persist"] = "omitted"
            return state
        rows: dict[str, dict[str, torch.Tensor]] = {}
        total = 0
        for t in tables:
            keys, records, freq = [], [], []
            for k, r, f in cast(_RowCache, self.cache).export_rows(t, _select_all):
                total += r.nbytes
                if total > self.max_state_bytes:
                    warnings.warn(f"{type(self).__name__}: the rows of {tables} exceed max_state_bytes="
                                  f"{self.max_state_bytes}, so this state_dict does NOT hold them; build the module "
                                  f"with persist='checkpoint', checkpoint_dir=... (a cache checkpoint named in the "
                                  f"state_dict) or a larger max_state_bytes", RuntimeWarning, stacklevel=4)
                    state["persist"] = "omitted"
                    return state
                keys.append(torch.from_numpy(np.array(k, dtype=np.int64)))
                records.append(torch.from_numpy(np.array(r, dtype=np.uint8)))
                freq.append(torch.from_numpy(np.array(f, dtype=np.float32)))
            rows[t] = {"keys": torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64),
                       "records": torch.cat(records) if records else torch.zeros(0, 0, dtype=torch.uint8),
                       "freq": torch.cat(freq) if freq else torch.zeros(0)}
        state["rows"] = rows
        return state

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + STATE_KEY
        if key in unexpected_keys:  # torch expects it only of modules with set_extra_state
            unexpected_keys.remove(key)
        if self.persist == "none":
            return  # the cache persists itself: rows in the state_dict are ignored
        if key not in state_dict:  # torch always passes strict=True here; load_state_dict(strict=False) returns it
            missing_keys.append(key)
            return
        self._restore(state_dict[key], error_msgs)

    def _restore(self, state: Any, error_msgs: list[str]) -> None:
        """Make the cache's tables hold the rows of a state saved by :meth:`_cache_state`."""
        name = type(self).__name__
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            error_msgs.append(f"{name}: {STATE_KEY} is not an embcache module state (format {_STATE_FORMAT})")
            return
        saved = state.get("configs", {})
        tables = self._state_tables()
        configs = self.cache.tables()
        for t in tables:
            if t not in saved:
                error_msgs.append(f"{name}: the state holds no table {t!r} (it has {sorted(saved)})")
                continue
            conflicts = TableConfig.from_dict(saved[t]).layout_conflicts(configs[t])
            if conflicts:
                error_msgs.append(f"{name}: table {t!r} was saved with other {', '.join(conflicts)}")
        if error_msgs:
            return
        persist = state["persist"]
        if persist in ("omitted", "remote"):
            where = f" (the servers' checkpoints: {state.get('directories')})" if persist == "remote" else ""
            warnings.warn(f"{name}: this state_dict does not hold the rows of {tables}{where}; the cache keeps "
                          f"its own", RuntimeWarning, stacklevel=4)
            return
        if not callable(getattr(self.cache, "import_rows", None)):
            warnings.warn(f"{name}: the cache ({type(self.cache).__name__}) cannot import rows; the rows of "
                          f"{tables} in this state_dict are NOT loaded", RuntimeWarning, stacklevel=4)
            return
        cache = cast(_RowCache, self.cache)
        if persist == "rows":
            for t in tables:
                entry = state["rows"][t]
                _replace_rows(cache, t, [(entry["keys"].numpy(), entry["records"].numpy(), entry["freq"].numpy())])
            return
        # persist == "checkpoint": open the checkpoint as a small CPU cache and copy the tables' rows over
        from ..cache import EmbeddingCache
        directory = state["directory"]
        with tempfile.TemporaryDirectory(prefix="embcache-load-") as tmp:
            manifest_store = _checkpoint_store(directory)
            config = CacheConfig(hbm_bytes=1 << 20, ddr_bytes=1 << 20, path=tmp, store=manifest_store, device="cpu")
            with EmbeddingCache.restore(directory, config) as source:
                for t in tables:
                    _replace_rows(cache, t, source.export_rows(t, _select_all))


# ---------------------------------------------------------------------- checkpoints
#: (id(state_dict being built), id(cache)) -> (weak reference to it, the checkpoint written for it)
_CHECKPOINTS: dict[tuple[int, int], tuple[weakref.ref[dict[str, Any]], tuple[str, list[str] | None]]] = {}


def _checkpoint_once(destination: dict[str, Any], cache: _Checkpointing,
                     root: str | None) -> tuple[str, list[str] | None]:
    """Checkpoint ``cache`` under ``root`` once per ``state_dict()`` call: modules sharing a cache share it.

    Returns the directory and what ``cache.checkpoint`` returned (a Client: the servers' directories).
    """
    assert root is not None
    key = (id(destination), id(cache))
    hit = _CHECKPOINTS.get(key)
    if hit is not None and hit[0]() is destination:
        return hit[1]
    directory = os.path.join(root, f"embcache-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
    result = (directory, cache.checkpoint(directory))
    try:
        ref = weakref.ref(destination, lambda _: _CHECKPOINTS.pop(key, None))
    except TypeError:  # a destination that takes no weak reference: each module writes its own
        return result
    _CHECKPOINTS[key] = (ref, result)
    return result


def _select_all(keys: np.ndarray) -> np.ndarray:
    return np.ones(keys.shape[0], dtype=bool)


def _checkpoint_store(directory: str) -> str:
    """The store backend a cache checkpoint was written with (its manifest's)."""
    import json

    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            return str(json.load(f)["store"])
    except FileNotFoundError:
        raise ConfigError(f"{directory!r} holds no embcache checkpoint (manifest.json missing); was it moved? "
                          f"The state_dict names it by its absolute path") from None


def _replace_rows(cache: _RowCache, table: str, batches: Iterable[_RowBatch]) -> None:
    """Make ``table`` hold exactly the rows of ``batches`` ((keys, records, freq) ...) among its stored rows.

    Stored rows the batches do not have are deleted (a later lookup creates them from the
    initializer again, as the saved cache would), then the batches' rows are imported.
    """
    keys_seen: list[np.ndarray] = []
    for keys, records, freq in batches:
        keys = np.asarray(keys, dtype=np.int64)
        for i in range(0, keys.shape[0], _IMPORT_ROWS):
            cache.import_rows(table, torch.from_numpy(np.ascontiguousarray(keys[i:i + _IMPORT_ROWS])),
                              records[i:i + _IMPORT_ROWS], freq[i:i + _IMPORT_ROWS])
        keys_seen.append(keys)
    saved = np.concatenate(keys_seen) if keys_seen else np.zeros(0, dtype=np.int64)
    stale = [k for k, _, _ in cache.export_rows(table, lambda ks: ~np.isin(ks, saved))]
    for k in stale:
        for i in range(0, k.shape[0], _IMPORT_ROWS):
            cache.delete_rows(table, torch.from_numpy(np.ascontiguousarray(k[i:i + _IMPORT_ROWS])))
