"""Add or remove parameter-server shards while training runs, moving every row whose owner changes.

    embcache reshard --servers 10.0.0.1:50051,10.0.0.2:50051 --add 10.0.0.3:50051
    embcache reshard --servers 10.0.0.1:50051,10.0.0.2:50051,10.0.0.3:50051 --remove 10.0.0.3:50051

or from Python, ``Client.reshard(new_servers)`` (and ``Client.refresh_shards()`` for a
``dns:///`` fleet). The coordinator (this module) drives the servers through one migration to
the next version of the fleet's shard map (:mod:`embcache.ring`, :mod:`embcache.server.sharding`):

1. **Begin.** Every server of the old and the new list gets the map in force (on a fleet never
   resharded, the old list becomes version 1) and the new map as *pending*. Everything is still
   served; a source records which of its leaving rows are written from now on.
2. **Copy.** Each source exports the rows it will lose, whole (weights, optimizer state,
   frequency), straight from its store after writing back its dirty rows; the coordinator imports
   each batch on the row's new owner, which replaces any stale copy. Training goes on.
3. **Freeze and copy what changed.** The sources start refusing writes to their leaving rows
   (``MigratingError``: clients resend them) and export only the leaving rows written during the
   copy; the new owners import them and flush. This is the only pause, and only for writes that
   touch moving rows. A source flushes as it freezes, and the record of what its process made
   durable (:mod:`embcache.server.ledger`) goes to the shards that stay, so that a client's
   ``flush()`` can still settle the writes a removed shard acknowledged.
4. **Commit.** Every server adopts the new map and deletes the rows that left it. A client still
   routing by the old map is refused with the new one (``WrongShardError``, nothing applied),
   adopts it and sends the keys to their new owners: no key is ever served by two shards.

A crash of any party (a source, a target, the coordinator) leaves the pending map persisted on
the servers; running the same reshard again resumes: until the first commit the sources are
frozen at once and the whole copy is redone (idempotent: the moving rows no longer change), after
it the remaining commits are sent. A reshard to another list is refused while one is pending.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import numpy as np
from google.protobuf.message import Message

from .errors import ConfigError
from .ring import ShardMap
from .rpc.errors import error_from_rpc
from .rpc.v1 import embcache_pb2 as pb

if TYPE_CHECKING:
    from .client import Client
    from .client.transport import Shard, Topology
    from .config import TableConfig

__all__ = ["FleetLink", "ReshardReport", "add_arguments", "migrate", "reshard", "run"]


class FleetLink(Protocol):
    """What the coordinator needs of a client's connection to the fleet (its
    :class:`~embcache.client.transport.Transport` is one)."""

    @property
    def topology(self) -> Topology:
        """The shards the client routes to, and the map it routes by."""
        ...

    @property
    def long_timeout(self) -> float:
        """The deadline of the whole migration, seconds."""
        ...

    def reach(self, named: Mapping[str, str]) -> dict[str, Shard]:
        """The shards of the current map and of ``named`` by name (new ones connected, closed with the client)."""
        ...

    def direct(self, shard: Shard, method: str, request: Message, deadline: float) -> Any:
        """One call routed by no shard map (the token only); a unary call's error raised as an embcache error."""
        ...

    def adopt(self, shard_map: str | ShardMap) -> bool:
        """Route by ``shard_map`` from now on if it is newer; True if adopted."""
        ...

    def refresh_tables(self, timeout: float | None = None) -> dict[str, TableConfig]:
        """Fetch the tables (and limits) from the shards of the current map."""
        ...


@dataclass
class ReshardReport:
    """What a reshard did.

    Attributes:
        version: the shard map version in force after it.
        shards: the shards of that map (name -> address).
        moved_rows: rows copied to their new owners, per table.
        deleted_rows: rows deleted from the shards they left.
        seconds: wall time of the copy (begin to the last import of the first copy).
        pause_seconds: wall time from the freeze to the last server's commit: writes to moving rows
            waited at most this long (a server switches maps as its commit begins, then deletes).
        delta_rows: rows copied again because they were written during the first copy.
        total_seconds: wall time of the whole reshard.
        resumed: an interrupted reshard was finished.
    """

    version: int
    shards: dict[str, str]
    moved_rows: dict[str, int] = field(default_factory=dict)
    deleted_rows: int = 0
    seconds: float = 0.0
    pause_seconds: float = 0.0
    delta_rows: int = 0
    total_seconds: float = 0.0
    resumed: bool = False

    @property
    def rows_per_second(self) -> float:
        """Rows migrated per second of copy."""
        total = sum(self.moved_rows.values())
        return total / self.seconds if self.seconds > 0 else 0.0


def _named(servers: Mapping[str, str] | Sequence[str]) -> dict[str, str]:
    named = dict(servers) if isinstance(servers, Mapping) else {a: a for a in servers}
    if not named:
        raise ConfigError("a reshard needs at least one shard in the new list")
    return named


