"""Change tracking for delta exports: a mark per written or deleted key, kept in the store.

Once a table has been exported (:mod:`embcache.engine.export`), every store write or delete of
its rows (all of them pass through :class:`~embcache.engine.rows.StoreRows`) first writes a
*mark* per key into the side table ``~changes/<table>`` of the same store: the key, with the
table's current export *epoch* (int64) as its value. Then the rows are written. A crash between
the two can only leave a mark without its write (the next delta exports that row again,
harmless), never a write without its mark, so no change is missed.

An export bumps the epoch (persisted) and takes every marked key; once its version is durable
it deletes the marks whose epoch is at most the one it covered. A key written again meanwhile
carries the newer epoch and keeps its mark for the next export.

The state (whether tracking is on, the epoch, and which version of which chain was last
exported) is one JSON blob of store metadata, :func:`export_meta`; so the marks and the state
travel with every copy of the store (checkpoints, restores into the other backend). Until a
table's first export nothing is marked: tracking costs nothing to users who never export.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from ..stores import Store

__all__ = ["MARK_BYTES", "Changes", "ExportState", "MarkedKeys", "export_meta", "marks_table"]

MARK_BYTES = 8  # one int64: the export epoch the key was written in
# Keys remembered as marked in the current epoch, at most (8 bytes each: 128 MiB per table);
# past it, writes mark every key again (correct, only slower).
MARKED_KEYS_MAX = 1 << 24


def marks_table(table: str) -> str:
    """Name of the store table that holds ``table``'s change marks."""
    return f"~changes/{table}"


def export_meta(table: str) -> str:
    """Metadata name of ``table``'s export state (:class:`ExportState` as JSON)."""
    return f"export/{table}"


class MarkedKeys:
    """The keys marked in the current epoch, kept in memory so that a row written back again and
    again (a hot row, evicted and reloaded) is marked once per epoch, not at every write.

    Sorted runs of geometrically growing sizes (a small log-structured set): a lookup is a
    binary search per run, an insert merges runs of similar size, all vectorized.
    """

    def __init__(self, limit: int = MARKED_KEYS_MAX) -> None:
        self.limit = limit
        self.runs: list[np.ndarray] = []
        self.size = 0

    def clear(self) -> None:
        """Forget every key (a new epoch begins: every key must be marked with it)."""
        self.runs, self.size = [], 0

    def missing(self, keys: np.ndarray) -> np.ndarray:
        """Bool [n]: which of ``keys`` are not known as marked."""
        found = np.zeros(keys.shape[0], dtype=bool)
        for run in self.runs:
            at = np.searchsorted(run, keys)
            found |= run[np.minimum(at, run.shape[0] - 1)] == keys
        return ~found

    def add(self, keys: np.ndarray) -> None:
        """Remember ``keys`` as marked (nothing once the limit is reached)."""
        if self.size + keys.shape[0] > self.limit or keys.shape[0] == 0:
            return
        run = np.unique(keys)
        while self.runs and self.runs[-1].shape[0] <= 2 * run.shape[0]:
            run = np.union1d(self.runs.pop(), run)
        self.runs.append(run)
        self.size = sum(r.shape[0] for r in self.runs)


@dataclass
class ExportState:
    """One table's export state, persisted as store metadata."""

    epoch: int = 1  # marks written now carry this epoch
    chain: str = ""  # the chain of versions the table was last exported into ("" before the first commit)
    version: int = 0  # the version of that chain the last committed export wrote


class Changes:
    """One table's change marks and export state (callers hold the table's lock, except where said)."""

    def __init__(self, store: Store, table: str) -> None:
        self.store = store
        self.table = table
        self.marks = marks_table(table)
        raw = store.get_meta(export_meta(table))
        self.state: ExportState | None = ExportState(**json.loads(raw)) if raw else None
        self.marked = MarkedKeys()  # keys whose mark already carries the current epoch
        if self.state is not None:
            store.open_table(self.marks, MARK_BYTES)

    @property
    def tracking(self) -> bool:
        """Whether writes are marked (the table was exported at least once)."""
        return self.state is not None

    def mark(self, keys: np.ndarray) -> None:
        """Mark ``keys`` as changed in the current epoch (before their rows are written or deleted)."""
        if self.state is None or len(keys) == 0:
            return
        keys = np.asarray(keys, dtype=np.int64)
        keys = keys[self.marked.missing(keys)]
        if keys.shape[0] == 0:
            return
        epochs = np.full(keys.shape[0], self.state.epoch, dtype=np.int64)
        self.store.put_many(self.marks, keys, epochs.view(np.uint8).reshape(-1, MARK_BYTES))
        self.marked.add(keys)  # after the write: a failed one is marked again next time

    def _save(self, state: ExportState) -> None:
        self.store.put_meta(export_meta(self.table), json.dumps(asdict(state)).encode())
        self.state = state

    def bump(self) -> int:
        """Start tracking if it is off, and move to a new epoch; returns the epoch now closed (every
        mark written so far carries at most that epoch)."""
        if self.state is None:
            self.store.open_table(self.marks, MARK_BYTES)
            state = ExportState()
        else:
            state = ExportState(**asdict(self.state))
        closed = state.epoch
        state.epoch += 1
        self._save(state)
        self.marked.clear()  # from now on a write must mark its keys with the new epoch
        return closed

    def exported(self, chain: str, version: int) -> None:
        """Record that version ``version`` of ``chain`` now holds this table's changes."""
        assert self.state is not None
        self._save(ExportState(self.state.epoch, chain, version))

    def follows(self, chain: str, version: int) -> bool:
        """Whether the last committed export of this table was version ``version`` of ``chain``
        (so a delta on top of it misses nothing)."""
        s = self.state
        return s is not None and bool(chain) and s.chain == chain and s.version == version

    def scan(self, batch_rows: int) -> Iterator[np.ndarray]:
        """Every marked key (int64 batches, ascending); without the lock: a key marked for the
        whole scan is returned, keys marked meanwhile may or may not be (they keep a newer epoch)."""
        if self.state is None:
            return
        for keys, _ in self.store.scan(self.marks, batch_rows):
            yield keys

    def clear(self, keys: np.ndarray, upto: int) -> int:
        """Delete the marks of ``keys`` whose epoch is at most ``upto``; how many (under the lock,
        so no write re-marks a key between the read and the delete)."""
        if self.state is None or len(keys) == 0:
            return 0
        found, records = self.store.get_many(self.marks, np.asarray(keys, dtype=np.int64))
        epochs = np.ascontiguousarray(records).view(np.int64).reshape(-1)
        drop = np.asarray(found, dtype=bool) & (epochs <= upto)
        if drop.any():
            self.store.delete_many(self.marks, np.asarray(keys, dtype=np.int64)[drop])
        return int(drop.sum())
