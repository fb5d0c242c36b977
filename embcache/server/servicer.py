"""The gRPC servicer: a thin adapter from ``embcache.rpc.v1`` to :class:`~embcache.EmbeddingCache`.

Each method decodes its request (:mod:`embcache.server.decoding`, over :mod:`embcache.rpc.codec`),
calls the library and encodes the reply; every rule about keys, rows, tables and passes lives in
the library. Typed errors become status codes through the one table in :mod:`embcache.rpc.errors`,
with the type's name in the trailing metadata. Each call is counted once when it ends, with its status
code and latency, in :class:`~embcache.server.rpcmetrics.RpcMetrics` (and when it starts, by the
handlers); so are the messages of reply streams.

Concurrency: gRPC runs each call on a worker thread; the cache serializes operations per table
(one lock each) and releases the GIL in its heavy parts, so calls on different tables, and the
encoding and decoding of different calls, run in parallel. A write request is applied with one
library call, so it is atomic per table. Batch leases (PrefetchBatch) are held in a
:class:`~embcache.server.leases.LeaseTable`, without a thread per lease.

Around it: :mod:`embcache.server.handlers` registers its methods with a gRPC server
(:func:`add_to_server`), :mod:`embcache.server.durability` flushes after writes
(:class:`Durability`), and :mod:`embcache.server.auth` holds the token roles (:data:`ROLES`).
Those names are importable from here too.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from ..cache import EmbeddingCache
from ..engine.rows import record_bytes
from ..errors import (
    BatchTooLargeError,
    CacheClosedError,
    ConfigError,
    EmbcacheError,
    InvalidGradientError,
    InvalidKeysError,
    InvalidRowsError,
    MigratingError,
    UnknownTableError,
    WrongShardError,
)
from ..keyset import Keyset
from ..optim import state_width
from ..rpc import codec, wire
from ..rpc.errors import (
    ERROR_TYPE_KEY,
    INCARNATION_KEY,
    MAP_VERSION_KEY,
    NOT_APPLIED_KEY,
    SHARD_MAP_KEY,
    status_of,
)
from ..rpc.v1 import embcache_pb2 as pb
from ..rpc.v1 import embcache_pb2_grpc as pb_grpc
from .auth import READ_METHODS, ROLES, WRITE_METHODS, roles_text
from .decoding import collect_chunks, collect_keysets, keys_of, keysets_of, unique_tables, values_of
from .durability import Durability
from .exports import Exports
from .handlers import SERVICE_NAME, add_to_server
from .leases import LeaseTable
from .overlay import Overlay
from .overload import StreamWatchdog
from .rpcmetrics import RpcMetrics
from .serving import ServedModel
from .sharding import ShardGate

__all__ = ["LOOKUP_CHUNK_KEYS", "READ_METHODS", "ROLES", "SERVICE_NAME", "WRITE_METHODS", "Durability",
           "EmbeddingCacheServicer", "add_to_server", "roles_text"]

log = logging.getLogger("embcache.server")
R = TypeVar("R")

#: Keys a Lookup hands the cache per call: a larger request is looked up in chunks of this many
#: (same rows; the cache's working memory stays that of one chunk).
LOOKUP_CHUNK_KEYS = 1 << 16
_REPLY_ENTRY_BYTES = 256  # a Lookup reply's bytes per table besides its rows and name (headers, padding), at most


class EmbeddingCacheServicer(pb_grpc.EmbeddingCacheServiceServicer):
    """Serves one :class:`~embcache.EmbeddingCache` over ``embcache.rpc.v1.EmbeddingCacheService``.

    Args:
        cache: the cache (owned by the caller, who closes it after the server stopped).
        durability: the flush policy applied after writes.
        server_info: limits and settings reported by ListTables.
        metrics: counts the calls: their end (status code name and latency) is recorded here, their start
            and request messages by :func:`~embcache.server.handlers.add_to_server`'s handlers.
        checkpoint_root: directory under which Checkpoint may write.
        leases: the batch leases (default: a table with the server's longest time-to-live).
        gate: the shard map's gate (default: one over the cache's store directory).
        watchdog: cuts idle client streams (default: none).
        serving: serving mode: the export served (lookups hold its version gate; ListTables and
            Stats report its version). Its write calls are refused before they reach here
            (:class:`~embcache.server.serving.ReadOnlyGuard`).
    """

    def __init__(self, cache: EmbeddingCache, durability: Durability, server_info: pb.ServerInfo,
                 metrics: RpcMetrics, checkpoint_root: str,
                 leases: LeaseTable | None = None, gate: ShardGate | None = None,
                 watchdog: StreamWatchdog | None = None, serving: ServedModel | None = None) -> None:
        self._cache = cache
        self._serving = serving
        self._reading: Callable[[], AbstractContextManager[Overlay | None]] = (
            serving.reading if serving is not None else nullcontext)
        self._gate = gate if gate is not None else ShardGate(cache.config.path, cache)
        self._durability = durability
        self._info = server_info
        self.metrics = metrics
        self._observe = metrics.handled
        self._checkpoint_root = os.path.realpath(checkpoint_root)
        self._stopping = threading.Event()
        self._ledger = durability.ledger
        self._incarnation = durability.ledger.incarnation
        self._incarnation_hex = f"{self._incarnation:016x}"
        self._watchdog = watchdog
        self._exports = Exports(cache, server_info.max_send_message_bytes)
        self.leases = leases if leases is not None else LeaseTable(
            cache, server_info.max_lease_seconds or 600.0)

    def begin_shutdown(self) -> None:
        """Refuse new calls (UNAVAILABLE, marked not applied); calls already running finish (lease polls at once)."""
        self._stopping.set()
        self.leases.interrupt()

    def close(self) -> None:
        """Cancel every batch lease and stop their reaper (after the server stopped, before the cache closes)."""
        self.leases.close()
        if self._watchdog is not None:
            self._watchdog.close()

    def watch(self, requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Iterator[Any]:
        """A client stream's requests, cut after the idle time of the stream watchdog (if any)."""
        return requests if self._watchdog is None else self._watchdog.watch(requests, context, method)

    # ------------------------------------------------------------------ error and latency plumbing
    def _fail(self, method: str, context: grpc.ServicerContext, exc: BaseException, t0: float) -> None:
        if isinstance(exc, EmbcacheError):
            code, name = status_of(exc)
            message = str(exc)
        else:  # a bug: say so, keep serving
            log.exception("%s failed unexpectedly", method, exc_info=exc)
            code, name = grpc.StatusCode.INTERNAL, type(exc).__name__
            message = f"internal error in {method}: {type(exc).__name__}: {exc}"
        meta: list[tuple[str, str]] = [(ERROR_TYPE_KEY, name), (INCARNATION_KEY, self._incarnation_hex)]
        if isinstance(exc, (CacheClosedError, WrongShardError, MigratingError)):
            meta.append((NOT_APPLIED_KEY, "1"))
        if getattr(exc, "shard_map", ""):
            meta.append((SHARD_MAP_KEY, exc.shard_map))  # type: ignore[attr-defined]
        self._observe(method, code.name, time.perf_counter() - t0)
        context.set_trailing_metadata(tuple(meta))
        context.abort(code, message)

    def refuse_malformed(self, method: str, context: grpc.ServicerContext, message: str) -> None:
        """Abort a call whose request bytes are no valid message: INVALID_ARGUMENT, InvalidKeysError, not applied."""
        self._observe(method, "INVALID_ARGUMENT", 0.0)
        context.set_trailing_metadata(((ERROR_TYPE_KEY, InvalidKeysError.__name__), (NOT_APPLIED_KEY, "1")))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    def _refuse_if_stopping(self, method: str, context: grpc.ServicerContext, t0: float) -> None:
        if self._stopping.is_set():
            self._observe(method, "UNAVAILABLE", time.perf_counter() - t0)
            context.set_trailing_metadata(((NOT_APPLIED_KEY, "1"), (INCARNATION_KEY, self._incarnation_hex)))
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; the request was not applied")

    def _run(self, method: str, context: grpc.ServicerContext, fn: Callable[[], R]) -> R:
        t0 = time.perf_counter()
        self._refuse_if_stopping(method, context, t0)
        try:
            result = fn()
        except Exception as exc:
            self._fail(method, context, exc, t0)
            raise  # unreachable: abort raised
        self._observe(method, "OK", time.perf_counter() - t0)
        return result

    def _run_stream(self, method: str, context: grpc.ServicerContext, gen: Iterator[R]) -> Iterator[R]:
        t0 = time.perf_counter()
        self._refuse_if_stopping(method, context, t0)
        try:
            for reply in gen:
                yield reply
                self.metrics.sent(method)  # gRPC came back for the next reply: it has sent this one
        except CancelledError:  # the client went away and its staging was cancelled
            self._observe(method, "CANCELLED", time.perf_counter() - t0)
            return
        except GeneratorExit:  # the call ended (the client cancelled it or went away) before the stream did
            close = getattr(gen, "close", None)  # (as ``yield from`` did: the stream's own clean-up runs first)
            if close is not None:
                close()
            self._observe(method, "CANCELLED", time.perf_counter() - t0)
            raise
        except Exception as exc:
            self._fail(method, context, exc, t0)
            raise
        self._observe(method, "OK", time.perf_counter() - t0)

    def _write(self, method: str, context: grpc.ServicerContext, fn: Callable[[], None]) -> pb.WriteReceipt:
        """Apply a write request, number it in the ledger, flush if the durability mode says so; its receipt.

        The number is taken after the write was applied and before the mode's flush, so that
        flush covers it; a request that fails is not acknowledged (its number is skipped).
        """
        def apply() -> pb.WriteReceipt:
            fn()
            seq = self._ledger.acknowledge()
            self._durability.after_write()
            return pb.WriteReceipt(incarnation=self._incarnation, seq=seq)
        return self._run(method, context, apply)

    @staticmethod
    def _map_version(context: grpc.ServicerContext) -> int:
        """The shard map version the client routed this request by (0: none)."""
        for key, value in context.invocation_metadata() or ():
            if key == MAP_VERSION_KEY:
                try:
                    return int(value)
                except ValueError:
                    raise WrongShardError(f"metadata {MAP_VERSION_KEY}={value!r} is not a version number") from None
        return 0

    # ------------------------------------------------------------------ tables
    def CreateTable(self, request: pb.CreateTableRequest, context: grpc.ServicerContext) -> pb.CreateTableResponse:
        """Add a table (idempotent for an equal definition)."""
        return self._run("CreateTable", context, lambda: pb.CreateTableResponse(
            created=self._cache.create_table(codec.table_from_proto(request.table))))

    def ListTables(self, request: pb.ListTablesRequest, context: grpc.ServicerContext) -> pb.ListTablesResponse:
        """The tables, by name, and the server's limits."""
        def list_tables() -> pb.ListTablesResponse:
            tables = self._cache.tables()
            info = pb.ServerInfo()
            info.CopyFrom(self._info)
            info.shard_map = self._gate.state()[0]
            if self._serving is not None:
                info.serving_version = self._serving.version
            return pb.ListTablesResponse(tables=[codec.table_to_proto(tables[n]) for n in sorted(tables)],
                                         server=info)
        return self._run("ListTables", context, list_tables)

    # ------------------------------------------------------------------ rows
    def Lookup(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Rows of several tables; counts accesses like the library's lookup.

        The reply is allocated once and each table's rows are looked up straight into it (no
        copy to encode them, no buffer per table).
        """
        def lookup() -> bytes:
            tables = wire.parse_lookup_request(request)
            unique_tables(tables, "Lookup")
            keys = {tk.table: keys_of(tk) for tk in tables}
            self._gate.check_read(self._map_version(context), {n: k.numpy() for n, k in keys.items()})
            known = self._cache.tables()
            self._check_reply_size(keys, known)
            if any(name not in known for name in keys):  # the library raises UnknownTableError, having read nothing
                with self._reading() as overlay:  # (or the table was created meanwhile)
                    rows = {n: r.cpu() for n, r in self._cache.lookup_many(keys).items()}
                    if overlay is not None:
                        for n, r in rows.items():
                            overlay.patch(n, keys[n], r)
                return wire.encode_lookup_response([(n, r.numpy()) for n, r in rows.items()])
            reply, views = wire.new_lookup_response([(n, k.numel(), known[n].dim) for n, k in keys.items()])
            on_cpu = self._cache.device.type == "cpu"
            with self._reading() as overlay:  # serving mode: every table and chunk of one version
                for (name, k), out in zip(keys.items(), views, strict=True):
                    # In chunks: the cache's working memory for a batch (unique keys, staged rows, their
                    # placement) grows with the batch, so one lookup of 8M unknown keys (a 64 MiB request)
                    # peaked 4 GiB above the tier budgets; per chunk it stays bounded.
                    for start in range(0, max(k.numel(), 1), LOOKUP_CHUNK_KEYS):
                        end = start + LOOKUP_CHUNK_KEYS
                        if on_cpu:
                            self._cache.lookup(name, k[start:end], out=out[start:end])
                        else:  # the rows leave the device once, into the reply
                            out[start:end].copy_(self._cache.lookup(name, k[start:end]))
                    if overlay is not None:  # rows of the version served not yet written into the cache
                        overlay.patch(name, k, out)
            return reply
        return self._run("Lookup", context, lookup)

    def _check_reply_size(self, keys: dict[str, torch.Tensor], known: dict[str, Any]) -> None:
        """Refuse a Lookup whose reply could not be sent, before any row is read or created.

        Raises:
            BatchTooLargeError: the rows would exceed the send limit (RESOURCE_EXHAUSTED).
        """
        limit = self._info.max_send_message_bytes
        if not limit:
            return
        size = sum(4 * k.numel() * known[n].dim + _REPLY_ENTRY_BYTES + len(n.encode())
                   for n, k in keys.items() if n in known)
        if size > limit:
            raise BatchTooLargeError(
                f"Lookup: the reply would hold {size} bytes of rows, over the server's send limit of {limit} "
                f"bytes; nothing was read. Send fewer keys per call (embcache.Client splits its batches by the "
                f"limits the server reports)")

    def _apply(self, updates: dict[str, tuple[torch.Tensor, torch.Tensor]], context: grpc.ServicerContext) -> None:
        with self._gate.writing(self._map_version(context), {n: k.numpy() for n, (k, _) in updates.items()}):
            self._apply_checked(updates)

    def _apply_checked(self, updates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(updates) == 1:
            (name, (k, g)), = updates.items()
            self._cache.apply_gradients(name, k, g)
        elif updates:
            self._cache.apply_gradients_many(updates)

    def _assign(self, updates: dict[str, tuple[torch.Tensor, torch.Tensor]], context: grpc.ServicerContext) -> None:
        with self._gate.writing(self._map_version(context), {n: k.numpy() for n, (k, _) in updates.items()}):
            self._assign_checked(updates)

    def _assign_checked(self, updates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(updates) == 1:
            (name, (k, r)), = updates.items()
            self._cache.assign(name, k, r)
        elif updates:
            self._cache.assign_many(updates)  # every table checked before any changes

    def ApplyGradients(self, request: bytes, context: grpc.ServicerContext) -> pb.ApplyGradientsResponse:
        """Apply each table's optimizer; duplicate keys' gradients are summed."""
        def apply() -> None:
            tables = wire.parse_values_request(request)
            unique_tables(tables, "ApplyGradients")
            self._apply({tv.table: (keys_of(tv), values_of(tv, "gradients", InvalidGradientError)) for tv in tables},
                        context)
        return pb.ApplyGradientsResponse(receipt=self._write("ApplyGradients", context, apply))

    def ApplyGradientsStream(self, request_iterator: Iterator[pb.ApplyGradientsRequest],
                             context: grpc.ServicerContext) -> pb.ApplyGradientsResponse:
        """ApplyGradients for batches above the message limit: chunks collected, then applied as one request."""
        return pb.ApplyGradientsResponse(receipt=self._write(
            "ApplyGradientsStream", context,
            lambda: self._apply(collect_chunks(request_iterator, "gradients", InvalidGradientError), context)))

    def Assign(self, request: bytes, context: grpc.ServicerContext) -> pb.AssignResponse:
        """Overwrite rows and reset their optimizer state; the last duplicate wins."""
        def assign() -> None:
            tables = wire.parse_values_request(request)
            unique_tables(tables, "Assign")
            self._assign({tv.table: (keys_of(tv), values_of(tv, "rows", InvalidRowsError)) for tv in tables}, context)
        return pb.AssignResponse(receipt=self._write("Assign", context, assign))

    def AssignStream(self, request_iterator: Iterator[pb.AssignRequest],
                     context: grpc.ServicerContext) -> pb.AssignResponse:
        """Assign for batches above the message limit: chunks collected, then assigned as one request."""
        return pb.AssignResponse(receipt=self._write(
            "AssignStream", context,
            lambda: self._assign(collect_chunks(request_iterator, "rows", InvalidRowsError), context)))

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        """Delete rows (and their expiry touches) from every tier and the store; per table, how many existed."""
        counts: dict[str, int] = {}

        def delete() -> None:
            unique_tables(request.tables, "Delete")
            keys = {tk.table: keys_of(tk) for tk in request.tables}
            known = self._cache.tables()
            for name in keys:  # every table checked before any row goes
                if name not in known:
                    raise UnknownTableError(f"unknown table {name!r}; tables: {sorted(known)}")
            with self._gate.writing(self._map_version(context), {n: k.numpy() for n, k in keys.items()}):
                for name, k in keys.items():
                    counts[name] = self._cache.delete(name, k)
        receipt = self._write("Delete", context, delete)
        return pb.DeleteResponse(receipt=receipt, tables=[pb.TableCount(table=n, rows=c) for n, c in counts.items()])

    # ------------------------------------------------------------------ passes
    def _routed(self, keysets: dict[str, Keyset], context: grpc.ServicerContext) -> dict[str, Keyset]:
        """``keysets``, once their routing is checked against the shard map (WrongShardError)."""
        self._gate.check_read(self._map_version(context), {n: ks.keys.numpy() for n, ks in keysets.items()})
        return keysets

    def _prefetch(self, keysets: dict[str, Keyset], wait: bool,
                  context: grpc.ServicerContext) -> Iterator[pb.PrefetchResponse]:
        fut = self._cache.prefetch(self._routed(keysets, context))
        yield pb.PrefetchResponse(done=False)
        if not wait:
            return
        finished = threading.Event()

        def on_end() -> None:  # the call ended before the staging did: the client gave up on it
            if not finished.is_set():
                fut.cancel()
        context.add_callback(on_end)
        result = fut.result()
        finished.set()
        yield pb.PrefetchResponse(done=True, tables=codec.prefetch_results(result))

    def Prefetch(self, request: pb.PrefetchRequest, context: grpc.ServicerContext) -> Iterator[pb.PrefetchResponse]:
        """Start staging; with ``wait``, a second message when done (cancelling the call stops the staging)."""
        def stream() -> Iterator[pb.PrefetchResponse]:
            yield from self._prefetch(keysets_of(request.keysets, "Prefetch"), request.wait, context)
        yield from self._run_stream("Prefetch", context, stream())

    def PrefetchStream(self, request_iterator: Iterator[pb.PrefetchRequest],
                       context: grpc.ServicerContext) -> Iterator[pb.PrefetchResponse]:
        """Prefetch for keysets above the message limit: the chunks are merged, then staged as one prefetch."""
        def stream() -> Iterator[pb.PrefetchResponse]:
            keysets, first = collect_keysets(request_iterator, "PrefetchStream")
            yield from self._prefetch(keysets, first.wait, context)
        yield from self._run_stream("PrefetchStream", context, stream())

    def _begin_pass(self, keysets: dict[str, Keyset], context: grpc.ServicerContext) -> pb.BeginPassResponse:
        report = self._cache.begin_pass(self._routed(keysets, context))
        return pb.BeginPassResponse(tables=[pb.PassTableReport(table=n, keyset_rows=r["keyset_rows"],
                                                               pinned_rows=r["pinned_rows"])
                                            for n, r in report.items()], incarnation=self._incarnation)

    def BeginPass(self, request: pb.BeginPassRequest, context: grpc.ServicerContext) -> pb.BeginPassResponse:
        """Make a pass's keyset resident and pin it."""
        return self._run("BeginPass", context,
                         lambda: self._begin_pass(keysets_of(request.keysets, "BeginPass"), context))

    def BeginPassStream(self, request_iterator: Iterator[pb.BeginPassRequest],
                        context: grpc.ServicerContext) -> pb.BeginPassResponse:
        """BeginPass for keysets above the message limit: the chunks are merged, then begun as one pass."""
        return self._run("BeginPassStream", context,
                         lambda: self._begin_pass(collect_keysets(request_iterator, "BeginPassStream")[0], context))

    # ------------------------------------------------------------------ batch leases
    def PrefetchBatch(self, request: pb.PrefetchBatchRequest,
                      context: grpc.ServicerContext) -> pb.PrefetchBatchResponse:
        """Stage one batch's rows under a lease with a time-to-live (see :mod:`embcache.server.leases`)."""
        def lease() -> pb.PrefetchBatchResponse:
            lease_id, ttl = self.leases.open(self._routed(keysets_of(request.keysets, "PrefetchBatch"), context),
                                             request.ttl_seconds)
            return pb.PrefetchBatchResponse(lease_id=lease_id, ttl_seconds=ttl, incarnation=self._incarnation)
        return self._run("PrefetchBatch", context, lease)

    def PrefetchBatchStream(self, request_iterator: Iterator[pb.PrefetchBatchRequest],
                            context: grpc.ServicerContext) -> pb.PrefetchBatchResponse:
        """PrefetchBatch for keysets above the message limit: the chunks are merged into one lease."""
        def lease() -> pb.PrefetchBatchResponse:
            keysets, first = collect_keysets(request_iterator, "PrefetchBatchStream")
            lease_id, ttl = self.leases.open(self._routed(keysets, context), first.ttl_seconds)
            return pb.PrefetchBatchResponse(lease_id=lease_id, ttl_seconds=ttl, incarnation=self._incarnation)
        return self._run("PrefetchBatchStream", context, lease)

    def RenewLeases(self, request: pb.RenewLeasesRequest, context: grpc.ServicerContext) -> pb.RenewLeasesResponse:
        """Extend leases by their TTL and report their states (optionally waiting for staging to end)."""
        return self._run("RenewLeases", context, lambda: pb.RenewLeasesResponse(
            leases=self.leases.renew(list(request.lease_ids), request.wait_seconds), incarnation=self._incarnation))

    def ReleaseLeases(self, request: pb.ReleaseLeasesRequest,
                      context: grpc.ServicerContext) -> pb.ReleaseLeasesResponse:
        """Unpin leases (and with ``cancel`` stop their staging); their states after it."""
        return self._run("ReleaseLeases", context, lambda: pb.ReleaseLeasesResponse(
            leases=self.leases.release(list(request.lease_ids), request.cancel)))

    def EndPass(self, request: pb.EndPassRequest, context: grpc.ServicerContext) -> Iterator[pb.EndPassResponse]:
        """Unpin the pass; with ``wait``, a second message when the write-back is done."""
        def stream() -> Iterator[pb.EndPassResponse]:
            fut = self._cache.end_pass()
            yield pb.EndPassResponse(done=False, incarnation=self._incarnation)
            if request.wait:
                yield pb.EndPassResponse(done=True, written_rows=int(fut.result()), incarnation=self._incarnation)
        yield from self._run_stream("EndPass", context, stream())

    # ------------------------------------------------------------------ durability and inspection
    def _durable(self, incarnations: Sequence[int]) -> list[pb.DurableThrough]:
        return [pb.DurableThrough(incarnation=d.incarnation, durable_seq=d.seq, known=d.known)
                for d in self._ledger.answer(incarnations)]

    def Flush(self, request: pb.FlushRequest, context: grpc.ServicerContext) -> pb.FlushResponse:
        """Make every acknowledged update durable; say what is durable of each asked incarnation."""
        self._run("Flush", context, self._durability.flush)
        return pb.FlushResponse(incarnation=self._incarnation, durable=self._durable(request.incarnations))

    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointResponse:
        """Write a consistent snapshot under the checkpoint root."""
        t0 = time.perf_counter()
        directory = os.path.realpath(os.path.join(self._checkpoint_root, request.directory or ""))
        if (not request.directory or directory == self._checkpoint_root
                or os.path.commonpath([directory, self._checkpoint_root]) != self._checkpoint_root):
            self._observe("Checkpoint", "PERMISSION_DENIED", time.perf_counter() - t0)
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"checkpoint directory {request.directory!r} is not inside the server's checkpoint root "
                          f"{self._checkpoint_root!r}; pass a relative name")
        self._run("Checkpoint", context, lambda: self._durability.checkpoint(directory))
        return pb.CheckpointResponse(directory=directory, incarnation=self._incarnation,
                                     durable=self._durable(request.incarnations))

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        """``EmbeddingCache.stats()`` as JSON."""
        def stats() -> pb.StatsResponse:
            report = self._cache.stats()
            if self._serving is not None:  # serving mode: the version served, in each table's entry
                served = self._serving.report()
                for entry in report.values():
                    entry["serving"] = served
            return pb.StatsResponse(json=json.dumps(report))
        return self._run("Stats", context, stats)

    def ResidentKeys(self, request: pb.ResidentKeysRequest,
                     context: grpc.ServicerContext) -> Iterator[pb.ResidentKeysResponse]:
        """The keys resident in one tier, in chunks below the send limit (one empty chunk for none)."""
        def stream() -> Iterator[pb.ResidentKeysResponse]:
            keys = self._cache.resident_keys(request.table, request.tier).numpy()
            per = wire.payload_budget(self._info.max_send_message_bytes or (64 << 20)) // 8
            for start in range(0, max(keys.size, 1), per):
                yield pb.ResidentKeysResponse(keys=codec.encode_tensor(keys[start:start + per]))
        yield from self._run_stream("ResidentKeys", context, stream())

    # ------------------------------------------------------------------ resharding
    def _map_state(self, ledger: bool = False) -> pb.ShardMapState:
        current, pending, name, frozen = self._gate.state()
        return pb.ShardMapState(current=current, pending=pending, name=name, frozen=frozen,
                                ledger=self._ledger.records() if ledger else "")

    def GetShardMap(self, request: pb.GetShardMapRequest, context: grpc.ServicerContext) -> pb.ShardMapState:
        """The shard map in force, the pending one and this server's name."""
        return self._run("GetShardMap", context, self._map_state)

    def SetShardMap(self, request: pb.SetShardMapRequest, context: grpc.ServicerContext) -> pb.ShardMapState:
        """Install the fleet's map and begin a migration to the pending one (idempotent).

        Freezing also flushes and hands back this server's write ledger, for the shards that keep
        its rows to answer for the writes it acknowledged once it has left the fleet.
        """
        def set_map() -> pb.ShardMapState:
            self._gate.set_map(request.name, request.current, request.pending, request.freeze)
            if request.freeze:
                self._durability.flush()
            return self._map_state(ledger=request.freeze)
        return self._run("SetShardMap", context, set_map)

    def ExportRows(self, request: pb.ExportRowsRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.ExportRowsResponse]:
        """The rows of a table that leave this shard under the pending map, whole, grouped by new owner."""
        def stream() -> Iterator[pb.ExportRowsResponse]:
            for to, keys, records, freq in self._gate.export(request.table, request.pending_version,
                                                             int(request.batch_rows), request.written_only):
                yield pb.ExportRowsResponse(to=to, keys=codec.encode_tensor(keys), records=records.tobytes(),
                                            freq=codec.encode_tensor(freq))
        yield from self._run_stream("ExportRows", context, stream())

    def ImportRows(self, request: pb.ImportRowsRequest, context: grpc.ServicerContext) -> pb.ImportRowsResponse:
        """Take rows that move to this shard under the pending map."""
        def take() -> pb.ImportRowsResponse:
            keys = keys_of(request).numpy()
            freq = codec.decode_tensor(request.freq, "freq", InvalidRowsError, codec.FLOAT_DTYPES, 1,
                                       request.HasField("freq"))
            self._cache.row_bytes(request.table)  # UnknownTableError for a table this server does not have
            cfg = self._cache.tables()[request.table]
            width = record_bytes(cfg.dim, cfg.torch_dtype, state_width(cfg.optimizer, cfg.dim))
            if len(request.records) != keys.shape[0] * width:
                raise InvalidRowsError(f"ImportRows: {len(request.records)} record bytes for {keys.shape[0]} rows of "
                                       f"{width} bytes; nothing was imported")
            records = np.frombuffer(request.records, dtype=np.uint8).reshape(keys.shape[0], width)
            return pb.ImportRowsResponse(rows=self._gate.import_rows(request.table, request.pending_version, keys,
                                                                     records, freq))
        return self._run("ImportRows", context, take)

    def CommitShardMap(self, request: pb.CommitShardMapRequest,
                       context: grpc.ServicerContext) -> pb.CommitShardMapResponse:
        """Adopt the pending map and delete the rows that left this shard (idempotent)."""
        def commit() -> pb.CommitShardMapResponse:
            if request.ledger:
                try:
                    self._ledger.adopt(request.ledger)
                except ValueError as exc:
                    raise ConfigError(f"CommitShardMap: {exc}") from None
            deleted = self._gate.commit(request.version)
            return pb.CommitShardMapResponse(state=self._map_state(), deleted_rows=deleted)
        return self._run("CommitShardMap", context, commit)

    # ------------------------------------------------------------------ delta export
    def ExportDelta(self, request: pb.ExportDeltaRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.ExportDeltaResponse]:
        """Begin a delta (or full) export of this shard and stream its rows (see ``embcache.server.exports``)."""
        yield from self._run_stream("ExportDelta", context, self._exports.stream(request))

    def CommitExport(self, request: pb.CommitExportRequest,
                     context: grpc.ServicerContext) -> pb.CommitExportResponse:
        """Drop the change marks of an export whose version the client has written."""
        return self._run("CommitExport", context,
                         lambda: pb.CommitExportResponse(dropped_marks=self._exports.commit(request)))
