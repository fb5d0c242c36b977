"""Compiled CPU kernels of the frequency sketch (:class:`embcache.policy.FrequencySketch`).

A tiered lookup adds the accesses of the keys it stages from below memory to the sketch and reads
back their estimates, and raises the counters of the rows that leave memory. In torch that is a
dozen whole-array operations over ``[depth, n]`` cells (hash, gather, min, scatter-max, gather,
min); each key's ``depth`` counters lie at random in an array of up to 128 MiB, so each gather and
scatter waits for its cache misses one array at a time. Timed per 8,192-key lookup with 1% / 10%
tiers (``bench/profile_tiered.py``'s trace): 1.5 ms for the add and 0.6 ms for the raise, about a
sixth of the lookup, for ~1,300 staged keys.

Here each operation is one call: the cells of every key are hashed first, then each key's
counters are read with those of the key ``_AHEAD`` places on prefetched, so the misses overlap.
The arithmetic is the torch version's, bit for bit: the minimum of a key's float32 counters, plus
the float64 amount, rounded to float32 once; counters raised to the largest value any key of the
call gives them (a conservative update reads every counter before any is raised, as the torch
gather before the scatter does); estimates are the minimum after. ``tests/test_policy.py``
compares the two on the same calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._compiled import compile_once, prefetch

__all__ = ["add_and_estimate", "available", "estimate", "raise_to"]

_AHEAD = 8  # keys whose counters are prefetched ahead
_KERNELS: dict[str, Any] = {}


_prefetch: Any = None  # LLVM's prefetch, bound by _build() (embcache._compiled.prefetch)
_mix: Any = None  # the key index's compiled mix64 (index/numba_index.py), bound by _build()


def _cells_py(keys: Any, salts: Any, width: Any, cells: Any) -> None:  # pragma: no cover - compiled
    """``cells[i, r]``: the counter of ``keys[i]`` in row ``r`` (``embcache._bits.mix64`` of the key
    xor the row's salt, masked to the width, offset by the row)."""
    mask = np.uint64(width - 1)
    for i in range(keys.shape[0]):
        for r in range(salts.shape[0]):
            cells[i, r] = r * width + np.int64(_mix(keys[i] ^ salts[r]) & mask)


def _min_of_py(counts: Any, cells: Any, i: Any) -> Any:
    m = counts[cells[i, 0]]
    for r in range(1, cells.shape[1]):
        m = min(m, counts[cells[i, r]])  # no branch: the counters' order is random
    return m


def _prefetch_row_py(counts: Any, cells: Any, i: Any) -> None:
    for r in range(cells.shape[1]):
        _prefetch(counts, (cells[i, r],))


def _ahead_py(counts: Any, cells: Any, i: Any) -> None:
    """Before key ``i`` is read: prefetch the counters of key ``i + _AHEAD`` (of the first keys too, at 0)."""
    n = cells.shape[0]
    if i == 0:
        for j in range(min(_AHEAD, n)):
            _prefetch_row(counts, cells, j)
    if i + _AHEAD < n:
        _prefetch_row(counts, cells, i + _AHEAD)


def _estimate_py(counts: Any, keys: Any, salts: Any, width: Any, cells: Any,  # pragma: no cover - compiled
                 out: Any) -> None:
    """``out[i]``: the estimate of ``keys[i]`` (float64)."""
    _cells(keys, salts, width, cells)
    for i in range(keys.shape[0]):
        _ahead(counts, cells, i)
        out[i] = np.float64(_min_of(counts, cells, i))


def _add_py(counts: Any, keys: Any, amounts: Any, salts: Any, width: Any, cells: Any,  # pragma: no cover
            raised: Any, out: Any) -> None:
    """Conservative update of ``keys`` by ``amounts`` (float64), then their estimates into ``out``."""
    _cells(keys, salts, width, cells)
    for i in range(keys.shape[0]):  # every new value from the counters as they were
        _ahead(counts, cells, i)
        raised[i] = np.float32(np.float64(_min_of(counts, cells, i)) + amounts[i])
    _raise(counts, cells, raised)
    for i in range(keys.shape[0]):  # the counters are in cache now
        out[i] = np.float64(_min_of(counts, cells, i))


def _raise_py(counts: Any, cells: Any, values: Any) -> None:  # pragma: no cover - compiled
    """Every counter of key ``i`` at least ``values[i]`` (float32)."""
    for i in range(cells.shape[0]):
        _ahead(counts, cells, i)
        v = values[i]
        for r in range(cells.shape[1]):
            c = cells[i, r]
            counts[c] = max(counts[c], v)


def _raise_keys_py(counts: Any, keys: Any, salts: Any, width: Any, cells: Any,  # pragma: no cover - compiled
                   values: Any) -> None:
    _cells(keys, salts, width, cells)
    _raise(counts, cells, values)


_cells: Any = _cells_py
_min_of: Any = _min_of_py
_prefetch_row: Any = _prefetch_row_py
_raise: Any = _raise_py
_ahead: Any = _ahead_py


def _build() -> dict[str, Any]:
    global _prefetch, _mix, _cells, _min_of, _prefetch_row, _raise, _ahead
    import numba

    from .index.numba_index import _hash_py

    inline = numba.njit(cache=True, nogil=True, inline="always")
    _prefetch = prefetch(numba)
    _mix = inline(_hash_py)
    _cells = numba.njit(nogil=True, cache=True)(_cells_py)
    _min_of, _prefetch_row = inline(_min_of_py), inline(_prefetch_row_py)
    _ahead = inline(_ahead_py)
    _raise = numba.njit(nogil=True, cache=True)(_raise_py)
    return {"estimate": numba.njit(nogil=True, cache=True)(_estimate_py),
            "add": numba.njit(nogil=True, cache=True)(_add_py),
            "raise": numba.njit(nogil=True, cache=True)(_raise_keys_py)}


def _build_and_run() -> dict[str, Any]:
    kernels = _build()
    counts, keys, salts = np.zeros(8, np.float32), np.arange(3, dtype=np.int64), np.ones(2, np.int64)
    cells = _scratch(3, 2)
    kernels["add"](counts, keys, np.ones(3), salts, 4, cells, np.empty(3, np.float32), np.empty(3))
    kernels["estimate"](counts, keys, salts, 4, cells, np.empty(3))
    kernels["raise"](counts, keys, salts, 4, cells, np.ones(3, np.float32))
    return kernels


def available() -> bool:
    """Whether the kernels can run: numba imports and compiles them (or loads them from its disk
    cache), tried once, here rather than in the middle of a lookup. Where numba is missing, or
    fails to compile them (a warning says why), the sketch uses its torch operations."""
    return compile_once(_KERNELS, _build_and_run, "frequency sketch's")


def _scratch(n: int, depth: int) -> np.ndarray:
    return np.empty((n, depth), dtype=np.int64)


def estimate(counts: np.ndarray, keys: np.ndarray, salts: np.ndarray, width: int) -> np.ndarray:
    """Estimates (float64 [n]) of ``keys`` (int64 [n]) in the sketch ``counts`` (float32
    [depth * width]); ``salts`` (int64 [depth]) what each row's hash xors the key with."""
    out = np.empty(keys.shape[0], dtype=np.float64)
    _KERNELS["estimate"](counts, keys, salts, width, _scratch(keys.shape[0], salts.shape[0]), out)
    return out


def add_and_estimate(counts: np.ndarray, keys: np.ndarray, amounts: np.ndarray, salts: np.ndarray,
                     width: int) -> np.ndarray:
    """Add ``amounts`` (float64 [n]) to the estimates of ``keys`` (conservatively, in place in
    ``counts``); their new estimates (float64 [n])."""
    n = keys.shape[0]
    out = np.empty(n, dtype=np.float64)
    _KERNELS["add"](counts, keys, amounts, salts, width, _scratch(n, salts.shape[0]),
                    np.empty(n, dtype=np.float32), out)
    return out


def raise_to(counts: np.ndarray, keys: np.ndarray, values: np.ndarray, salts: np.ndarray, width: int) -> None:
    """Make every counter of ``keys`` at least ``values`` (float32 [n]), in place in ``counts``."""
    _KERNELS["raise"](counts, keys, salts, width, _scratch(keys.shape[0], salts.shape[0]), values)
