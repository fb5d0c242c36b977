"""Trace and capacity checks and the hit ratio, shared by every simulator of :mod:`embcache.sim`."""

from __future__ import annotations

import numpy as np


def _check_trace(trace: np.ndarray) -> np.ndarray:
    """``trace`` as an array, after checking that it is a 1-D integer array (else ValueError)."""
    keys = np.asarray(trace)
    if keys.ndim != 1 or not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"trace must be a 1-D integer array, got {keys.dtype} of shape {keys.shape}")
    return keys


def _dense(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate ``trace``; return its keys as dense ids ``0 .. n_ids-1`` and the sorted keys."""
    uniq, inverse = np.unique(_check_trace(trace), return_inverse=True)
    return inverse.reshape(-1).astype(np.int64, copy=False), uniq


def _check_capacity(capacity: int) -> int:
    cap = int(capacity)
    if cap != capacity or cap < 0:
        raise ValueError(f"capacity must be a non-negative integer, got {capacity!r}")
    return cap


def _ratio(hits: int, trace: np.ndarray) -> float:
    n = int(np.asarray(trace).size)
    return hits / n if n else 0.0
