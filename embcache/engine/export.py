"""Delta and full exports of a cache's tables into the open export format (:mod:`embcache.export.format`).

An export runs in three steps per table, so that a version is written outside the table locks
and a crash at any point loses no change (see :mod:`.changes` for the marks):

1. :func:`prepare` (under the table's lock): write the dirty resident rows back (they stay
   resident, now clean), then close the current epoch (:meth:`Changes.bump`; the first export
   turns change tracking on). Every change made so far is now in the store, marked with at
   most the closed epoch.
2. :func:`collect` (without the lock; the caller has flushed the store): a full export scans the
   table; a delta reads the marked keys' rows: a key the store holds is a changed row, one it
   lacks a deleted key. Writes made meanwhile are marked with the new epoch and come again in
   the next export (a row exported twice, never one missed).
3. :func:`commit` (once the version is durable; the lock per chunk): drop the marks of the
   closed epoch or older, and record which version of which chain the table was exported into.

:func:`export_tables` runs the three for an in-process cache; the parameter server runs 1-2 for
the ``ExportDelta`` call and 3 for ``CommitExport``, with the client writing the version between.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..config import TableConfig
from ..export.format import TablePart, latest_version, write_version
from ..optim import initial_state, state_width
from ..stores import Store
from .rows import RecordCodec
from .table import STAGE_CHUNK, TableEngine

__all__ = ["ExportResult", "PartBuilder", "Prepared", "collect", "commit", "export_tables", "import_records",
           "new_chain", "plan_kind", "prepare"]


@dataclass
class Prepared:
    """One table's export between :func:`prepare` and :func:`commit`."""

    table: str
    full: bool
    epoch: int  # the closed epoch: the marks this export covers carry at most this
    step: int  # the table's clock (key occurrences looked up) when it was prepared


@dataclass
class ExportResult:
    """What an export wrote."""

    version: int
    kind: str  # "full" or "delta"
    path: str
    rows: int  # changed (delta) or all (full) rows written, over all tables
    deleted: int  # deleted keys listed, over all tables
    tables: dict[str, dict[str, int]] = field(default_factory=dict)  # table -> {"rows", "deleted"}
    seconds: float = 0.0


def new_chain() -> str:
    """A fresh chain id: a full version starts a chain, deltas continue their base's."""
    return uuid.uuid4().hex


def plan_kind(directory: str, engines: Sequence[TableEngine], force_full: bool = False
              ) -> tuple[bool, str, int]:
    """Whether the next export into ``directory`` can be a delta, the chain it continues, and the
    number of the version it follows (0: none).

    A delta needs every table's last committed export to be the directory's newest complete
    version (same chain, same number); otherwise (first export, another directory, a version
    lost, a table added) the export is full.
    """
    latest = latest_version(directory)
    if latest is None:
        return False, "", 0
    chain = str(latest.covers.get("chain", ""))
    delta = not force_full and all(t.rows.changes.follows(chain, latest.version) for t in engines)
    return delta, chain, latest.version


def prepare(t: TableEngine, full: bool) -> Prepared:
    """Step 1 (the caller holds ``t.lock``): write dirty rows back and close the epoch."""
    t.write_dirty()
    epoch = t.rows.changes.bump()
    return Prepared(t.cfg.name, full, epoch, int(t.clock.now))


