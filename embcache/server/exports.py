"""The server's half of a fleet-wide delta export: pending exports by id, streamed in messages.

``ExportDelta`` runs :meth:`EmbeddingCache.begin_export` (dirty rows written back, the change
epoch closed) and streams the rows; the client writes the fleet's version and calls
``CommitExport`` with the id, which drops the change marks that version covered. A few exports
may be pending at once (a client that died between the two calls leaves one behind: its marks
stay, so the next export streams those rows again); the oldest are forgotten first.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator

import torch

from ..cache import EmbeddingCache
from ..engine.export import PendingExport, batches
from ..errors import ConfigError
from ..rpc import codec, wire
from ..rpc.v1 import embcache_pb2 as pb

__all__ = ["Exports"]

_PENDING_MAX = 8  # exports kept between ExportDelta and CommitExport


class Exports:
    """Pending exports of one server, by id."""

    def __init__(self, cache: EmbeddingCache, max_send_bytes: int) -> None:
        self._cache = cache
        self._budget = wire.payload_budget(max_send_bytes or (64 << 20))
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, PendingExport] = OrderedDict()

    def stream(self, request: pb.ExportDeltaRequest) -> Iterator[pb.ExportDeltaResponse]:
        """Begin an export and stream it: a header, then each table's rows below the send limit."""
        pending = self._cache.begin_export(request.chain, int(request.base_version),
                                           tables=list(request.tables) or None, full=request.full)
        export_id = uuid.uuid4().hex
        with self._lock:
            self._pending[export_id] = pending
            while len(self._pending) > _PENDING_MAX:
                self._pending.popitem(last=False)
        yield pb.ExportDeltaResponse(export_id=export_id, full=pending.full, steps=pending.steps)
        for name in sorted(pending.engines):
            cfg = self._cache.tables()[name]
            row = cfg.dim * cfg.torch_dtype.itemsize + (4 * pending.engines[name].state_width
                                                        if request.with_state else 0) + 8
            rows = max(1, self._budget // (2 * row))  # half the budget: deleted keys share the message
            if request.batch_rows > 0:
                rows = min(rows, int(request.batch_rows))
            for keys, weights, state, deleted in batches(pending.engines[name], pending.prepared[name],
                                                         request.with_state, rows):
                if len(keys) == 0 and len(deleted) == 0:
                    continue
                yield pb.ExportDeltaResponse(
                    table=name, keys=codec.encode_tensor(keys),
                    weights=weights.contiguous().view(torch.uint8).numpy().tobytes(),
                    state=b"" if state is None else state.tobytes(), deleted=codec.encode_tensor(deleted))

    def commit(self, request: pb.CommitExportRequest) -> int:
        """Drop the change marks the export covered (its version is durable); how many.

        Raises:
            ConfigError: no export of that id is pending here (committed already, forgotten, or
                this process restarted since: its marks stay, the next export streams them again).
        """
        with self._lock:
            pending = self._pending.pop(request.export_id, None)
        if pending is None:
            raise ConfigError(f"CommitExport: no export {request.export_id!r} is pending on this server (committed "
                              "already, or the server restarted); its changes stay marked for the next export")
        return pending.commit(request.chain, int(request.version))
