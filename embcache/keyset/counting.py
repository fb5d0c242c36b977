"""Keysets computed from training data: counted from batches or data-set files, and passes cut by budget.

* :func:`keysets_from_batches` counts the keys of an iterable of batches (``{table: keys}``).
* :func:`keysets_from_file` counts the keys of ``.npy`` data-set files of integer ids
  ``[samples, columns]`` (memory-mapped, read in chunks), one table per column.
* :func:`split_passes` cuts such a data set into passes (:class:`PassSpan`, each with its
  keysets), by sample count and/or a budget on each pass's keyset; a chunk alone above the
  budget becomes a pass by itself with a :class:`KeysetBudgetWarning`.

Counting is vectorized: each chunk of keys is reduced with ``torch.unique`` and partial counts
are merged the same way, never per key in Python. Long extractions show a tqdm progress bar.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from ..errors import ConfigError, InvalidKeysError
from .keyset import EMPTY_KEYSET, Keyset, KeysetFileError, PathLike, host_keys, merge_all

__all__ = ["KeysetBudgetWarning", "PassSpan", "keysets_from_batches", "keysets_from_file", "split_passes"]

#: A batch of training data, whatever the data loader yields (``keys_of`` reads its keys).
Batch = TypeVar("Batch")


class KeysetBudgetWarning(UserWarning):
    """A single chunk of samples has a keyset above the pass budget; it became a pass on its own."""


class _Counter:
    """Per-table key counts of a stream of key chunks, reduced with ``torch.unique`` as it goes.

    Raw keys are buffered up to ``chunk_keys`` per table, then reduced to a partial keyset;
    partial keysets are merged once they hold more keys than the merged result, so the work is
    O(n log n) overall and memory stays about twice the final keyset plus one buffer.
    """

    def __init__(self, chunk_keys: int) -> None:
        self._chunk_keys = max(int(chunk_keys), 1)
        self._raw: dict[str, list[torch.Tensor]] = {}
        self._raw_n: dict[str, int] = {}
        self._parts: dict[str, list[Keyset]] = {}
        self._merged: dict[str, Keyset] = {}

    def add(self, table: str, keys: Any) -> None:
        k = host_keys(keys)
        self._raw.setdefault(table, [])
        self._raw_n.setdefault(table, 0)
        if k.numel() == 0:
            return
        self._raw[table].append(k)
        self._raw_n[table] += k.numel()
        if self._raw_n[table] >= self._chunk_keys:
            self._reduce(table)

    def _reduce(self, table: str) -> None:
        raw = self._raw.get(table, [])
        if raw:
            self._parts.setdefault(table, []).append(Keyset.from_keys(torch.cat(raw)))
            self._raw[table], self._raw_n[table] = [], 0
        parts = self._parts.get(table, [])
        merged = self._merged.get(table, EMPTY_KEYSET)
        if parts and sum(len(p) for p in parts) >= max(len(merged), self._chunk_keys):
            self._merged[table] = merge_all([merged, *parts])
            self._parts[table] = []

    def result(self) -> dict[str, Keyset]:
        out = {}
        for table in self._raw:
            self._reduce(table)
            out[table] = merge_all([self._merged.get(table, EMPTY_KEYSET), *self._parts.get(table, [])])
        return out


def _batch_keys(batch: Any) -> Mapping[str, Any]:
    if not isinstance(batch, Mapping):
        raise InvalidKeysError(f"a batch must be a mapping of table name to keys (or pass keys_of), "
                               f"got {type(batch).__name__}")
    return batch


def keysets_from_batches(batches: Iterable[Batch], keys_of: Callable[[Batch], Mapping[str, Any]] | None = None, *,
                         total: int | None = None, progress: bool = True, desc: str = "keyset",
                         chunk_keys: int = 1 << 22) -> dict[str, Keyset]:
    """The keyset per table of a stream of batches (unique keys with their access counts).

    Args:
        batches: any iterable of batches.
        keys_of: ``fn(batch) -> {table: keys}`` (keys: integer tensor or array of any shape, duplicates
            counted); default: each batch already is such a mapping.
        total: number of batches, for the progress bar (default ``len(batches)`` when it has one).
        progress: show a tqdm progress bar on stderr (default True; it also works when stderr is not a TTY).
        desc: label of the progress bar.
        chunk_keys: raw keys buffered per table before they are reduced (default 4M).

    Returns:
        ``{table: Keyset}`` for every table any batch named (empty keysets included).

    Raises:
        InvalidKeysError: a batch (or ``keys_of``'s result) is not a mapping, or its keys are not integers.
    """
    get = keys_of if keys_of is not None else _batch_keys
    counter = _Counter(chunk_keys)
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)  # type: ignore[arg-type]
    with tqdm(batches, total=total, desc=desc, unit="batch", disable=not progress, dynamic_ncols=True) as bar:
        for batch in bar:
            keys = get(batch)
            if not isinstance(keys, Mapping):
                raise InvalidKeysError(f"keys_of must return a mapping of table name to keys, "
                                       f"got {type(keys).__name__}")
            for table, k in keys.items():
                counter.add(table, k)
    return counter.result()


class _Rows:
    """Integer id arrays ``[samples, columns]`` of one or more ``.npy`` files, as one memory-mapped sequence."""

    def __init__(self, paths: PathLike | Sequence[PathLike]) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if len(paths) == 0:
            raise KeysetFileError("no data-set files given")
        self.arrays: list[np.ndarray] = []
        for p in paths:
            try:
                arr = np.load(p, mmap_mode="r", allow_pickle=False)
            except FileNotFoundError:
                raise KeysetFileError(f"data-set file {os.fspath(p)!r} does not exist") from None
            except (OSError, ValueError) as exc:
                raise KeysetFileError(f"data-set file {os.fspath(p)!r} is not a readable .npy array: {exc}") from None
            if not isinstance(arr, np.ndarray) or arr.ndim != 2 or arr.dtype.kind not in "iu":
                shape = getattr(arr, "shape", None)
                dtype = getattr(arr, "dtype", None)
                raise KeysetFileError(f"data-set file {os.fspath(p)!r} must hold integer ids [samples, columns], "
                                      f"got {dtype} {shape}")
            if self.arrays and arr.shape[1] != self.arrays[0].shape[1]:
                raise KeysetFileError(f"data-set file {os.fspath(p)!r} has {arr.shape[1]} columns, "
                                      f"the first file has {self.arrays[0].shape[1]}")
            self.arrays.append(arr)
        self.columns = int(self.arrays[0].shape[1])
        self.bounds = np.cumsum([0] + [a.shape[0] for a in self.arrays])
        self.samples = int(self.bounds[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Samples ``[start, stop)`` as one int64 array (copied out of the memory maps)."""
        parts = []
        first = int(np.searchsorted(self.bounds, start, side="right")) - 1
        for i in range(max(first, 0), len(self.arrays)):
            lo, hi = int(self.bounds[i]), int(self.bounds[i + 1])
            if lo >= stop:
                break
            a, b = max(start, lo) - lo, min(stop, hi) - lo
            if b > a:
                parts.append(np.array(self.arrays[i][a:b], dtype=np.int64))
        if not parts:
            return np.empty((0, self.columns), dtype=np.int64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _column_groups(tables: Sequence[str] | None, columns: int) -> dict[str, list[int]]:
    """``{table: [column indices]}`` from one table name per column (default ``c0 .. c{columns-1}``)."""
    names = [f"c{j}" for j in range(columns)] if tables is None else [str(t) for t in tables]
    if len(names) != columns:
        raise KeysetFileError(f"the data set has {columns} columns but {len(names)} table names were given")
    groups: dict[str, list[int]] = {}
    for j, name in enumerate(names):
        groups.setdefault(name, []).append(j)
    return groups


def _chunk_keysets(chunk: np.ndarray, groups: Mapping[str, list[int]]) -> dict[str, Keyset]:
    t = torch.from_numpy(chunk)
    out = {}
    for name, cols in groups.items():
        keys = t[:, cols[0]] if len(cols) == 1 else t[:, cols].reshape(-1)
        out[name] = Keyset.from_keys(keys)
    return out


def _check_range(start: int, stop: int | None, samples: int) -> tuple[int, int]:
    stop = samples if stop is None else stop
    if not 0 <= start <= stop <= samples:
        raise ConfigError(f"sample range [{start}, {stop}) is outside the data set's {samples} samples")
    return start, stop


def keysets_from_file(paths: PathLike | Sequence[PathLike], tables: Sequence[str] | None = None, *,
                      start: int = 0, stop: int | None = None, chunk_rows: int = 1 << 16, progress: bool = True,
                      desc: str = "keyset") -> dict[str, Keyset]:
    """The keyset per table of a data-set file (or of several, taken as one sequence of samples).

    Args:
        paths: ``.npy`` file(s) of integer ids ``[samples, columns]`` (memory-mapped, read in chunks).
        tables: table name of each column (columns may share a table); default ``c0 .. c{columns-1}``.
        start, stop: the range of samples to count (default all).
        chunk_rows: samples read and reduced at a time (default 65,536).
        progress: show a tqdm progress bar (default True).
        desc: label of the progress bar.

    Returns:
        ``{table: Keyset}``.

    Raises:
        KeysetFileError: a file is missing or not an integer ``[samples, columns]`` array, the files
            disagree on columns, or ``tables`` has the wrong length.
        ConfigError: the sample range is outside the data set, or ``chunk_rows`` < 1.
    """
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows={chunk_rows!r}: must be >= 1")
    rows = _Rows(paths)
    groups = _column_groups(tables, rows.columns)
    start, stop = _check_range(start, stop, rows.samples)
    counter = _Counter(1 << 22)
    for name in groups:
        counter.add(name, torch.empty(0, dtype=torch.int64))
    with tqdm(total=stop - start, desc=desc, unit="sample", unit_scale=True, disable=not progress,
              dynamic_ncols=True) as bar:
        for lo in range(start, stop, chunk_rows):
            hi = min(lo + chunk_rows, stop)
            t = torch.from_numpy(rows.read(lo, hi))
            for name, cols in groups.items():
                counter.add(name, t[:, cols])
            bar.update(hi - lo)
    return counter.result()


# ---------------------------------------------------------------------------------------- passes
@dataclass(frozen=True)
class PassSpan:
    """One pass of a data set cut by :func:`split_passes`.

    Args:
        index: position of the pass (0-based).
        start: first sample of the pass in the data set (files taken as one sequence).
        stop: one past its last sample.
        keysets: ``{table: Keyset}`` of the pass's samples.
        within_budget: False when the pass is a single chunk whose keyset alone exceeds the budget.
    """

    index: int
    start: int
    stop: int
    keysets: dict[str, Keyset]
    within_budget: bool = True

    @property
    def samples(self) -> int:
        """Samples in the pass."""
        return self.stop - self.start

    def rows(self) -> dict[str, int]:
        """Unique keys per table (the rows the pass needs in memory)."""
        return {name: len(ks) for name, ks in self.keysets.items()}


class _Budget:
    """Limits on a pass's keyset: rows per table and/or bytes (in total, or per table)."""

    def __init__(self, tables: Sequence[str], max_rows: int | Mapping[str, int] | None,
                 max_bytes: int | Mapping[str, int] | None, row_bytes: int | Mapping[str, int] | None) -> None:
        self.max_rows = _per_table("max_rows", max_rows, tables) if max_rows is not None else None
        self.total_bytes: int | None = None
        self.table_bytes: dict[str, int] | None = None
        self.row_bytes: dict[str, int] = {}
        if max_bytes is not None:
            if row_bytes is None:
                raise ConfigError("max_bytes needs row_bytes (the bytes one row of each table costs in memory)")
            self.row_bytes = _per_table("row_bytes", row_bytes, tables, minimum=1)
            if isinstance(max_bytes, Mapping):
                self.table_bytes = _per_table("max_bytes", max_bytes, tables)
            else:
                self.total_bytes = _check_int("max_bytes", max_bytes)

    @property
    def active(self) -> bool:
        return self.max_rows is not None or self.total_bytes is not None or self.table_bytes is not None

    def fits(self, sizes: Mapping[str, int]) -> bool:
        if self.max_rows is not None and any(sizes[t] > self.max_rows[t] for t in sizes):
            return False
        if self.table_bytes is not None and any(sizes[t] * self.row_bytes[t] > self.table_bytes[t] for t in sizes):
            return False
        return self.total_bytes is None or sum(sizes[t] * self.row_bytes[t] for t in sizes) <= self.total_bytes


def _check_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name}={value!r}: must be an int >= {minimum}")
    return int(value)


def _per_table(name: str, value: int | Mapping[str, int], tables: Sequence[str], minimum: int = 0) -> dict[str, int]:
    if isinstance(value, Mapping):
        missing = [t for t in tables if t not in value]
        if missing:
            raise ConfigError(f"{name} has no value for tables {missing}")
        return {t: _check_int(f"{name}[{t!r}]", value[t], minimum) for t in tables}
    v = _check_int(name, value, minimum)
    return dict.fromkeys(tables, v)


def split_passes(paths: PathLike | Sequence[PathLike], tables: Sequence[str] | None = None, *,
                 samples_per_pass: int | None = None, max_rows: int | Mapping[str, int] | None = None,
                 max_bytes: int | Mapping[str, int] | None = None, row_bytes: int | Mapping[str, int] | None = None,
                 chunk_rows: int = 1 << 16, progress: bool = True) -> list[PassSpan]:
    """Cut a data set into consecutive passes, each with its keysets, greedily in chunks of samples.

    A pass grows chunk by chunk and is cut before the chunk that would take it past a limit:
    ``samples_per_pass`` samples (chunks are aligned to it, so passes have exactly that many
    samples except the last), and/or a budget on its keyset so that it fits in HBM+DDR:
    ``max_rows`` unique keys per table, or ``max_bytes`` of memory given ``row_bytes`` per table
    (e.g. ``cache.row_bytes(table)``; an int ``max_bytes`` bounds the sum over tables, a mapping
    each table). A chunk is never split: when one chunk's keyset alone exceeds the budget it
    becomes a pass by itself, with ``within_budget=False``, and a :class:`KeysetBudgetWarning` is
    issued (use a smaller ``chunk_rows``).

    Args:
        paths: ``.npy`` file(s) of integer ids ``[samples, columns]`` (see :func:`keysets_from_file`).
        tables: table name of each column; default ``c0 .. c{columns-1}``.
        samples_per_pass: samples per pass (>= 1), or None.
        max_rows: unique keys per table (an int for every table, or ``{table: rows}``), or None.
        max_bytes: bytes of a pass's keyset, in total (int) or per table (mapping), or None.
        row_bytes: bytes one row of each table costs in memory (int or ``{table: bytes}``); needed with ``max_bytes``.
        chunk_rows: samples per chunk, the granularity of budget cuts (default 65,536).
        progress: show a tqdm progress bar (default True).

    Returns:
        The passes in data order (an empty data set gives none).

    Raises:
        ConfigError: no limit is given, a limit or ``chunk_rows`` is not a valid int, ``max_bytes``
            comes without ``row_bytes``, or a mapping misses a table.
        KeysetFileError: as :func:`keysets_from_file`.
    """
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows={chunk_rows!r}: must be >= 1")
    if samples_per_pass is not None:
        _check_int("samples_per_pass", samples_per_pass, 1)
    rows = _Rows(paths)
    groups = _column_groups(tables, rows.columns)
    names = list(groups)
    budget = _Budget(names, max_rows, max_bytes, row_bytes)
    if samples_per_pass is None and not budget.active:
        raise ConfigError("split_passes needs samples_per_pass, max_rows or max_bytes")

    passes: list[PassSpan] = []
    cur: dict[str, Keyset] = {}
    cur_start = pos = 0
    cur_ok = True

    def close(stop: int) -> None:
        nonlocal cur, cur_start, cur_ok
        if stop > cur_start:
            passes.append(PassSpan(len(passes), cur_start, stop, cur, cur_ok))
        cur, cur_start, cur_ok = {}, stop, True

    with tqdm(total=rows.samples, desc="passes", unit="sample", unit_scale=True, disable=not progress,
              dynamic_ncols=True) as bar:
        while pos < rows.samples:
            n = min(chunk_rows, rows.samples - pos)
            if samples_per_pass is not None:
                n = min(n, cur_start + samples_per_pass - pos)
            chunk = _chunk_keysets(rows.read(pos, pos + n), groups)
            merged = {t: cur[t].merge(chunk[t]) for t in names} if cur else chunk
            if budget.active and not budget.fits({t: len(merged[t]) for t in names}):
                if cur:  # cut before this chunk, then retry it as the start of the next pass
                    close(pos)
                    merged = chunk
                if not budget.fits({t: len(merged[t]) for t in names}):
                    cur_ok = False
                    warnings.warn(f"samples [{pos}, {pos + n}) alone exceed the pass budget; they form pass "
                                  f"{len(passes)} by themselves (use a smaller chunk_rows)",
                                  KeysetBudgetWarning, stacklevel=2)
            cur = merged
            pos += n
            bar.update(n)
            if not cur_ok or (samples_per_pass is not None and pos - cur_start >= samples_per_pass):
                close(pos)
        close(pos)
    return passes