def reshard(client: Client, servers: Mapping[str, str] | Sequence[str], progress: bool = True,
            batch_rows: int = 65536) -> ReshardReport:
    """Move the fleet ``client`` talks to onto ``servers``: :meth:`Client.reshard <embcache.Client.reshard>`.

    ``client`` (a client of the fleet) lends its credentials, and routes by the new map after.
    The other arguments, the result and the errors are :func:`migrate`'s.
    """
    return client.reshard(servers, progress=progress, batch_rows=batch_rows)


def migrate(link: FleetLink, servers: Mapping[str, str] | Sequence[str], progress: bool = True,
            batch_rows: int = 65536) -> ReshardReport:
    """Move the fleet ``link`` reaches onto ``servers``, migrating every row whose owner changes.

    Args:
        link: the coordinator's way to the fleet (a client's transport).
        servers: the new shard list: ``["host:port", ...]`` or ``{name: "host:port"}``; shards
            that stay must keep their names.
        progress: show a progress bar of the rows copied (stderr).
        batch_rows: store rows a source scans per exported message.

    Returns:
        A :class:`ReshardReport`.

    Raises:
        ConfigError: another reshard is pending (run it again with its list to finish it), or a
            server is in another state than the fleet (its map file lost, say).
        UnavailableError, DeadlineExceededError, StoreError: a shard failed; run the same reshard
            again once it is back (the migration resumes).
    """
    t_start = time.monotonic()
    named = _named(servers)
    topo = link.topology
    shards = link.reach(named)  # a shard that stays is reached where this client reaches it
    deadline = time.monotonic() + link.long_timeout

    def call(shard: Shard, method: str, request: Message) -> Any:
        return link.direct(shard, method, request, deadline)

    states = {name: call(s, "GetShardMap", pb.GetShardMapRequest()) for name, s in shards.items()}
    currents = [ShardMap.from_json(st.current) for st in states.values() if st.current]
    pendings = [ShardMap.from_json(st.pending) for st in states.values() if st.pending]
    resumed = bool(pendings)
    if pendings:
        target = pendings[0]
        if any(p != target for p in pendings) or set(target.shards) != set(named):
            raise ConfigError(f"a reshard to {sorted(target.shards.values())} (shard map version {target.version}) "
                              f"is pending: run it again with that list to finish it first")
        olds = [c for c in currents if c.version == target.version - 1]
        if not olds:
            raise ConfigError(f"no server holds the map version {target.version - 1} that the pending reshard "
                              f"started from")
        current = olds[0]
    else:
        current = max(currents, key=lambda m: m.version) if currents else ShardMap(
            max(topo.map.version, 1), dict(topo.map.shards), topo.map.vnodes)
        if set(current.shards) == set(named):
            link.adopt(current)
            return ReshardReport(current.version, named, total_seconds=time.monotonic() - t_start)
        target = ShardMap(current.version + 1, named, current.vnodes)
        missing = [n for n in current.shards if n not in shards]
        if missing:
            raise ConfigError(f"the fleet's shard map version {current.version} has shards {missing} this client "
                              "does not know; make the client from that map's list")
    committed = any(c.version == target.version for c in currents)
    everyone = {n: shards[n] for n in dict.fromkeys([*current.shards, *target.shards])}
    # 1. begin: every server holds the map in force and the pending one (a resumed one frozen at once)
    leaving = [n for n in current.shards if n not in target.shards]
    ledgers: dict[str, str] = {}  # a frozen shard's write ledger, to be answered for by those that stay

    def begin(names: Sequence[str], freeze: bool) -> None:
        for name in names:
            state = call(everyone[name], "SetShardMap", pb.SetShardMapRequest(
                name=name, current=current.to_json(), pending=target.to_json(), freeze=freeze))
            if freeze and name in leaving:
                ledgers[name] = state.ledger
    begin(list(everyone), freeze=resumed)
    report = ReshardReport(target.version, named, resumed=resumed)
    t_copy = time.monotonic()
    if not committed:
        # the new shards get every table first
        tables: dict[str, pb.TableConfig] = {}
        for name in current.shards:
            for t in call(everyone[name], "ListTables", pb.ListTablesRequest()).tables:
                tables.setdefault(t.name, t)
        for name in target.shards:
            have = {t.name for t in call(everyone[name], "ListTables", pb.ListTablesRequest()).tables}
            for t_name, t in tables.items():
                if t_name not in have:
                    call(everyone[name], "CreateTable", pb.CreateTableRequest(table=t))
        # 2. copy, while training goes on (a resumed reshard is frozen already: this copy is the last)
        def copy_all(written_only: bool) -> int:
            bar = _progress(progress, target.version, "changed rows" if written_only else "rows")
            total = 0
            try:
                for source in current.shards:
                    for table in sorted(tables):
                        moved = _copy(link, everyone, source, table, target.version, batch_rows, deadline, bar,
                                      written_only)
                        report.moved_rows[table] = report.moved_rows.get(table, 0) + (0 if written_only else moved)
                        total += moved
            finally:
                if bar is not None:
                    bar.close()
            return total
        copy_all(written_only=False)
        report.seconds = time.monotonic() - t_copy
        t_freeze = time.monotonic()
        if not resumed:
            # 3. freeze the leaving rows and copy again the ones written meanwhile
            begin(list(current.shards), freeze=True)
            report.delta_rows = copy_all(written_only=True)
        for name in target.shards:
            call(everyone[name], "Flush", pb.FlushRequest())
    else:
        t_freeze = time.monotonic()
    # 4. commit, on every server at once: each switches maps first and then deletes the rows that left it
    # (a client that meets a shard not yet switched is refused with the older map and tries again); the
    # shards that stay get the ledgers of those that leave, merged (not imported above: the server
    # package imports the whole of embcache, which imports this module)
    from .server.ledger import merge_records

    with ThreadPoolExecutor(max_workers=len(everyone)) as pool:
        handed = merge_records(ledgers.values())
        replies = list(pool.map(lambda name: call(everyone[name], "CommitShardMap", pb.CommitShardMapRequest(
            version=target.version, ledger=handed if name in target.shards else "")), list(everyone)))
    report.deleted_rows = sum(int(r.deleted_rows) for r in replies)
    report.pause_seconds = time.monotonic() - t_freeze
    link.adopt(target)
    link.refresh_tables()
    report.total_seconds = time.monotonic() - t_start
    return report


