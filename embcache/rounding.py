"""Updated weights into their storage dtype: round to nearest, or stochastic rounding.

A table stored in ``float16`` or ``bfloat16`` keeps its rows' weights in that dtype; the optimizer
computes in float32 and the result is rounded back on every update. Round-to-nearest (torch's
cast) is biased for training: an update smaller than half the gap between two representable
neighbours is lost every time, so small learning rates stall on low-precision rows. With
``TableConfig.stochastic_rounding`` the cache rounds up with probability
``(x - lo) / (hi - lo)`` (``lo``, ``hi`` the representable neighbours of ``x``), whose expected
value is ``x``: the rounding is unbiased, as FBGEMM does for its low-precision embedding tables.

The random number of each value is a counter-based hash (splitmix64's finalizer,
:func:`embcache._bits.mix64`) of the table's seed, the row's key, the update step (the table's
count of updates) and the column, so that a run is repeatable, a row's rounding does not depend
on its tier or on the batch around it, and torch's global generator (the user's) is not drawn
from. It is one set of torch operations on any device; the fused CPU kernel of
:mod:`embcache.fused` only updates float32 tiers, so every cast of updated weights to a
low-precision dtype goes through :func:`to_storage`.
"""

from __future__ import annotations

import torch

from ._bits import mix64

__all__ = ["stochastic_round", "to_storage", "uniforms"]

# odd 64-bit constants that separate the hash's inputs (the golden ratio's, and splitmix64's M1)
_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as int64
_STEP = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9 as int64
_TWO_M53 = 2.0 ** -53


def _wrap64(v: int) -> int:
    """``v`` modulo 2**64 as the int64 with those bits."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def uniforms(seed: int, keys: torch.Tensor, step: int, dim: int) -> torch.Tensor:
    """float64 [n, dim] in [0, 1): the random number of each (key, column) at ``step``.

    Args:
        seed: the table's seed (int64).
        keys: int64 [n], the rows' keys.
        step: the update step (>= 0).
        dim: columns.
    """
    row = mix64(keys ^ _wrap64(seed * _GOLDEN + 1))
    row = mix64(row + _wrap64(step * _STEP))
    cols = torch.arange(dim, dtype=torch.int64, device=keys.device).mul_(_GOLDEN)
    bits = mix64(row.unsqueeze(1) + cols.unsqueeze(0))
    # the top 53 bits as a double in [0, 1) (>> is arithmetic on int64: mask the sign's copies)
    return ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64).mul_(_TWO_M53)


def stochastic_round(values: torch.Tensor, dtype: torch.dtype, u: torch.Tensor) -> torch.Tensor:
    """``values`` (float32) rounded to ``dtype`` (float16 or bfloat16), up with probability
    ``(x - lo) / (hi - lo)`` given uniform ``u`` (float64, same shape) in [0, 1).

    Values that ``dtype`` represents exactly are kept; values whose nearest is not finite (beyond
    the dtype's range) round as torch's cast does (to inf); NaN stays NaN.
    """
    nearest = values.to(dtype)
    near32 = nearest.to(torch.float32)
    inf = torch.tensor(float("inf"), dtype=dtype, device=values.device)
    # the neighbour on the other side of x: nearest is one of lo, hi
    other = torch.nextafter(nearest, torch.where(values > near32, inf, -inf))
    other32 = other.to(torch.float32)
    lo = torch.minimum(near32, other32).double()
    hi = torch.maximum(near32, other32).double()
    p_up = (values.double() - lo) / (hi - lo)
    chosen = torch.where(u < p_up, hi, lo).to(dtype)  # lo and hi are representable: exact casts
    keep = (values == near32) | ~torch.isfinite(near32)
    return torch.where(keep, nearest, chosen)


def to_storage(values: torch.Tensor, dtype: torch.dtype, stochastic: bool, seed: int, keys: torch.Tensor,
               step: int) -> torch.Tensor:
    """Updated weights ``values`` (float32 [n, dim]) in the storage ``dtype``.

    Args:
        values: the rows' new weights.
        dtype: the table's storage dtype.
        stochastic: stochastic rounding (``TableConfig.stochastic_rounding``); ignored for float32.
        seed: the table's seed.
        keys: int64 [n], the rows' keys (any device; moved to ``values``'s).
        step: the table's update step.
    """
    if dtype == torch.float32 or not stochastic or values.numel() == 0:
        return values.to(dtype)
    u = uniforms(seed, keys.to(values.device), step, values.shape[1])
    return stochastic_round(values.to(torch.float32), dtype, u)
