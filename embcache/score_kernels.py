"""Compiled CPU kernels of the policy's eviction score: a row's discounted frequency.

Every placement of a tiered lookup scores rows: the candidates for HBM and DDR, and a sample of
each tier's residents to find the rows they would displace (:meth:`embcache.tier.MemoryTier.lowest`
draws ``eviction_sample`` slots per victim wanted: ~15,000 a lookup of 8,192 keys with 1% / 10%
tiers of 766,000 rows). In torch a score is eight whole-array operations: two gathers from the
tier's strided records, a cast, a subtraction, a clamp, two products, then the ``exp`` and a
last product. The sampled rows lie at random in the tier, so the gathers wait for their cache
misses one at a time.

Here the gathers and the arithmetic before the ``exp`` are one pass, with the records of the rows
16 places on prefetched, so the misses overlap; the ``exp`` and the last product stay torch's, so
the scores are :func:`embcache.policy.discounted_scores`' bit for bit (``tests/test_score_kernels.py``).
Measured with ``bench/ab_kernels.py score`` (one process, lookups alternating between this and
the torch operations, ``bench/profile_tiered.py``'s trace over 766,000 ids, thread CPU time, two
runs): the scoring took 0.51-0.54 ms a lookup against 0.74-0.77 ms, and the median lookup was
0.12-0.32 ms less of 9.6-10.4 ms: a small gain, as the gathers' misses were most of the cost
either way.

Choosing the lowest ``k`` of the scores stays torch's ``topk``: a numpy partition was 3x faster
alone, on arrays in cache, and slower inside the lookup (0.7 against 0.47 ms), so it was dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._compiled import compile_once, prefetch

__all__ = ["available", "discounted", "discounted_at"]

_KERNELS: dict[str, Any] = {}
_AHEAD = 16  # rows whose records are prefetched ahead
_prefetch: Any = None  # LLVM's prefetch, bound by _build() (embcache._compiled.prefetch)


def _args_py(freq: Any, last: Any, now: Any, a: Any, f_out: Any, x_out: Any) -> None:  # pragma: no cover
    """``f_out``: ``freq`` in float64; ``x_out``: the exponent ``idle * freq * -a`` (compiled)."""
    for i in range(freq.shape[0]):
        f = np.float64(freq[i])
        idle = np.float64(now - last[i])
        f_out[i] = f
        x_out[i] = (idle if idle > 0.0 else 0.0) * f * -a


def _args_at_py(freq: Any, last: Any, slots: Any, now: Any, a: Any, f_out: Any,  # pragma: no cover - compiled
                x_out: Any) -> None:
    """:func:`_args_py` of the rows at ``slots``."""
    n = slots.shape[0]
    for i in range(min(_AHEAD, n)):
        _prefetch(freq, (slots[i],))
    for i in range(n):
        if i + _AHEAD < n:  # the rows lie at random in the tier: their misses overlap
            _prefetch(freq, (slots[i + _AHEAD],))
        s = slots[i]
        f = np.float64(freq[s])
        idle = np.float64(now - last[s])
        f_out[i] = f
        x_out[i] = (idle if idle > 0.0 else 0.0) * f * -a


def _build() -> dict[str, Any]:
    global _prefetch
    import numba

    _prefetch = prefetch(numba)
    kernels: dict[str, Any] = {"args": numba.njit(nogil=True, cache=True)(_args_py),
                               "args_at": numba.njit(nogil=True, cache=True)(_args_at_py)}
    # the signatures lookups use, compiled (or loaded) now: contiguous float32 and float64
    # frequencies, and a tier's strided columns (views of its records)
    last, f, x = np.zeros(3, np.int64), np.empty(3), np.empty(3)
    for freq in (np.ones(3, np.float32), np.ones(3, np.float64)):
        kernels["args"](freq, last, 5, 0.5, f, x)
    meta = np.zeros((3, 3), np.int64)
    kernels["args_at"](meta.view(np.float32)[:, 4], meta[:, 1], np.arange(3, dtype=np.int64), 5, 0.5, f, x)
    return kernels


def available() -> bool:
    """Whether the kernels can run (numba compiles or loads them, tried once; see
    :func:`embcache._compiled.compile_once`). Elsewhere the scores are torch operations."""
    return compile_once(_KERNELS, _build, "eviction scoring's")


def _finish(f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # torch's exp, as discounted_scores applies it, then freq times it: the same scores bit for bit
    return x.exp_().mul_(f)


def discounted(freq: np.ndarray, last: np.ndarray, now: int, a: float) -> torch.Tensor:
    """Scores (float64 [n]) of rows with aged frequencies ``freq`` (float32 or float64 [n]) and
    last ticks ``last`` (int64 [n]) at tick ``now``, idle discount rate ``a``."""
    n = freq.shape[0]
    f, x = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    _KERNELS["args"](np.ascontiguousarray(freq), np.ascontiguousarray(last), now, a, f.numpy(), x.numpy())
    return _finish(f, x)


def discounted_at(freq: np.ndarray, last: np.ndarray, slots: np.ndarray, now: int, a: float) -> torch.Tensor:
    """:func:`discounted` of the rows at ``slots`` (int64 [n]) of a tier's ``freq`` and ``last``
    columns (any stride: the tier's records), read where they lie."""
    n = slots.shape[0]
    f, x = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    _KERNELS["args_at"](freq, last, slots, now, a, f.numpy(), x.numpy())
    return _finish(f, x)