class _Bar(Protocol):
    """A progress bar (tqdm's shape)."""

    def update(self, n: int) -> object:
        ...

    def close(self) -> object:
        ...


def _progress(show: bool, version: int, what: str) -> _Bar | None:
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(desc=f"reshard to map v{version}: {what}", unit=" rows", unit_scale=True, leave=False)


def _copy(link: FleetLink, shards: Mapping[str, Shard], source: str, table: str, version: int, batch_rows: int,
          deadline: float, bar: _Bar | None, written_only: bool = False) -> int:
    """Stream one source's leaving rows of ``table`` (``written_only``: those written since the begin) to
    their new owners; rows copied."""
    src = shards[source]
    stream = link.direct(src, "ExportRows", pb.ExportRowsRequest(
        table=table, pending_version=version, batch_rows=batch_rows, written_only=written_only), deadline)
    moved = 0
    try:
        for msg in stream:
            n = int(np.prod(list(msg.keys.shape))) if msg.keys.shape else 0
            dst = shards[msg.to]
            link.direct(dst, "ImportRows", pb.ImportRowsRequest(table=table, pending_version=version, keys=msg.keys,
                                                                records=msg.records, freq=msg.freq), deadline)
            moved += n
            if bar is not None:
                bar.update(n)
    except grpc.RpcError as err:
        raise error_from_rpc(err, src.address) from None
    return moved


# ---------------------------------------------------------------------- the command
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``embcache reshard`` flags."""
    p.add_argument("--servers", required=True,
                   help="the fleet's shards now: comma-separated host:port (or name=host:port)")
    p.add_argument("--add", action="append", default=[], metavar="HOST:PORT", help="a shard to add (repeatable)")
    p.add_argument("--remove", action="append", default=[], metavar="HOST:PORT",
                   help="a shard to remove (repeatable; its rows move to the others)")
    p.add_argument("--token", help="bearer token (read-write)")
    p.add_argument("--tls-ca", help="CA (PEM file) of the servers' certificates (enables TLS)")
    p.add_argument("--tls-cert", help="client certificate (PEM file), for mutual TLS")
    p.add_argument("--tls-key", help="client key (PEM file), for mutual TLS")
    p.add_argument("--tls-server-name", help="name to check the servers' certificates against")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parse_list(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, address = item.partition("=")
        out[name if sep else item] = address if sep else item
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``embcache reshard``; prints the report. Returns 0, or 1 when the reshard failed."""
    from .client import Client
    from .errors import EmbcacheError

    now = _parse_list(args.servers)
    new = dict(now)
    for spec in args.add:
        new.update(_parse_list(spec))
    for spec in args.remove:
        for name, address in _parse_list(spec).items():
            gone = [n for n, a in new.items() if n == name or a == address]
            if not gone:
                print(f"embcache reshard: {spec} is not one of the shards {sorted(new.values())}")
                return 1
            for n in gone:
                del new[n]
    try:
        with Client(now, token=args.token, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                    tls_server_name=args.tls_server_name) as client:
            report = reshard(client, new, progress=not args.no_progress)
    except EmbcacheError as exc:
        print(f"embcache reshard: {type(exc).__name__}: {exc}\nRun the same command again to resume.")
        return 1
    moved = sum(report.moved_rows.values())
    print(f"shard map version {report.version}: {sorted(report.shards.values())}; moved {moved:,} rows "
          f"({report.rows_per_second:,.0f} rows/s) and {report.delta_rows:,} written meanwhile again, deleted "
          f"{report.deleted_rows:,} from the shards they left; writes to moving rows waited "
          f"{report.pause_seconds:.2f} s of {report.total_seconds:.1f} s{' (resumed)' if report.resumed else ''}")
    return 0
