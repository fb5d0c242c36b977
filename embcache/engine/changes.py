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

__all__ = ["MARK_BYTES", "Changes", "ExportState", "export_meta", "marks_table"]

MARK_BYTES = 8  # one int64: the export epoch the key was written in


def marks_table(table: str) -> str:
    """Name of the store table that holds ``table``'s change marks."""
    return f"~changes/{table}"


def export_meta(table: str) -> str:
    """Metadata name of ``table``'s export state (:class:`ExportState` as JSON)."""
    return f"export/{table}"


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
        epochs = np.full(keys.shape[0], self.state.epoch, dtype=np.int64)
        self.store.put_many(self.marks, keys, epochs.view(np.uint8).reshape(-1, MARK_BYTES))

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
