"""The gRPC servicer: a thin adapter from ``embcache.rpc.v1`` to :class:`~embcache.EmbeddingCache`.

Each method decodes its request (:mod:`embcache.rpc.codec`), calls the library and encodes the
reply; every rule about keys, rows, tables and passes lives in the library. Typed errors become
status codes through the one table in :mod:`embcache.rpc.errors`, with the type's name in the
trailing metadata. Latency is recorded per method and status code.

Concurrency: gRPC runs each call on a worker thread; the cache serializes operations per table
(one lock each) and releases the GIL in its heavy parts, so calls on different tables, and the
encoding and decoding of different calls, run in parallel. A write request is applied with one
library call, so it is atomic per table. Batch leases (PrefetchBatch) are held in a
:class:`~embcache.server.leases.LeaseTable`, without a thread per lease.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
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
    StoreError,
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
    StreamCancelledError,
    status_of,
)
from ..rpc.v1 import embcache_pb2 as pb
from ..rpc.v1 import embcache_pb2_grpc as pb_grpc
from .leases import LeaseTable
from .ledger import WriteLedger
from .overload import StreamWatchdog, on_pool
from .sharding import ShardGate

__all__ = ["READ_METHODS", "ROLES", "SERVICE_NAME", "WRITE_METHODS", "Durability", "EmbeddingCacheServicer",
           "add_to_server", "roles_text"]

log = logging.getLogger("embcache.server")
R = TypeVar("R")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].full_name
# The hot calls skip the generated classes: requests arrive as bytes (parsed by embcache.rpc.wire
# into views of those bytes) and the Lookup reply leaves as bytes joined once from the rows' memory.
_RAW_REQUESTS = frozenset({"Lookup", "ApplyGradients", "Assign"})
_RAW_RESPONSES = frozenset({"Lookup"})
#: Keys a Lookup hands the cache per call: a larger request is looked up in chunks of this many
#: (same rows; the cache's working memory stays that of one chunk).
LOOKUP_CHUNK_KEYS = 1 << 16
_REPLY_ENTRY_BYTES = 256  # a Lookup reply's bytes per table besides its rows and name (headers, padding), at most
_CANCEL_GRACE_SECONDS = 0.01  # how long a request stream's end waits to learn that it was a cancellation
_NAME_MAX, _PATH_MAX = 255, 4096  # Linux's limits on a file name and a path, in bytes

#: The one table of token roles: every method of the service -> the role a bearer token needs to
#: call it. "read": any token, read-only ones too (the call changes no row, table, pass, pin or
#: file); "write": read-write tokens only. The server's token check, ``embcache-server --help``,
#: the README's table (between its ``roles`` markers) and the tests all come from this table.
#: ResidentKeys is a read: it lists keys and changes nothing. The resharding calls (GetShardMap
#: ... CommitShardMap) are writes: only the operator's reshard makes them.
ROLES: dict[str, str] = {
    "ListTables": "read", "Lookup": "read", "Stats": "read", "ResidentKeys": "read",
    "CreateTable": "write", "ApplyGradients": "write", "ApplyGradientsStream": "write", "Assign": "write",
    "AssignStream": "write", "Prefetch": "write", "PrefetchStream": "write", "BeginPass": "write",
    "BeginPassStream": "write", "EndPass": "write", "PrefetchBatch": "write", "PrefetchBatchStream": "write",
    "RenewLeases": "write", "ReleaseLeases": "write", "Flush": "write", "Checkpoint": "write",
    "GetShardMap": "write", "SetShardMap": "write", "ExportRows": "write", "ImportRows": "write",
    "CommitShardMap": "write",
}
_SERVICE_METHODS = {m.name for m in pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].methods}
if set(ROLES) != _SERVICE_METHODS or set(ROLES.values()) != {"read", "write"}:  # a new method needs its role
    raise ImportError(f"ROLES must give every method 'read' or 'write': {sorted(set(ROLES) ^ _SERVICE_METHODS)}")
#: Methods that change rows, tables, passes, pins or files (role "write").
WRITE_METHODS = frozenset(m for m, role in ROLES.items() if role == "write")
#: Methods a read-only token may call (role "read").
READ_METHODS = frozenset(m for m, role in ROLES.items() if role == "read")


def roles_text(markdown: bool = False) -> str:
    """The token roles of :data:`ROLES` in words: for ``--help``, or as the README's Markdown table."""
    rows = [("read", "any token (read-only ones too)", sorted(READ_METHODS)),
            ("write", "read-write tokens only", sorted(WRITE_METHODS))]
    if markdown:
        return "\n".join(["| role | who may call | methods |", "| --- | --- | --- |",
                          *(f"| {role} | {who} | {', '.join(methods)} |" for role, who, methods in rows)])
    lines = ["Token roles (which bearer token may call which method; embcache.server.servicer.ROLES):"]
    for role, who, methods in rows:
        lines.append(f"  {role} - {who}:")
        text, width = "", 96
        for m in methods:
            if text and len(text) + len(m) + 2 > width:
                lines.append(f"    {text},")
                text = ""
            text = f"{text}, {m}" if text else m
        lines.append(f"    {text}")
    return "\n".join(lines)


