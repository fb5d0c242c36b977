"""A fleet-wide delta export: every shard's changes merged into one version written here.

Two phases, so nothing is lost: (1) each shard begins an export (``ExportDelta``: its dirty rows
written back, its change epoch closed) and streams its changed rows and deleted keys; (2) the
client writes the merged version with :func:`~embcache.export.format.write_version`; (3) only
then is each shard told to commit (``CommitExport``: drop the marks the version covered). A
client that dies before (3) leaves the marks in place, so the next export includes them again.

Each shard decides whether it can send a delta on the directory's newest version; when the
shards disagree (a shard new to the fleet, one whose last commit was lost), every shard is asked
again for a full export. A row that moved between shards since the last export is a deleted key
on the shard it left and a changed row on the one that took it: a changed row wins over a
deleted key of another shard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import grpc
import numpy as np
import torch

from ..config import TableConfig
from ..engine.export import ExportResult, PartBuilder, result_of, write_parts
from ..errors import InvalidKeysError, InvalidRowsError
from ..export.format import TablePart, check_directory, latest_version
from ..optim import state_width
from ..rpc import codec, wire
from ..rpc.errors import error_from_rpc
from ..rpc.v1 import embcache_pb2 as pb
from .transport import ReplyStream, Shard, Transport

__all__ = ["export_fleet"]


def _open(transport: Transport, shards: Sequence[Shard], request: pb.ExportDeltaRequest, deadline: float
          ) -> tuple[list[ReplyStream], list[pb.ExportDeltaResponse]]:
    """Start the export on every shard; the streams and their first message (the header)."""
    streams = [transport.stream(s, "ExportDelta", request, deadline) for s in shards]
    headers = []
    for shard, stream in zip(shards, streams, strict=True):
        try:
            headers.append(next(stream))
        except grpc.RpcError as err:
            for other in streams:
                other.cancel()
            raise error_from_rpc(err, shard.address) from None
    return streams, headers


def _take(builders: dict[str, PartBuilder], configs: dict[str, TableConfig], msg: pb.ExportDeltaResponse,
          with_state: bool, address: str) -> None:
    cfg = configs.get(msg.table)
    if cfg is None:
        raise InvalidRowsError(f"ExportDelta from {address}: rows of table {msg.table!r}, which was not asked for")
    what = f"ExportDelta from {address}, table {msg.table!r}"
    keys = codec.decode_tensor(msg.keys, f"{what}: keys", InvalidKeysError, ("int64",), 1).astype(np.int64)
    deleted = codec.decode_tensor(msg.deleted, f"{what}: deleted keys", InvalidKeysError, ("int64",), 1,
                                  msg.HasField("deleted")).astype(np.int64)
    n = keys.shape[0]
    width = state_width(cfg.optimizer, cfg.dim)
    if len(msg.weights) != n * cfg.dim * cfg.torch_dtype.itemsize or (with_state and len(msg.state) != n * width * 4):
        raise InvalidRowsError(f"{what}: {len(msg.weights)} weight bytes and {len(msg.state)} state bytes "
                               f"for {n} rows of dim {cfg.dim}")
    weights = torch.from_numpy(np.frombuffer(msg.weights, dtype=np.uint8).copy()).view(cfg.torch_dtype)
    state = np.frombuffer(msg.state, dtype=np.float32).reshape(n, width) if with_state else None
    builders[msg.table].add(keys, weights.reshape(n, cfg.dim), state, deleted)


def _merged(part: TablePart) -> TablePart:
    """One table's rows of every shard: a key some shard changed is not deleted; a key two shards
    sent (a copy mid-migration, equal) is kept once."""
    keys, first = np.unique(part.keys, return_index=True)
    weights = part.weights[torch.from_numpy(first)] if isinstance(part.weights, torch.Tensor) else part.weights[first]
    deleted = np.setdiff1d(part.deleted, keys)
    return TablePart(part.config, keys, weights, deleted, None if part.state is None else part.state[first])


def export_fleet(transport: Transport, directory: str | os.PathLike[str], *, with_state: bool = False,
                 tables: Sequence[str] | None = None, full: bool = False) -> ExportResult:
    """Export every shard's changes as the next version under ``directory`` (see the module's docstring).

    Raises:
        ExportFormatError: ``directory`` is not a directory, or holds another format.
        UnknownTableError, UnavailableError, DeadlineExceededError, StoreError: no version was
            written, or (a commit failed) the version was written and that shard's changes stay
            marked for the next export.
    """
    t0 = time.perf_counter()
    path = check_directory(directory)
    configs = transport.known(*tables) if tables else transport.refresh_tables()
    latest = latest_version(path)
    chain = str(latest.covers.get("chain", "")) if latest is not None else ""
    base = latest.version if latest is not None else 0
    shards = transport.topology.shards
    row = max((c.dim * c.torch_dtype.itemsize + 4 * state_width(c.optimizer, c.dim) + 8 for c in configs.values()),
              default=1)
    per_message = max(1, wire.payload_budget(transport.max_message) // (2 * row))
    request = pb.ExportDeltaRequest(tables=sorted(configs), with_state=with_state, chain=chain, base_version=base,
                                    full=full, batch_rows=per_message)
    deadline = time.monotonic() + transport.long_timeout
    streams, headers = _open(transport, shards, request, deadline)
    if len({h.full for h in headers}) > 1:  # some shard cannot follow the base: all send everything
        for stream in streams:
            stream.cancel()
        request.full = True
        streams, headers = _open(transport, shards, request, deadline)
    is_full = headers[0].full
    builders = {name: PartBuilder(cfg, with_state) for name, cfg in configs.items()}
    for shard, stream in zip(shards, streams, strict=True):
        try:
            for msg in stream:
                _take(builders, configs, msg, with_state, shard.address)
        except grpc.RpcError as err:
            for other in streams:
                other.cancel()
            raise error_from_rpc(err, shard.address) from None
    parts = {name: _merged(b.part()) for name, b in builders.items()}
    steps = {name: sum(int(h.steps.get(name, 0)) for h in headers) for name in configs}
    v = write_parts(path, base, is_full, chain, parts,
                    {"steps": steps, "shards": {s.name: h.export_id for s, h in zip(shards, headers, strict=True)}})
    written_chain = str(v.covers["chain"])
    transport.fanout([(s, "CommitExport", pb.CommitExportRequest(export_id=h.export_id, chain=written_chain,
                                                                 version=v.version))
                      for s, h in zip(shards, headers, strict=True)], idempotent=False)
    return result_of(v, parts, time.perf_counter() - t0)
