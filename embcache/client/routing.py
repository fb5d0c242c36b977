"""Keyed batches over the shards: split by owner into parts, cut under the message limit, replies filled back.

A call on keys (``lookup_many``, ``apply_gradients_many``, ``assign_many``) becomes one
request per shard carrying every table (:func:`parts_by_shard`); a shard's part above the
message limit is cut into chunks (:func:`chunks`): several Lookup requests, or one client
stream for a write (applied by the server as one request). :func:`send` runs the requests and
sends again, by the newest shard map, the keys a shard refused as routed by another map (or
held back while a reshard moved them). Lookup replies are copied back to the caller's positions
(:func:`fill`). Keysets (passes, prefetches, leases) go the same way, one call per shard
(:func:`keyset_calls`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
import numpy as np
import torch
from google.protobuf.message import Message

from ..errors import InvalidRowsError
from ..keyset import Keyset, as_keysets
from ..receipts import Receipts
from ..ring import ShardMap
from ..rpc import codec, wire
from ..rpc.errors import RemoteError, error_from_rpc
from ..rpc.v1 import embcache_pb2 as pb
from .transport import MAX_REROUTES, migrating, wrong_shard

if TYPE_CHECKING:
    from .transport import Call, Reply, Shard, Topology, Transport

__all__ = ["Batch", "Part", "chunks", "fill", "keyset_calls", "lookup", "parts_by_shard", "send", "write"]

#: ``{table: (keys int64 [n], values [n, ...] or None)}``, as numpy arrays.
Batch: TypeAlias = Mapping[str, tuple[np.ndarray, "np.ndarray | None"]]
#: ``done(calls, layouts, replies)``: the calls that succeeded, the parts each carried, their replies.
Done: TypeAlias = Callable[["list[Call]", "list[list[Part]]", "list[Reply]"], None]

_KEYSET_ROW_BYTES = 16  # a keyset key on the wire: the key and its count (int64 each)


def _row_bytes(dim: int) -> int:
    """A row on the wire: its int64 key and ``dim`` float32 values."""
    return 4 * dim + 8


@dataclass
class Part:
    """One table's slice in one request: keys (and values) at ``positions`` of the caller's batch."""

    table: str
    positions: np.ndarray | None  # positions in the caller's batch; None: the whole batch, in order
    keys: np.ndarray
    values: np.ndarray | None


def _absolute(part: Part, subset: np.ndarray | None) -> Part:
    """``part`` of a sub-batch (the caller's positions ``subset``) with positions in the caller's batch."""
    if subset is None:
        return part
    return Part(part.table, subset if part.positions is None else subset[part.positions], part.keys, part.values)


def _take(keys_values: tuple[np.ndarray, np.ndarray | None],
          positions: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Keys (and values) at ``positions`` (None: all)."""
    keys, values = keys_values
    if positions is None:
        return keys, values
    return keys[positions], None if values is None else values[positions]


def parts_by_shard(batch: Batch, topo: Topology, every_table: bool = False) -> list[list[Part]]:
    """Split each table's keys (and values) over the shards (positions ascending in each part).

    ``every_table``: each shard gets a part of every table, empty where it owns no key.
    """
    per_shard: list[list[Part]] = [[] for _ in topo.shards]
    for table, (keys, values) in batch.items():
        if len(topo.shards) == 1:
            per_shard[0].append(Part(table, None, keys, values))
            continue
        for i, pos in enumerate(topo.ring.split(keys)):
            if pos.size or every_table:
                per_shard[i].append(Part(table, pos, keys[pos], None if values is None else values[pos]))
    return per_shard


def chunks(parts: list[Part], row_bytes: Mapping[str, int], max_message: int) -> list[list[Part]]:
    """Group parts into requests of at most the message limit, cutting a table's part where needed."""
    budget = wire.payload_budget(max_message)
    out: list[list[Part]] = [[]]
    room = budget
    for part in parts:
        start, n, per_row = 0, part.keys.shape[0], row_bytes[part.table]
        while start < n:
            take = min(n - start, max(room // per_row, 0))
            if take == 0:
                out.append([])
                room = budget
                take = min(n - start, max(budget // per_row, 1))
            end = start + take
            whole = start == 0 and end == n
            out[-1].append(part if whole else Part(
                part.table, (part.positions if part.positions is not None else np.arange(n))[start:end],
                part.keys[start:end], None if part.values is None else part.values[start:end]))
            room -= take * per_row
            start = end
    return [c for c in out if c]


def send(transport: Transport, batch: Batch, row_bytes: Mapping[str, int], method: str, idempotent: bool,
         encode: Callable[[list[Part]], bytes | Message], stream: Callable[[list[Part]], Message] | None,
         done: Done) -> None:
    """Send a keyed batch to the shards that own its keys, routing again what a shard refused by its map.

    Each shard's part is cut into requests within the message limit: ``encode(chunk)`` makes a
    unary request; with ``stream``, a part of several chunks goes as one client stream of
    ``stream(chunk)`` messages (applied by the server as one request). ``done(calls, layouts,
    replies)`` gets the calls that succeeded, with the parts each carried (positions in the
    caller's batch). A shard that refuses a request because it serves another shard map
    (WrongShardError, nothing applied) hands its map back: the client adopts it and sends
    those keys again, to their owners under it (a shard behind the client's map is waited
    for). Other failures raise, after ``done`` saw what succeeded.

    Raises:
        The embcache error of the first call that failed for good; WrongShardError after
        ``MAX_REROUTES`` map changes in a row.
    """
    todo: dict[str, np.ndarray | None] = {t: None for t in batch}  # positions still to send (None: all)
    deadline = time.monotonic() + transport.timeout
    reroutes = waits = 0
    while True:
        topo = transport.topology
        sub = {t: _take(batch[t], pos) for t, pos in todo.items()}
        calls: list[Call] = []
        layouts: list[list[Part]] = []
        for shard, parts in zip(topo.shards, parts_by_shard(sub, topo), strict=True):
            parts = [_absolute(p, todo[p.table]) for p in parts if p.keys.size]
            cut = chunks(parts, row_bytes, transport.max_message)
            if stream is not None and len(cut) > 1:
                calls.append((shard, f"{method}Stream", [stream(c) for c in cut]))
                layouts.append([p for c in cut for p in c])
                continue
            for chunk in cut:
                calls.append((shard, method, encode(chunk)))
                layouts.append(chunk)
        if not calls:
            return
        outcomes = transport.fanout_outcomes(calls, idempotent, stop_on_failure=True)
        ok = [i for i, o in enumerate(outcomes) if not isinstance(o, grpc.RpcError)]
        done([calls[i] for i in ok], [layouts[i] for i in ok], [outcomes[i] for i in ok])
        # refused by its map, or held back by a migration: nothing applied, so sent again by the newest map
        again = [i for i, o in enumerate(outcomes) if wrong_shard(o) or (isinstance(o, grpc.RpcError)
                                                                          and migrating(o))]
        failed = [i for i, o in enumerate(outcomes) if isinstance(o, grpc.RpcError) and i not in again]
        failure = transport.failure([calls[i] for i in failed], [outcomes[i] for i in failed], idempotent)
        if failure is not None:
            raise failure from None
        if not again:
            return
        left: dict[str, list[np.ndarray]] = {}
        for i in again:
            for p in layouts[i]:
                pos = p.positions if p.positions is not None else np.arange(batch[p.table][0].shape[0])
                left.setdefault(p.table, []).append(pos)
        todo = {t: np.sort(np.concatenate(ps)) for t, ps in left.items()}
        maps = [ShardMap.from_json(m) for i in again if (m := wrong_shard(outcomes[i])) not in ("", "{}")]
        if maps and transport.adopt(max(maps, key=lambda m: m.version)):
            reroutes += 1
            if reroutes <= MAX_REROUTES:
                continue
        elif transport.sleep_backoff(min(waits, 6), deadline):  # a shard behind this map, or a migration: wait
            waits += 1
            continue
        i = again[0]
        raise error_from_rpc(outcomes[i], calls[i][0].address)


def lookup(transport: Transport, batch: Mapping[str, np.ndarray], dims: Mapping[str, int],
           outs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows of checked keys (``{table: int64 [n]}``), float32 [n, dim] per table, written into ``outs`` where given.

    Raises:
        InvalidRowsError: an ``out`` is not float32 [n, dim] on the CPU. The errors of :func:`send`.
    """
    filled: dict[str, torch.Tensor] = {}
    for t, k in batch.items():
        out = outs.get(t)
        if out is not None:
            n, dim = k.shape[0], dims[t]
            if out.shape != (n, dim) or out.dtype != torch.float32 or out.device.type != "cpu":
                raise InvalidRowsError(f"out must be float32 [{n}, {dim}] on cpu")
            filled[t] = out

    def copy(calls: list[Call], layouts: list[list[Part]], replies: list[Reply]) -> None:
        for reply, chunk, (shard, _, _) in zip(replies, layouts, calls, strict=True):
            fill(reply, chunk, shard, batch, dims, filled)

    send(transport, {t: (k, None) for t, k in batch.items()}, {t: _row_bytes(d) for t, d in dims.items()}, "Lookup",
         idempotent=True, encode=lambda chunk: wire.encode_lookup_request([(p.table, p.keys) for p in chunk]),
         stream=None, done=copy)
    return {t: filled[t] if t in filled else torch.empty(0, dims[t], dtype=torch.float32) for t in batch}


def fill(reply: bytes, chunk: list[Part], shard: Shard, batch: Mapping[str, np.ndarray], dims: Mapping[str, int],
         filled: dict[str, torch.Tensor]) -> None:
    """Copy one Lookup reply's rows into the output tensors (the whole batch's reply becomes the output)."""
    tables = wire.parse_lookup_response(reply)
    if len(tables) != len(chunk):
        raise RemoteError(f"server {shard.address} answered {len(tables)} tables for {len(chunk)}")
    for part, rows_msg in zip(chunk, tables, strict=True):
        rows = codec.decode_tensor(rows_msg.rows, f"rows of table {part.table!r} from {shard.address}",
                                   InvalidRowsError, ("float32",), 2)
        n, dim = batch[part.table].shape[0], dims[part.table]
        if rows.shape != (part.keys.shape[0], dim):
            raise RemoteError(f"server {shard.address} sent rows {rows.shape} for "
                              f"{part.keys.shape[0]} keys of dim {dim}")
        out = filled.get(part.table)
        if out is None and part.positions is None:  # the whole batch in one reply: its rows, in place
            filled[part.table] = wire.as_tensor(reply, rows)
            continue
        if out is None:
            out = filled[part.table] = torch.empty(n, dim, dtype=torch.float32)
        if part.positions is None:
            out.numpy()[:] = rows
        else:
            out.numpy()[part.positions] = rows


def write(transport: Transport, receipts: Receipts, method: str, batch: Mapping[str, tuple[np.ndarray, np.ndarray]],
          request_type: type[pb.ApplyGradientsRequest] | type[pb.AssignRequest]) -> None:
    """Send checked writes (``{table: (keys [n], float32 values [n, dim])}``) by ``method``; keep each applied
    request's receipt.

    Raises:
        The errors of :func:`send` (a shard's part may be applied while another's failed).
    """
    def keep(calls: list[Call], layouts: list[list[Part]], replies: list[Reply]) -> None:
        for (shard, _, _), reply in zip(calls, replies, strict=True):  # applied there: keep the receipt
            receipts.add(shard.name, reply.receipt.incarnation, reply.receipt.seq)

    def values(p: Part) -> np.ndarray:
        assert p.values is not None  # a write's parts carry its values
        return p.values

    send(transport, batch, {t: _row_bytes(v.shape[1]) for t, (_, v) in batch.items()}, method, idempotent=False,
         encode=lambda chunk: wire.encode_values_request([(p.table, p.keys, values(p)) for p in chunk]),
         stream=lambda chunk: request_type(tables=[
             pb.TableValues(table=p.table, keys=codec.encode_tensor(p.keys), values=codec.encode_tensor(values(p)))
             for p in chunk]),
         done=keep)


def delete(transport: Transport, receipts: Receipts, batch: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Delete the rows of checked, unique keys (``{table: int64 [n]}``) on the shards that own them; per
    table, how many had a row. Each applied request's receipt is kept.

    Raises:
        The errors of :func:`send` (a shard's part may be deleted while another's failed).
    """
    counts = dict.fromkeys(batch, 0)

    def keep(calls: list[Call], layouts: list[list[Part]], replies: list[Reply]) -> None:
        for (shard, _, _), reply in zip(calls, replies, strict=True):
            receipts.add(shard.name, reply.receipt.incarnation, reply.receipt.seq)
            for tc in reply.tables:
                counts[tc.table] += int(tc.rows)

    send(transport, {t: (k, None) for t, k in batch.items()}, dict.fromkeys(batch, 8), "Delete", idempotent=False,
         encode=lambda chunk: pb.DeleteRequest(tables=[pb.TableKeys(table=p.table, keys=codec.encode_tensor(p.keys))
                                                       for p in chunk]),
         stream=None, done=keep)
    return counts


def keyset_calls(transport: Transport, keysets: Mapping[str, Keyset | Any], method: str,
                 make: Callable[[list[pb.TableKeyset]], Message], every_shard: bool = True) -> list[Call]:
    """One call per shard carrying its part of each keyset.

    A shard's part that fits in one message goes in the unary ``method`` (empty tables
    included, so every shard sees every table); a larger one is cut into chunks of at most
    the message limit (16 bytes per key: the key and its count) and sent over
    ``method + "Stream"``, which the server merges into one request. ``every_shard=False``
    leaves out the shards that own no key.

    Raises:
        UnknownTableError, InvalidKeysError, CacheClosedError.
    """
    ks = as_keysets(keysets)
    transport.known(*ks)
    topo = transport.topology
    batch = {t: (k.keys.numpy(), k.counts.numpy()) for t, k in ks.items()}
    budget = wire.payload_budget(transport.max_message)
    calls: list[Call] = []
    for shard, parts in zip(topo.shards, parts_by_shard(batch, topo, every_table=True), strict=True):
        n = sum(p.keys.shape[0] for p in parts)
        if n == 0 and not every_shard:
            continue
        if n * _KEYSET_ROW_BYTES <= budget:
            calls.append((shard, method, make([_table_keyset(p) for p in parts])))
            continue
        cut = chunks([p for p in parts if p.keys.size], {t: _KEYSET_ROW_BYTES for t in ks}, transport.max_message)
        cut[0] += [p for p in parts if not p.keys.size]
        calls.append((shard, f"{method}Stream", [make([_table_keyset(p) for p in chunk]) for chunk in cut]))
    return calls


def _table_keyset(part: Part) -> pb.TableKeyset:
    assert part.values is not None  # a keyset's parts carry its counts
    return pb.TableKeyset(table=part.table, keys=codec.encode_tensor(part.keys),
                          counts=codec.encode_tensor(part.values))