class Durability:
    """When acknowledged writes are flushed to the store (see ``embcache-server --help``).

    Every flush goes through the ledger, which records what it made durable (see
    :mod:`embcache.server.ledger`).

    Args:
        cache: the cache to flush.
        ledger: the server's write ledger.
        every_updates: flush in the write request that completes every N-th write request,
            before acknowledging it (0 = off).
        interval_seconds: flush from a background thread every S seconds when something was
            written (0 = off).
        sync: flush in every write request before acknowledging it.
    """

    def __init__(self, cache: EmbeddingCache, ledger: WriteLedger, every_updates: int = 0,
                 interval_seconds: float = 0.0, sync: bool = False) -> None:
        if every_updates < 0 or interval_seconds < 0:
            raise ValueError("flush_every_updates and flush_interval_seconds must be >= 0")
        self._cache = cache
        self.ledger = ledger
        self._every = every_updates
        self._interval = interval_seconds
        self._sync = sync
        self._lock = threading.Lock()
        self._count = 0
        self._dirty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_seconds > 0 and not sync:
            self._thread = threading.Thread(target=self._loop, name="embcache-flush", daemon=True)
            self._thread.start()

    def describe(self) -> str:
        """The mode in words (sent to clients in ServerInfo)."""
        if self._sync:
            return "sync: every write is flushed before it is acknowledged"
        parts = []
        if self._every:
            parts.append(f"flush every {self._every} write requests")
        if self._interval:
            parts.append(f"flush every {self._interval:g} s")
        return ", ".join(parts) or "flush on request (Flush, Checkpoint) and at shutdown"

    def after_write(self) -> None:
        """Account for one applied write request; flush now if the mode says so.

        Raises:
            StoreError: the flush failed (the write is applied in memory, not yet durable).
        """
        if self._sync:
            self.flush()
            return
        due = False
        with self._lock:
            self._dirty = True
            if self._every:
                self._count += 1
                if self._count >= self._every:
                    self._count, due = 0, True
        if due:
            self.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                dirty, self._dirty = self._dirty, False
            if not dirty:
                continue
            try:
                self.flush()
            except CacheClosedError:
                return
            except EmbcacheError as exc:  # the rows stay dirty in memory; the next round retries
                log.warning("periodic flush failed: %s", exc)
                with self._lock:
                    self._dirty = True

    def flush(self) -> None:
        """Flush the cache and record, in the ledger, the writes that made durable.

        Raises:
            CacheClosedError, StoreError: the flush failed (nothing is recorded).
        """
        self._flush_recorded(self._cache.flush)

    def _flush_recorded(self, fn: Callable[[], None]) -> None:
        try:
            self.ledger.flush(fn)
        except EmbcacheError:  # the flush's own (CheckpointExistsError is an OSError too)
            raise
        except OSError as exc:  # the rows are durable; the record of it is not (a full disk)
            raise StoreError(f"the flush succeeded but its record could not be written: {exc}") from exc

    def checkpoint(self, directory: str) -> None:
        """Checkpoint the cache (which flushes first) and record the flush in the ledger.

        Raises:
            CheckpointExistsError, CacheClosedError, StoreError.
        """
        self._flush_recorded(lambda: self._cache.checkpoint(directory))

    def stop(self) -> None:
        """Stop the periodic flusher (the shutdown's own flush follows)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _unique_tables(items: Iterable[Any], what: str) -> None:
    names = [i.table for i in items]
    if len(set(names)) != len(names):
        raise InvalidKeysError(f"{what}: a table appears more than once in one request: {names}")


def _values(tv: pb.TableValues | wire.TableKeysView, what: str, error: type[EmbcacheError]) -> torch.Tensor:
    return torch.from_numpy(codec.decode_tensor(tv.values, f"{what} of table {tv.table!r}", error,
                                                codec.FLOAT_DTYPES, 2, tv.HasField("values")))


def _keys(item: Any) -> torch.Tensor:
    return codec.decode_keys(item.keys, f"keys of table {item.table!r}", item.HasField("keys"))


def _collect(requests: Iterable[Any], what: str,
             error: type[EmbcacheError]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate the chunks of a write stream per table (in arrival order)."""
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for req in requests:
        _unique_tables(req.tables, f"{what} chunk")
        for tv in req.tables:
            keys, values = _keys(tv), _values(tv, what, error)
            ks, vs = parts.setdefault(tv.table, ([], []))
            if vs and values.shape[1:] != vs[0].shape[1:]:
                raise error(f"{what} of table {tv.table!r}: chunks have different widths "
                            f"({vs[0].shape[1]} and {values.shape[1]})")
            ks.append(keys.numpy())
            vs.append(values.numpy())
    out = {}
    for name, (ks, vs) in parts.items():
        dtype = np.result_type(*vs)
        out[name] = (torch.from_numpy(np.concatenate(ks)), torch.from_numpy(np.concatenate(vs).astype(dtype)))
    return out