class PartBuilder:
    """One table's rows of a version, gathered batch by batch from store records."""

    def __init__(self, codec: RecordCodec, with_state: bool) -> None:
        self.codec = codec
        self.with_state = with_state
        self.keys: list[np.ndarray] = []
        self.weights: list[torch.Tensor] = []
        self.states: list[np.ndarray] = []
        self.deleted: list[np.ndarray] = []

    def add(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Rows of ``keys`` from their store records (decoded as one batch)."""
        weights, state = self.codec.decode(np.ascontiguousarray(records))
        self.keys.append(np.asarray(keys, dtype=np.int64))
        self.weights.append(weights)
        if self.with_state:
            self.states.append(state.numpy())

    def add_deleted(self, keys: np.ndarray) -> None:
        """Keys the version lists as deleted."""
        self.deleted.append(np.asarray(keys, dtype=np.int64))

    def part(self) -> TablePart:
        """The gathered rows as a :class:`TablePart`."""
        cfg, width = self.codec.cfg, self.codec.state_width
        empty = np.empty(0, dtype=np.int64)
        return TablePart(
            config=cfg.to_dict(),
            keys=np.concatenate(self.keys) if self.keys else empty,
            weights=torch.cat(self.weights) if self.weights else torch.empty(0, cfg.dim, dtype=cfg.torch_dtype),
            deleted=np.concatenate(self.deleted) if self.deleted else empty,
            state=(np.concatenate(self.states) if self.states else np.empty((0, width), dtype=np.float32))
            if self.with_state else None)


def collect(t: TableEngine, p: Prepared, with_state: bool, batch_rows: int = STAGE_CHUNK) -> TablePart:
    """Step 2 (without the lock): the table's rows of this export as a :class:`TablePart`."""
    rows = t.rows
    out = PartBuilder(t.codec, with_state)
    if p.full:
        for keys, records in rows.store.scan(rows.table, batch_rows):
            out.add(keys, records)
    else:
        for marked in rows.changes.scan(batch_rows):
            found, records = rows.store.get_many(rows.table, marked)
            found = np.asarray(found, dtype=bool)
            if found.any():
                out.add(marked[found], np.asarray(records)[found])
            out.add_deleted(marked[~found])
    return out.part()


def commit(t: TableEngine, p: Prepared, chain: str, version: int, batch_rows: int = STAGE_CHUNK) -> int:
    """Step 3 (the version is durable): drop the marks of the closed epoch or older (the lock
    taken per chunk) and record the version; returns how many marks were dropped."""
    changes = t.rows.changes
    dropped = 0
    for marked in changes.scan(batch_rows):
        with t.lock:
            if t.closed:
                return dropped
            dropped += changes.clear(marked, p.epoch)
    with t.lock:
        if not t.closed:
            changes.exported(chain, version)
    return dropped


def export_tables(engines: Mapping[str, TableEngine], store: Store, directory: str, *, with_state: bool,
                  force_full: bool = False) -> ExportResult:
    """Export ``engines`` into ``directory`` as its next version: a delta when it can be one
    (:func:`plan_kind`), else a full version. The caller serializes exports of one cache.

    Raises:
        ExportFormatError: the directory holds a version of another format.
        CacheClosedError, StoreError, OSError: nothing was committed; the marks stay, so the next
            export includes every change of this one.
    """
    t0 = time.perf_counter()
    names = sorted(engines)
    delta, chain, base = plan_kind(directory, [engines[n] for n in names], force_full)
    prepared: dict[str, Prepared] = {}
    for name in names:
        t = engines[name]
        with t.lock:
            t.check_open()
            prepared[name] = prepare(t, full=not delta)
    store.flush()  # what the version holds is durable in the store before the version is written
    parts = {name: collect(engines[name], prepared[name], with_state) for name in names}
    chain = chain if delta else new_chain()
    covers: dict[str, Any] = {"chain": chain, "steps": {n: p.step for n, p in prepared.items()},
                              "time": time.time()}
    v = write_version(directory, base + 1, "delta" if delta else "full", parts,
                      base_version=base if delta else None, covers=covers)
    for name in names:
        commit(engines[name], prepared[name], chain, v.version)
    per = {n: {"rows": int(p.keys.shape[0]), "deleted": int(p.deleted.shape[0])} for n, p in parts.items()}
    return ExportResult(v.version, v.kind, v.path, sum(x["rows"] for x in per.values()),
                        sum(x["deleted"] for x in per.values()), per, time.perf_counter() - t0)


def import_records(cfg: TableConfig, weights: np.ndarray, state: np.ndarray | None) -> np.ndarray:
    """Store records (uint8 [n, record_bytes]) of exported ``weights`` (storage dtype, or uint16
    bits for bfloat16) and ``state`` (float32 [n, S]; None or another width: the optimizer's
    initial state)."""
    n = weights.shape[0]
    width = state_width(cfg.optimizer, cfg.dim)
    if state is None or state.shape != (n, width):
        state = initial_state(cfg.optimizer, cfg.dim, n, torch.device("cpu"),
                              cfg.initial_accumulator_value).numpy()
    w = np.ascontiguousarray(weights).view(np.uint8).reshape(n, -1)
    s = np.ascontiguousarray(state, dtype=np.float32).view(np.uint8).reshape(n, -1)
    return np.concatenate([w, s], axis=1)
