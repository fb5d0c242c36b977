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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..config import TableConfig
from ..export.format import TablePart, Version, latest_version, write_version
from ..optim import initial_state, state_width
from ..stores import Store
from .rows import RecordCodec
from .table import STAGE_CHUNK, TableEngine

__all__ = ["Batch", "ExportResult", "PartBuilder", "PendingExport", "Prepared", "batches", "begin", "collect",
           "commit", "decode_batch", "export_tables", "import_records", "new_chain", "prepare", "result_of",
           "write_parts"]


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


def prepare(t: TableEngine, full: bool) -> Prepared:
    """Step 1 (the caller holds ``t.lock``): write dirty rows back and close the epoch."""
    t.write_dirty()
    epoch = t.rows.changes.bump()
    return Prepared(t.cfg.name, full, epoch, int(t.clock.now))


class PartBuilder:
    """One table's rows of a version, gathered batch by batch."""

    def __init__(self, cfg: TableConfig, with_state: bool) -> None:
        self.cfg = cfg
        self.with_state = with_state
        self.keys: list[np.ndarray] = []
        self.weights: list[torch.Tensor] = []
        self.states: list[np.ndarray] = []
        self.deleted: list[np.ndarray] = []

    def add(self, keys: np.ndarray, weights: torch.Tensor, state: np.ndarray | None, deleted: np.ndarray) -> None:
        """Rows of ``keys`` (weights in the storage dtype, float32 state when exported) and deleted keys."""
        self.keys.append(np.asarray(keys, dtype=np.int64))
        self.weights.append(weights)
        if self.with_state and state is not None:
            self.states.append(np.asarray(state, dtype=np.float32))
        self.deleted.append(np.asarray(deleted, dtype=np.int64))

    def part(self) -> TablePart:
        """The gathered rows as a :class:`TablePart`."""
        cfg = self.cfg
        empty = np.empty(0, dtype=np.int64)
        width = state_width(cfg.optimizer, cfg.dim)
        return TablePart(
            config=cfg.to_dict(),
            keys=np.concatenate(self.keys) if self.keys else empty,
            weights=torch.cat(self.weights) if self.weights else torch.empty(0, cfg.dim, dtype=cfg.torch_dtype),
            deleted=np.concatenate(self.deleted) if self.deleted else empty,
            state=(np.concatenate(self.states) if self.states else np.empty((0, width), dtype=np.float32))
            if self.with_state else None)


Batch = tuple[np.ndarray, torch.Tensor, "np.ndarray | None", np.ndarray]  # keys, weights, state, deleted


def decode_batch(codec: RecordCodec, keys: np.ndarray, records: np.ndarray, with_state: bool,
                 deleted: np.ndarray | None = None) -> Batch:
    """A batch of rows from their store records (state only ``with_state``)."""
    weights, state = codec.decode(np.ascontiguousarray(records))
    return (keys, weights, state.numpy() if with_state else None,
            np.empty(0, dtype=np.int64) if deleted is None else deleted)


def batches(t: TableEngine, p: Prepared, with_state: bool, batch_rows: int = STAGE_CHUNK) -> Iterator[Batch]:
    """Step 2 (without the lock): the table's rows of this export, in batches of at most
    ``batch_rows`` keys (changed rows and deleted keys together)."""
    rows = t.rows
    if p.full:
        for keys, records in rows.store.scan(rows.table, batch_rows):
            yield decode_batch(t.codec, keys, records, with_state)
        return
    for marked in rows.changes.scan(batch_rows):
        found, records = rows.store.get_many(rows.table, marked)
        found = np.asarray(found, dtype=bool)
        yield decode_batch(t.codec, marked[found], np.asarray(records)[found], with_state, marked[~found])


def collect(t: TableEngine, p: Prepared, with_state: bool, batch_rows: int = STAGE_CHUNK) -> TablePart:
    """Step 2 (without the lock): the table's rows of this export as a :class:`TablePart`."""
    out = PartBuilder(t.cfg, with_state)
    for batch in batches(t, p, with_state, batch_rows):
        out.add(*batch)
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