def _keysets(items: Sequence[pb.TableKeyset], what: str) -> dict[str, Keyset]:
    _unique_tables(items, what)
    return {k.table: codec.decode_keyset(k) for k in items}


def _collect_keysets(requests: Iterable[Any], what: str) -> tuple[dict[str, Keyset], Any]:
    """Merge the keysets of a keyset stream's chunks per table; returns them and the first chunk (its options).

    Raises:
        InvalidKeysError: a malformed chunk, or a stream without any.
    """
    parts: dict[str, list[Keyset]] = {}
    first = None
    for req in requests:
        first = req if first is None else first
        for name, keyset in _keysets(req.keysets, f"{what} chunk").items():
            parts.setdefault(name, []).append(keyset)
    if first is None:
        raise InvalidKeysError(f"{what}: the stream held no request")
    return {name: codec.merge_keysets(ks) for name, ks in parts.items()}, first


class EmbeddingCacheServicer(pb_grpc.EmbeddingCacheServiceServicer):
    """Serves one :class:`~embcache.EmbeddingCache` over ``embcache.rpc.v1.EmbeddingCacheService``.

    Args:
        cache: the cache (owned by the caller, who closes it after the server stopped).
        durability: the flush policy applied after writes.
        server_info: limits and settings reported by ListTables.
        observe: ``observe(method, code_name, seconds)`` records a call's latency (e.g. a Prometheus histogram).
        checkpoint_root: directory under which Checkpoint may write.
    """

    def __init__(self, cache: EmbeddingCache, durability: Durability, server_info: pb.ServerInfo,
                 observe: Callable[[str, str, float], None], checkpoint_root: str,
                 leases: LeaseTable | None = None, gate: ShardGate | None = None,
                 watchdog: StreamWatchdog | None = None) -> None:
        self._cache = cache
        self._gate = gate if gate is not None else ShardGate(cache.config.path, cache)
        self._durability = durability
        self._info = server_info
        self._observe = observe
        self._checkpoint_root = os.path.realpath(checkpoint_root)
        self._stopping = threading.Event()
        self._ledger = durability.ledger
        self._incarnation = durability.ledger.incarnation
        self._incarnation_hex = f"{self._incarnation:016x}"
        self._watchdog = watchdog
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
            yield from gen
        except CancelledError:  # the client went away and its staging was cancelled
            self._observe(method, "CANCELLED", time.perf_counter() - t0)
            return
        except GeneratorExit:  # the call ended (the client cancelled it or went away) before the stream did
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
            _unique_tables(tables, "Lookup")
            keys = {tk.table: _keys(tk) for tk in tables}
            self._gate.check_read(self._map_version(context), {n: k.numpy() for n, k in keys.items()})
            known = self._cache.tables()
            self._check_reply_size(keys, known)
            if any(name not in known for name in keys):  # the library raises UnknownTableError, having read nothing
                rows = self._cache.lookup_many(keys)  # (or the table was created meanwhile)
                return wire.encode_lookup_response([(n, r.cpu().numpy()) for n, r in rows.items()])
            reply, views = wire.new_lookup_response([(n, k.numel(), known[n].dim) for n, k in keys.items()])
            on_cpu = self._cache.device.type == "cpu"
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
            _unique_tables(tables, "ApplyGradients")
            self._apply({tv.table: (_keys(tv), _values(tv, "gradients", InvalidGradientError)) for tv in tables},
                        context)
        return pb.ApplyGradientsResponse(receipt=self._write("ApplyGradients", context, apply))

    def ApplyGradientsStream(self, request_iterator: Iterator[pb.ApplyGradientsRequest],
                             context: grpc.ServicerContext) -> pb.ApplyGradientsResponse:
        """ApplyGradients for batches above the message limit: chunks collected, then applied as one request."""
        return pb.ApplyGradientsResponse(receipt=self._write(
            "ApplyGradientsStream", context,
            lambda: self._apply(_collect(request_iterator, "gradients", InvalidGradientError), context)))

    def Assign(self, request: bytes, context: grpc.ServicerContext) -> pb.AssignResponse:
        """Overwrite rows and reset their optimizer state; the last duplicate wins."""
        def assign() -> None:
            tables = wire.parse_values_request(request)
            _unique_tables(tables, "Assign")
            self._assign({tv.table: (_keys(tv), _values(tv, "rows", InvalidRowsError)) for tv in tables}, context)
        return pb.AssignResponse(receipt=self._write("Assign", context, assign))

    def AssignStream(self, request_iterator: Iterator[pb.AssignRequest],
                     context: grpc.ServicerContext) -> pb.AssignResponse:
        """Assign for batches above the message limit: chunks collected, then assigned as one request."""
        return pb.AssignResponse(receipt=self._write(
            "AssignStream", context,
            lambda: self._assign(_collect(request_iterator, "rows", InvalidRowsError), context)))

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
            yield from self._prefetch(_keysets(request.keysets, "Prefetch"), request.wait, context)
        yield from self._run_stream("Prefetch", context, stream())

    def PrefetchStream(self, request_iterator: Iterator[pb.PrefetchRequest],
                       context: grpc.ServicerContext) -> Iterator[pb.PrefetchResponse]:
        """Prefetch for keysets above the message limit: the chunks are merged, then staged as one prefetch."""
        def stream() -> Iterator[pb.PrefetchResponse]:
            keysets, first = _collect_keysets(request_iterator, "PrefetchStream")
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
                         lambda: self._begin_pass(_keysets(request.keysets, "BeginPass"), context))

    def BeginPassStream(self, request_iterator: Iterator[pb.BeginPassRequest],
                        context: grpc.ServicerContext) -> pb.BeginPassResponse:
        """BeginPass for keysets above the message limit: the chunks are merged, then begun as one pass."""
        return self._run("BeginPassStream", context,
                         lambda: self._begin_pass(_collect_keysets(request_iterator, "BeginPassStream")[0], context))

    # ------------------------------------------------------------------ batch leases
    def PrefetchBatch(self, request: pb.PrefetchBatchRequest,
                      context: grpc.ServicerContext) -> pb.PrefetchBatchResponse:
        """Stage one batch's rows under a lease with a time-to-live (see :mod:`embcache.server.leases`)."""
        def lease() -> pb.PrefetchBatchResponse:
            lease_id, ttl = self.leases.open(self._routed(_keysets(request.keysets, "PrefetchBatch"), context),
                                             request.ttl_seconds)
            return pb.PrefetchBatchResponse(lease_id=lease_id, ttl_seconds=ttl, incarnation=self._incarnation)
        return self._run("PrefetchBatch", context, lease)

    def PrefetchBatchStream(self, request_iterator: Iterator[pb.PrefetchBatchRequest],
                            context: grpc.ServicerContext) -> pb.PrefetchBatchResponse:
        """PrefetchBatch for keysets above the message limit: the chunks are merged into one lease."""
        def lease() -> pb.PrefetchBatchResponse:
            keysets, first = _collect_keysets(request_iterator, "PrefetchBatchStream")
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
        return self._run("Stats", context, lambda: pb.StatsResponse(json=json.dumps(self._cache.stats())))

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
            keys = _keys(request).numpy()
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


