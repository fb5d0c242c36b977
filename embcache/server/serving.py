"""Serving mode: a server that serves an exported model read-only and follows its new versions.

``embcache-server --serve DIR [--follow]`` builds its cache from the export in ``DIR``
(:mod:`embcache.export.format`): one table per table of the export, weights only (each table is
opened with the ``sgd`` optimizer, whose state is 0 bytes wide, so the tiers' budgets count no
optimizer bytes), its rows written into a store of the server's own (a fresh directory under
``--path``, removed at a clean stop) so that the tiers work as usual for models larger than
memory. The cache is opened with ``lookups_create_rows=False``: a key the model lacks gets the
configured default row (``--unknown-rows``: zeros, or the table's initializer) and creates
nothing, in memory or in the store.

Every call that could change a row, a table, a pass, a pin or a file (role "write" in
:data:`embcache.server.auth.ROLES`) is refused by one interceptor, :class:`ReadOnlyGuard`:
FAILED_PRECONDITION, error type :class:`~embcache.errors.ReadOnlyError`, marked not applied,
naming the version served. FAILED_PRECONDITION because the call is well formed and the caller may
be entitled to it: the *server's state* (serving an export) is what refuses it, which is that
code's meaning (PERMISSION_DENIED is the token check's answer, about who calls).

Versions switch atomically: :class:`VersionGate` is a reader-writer gate. Each Lookup (every
table and chunk of it) holds it shared; applying a version first stages everything it needs
outside the gate (reads and checks the version's files, encodes the rows, finds the stored keys
a full version drops), then takes the gate alone only to delete the keys the version deletes,
create its new tables, install an :class:`~embcache.server.overlay.Overlay` of its rows and move
the served version number. The rows are then written into the store, and their copies in the
memory tiers refreshed in place (hot rows stay hot), in chunks of ``_WRITE_CHUNK`` rows beside
the lookups, which take the overlay's rows over the cache's until the last chunk is written. A
lookup therefore sees one version, never a mix; the switch's stall is
``embcache_serving_switch_seconds`` (writing the rows under the gate held lookups off 18 ms per
10,000 rows). Deleted keys become unknown keys.

:class:`ServedModel` holds the served version and, with ``--follow``, a thread that polls the
directory every ``--follow-interval-seconds``: it applies complete versions in order; a version
not yet complete (no manifest, or a file whose size or SHA-256 does not match it yet) is waited
for without complaint; a broken chain (a delta that does not follow the served version) or a
manifest this code cannot read is logged once and counted (``embcache_serving_errors_total``),
and the last good version is served on. When the next version is missing but a newer complete
*full* version exists (the trainer started a new chain), that one is applied. A store error while
the gate is held (deleting keys) leaves the version number where it was: the next poll applies
the same version again (writing rows and deleting keys is idempotent). One while its rows are
written after the switch is reported, the overlay keeps serving them, and each poll tries the
write again before it looks for a newer version.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import numpy as np
import torch

from ..cache import EmbeddingCache
from ..config import TableConfig
from ..engine.rows import record_bytes
from ..errors import EmbcacheError, ReadOnlyError
from ..export.format import (
    ExportFormatError,
    Version,
    list_versions,
    read_table,
    read_version,
    version_chain,
    version_dir,
)
from ..rpc.errors import ERROR_TYPE_KEY, NOT_APPLIED_KEY
from .auth import ROLES
from .handlers import SERVICE_NAME, method_handler
from .overlay import Overlay
from .rpcmetrics import RpcMetrics

__all__ = ["UNKNOWN_ROWS", "ReadOnlyGuard", "ServedModel", "VersionGate", "register_serving_metrics",
           "serving_tables"]

log = logging.getLogger("embcache.server.serving")

#: What a lookup of a key the served model lacks returns (``--unknown-rows``; TableConfig.unadmitted).
UNKNOWN_ROWS = ("zeros", "init")
_IMPORT_CHUNK = 1 << 20  # rows written to the store per import call while nothing reads (the first load)
# rows per import call beside the lookups: each call holds its table's lock (0.8 ms for 512 rows
# of dim 64, 3 ms for 2,048, 18 ms for 10,000), so a lookup waits for one chunk at most
_WRITE_CHUNK = 1024
_METHOD_PREFIX = f"/{SERVICE_NAME}/"


class VersionGate:
    """A reader-writer gate: lookups share it, a version switch holds it alone.

    A waiting switch stops new readers from entering, so a steady stream of lookups cannot starve
    it; the switch then waits only for the lookups already inside to finish.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._waiting = 0

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the gate shared (a lookup)."""
        with self._cond:
            while self._writing or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def switching(self) -> Iterator[None]:
        """Hold the gate alone (a version switch)."""
        with self._cond:
            self._waiting += 1
            try:
                while self._writing or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def serving_tables(directory: str, unknown_rows: str = "zeros") -> list[TableConfig]:
    """The tables to serve the newest complete version of ``directory`` with: each table's exported
    definition, weights only (optimizer ``sgd``: no state), admitting no key by lookups, and
    ``unadmitted`` = ``unknown_rows``.

    Raises:
        ExportFormatError: no complete version, or a broken chain to it.
        ConfigError: an exported table definition is invalid.
    """
    configs: dict[str, dict[str, Any]] = {}
    for v in version_chain(directory):
        for name, entry in v.tables.items():
            configs[name] = dict(entry["config"])
    return [_serving_config(c, unknown_rows) for _, c in sorted(configs.items())]


def _serving_config(config: dict[str, Any], unknown_rows: str) -> TableConfig:
    cfg = TableConfig.from_dict(config)
    return replace(cfg, optimizer="sgd", admit_after=0, unadmitted=unknown_rows, eps=None)


@dataclass
class _Staged:
    """One version, ready to switch to: per table, the rows to write and the keys to delete."""

    version: Version
    new_tables: list[TableConfig] = field(default_factory=list)
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # keys, records
    deleted: dict[str, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # each written table's storage dtype

    def overlay(self) -> Overlay:
        """The staged rows, found by key (views of the records, no copy)."""
        return Overlay({name: (keys, torch.from_numpy(records).view(self.dtypes[name]))
                        for name, (keys, records) in self.rows.items()})


class ServedModel:
    """The export a serving server serves: its version, the switch to the next, the follow thread.

    Args:
        directory: the export directory.
        cache: the server's cache (opened with :func:`serving_tables`, ``lookups_create_rows=False``).
        unknown_rows: the ``unadmitted`` row of tables a later version adds ("zeros" or "init").
        follow_interval: seconds between two polls of ``directory`` (:meth:`follow`).
    """

    def __init__(self, directory: str, cache: EmbeddingCache, unknown_rows: str = "zeros",
                 follow_interval: float = 1.0) -> None:
        self.directory = directory
        self.cache = cache
        self.unknown_rows = unknown_rows
        self.follow_interval = follow_interval
        self.gate = VersionGate()
        self.version = 0
        self.created_unix = 0.0
        self.applied = 0  # versions applied since start (the first load's included)
        self.errors = 0  # distinct problems met while following
        self.switch_seconds_total = 0.0
        self.last_switch_seconds = 0.0
        self._problem = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the version switched to whose rows are still being written, and their overlay
        self._pending: _Staged | None = None
        self._overlay: Overlay | None = None

    @property
    def pending_rows(self) -> int:
        """Rows of the served version not yet written into the cache (its overlay's)."""
        overlay = self._overlay
        return overlay.rows if overlay is not None else 0

    @contextmanager
    def reading(self) -> Iterator[Overlay | None]:
        """Hold the gate shared (a lookup); yields the rows to take over the cache's (None: none)."""
        with self.gate.reading():
            yield self._overlay

    # ------------------------------------------------------------------ loading and switching
    def load(self) -> int:
        """Apply the newest complete version (its full version, then its deltas); the version served.

        Before the server serves, nothing reads: each table is staged and written on its own, so
        memory holds one table file's rows at a time.

        Raises:
            ExportFormatError: no complete version, a broken chain, or a version that does not fit the tables.
            StoreError: the rows could not be written.
        """
        for v in version_chain(self.directory):
            for name in self._tables_of(v):
                self._write(self._stage(v, [name]))
            self.version, self.created_unix = v.version, v.created_unix
            self.applied += 1
        return self.version

    def apply(self, version: Version) -> bool:
        """Stage ``version`` (outside the gate: every table it changes, in memory), switch to it
        atomically, then write its rows into the cache beside the lookups; whether all were written.

        When a write fails after the switch, the version is served all the same (its rows from
        the overlay), the problem is reported, and :meth:`poll` writes them later.

        Raises:
            ExportFormatError: the version does not fit (a table's dim or dtype differs, duplicate
                keys, a missing array): nothing was applied.
            StoreError: deleting its deleted keys failed during the switch: it is not served.
            RuntimeError: the rows of the version served before are not written yet.
        """
        if self._pending is not None:
            raise RuntimeError(f"version {self.version}'s rows are still being written")
        t_stage = time.perf_counter()
        staged = self._stage(version, self._tables_of(version))
        overlay = staged.overlay()
        t0 = time.perf_counter()
        with self.gate.switching():
            self._begin(staged)
            self._pending, self._overlay = staged, overlay
            self.version, self.created_unix = version.version, version.created_unix
        took = time.perf_counter() - t0
        self.applied += 1
        self.switch_seconds_total += took
        self.last_switch_seconds = took
        t1 = time.perf_counter()
        written = self._finish()
        log.info("serving version %d (%s) of %s; staged in %.1f ms, switched in %.1f ms, %d rows written in %.1f ms",
                 version.version, version.kind, self.directory, 1e3 * (t0 - t_stage), 1e3 * took, overlay.rows,
                 1e3 * (time.perf_counter() - t1))
        return written

    def _finish(self) -> bool:
        """Write the pending version's rows into the cache in chunks, then drop its overlay;
        whether it is done (a failure is reported, and the overlay kept)."""
        staged = self._pending
        if staged is None:
            return True
        try:
            self._write_rows(staged, _WRITE_CHUNK)
        except (EmbcacheError, OSError) as exc:
            self._report(f"version {staged.version.version} is served, but writing its rows into the store "
                         f"failed ({type(exc).__name__}: {exc}); lookups take them from memory until a poll "
                         "writes them")
            return False
        self._pending = self._overlay = None
        return True

    def _tables_of(self, v: Version) -> list[str]:
        """The tables ``v`` changes: its own, and for a full version also those it lacks (emptied)."""
        names = sorted(v.tables)
        if v.kind == "full":
            names += sorted(n for n in self.cache.tables() if n not in v.tables)
        return names

    def _write(self, staged: _Staged) -> None:
        """Carry out a staged version while nothing reads: tables created, keys deleted, rows written."""
        self._begin(staged)
        self._write_rows(staged, _IMPORT_CHUNK)

    def _write_rows(self, staged: _Staged, chunk: int) -> None:
        """Write the staged rows into the store, ``chunk`` rows a call (memory copies refreshed in place)."""
        for name, (keys, records) in staged.rows.items():
            for start in range(0, keys.shape[0], chunk):
                self.cache.import_rows(name, keys[start:start + chunk], records[start:start + chunk], refresh=True)

    def _begin(self, staged: _Staged) -> None:
        """The part of a staged version that comes before its rows: the tables it adds created, the
        keys it deletes deleted (never among its rows: ``_stage`` keeps them apart)."""
        for cfg in staged.new_tables:
            self.cache.create_table(cfg)
        for name, keys in staged.deleted.items():
            if keys.size:
                self.cache.delete_rows(name, keys)

    def _stage(self, v: Version, names: list[str]) -> _Staged:
        """What writing tables ``names`` of ``v`` takes, read and checked (nothing changes yet)."""
        staged = _Staged(v)
        known = self.cache.tables()
        for name in names:
            entry = v.tables.get(name)
            if entry is None:  # a full version without this table: it is emptied
                staged.deleted[name] = self._stored_keys(name, np.empty(0, dtype=np.int64))
                continue
            cfg = known.get(name)
            if cfg is None:
                cfg = _serving_config(dict(entry["config"]), self.unknown_rows)
                staged.new_tables.append(cfg)
            if int(entry["dim"]) != cfg.dim or str(entry["dtype"]) != cfg.dtype:
                raise ExportFormatError(f"version {v.version}: table {name!r} is dim {entry['dim']} "
                                        f"{entry['dtype']}; served as dim {cfg.dim} {cfg.dtype}")
            part = read_table(v, name)
            keys = np.ascontiguousarray(part["keys"], dtype=np.int64)
            weights = np.ascontiguousarray(part["weights"])
            width = record_bytes(cfg.dim, cfg.torch_dtype, 0)
            if weights.shape != (keys.shape[0], cfg.dim) or weights.dtype.itemsize * cfg.dim != width:
                raise ExportFormatError(f"version {v.version}: table {name!r} has weights of shape "
                                        f"{weights.shape} ({weights.dtype}) for {keys.shape[0]} keys of dim {cfg.dim}")
            if np.unique(keys).shape[0] != keys.shape[0]:
                raise ExportFormatError(f"version {v.version}: table {name!r} lists a key twice")
            staged.rows[name] = (keys, weights.view(np.uint8).reshape(keys.shape[0], width))
            staged.dtypes[name] = cfg.torch_dtype
            gone = np.unique(np.asarray(part["deleted"], dtype=np.int64))
            if v.kind == "full" and name in known:  # a full version replaces the table: drop what it lacks
                gone = np.union1d(gone, self._stored_keys(name, keys))
            staged.deleted[name] = np.setdiff1d(gone, keys)
        return staged

    def _stored_keys(self, table: str, keep: np.ndarray) -> np.ndarray:
        """The keys stored for ``table`` that ``keep`` lacks (only this object writes the store)."""
        parts = [k for k, _, _ in self.cache.export_rows(table, lambda keys: ~np.isin(keys, keep))]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    # ------------------------------------------------------------------ following
    def poll(self) -> int:
        """Finish writing the rows of the version served (if a write had failed), then apply every
        version complete after it, in order; how many were applied."""
        applied = 0
        if self._pending is not None:
            if not self._finish():
                return applied
            self._problem = ""
        while not self._stop.is_set():
            nxt = self._next()
            if nxt is None:
                break
            try:
                written = self.apply(nxt)
            except (EmbcacheError, OSError, ValueError) as exc:
                self._report(f"version {nxt.version} cannot be applied: {exc}")
                break
            applied += 1
            if not written:
                break
            self._problem = ""
        return applied

    def _next(self) -> Version | None:
        """The next version to apply, or None (none complete yet, or a problem, reported)."""
        n = self.version + 1
        path = version_dir(self.directory, n)
        try:
            v = read_version(path)
            if v is None and not os.path.exists(path):
                full = self._newer_full(n)
                later = [x for x in list_versions(self.directory) if x > n]
                if full is None and later:
                    self._report(f"version {n} is missing but version {later[0]} exists; waiting for version {n} "
                                 "or a new full version")
                return full
        except ExportFormatError as exc:
            self._report(str(exc))
            return self._newer_full(n + 1)
        if v is None:
            return None  # being written (or copied): wait for it, silently
        if v.kind == "delta" and v.base_version != self.version:
            self._report(f"version {n} is a delta of version {v.base_version}, but version {self.version} "
                         "is served; waiting for a full version")
            return self._newer_full(n + 1)
        return v

    def _newer_full(self, after: int) -> Version | None:
        """The newest complete full version from ``after`` on (a new chain), if any."""
        for n in reversed([x for x in list_versions(self.directory) if x >= after]):
            path = version_dir(self.directory, n)
            try:  # the manifest first: only a full version's files are worth checksumming
                head = read_version(path, verify=False)
                v = read_version(path) if head is not None and head.kind == "full" else None
            except ExportFormatError:
                continue
            if v is not None:
                return v
        return None

    def _report(self, problem: str) -> None:
        """Log and count a problem once (it is met again at every poll until it goes away)."""
        if problem != self._problem:
            self._problem = problem
            self.errors += 1
            log.error("serving %s: %s; still serving version %d", self.directory, problem, self.version)

    def follow(self) -> None:
        """Start the thread that polls the directory (idempotent)."""
        if self._thread is not None:
            return

        def run() -> None:
            while not self._stop.wait(self.follow_interval):
                try:
                    self.poll()
                except Exception as exc:  # a bug: say so, keep serving and polling
                    log.exception("serving: polling %s failed", self.directory, exc_info=exc)

        self._thread = threading.Thread(target=run, name="embcache-serving-follow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop following (waits for a switch in progress). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ reporting
    def report(self) -> dict[str, Any]:
        """What is served, as Stats reports it under each table's ``"serving"``."""
        return {"version": self.version, "directory": self.directory, "applied_versions": self.applied,
                "errors": self.errors, "age_seconds": max(time.time() - self.created_unix, 0.0),
                "switch_seconds": self.switch_seconds_total, "last_switch_seconds": self.last_switch_seconds,
                "pending_rows": self.pending_rows}

    def refusal(self, method: str) -> str:
        """The message a refused write carries."""
        return (f"{method} refused: this server serves version {self.version} of {self.directory} read-only "
                "(embcache-server --serve); its rows change only with the export's next version")



def register_serving_metrics(registry: Any, model: ServedModel | None) -> None:
    """Export ``embcache_serving_*`` (version, its age, versions applied, errors, switch time) of
    ``model``; a server not in serving mode (None) reports version 0 and nothing applied."""
    registry.register(_ServingCollector(model))


class _ServingCollector:
    """Prometheus collector of a :class:`ServedModel` (or of none), read at each scrape."""

    def __init__(self, model: ServedModel | None) -> None:
        self._model = model

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self._model
        yield GaugeMetricFamily("embcache_serving_version", "Version of the export this server serves "
                                "(0: not in serving mode)", value=m.version if m else 0)
        yield GaugeMetricFamily("embcache_serving_version_age_seconds",
                                "Seconds since the served version was created (written by the exporter)",
                                value=max(time.time() - m.created_unix, 0.0) if m else 0.0)
        yield CounterMetricFamily("embcache_serving_versions_applied", "Versions applied since the server started "
                                  "(its first load included)", value=m.applied if m else 0)
        yield CounterMetricFamily("embcache_serving_errors", "Problems met following the export (a broken chain, "
                                  "an unreadable manifest, a version that does not fit), each counted once",
                                  value=m.errors if m else 0)
        yield CounterMetricFamily("embcache_serving_switch_seconds", "Seconds lookups were held off while versions "
                                  "were switched (the gate held alone)", value=m.switch_seconds_total if m else 0.0)
        yield GaugeMetricFamily("embcache_serving_pending_rows", "Rows of the served version not yet written into "
                                "the cache (lookups take them from memory meanwhile)", value=m.pending_rows if m else 0)


class ReadOnlyGuard(grpc.ServerInterceptor):
    """Refuses every write call (role "write" in :data:`~embcache.server.auth.ROLES`) of a serving server:
    FAILED_PRECONDITION, :class:`~embcache.errors.ReadOnlyError`, marked not applied."""

    def __init__(self, model: ServedModel, metrics: RpcMetrics) -> None:
        self._model, self._metrics = model, metrics

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        """The call's handler for a read, one that refuses the call for a write."""
        t0 = time.perf_counter()
        handler = continuation(details)
        method = details.method
        if handler is None or not method.startswith(_METHOD_PREFIX):
            return handler
        name = method[len(_METHOD_PREFIX):]
        if ROLES.get(name) != "write":
            return handler

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            self._metrics.started(name)
            self._metrics.handled(name, grpc.StatusCode.FAILED_PRECONDITION.name, time.perf_counter() - t0)
            context.set_trailing_metadata(((ERROR_TYPE_KEY, ReadOnlyError.__name__), (NOT_APPLIED_KEY, "1")))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self._model.refusal(name))

        return method_handler(handler.request_streaming, handler.response_streaming, refuse,
                              request_deserializer=handler.request_deserializer,
                              response_serializer=handler.response_serializer)
