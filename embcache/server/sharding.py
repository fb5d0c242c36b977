"""A server's place in its fleet: the versioned shard map, the routing check, and row migration.

A fleet that was never resharded has no map (version 0): every server serves every key it is
sent. The first reshard installs the client's shard list as version 1 on every server, with the
target list as a *pending* version 2, and from then on each server:

- refuses a keyed request routed by another map version, or carrying a key it does not own
  (``WrongShardError``, FAILED_PRECONDITION, not applied, with its map in the trailing metadata:
  the client adopts it and routes again) -- so no two shards ever serve one key under two maps;
- while a migration is pending, exports the rows that leave it, whole (weights, optimizer state,
  frequency), for the coordinator to import on their new owners: first while writes to them go
  on (each written key is recorded), then, once *frozen*, only the rows written meanwhile, while
  writes to leaving rows are refused (``MigratingError``, UNAVAILABLE, not applied: the client
  resends them) -- the pause a training step sees is that last, small copy and the commit;
- on commit, adopts the pending map and deletes the rows that left it.

The map, the pending map and the server's name persist in ``<path>/shard-map.json`` (written
atomically before a change is acknowledged), so a migration survives a crash of either side and
is resumed by running the same reshard again: exporting and importing are idempotent until the
commit (the rows that move are frozen on their source), and a commit is idempotent after it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..cache import EmbeddingCache
from ..errors import ConfigError, MigratingError, PassStateError, WrongShardError
from ..ring import ShardMap
from ..stores.base import write_durably

__all__ = ["MAP_FILE", "ShardGate"]

log = logging.getLogger("embcache.server")

#: The persisted state's file name, in the cache's ``path``.
MAP_FILE = "shard-map.json"


def _map(text: str) -> ShardMap | None:
    if not text:
        return None
    try:
        return ShardMap.from_json(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class ShardGate:
    """The shard map a server holds, the check of every keyed request against it, and migration.

    Args:
        directory: the cache's path, where ``shard-map.json`` lives.
        cache: the server's cache (rows are exported from and imported into it).

    Raises:
        ConfigError: the persisted file is unreadable (the server refuses to start rather than
            serve keys it may no longer own).
    """

    def __init__(self, directory: str, cache: EmbeddingCache) -> None:
        self._path = os.path.join(directory, MAP_FILE)
        self._cache = cache
        self._cond = threading.Condition()
        self._writers = 0  # write requests between their check and their end
        self._changing = False  # a map change waits for the writers and holds new ones back
        self.current: ShardMap | None = None
        self.pending: ShardMap | None = None
        self.name = ""
        self.frozen = False
        # leaving keys written since this process began the pending migration, per table (None: not
        # recorded since its beginning, e.g. after a restart: a written-only export sends them all)
        self._written: dict[str, list[np.ndarray]] | None = None
        self.rows = {"exported": 0, "imported": 0, "deleted": 0}
        try:
            with open(self._path, "rb") as f:
                data = json.loads(f.read())
            self.name = str(data.get("name", ""))
            self.current, self.pending = _map(data.get("current", "")), _map(data.get("pending", ""))
            self.frozen = bool(data.get("frozen", False)) and self.pending is not None
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"cannot read {self._path}: {exc}; it says which keys this shard owns: restore it "
                              "(or delete it only if the fleet was never resharded)") from None
        if self.pending is not None:
            log.warning("a migration to shard map version %d is pending: run the same reshard again to finish it",
                        self.pending.version)

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[str, str, str, bool]:
        """``(current, pending, name, frozen)``: the maps as JSON ("" for none), this server's name, frozen."""
        with self._cond:
            return (self.current.to_json() if self.current else "", self.pending.to_json() if self.pending else "",
                    self.name, self.frozen)

    def _save(self) -> None:
        body = json.dumps({"name": self.name, "current": self.current.to_json() if self.current else "",
                           "pending": self.pending.to_json() if self.pending else "", "frozen": self.frozen}).encode()
        write_durably(self._path, body)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._changing:
                self._cond.wait()
            self._changing = True
            while self._writers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._changing = False
                self._cond.notify_all()

    # ------------------------------------------------------------------ the routing check
    def _refuse(self, why: str) -> WrongShardError:
        exc = WrongShardError(why)
        exc.shard_map = self.current.to_json() if self.current else ""  # type: ignore[attr-defined]
        return exc

    def _check(self, version: int, keys: Mapping[str, np.ndarray]) -> None:
        """Raise WrongShardError when the request was routed by another map, or sent a key this shard does not own."""
        current = self.current
        if current is None:
            if version:
                raise self._refuse(f"the request was routed by shard map version {version}, but this server holds "
                                   f"no shard map (was its {MAP_FILE} lost?)")
            return
        if version != current.version:
            raise self._refuse(f"the request was routed by shard map version {version}; this shard serves version "
                               f"{current.version} (the map is in the trailing metadata); nothing was applied")
        for table, k in keys.items():
            owned = current.owned_by(k, self.name)
            if not owned.all():
                raise self._refuse(f"{int((~owned).sum())} key(s) of table {table!r} (e.g. {int(k[~owned][0])}) "
                                   f"belong to another shard under map version {current.version}; nothing was "
                                   f"applied")

    def check_read(self, version: int, keys: Mapping[str, np.ndarray]) -> None:
        """Check a read (or keyset) request's routing.

        Raises:
            WrongShardError: routed by another map version, or a key this shard does not own.
        """
        self._check(version, keys)

    @contextmanager
    def writing(self, version: int, keys: Mapping[str, np.ndarray]) -> Iterator[None]:
        """Check a write request's routing and hold map changes back while it is applied.

        Raises:
            WrongShardError: as :meth:`check_read`.
            MigratingError: a key is being moved to another shard (resend it after the commit).
        """
        if self.current is None and self.pending is None and not version:
            yield  # never resharded: nothing to check, nothing to hold back
            return
        with self._cond:
            while self._changing:
                self._cond.wait()
            self._check(version, keys)
            pending = self.pending
            if pending is not None:
                leaving = {table: k[~pending.owned_by(k, self.name)] for table, k in keys.items()}
                moving = {table: k for table, k in leaving.items() if k.size}
                if moving and self.frozen:
                    table, k = next(iter(moving.items()))
                    raise MigratingError(
                        f"{k.size} key(s) of table {table!r} are moving to another shard (shard map version "
                        f"{pending.version} pending); nothing was applied: resend after the migration")
                if moving and self._written is not None:
                    for table, k in moving.items():
                        self._remember(table, k)
            self._writers += 1
        try:
            yield
        finally:
            with self._cond:
                self._writers -= 1
                self._cond.notify_all()

    def _remember(self, table: str, keys: np.ndarray) -> None:
        """Record leaving keys written while the migration copies (lock held); deduplicated as it grows."""
        assert self._written is not None
        parts = self._written.setdefault(table, [])
        parts.append(np.array(keys, dtype=np.int64))
        if len(parts) > 256:
            self._written[table] = [np.unique(np.concatenate(parts))]

    # ------------------------------------------------------------------ migration
    def set_map(self, name: str, current_json: str, pending_json: str, freeze: bool = False) -> None:
        """Install the fleet's current map (if this server has none) and begin a migration to ``pending``.

        Idempotent: setting what is already set (a resumed reshard) changes nothing. ``freeze``
        (with the same pending map) starts refusing writes to the leaving rows, for the last copy.

        Raises:
            ConfigError: malformed maps, versions that do not follow, a different map in force,
                another migration pending, or this server not in either map.
        """
        current, pending = _map(current_json), _map(pending_json)
        if current is None:
            raise ConfigError("SetShardMap needs the current map")
        if pending is not None and pending.version != current.version + 1:
            raise ConfigError(f"the pending map must be version {current.version + 1}, got {pending.version}")
        if not name or (name not in current.shards and (pending is None or name not in pending.shards)):
            raise ConfigError(f"this server's name {name!r} is in neither map")
        with self._exclusive():
            if self.current is not None and pending is not None and self.current.version == pending.version:
                if self.current != pending:
                    raise ConfigError(f"this server already serves another map version {pending.version}")
                return  # committed here already: a resumed reshard
            if self.current is not None and self.current != current:
                raise ConfigError(f"this server serves shard map version {self.current.version}, not the given "
                                  f"version {current.version}")
            if self.pending is not None and pending is not None and self.pending != pending:
                raise ConfigError(f"a migration to another map version {self.pending.version} is pending here: "
                                  "finish it (run that reshard again) first")
            if self.name and self.name != name:
                raise ConfigError(f"this server is {self.name!r} in the fleet's maps, not {name!r}")
            pending = pending if pending is not None else self.pending
            frozen = pending is not None and (freeze or self.frozen)
            if (self.name, self.current, self.pending, self.frozen) == (name, current, pending, frozen):
                return  # already so (another client installed the same map, or a resumed reshard)
            if pending is not None and self.pending is None:
                self._written = {}  # from now on, every write to a leaving row is recorded
            self.name, self.current, self.pending, self.frozen = name, current, pending, frozen
            self._save()
        log.info("shard map: serving version %d as %r%s", current.version, name,
                 f", migrating to version {pending.version}" if pending is not None else "")

    def _pending(self, version: int) -> ShardMap:
        pending = self.pending
        if pending is None or pending.version != version:
            raise PassStateError(f"no migration to shard map version {version} is pending here "
                                 f"(pending: {pending.version if pending else 'none'})")
        return pending

    def export(self, table: str, version: int, batch_rows: int,
               written_only: bool = False) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
        """Rows of ``table`` this shard owns now but not under the pending map: ``(owner, keys, records, freq)``.

        Args:
            written_only: only those written since the migration began (needs the migration
                frozen, so that the record is final); all of them when this process has not
                recorded the writes since the beginning (it restarted meanwhile).

        Raises:
            PassStateError: no migration to ``version`` is pending, or ``written_only`` while not frozen.
            UnknownTableError, StoreError.
        """
        pending = self._pending(version)
        only: np.ndarray | None = None
        if written_only:
            with self._cond:
                if not self.frozen:
                    raise PassStateError("ExportRows of the written rows needs the migration frozen first")
                if self._written is not None:
                    parts = self._written.get(table, [])
                    only = np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
        current, me = self.current, self.name
        assert current is not None

        def leaving(keys: np.ndarray) -> np.ndarray:
            return current.owned_by(keys, me) & ~pending.owned_by(keys, me)

        names = pending.names
        for keys, records, freq in self._cache.export_rows(table, leaving, batch_rows or 65536, keys=only):
            owners = pending.ring.owners(keys)
            for owner in np.unique(owners):
                pick = owners == owner
                self.rows["exported"] += int(pick.sum())
                yield names[int(owner)], keys[pick], records[pick], freq[pick]

    def import_rows(self, table: str, version: int, keys: np.ndarray, records: np.ndarray,
                    freq: np.ndarray) -> int:
        """Take rows that move here under the pending map (replacing any stale copy); how many.

        Raises:
            PassStateError: no migration to ``version`` is pending. WrongShardError: a key this
            shard will not own, or owns already. InvalidRowsError, StoreError.
        """
        pending = self._pending(version)
        arriving = pending.owned_by(keys, self.name)
        if self.current is not None:
            arriving &= ~self.current.owned_by(keys, self.name)
        if not arriving.all():
            raise WrongShardError(f"ImportRows: {int((~arriving).sum())} key(s) do not move to this shard "
                                  f"({self.name!r}) under map version {version}; nothing was imported")
        self._cache.import_rows(table, keys, records, freq)
        self.rows["imported"] += keys.shape[0]
        return int(keys.shape[0])

    def commit(self, version: int) -> int:
        """Adopt the pending map ``version`` and delete the rows that left this shard; rows deleted.

        Idempotent: committing the map already in force deletes what is left of the moved rows.

        Raises:
            PassStateError: neither pending nor in force.
        """
        with self._exclusive():
            before = self.current
            if self.current is not None and self.current.version == version and self.pending is None:
                before = None  # committed already: delete what a crash may have left
            else:
                self.current, self.pending = self._pending(version), None
                self.frozen, self._written = False, None
                self._save()
        current, me = self.current, self.name
        assert current is not None
        deleted = 0
        if before is not None and not before.loses(me, current):
            log.info("shard map: committed version %d as %r (nothing left this shard)", version, me)
            return 0
        for table in self._cache.tables():
            gone = [k for k, _, _ in self._cache.export_rows(table, lambda keys: ~current.owned_by(keys, me))]
            for keys in gone:
                self._cache.delete_rows(table, keys)
                deleted += int(keys.shape[0])
        self.rows["deleted"] += deleted
        log.info("shard map: committed version %d as %r (%d rows that left deleted)", version, me, deleted)
        return deleted

    def register_metrics(self, registry: Any) -> None:
        """Export ``embcache_shard_map_version``, ``embcache_migration_pending`` and
        ``embcache_migration_rows_total{direction}`` to a Prometheus registry."""
        registry.register(_MigrationCollector(self))


class _MigrationCollector:
    """Prometheus collector of a :class:`ShardGate`'s state, read at each scrape."""

    def __init__(self, gate: ShardGate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gate = self._gate
        yield GaugeMetricFamily("embcache_shard_map_version", "Version of the fleet's shard map this shard serves "
                                "(0: never resharded)", value=gate.current.version if gate.current else 0)
        yield GaugeMetricFamily("embcache_migration_pending", "1 while a migration to a new shard map is pending here",
                                value=1 if gate.pending is not None else 0)
        rows = CounterMetricFamily("embcache_migration_rows", "Rows moved by resharding: exported from, imported "
                                   "into and deleted from this shard", labels=["direction"])
        for direction, n in gate.rows.items():
            rows.add_metric([direction], n)
        yield rows