def _identity(data: bytes) -> bytes:
    return data


class _Malformed:
    """What a request deserializer hands the handler for bytes that are no valid request (it never raises).

    gRPC answers a deserializer's exception with INTERNAL ("Exception deserializing request!")
    and no metadata; the handler refuses this with INVALID_ARGUMENT and the error type instead.
    """

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _parser(request_type: Any) -> Callable[[bytes], Any]:
    """``request_type.FromString`` that returns a :class:`_Malformed` instead of raising."""
    name = request_type.DESCRIPTOR.name

    def parse(data: bytes) -> Any:
        try:
            request = request_type.FromString(data)
        except Exception as exc:  # DecodeError, or whatever else the parser raises on garbage
            return _Malformed(f"malformed {name}: {exc or 'not a valid protobuf message'}")
        problem = _checkpoint_problem(request.directory) if name == "CheckpointRequest" else None
        return _Malformed(f"malformed {name}: {problem}") if problem else request
    return parse


def _checkpoint_problem(directory: str) -> str | None:
    """Why ``directory`` can be no path on this system (the OS would refuse it with an OSError), or None."""
    if "\0" in directory:
        return "the directory name holds a NUL character"
    if len(directory.encode()) >= _PATH_MAX or any(len(p.encode()) > _NAME_MAX for p in directory.split("/")):
        return f"the directory name is longer than a path ({_PATH_MAX} bytes) or a name in it ({_NAME_MAX}) may be"
    return None


