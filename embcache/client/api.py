"""The public surface of :class:`Client`: the methods of EmbeddingCache, each handing over to the room that does it.

Arguments are checked here (:mod:`embcache.validate`, as the embedded cache checks them) before
anything is sent; the calls go through the client's :class:`~embcache.client.transport.Transport`
(keyed batches by :mod:`~embcache.client.routing`, passes by :mod:`~embcache.client.passes`,
batch leases by :mod:`~embcache.client.leases`, flush and checkpoint by
:mod:`~embcache.client.durability`), and the shards' answers are merged by
:mod:`~embcache.client.merge`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import torch

from ..config import TableConfig
from ..engine.export import ExportResult
from ..errors import (
    ConfigError,
    InvalidGradientError,
    InvalidKeysError,
    InvalidRowsError,
    UnknownTableError,
)
from ..keyset import Keyset
from ..optim import state_width
from ..receipts import Receipts
from ..reshard import ReshardReport, migrate
from ..ring import ShardMap
from ..rpc import codec
from ..rpc.errors import DeadlineExceededError, TLSMismatchError, UnavailableError, error_from_rpc
from ..rpc.v1 import embcache_pb2 as pb
from ..tier import resident_row_bytes
from ..types import memory_tier
from ..validate import all_finite, checked_keys, checked_rows, nonfinite_gradients
from . import routing
from .discovery import Resolver, resolve_expected
from .durability import settle
from .exports import export_fleet
from .leases import LeaseKeeper, RemoteLease
from .merge import merge_stats
from .passes import Passes
from .tls import TLSSettings
from .transport import RemoteFuture, Transport, log

__all__ = ["Client"]

_TLS_CHECK_SECONDS = 1.0  # a shard's channel not ready this long after the client is made: TLS is checked


class Client:
    """The methods of :class:`~embcache.EmbeddingCache`, served by ``embcache-server`` shards.

    Args:
        servers: ``"host:port"``, a list of them, or ``{shard name: "host:port"}``. Names place
            the shards on the hash ring (for a list, the address is the name): keep them stable
            when a shard moves, or its keys move with it. ``"dns:///name:port"`` takes every
            address a DNS name resolves to (a Kubernetes headless Service), each named by its
            reverse-DNS name (:func:`resolve_shards`).
        timeout: deadline of a data call in seconds, retries included (default 60).
        long_timeout: deadline of pass, flush and checkpoint calls (default 3600).
        connect_timeout: how long the constructor waits for every shard (default 30).
        retries: resends of an idempotent call after UNAVAILABLE (default 5; backoff from
            ``backoff`` seconds, doubling, at most ``max_backoff``, with jitter).
        wait_for_ready: a call to a shard that is down waits (until its deadline) for it to come
            back instead of failing at once (default True).
        token: bearer token sent as ``authorization: Bearer <token>``.
        tls_ca: PEM (bytes, or a file path) of the CA that signed the servers' certificates;
            setting it (or ``tls_cert``) switches to TLS.
        tls_cert, tls_key: client certificate and key (PEM bytes or paths) for mutual TLS.
        tls_server_name: name to check the server certificates against, when it differs from the host.
        max_message_bytes: largest message this client sends or receives (default 64 MiB; the
            servers' own limits are honoured too).
        vnodes: virtual nodes per shard on the ring (default 256).
        resolver: for a ``dns:///`` target, the name resolver, with the shape of
            :func:`socket.getaddrinfo` (the default; see :func:`resolve_shards`).
        expected_shards: for a ``dns:///`` target, the number of shards the name must resolve to:
            the constructor resolves again (every 0.2 s, up to ``connect_timeout``) until it does,
            and :meth:`refresh_shards` keeps the current shards while it does not. Without it
            the shards are whatever the name gives at that moment, and the key-to-shard map
            with them. For a list or mapping, a different count is a ValueError.
        lease_ttl: time-to-live of the batch leases of :meth:`prefetch_batch`, seconds (default
            30; the servers cap it at their ``--max-lease-seconds``): the client renews them
            every third of it; if this process dies, the servers unpin their rows after it.

    DNS targets are resolved when the client is made, not on every call; :meth:`refresh_shards`
    resolves again (e.g. after a shard was added) and moves keys to the new map.

    Raises:
        UnavailableError, DeadlineExceededError: a shard could not be reached within ``connect_timeout``,
            or a ``dns:///`` name did not resolve to ``expected_shards`` addresses in that time.
        TLSMismatchError: (an UnavailableError) a shard's channel does not come up because of TLS:
            the server speaks TLS and the client plaintext or the other way round, its certificate
            does not verify against ``tls_ca`` (or name ``tls_server_name``), or it wants a client
            certificate. Checked when a channel is not ready one second after the client is made.
        UnauthenticatedError, PermissionDeniedError: the servers refused the credentials.
        ValueError: a malformed target, a name that does not resolve, a list of the wrong length,
            or ``lease_ttl`` not positive.

    Not offered (``EmbeddingCache`` has them): ``config``, because a fleet has no one
    :class:`~embcache.CacheConfig`: every shard has its own path, tier sizes and device (see
    :meth:`shard_stats` for their capacities, :meth:`capacity_rows` for the totals); and
    ``restore``, because a checkpoint is restored where its store lives: run
    ``EmbeddingCache.restore(shard_checkpoint, CacheConfig(path=...))`` on each shard's
    machine and start ``embcache-server --path`` there (a client cannot move a store); and
    ``export_rows``, ``import_rows`` and ``delete_rows``, with which a server moves rows between
    shards while resharding: a fleet moves its rows with :meth:`reshard`; and ``begin_export``,
    the shard's half of :meth:`export_delta` (which runs it on every shard); and
    ``import_version``, because an exported version is loaded where a store lives: run
    ``embcache import EXPORT_DIR STORE_DIR`` for a server's path before starting it (with
    several shards, import into one and :meth:`reshard` onto the others); and ``expire_now``,
    because each server's own sweeper expires its rows (every ``CacheConfig.expiry_interval``
    seconds) and a fleet has no one moment to sweep.
    """

    def __init__(self, servers: str | Sequence[str] | Mapping[str, str], *, timeout: float = 60.0,
                 long_timeout: float = 3600.0, connect_timeout: float = 30.0, retries: int = 5,
                 backoff: float = 0.05, max_backoff: float = 2.0, wait_for_ready: bool = True,
                 token: str | None = None, tls_ca: str | bytes | None = None, tls_cert: str | bytes | None = None,
                 tls_key: str | bytes | None = None, tls_server_name: str | None = None,
                 max_message_bytes: int = 64 << 20, vnodes: int = 256, resolver: Resolver = socket.getaddrinfo,
                 expected_shards: int | None = None, lease_ttl: float = 30.0) -> None:
        if expected_shards is not None and expected_shards < 1:
            raise ValueError(f"expected_shards must be >= 1, got {expected_shards}")
        if not 0 < lease_ttl < float("inf"):
            raise ValueError(f"lease_ttl must be a positive number of seconds, got {lease_ttl}")
        self._dns_target = servers if isinstance(servers, str) and servers.startswith("dns:///") else None
        self._resolver, self._expected_shards = resolver, expected_shards
        if self._dns_target is not None:
            servers = resolve_expected(self._dns_target, resolver, expected_shards,
                                       time.monotonic() + connect_timeout)
        elif isinstance(servers, str):
            servers = [servers]
        named = dict(servers) if isinstance(servers, Mapping) else {a: a for a in servers}
        if not named or len(named) != len(servers):
            raise ValueError(f"servers must be one or more distinct addresses, got {servers!r}")
        if expected_shards is not None and len(named) != expected_shards:
            raise ValueError(f"expected {expected_shards} shards, got {len(named)}: {list(named)}")
        tls = TLSSettings.of(tls_ca, tls_cert, tls_key, tls_server_name)
        self._transport = t = Transport(named, timeout=timeout, long_timeout=long_timeout, retries=retries,
                                        backoff=backoff, max_backoff=max_backoff, wait_for_ready=wait_for_ready,
                                        token=token, tls=tls, max_message_bytes=max_message_bytes, vnodes=vnodes)
        self._leases = LeaseKeeper(t, float(lease_ttl))
        self._passes = Passes(t)
        self._receipts = Receipts()  # acknowledged writes per shard, until a flush shows them durable
        deadline = time.monotonic() + connect_timeout
        try:
            if wait_for_ready:  # (without wait_for_ready a call to such a shard fails at once: checked below)
                tls.check_ready([(s.address, s.channel) for s in t.topology.shards],
                                min(_TLS_CHECK_SECONDS, connect_timeout))
            t.refresh_tables(timeout=max(deadline - time.monotonic(), 0.001))
            if t.topology.map.version == 0 and len(t.topology.shards) > 1:  # one shard: nothing to disagree about
                t.install_map(max(deadline - time.monotonic(), 0.001))
        except (UnavailableError, DeadlineExceededError) as exc:
            self.close()
            if isinstance(exc, TLSMismatchError):
                raise
            problem = next(filter(None, (tls.problem(s.address) for s in t.topology.shards)), None)
            if problem is not None:
                raise TLSMismatchError(problem, grpc.StatusCode.UNAVAILABLE) from exc
            raise
        except BaseException:
            self.close()
            raise

    @property
    def shard_map(self) -> ShardMap:
        """The shard map this client routes by (version 0: its own shard list, before any reshard)."""
        return self._transport.topology.map

    def refresh_shards(self, progress: bool = False) -> bool:
        """Resolve the ``dns:///`` target again and reshard the fleet onto the shards it gives now.

        When the name gives another set of shards than the fleet's map, this runs
        :meth:`reshard` onto it: every row whose owner changes moves, with its optimizer state
        and frequency, before the new map takes effect (see :mod:`embcache.reshard`); other
        clients are redirected to the new map by the servers.

        Returns:
            True when the shards changed.

        Raises:
            ValueError: the client was not made from a ``dns:///`` target, or the name does not resolve.
            UnavailableError: the name does not resolve to ``expected_shards`` addresses now
                (the current shards are kept), or a shard failed during the migration (call
                again to resume it).
        """
        self._transport.check_open()
        if self._dns_target is None:
            raise ValueError("refresh_shards() needs a client made from a 'dns:///name:port' target")
        named = resolve_expected(self._dns_target, self._resolver, self._expected_shards, time.monotonic())
        current = self._transport.topology.map.shards
        if set(current) == set(named):
            return False
        log.info("shards of %s changed: %s -> %s: resharding", self._dns_target, sorted(current.values()),
                 sorted(named.values()))
        self.reshard(named, progress=progress)
        return True

    def reshard(self, servers: Sequence[str] | Mapping[str, str], progress: bool = True,
                batch_rows: int = 65536) -> ReshardReport:
        """Move the fleet onto ``servers`` (add or remove shards), migrating every row whose owner changes.

        Training may go on meanwhile, in this process and others: writes to the rows being
        moved wait (they are refused and resent) until the new map is committed, everything
        else is served; clients still on the old map are redirected. Resumable: after a crash of
        any party, call it again with the same list. See :mod:`embcache.reshard`.

        Args:
            servers: the new shard list (``"host:port"`` list, or ``{name: "host:port"}``).
            progress: a progress bar of the rows copied (stderr).
            batch_rows: store rows a source scans per exported message.

        Raises:
            ConfigError, UnavailableError, DeadlineExceededError, StoreError (see :func:`embcache.reshard.migrate`).
        """
        self._transport.check_open()
        return migrate(self._transport, servers, progress=progress, batch_rows=batch_rows)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Cancel the batch leases still held, then close the channels (the servers keep running). Idempotent."""
        if not self._transport.closed:
            self._leases.close()
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._transport.closed

    @property
    def device(self) -> torch.device:
        """Where returned rows live: the CPU."""
        return torch.device("cpu")

    @property
    def servers(self) -> dict[str, str]:
        """Shard name -> address."""
        return {s.name: s.address for s in self._transport.topology.shards}

    def shard_of(self, keys: Any) -> np.ndarray:
        """Index (into :attr:`servers`) of the shard that owns each key: int64 [n]."""
        return self._transport.topology.ring.owners(self._keys(keys))

    # ------------------------------------------------------------------ argument checks
    def _keys(self, keys: Any) -> np.ndarray:
        """int64 [n] numpy keys, checked as EmbeddingCache checks them (the servers' batch limit)."""
        return checked_keys(keys, self._transport.max_batch_keys).numpy()

    def _dims(self, names: Sequence[str]) -> dict[str, int]:
        """Dims of the named tables (the list is fetched again when a name is new to this client)."""
        return {n: cfg.dim for n, cfg in self._transport.known(*names).items()}

    def _rows_batch(self, updates: Mapping[str, tuple[Any, Any]], what: str,
                    error: type[InvalidGradientError] | type[InvalidRowsError]
                    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every table's keys and rows (float32 numpy, on the CPU) of ``updates``, checked before any is sent."""
        dims = self._dims(list(updates))
        batch: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for t, (k, v) in updates.items():
            keys = self._keys(k)
            rows = checked_rows(what, v, keys.shape[0], dims[t], error)
            batch[t] = (keys, rows.to("cpu").contiguous().numpy())
        return batch

    # ------------------------------------------------------------------ tables
    def tables(self) -> dict[str, TableConfig]:
        """The tables the servers serve, by name (fetched now)."""
        self._transport.check_open()
        return self._transport.refresh_tables()

    def create_table(self, cfg: TableConfig) -> bool:
        """Add a table on every shard; idempotent for an equal definition.

        Returns:
            True if some shard created it, False if every shard had an equal one.

        Raises:
            TableConflictError: a table of that name exists with another definition.
            PassStateError: rows are pinned on a shard. ConfigError: ``cfg`` is not a TableConfig.
        """
        if not isinstance(cfg, TableConfig):
            raise ConfigError(f"create_table takes a TableConfig, got {type(cfg).__name__}")
        req = pb.CreateTableRequest(table=codec.table_to_proto(cfg))
        replies = self._transport.fanout([(s, "CreateTable", req) for s in self._transport.topology.shards],
                                         idempotent=True)
        self._transport.remember(cfg)
        return any(r.created for r in replies)

    # ------------------------------------------------------------------ lookups
    def lookup(self, table: str, keys: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``keys``: float32 [n, dim] on the CPU.

        Args:
            table: table name.
            keys: int64 [n] (any integer dtype; tensor, numpy array or sequence); duplicates allowed.
            out: optional float32 [n, dim] CPU tensor to write into.

        Raises:
            UnknownTableError, InvalidKeysError, BatchTooLargeError, InvalidRowsError (bad ``out``),
            StoreError, UnavailableError, DeadlineExceededError.
        """
        return self._lookup({table: keys}, {table: out} if out is not None else {})[table]

    def lookup_many(self, keys: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Rows of several tables in one round trip per shard: ``{table: keys [n]} -> {table: float32 [n, dim]}``.

        Raises:
            The errors of :meth:`lookup`.
        """
        return self._lookup(keys, {})

    def _lookup(self, keys: Mapping[str, Any], outs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dims = self._dims(list(keys))
        return routing.lookup(self._transport, {t: self._keys(k) for t, k in keys.items()}, dims, outs)

    # ------------------------------------------------------------------ writes
    def apply_gradients(self, table: str, keys: Any, grads: Any) -> None:
        """Apply the table's optimizer to the rows of ``keys``; gradients of duplicate keys are summed.

        Never resent after a failure that may have reached the server (not idempotent).

        Args:
            table: table name.
            keys: int64 [n] (duplicates allowed).
            grads: floating [n, dim] (any device; sent as float32).

        Raises:
            UnknownTableError, InvalidKeysError, InvalidGradientError, NonFiniteGradientError,
            BatchTooLargeError, StoreError, UnavailableError (may or may not be applied),
            DeadlineExceededError.
        """
        self.apply_gradients_many({table: (keys, grads)})

    def apply_gradients_many(self, updates: Mapping[str, tuple[Any, Any]]) -> None:
        """Apply gradients to several tables in one round trip per shard: ``{table: (keys [n], grads [n, dim])}``.

        Every table's input is checked before anything is sent.

        Raises:
            The errors of :meth:`apply_gradients`.
        """
        batch = self._rows_batch(updates, "gradients", InvalidGradientError)
        if self._transport.reject_nonfinite:
            for t, (_, g) in batch.items():
                if not all_finite(g):
                    raise nonfinite_gradients(t)  # the server's own refusal, checked before sending
        routing.write(self._transport, self._receipts, "ApplyGradients", batch, pb.ApplyGradientsRequest)

    def assign(self, table: str, keys: Any, rows: Any) -> None:
        """Overwrite the rows of ``keys`` and reset their optimizer state; the last duplicate wins.

        Raises:
            UnknownTableError, InvalidKeysError, InvalidRowsError, BatchTooLargeError, StoreError,
            UnavailableError (may or may not be applied), DeadlineExceededError.
        """
        self.assign_many({table: (keys, rows)})

    def assign_many(self, updates: Mapping[str, tuple[Any, Any]]) -> None:
        """Assign rows of several tables in one round trip per shard: ``{table: (keys [n], rows [n, dim])}``.

        Every table's input is checked before anything is sent; each shard applies its part of
        every table as one request. Never resent after a failure that may have reached a server.

        Raises:
            The errors of :meth:`assign`.
        """
        batch = self._rows_batch(updates, "rows", InvalidRowsError)
        for _, rows in batch.values():
            if not all_finite(rows):
                raise InvalidRowsError("rows contain NaN or inf; nothing was assigned")
        routing.write(self._transport, self._receipts, "Assign", batch, pb.AssignRequest)

    def delete(self, table: str, keys: Any) -> int:
        """Delete the rows of ``keys`` from every tier and the store of the shards that own them
        (see :meth:`EmbeddingCache.delete`); a later lookup gets the initializer's row afresh.

        Never resent after a failure that may have reached the server.

        Returns:
            How many of the distinct keys had a row.

        Raises:
            UnknownTableError, InvalidKeysError, BatchTooLargeError, StoreError,
            UnavailableError (may or may not be applied), DeadlineExceededError.
        """
        self._dims([table])
        keys = np.unique(self._keys(keys))
        return routing.delete(self._transport, self._receipts, {table: keys})[table]

    # ------------------------------------------------------------------ passes
    def prefetch(self, keysets: Mapping[str, Keyset | Any]) -> RemoteFuture:
        """Stage the rows of the next pass on every shard in the background.

        Returns once every shard has started staging (bad input raises here); the future's
        result is ``{table: {"staged_rows", "leased_rows", "seconds"}}`` summed over shards.
        ``cancel()`` stops the staging and releases its rows. The next :meth:`begin_pass`
        adopts what was staged. A shard's keyset above the message limit is sent in chunks
        (``PrefetchStream``) and staged as one prefetch. A shard that refuses the call before it
        had any effect (a draining server) is asked again, within ``retries`` and the deadline.

        Raises:
            UnknownTableError, InvalidKeysError, UnavailableError, DeadlineExceededError.
        """
        return self._transport.rerouting(lambda: self._passes.prefetch(keysets))

    def begin_pass(self, keysets: Mapping[str, Keyset | Any]) -> dict[str, dict[str, int]]:
        """Make a pass's keyset resident and pinned on every shard (each gets the keys it owns).

        A shard's keyset above the message limit is sent in chunks (``BeginPassStream``) and begun
        as one pass. A shard that refuses the call before it had any effect (a draining server)
        is asked again, within ``retries`` and the deadline. If some shard still refuses, the
        shards that began are ended again, so no pass is left half begun.

        Returns:
            ``{table: {"keyset_rows": n, "pinned_rows": m}}`` summed over shards.

        Raises:
            PassStateError, UnknownTableError, InvalidKeysError, StoreError, UnavailableError.
        """
        return self._transport.rerouting(lambda: self._passes.begin(keysets))

    def end_pass(self) -> RemoteFuture:
        """Unpin the pass's rows on every shard (done when this returns); write-back goes on in the background.

        A shard that refuses the call before it had any effect (a draining server) is asked
        again, within ``retries`` and the deadline.

        Returns:
            A future of the number of rows written back, summed over shards.

        Raises:
            PassStateError: no pass is active. ShardRestartedError: a shard restarted since
                :meth:`begin_pass` and its new process holds no pass (the rows it had pinned were
                unpinned by the restart; acknowledged writes are accounted for by :meth:`flush`).
            UnavailableError, DeadlineExceededError.
        """
        return self._passes.end()

    # ------------------------------------------------------------------ batch leases
    def prefetch_batch(self, keysets: Mapping[str, Keyset | Any]) -> RemoteLease:
        """Stage the rows of one upcoming batch on the shards that own them, and lease them until ``release()``.

        As :meth:`EmbeddingCache.prefetch_batch`: each shard stages its keys in the background
        and pins them until the returned future's ``release()`` or ``cancel()``, so
        :class:`~embcache.LookAhead` runs over a client unchanged. The servers hold the lease by
        id with a time-to-live (``lease_ttl``); this client renews its leases from one background
        thread (one call per shard every third of the TTL, or a bounded wait while staging runs),
        so a crashed or cut-off client pins rows at most for the TTL. Release every lease (as
        ``LookAhead`` does): a lease neither released nor cancelled stays pinned while the client
        lives. A shard's keys above the message limit go in chunks (``PrefetchBatchStream``).

        Returns:
            A :class:`RemoteLease` (a :class:`~embcache.prefetch.PrefetchFuture`); its result is
            ``{table: {"staged_rows", "leased_rows", "seconds"}}`` summed over shards.

        Raises:
            UnknownTableError, InvalidKeysError, UnavailableError, DeadlineExceededError (the
            shards that had granted the lease are told to cancel it).
        """
        return self._transport.rerouting(lambda: self._leases.grant(keysets))

    # ------------------------------------------------------------------ durability and inspection
    def flush(self) -> None:
        """Make every acknowledged update durable on every shard (survives kill -9), or say which may be lost.

        Each shard is asked, with the flush, about the server processes that acknowledged this
        client's writes since its last flush: a shard whose process crashed and restarted since
        (kill -9, OOM, power loss) cannot prove those writes durable, and this raises
        :class:`DataLossError` naming it and counting them instead of returning. The writes of a
        shard that left the fleet by a reshard are answered for by the shards that took its rows
        (the reshard flushed it and handed its record to them). A clean restart
        (SIGTERM) flushes first and loses nothing. A loss is reported once.

        Raises:
            DataLossError, StoreError, UnavailableError, DeadlineExceededError.
        """
        settle(self._transport, self._receipts, "Flush", self._transport.topology.shards,
               lambda _, incs: pb.FlushRequest(incarnations=incs), idempotent=True)

    def checkpoint(self, directory: str | os.PathLike[str]) -> list[str]:
        """Checkpoint every shard: ``directory`` (one shard) or ``directory/shard-<i>``, under each server's root.

        Args:
            directory: a name relative to the servers' checkpoint root (``--checkpoint-root``).

        Returns:
            The absolute paths the servers wrote, per shard.

        Raises:
            DataLossError: as :meth:`flush` (the checkpoints were written; they lack those writes).
            CheckpointExistsError, PermissionDeniedError (outside the root), StoreError, UnavailableError.
        """
        directory = os.fspath(directory)
        shards = self._transport.topology.shards
        names = [directory] if len(shards) == 1 else [os.path.join(directory, f"shard-{i}")
                                                      for i in range(len(shards))]
        where = dict(zip((s.name for s in shards), names, strict=True))
        replies = settle(self._transport, self._receipts, "Checkpoint", shards, lambda s, incs: pb.CheckpointRequest(
            directory=where[s.name], incarnations=incs), idempotent=False)
        return [r.directory for r in replies]

    def export_delta(self, directory: str | os.PathLike[str], *, with_state: bool = False,
                     tables: Sequence[str] | None = None, full: bool = False) -> ExportResult:
        """Write the fleet's rows changed and keys deleted since the previous export as the next
        version under ``directory`` (here, on the client's machine), as
        :meth:`EmbeddingCache.export_delta` does for one cache.

        Each shard streams its changes (``ExportDelta``); the client merges them and writes the
        version; only then does each shard drop the change marks it covered (``CommitExport``).
        A failure before that leaves every mark in place: the next export includes these rows.
        The first export (or one after the shards disagree on the base) is a full version.

        Args:
            directory: the export directory on this machine (created if missing).
            with_state: export the optimizer state too.
            tables: the tables to export (default: all).
            full: write a full version even when a delta could follow.

        Raises:
            ExportFormatError, UnknownTableError, UnavailableError, DeadlineExceededError, StoreError.
        """
        return export_fleet(self._transport, directory, with_state=with_state, tables=tables, full=full)

    def stats(self) -> dict[str, dict[str, Any]]:
        """``EmbeddingCache.stats()`` summed over shards (same shape; miss-ratio estimates averaged by lookups)."""
        return merge_stats(self.shard_stats())

    def shard_stats(self) -> list[dict[str, dict[str, Any]]]:
        """``stats()`` of each shard, in :attr:`servers` order."""
        replies = self._transport.fanout([(s, "Stats", pb.StatsRequest()) for s in self._transport.topology.shards],
                                         idempotent=True)
        return [json.loads(r.json) for r in replies]

    def server_info(self) -> list[dict[str, Any]]:
        """Each shard's ``ServerInfo`` (fetched now), in :attr:`servers` order, as a dict: its
        ``address``, embcache ``version``, limits, ``device``, ``durability``, ``incarnation``
        and, in serving mode (``embcache-server --serve``), ``serving_version`` (the export's
        version it serves; 0: not serving) and ``serving_directory``.

        Raises:
            UnavailableError, DeadlineExceededError.
        """
        shards = self._transport.topology.shards
        replies = self._transport.fanout([(s, "ListTables", pb.ListTablesRequest()) for s in shards],
                                         idempotent=True)
        return [{"address": shard.address, **{f.name: getattr(r.server, f.name) for f in r.server.DESCRIPTOR.fields}}
                for shard, r in zip(shards, replies, strict=True)]

    def row_bytes(self, table: str) -> int:
        """Bytes of memory one resident row of ``table`` costs (weights, optimizer state, bookkeeping, key index).

        Computed from the table's definition by the formula every server of this version uses
        (``EmbeddingCache.row_bytes``) for a tier in host memory, e.g. to size passes with
        ``embcache.keyset.split_passes``; a server whose hot tier is on a GPU counts its GPU index's
        16 more bytes for the rows there.

        Raises:
            UnknownTableError.
        """
        cfg = self._transport.table(table)
        return resident_row_bytes(cfg.dim, cfg.torch_dtype, state_width(cfg.optimizer, cfg.dim), "cpu")

    def capacity_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` each memory tier can hold, summed over shards: ``{"hbm": n, "ddr": m}``.

        Raises:
            UnknownTableError, UnavailableError, DeadlineExceededError.
        """
        self._transport.table(table)
        per = [s.get(table) for s in self.shard_stats()]
        if any(p is None for p in per):
            raise UnknownTableError(f"table {table!r} is missing on a shard; create it through this client")
        return {tier: sum(int(p[tier]["capacity_rows"]) for p in per if p is not None) for tier in ("hbm", "ddr")}

    def resident_keys(self, table: str, tier: str) -> torch.Tensor:
        """Keys (int64, CPU) of ``table`` resident in ``tier`` ("hbm" or "ddr") on any shard, for inspection.

        The shards' keys concatenated in :attr:`servers` order (each shard's in no particular
        order); each shard streams them in chunks below the message limit.

        Raises:
            ConfigError: ``tier`` is not "hbm" or "ddr". UnknownTableError, UnavailableError.
        """
        memory_tier(tier)
        self._transport.table(table)
        shards = self._transport.topology.shards
        deadline = time.monotonic() + self._transport.timeout
        out: list[np.ndarray] = []
        calls = [(s, self._transport.stream(s, "ResidentKeys", pb.ResidentKeysRequest(table=table, tier=tier),
                                            deadline)) for s in shards]
        for shard, call in calls:
            try:
                out += [codec.decode_tensor(m.keys, f"resident keys from {shard.address}", InvalidKeysError,
                                            ("int64",), 1) for m in call]
            except grpc.RpcError as err:
                raise error_from_rpc(err, shard.address) from None
        return torch.from_numpy(np.concatenate(out).astype(np.int64) if out else np.empty(0, dtype=np.int64))