class PendingExport:
    """An export of some tables between :func:`begin` (step 1 done) and :meth:`commit`."""

    def __init__(self, engines: Mapping[str, TableEngine], prepared: Mapping[str, Prepared], full: bool) -> None:
        self.engines = dict(engines)
        self.prepared = dict(prepared)
        self.full = full

    @property
    def steps(self) -> dict[str, int]:
        """Each table's clock when it was prepared (what the version covers)."""
        return {n: p.step for n, p in self.prepared.items()}

    def batches(self, with_state: bool, batch_rows: int = STAGE_CHUNK) -> Iterator[tuple[str, Batch]]:
        """Step 2: ``(table, batch)`` for every table, in name order."""
        for name in sorted(self.engines):
            for batch in batches(self.engines[name], self.prepared[name], with_state, batch_rows):
                yield name, batch

    def parts(self, with_state: bool) -> dict[str, TablePart]:
        """Step 2, gathered: every table's :class:`TablePart`."""
        return {n: collect(self.engines[n], self.prepared[n], with_state) for n in sorted(self.engines)}

    def commit(self, chain: str, version: int) -> int:
        """Step 3: drop the covered marks of every table; how many."""
        return sum(commit(self.engines[n], self.prepared[n], chain, version) for n in sorted(self.engines))


def begin(engines: Mapping[str, TableEngine], store: Store, chain: str, base_version: int,
          force_full: bool = False) -> PendingExport:
    """Step 1 for every table: a delta when every table's last committed export was version
    ``base_version`` of ``chain`` (and ``force_full`` is off), else a full export; the store is
    flushed after, so what the version will hold is durable in the store first."""
    names = sorted(engines)
    full = force_full or not all(engines[n].rows.changes.follows(chain, base_version) for n in names)
    prepared: dict[str, Prepared] = {}
    for name in names:
        t = engines[name]
        with t.lock:
            t.check_open()
            prepared[name] = prepare(t, full)
    store.flush()
    return PendingExport(engines, prepared, full)


def export_tables(engines: Mapping[str, TableEngine], store: Store, directory: str, *, with_state: bool,
                  force_full: bool = False) -> ExportResult:
    """Export ``engines`` into ``directory`` as its next version: a delta when it can be one
    (every table's last export was the directory's newest version), else a full version. The
    caller serializes exports of one cache.

    Raises:
        ExportFormatError: the directory holds a version of another format.
        CacheClosedError, StoreError, OSError: nothing was committed; the marks stay, so the next
            export includes every change of this one.
    """
    t0 = time.perf_counter()
    latest = latest_version(directory)
    chain = str(latest.covers.get("chain", "")) if latest is not None else ""
    base = latest.version if latest is not None else 0
    pending = begin(engines, store, chain, base, force_full)
    parts = pending.parts(with_state)
    v = write_parts(directory, base, pending.full, chain, parts, {"steps": pending.steps})
    pending.commit(str(v.covers["chain"]), v.version)
    return result_of(v, parts, time.perf_counter() - t0)


def write_parts(directory: str, base: int, full: bool, chain: str, parts: Mapping[str, TablePart],
                covers: Mapping[str, Any]) -> Version:
    """Write ``parts`` as version ``base + 1``: a delta on ``base`` continuing ``chain``, or a full
    version starting a new chain."""
    chain = new_chain() if full else chain
    return write_version(directory, base + 1, "full" if full else "delta", parts,
                         base_version=None if full else base,
                         covers={"chain": chain, **covers, "time": time.time()})


def result_of(v: Version, parts: Mapping[str, TablePart], seconds: float) -> ExportResult:
    """The :class:`ExportResult` of a written version."""
    per = {n: {"rows": int(p.keys.shape[0]), "deleted": int(p.deleted.shape[0])} for n, p in parts.items()}
    return ExportResult(v.version, v.kind, v.path, sum(x["rows"] for x in per.values()),
                        sum(x["deleted"] for x in per.values()), per, seconds)


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