def _checked(requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Iterator[Any]:
    """A request stream whose malformed message raises InvalidKeysError where the handler reads it,
    and whose end raises StreamCancelledError when the client cancelled it instead of closing it.

    gRPC ends the requests of a call the client cancelled (or whose deadline passed) mid-stream
    just as if the client had sent its last chunk, and learns of the cancellation a moment later:
    a handler that took that for the end applied the chunks it had (half of the cancelled streams
    in a test). So the end waits up to ``_CANCEL_GRACE_SECONDS`` for the call to turn inactive.
    """
    ended = threading.Event()
    context.add_callback(ended.set)  # runs when the call terminates (cancelled, or finished)
    for request in requests:
        if isinstance(request, _Malformed):
            raise InvalidKeysError(request.message)
        yield request
    ended.wait(_CANCEL_GRACE_SECONDS)
    if not context.is_active():
        raise StreamCancelledError(f"{method}: the client cancelled the stream (or its deadline passed) before "
                                   "it ended; nothing of it was applied")


def _guarded(servicer: EmbeddingCacheServicer, name: str, streaming: bool) -> Callable[[Any, Any], Any]:
    """The servicer's method ``name``, refusing a malformed request with INVALID_ARGUMENT before it runs
    (and with a request stream, cut when it idles: see :class:`~embcache.server.overload.StreamWatchdog`)."""
    method = getattr(servicer, name)
    if streaming:
        return lambda requests, context: method(_checked(servicer.watch(requests, context, name), context, name),
                                                context)

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            servicer.refuse_malformed(name, context, request.message)
        return method(request, context)
    return unary


def add_to_server(servicer: EmbeddingCacheServicer, server: grpc.Server,
                  stream_pool: ThreadPoolExecutor | None = None) -> None:
    """Register the servicer, with bytes in and out for the hot calls (the generated helper would parse them).

    Every request deserializer returns instead of raising: bytes that are no valid request get
    INVALID_ARGUMENT (InvalidKeysError, "malformed ..."), never gRPC's own INTERNAL. With
    ``stream_pool``, the calls that stream (either way) run on it, not on the server's pool.
    """
    handlers = {}
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    for method in pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"].methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        behavior = _guarded(servicer, method.name, method.client_streaming)
        if stream_pool is not None and (method.client_streaming or method.server_streaming):
            behavior = on_pool(behavior, stream_pool)
        handlers[method.name] = make[(method.client_streaming, method.server_streaming)](
            behavior,
            request_deserializer=_identity if method.name in _RAW_REQUESTS else _parser(request_type),
            response_serializer=_identity if method.name in _RAW_RESPONSES else response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
